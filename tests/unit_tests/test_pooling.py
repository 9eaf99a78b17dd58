"""retrieval_pooling="cumulative" through the real engine (tiny random Llama): each layer ranks events by the sum of
its own and the earlier layers' standardised scores from the same forward (the first layer by its own alone); bad
values are refused."""

from __future__ import annotations

import pytest
import torch

from emllm import EMConfig
from emllm.config import ConfigError
from emllm.memory import EpisodicMemory
from emllm.retrieval import fill_budget

from .tiny import tiny_engine, token_ids


def _standard(scores: torch.Tensor) -> torch.Tensor:
    return (scores - scores.mean()) / scores.std()


def test_the_pool_sums_standardised_scores_within_a_forward_and_starts_afresh_with_the_next():
    memory = tiny_engine("S").new_memory()
    first, second = torch.tensor([1.0, 5.0, 2.0, 0.0]), torch.tensor([100.0, -40.0, 10.0, 30.0])
    memory.begin_forward(True)
    torch.testing.assert_close(memory.pool_scores(first), _standard(first))
    torch.testing.assert_close(memory.pool_scores(second), _standard(first) + _standard(second))
    # A layer on another scale (here x1000) weighs the same once standardised.
    memory.begin_forward(True)
    memory.pool_scores(first)
    torch.testing.assert_close(memory.pool_scores(1000 * second), _standard(first) + _standard(second))
    memory.begin_forward(False)
    assert memory.score_pool is None and not memory.retrieve_now
    # Equal scores (no evidence either way) add nothing rather than dividing by zero.
    memory.begin_forward(True)
    assert torch.equal(memory.pool_scores(torch.full((3,), 2.0)), torch.zeros(3))


@pytest.mark.parametrize("scoring", ["representatives", "attention"])
def test_later_layers_rank_by_the_pooled_scores(monkeypatch, scoring):
    engine = tiny_engine("S", retrieval_scoring=scoring, retrieval_pooling="cumulative")
    pools: list[tuple[torch.Tensor, torch.Tensor]] = []  # (one layer's raw scores, the pool it then ranked by)
    real = EpisodicMemory.pool_scores

    def spy(self, scores):
        pooled = real(self, scores)
        pools.append((scores.clone(), pooled.clone()))
        return pooled

    monkeypatch.setattr(EpisodicMemory, "pool_scores", spy)
    memory = engine.new_memory()
    engine.read(memory, token_ids(400, seed=3))
    layers = len(memory.layers)
    assert memory.num_events > 5 and len(pools) >= 2 * layers and len(pools) % layers == 0  # every layer pools
    (raw_0, pool_0), (raw_1, pool_1) = pools[-2:]  # the last retrieval of the 2-layer model
    torch.testing.assert_close(pool_0, _standard(raw_0))
    torch.testing.assert_close(pool_1, _standard(raw_0) + _standard(raw_1))
    events_then, budget = len(pool_1), memory.config.similarity_tokens
    for layer, pool in zip(memory.layers, (pool_0, pool_1)):
        expected = fill_budget(torch.argsort(pool, descending=True), memory.event_sizes[:events_then], budget)
        assert set(layer.retrieved_ids) == set(expected.tolist())
    # Not vacuous: at some retrieval the second layer's own ranking would have chosen other events.
    sizes = memory.event_sizes
    assert any(set(fill_budget(torch.argsort(raw, descending=True), sizes[:len(raw)], budget).tolist())
               != set(fill_budget(torch.argsort(pool, descending=True), sizes[:len(raw)], budget).tolist())
               for raw, pool in pools[1::layers])
    memory.close()


def test_an_unknown_pooling_is_refused_with_the_choices():
    with pytest.raises(ConfigError, match=r"retrieval_pooling must be one of \('none', 'cumulative'\)"):
        EMConfig(retrieval_pooling="sum")
