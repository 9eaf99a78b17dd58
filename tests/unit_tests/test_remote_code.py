"""A model's own code never runs: no "y" on standard input, however it got there, makes emllm import a model
folder's tokenization_*.py, configuration_*.py or modeling_*.py. transformers asks on standard input when a folder
ships code (an auto_map) it cannot replace by its own classes; a question piped to `emllm chat` answered that.

A tiny random Llama saved with a tokenizer, its config and tokenizer config pointing at code files that leave a
marker file when imported."""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path

import pytest

from emllm.models import UnsupportedModelError, load_model

from .tiny import tiny_model, tiny_tokenizer


def model_with_code(folder: Path, tokenizer_class: str) -> Path:
    tiny_model().save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    marker = folder / "ran"
    for module, base, name in (("tokenization_evil", "PreTrainedTokenizerFast", "EvilTokenizer"),
                               ("configuration_evil", "LlamaConfig", "EvilConfig"),
                               ("modeling_evil", "LlamaForCausalLM", "EvilModel")):
        (folder / f"{module}.py").write_text(f"open({str(marker)!r}, 'a').write({module!r})\n"
                                             f"from transformers import {base}\nclass {name}({base}):\n    pass\n")
    tokenizer_config = json.loads((folder / "tokenizer_config.json").read_text())
    tokenizer_config.update(auto_map={"AutoTokenizer": [None, "tokenization_evil.EvilTokenizer"]},
                            tokenizer_class=tokenizer_class)
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    config = json.loads((folder / "config.json").read_text())
    config["auto_map"] = {"AutoConfig": "configuration_evil.EvilConfig",
                          "AutoModelForCausalLM": "modeling_evil.EvilModel"}
    (folder / "config.json").write_text(json.dumps(config))
    return marker


def test_a_model_that_needs_its_own_code_is_refused_and_a_yes_on_stdin_runs_nothing(tmp_path, monkeypatch):
    marker = model_with_code(tmp_path, "EvilTokenizer")  # no class of transformers' own can stand in
    monkeypatch.setattr(sys, "stdin", io.StringIO("y\n" * 8))
    with pytest.raises(UnsupportedModelError, match="needs its own Python code .* never runs a model's code"):
        load_model(tmp_path, dtype="float32", device="cpu", progress=False)
    assert not marker.exists()


def test_a_model_whose_code_transformers_can_replace_loads_with_transformers_classes(tmp_path, monkeypatch):
    marker = model_with_code(tmp_path, "PreTrainedTokenizerFast")
    monkeypatch.setattr(sys, "stdin", io.StringIO("y\n" * 8))
    model, tokenizer = load_model(tmp_path, dtype="float32", device="cpu", progress=False)
    assert type(model).__name__ == "LlamaForCausalLM" and "Evil" not in type(tokenizer).__name__
    assert not marker.exists()
