"""memory_positions="ordered" through the real engine (tiny random Llama): sinks and retrieved events laid out in
input order before the window. With every evicted event retrieved that is the whole input at its true positions, so
the engine must compute exactly what the unmodified model computes; the paper's "fixed" positions must not.
(Saving and loading the setting: test_retrieval_scoring.py.)"""

from __future__ import annotations

import pytest
import torch

from .tiny import TINY, tiny_engine, tiny_model, token_ids

ROOMY = dict(n_mem=384)  # holds every event of a 300-token input: each retrieval takes them all


def _chunked_logits(engine, ids: list[int]) -> tuple[torch.Tensor, object]:
    memory = engine.new_memory()
    memory.track_surprise = True  # every position's logits
    chunk = engine.config.chunk_size
    with torch.no_grad():
        logits = torch.cat([engine.forward(memory, torch.tensor(ids[i:i + chunk]), retrieve=True)
                            for i in range(0, len(ids), chunk)])
    return logits, memory


def _vanilla_logits(ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return tiny_model()(torch.tensor([ids])).logits[0]


@pytest.mark.parametrize("preset", ["S", "SM", "F"])
def test_ordered_layout_with_every_event_retrieved_is_the_vanilla_model(preset):
    ids = token_ids(300, seed=7)
    logits, memory = _chunked_logits(tiny_engine(preset, memory_positions="ordered", **ROOMY), ids)
    assert memory.num_events > 5 and memory.store.num_tokens > 200
    for layer in memory.layers:  # the last retrieval took every event stored by then (the last chunk's come later)
        assert layer.retrieved_ids == tuple(range(len(layer.retrieved_ids))) and len(layer.retrieved_ids) > 5
    torch.testing.assert_close(logits, _vanilla_logits(ids), rtol=0, atol=1e-4)
    memory.close()


def test_fixed_layout_with_the_same_events_is_not_the_vanilla_model():
    ids = token_ids(300, seed=7)
    logits, memory = _chunked_logits(tiny_engine("S", **ROOMY), ids)
    reference = _vanilla_logits(ids)
    fits = TINY["n_init"] + TINY["n_local"]
    torch.testing.assert_close(logits[:fits], reference[:fits], rtol=0, atol=1e-4)  # before any eviction: equal
    assert (logits[-50:] - reference[-50:]).abs().max() > 1e-2
    memory.close()


def test_ordered_decoding_matches_the_vanilla_model_token_by_token():
    """The decode path (one query at a time, retrieval per token) lays the memory out the same way."""
    engine = tiny_engine("S", memory_positions="ordered", **ROOMY)
    ids = token_ids(260, seed=8)
    memory = engine.new_memory()
    engine.read(memory, ids[:240])
    with torch.no_grad():
        steps = [engine.forward(memory, torch.tensor([t]), retrieve=True)[-1] for t in ids[240:]]
    assert memory.num_events > 5
    torch.testing.assert_close(torch.stack(steps), _vanilla_logits(ids)[240:], rtol=0, atol=1e-4)
    memory.close()

