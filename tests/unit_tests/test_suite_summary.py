"""emllm_integrations.bench.suite: the arithmetic behind RESULTS.md's suite figure (benchmarks/suite_plot.py) and
goals (benchmarks/suite_compare.py)."""

import json
import pathlib

import pytest

from emllm_integrations.bench import suite
from emllm_integrations.bench.settings import LIST_ANSWER_TOKENS, SETTINGS_FILE


def _folder(root: pathlib.Path, name: str, rows: list[dict], list_answer_tokens: int | None) -> pathlib.Path:
    folder = root / name
    folder.mkdir()
    settings = {"questions": 20} | ({"list_answer_tokens": list_answer_tokens} if list_answer_tokens else {})
    (folder / SETTINGS_FILE).write_text(json.dumps(settings))
    (folder / "bench.json").write_text(json.dumps(rows))
    return folder


def _row(task: str, method: str, question: str, correct: bool, score: float | None = None) -> dict:
    return {"task": task, "method": method, "length": 8192, "question": question, "correct": correct,
            "score": score}


def test_list_answers_cut_short_are_left_out_and_no_question_counts_twice(tmp_path):
    old = _folder(tmp_path, "suite_a", [_row("variable_tracking", "E", "q1", False, 0.2),
                                         _row("niah_single", "E", "q2", True, 1.0)], list_answer_tokens=None)
    new = _folder(tmp_path, "suite_b", [_row("variable_tracking", "E", "q1", True, 1.0),
                                         _row("niah_single", "E", "q2", False, 0.0)], LIST_ANSWER_TOKENS)
    cells = suite.load_cells([old, new])
    assert cells[("variable_tracking", "E", 8192)] == {"q1": 1.0}  # the old run's list answer was cut short
    assert cells[("niah_single", "E", 8192)] == {"q2": 1.0}  # the first folder's answer to q2 stands


def test_a_row_without_score_counts_as_right_or_wrong(tmp_path):
    folder = _folder(tmp_path, "suite_a", [_row("fact_qa", "S", "q", True)], LIST_ANSWER_TOKENS)
    assert suite.load_cells([folder])[("fact_qa", "S", 8192)] == {"q": 1.0}


def test_a_folder_without_bench_files_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="emllm bench --out"):
        suite.load_cells([tmp_path])


def test_paired_difference_pairs_by_question():
    first = {f"q{i}": 1.0 for i in range(20)}
    second = {f"q{i}": float(i < 5) for i in range(20)} | {"only in second": 0.0}
    mean, low, high, asked = suite.paired_difference(first, second)
    assert asked == 20
    assert mean == pytest.approx(75.0)
    assert low < 75.0 < high <= 100.0


def test_paired_difference_of_equal_cells_is_exactly_zero():
    cell = {f"q{i}": float(i % 2) for i in range(20)}
    assert suite.paired_difference(cell, dict(cell))[:3] == (0.0, 0.0, 0.0)


def test_cells_of_different_documents_are_refused():
    with pytest.raises(ValueError, match="share no question"):
        suite.paired_difference({"a": 1.0}, {"b": 0.0})


def _run(root: pathlib.Path, name: str, rows: list[dict], **settings) -> pathlib.Path:
    folder = root / name
    folder.mkdir(parents=True)
    (folder / SETTINGS_FILE).write_text(json.dumps({"seed": 0, "model": None, "engine_fields": {},
                                                    "list_answer_tokens": LIST_ANSWER_TOKENS} | settings))
    (folder / "bench.json").write_text(json.dumps(rows))
    return folder


def test_only_runs_of_what_ships_are_gathered(tmp_path):
    shipped = _run(tmp_path, "suite_8k", [_row("fact_qa", "E", "q", True)])
    as_preset = _run(tmp_path, "eg_test", [_row("fact_qa", "EG", "q", True)],
                     engine_fields={"contiguity_neighbours": 3})  # EG's own value: still EG as shipped
    _run(tmp_path, "dev", [_row("fact_qa", "E", "q", True)], seed=1)
    _run(tmp_path, "larger_reader", [_row("fact_qa", "E", "q", True)], model="qwen-1.5b")
    _run(tmp_path, "option", [_row("fact_qa", "EG", "q", True)], engine_fields={"full_until": 16384})
    _run(tmp_path, "e_with_neighbours", [_row("fact_qa", "E", "q", True)], engine_fields={"contiguity_neighbours": 3})
    rag_only = _run(tmp_path, "rag", [_row("fact_qa", "rag-tuned", "q", True)], engine_fields={"n_local": 512})
    assert sorted(suite.default_runs(tmp_path)) == sorted([shipped, as_preset, rag_only])


def test_a_changed_preset_keeps_only_its_current_runs(tmp_path):
    _run(tmp_path, "suite_within", [_row("fact_qa", "EG", "q1", False), _row("fact_qa", "E", "q1", True)])
    _run(tmp_path, "eg_neighbours_test", [_row("fact_qa", "EG", "q2", True)])
    cells = suite.current_cells(tmp_path, {"EG": ("eg_neighbours",)})
    assert cells[("fact_qa", "EG", 8192)] == {"q2": 1.0}  # the older EG's answer to q1 is left out
    assert cells[("fact_qa", "E", 8192)] == {"q1": 1.0}  # other methods come from every shipped run
