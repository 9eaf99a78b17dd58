"""Models by hub id, offline, from a Hugging Face cache laid out as huggingface_hub writes it (tests/hub_cache.py),
holding the tiny random model; and models loaded by other means handed to the engine."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GPT2Config, GPT2LMHeadModel

from emllm import EMConfig, EMEngine, load_model
from emllm.models import ModelNotAvailableError, UnsupportedModelError, check_model, resolve_model_dir
from tests.hub_cache import add_snapshot

from .tiny import TINY, tiny_model, tiny_tokenizer

REPO = "emllm-test/tiny-llama"


@pytest.fixture
def offline(monkeypatch):
    """HF_HUB_OFFLINE as huggingface_hub reads it (at call time), whatever the shell set."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)


def _saved(folder, seed):
    model, tokenizer = tiny_model(seed=seed), tiny_tokenizer()
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return model


def test_a_hub_id_loads_offline_from_the_cache_as_transformers_would(tmp_path, offline, monkeypatch):
    from huggingface_hub import constants

    original = _saved(tmp_path / "source", seed=0)
    cache = tmp_path / "hub"
    commit = add_snapshot(cache, REPO, tmp_path / "source")
    model, tokenizer = load_model(REPO, cache_dir=cache, dtype="float32", device="cpu", progress=False)
    assert resolve_model_dir(REPO, cache_dir=cache) == cache / "models--emllm-test--tiny-llama" / "snapshots" / commit
    for name, tensor in original.state_dict().items():
        assert torch.equal(model.state_dict()[name], tensor), name
    # the default cache is huggingface_hub's own (HF_HOME / HF_HUB_CACHE), read when the call is made
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    engine = EMEngine.from_pretrained(REPO, preset="SM+C", dtype="float32", device="cpu", progress=False, **TINY)
    reference = EMEngine(original, tiny_tokenizer(), EMConfig.from_preset("SM+C", **TINY))
    prompt = " ".join(f"t{i % 90 + 3}" for i in range(80))
    assert engine.generate(prompt, max_new_tokens=6).token_ids == \
        reference.generate(prompt, max_new_tokens=6).token_ids


def test_a_revision_picks_its_commit_by_branch_tag_or_hash(tmp_path, offline):
    first, second = _saved(tmp_path / "a", seed=0), _saved(tmp_path / "b", seed=1)
    cache = tmp_path / "hub"
    old = add_snapshot(cache, REPO, tmp_path / "a", refs=("v1",))
    add_snapshot(cache, REPO, tmp_path / "b", refs=("main",))
    weight = "model.layers.0.mlp.down_proj.weight"
    for revision, expected in ((None, second), ("main", second), ("v1", first), (old, first)):
        model, _ = load_model(REPO, cache_dir=cache, revision=revision, dtype="float32", device="cpu",
                              progress=False)
        assert torch.equal(model.state_dict()[weight], expected.state_dict()[weight]), revision
    with pytest.raises(ModelNotAvailableError, match="emllm-test/tiny-llama@v9 is not in the Hugging Face cache"):
        load_model(REPO, cache_dir=cache, revision="v9", progress=False)


def test_an_unsupported_hub_model_is_refused_from_its_config_before_any_weight(tmp_path, offline):
    source = tmp_path / "gpt2"
    source.mkdir()
    GPT2Config(n_layer=1, n_embd=8, n_head=2).save_pretrained(source)  # no weight file at all
    cache = tmp_path / "hub"
    add_snapshot(cache, "emllm-test/gpt2", source)
    with pytest.raises(UnsupportedModelError, match="gpt2"):
        load_model("emllm-test/gpt2", cache_dir=cache, progress=False)


def test_a_cached_hub_model_without_weights_says_so(tmp_path, offline):
    source = tmp_path / "config-only"
    tiny_model().config.save_pretrained(source)
    cache = tmp_path / "hub"
    add_snapshot(cache, REPO, source)
    with pytest.raises(ModelNotAvailableError, match="no safetensors or pytorch_model"):
        resolve_model_dir(REPO, cache_dir=cache)


def test_construction_checks_find_a_cached_hub_id_and_refuse_a_missing_one_offline(tmp_path, offline):
    _saved(tmp_path / "source", seed=0)
    cache = tmp_path / "hub"
    add_snapshot(cache, REPO, tmp_path / "source")
    check_model(REPO, cache_dir=cache)  # cached: fine, nothing loaded
    with pytest.raises(ModelNotAvailableError, match="hf download emllm-test/other"):
        check_model("emllm-test/other", cache_dir=cache)


def test_an_already_loaded_model_and_tokenizer_make_an_engine(tmp_path):
    _saved(tmp_path, seed=0)
    model = AutoModelForCausalLM.from_pretrained(tmp_path)  # as transformers users load it
    model.train()
    engine = EMEngine(model, AutoTokenizer.from_pretrained(tmp_path), EMConfig.from_preset("S", **TINY))
    assert not model.training and not any(p.requires_grad for p in model.parameters())
    assert engine.generate(" ".join(["t5"] * 50), max_new_tokens=3).output_tokens == 3
    with pytest.raises(UnsupportedModelError, match="gpt2"):
        EMEngine(GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=8, n_head=2)), tiny_tokenizer())


def test_the_adapters_run_an_engine_made_from_a_loaded_model():
    from langchain_core.messages import HumanMessage

    from emllm.sessions import loaded_engines
    from emllm_integrations.langchain import ChatEMLLM
    from emllm_integrations.llama_index import EMLLM

    from .tiny import tiny_engine

    engine, before = tiny_engine("S"), loaded_engines()
    chat = ChatEMLLM(engine=engine, preset="S", max_tokens=3, **TINY)
    assert chat.engine() is engine and chat.model_name == engine.model_name
    assert chat.invoke([HumanMessage(" ".join(["t7"] * 30))]).response_metadata["finish_reason"] in ("stop", "length")
    llm = EMLLM(engine=engine, preset="S", max_tokens=3, **TINY)
    assert llm.pool.engine is engine and llm.metadata.model_name == engine.model_name
    assert llm.complete(" ".join(["t9"] * 30)).raw is not None
    assert loaded_engines() == before  # nothing was loaded by name


def test_chat_emllm_shows_reading_progress_when_asked(capfd):
    """Issue 58, item 6: ChatEMLLM read long prompts in silence. progress=True shows the reading bar on stderr;
    the default stays quiet, as LangChain chat models are."""
    from langchain_core.messages import HumanMessage

    from emllm_integrations.langchain import ChatEMLLM

    from .tiny import tiny_engine

    engine = tiny_engine("S")
    long_prompt = [HumanMessage(" ".join(["t5"] * 120))]
    ChatEMLLM(engine=engine, preset="S", max_tokens=2, **TINY).invoke(long_prompt)
    assert "reading into memory" not in capfd.readouterr().err
    ChatEMLLM(engine=engine, preset="S", max_tokens=2, progress=True, **TINY).invoke(
        [HumanMessage(" ".join(["t6"] * 120))])
    assert "reading into memory" in capfd.readouterr().err
