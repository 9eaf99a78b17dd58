"""retrieval_scoring="attention" through the real engine (tiny random Llama): every retrieval ranks events by the
attention their stored tokens receive, the layer takes the best-first events that fit its budget, and memories
saved before the setting existed still load."""

from __future__ import annotations

import json

import pytest
import torch

from emllm import EMConfig, memory as memory_module
from emllm.persistence import MANIFEST, _manifest_checksum, load_memory, save_memory
from emllm.retrieval import fill_budget

from .tiny import TINY, tiny_engine, token_ids


def _spy_on_scoring(monkeypatch) -> list[torch.Tensor]:
    masses: list[torch.Tensor] = []
    real = memory_module.attention_mass_per_event

    def spy(*args, **kwargs):
        masses.append(real(*args, **kwargs))
        return masses[-1]

    monkeypatch.setattr(memory_module, "attention_mass_per_event", spy)
    return masses


def test_attention_scoring_retrieves_the_most_attended_events_that_fit(monkeypatch):
    engine = tiny_engine("S", retrieval_scoring="attention")
    masses = _spy_on_scoring(monkeypatch)
    memory = engine.new_memory()
    engine.read(memory, token_ids(400, seed=2))
    layers = len(memory.layers)
    assert memory.num_events > 5 and len(masses) >= layers  # a ranking per layer per retrieval
    events_then = len(masses[-1])  # the last retrieval ran before the last chunk's events were stored
    assert 0 < events_then <= memory.num_events and all(len(m) == events_then for m in masses[-layers:])
    budget = memory.config.similarity_tokens
    for layer, mass in zip(memory.layers, masses[-layers:]):  # the last retrieval, layer by layer
        expected = fill_budget(torch.argsort(mass, descending=True), memory.event_sizes[:events_then], budget)
        assert set(layer.retrieved_ids) == set(expected.tolist())
    answer = engine.generate(memory.token_ids + [5, 6], memory=memory, max_new_tokens=4)
    assert len(answer.token_ids) == 4
    memory.close()


def test_representatives_scoring_does_not_read_every_key(monkeypatch):
    engine = tiny_engine("S")
    masses = _spy_on_scoring(monkeypatch)
    memory = engine.new_memory()
    engine.read(memory, token_ids(400, seed=2))
    assert memory.num_events > 5 and any(layer.retrieved_ids for layer in memory.layers)
    assert masses == []
    memory.close()


def test_a_memory_saved_before_retrieval_scoring_existed_loads_with_the_scoring_it_was_read_with(tmp_path):
    engine = tiny_engine("S")
    memory = engine.new_memory()
    engine.read(memory, token_ids(200, seed=3))
    save_memory(memory, tmp_path / "old", engine=engine)
    memory.close()
    manifest = json.loads((tmp_path / "old" / MANIFEST).read_text())
    del manifest["config"]["retrieval_scoring"]  # what a save from before the field looks like
    manifest["checksum"] = _manifest_checksum(manifest)
    (tmp_path / "old" / MANIFEST).write_text(json.dumps(manifest))
    loaded = load_memory(tmp_path / "old", engine)
    assert loaded.config.retrieval_scoring == "representatives"
    loaded.close()


def test_the_scoring_is_part_of_a_saved_memory(tmp_path):
    engine = tiny_engine("S", retrieval_scoring="attention")
    memory = engine.new_memory()
    engine.read(memory, token_ids(200, seed=3))
    save_memory(memory, tmp_path / "m", engine=engine)
    memory.close()
    assert load_memory(tmp_path / "m", engine).config.retrieval_scoring == "attention"
    from emllm.persistence import MemoryFileError
    with pytest.raises(MemoryFileError, match="retrieval_scoring='attention'"):
        load_memory(tmp_path / "m", engine, config=EMConfig.from_preset("S", **TINY))
