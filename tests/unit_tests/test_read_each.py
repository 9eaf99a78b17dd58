"""The bench's read_each: documents that begin alike share their reading, yet each memory is the one a separate
read gives (same tokens, events, last logits, answer), and no memory is left open."""

from __future__ import annotations

import pytest
import torch

from emllm_integrations.bench import read_each
from emllm_integrations.bench.measure import common_prefix

from .tiny import tiny_engine, token_ids

NEEDLE = [5, 6, 7, 8, 9]


def _haystack_documents(depths=(0.1, 0.5, 0.9), length=200):
    """One haystack with the needle at each depth: identical up to their needles, as the benchmark's are."""
    hay = token_ids(length, seed=3)
    return [hay[:round(d * length)] + NEEDLE + hay[round(d * length):] for d in depths]


def _assert_same_state(shared, alone, engine):
    assert shared.token_ids == alone.token_ids
    assert torch.equal(shared.event_starts, alone.event_starts)
    assert torch.equal(shared.event_sizes, alone.event_sizes)
    assert torch.equal(shared.last_logits, alone.last_logits)
    follow = shared.token_ids + [11, 12, 13]
    assert (engine.generate(follow, memory=shared, max_new_tokens=6).token_ids
            == engine.generate(follow, memory=alone, max_new_tokens=6).token_ids)


def _counting_reads(engine, monkeypatch) -> list[int]:
    """Record how many tokens each engine.read call reads (the real read still runs)."""
    counts: list[int] = []
    real_read = engine.read

    def read(memory, ids, **kwargs):
        counts.append(len(ids))
        return real_read(memory, ids, **kwargs)

    monkeypatch.setattr(engine, "read", read)
    return counts


@pytest.mark.parametrize("preset", ["S", "SM+C", "full"])
def test_each_memory_equals_a_separate_read_and_the_haystack_is_read_once(preset, monkeypatch):
    engine = tiny_engine(preset)
    docs = _haystack_documents()
    alone = []
    for ids in docs:
        memory = engine.new_memory()
        engine.read(memory, ids)
        alone.append(memory)
    counts = _counting_reads(engine, monkeypatch)
    seen = 0
    for (memory, seconds), ids, reference in zip(read_each(engine, docs), docs, alone):
        assert seconds > 0
        assert memory.num_events > 0 or preset == "full"
        _assert_same_state(memory, reference, engine)
        memory.close()
        reference.close()
        seen += 1
    assert seen == len(docs)
    # The haystack before the last needle is read once: far less than three whole documents.
    chunk = engine.config.chunk_size
    assert sum(counts) < sum(map(len, docs)) - 2 * (round(0.1 * 200) // chunk * chunk)
    assert sum(counts) >= len(docs[-1])
    assert not engine.open_memories()


def test_documents_that_do_not_share_a_prefix_are_read_separately_and_correctly():
    engine = tiny_engine("S")
    docs = [token_ids(120, seed=1), token_ids(90, seed=2), token_ids(120, seed=1)[:70] + [4] * 30]
    for (memory, _), ids in zip(read_each(engine, docs), docs):
        reference = engine.new_memory()
        engine.read(reference, ids)
        _assert_same_state(memory, reference, engine)
        memory.close()
        reference.close()
    assert not engine.open_memories()


def test_stopping_early_closes_the_shared_trunk():
    engine = tiny_engine("S")
    reads = read_each(engine, _haystack_documents())
    memory, _ = next(reads)
    memory.close()
    reads.close()  # the caller stops after the first document
    assert not engine.open_memories()


def test_a_memory_config_of_its_own_is_used_for_every_document():
    """read_each(engine, docs, config): each memory (the trunk's forks too) is read with that config, as a separate
    engine.new_memory(config) read would be."""
    engine = tiny_engine("S")
    config = engine.config.replace(n_local=48, n_mem=48)
    docs = _haystack_documents()
    for (memory, _), ids in zip(read_each(engine, docs, config), docs):
        assert memory.config == config
        reference = engine.new_memory(config)
        engine.read(reference, ids)
        _assert_same_state(memory, reference, engine)
        memory.close()
        reference.close()
    assert not engine.open_memories()


@pytest.mark.parametrize("a, b, shared", [([1, 2, 3], [1, 2, 4], 2), ([1, 2], [1, 2, 3], 2), ([], [1], 0),
                                          ([5, 6], [7, 6], 0), ([1, 2, 3], [1, 2, 3], 3)])
def test_common_prefix_counts_the_shared_leading_tokens(a, b, shared):
    assert common_prefix(a, b) == shared == common_prefix(b, a)


def test_a_prompt_that_does_not_extend_the_memory_names_where_it_departs():
    """The refusal tells the caller which token broke the history (the same common-prefix count read_each uses)."""
    from emllm import MemoryMismatchError

    engine = tiny_engine("S")
    ids = token_ids(60, seed=4)
    memory = engine.new_memory()
    engine.read(memory, ids)
    departed = ids[:17] + [2 if ids[17] != 2 else 3] + ids[18:]
    with pytest.raises(MemoryMismatchError, match="first differ at token 17"):
        engine.generate(departed + [3], memory=memory, max_new_tokens=2)
    memory.close()
