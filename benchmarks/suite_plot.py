"""One figure of the whole quality suite: RULER's score by length, one panel per task family, one line per method.

Each `emllm bench` run writes its own accuracy.png, but the suite is spread over a folder per length and method
group (suite_8k, suite_64k_lists_rag, ...); a reader comparing the default with RAG across lengths needs them on
one set of axes. The score (RULER's partial credit) is plotted rather than right/wrong because the list families
are 0 of 20 right for every method at this model size, while their scores still differ. Error bars are 95%
percentile-bootstrap intervals over the cell's questions.

    PYTHONPATH=. python benchmarks/suite_plot.py --out benchmarks/results/suite.png
"""

from __future__ import annotations

import argparse
import pathlib

import numpy as np

from emllm_integrations.bench.settings import RULER_TASKS
from emllm_integrations.bench.suite import bootstrap_interval, current_cells, load_cells
from suite_tables import CURRENT  # a sibling script: which folders hold today's EG and tuned RAG

RESULTS = pathlib.Path(__file__).parent / "results"
METHODS = ("EG", "E", "S", "SM", "S+C", "SM+C", "F", "full", "rag-minilm", "rag-mpnet", "rag-tuned")
STYLE = {"EG": ("C3", "o", 2.4), "E": ("C6", "o", 1.2), "rag-minilm": ("C0", "s", 2.0), "rag-mpnet": ("C9", "D", 1.2),
         "rag-tuned": ("C1", "P", 2.0),
         "S": ("C2", "^", 1.2), "SM": ("C4", "x", 0.8), "S+C": ("C5", "x", 0.8), "SM+C": ("C8", "x", 0.8),
         "F": ("C7", "v", 1.2), "full": ("k", "*", 1.2)}
"""The default (EG) and the RAGs stand out; E and the paper's other presets are thin."""


def plot(cells: dict[tuple[str, str, int], dict[str, float]], out: pathlib.Path, min_questions: int = 20) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = [t for t in RULER_TASKS if any(k[0] == t for k in cells)]
    lengths = sorted({k[2] for k in cells})
    columns = 3
    rows = -(-len(tasks) // columns)
    fig, axes = plt.subplots(rows, columns, figsize=(13, 3.3 * rows), squeeze=False, sharex=True)
    for ax, task in zip(axes.flat, tasks):
        for i, method in enumerate(METHODS):
            points = [(n, list(cells[(task, method, n)].values())) for n in lengths
                      if len(cells.get((task, method, n), [])) >= min_questions]
            if not points:
                continue
            colour, marker, width = STYLE[method]
            nudge = 2 ** (0.04 * (i - len(METHODS) / 2))  # methods often tie: each is shifted so none hides
            xs = [n * nudge for n, _ in points]
            ys = [float(np.mean(s)) for _, s in points]
            bounds = np.array([bootstrap_interval(s) for _, s in points])
            ax.errorbar(xs, ys, yerr=[np.array(ys) - bounds[:, 0], bounds[:, 1] - np.array(ys)], color=colour,
                        marker=marker, linewidth=width, markersize=4, capsize=2, label=method)
        ax.set_title(task.replace("_", " "))
        ax.set_ylim(-0.05, 1.05)
        ax.set_xscale("log", base=2)
        ax.set_xticks(lengths, [f"{n // 1024}K" for n in lengths])
        ax.grid(alpha=0.3)
    for ax in axes.flat[len(tasks):]:
        ax.axis("off")
    for ax in axes[:, 0]:
        ax.set_ylabel("RULER score")
    handles: dict = {}
    for ax in axes.flat:
        for h, label in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(label, h)
    fig.legend(list(handles.values()), list(handles), loc="lower center", ncol=len(handles), fontsize=9)
    fig.suptitle("The quality suite: score by length (20 questions per point, 95% bootstrap bars)")
    fig.tight_layout(rect=(0, 0.04, 1, 0.97))
    fig.savefig(out, dpi=100)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--folders", nargs="*", type=pathlib.Path,
                        help="bench output folders (default: every run of today's presets, as suite_tables.py)")
    parser.add_argument("--out", type=pathlib.Path, default=RESULTS / "suite.png")
    args = parser.parse_args()
    plot(load_cells(args.folders) if args.folders else current_cells(RESULTS, CURRENT), args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
