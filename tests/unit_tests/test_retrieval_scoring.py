"""Attention-mass scoring (scoring.AttentionMass) through the real engine (tiny random Llama): every retrieval ranks events by the
attention their stored tokens receive, the layer takes the best-first events that fit its budget, and memories
saved before the scorer objects existed still load."""

from __future__ import annotations

import json
import re

import pytest
import torch

from emllm import EMConfig, scoring as scoring_module
from emllm.scoring import AttentionMass, EventText, ForQuestions, Pooled, Representatives, uses_stored_keys
from emllm.persistence import ADDED_FIELDS, MANIFEST, load_memory, manifest_checksum, save_memory
from emllm.retrieval import fill_budget

from .tiny import TINY, tiny_engine, token_ids


def _spy_on_scoring(monkeypatch) -> list[torch.Tensor]:
    masses: list[torch.Tensor] = []
    real = scoring_module.attention_mass_per_event

    def spy(*args, **kwargs):
        masses.append(real(*args, **kwargs))
        return masses[-1]

    monkeypatch.setattr(scoring_module, "attention_mass_per_event", spy)
    return masses


def test_attention_scoring_retrieves_the_most_attended_events_that_fit(monkeypatch):
    engine = tiny_engine("S", scorer=AttentionMass())
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


@pytest.mark.parametrize("field, read_with", list(ADDED_FIELDS.items()))
def test_a_memory_saved_before_a_setting_existed_loads_with_the_value_it_was_read_with(tmp_path, field, read_with):
    engine = tiny_engine("S")
    memory = engine.new_memory()
    engine.read(memory, token_ids(200, seed=3))
    save_memory(memory, tmp_path / "old", engine=engine)
    memory.close()
    manifest = json.loads((tmp_path / "old" / MANIFEST).read_text())
    del manifest["config"][field]  # what a save from before the field looks like
    manifest["checksum"] = manifest_checksum(manifest)
    (tmp_path / "old" / MANIFEST).write_text(json.dumps(manifest))
    loaded = load_memory(tmp_path / "old", engine)
    assert getattr(loaded.config, field) == read_with
    loaded.close()


@pytest.mark.parametrize("field, value", [("scorer", AttentionMass()), ("scorer", Pooled(ForQuestions())),
                                          ("memory_positions", "ordered")])
def test_a_non_default_method_setting_is_part_of_a_saved_memory(tmp_path, field, value):
    engine = tiny_engine("S", **{field: value})
    memory = engine.new_memory()
    engine.read(memory, token_ids(200, seed=3))
    save_memory(memory, tmp_path / "m", engine=engine)
    memory.close()
    loaded = load_memory(tmp_path / "m", engine)
    assert getattr(loaded.config, field) == value
    engine.generate(loaded.token_ids + [4], memory=loaded, max_new_tokens=2)  # the key copy starts from the file
    for layer in loaded.layers if uses_stored_keys(loaded.config.scorer) else ():
        assert layer.key_copy_length == loaded.store.num_tokens > 0
        assert torch.equal(layer.key_copy[:, :layer.key_copy_length],
                           loaded.store.layer_keys(layer.layer_index, layer.device).float())
    loaded.close()
    from emllm.persistence import MemoryFileError
    with pytest.raises(MemoryFileError, match=re.escape(f"{field}={value!r}")):
        load_memory(tmp_path / "m", engine, config=EMConfig.from_preset("S", **TINY))


@pytest.mark.parametrize("scoring, pooling, scorer", [
    ("representatives", "none", Representatives()), ("attention", "none", AttentionMass()),
    ("attention_for_questions", "cumulative", Pooled(ForQuestions()))])
def test_a_memory_saved_with_the_retrieval_names_loads_with_the_scorer_they_name(tmp_path, scoring, pooling, scorer):
    """Saves from before the scorer objects name the ranking by two strings (and carry read_question_alone)."""
    engine = tiny_engine("S", scorer=scorer)
    memory = engine.new_memory()
    engine.read(memory, token_ids(200, seed=3))
    save_memory(memory, tmp_path / "old", engine=engine)
    memory.close()
    manifest = json.loads((tmp_path / "old" / MANIFEST).read_text())
    del manifest["config"]["scorer"]
    manifest["config"].update(retrieval_scoring=scoring, retrieval_pooling=pooling, read_question_alone=True)
    manifest["checksum"] = manifest_checksum(manifest)
    (tmp_path / "old" / MANIFEST).write_text(json.dumps(manifest))
    loaded = load_memory(tmp_path / "old", engine)
    assert loaded.config.scorer == scorer
    loaded.close()


def test_a_memory_saved_with_the_scorer_settings_in_the_config_loads_with_them_on_the_scorer(tmp_path):
    """Saves from before retrieval_backend, faiss_min_events and relevance_bias became scorer parameters hold them as
    config fields, and a scorer description without them."""
    engine = tiny_engine("S", scorer=ForQuestions(answering=EventText()))
    memory = engine.new_memory()
    engine.read(memory, token_ids(200, seed=3))
    save_memory(memory, tmp_path / "old", engine=engine)
    memory.close()
    manifest = json.loads((tmp_path / "old" / MANIFEST).read_text())
    spec = manifest["config"]["scorer"]
    del spec["reading"]["backend"], spec["reading"]["faiss_min_events"], spec["answering"]["relevance_bias"]
    manifest["config"].update(retrieval_backend="torch", faiss_min_events=5, relevance_bias=1.5)
    manifest["checksum"] = manifest_checksum(manifest)
    (tmp_path / "old" / MANIFEST).write_text(json.dumps(manifest))
    loaded = load_memory(tmp_path / "old", engine)
    assert loaded.config.scorer == ForQuestions(reading=Representatives(backend="torch", faiss_min_events=5),
                                                answering=EventText(relevance_bias=1.5))
    assert loaded.relevance_bias == 1.5 and loaded.layers[0].index.backend == "torch"
    loaded.close()


def _retrievals(engine, ids):
    memory = engine.new_memory()
    engine.read(memory, ids)
    after_read = [layer.retrieved_ids for layer in memory.layers]
    answer = engine.generate(ids + [5, 6], memory=memory, max_new_tokens=6)
    return memory, after_read, [layer.retrieved_ids for layer in memory.layers], answer.token_ids


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_key_copy_changes_no_retrieval_and_holds_every_stored_key(dtype):
    ids = token_ids(400, seed=4)
    copying, read_a, decode_a, answer_a = _retrievals(tiny_engine("S", dtype, scorer=AttentionMass()), ids)
    # A RAM budget (large enough that nothing leaves RAM) turns the copy off: keys are read from the pages.
    paging, read_b, decode_b, answer_b = _retrievals(
        tiny_engine("S", dtype, scorer=AttentionMass(), ram_budget_mb=1024), ids)
    assert (read_a, decode_a, answer_a) == (read_b, decode_b, answer_b)
    assert any(read_a) and read_a != decode_a  # retrieval ran, and decoding moved it
    for layer in copying.layers:  # the last forward may have stored tokens that no retrieval has looked at yet
        n = layer.key_copy_length
        stored = copying.store.layer_keys(layer.layer_index, layer.device)[:, :n]
        assert 0 < n <= copying.store.num_tokens
        assert torch.equal(layer.key_copy[:, :n], stored.float())
    assert copying.stats()["key_copy_bytes"] >= 4 * stored.numel() * len(copying.layers)
    assert all(layer.key_copy.numel() == 0 for layer in paging.layers)
    assert paging.stats()["key_copy_bytes"] == 0
    copying.close()
    paging.close()


def test_the_key_copy_reads_each_stored_key_once(monkeypatch):
    """The point of the copy: a retrieval reads only the keys stored since the last one, not every page again."""
    engine = tiny_engine("S", scorer=AttentionMass())
    memory = engine.new_memory()
    read_tokens: dict[int, int] = {}
    real = type(memory.store).layer_keys

    def counting(store, layer, device, start=0):
        keys = real(store, layer, device, start)
        read_tokens[layer] = read_tokens.get(layer, 0) + keys.shape[1]
        return keys

    monkeypatch.setattr(type(memory.store), "layer_keys", counting)
    engine.read(memory, token_ids(400, seed=5))
    engine.generate(memory.token_ids + [7], memory=memory, max_new_tokens=5)
    retrievals = memory.layers[0].retrievals
    assert retrievals > 10 and memory.num_events > 5
    copied = [layer.key_copy_length for layer in memory.layers]
    assert read_tokens == {i: n for i, n in enumerate(copied)} and 0 < copied[0] <= memory.store.num_tokens
    memory.close()


def test_forks_keep_their_own_key_copies():
    engine = tiny_engine("S", scorer=AttentionMass())
    parent = engine.new_memory()
    engine.read(parent, token_ids(300, seed=6))
    for layer in parent.layers:  # room for both to go on in place: the case where a shared buffer would be clobbered
        layer.key_copy = torch.cat([layer.key_copy, torch.zeros_like(layer.key_copy).repeat(1, 4, 1)], dim=1)
    child = parent.fork()
    shared = parent.layers[0].key_copy_length
    assert shared > 0 and child.layers[0].key_copy is parent.layers[0].key_copy
    engine.read(parent, token_ids(120, seed=7))  # both go on from the shared copy, with different text
    engine.read(child, token_ids(120, seed=8))
    for memory in (parent, child):
        engine.generate(memory.token_ids + [9], memory=memory, max_new_tokens=2)  # a retrieval after the last read
        for layer in memory.layers:
            n = layer.key_copy_length
            assert n > shared  # each went on copying after the fork
            stored = memory.store.layer_keys(layer.layer_index, layer.device)[:, :n].float()
            assert torch.equal(layer.key_copy[:, :n], stored)
    assert parent.layers[0].key_copy is not child.layers[0].key_copy
    parent.close()
    child.close()
