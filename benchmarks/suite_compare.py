"""The quality goals' arithmetic: one method minus another on the same questions, per family and length.

Two cells of 20 questions whose Wilson intervals overlap can still differ reliably when both methods answered the
same questions; pairing by question removes the documents' own difficulty from the comparison. Differences are
in points of RULER's score (right/wrong for one-answer families), with a 95% percentile-bootstrap interval over
the questions. `--tolerance 5` reads "the default >= full attention - 5 points".

    PYTHONPATH=. python benchmarks/suite_compare.py E rag-minilm
    PYTHONPATH=. python benchmarks/suite_compare.py E full --tolerance 5
"""

from __future__ import annotations

import argparse
import pathlib

from emllm_integrations.bench.settings import RULER_TASKS
from emllm_integrations.bench.suite import current_cells, load_cells, paired_difference
from suite_tables import CURRENT  # a sibling script: which folders hold today's EG and tuned RAG

RESULTS = pathlib.Path(__file__).parent / "results"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("method", help="the method the goal is about (EG, the default)")
    parser.add_argument("other", help="the method it is held against (rag-minilm, full, F, ...)")
    parser.add_argument("--tolerance", type=float, default=0.0, help="points the method may trail by and still meet")
    parser.add_argument("--folders", nargs="*", type=pathlib.Path,
                        help="bench output folders (default: every run of today's presets, as suite_tables.py)")
    args = parser.parse_args()
    cells = load_cells(args.folders) if args.folders else current_cells(RESULTS, CURRENT)
    met = measured = 0
    for length in sorted({k[2] for k in cells}):
        for task in RULER_TASKS:
            first, second = cells.get((task, args.method, length)), cells.get((task, args.other, length))
            if not first or not second:
                continue
            mean, low, high, asked = paired_difference(first, second)
            verdict = "met" if mean >= -args.tolerance else ("within the noise" if high >= -args.tolerance else "not met")
            met, measured = met + (verdict == "met"), measured + 1
            print(f"{length // 1024:>4}K {task:18} {args.method} - {args.other}: {mean:+6.1f} [{low:+.0f}, {high:+.0f}]"
                  f" of {asked}  {verdict}")
    print(f"met on {met} of {measured} cells")


if __name__ == "__main__":
    main()
