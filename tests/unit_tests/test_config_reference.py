"""docs/config.md is generated from EMConfig: a field added, removed or re-documented without `make docs` fails here."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from emllm import EMConfig
from emllm.config import reference_markdown

PAGE = Path(__file__).resolve().parents[2] / "docs" / "config.md"


def test_the_config_reference_page_is_current():
    assert PAGE.read_text() == reference_markdown(), "docs/config.md is stale: run `make docs`"


def test_every_field_has_one_line_of_doc():
    page = reference_markdown()
    for field in dataclasses.fields(EMConfig):
        row = next(line for line in page.splitlines() if line.startswith(f"| `{field.name}` |"))
        assert not row.endswith("|  |"), f"EMConfig.{field.name} has no docstring"
        assert len(row.split(" | ")[-1]) <= 125, f"EMConfig.{field.name}'s doc is longer than one line"


def test_every_field_is_in_exactly_one_section():
    import dataclasses

    from emllm.config import SECTIONS, EMConfig

    listed = [name for names in SECTIONS.values() for name in names]
    assert sorted(listed) == sorted(f.name for f in dataclasses.fields(EMConfig))  # each once, none missing
    assert set(SECTIONS) == {"layout", "segmentation", "retrieval", "storage"}
