"""The quality suite read across runs: the arithmetic behind benchmarks/RESULTS.md's suite figure
(benchmarks/suite_plot.py) and its goals (benchmarks/suite_compare.py).

The suite is spread over a folder per length and method group (suite_8k, suite_64k_lists_rag, ...), each written by
`emllm bench --out`. This module gathers their rows into one cell per (task, method, length), and compares two
methods on the same questions. It lives here rather than in the scripts so that the scripts and the unit tests
import it as a module of the package, neither through the other's folder."""

from __future__ import annotations

import json
import pathlib
from collections import defaultdict

import numpy as np

from emllm.config import ConfigError, EMConfig

from .settings import LIST_ANSWER_TOKENS, RULER_TASKS, SETTINGS_FILE

LIST_TASKS = ("niah_multivalue", "niah_multiquery", "variable_tracking", "common_words", "frequent_words")
"""The families whose answer is a list: runs before the bench gave lists RULER's token budget cut them short."""


def load_cells(folders: list[pathlib.Path]) -> dict[tuple[str, str, int], dict[str, float]]:
    """(task, method, length) -> {question: its score}; a question already seen in an earlier folder is not
    counted twice (some families were measured in two runs). List answers from runs before the bench gave lists
    RULER's token budget (no ``list_answer_tokens`` in their settings) were cut short: they are left out."""
    missing = [str(f) for f in folders if not (f / "bench.json").is_file() or not (f / SETTINGS_FILE).is_file()]
    if missing:
        raise FileNotFoundError(f"No bench.json or {SETTINGS_FILE} in {missing}: pass folders written by "
                                "`emllm bench --out`.")
    cells: dict[tuple[str, str, int], dict[str, float]] = defaultdict(dict)
    seen: set[tuple[str, str, int, str]] = set()
    for folder in folders:
        settings = json.loads((folder / SETTINGS_FILE).read_text())
        lists_cut_short = settings.get("list_answer_tokens") != LIST_ANSWER_TOKENS
        for row in json.loads((folder / "bench.json").read_text()):
            key = (row["task"], row["method"], row["length"], row["question"])
            if key in seen or row["task"] not in RULER_TASKS or (lists_cut_short and row["task"] in LIST_TASKS):
                continue
            seen.add(key)
            score = row.get("score")
            cells[key[:3]][row["question"]] = float(bool(row["correct"])) if score is None else float(score)
    return cells


def default_runs(root: pathlib.Path) -> list[pathlib.Path]:
    """The bench folders under `root` that measured what ships: the test split (seed 0), the default model, and no
    engine field that changes a preset run there. A development run (seed 1), a larger reader or an option such as
    ``full_until`` answers other questions or another way, and would blur the shipped presets' cells."""
    return [settings_file.parent for settings_file in sorted(root.rglob(SETTINGS_FILE))
            if _runs_as_shipped(settings_file.parent, json.loads(settings_file.read_text()))]


def _runs_as_shipped(folder: pathlib.Path, settings: dict) -> bool:
    if settings.get("seed") != 0 or settings.get("model") is not None:
        return False
    fields = settings.get("engine_fields", {})
    for method in {row["method"] for row in json.loads((folder / "bench.json").read_text())}:
        try:
            preset = EMConfig.from_preset(method)
        except ConfigError:
            continue  # full attention or a RAG: engine fields do not apply to it
        if any(getattr(preset, name, None) != value for name, value in fields.items()):
            return False
    return True


def current_cells(root: pathlib.Path,
                  current: dict[str, tuple[str, ...]]) -> dict[tuple[str, str, int], dict[str, float]]:
    """The cells of `default_runs`, a method named in `current` taken only from folders whose top-level name under
    `root` starts with one of its prefixes: a preset whose definition changed keeps only runs of its current form."""
    folders = default_runs(root)
    cells = {k: v for k, v in load_cells(folders).items() if k[1] not in current}
    for method, prefixes in current.items():
        made_since = [f for f in folders if f.relative_to(root).parts[0].startswith(prefixes)]
        cells.update({k: v for k, v in load_cells(made_since).items() if k[1] == method})
    return cells


def bootstrap_interval(scores: list[float], draws: int = 2000, seed: int = 0) -> tuple[float, float]:
    """95% percentile interval of the mean: resampling the questions, as a reader re-asking other ones would."""
    values = np.asarray(scores)
    means = np.random.default_rng(seed).choice(values, size=(draws, len(values))).mean(axis=1)
    return float(np.percentile(means, 2.5)), float(np.percentile(means, 97.5))


def paired_difference(first: dict[str, float], second: dict[str, float]) -> tuple[float, float, float, int]:
    """Mean of first - second over the questions both answered, in points, with its 95% bootstrap interval."""
    shared = sorted(set(first) & set(second))
    if not shared:
        raise ValueError("The two cells share no question: they were asked of different documents.")
    gaps = [first[q] - second[q] for q in shared]
    low, high = bootstrap_interval(gaps, draws=5000)
    return 100 * float(np.mean(gaps)), 100 * low, 100 * high, len(shared)
