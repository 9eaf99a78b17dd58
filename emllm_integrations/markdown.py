"""Markdown tables for reports: `emllm bench`, the comparison helper and the scripts in benchmarks/ all print them,
and one writer keeps the escaping and the alignment row the same everywhere."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

ALIGNMENT_ROW = {"l": "---", "r": "---:"}


def table(header: Sequence[str], align: str, rows: Iterable[Sequence[object]]) -> str:
    """A GitHub-flavoured markdown table.

    ``align`` has one letter per column, ``l`` for text and ``r`` for numbers (right-aligned so that digits line
    up when rendered). Cells are written with ``str``; a ``|`` or a line break inside a cell would end the cell or
    the row, so they are escaped and collapsed: the text is kept whole.
    """
    if len(align) != len(header) or set(align) - set(ALIGNMENT_ROW):
        raise ValueError(f"align={align!r} must give one of 'l' or 'r' per column, {len(header)} columns here "
                         f"({', '.join(header)})")
    lines = [_row(header), "|" + "|".join(ALIGNMENT_ROW[a] for a in align) + "|"]
    for number, row in enumerate(rows):
        if len(row) != len(header):
            raise ValueError(f"row {number} has {len(row)} cells for {len(header)} columns ({', '.join(header)}): "
                             f"{list(row)!r}")
        lines.append(_row(row))
    return "\n".join(lines)


def cell(value: object) -> str:
    """One table cell: whitespace runs (line breaks included) become one space and ``|`` is escaped."""
    return " ".join(str(value).split()).replace("|", "\\|")


def _row(cells: Sequence[object]) -> str:
    return "| " + " | ".join(cell(c) for c in cells) + " |"
