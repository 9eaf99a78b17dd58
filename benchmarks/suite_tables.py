"""The quality suite as one markdown table per length: every method a row, every family a column.

The suite's answers are spread over a results folder per run (a length, a method group, a later rerun), and the
presets changed along the way (EG's three contiguity neighbours, the tuned RAG's 128-word chunks); a reader choosing
between the default and the RAG they would build needs each length's cells side by side, from the runs that match
what ships today. This script gathers them from the folders that do (bench.suite.default_runs: the test split, the
default model, no engine override), EG and the tuned RAG only from runs made since each took its current form
(`CURRENT`). A cell is "right of asked" (lists and variable tracking: RULER's partial score too, in parentheses);
the 95% Wilson interval of every count is in the legend, so each cell need not repeat it.

    PYTHONPATH=. python benchmarks/suite_tables.py > /tmp/tables.md
"""

from __future__ import annotations

import argparse
import pathlib

from emllm_integrations.bench.report import wilson_interval
from emllm_integrations.bench.settings import RULER_TASKS
from emllm_integrations.bench.suite import LIST_TASKS, current_cells

RESULTS = pathlib.Path(__file__).parent / "results"
METHODS = {"EG": "EG (default)", "E": "E", "S": "S (paper)", "F": "F (InfLLM)", "full": "full attention",
           "rag-minilm": "RAG paper", "rag-tuned": "RAG tuned"}
"""Rows, in order: the default and its unfiltered form, the paper's presets, full attention, both RAGs."""
CURRENT = {"EG": ("eg_neighbours_test", "full_until_8k_eg", "handwritten", "multihop_64k"),
           "rag-tuned": ("suite_tuned128", "handwritten", "multihop_64k")}
"""For the methods whose definition changed, the folders (by name prefix) made since it took its current form: EG
with three neighbours a side (older EG rows, suite_within, are a preset that no longer ships) and the tuned RAG with
128-word chunks (suite_multihop's tuned rows used 32)."""
SHORT = {"niah_single": "single", "niah_noise": "noise", "niah_multikey": "multi-key", "niah_multivalue": "multi-value",
         "niah_multiquery": "multi-query", "variable_tracking": "var. tracking", "common_words": "common words",
         "frequent_words": "frequent words", "fact_qa": "fact QA", "two_hop": "two-hop", "three_hop": "three-hop",
         "chronicle": "chronicle", "handwritten": "by hand"}


def table(cells: dict[tuple[str, str, int], dict[str, float]], length: int) -> str:
    """One length: a row per method that has a cell there, a column per family that any method has."""
    tasks = [t for t in RULER_TASKS if any((t, m, length) in cells for m in METHODS)]
    lines = ["| method | " + " | ".join(SHORT[t] for t in tasks) + " |", "|---|" + "---:|" * len(tasks)]
    for method, label in METHODS.items():
        row = []
        for task in tasks:
            scores = cells.get((task, method, length), {})
            if len(scores) < 20:
                row.append("–")
                continue
            right = sum(s == 1.0 for s in scores.values())
            row.append(f"{right} ({sum(scores.values()) / len(scores):.2f})" if task in LIST_TASKS else str(right))
        if any(c != "–" for c in row):
            lines.append(f"| {label} | " + " | ".join(row) + " |")
    return "\n".join(lines)


def legend(asked: int) -> str:
    """The 95% Wilson interval of every count of `asked`, in %, so a table's bare counts can be read as estimates."""
    return ", ".join(f"{k} [{round(100 * lo)}–{round(100 * hi)}]" for k in range(asked + 1)
                     for lo, hi in [wilson_interval(k, asked)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", type=pathlib.Path, default=RESULTS, help="where the bench folders are")
    args = parser.parse_args()
    cells = current_cells(args.root, CURRENT)
    for length in sorted({k[2] for k in cells}):
        print(f"**{length // 1024}K**\n\n{table(cells, length)}\n")
    print(f"Of 20, 95% Wilson interval in %: {legend(20)}.\n\nOf 24: {legend(24)}.")


if __name__ == "__main__":
    main()
