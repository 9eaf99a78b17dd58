"""Unit tests for emllm.retrieval: exact torch k-NN vs faiss, budget filling, the contiguity queue,
the token indices of selected events, and the event representatives of emllm.memory (each against a
plain Python loop)."""

import pytest
import torch
from hypothesis import given, settings, strategies as st

from emllm.layer_memory import event_representatives
from emllm.retrieval import ContiguityBuffer, RepresentativeIndex, fill_budget, token_index_of_events

CPU = torch.device("cpu")
DIM = 24


def random_vectors(n, seed, dim=DIM):
    return torch.randn(n, dim, generator=torch.Generator().manual_seed(seed))


def index_with(vectors, backend, **kwargs):
    index = RepresentativeIndex(vectors.shape[1], CPU, backend=backend, **kwargs)
    index.add(vectors)
    return index


def brute_force(vectors, query, k):
    """Reference: sort all dot products with Python."""
    scores = [(float(v @ query), i) for i, v in enumerate(vectors)]
    scores.sort(reverse=True)
    return [i for _, i in scores[:k]]


# ----------------------------------------------------------------------------- RepresentativeIndex
@pytest.mark.parametrize("k", [1, 3, 10, 57, 200, 500])
def test_torch_and_faiss_agree(k):
    vectors = random_vectors(200, seed=k)
    exact = index_with(vectors, "torch")
    approx = index_with(vectors, "faiss")
    assert not exact.uses_faiss() and approx.uses_faiss()
    for q in range(3):
        query = random_vectors(1, seed=1000 + 10 * k + q)[0]
        scores_t, ids_t = exact.search(query, k)
        scores_f, ids_f = approx.search(query, k)
        assert ids_t.dtype == ids_f.dtype == torch.long
        assert ids_t.tolist() == ids_f.tolist() == brute_force(vectors, query, min(k, 200))
        assert torch.allclose(scores_t, scores_f, rtol=1e-5, atol=1e-4)
        assert torch.all(scores_t[:-1] >= scores_t[1:])  # best first
        assert torch.allclose(scores_t, vectors[ids_t] @ query, atol=1e-5)


@pytest.mark.parametrize("backend", ["torch", "faiss"])
def test_planted_vector_in_query_direction_ranks_first(backend):
    vectors = random_vectors(300, seed=3)
    query = random_vectors(1, seed=4)[0]
    longest = vectors.norm(dim=1).max()
    planted = query / query.norm() * (longest + 0.5)  # by Cauchy-Schwarz it beats every other vector
    vectors = torch.cat([vectors[:123], planted[None], vectors[123:]])
    index = index_with(vectors, backend)
    scores, ids = index.search(query, 5)
    assert ids[0].item() == 123
    assert scores[0].item() == pytest.approx(float(planted @ query), rel=1e-5)


def test_auto_backend_switches_at_faiss_min_events():
    index = RepresentativeIndex(DIM, CPU, backend="auto", faiss_min_events=10)
    vectors = random_vectors(12, seed=5)
    query = random_vectors(1, seed=6)[0]
    index.add(vectors[:9])
    assert not index.uses_faiss()
    assert index.search(query, 4)[1].tolist() == brute_force(vectors[:9], query, 4)
    index.add(vectors[9:10])
    assert index.uses_faiss()
    assert index.search(query, 4)[1].tolist() == brute_force(vectors[:10], query, 4)
    index.add(vectors[10:])
    assert index.search(query, 12)[1].tolist() == brute_force(vectors, query, 12)


def test_adding_after_the_faiss_index_was_built_keeps_it_in_sync():
    vectors = random_vectors(60, seed=7)
    query = random_vectors(1, seed=8)[0]
    faiss_index = index_with(vectors[:20], "faiss")
    torch_index = index_with(vectors[:20], "torch")
    faiss_index.search(query, 5)  # builds the faiss index
    for start in range(20, 60, 7):  # uneven pieces
        piece = vectors[start:start + 7]
        faiss_index.add(piece)
        torch_index.add(piece)
        seen = vectors[:start + len(piece)]
        for k in (1, 8, len(seen)):
            ids_f = faiss_index.search(query, k)[1].tolist()
            assert ids_f == torch_index.search(query, k)[1].tolist() == brute_force(seen, query, k)
    # a new best vector added last is found
    best = query / query.norm() * 100
    faiss_index.add(best[None])
    assert faiss_index.search(query, 1)[1].tolist() == [60]


def test_vectors_survive_growth_in_small_pieces():
    index = RepresentativeIndex(DIM, CPU, backend="torch")
    vectors = random_vectors(150, seed=9)
    start = 0
    for n in [1, 2, 3, 60, 1, 5, 70, 8]:
        index.add(vectors[start:start + n].double())  # converted to float32
        start += n
    assert index.size == 150
    assert index.vectors.dtype == torch.float32
    assert torch.equal(index.vectors, vectors)


def test_the_index_counts_its_spare_capacity_in_its_bytes():
    """A RAM budget counts what the buffer holds, written or not: reused heap memory is resident either way."""
    index = RepresentativeIndex(DIM, CPU, backend="torch")
    index.add(random_vectors(64, seed=11))
    assert index.nbytes == 64 * DIM * 4 == index.nbytes_after(0)  # full: nothing spare
    assert index.nbytes_after(1) == 80 * DIM * 4 and index.nbytes_after(100) == 164 * DIM * 4  # what add() grows to
    index.add(random_vectors(1, seed=12))  # grows by a quarter
    assert index.size == 65 and index.nbytes == 80 * DIM * 4 == index.nbytes_after(15)


@pytest.mark.parametrize("backend", ["torch", "faiss"])
def test_search_of_an_empty_index_or_k_zero(backend):
    index = RepresentativeIndex(DIM, CPU, backend=backend)
    scores, ids = index.search(torch.ones(DIM), 5)
    assert scores.numel() == 0 and ids.numel() == 0 and ids.dtype == torch.long
    index.add(random_vectors(4, seed=10))
    assert index.search(torch.ones(DIM), 0)[1].numel() == 0
    assert sorted(index.search(torch.ones(DIM), 99)[1].tolist()) == [0, 1, 2, 3]


# ----------------------------------------------------------------------------- fill_budget
def L(*values):
    return torch.tensor(values, dtype=torch.long)


@pytest.mark.parametrize("budget, expected", [
    (100, [2, 0, 1]),   # all fit (4 + 5 + 3 = 12)
    (12, [2, 0, 1]),    # exactly
    (11, [2, 0]),
    (9, [2, 0]),
    (8, [2]),           # 0 (size 5) does not fit; 1 (size 3) would, but the prefix stops at the first miss
    (4, [2]),
    (3, []),            # the best event alone exceeds the budget
    (0, []),
])
def test_fill_budget_takes_the_longest_best_first_prefix(budget, expected):
    sizes = L(5, 3, 4)
    assert fill_budget(L(2, 0, 1), sizes, budget).tolist() == expected


def test_fill_budget_first_event_too_large_gives_nothing():
    assert fill_budget(L(0, 1, 2), L(10, 1, 1), 5).tolist() == []


def test_fill_budget_empty():
    assert fill_budget(L(), L(3, 4), 10).tolist() == []


# ----------------------------------------------------------------------------- ContiguityBuffer
def test_contiguity_enqueues_neighbours_not_retrieved_ones():
    buffer = ContiguityBuffer(budget=100, neighbours=1)
    assert buffer.update([3], [10] * 10, num_events=10) == [2, 4]
    buffer = ContiguityBuffer(budget=100, neighbours=1)
    assert sorted(buffer.update([3, 4], [10] * 10, num_events=10)) == [2, 5]  # 3 and 4 are not neighbours here


def test_contiguity_stays_in_range():
    buffer = ContiguityBuffer(budget=100, neighbours=1)
    assert buffer.update([0], [10] * 5, num_events=5) == [1]
    buffer = ContiguityBuffer(budget=100, neighbours=1)
    assert buffer.update([4], [10] * 5, num_events=5) == [3]
    buffer = ContiguityBuffer(budget=100, neighbours=3)
    assert sorted(buffer.update([1], [1] * 3, num_events=3)) == [0, 2]


def test_contiguity_with_two_neighbours_each_side():
    buffer = ContiguityBuffer(budget=100, neighbours=2)
    assert sorted(buffer.update([5], torch.full((10,), 3), num_events=10)) == [3, 4, 6, 7]


def test_contiguity_evicts_oldest_first_over_budget():
    buffer = ContiguityBuffer(budget=30, neighbours=1)
    sizes = [10] * 10
    assert buffer.update([1], sizes, 10) == [0, 2]
    assert buffer.update([5], sizes, 10) == [2, 4, 6]  # 40 > 30 tokens: 0 (oldest) leaves


def test_contiguity_over_budget_keeps_the_best_ranked_events_neighbours():
    # retrieved best first: 7 is the best match, 1 the worst; room for two neighbours
    buffer = ContiguityBuffer(budget=20, neighbours=1)
    assert sorted(buffer.update([7, 4, 1], [10] * 10, 10)) == [6, 8]


def test_contiguity_reenqueued_id_is_refreshed():
    buffer = ContiguityBuffer(budget=40, neighbours=1)
    sizes = [10] * 10
    buffer.update([1], sizes, 10)                         # queue: 0 2
    buffer.update([5], sizes, 10)                         # queue: 0 2 4 6
    assert buffer.update([1], sizes, 10) == [4, 6, 0, 2]  # 0 and 2 refreshed to newest
    assert buffer.update([8], sizes, 10) == [0, 2, 7, 9]  # so 4 and 6 are the oldest and leave


def test_contiguity_respects_token_sizes():
    buffer = ContiguityBuffer(budget=25, neighbours=1)
    sizes = [5, 20, 5, 5, 5, 5]
    assert buffer.update([0], sizes, 6) == [1]         # 20 tokens
    assert buffer.update([3], sizes, 6) == [2, 4]      # 20 + 5 + 5 > 25: event 1 leaves


def test_contiguity_event_larger_than_budget_is_dropped():
    buffer = ContiguityBuffer(budget=5, neighbours=1)
    assert buffer.update([1], [10, 1, 10], 3) == []


@pytest.mark.parametrize("budget", [0, -4])
def test_contiguity_zero_budget_is_always_empty(budget):
    buffer = ContiguityBuffer(budget=budget, neighbours=2)
    for retrieved in ([3], [0, 9], [5, 6, 7]):
        assert buffer.update(retrieved, [1] * 10, 10) == []


def test_contiguity_total_never_exceeds_budget():
    generator = torch.Generator().manual_seed(11)
    sizes = torch.randint(1, 12, (40,), generator=generator)
    buffer = ContiguityBuffer(budget=30, neighbours=2)
    for _ in range(50):
        retrieved = torch.randperm(40, generator=generator)[:3].tolist()
        returned = buffer.update(retrieved, sizes, 40)
        assert sum(int(sizes[e]) for e in returned) <= 30
        assert not set(returned) & set(retrieved)
        assert len(set(returned)) == len(returned)


# ----------------------------------------------------------------------------- token_index_of_events
def loop_reference(event_ids, starts, sizes):
    out = []
    for e in event_ids:
        out.extend(range(starts[e], starts[e] + sizes[e]))
    return out


def _spaced_starts(draw, sizes: list[int], max_gap: int) -> tuple[list[int], int]:
    """Event starts laid out in order with random gaps; returns (starts, end of the last event)."""
    gaps = draw(st.lists(st.integers(0, max_gap), min_size=len(sizes), max_size=len(sizes)))
    starts, position = [], 0
    for size, gap in zip(sizes, gaps):
        position += gap
        starts.append(position)
        position += size
    return starts, position


@st.composite
def events_and_selection(draw):
    sizes = draw(st.lists(st.integers(1, 7), min_size=1, max_size=15))
    starts, position = _spaced_starts(draw, sizes, max_gap=5)
    selection = draw(st.lists(st.integers(0, len(sizes) - 1), max_size=len(sizes), unique=True))
    if draw(st.booleans()):
        selection.sort()
    return starts, sizes, selection


@settings(max_examples=60, deadline=None)
@given(events_and_selection())
def test_token_index_of_events_matches_a_loop(case):
    starts, sizes, selection = case
    result = token_index_of_events(torch.tensor(selection, dtype=torch.long), torch.tensor(starts),
                                   torch.tensor(sizes))
    assert result.dtype == torch.long
    assert result.tolist() == loop_reference(selection, starts, sizes)


def test_token_index_of_events_empty_selection():
    result = token_index_of_events(L(), L(0, 4), L(4, 2))
    assert result.dtype == torch.long and result.numel() == 0


def test_token_index_of_events_hand_case():
    starts, sizes = L(0, 3, 10, 12), L(3, 7, 2, 1)
    assert token_index_of_events(L(3, 0, 2), starts, sizes).tolist() == [12, 0, 1, 2, 10, 11]


# ----------------------------------------------------------------------------- event representatives
def representatives_loop(keys, scores, starts, sizes, topk):
    """Per event and KV head, the mean key of its topk highest-scoring tokens (all of them if fewer)."""
    kv, _, d = keys.shape
    rows = []
    for start, size in zip(starts, sizes):
        heads = []
        for h in range(kv):
            tokens = list(range(start, start + size))
            tokens.sort(key=lambda t: float(scores[h, t]), reverse=True)
            best = tokens[:topk]
            heads.append(torch.stack([keys[h, t].double() for t in best]).mean(0))
        rows.append(torch.cat(heads))
    return torch.stack(rows)


@st.composite
def representative_cases(draw):
    kv, d = draw(st.integers(1, 3)), draw(st.integers(1, 5))
    sizes = draw(st.lists(st.integers(1, 9), min_size=1, max_size=8))
    starts, position = _spaced_starts(draw, sizes, max_gap=3)
    n = position + draw(st.integers(0, 3))
    return kv, d, n, starts, sizes, draw(st.integers(1, 6)), draw(st.integers(0, 2**31 - 1))


@settings(max_examples=60, deadline=None)
@given(representative_cases(), st.sampled_from([torch.float32, torch.bfloat16]))
def test_event_representatives_match_a_loop(case, dtype):
    kv, d, n, starts, sizes, topk, seed = case
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(kv, n, d, generator=g).to(dtype)
    scores = torch.rand(kv, n, generator=g)  # distinct almost surely: no ties in the top-k
    result = event_representatives(keys, scores, torch.tensor(starts), torch.tensor(sizes), topk)
    assert result.dtype == torch.float32 and result.shape == (len(sizes), kv * d)
    want = representatives_loop(keys, scores, starts, sizes, topk)
    torch.testing.assert_close(result.double(), want, atol=1e-6, rtol=1e-6)


def test_event_representatives_hand_case():
    # one head, d=1: key value = token index; scores pick tokens 2 and 0 of event 0, token 4 of event 1
    keys = torch.arange(6, dtype=torch.float32).view(1, 6, 1)
    scores = torch.tensor([[0.5, 0.1, 0.9, 0.0, 0.7, 0.3]])
    result = event_representatives(keys, scores, torch.tensor([0, 4]), torch.tensor([3, 1]), topk=2)
    assert result.tolist() == [[1.0], [4.0]]  # mean(2, 0); event 1 is shorter than topk: its only token


# ----------------------------------------------------------------------------- attention scoring
def attention_mass_by_loops(queries, keys, sizes, scaling):
    """Reference: for each KV head and query row, softmax over every stored token; average rows, sum heads, add
    each token's probability to its event (plain Python over events)."""
    kv, rows, _ = queries.shape
    probs = torch.softmax(torch.einsum("krd,knd->krn", queries.double(), keys.double()) * scaling, dim=-1)
    per_token = probs.sum(dim=(0, 1)) / rows
    out, start = [], 0
    for size in sizes.tolist():
        out.append(float(per_token[start:start + size].sum()))
        start += size
    return torch.tensor(out, dtype=torch.float64)


@pytest.mark.parametrize("max_elements", [1 << 25, 50])  # 50: one query row per block, the bounded-memory path
def test_attention_mass_per_event_matches_softmax_attention(max_elements):
    from emllm.retrieval import attention_mass_per_event

    g = torch.Generator().manual_seed(0)
    sizes = torch.tensor([3, 8, 1, 5, 12])
    queries, keys = torch.randn(2, 7, 16, generator=g), torch.randn(2, int(sizes.sum()), 16, generator=g)
    mass = attention_mass_per_event(queries, keys, sizes, 0.25, max_elements=max_elements)
    assert mass.shape == (5,) and mass.dtype == torch.float32
    assert torch.allclose(mass.double(), attention_mass_by_loops(queries, keys, sizes, 0.25), atol=1e-5)
    assert torch.isclose(mass.sum(), torch.tensor(2.0))  # a distribution per KV head, summed over 2 heads


def test_attention_scoring_finds_the_event_the_queries_attend_to_even_when_representatives_miss_it():
    """The failure it fixes: an event whose important-token keys (its representative) point away from the query,
    but one of whose tokens the query attends to strongly. Representatives rank it last; attention ranks it first."""
    from emllm.retrieval import attention_mass_per_event

    g = torch.Generator().manual_seed(1)
    d, sizes = 16, torch.tensor([6, 6, 6])
    query = torch.randn(1, 1, d, generator=g)
    keys = torch.randn(1, 18, d, generator=g) * 0.1
    keys[0, 12:] -= query[0, 0]             # event 2's tokens point away from the query ...
    keys[0, 15] = 4 * query[0, 0]           # ... except one, the "needle", which the query matches
    representatives = torch.stack([keys[0, 0:6].mean(0), keys[0, 6:12].mean(0), keys[0, 12:18].mean(0)])
    assert int(torch.argmin(representatives @ query[0, 0])) == 2
    assert int(torch.argmax(attention_mass_per_event(query, keys, sizes, d ** -0.5))) == 2
