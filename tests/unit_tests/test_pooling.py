"""Pooled scoring through the real engine (tiny random Llama): each layer ranks events by the sum of its own and the
earlier layers' standardised scores from the same forward (the first layer by its own alone)."""

from __future__ import annotations

import pytest
import torch

from emllm.retrieval import fill_budget
from emllm.scoring import AttentionMass, Pooled, Representatives, RetrievalPlan, ScoringStep, scorer_from_names

from .tiny import Fixed, Recording, tiny_engine, token_ids


def _standard(scores: torch.Tensor) -> torch.Tensor:
    return (scores - scores.mean()) / scores.std()


def _step(plan: RetrievalPlan) -> ScoringStep:
    return ScoringStep(layer=None, queries=torch.empty(0), scaling=1.0, event_sizes=torch.empty(0), store=None,
                       plan=plan, candidates=None)


def test_the_pool_sums_standardised_scores_within_a_forward_and_starts_afresh_with_the_next():
    first, second = torch.tensor([1.0, 5.0, 2.0, 0.0]), torch.tensor([100.0, -40.0, 10.0, 30.0])
    plan = RetrievalPlan()
    torch.testing.assert_close(Pooled(Fixed(first)).score(_step(plan)), _standard(first))
    torch.testing.assert_close(Pooled(Fixed(second)).score(_step(plan)), _standard(first) + _standard(second))
    # A layer on another scale (here x1000) weighs the same once standardised; a new forward's plan starts afresh.
    plan = RetrievalPlan()
    Pooled(Fixed(first)).score(_step(plan))
    torch.testing.assert_close(Pooled(Fixed(1000 * second)).score(_step(plan)), _standard(first) + _standard(second))
    assert RetrievalPlan().pool is None
    # Equal scores (no evidence either way) add nothing rather than dividing by zero.
    assert torch.equal(Pooled(Fixed(torch.full((3,), 2.0))).score(_step(RetrievalPlan())), torch.zeros(3))


@pytest.mark.parametrize("base", [Representatives(), AttentionMass()], ids=["representatives", "attention"])
def test_later_layers_rank_by_the_pooled_scores(base):
    raw = Recording(base)
    pooled = Recording(Pooled(raw))
    engine = tiny_engine("S", scorer=pooled)
    memory = engine.new_memory()
    engine.read(memory, token_ids(400, seed=3))
    layers = len(memory.layers)
    pools = [(r, p) for (r, _), (p, _) in zip(raw.calls, pooled.calls)]  # (one layer's raw scores, its pool)
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
    with pytest.raises(ValueError, match=r"retrieval pooling must be one of \('none', 'cumulative'\)"):
        scorer_from_names("representatives", "sum")
