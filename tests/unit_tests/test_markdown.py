"""The one markdown table writer behind every report (bench.md, compare's to_markdown, benchmarks/*.md)."""

import re

import pytest

from emllm_integrations.markdown import table


def test_table_aligns_columns_and_keeps_cells_whole():
    text = table(["method", "answer", "seconds"], "llr",
                 [["S", "a | b\nc", 1.5], ["rag-minilm", "", "–"]]).splitlines()
    assert text[0] == "| method | answer | seconds |"
    assert text[1] == "|---|---|---:|"
    assert text[2] == "| S | a \\| b c | 1.5 |"  # a pipe would split the cell, a line break the row
    assert len(re.findall(r"(?<!\\)\|", text[2])) == 4 and len(text) == 4
    assert text[3] == "| rag-minilm |  | – |"


@pytest.mark.parametrize("header, align, rows, message", [
    (["a", "b"], "l", [], "one of 'l' or 'r' per column, 2 columns"),
    (["a", "b"], "lc", [], "one of 'l' or 'r' per column"),
    (["a", "b"], "lr", [["x", 1], ["y"]], "row 1 has 1 cells for 2 columns"),
])
def test_table_refuses_a_shape_it_would_garble(header, align, rows, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        table(header, align, rows)
