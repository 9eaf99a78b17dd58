"""`emllm bench` end to end on the real model (SmolLM2-135M-Instruct, named with --model) at a tiny size: the CLI
entry runs passkey and kv with EM-LLM (S) and the RAG baseline (MiniLM), each (method, length) cell in its own
process, and writes complete rows, the markdown and the figures. About a minute of CPU; the accuracy itself is not
asserted (1K tokens says little about it)."""

from __future__ import annotations

import json

import pytest

from emllm.batching import StepBatcher
from emllm_integrations.bench import ROW_FIELDS, run_bench
from emllm_integrations.cli import main

from .conftest import SMOL

PNG = b"\x89PNG\r\n\x1a\n"
LENGTH = 1024
# A window far smaller than the document, so the document really goes through the episodic memory.
LAYOUT = ["--n-local", "256", "--n-mem", "256", "--chunk-size", "256"]


@pytest.mark.timeout(600)
def test_cli_bench_writes_complete_rows_table_and_figures(tmp_path, capsys):
    out = tmp_path / "bench"
    code = main(["bench", "--tasks", "passkey", "kv", "--methods", "S", "rag-minilm", "--lengths", str(LENGTH),
                 "--depths", "0.5", *LAYOUT, "--model", SMOL, "--threads", "1", "--out", str(out)])
    printed = capsys.readouterr()
    assert code == 0, printed.err[-2000:]

    rows = json.loads((out / "bench.json").read_text())
    assert sorted((r["method"], r["task"]) for r in rows) == [("S", "kv"), ("S", "passkey"), ("rag-minilm", "kv"),
                                                              ("rag-minilm", "passkey")]
    for row in rows:
        assert set(row) == set(ROW_FIELDS)
        assert row["error"] is None, row["error"]
        assert isinstance(row["correct"], bool)
        assert row["correct"] == (row["expected"] in row["output"])
        assert row["length"] == LENGTH and row["tokens"] >= LENGTH and row["depth"] == 0.5
        assert row["expected"] and row["question"]
        assert row["prefill_seconds"] > 0 and row["query_seconds"] > 0 and row["decode_ms_per_token"] > 0
        assert row["output_tokens"] >= 1
        assert 100 < row["peak_rss_mb"] < 16_000
    for row in rows:
        if row["method"] == "S":
            # The document was read once as the prefill; the query read only the question's tokens.
            assert row["tokens_read"] < 100
            assert 8 <= row["mean_event_size"] <= 128  # events formed (min/max block size bound them)
        else:
            assert row["mean_event_size"] is None
            assert row["tokens_read"] > 100  # RAG's LLM reads the retrieved chunks with the question
    # The same documents for both methods: same seed, same expected answers.
    expected = {(r["task"], r["method"]): r["expected"] for r in rows}
    assert expected[("passkey", "S")] == expected[("passkey", "rag-minilm")]
    assert expected[("kv", "S")] == expected[("kv", "rag-minilm")]

    table = (out / "bench.md").read_text()
    for task in ("passkey", "kv"):
        for method in ("S", "rag-minilm"):
            assert f"| {task} | {method} | {LENGTH:,} |" in table
    assert "Accuracy by task, method and length" in printed.out
    for name in ("accuracy", "prefill_seconds", "query_seconds", "decode_ms_per_token", "peak_rss_mb",
                 "mean_event_size"):
        assert (out / f"{name}.png").read_bytes()[:8] == PNG, name


@pytest.mark.timeout(600)
def test_questions_asked_at_once_get_the_answers_asked_one_at_a_time(monkeypatch):
    """--concurrent answers a document's questions in threads whose decoding steps share forwards, for EM-LLM and
    for RAG: the rows must be those of one question at a time, in the same order."""
    batchers = []
    original_init = StepBatcher.__init__

    def record(self, *args, **kwargs):  # the real batcher, remembered so the test can see its forwards
        original_init(self, *args, **kwargs)
        batchers.append(self)

    monkeypatch.setattr(StepBatcher, "__init__", record)
    common = dict(model=SMOL, engine_fields={"n_local": 256, "n_mem": 256, "chunk_size": 256}, isolate=False,
                  progress=False, threads=1, questions=4, max_new_tokens=12)  # equal rows, not right ones, are asked
    alone = run_bench(["niah_multikey"], ["S", "rag-minilm"], [LENGTH], **common)
    shared = len(batchers)
    together = run_bench(["niah_multikey"], ["S", "rag-minilm"], [LENGTH], concurrent=4, **common)
    assert len(together) == 8 and all(row["error"] is None for row in together)
    assert [(r["method"], r["question"], r["output"], r["correct"]) for r in together] == \
        [(r["method"], r["question"], r["output"], r["correct"]) for r in alone]
    assert all(max(b.batch_sizes, default=1) == 1 for b in batchers[:shared])  # one question at a time
    assert len(batchers) - shared == 2
    # The padding probe is timed once per engine (emllm.batching.padding_is_cheap): under load the two engines here
    # may decide differently, and one that decodes a row per forward cannot share one.
    sharing = [b for b in batchers[shared:] if b.max_rows > 1]
    if not sharing:
        pytest.skip("this CPU's matmul kernels give no batch-invariant row count, or padding to it costs several "
                    "one-row forwards (emllm.batching.padding_is_cheap), so each question decoded in its own forward "
                    "(the answers above still had to match)")
    assert all(max(b.batch_sizes) > 1 for b in sharing)  # shared forwards


@pytest.mark.timeout(300)
def test_a_cell_whose_process_fails_gives_error_rows_not_a_crash(tmp_path):
    rows = run_bench(["passkey"], ["S"], [LENGTH], [0.2, 0.8], model=str(tmp_path / "no-such-model"),
                     progress=False)
    assert len(rows) == 2
    for row in rows:
        assert row["correct"] is False and row["output"] == ""
        assert "exited with code" in row["error"] and "no-such-model" in row["error"]


def typed(monkeypatch, lines: list) -> None:
    """What ``input()`` returns, one item per call, for ``emllm chat``; an exception in ``lines`` is raised there."""
    answers = iter(lines)

    def read_line(prompt=""):
        item = next(answers)
        if isinstance(item, BaseException):
            raise item
        return item

    monkeypatch.setattr("builtins.input", read_line)


def test_cli_chat_rereads_and_answers_follow_ups_from_the_document(tmp_path, monkeypatch, capsys):
    """``emllm chat --reread``: each answer is written from the retrieved passages re-read as text, and the next
    question still continues the memory that read the document (no re-reading, no mismatch)."""
    document = tmp_path / "doc.txt"
    document.write_text("The lighthouse keeper painted the door blue in 1911. " * 60)
    typed(monkeypatch, ["What colour is the door?", "In which year?", EOFError()])
    code = main(["chat", "--file", str(document), "--model", SMOL, "--max-new-tokens", "6", "--reread", *LAYOUT])
    printed = capsys.readouterr()
    assert code == 0, printed.err[-2000:]
    assert "Traceback" not in printed.err and "Ask again" not in printed.err
    assert len([line for line in printed.out.splitlines() if line.strip()]) == 2  # both questions answered


def test_cli_chat_survives_questions_it_cannot_read(tmp_path, monkeypatch, capsys):
    """A question holding a control character the tokenizer refuses, or bytes that are not UTF-8, is answered with
    one line and the session goes on with the document already read; the next question is answered."""
    document = tmp_path / "doc.txt"
    document.write_text("The lighthouse keeper painted the door blue in 1911. " * 40)
    not_utf8 = UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte")
    typed(monkeypatch, ["What colour is the door?\x04", not_utf8, "What colour is the door?", EOFError()])
    code = main(["chat", "--file", str(document), "--model", SMOL, "--max-new-tokens", "6", *LAYOUT])
    printed = capsys.readouterr()
    assert code == 0, printed.err[-2000:]
    assert "Traceback" not in printed.err
    assert "not UTF-8" in printed.err and printed.err.count("Ask again") == 1
    assert printed.out.strip()  # the good question was answered
