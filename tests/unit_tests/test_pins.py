"""EpisodicMemory.pin through the real engine (tiny random Llama): pinned tokens are in every layer's attention at
every later retrieval, whatever the ranking says; pins fork, save and load with the memory; bad spans are refused."""

from __future__ import annotations

import pytest

from emllm.persistence import load_memory, save_memory

from emllm.scoring import AttentionMass, Representatives

from .tiny import tiny_engine, token_ids


def _read_then_pin(engine, span: tuple[int, int], before: int = 120, after: int = 200):
    memory = engine.new_memory()
    ids = token_ids(before + after, seed=5)
    engine.read(memory, ids[:before])
    memory.pin(*span)
    engine.read(memory, ids[before:])
    return memory


@pytest.mark.parametrize("scorer", [Representatives(), AttentionMass()], ids=["representatives", "attention"])
def test_pinned_events_are_in_every_layer_after_each_retrieval(scorer):
    engine = tiny_engine("S", scorer=scorer)
    span = (20, 30)
    pinned = _read_then_pin(engine, span)
    free = engine.new_memory()
    engine.read(free, token_ids(320, seed=5))
    events = pinned.pinned_events()
    assert events == pinned.events_overlapping(*span) and len(events) >= 1
    assert all(set(events) <= set(layer.retrieved_ids) for layer in pinned.layers)
    assert pinned.layers_holding(*span) == len(pinned.layers)
    # The ranking alone does not keep them everywhere, so the pin is what put them there.
    assert free.layers_holding(*span) < len(free.layers)
    # The rest of the budget still goes to the ranking: more events than the pinned ones are retrieved.
    assert all(len(layer.retrieved_ids) > len(events) for layer in pinned.layers)


def test_unpin_hands_retrieval_back_to_the_ranking():
    engine = tiny_engine("S")
    dropped = []
    for span in [(20, 30), (40, 48), (60, 68), (80, 88)]:
        kept = _read_then_pin(engine, span)
        unpinned = kept.fork()
        unpinned.unpin()
        assert unpinned.pinned_spans == () and unpinned.pinned_events() == [] and kept.pinned_spans == (span,)
        more = token_ids(64, seed=8)
        engine.read(kept, more)
        engine.read(unpinned, more)
        assert kept.layers_holding(*span) == len(kept.layers)
        dropped.append(unpinned.layers_holding(*span) < len(unpinned.layers))
    assert any(dropped)  # once unpinned, the ranking may drop them again


def test_pins_fork_save_and_load_with_the_memory(tmp_path):
    engine = tiny_engine("S", n_mem=64)  # room for two pins
    memory = _read_then_pin(engine, (20, 30))
    child = memory.fork()
    child.pin(40, 44)
    assert memory.pinned_spans == ((20, 30),) and child.pinned_spans == ((20, 30), (40, 44))
    save_memory(child, tmp_path / "m", engine=engine)
    loaded = load_memory(tmp_path / "m", engine)
    assert loaded.pinned_spans == child.pinned_spans
    more = token_ids(48, seed=9)
    engine.read(child, more)
    engine.read(loaded, more)
    assert [layer.retrieved_ids for layer in loaded.layers] == [layer.retrieved_ids for layer in child.layers]


def test_bad_spans_are_refused_with_the_fix():
    engine = tiny_engine("S")
    memory = engine.new_memory()
    engine.read(memory, token_ids(100, seed=1))
    with pytest.raises(ValueError, match=r"0 <= start < end <= 100 .*read the text first"):
        memory.pin(90, 101)
    with pytest.raises(ValueError, match="0 <= start < end"):
        memory.pin(30, 30)
    with pytest.raises(TypeError, match="integer token positions"):
        memory.pin(10.0, 20)
    budget = engine.config.similarity_tokens
    with pytest.raises(ValueError, match=f"more than the retrieval budget \\({budget} tokens.*raise n_mem"):
        memory.pin(10, 10 + budget)
    assert memory.pinned_spans == ()  # a refused pin leaves none behind


def test_a_tool_listing_too_long_to_pin_is_left_to_retrieval_with_a_warning():
    engine = tiny_engine("S")  # a retrieval budget far below 300 tokens
    memory = engine.new_memory()
    ids = token_ids(400, seed=3)
    with pytest.warns(UserWarning, match=r"tool listing \(300 tokens\) is not kept.*raise n_mem"):
        engine.pin_prefix(memory, ids, 300)
    assert memory.pinned_spans == () and memory.total_tokens == 300
