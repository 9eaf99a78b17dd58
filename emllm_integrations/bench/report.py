"""The bench's report: bench.json (the rows), bench.md (accuracy at a glance, the summary per task x method x
length, every question) and PNG figures."""

from __future__ import annotations

import json
import math
import os
import pathlib
from collections.abc import Iterable, Sequence
from typing import Any

from ..markdown import table as markdown_table
from .settings import ROW_FIELDS, SETTINGS_FILE


def write_report(rows: Sequence[dict[str, Any]], out_dir: str | os.PathLike,
                 settings: dict[str, Any] | None = None) -> dict[str, pathlib.Path]:
    """Write bench.json (the rows), bench.md (an accuracy summary per task x method x length, then every row) and
    PNG figures into ``out_dir``; returns {name: path}. Figures: accuracy by length per method (one panel per
    task), a depth x length accuracy heatmap per method for the needle task, and prefill time, time per query,
    decode ms/token, peak RSS and mean event size by length per method (those with no values are not drawn)."""
    rows = [dict(r) for r in rows]
    if not rows:
        raise ValueError("There are no rows to report: run_bench returned nothing (every cell skipped?).")
    for i, row in enumerate(rows):
        absent = [k for k in ROW_FIELDS if k not in row]
        if absent:
            raise ValueError(f"Row {i} lacks {absent}: pass the rows run_bench returned.")
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "bench.json", "markdown": out / "bench.md"}
    if settings is not None:  # what a later `--resume` into this folder must match
        paths["settings"] = out / SETTINGS_FILE
        _write_atomically(paths["settings"], json.dumps(settings, indent=1) + "\n")
    _write_atomically(paths["json"], json.dumps(rows, indent=1) + "\n")
    _write_atomically(paths["markdown"], markdown(rows) + "\n")
    paths.update(_plots(rows, out))
    return paths


def _write_atomically(path: pathlib.Path, text: str) -> None:
    """The report is rewritten after every cell: a run stopped mid-write must leave the previous file whole."""
    partial = path.with_name(path.name + ".partial")
    partial.write_text(text, encoding="utf-8")
    os.replace(partial, path)


def summary(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Accuracy and mean measurements per (task, method, length), in the order the rows came."""
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault((row["task"], row["method"], row["length"]), []).append(row)
    out = []
    for (task, method, length), group in groups.items():
        correct = sum(bool(r["correct"]) for r in group)
        low, high = wilson_interval(correct, len(group))
        entry = {"task": task, "method": method, "length": length, "questions": len(group),
                 "accuracy": correct / len(group), "accuracy_low": low, "accuracy_high": high,
                 "score": _mean(r.get("score", float(bool(r["correct"]))) for r in group),
                 "errors": sum(bool(r["error"]) for r in group)}
        for key in ("tokens", "prefill_seconds", "query_seconds", "decode_ms_per_token", "peak_rss_mb",
                    "mean_event_size"):
            entry[key] = _mean(r[key] for r in group)
        out.append(entry)
    return out


def wilson_interval(correct: int, asked: int, z: float = 1.96) -> tuple[float, float]:
    """The 95% Wilson score interval of a proportion: unlike the normal approximation it stays inside [0, 1] and is
    honest at 0/20 or 20/20, where a cell of few questions says least."""
    if asked <= 0:
        return 0.0, 1.0
    p = correct / asked
    centre = (p + z * z / (2 * asked)) / (1 + z * z / asked)
    half = z * math.sqrt(p * (1 - p) / asked + z * z / (4 * asked * asked)) / (1 + z * z / asked)
    return max(0.0, centre - half), min(1.0, centre + half)


def accuracy_grid(rows: Sequence[dict[str, Any]]) -> str:
    """Accuracy at a glance: one line per method, one column per (task, length), as "correct/asked [95% interval in
    %]"; a cell with failed questions is marked "!" (see the rows' ``error``)."""
    tasks = list(dict.fromkeys(r["task"] for r in rows))
    columns = sorted({(r["task"], r["length"]) for r in rows}, key=lambda c: (tasks.index(c[0]), c[1]))
    cells: dict[tuple[str, str, int], list[dict[str, Any]]] = {}
    for row in rows:
        cells.setdefault((row["method"], row["task"], row["length"]), []).append(row)
    header = ["method", *(f"{task} {_short(length)}" for task, length in columns)]
    body = []
    for method in dict.fromkeys(r["method"] for r in rows):
        entries = []
        for task, length in columns:
            group = cells.get((method, task, length), [])
            mark = "!" if any(r["error"] for r in group) else ""
            right = sum(bool(r["correct"]) for r in group)
            low, high = wilson_interval(right, len(group))
            entries.append(f"{right}/{len(group)} [{low:.0%}–{high:.0%}]{mark}".replace("%", "", 1)
                           if group else "–")
        body.append([method, *entries])
    return markdown_table(header, "l" + "r" * len(columns), body)


def markdown(rows: Sequence[dict[str, Any]]) -> str:
    """Accuracy at a glance, the accuracy summary with the measurements, then one line per question."""
    summary_table = markdown_table(
        ["task", "method", "length", "tokens", "accuracy (95% CI)", "questions", "prefill s", "s / query",
         "decode ms/token", "peak RSS MB", "mean event"], "llrrrrrrrrr",
        ([s["task"], s["method"], f"{s['length']:,}", _num(s["tokens"], ",.0f"),
          f"{s['accuracy']:.0%} ({s['accuracy_low']:.0%}-{s['accuracy_high']:.0%})",
          f"{s['questions']}" + (f" ({s['errors']} failed)" if s["errors"] else ""),
          _num(s["prefill_seconds"], ".2f"), _num(s["query_seconds"], ".2f"), _num(s["decode_ms_per_token"], ".1f"),
          _num(s["peak_rss_mb"], ",.0f"), _num(s["mean_event_size"], ".1f")] for s in summary(rows)))
    question_table = markdown_table(
        ["task", "method", "tokens", "depth", "expected", "output", "correct", "prefill s", "s / query",
         "decode ms/token", "peak RSS MB", "mean event"], "llrrlllrrrrr",
        ([r["task"], r["method"], _num(r["tokens"] or r["length"], ","), f"{r['depth']:.2f}", _preview(r["expected"]),
          _preview(f"error: {r['error']}" if r["error"] else r["output"]), "yes" if r["correct"] else "no",
          _num(r["prefill_seconds"], ".2f"), _num(r["query_seconds"], ".2f"), _num(r["decode_ms_per_token"], ".1f"),
          _num(r["peak_rss_mb"], ",.0f"), _num(r["mean_event_size"], ".1f")] for r in rows))
    return "\n".join(["## Accuracy at a glance (correct / asked [95% Wilson interval])", "", accuracy_grid(rows), "",
                      "## Accuracy by task, method and length", "", summary_table, "",
                      "## Every question", "", question_table])


# ---------------------------------------------------------------------------------------------- report helpers
def _mean(values: Iterable[Any]) -> float | None:
    kept = [float(v) for v in values if v is not None]
    return sum(kept) / len(kept) if kept else None


def _num(value: Any, spec: str) -> str:
    return "–" if value is None else format(value, spec)


def _preview(text: Any, chars: int = 80) -> str:
    """The start of a long answer for a table cell (the whole text is in bench.json)."""
    return " ".join(str(text).split())[:chars]


METRICS = (("prefill_seconds", "prefill time (s): reading the document(s) once"),
           ("query_seconds", "time per query (s): the question until its first token"),
           ("decode_ms_per_token", "decode ms / token"),
           ("peak_rss_mb", "peak RSS (MB) of the cell's process"),
           ("mean_event_size", "mean event size (tokens)"))


MARKERS = "osD^vP*Xh<>"
ACCURACY_DODGE = 0.05
"""Sideways offset between methods in the accuracy figure, in octaves of length (lengths are on a log-2 axis)."""


def _plots(rows: list[dict[str, Any]], out: pathlib.Path) -> dict[str, pathlib.Path]:
    import matplotlib
    import numpy as np

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = list(dict.fromkeys(r["method"] for r in rows))
    tasks = list(dict.fromkeys(r["task"] for r in rows))
    lengths = sorted({r["length"] for r in rows})
    paths: dict[str, pathlib.Path] = {}

    def by_length(selected: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
        xs, ys = [], []
        for length in lengths:
            value = _mean((float(r[key]) if r[key] is not None else None) for r in selected if r["length"] == length)
            if value is not None:
                xs.append(length)
                ys.append(value)
        return xs, ys

    def finish(fig: Any, axes: Sequence[Any], name: str) -> None:
        for ax in axes:
            if len(lengths) > 1:
                ax.set_xscale("log", base=2)
            ax.set_xticks(lengths, [_short(n) for n in lengths])
            ax.set_xlabel("length (tokens)")
            ax.grid(alpha=0.3)
        fig.tight_layout()
        paths[name] = out / f"{name}.png"
        fig.savefig(paths[name], dpi=110)
        plt.close(fig)

    fig, axes = plt.subplots(1, len(tasks), figsize=(4.5 * len(tasks), 3.8), squeeze=False)
    for ax, task in zip(axes[0], tasks):
        for i, method in enumerate(methods):
            selected = [dict(r, correct=float(bool(r["correct"]))) for r in rows
                        if r["task"] == task and r["method"] == method]
            xs, ys = by_length(selected, "correct")
            # Methods often tie (0/3, 3/3): each is nudged sideways and drawn with its own marker, so none hides.
            nudge = 2 ** (ACCURACY_DODGE * (i - (len(methods) - 1) / 2))
            ax.plot([x * nudge for x in xs], ys, marker=MARKERS[i % len(MARKERS)], label=method)
        ax.set_title(f"{task}: accuracy")
        ax.set_ylim(-0.05, 1.05)
    axes[0][-1].legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.02, 1))  # outside: points sit at 0 and 1
    finish(fig, axes[0], "accuracy")

    needle = [r for r in rows if r["task"] == "needle"]
    if needle:
        needle_methods = list(dict.fromkeys(r["method"] for r in needle))
        depths = sorted({r["depth"] for r in needle})
        fig, axes = plt.subplots(1, len(needle_methods), figsize=(3.2 * len(needle_methods) + 1.5, 3.6),
                                 squeeze=False, layout="constrained")
        for i, (ax, method) in enumerate(zip(axes[0], needle_methods)):
            grid = [[_mean(float(bool(r["correct"])) for r in needle
                           if r["method"] == method and r["depth"] == d and r["length"] == n) for n in lengths]
                    for d in depths]
            values = [[math.nan if v is None else v for v in line] for line in grid]
            image = ax.imshow(values, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto", origin="upper")
            ax.set_xticks(range(len(lengths)), [_short(n) for n in lengths])
            ax.set_yticks(range(len(depths)), [f"{d:.0%}" for d in depths])
            for (y, x), value in np.ndenumerate(np.asarray(values, dtype=float)):
                if not math.isnan(value):
                    ax.text(x, y, f"{value:.0%}", ha="center", va="center", fontsize=8)
            ax.set_xlabel("length (tokens)")
            if i == 0:
                ax.set_ylabel("needle depth")
            ax.set_title(f"needle: {method}")
        fig.colorbar(image, ax=list(axes[0]), label="accuracy")
        paths["needle_heatmap"] = out / "needle_heatmap.png"
        fig.savefig(paths["needle_heatmap"], dpi=110)
        plt.close(fig)

    for key, title in METRICS:
        lines = {m: by_length([r for r in rows if r["method"] == m], key) for m in methods}
        lines = {m: xy for m, xy in lines.items() if xy[0]}
        if not lines:
            continue
        fig, ax = plt.subplots(figsize=(6, 4))
        for method, (xs, ys) in lines.items():
            ax.plot(xs, ys, marker="o", label=method)
        ax.set_title(title)
        ax.legend(fontsize=8)
        finish(fig, [ax], key)
    return paths


def _short(n: int) -> str:
    for unit, size in (("M", 2**20), ("K", 2**10)):
        if n >= size and n % size == 0:
            return f"{n // size}{unit}"
    return f"{n:,}"
