"""Storage tiers and retrieval backends on the real model: they must not change the answer."""

from __future__ import annotations

import os

import pytest
import torch

from emllm import EMConfig, EMEngine
from emllm.scoring import ForQuestions, Pooled, Representatives, with_parameters
from emllm_integrations.bench.tasks import needle_document, passkey_document

from .conftest import SMOL

TOKENS = 3500


@pytest.fixture(scope="module")
def doc(smol_fast):
    _, tokenizer = smol_fast
    return passkey_document(TOKENS, 0.4, lambda t: len(tokenizer(t, add_special_tokens=False)["input_ids"]), seed=7)


def _engine(pair, **overrides):
    """The default layout (SmolLM2's): 3.5K tokens overflow its 2K window into 5-10 pages of 128 tokens."""
    return EMEngine(*pair, EMConfig.from_preset("SM", page_tokens=128, **overrides))


@pytest.fixture(scope="module")
def in_ram(smol_fast, doc):
    engine = _engine(smol_fast)
    memory = engine.new_memory()
    result = engine.generate(doc.prompt, memory=memory, max_new_tokens=8)
    yield engine, memory, result
    memory.close()


@pytest.fixture(scope="module")
def in_ram_answer(in_ram):
    return in_ram[2]


def test_episodic_memory_finds_the_key(in_ram_answer, doc):
    assert doc.answer in in_ram_answer.text


def test_disk_offload_gives_the_same_answer_and_cleans_up(smol_fast, doc, in_ram_answer, tmp_path):
    engine = _engine(smol_fast, ram_budget_mb=6, offload_dir=str(tmp_path))  # ~2 of the pages fit in RAM
    memory = engine.new_memory()
    result = engine.generate(doc.prompt, memory=memory, max_new_tokens=8)
    tiers = memory.stats()["tokens_per_tier"]
    assert tiers["disk"] > tiers["ram"] > 0  # the budget really forced pages to disk
    disk_dir = memory.store.disk_dir
    assert disk_dir and len(os.listdir(disk_dir)) > 0
    assert result.token_ids == in_ram_answer.token_ids
    memory.close()
    assert not os.path.exists(disk_dir)
    assert os.listdir(tmp_path) == []


def test_faiss_and_torch_retrieval_give_the_same_answer(smol_fast, doc, in_ram_answer):
    engine = _engine(smol_fast, scorer=with_parameters(EMConfig.from_preset("SM").scorer, Representatives,
                                                       backend="faiss"))
    memory = engine.new_memory()
    result = engine.generate(doc.prompt, memory=memory, max_new_tokens=8)
    assert memory.layers[0].index.uses_faiss()
    assert result.token_ids == in_ram_answer.token_ids
    memory.close()


def test_the_needle_event_is_retrieved(in_ram, doc):
    """The event holding the pass key is among those most layers retrieve for the question."""
    engine, memory, _ = in_ram
    ids = memory.token_ids
    key = engine.tokenize(" " + doc.answer)
    at = next(i for i in range(len(ids)) if ids[i:i + len(key)] == key)
    starts = memory.event_boundaries()
    event = int(torch.searchsorted(starts, torch.tensor(at), right=True)) - 1
    assert event >= 0 and memory.local_start > at  # the key was evicted into an event
    layers = sum(event in layer.retrieved_ids for layer in memory.layers)
    assert layers >= len(memory.layers) // 2



def test_a_pinned_needle_is_held_by_every_layer_and_answered(smol_fast):
    """Pinning the needle sentence of an essay haystack after reading it puts its events in all 30 layers for the
    question, and the model copies the number: the diagnostic behind benchmarks/retrieval_scoring.py --pin-answer."""
    from emllm_integrations.bench.tasks import probe_suffix

    engine = EMEngine(*smol_fast, EMConfig.from_preset("S", n_local=512))
    doc = needle_document(TOKENS, 0.2, engine.count_tokens, seed=7)
    context = engine.tokenize(doc.context)
    span = (engine.count_tokens(doc.context[:doc.needle_offset]),
            engine.count_tokens(doc.context[:doc.needle_offset + len(doc.needle)]))
    memory = engine.new_memory()
    engine.read(memory, context)
    memory.pin(*span)
    question = context + engine.tokenize(probe_suffix(doc.question, doc.answer_lead))
    result = engine.generate(question, memory=memory, max_new_tokens=12)
    assert memory.local_start > span[1]  # evicted: only retrieval (here, the pin) can show it
    assert memory.layers_holding(*span) == len(memory.layers) == engine.shape.num_layers
    assert doc.answer in result.text
    memory.close()

def test_stats_describe_the_memory(in_ram):
    engine, memory, _ = in_ram
    stats = memory.stats()
    assert stats["tokens_read"] == memory.total_tokens
    assert stats["tokens_sinks"] + stats["tokens_evicted"] + stats["tokens_local"] == stats["tokens_read"]
    assert stats["events"] == memory.num_events > 0
    assert engine.config.min_block_size <= stats["mean_event_size"] <= engine.config.max_block_size
    assert sum(stats["tokens_per_tier"].values()) == stats["tokens_evicted"]
    assert all(n > 0 for n in stats["retrievals_per_layer"])


def test_device_map_auto_loads_and_runs():
    """accelerate's device_map places each layer; each layer's memory lives on its layer's device."""
    from emllm.models import load_model

    pair = load_model(SMOL, dtype="auto", device_map="auto")
    engine = EMEngine(*pair, EMConfig.from_preset("S", n_init=32, n_local=256, n_mem=256, chunk_size=128,
                                                  max_block_size=64))
    memory = engine.new_memory()
    engine.read(memory, "A long text about episodic memory. " * 150)
    assert memory.num_events > 0
    for layer, block in zip(memory.layers, pair[0].model.layers):
        assert layer.keys.device == next(block.parameters()).device
    memory.close()


def test_the_readme_needle_recipe_answers_an_evicted_essay_needle(smol_fp32):
    """README's recipe for one fact deep in prose (S+C, a 512-token window, the representatives while reading and
    attention scoring pooled over layers for the question and answer, the prompt in one call, its question read in
    forwards of its own): at 8K the needle leaves the window and most layers retrieve it for the question, and the
    model copies the number (ranked by the representatives, pooled too, preset S, 27 layers held an event
    overlapping the needle and the answer was "100.": measured by hand).
    float32, so the counts do not depend on the CPU's bf16 support (measured here with preset S: 23 of 30 layers;
    docs/notes/needle-retrieval.md has 32K to 128K)."""
    from emllm_integrations.bench.tasks import probe_suffix

    engine = EMEngine(*smol_fp32, EMConfig.from_preset("S+C", n_local=512, scorer=Pooled(ForQuestions())))
    doc = needle_document(8000, 0.3, engine.count_tokens, seed=7)
    span = (engine.count_tokens(doc.context[:doc.needle_offset]),
            engine.count_tokens(doc.context[:doc.needle_offset + len(doc.needle)]))
    prompt = doc.context + probe_suffix(doc.question, doc.answer_lead)
    memory = engine.new_memory()
    first = engine.generate(prompt, memory=memory, max_new_tokens=1)  # one token: no retrieval after the prompt's
    assert memory.local_start > span[1]  # evicted: only retrieval can show it
    assert memory.layers_holding(*span) > len(memory.layers) // 2
    answer = engine.generate(memory.token_ids, memory=memory, max_new_tokens=12)  # all read: goes on from there
    assert answer.new_input_tokens == 0 and answer.token_ids[0] == first.token_ids[0]
    assert doc.answer in answer.text
    memory.close()
