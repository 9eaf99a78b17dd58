"""Bad input fails early with a message that names the problem and the fix."""

from __future__ import annotations

import json

import pytest

from emllm import ConfigError, EMConfig, EMEngine, UnsupportedModelError

from .conftest import make_engine


@pytest.fixture(scope="module")
def engine(smol_fast):
    return make_engine(smol_fast, "S")


@pytest.mark.parametrize("text", ["", "   \n\t  "])
def test_empty_or_whitespace_text(engine, text):
    with pytest.raises(ValueError, match="empty"):
        engine.generate(text)
    with pytest.raises(ValueError, match="empty"):
        engine.read(engine.new_memory(), text)


def test_empty_conversation(engine):
    with pytest.raises(ValueError, match="empty"):
        engine.chat([])
    with pytest.raises(ValueError, match="whitespace"):
        engine.chat([{"role": "user", "content": "  "}])


def test_unsupported_model_dir(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_layer": 2}))
    with pytest.raises(UnsupportedModelError, match="gpt2"):
        EMEngine.from_pretrained(str(tmp_path))


def test_sizes_beyond_the_model_positions(smol_fast):
    model, tokenizer = smol_fast
    with pytest.raises(ConfigError, match="n_local"):
        EMEngine(model, tokenizer, EMConfig.from_preset("SM", n_local=8000, n_mem=2048))


def test_min_block_larger_than_max_block():
    with pytest.raises(ConfigError, match="min_block_size"):
        EMConfig.from_preset("SM", min_block_size=200, max_block_size=100)


def test_unknown_preset():
    with pytest.raises(ConfigError, match="SM\\+C"):
        EMConfig.from_preset("SMX")


def test_bad_sampling_arguments(engine):
    for kwargs, field in [({"max_new_tokens": 0}, "max_new_tokens"), ({"temperature": -1}, "temperature"),
                          ({"top_p": 0}, "top_p"), ({"top_k": -2}, "top_k")]:
        with pytest.raises(ValueError, match=field):
            engine.generate("Hello", **kwargs)


def test_input_over_the_configured_limit_is_refused_before_work(smol_fast):
    engine = make_engine(smol_fast, "S", max_input_tokens=100)
    memory = engine.new_memory()
    with pytest.raises(ValueError, match="max_input_tokens"):
        engine.read(memory, "word " * 500)
    assert memory.total_tokens == 0
