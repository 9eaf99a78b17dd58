"""Where a read's time goes, per method, from py-spy samples: to explain why one preset reads slower than another.

    py-spy record --pid <pid of a process inside EMEngine.read> --rate 20 --nonblocking --duration 90 \\
        --format raw -o s_plus_c_read_early.txt
    python benchmarks/read_profile.py --method S+C benchmarks/results/read_profile_128k/s_plus_c_read_*.txt \\
        --method F benchmarks/results/read_profile_128k/f_read_*.txt

Each sample is put in one part of the forward pass (first matching rule below). Shares of one profile are not
comparable across methods, because a slower method spends a smaller share on the work both do; so each part is
given in units of the MLP's samples, which is the same work per chunk for every method of one model. A part's
difference between two methods is then its share of their time gap: S+C's total in MLP units over F's is its
read time over F's. Samples outside EMEngine.read (loading, answering) are left out. Prints a markdown table.
"""

from __future__ import annotations

import argparse
import re
from collections import Counter
from pathlib import Path

from emllm_integrations.markdown import table as markdown_table

# (part, pattern on the whole ';'-joined stack): the first match wins, so specific parts come first. The line
# numbers are the three attend calls (named _attend before it was public) of emllm/attention.py's episodic_attention
# as of the recorded profiles (commit 856d017 onwards): a profile of code where they moved needs these updated.
PARTS = [
    ("retrieval (rank, gather)", r"LayerMemory\.retrieve"),
    ("eviction, segmentation", r"EpisodicMemory\.(evict|observe)"),
    ("score accumulation", r"_accumulate_scores"),
    ("attention: chunk (causal)", r"episodic_attention \(emllm/attention\.py:59\);_?attend"),
    ("attention: older window", r"episodic_attention \(emllm/attention\.py:62\);_?attend"),
    ("attention: memory part", r"episodic_attention \(emllm/attention\.py:78\);_?attend"),
    ("rotary positions", r"window_keys|RotaryTable"),
    ("merging attention parts", r"_merge|merge_parts"),
    ("rest of episodic_attention", r"episodic_attention"),
    ("LM head", r"ForCausalLM\.forward \([^)]*\);Module\._wrapped_call_impl \([^)]*\);Module\._call_impl \([^)]*\);"
                r"Linear"),
    ("MLP", r"MLP\.forward"),
    ("q/k/v/o projections", r"Attention\.forward \([^)]*\);Module\._wrapped_call_impl[^;]*;Module\._call_impl[^;]*;"
                            r"Linear"),
    ("norms", r"RMSNorm"),
]
UNIT = "MLP"


def part_samples(path: Path) -> Counter:
    """Samples per part in one py-spy raw file (lines of 'frame;frame;... count'), reading only."""
    parts: Counter = Counter()
    for number, line in enumerate(path.read_text().splitlines(), 1):
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():  # an empty stack (a sample with no Python frame) is fine: it is not reading
            raise ValueError(f"{path}:{number} is not a py-spy raw line ('frames count'): record with --format raw")
        if "EMEngine.read" in stack:
            parts[next((name for name, pattern in PARTS if re.search(pattern, stack)), "other")] += int(count)
    if not parts[UNIT]:
        raise ValueError(f"{path} has no {UNIT} samples inside EMEngine.read: was the process reading?")
    return parts


def in_mlp_units(paths: list[Path]) -> dict[str, float]:
    """Each part's samples over the MLP's, averaged over the profiles (windows) of one method."""
    units: Counter = Counter()
    for path in paths:
        parts = part_samples(path)
        for name, samples in parts.items():
            units[name] += samples / parts[UNIT] / len(paths)
    return dict(units)


def report(methods: dict[str, dict[str, float]]) -> str:
    """One column per method; with two methods, a third with their difference (the gap, part by part)."""
    names = list(methods)
    parts = [part for part in [name for name, _ in PARTS] + ["other"] if any(methods[m].get(part) for m in names)]
    cells = {part: [methods[m].get(part, 0.0) for m in names] for part in parts}
    cells["**total**"] = [sum(methods[m].values()) for m in names]
    header = ["part (time in MLP units)", *names]
    rows = [[part, *(f"{v:.2f}" for v in values)] for part, values in cells.items()]
    if len(names) == 2:
        header.append(f"{names[0]} - {names[1]}")
        for row, (a, b) in zip(rows, cells.values()):
            row.append(f"{a - b:+.2f}")
        rows[-1][-1] += f" ({cells['**total**'][0] / cells['**total**'][1]:.2f}x)"
    return markdown_table(header, "l" + "r" * (len(header) - 1), rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--method", nargs="+", action="append", required=True, metavar=("NAME", "FILE"),
                        help="a method's name and its py-spy raw files (windows of one read); repeat per method")
    args = parser.parse_args()
    for spec in args.method:
        if len(spec) < 2:
            parser.error(f"--method {spec[0]} names no profile: give --method NAME FILE [FILE ...]")
    print(report({name: in_mlp_units([Path(f) for f in files]) for name, *files in args.method}))


if __name__ == "__main__":
    main()
