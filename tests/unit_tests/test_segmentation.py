"""Unit tests for emllm.segmentation: each function against a direct reference, plus hand-made cases.

The references here are written differently on purpose (Python loops, literal formulas, brute force
over candidates), so an agreement means something.
"""

import math
import sys
from itertools import accumulate
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings, strategies as st

try:
    from emllm import segmentation as seg
except ImportError:  # package not installed: import from the source tree
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "core"))
    from emllm import segmentation as seg

FAST = settings(max_examples=40, deadline=None)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """The tensors here are tiny: intra-op threads only add sync overhead, and on a busy machine they
    stall (this file takes ~4 s on one thread and 20-40 s on two under load)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def lt(values) -> torch.Tensor:
    return torch.tensor(list(values), dtype=torch.long)


# -----------------------------------------------------------------------------
# token_surprise

def _reference_surprise(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """-log_softmax gathered, by the other formula (logsumexp - logit) and in float64."""
    x = logits.double()
    return (torch.logsumexp(x, dim=-1) - x.gather(1, ids[:, None]).squeeze(1)).float()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_token_surprise_matches_log_softmax(dtype):
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(37, 50, generator=g) * 4).to(dtype)
    ids = torch.randint(0, 50, (37,), generator=g)
    for rows in (1, 8, 37, 64):  # several slices, an uneven last slice, one slice
        out = seg.token_surprise(logits, ids, rows_per_slice=rows)
        assert out.dtype == torch.float32 and out.shape == (37,)
        torch.testing.assert_close(out, _reference_surprise(logits, ids), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_token_surprise_large_vocab_slices_agree(dtype):
    g = torch.Generator().manual_seed(1)
    n, vocab = 20, 150_000
    logits = (torch.randn(n, vocab, generator=g) * 3).to(dtype)
    ids = torch.randint(0, vocab, (n,), generator=g)
    ref = _reference_surprise(logits, ids)
    # slices of 1 and 3 rows, and the 4 MB element cap (6 rows at this V) for rows_per_slice=64
    outs = [seg.token_surprise(logits, ids, rows_per_slice=r) for r in (1, 3, 64)]
    for out in outs:
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-4)
        torch.testing.assert_close(out, outs[0], rtol=1e-6, atol=1e-6)  # equal up to fp32 rounding


def test_token_surprise_edge_cases():
    assert seg.token_surprise(torch.zeros(0, 10), torch.zeros(0, dtype=torch.long)).shape == (0,)
    # int32 ids are accepted; a uniform distribution gives log(V) everywhere
    out = seg.token_surprise(torch.zeros(3, 10), torch.tensor([0, 5, 9], dtype=torch.int32))
    torch.testing.assert_close(out, torch.full((3,), math.log(10)))
    with pytest.raises(ValueError):
        seg.token_surprise(torch.zeros(3, 10), torch.zeros(4, dtype=torch.long))
    with pytest.raises(ValueError):
        seg.token_surprise(torch.zeros(3, 10), torch.zeros(3, dtype=torch.long), rows_per_slice=0)


# -----------------------------------------------------------------------------
# surprise_boundary_flags

def f32(values) -> torch.Tensor:
    return torch.tensor(list(values), dtype=torch.float32)


def flagged(flags: torch.Tensor) -> list[int]:
    return torch.nonzero(flags).flatten().tolist()


def _reference_flags(stream: list[float], start: int, gamma: float, tau: int, min_history: int):
    """Python loop over stream[start:]: (flag, margin) per token; margin = distance to the threshold."""
    out = []
    for q in range(start, len(stream)):
        window = [v for v in stream[max(0, q - tau):q] if math.isfinite(v)]
        x = stream[q]
        if len(window) < max(min_history, 1):
            out.append((False, math.inf))
            continue
        mu = math.fsum(window) / len(window)
        sigma = math.sqrt(math.fsum((v - mu) ** 2 for v in window) / len(window))
        threshold = mu + gamma * sigma
        margin = abs(x - threshold) if math.isfinite(x) else math.inf
        out.append((not math.isnan(x) and x > threshold, margin))
    return out


@pytest.mark.parametrize("gamma", [0.0, 1.0, 3.0])
def test_flags_constant_with_one_spike(gamma):
    values = [2.7] * 40  # not a dyadic number: rounding must not flag a constant stretch
    values[25] = 4.0
    assert flagged(seg.surprise_boundary_flags(f32([]), f32(values), gamma=gamma, tau=10)) == [25]


@pytest.mark.parametrize("x, gamma, expected", [
    (2.0, 1.0, False),  # mu + sigma = 2 exactly: strictly greater is required
    (2.0, 0.999, True),
    (3.0, 2.0, False),
    (3.001, 2.0, True),
    (1.0, 0.0, False),
    (1.001, 0.0, True),
    (0.0, -1.0, False),
    (0.001, -1.0, True),
])
def test_flags_threshold_arithmetic(x, gamma, expected):
    # window 0, 2, 0, 2, ...: mu = 1 and the population sigma = 1 (the sample std would be 1.069)
    previous = f32([0.0, 2.0] * 4)
    assert seg.surprise_boundary_flags(previous, f32([x]), gamma=gamma, tau=8).tolist() == [expected]


def test_flags_window_tau_respected():
    stream = [50.0] + [1.0] * 20 + [1.5]
    # tau = 10: the spike at 0 is long out of the window at the end: mu = 1, sigma = 0, 1.5 is flagged
    assert flagged(seg.surprise_boundary_flags(f32([]), f32(stream), gamma=1.0, tau=10)) == [21]
    # tau = 25: the spike is in every window and keeps the threshold high
    assert flagged(seg.surprise_boundary_flags(f32([]), f32(stream), gamma=1.0, tau=25)) == []
    # a long history in previous changes nothing beyond its last tau values
    long_previous = f32([100.0] * 50 + [1.0] * 10)
    assert seg.surprise_boundary_flags(long_previous, f32([1.5]), gamma=1.0, tau=10).tolist() == [True]


def test_flags_min_history():
    stream = [1.0] * 7 + [5.0]
    assert flagged(seg.surprise_boundary_flags(f32([]), f32(stream), gamma=1.0, tau=16, min_history=8)) == []
    assert flagged(seg.surprise_boundary_flags(f32([]), f32(stream), gamma=1.0, tau=16, min_history=7)) == [7]
    with pytest.raises(ValueError):
        seg.surprise_boundary_flags(f32([]), f32(stream), gamma=1.0, tau=4, min_history=8)
    with pytest.raises(ValueError):
        seg.surprise_boundary_flags(f32([]), f32(stream), gamma=1.0, tau=0)
    assert seg.surprise_boundary_flags(f32([1.0] * 8), f32([]), gamma=1.0, tau=8).shape == (0,)


def test_flags_nan_is_absent_and_inf_does_not_poison():
    nan, inf = math.nan, math.inf
    # the first token of a text has no surprise: it fills a window slot but is not counted
    stream = [nan] + [1.0] * 8 + [5.0]
    assert flagged(seg.surprise_boundary_flags(f32([]), f32(stream), 1.0, tau=9, min_history=8)) == [9]
    assert flagged(seg.surprise_boundary_flags(f32([]), f32(stream), 1.0, tau=9, min_history=9)) == []
    # a NaN token is never flagged and is left out of later windows
    stream = [1.0] * 10 + [nan] + [1.0] * 3 + [2.0]
    assert flagged(seg.surprise_boundary_flags(f32([]), f32(stream), 1.0, tau=9)) == [14]
    assert flagged(seg.surprise_boundary_flags(f32([]), f32(stream), 1.0, tau=8)) == []  # 7 values only
    # +inf (probability 0) is flagged but stays out of mu/sigma: the 9 after it is still flagged
    stream = [1.0] * 10 + [inf] + [1.0] * 3 + [9.0]
    assert flagged(seg.surprise_boundary_flags(f32([]), f32(stream), 1.0, tau=20)) == [10, 14]


_surprise_value = st.one_of(
    st.integers(0, 5).map(float),  # exact arithmetic, many ties
    st.floats(0.0, 20.0, allow_nan=False, width=32),
    st.just(math.nan),
)


@FAST
@given(
    values=st.lists(_surprise_value, min_size=0, max_size=80),
    cut=st.integers(0, 80),
    gamma=st.one_of(st.sampled_from([-0.5, 0.0, 0.5, 1.0, 2.0]), st.floats(-1.0, 3.0, width=32)),
    tau=st.integers(1, 20),
    data=st.data(),
)
def test_flags_match_loop_reference_and_split_stream(values, cut, gamma, tau, data):
    min_history = data.draw(st.integers(0, tau), label="min_history")
    stream = [float(v) for v in f32(values).tolist()]  # the float32 values the function sees
    cut = min(cut, len(stream))
    first, second = f32(stream[:cut]), f32(stream[cut:])

    whole = seg.surprise_boundary_flags(f32([]), f32(stream), gamma, tau, min_history)
    split = torch.cat([seg.surprise_boundary_flags(f32([]), first, gamma, tau, min_history),
                       seg.surprise_boundary_flags(first, second, gamma, tau, min_history)])
    assert whole.dtype == torch.bool and whole.shape == (len(stream),)

    ref = _reference_flags(stream, 0, gamma, tau, min_history)
    for i, (flag, margin) in enumerate(ref):
        if margin > 1e-9 * (1.0 + abs(stream[i])):  # skip exact ties, where rounding may decide
            assert bool(whole[i]) == flag, (i, stream, gamma, tau, min_history)
            assert bool(split[i]) == flag, (i, stream, gamma, tau, min_history)


# -----------------------------------------------------------------------------
# fixed_boundaries, enforce_event_sizes

def test_fixed_boundaries():
    assert seg.fixed_boundaries(10, 4).tolist() == [4, 8]
    assert seg.fixed_boundaries(8, 4).tolist() == [4]
    assert seg.fixed_boundaries(3, 4).tolist() == []
    assert seg.fixed_boundaries(0, 4).tolist() == []
    assert seg.fixed_boundaries(10, 4).dtype == torch.long
    with pytest.raises(ValueError):
        seg.fixed_boundaries(10, 0)


def _reference_enforce(bounds: list[int], n: int, min_size: int, max_size: int, last_is_open: bool) -> list[int]:
    """The same rules written over event sizes instead of boundary positions."""
    sizes = [e - s for s, e in zip([0] + bounds, bounds + [n])]
    merged: list[int] = []
    for size in sizes:
        if merged and merged[-1] < min_size:
            merged[-1] += size
        else:
            merged.append(size)
    if not last_is_open and len(merged) > 1 and merged[-1] < min_size:
        tail = merged.pop()
        merged[-1] += tail
    pieces: list[int] = []
    for j, size in enumerate(merged):
        parts = []
        while size > max_size:
            parts.append(max_size)
            size -= max_size
        parts.append(size)
        if len(parts) > 1 and parts[-1] < min_size and not (last_is_open and j == len(merged) - 1):
            parts[-2] -= min_size - parts[-1]
            parts[-1] = min_size
        pieces += parts
    return list(accumulate(pieces))[:-1] if n > 0 else []


def test_enforce_event_sizes_examples():
    # 3 and 5 are too close to 0: both merge forward; 20 closes an event of 20
    assert seg.enforce_event_sizes(lt([3, 5, 20]), 30, 8, 128).tolist() == [20]
    # open last event of 2 stays; closed, it joins the previous one
    assert seg.enforce_event_sizes(lt([10, 28]), 30, 8, 128, last_is_open=True).tolist() == [10, 28]
    assert seg.enforce_event_sizes(lt([10, 28]), 30, 8, 128, last_is_open=False).tolist() == [10]
    # splitting: pieces of max_size from the start, the remainder last
    assert seg.enforce_event_sizes(lt([]), 300, 8, 128).tolist() == [128, 256]
    assert seg.enforce_event_sizes(lt([]), 300, 8, 128, last_is_open=False).tolist() == [128, 256]
    # a closed tail of 4 < min_size: the last cut moves back so the tail is 8
    assert seg.enforce_event_sizes(lt([]), 260, 8, 128, last_is_open=False).tolist() == [128, 252]
    assert seg.enforce_event_sizes(lt([]), 260, 8, 128, last_is_open=True).tolist() == [128, 256]
    assert seg.enforce_event_sizes(lt([260]), 300, 8, 128).tolist() == [128, 252, 260]
    assert seg.enforce_event_sizes(lt([]), 0, 8, 128).tolist() == []
    with pytest.raises(ValueError):
        seg.enforce_event_sizes(lt([]), 100, 8, 14)  # max_size < 2 * min_size - 1
    with pytest.raises(ValueError):
        seg.enforce_event_sizes(lt([5, 3]), 100, 8, 128)  # not sorted
    with pytest.raises(ValueError):
        seg.enforce_event_sizes(lt([0, 3]), 100, 8, 128)  # 0 is not a boundary


@st.composite
def _event_size_case(draw):
    n = draw(st.integers(0, 400))
    bounds = sorted(draw(st.sets(st.integers(1, n - 1), max_size=60))) if n > 1 else []
    min_size = draw(st.integers(0, 12))
    max_size = draw(st.integers(max(1, 2 * min_size - 1), 60))
    return bounds, n, min_size, max_size, draw(st.booleans())


@FAST
@given(case=_event_size_case())
def test_enforce_event_sizes_properties(case):
    bounds, n, min_size, max_size, last_is_open = case
    out = seg.enforce_event_sizes(lt(bounds), n, min_size, max_size, last_is_open)
    assert out.dtype == torch.long
    got = out.tolist()
    assert got == _reference_enforce(bounds, n, min_size, max_size, last_is_open)
    assert got == sorted(set(got)) and all(0 < b < n for b in got)
    sizes = [e - s for s, e in zip([0] + got, got + [n])] if n > 0 else []
    for j, size in enumerate(sizes):
        assert size <= max_size
        is_last = j == len(sizes) - 1
        if not (is_last and (last_is_open or j == 0)):  # the open tail, or a stream shorter than min_size
            assert size >= min_size, (j, sizes)
    again = seg.enforce_event_sizes(out, n, min_size, max_size, last_is_open).tolist()
    assert again == got  # idempotent


# -----------------------------------------------------------------------------
# key_similarity, modularity, conductance

def test_key_similarity():
    g = torch.Generator().manual_seed(2)
    keys = torch.randn(2, 3, 10, 8, generator=g).to(torch.bfloat16)  # [layers, kv_heads, n, head_dim]
    out = seg.key_similarity(keys)
    k = keys.float()
    k = k - k.mean(dim=2, keepdim=True)  # centred per layer and head over the tokens
    ref = torch.einsum("lhid,lhjd->ij", k, k) / 6
    assert out.dtype == torch.float32 and out.shape == (10, 10)
    torch.testing.assert_close(out, ref.clamp_min(0), rtol=1e-5, atol=1e-5)
    assert (out >= 0).all() and (ref < 0).any()  # some similarities were negative and got clamped
    torch.testing.assert_close(out, out.T)
    single = k[0, 0]
    torch.testing.assert_close(seg.key_similarity(keys[0, 0]), (single @ single.T).clamp_min(0), rtol=1e-5, atol=1e-5)


def test_key_similarity_ignores_a_shared_component():
    """A large direction common to all keys (as real keys have) must not swamp the graph."""
    g = torch.Generator().manual_seed(3)
    keys = torch.randn(1, 1, 12, 16, generator=g)
    shifted = keys + 50.0 * torch.ones(16)
    torch.testing.assert_close(seg.key_similarity(shifted), seg.key_similarity(keys), rtol=1e-4, atol=1e-3)


def _loop_modularity(a: list[list[float]], labels: list[int]) -> float:
    n = len(a)
    two_m = sum(map(sum, a))
    k_out = [sum(a[i]) for i in range(n)]
    k_in = [sum(a[i][j] for i in range(n)) for j in range(n)]
    q = sum(a[i][j] - k_out[i] * k_in[j] / two_m for i in range(n) for j in range(n) if labels[i] == labels[j])
    return q / two_m


def _loop_conductance(a: list[list[float]], labels: list[int]) -> float:
    n = len(a)
    best = math.inf
    for community in set(labels):
        inside = [labels[i] == community for i in range(n)]
        cut = sum(a[i][j] for i in range(n) for j in range(n) if inside[i] and not inside[j])
        vol_s = sum(a[i][j] for i in range(n) for j in range(n) if inside[i] and inside[j])
        vol_rest = sum(a[i][j] for i in range(n) for j in range(n) if not inside[i] and not inside[j])
        denom = min(vol_s, vol_rest)
        best = min(best, cut / denom if denom > 0 else math.inf)
    return best


def _labels_of(bounds: list[int], n: int) -> list[int]:
    return [sum(b <= i for b in bounds) for i in range(n)]


@pytest.mark.parametrize("seed", range(6))
def test_modularity_conductance_match_loops(seed):
    g = torch.Generator().manual_seed(seed)
    n = 7
    a = torch.rand(n, n, generator=g)
    if seed % 2:
        a = a + a.T  # symmetric and asymmetric graphs both follow the formulas
    for bounds in ([], [3], [1, 4], [2, 3, 6], list(range(1, n))):
        labels = _labels_of(bounds, n)
        assert seg.modularity(a, lt(bounds)) == pytest.approx(_loop_modularity(a.tolist(), labels), abs=1e-9)
        assert seg.conductance(a, lt(bounds)) == pytest.approx(_loop_conductance(a.tolist(), labels), rel=1e-9)


def _loop_intra_inter(a: list[list[float]], labels: list[int]) -> float:
    n, ratios = len(a), []
    for community in sorted(set(labels)):
        inside = [labels[i] == community for i in range(n)]
        intra = sum(a[i][j] for i in range(n) for j in range(n) if inside[i] and inside[j])
        inter = sum(a[i][j] for i in range(n) for j in range(n) if inside[i] and not inside[j])
        if inter > 0:
            ratios.append(intra / inter)
    return sum(ratios) / len(ratios) if ratios else math.nan


@pytest.mark.parametrize("seed", range(4))
def test_partition_scores_match_the_single_graph_metrics_on_every_graph_of_a_batch(seed):
    g = torch.Generator().manual_seed(seed)
    n = 9
    graphs = torch.rand(2, 3, n, n, generator=g)  # e.g. [layers, heads, n, n]
    graphs[0, 1] = graphs[0, 1] + graphs[0, 1].T
    graphs[1, 2, :, 4:] = 0  # a graph where some communities have no outside weight
    for bounds in ([3], [1, 4], [2, 3, 6], list(range(1, n))):
        scores = seg.partition_scores(graphs, lt(bounds))
        assert all(v.shape == (2, 3) and v.dtype == torch.float64 for v in scores.values())
        for layer in range(2):
            for head in range(3):
                a = graphs[layer, head]
                labels = _labels_of(bounds, n)
                assert float(scores["modularity"][layer, head]) == pytest.approx(seg.modularity(a, lt(bounds)),
                                                                                 abs=1e-9)
                assert float(scores["conductance"][layer, head]) == pytest.approx(seg.conductance(a, lt(bounds)),
                                                                                  rel=1e-9)
                expected = _loop_intra_inter(a.tolist(), labels)
                got = float(scores["intra_inter"][layer, head])
                assert (math.isnan(got) and math.isnan(expected)) or got == pytest.approx(expected, rel=1e-9)


def test_partition_scores_of_one_community_and_of_an_empty_graph():
    a = torch.rand(1, 6, 6)
    one = seg.partition_scores(a, lt([]))
    assert float(one["modularity"][0]) == pytest.approx(0.0, abs=1e-12)  # no structure
    assert float(one["conductance"][0]) == math.inf and math.isnan(float(one["intra_inter"][0]))
    empty = seg.partition_scores(torch.zeros(1, 6, 6), lt([3]))
    assert float(empty["modularity"][0]) == 0.0 and float(empty["conductance"][0]) == math.inf


def test_two_cliques():
    n = 10
    a = torch.zeros(n, n)
    a[:5, :5] = 1.0
    a[5:, 5:] = 1.0
    # two disjoint cliques with self-loops: Q = 1 - 2 * (25/50)^2 = 0.5, and nothing is cut
    assert seg.modularity(a, lt([5])) == pytest.approx(0.5)
    assert seg.conductance(a, lt([5])) == 0.0
    noisy = a + 0.05
    right = seg.modularity(noisy, lt([5]))
    for wrong in ([3], [7], [2, 5], [5, 8]):
        assert seg.modularity(noisy, lt(wrong)) < right
    for wrong in ([3], [7], [2, 6]):  # conductance is the best community's: [2, 5] keeps [5, 10) intact
        assert seg.conductance(noisy, lt(wrong)) > seg.conductance(noisy, lt([5]))
    # one community: no structure (Q = 0) and no complement (conductance inf)
    assert seg.modularity(noisy, lt([])) == pytest.approx(0.0)
    assert seg.conductance(noisy, lt([])) == math.inf
    assert seg.modularity(torch.zeros(4, 4), lt([2])) == 0.0
    assert seg.conductance(torch.zeros(4, 4), lt([2])) == math.inf


# -----------------------------------------------------------------------------
# refine_boundaries

def _brute_force_refine(a: torch.Tensor, bounds: list[int], metric: str) -> list[int]:
    """Alg. 1 with every candidate scored by the reference metric on the 2-part subgraph."""
    n = a.shape[0]
    b = [0] + bounds + [n]
    for i in range(len(bounds)):
        alpha, beta, gamma = b[i], b[i + 1], b[i + 2]
        sub = a[alpha:gamma, alpha:gamma]
        candidates = list(range(alpha + 1, gamma))
        if metric == "modularity":
            scores = [seg.modularity(sub, lt([c - alpha])) for c in candidates]
        else:
            scores = [-seg.conductance(sub, lt([c - alpha])) for c in candidates]
        best = max(scores)
        tol = 1e-9 * max(1.0, abs(best))
        ties = [c for c, s in zip(candidates, scores) if s >= best - tol]
        b[i + 1] = min(ties, key=lambda c: (abs(c - beta), c))
    return b[1:-1]


def _graph(kind: str, n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if kind == "keys":  # the real thing: clamped dot products of random keys
        return seg.key_similarity(torch.randn(2, n, 8, generator=g))
    if kind == "uniform":
        return torch.rand(n, n, generator=g)  # asymmetric: both cut directions matter
    if kind == "int":  # exact sums: ties are real ties
        a = torch.randint(0, 3, (n, n), generator=g).double()
        return a + a.T
    if kind == "sparse":  # many empty blocks: zero volumes, zero cuts, inf conductance
        a = torch.randint(1, 3, (n, n), generator=g).double() * (torch.rand(n, n, generator=g) < 0.08)
        return a + a.T
    return torch.zeros(n, n)  # no edges: every candidate ties, nothing moves


@st.composite
def _refine_case(draw):
    n = draw(st.integers(4, 60))
    bounds = sorted(draw(st.sets(st.integers(1, n - 1), min_size=1, max_size=8)))
    kind = draw(st.sampled_from(["keys", "uniform", "int", "sparse", "zeros"]))
    return n, bounds, kind, draw(st.integers(0, 2**31 - 1))


@settings(max_examples=30, deadline=None)
@given(case=_refine_case())
def test_refine_matches_brute_force(case):
    n, bounds, kind, seed = case
    a = _graph(kind, n, seed)
    for metric in ("modularity", "conductance"):
        out = seg.refine_boundaries(a, lt(bounds), metric)
        assert out.dtype == torch.long and out.shape == (len(bounds),)
        got = out.tolist()
        assert got == _brute_force_refine(a, bounds, metric), (metric, kind)
        assert all(0 < x < n for x in got) and all(x < y for x, y in zip(got, got[1:]))
    if kind == "zeros":
        assert got == bounds


def _planted(edges: list[int], n: int, seed: int) -> torch.Tensor:
    """Keys drawn around one centre per block: high similarity inside blocks, little across."""
    g = torch.Generator().manual_seed(seed)
    centres = torch.randn(len(edges) + 1, 16, generator=g) * 3
    block = torch.tensor(_labels_of(edges, n))
    keys = centres[block] + 0.5 * torch.randn(n, 16, generator=g)
    return seg.key_similarity(keys)


@pytest.mark.parametrize("metric", ["modularity", "conductance"])
def test_refine_finds_planted_edges(metric):
    a = _planted([37], 64, seed=3)
    for start in (30, 44, 37, 2, 62):
        assert seg.refine_boundaries(a, lt([start]), metric).tolist() == [37]
    # three blocks: 24 moves earlier to 20, 41 moves later to 45 (the paper's (alpha, beta] could not)
    a = _planted([20, 45], 64, seed=4)
    assert seg.refine_boundaries(a, lt([24, 41]), metric).tolist() == [20, 45]


@pytest.mark.parametrize("seed", range(4))
def test_refine_asymmetric_graph_matches_brute_force(seed):
    # key graphs are symmetric, but the metrics are defined for any non-negative graph: both cut
    # directions (rows of one part into the other and back) must be handled like the reference
    g = torch.Generator().manual_seed(seed)
    a = torch.rand(48, 48, generator=g) ** 4
    bounds = sorted(torch.randperm(47, generator=g)[:6].add(1).tolist())
    for metric in ("modularity", "conductance"):
        assert seg.refine_boundaries(a, lt(bounds), metric).tolist() == _brute_force_refine(a, bounds, metric)


@pytest.mark.parametrize("seed", range(3))
def test_refine_prefix_sum_noise_is_not_signal(seed):
    # Edges only between the middle [40, 80) and the rest: many candidate parts are empty, and their
    # block sums from the integral image come out as rounding noise (~1e-16 of the total) instead of 0.
    # Noise must not turn an empty part's inf conductance into a finite one and move the boundary.
    g = torch.Generator().manual_seed(seed)
    n = 120
    middle = torch.zeros(n, dtype=torch.bool)
    middle[40:80] = True
    a = torch.rand(n, n, generator=g, dtype=torch.float64) * 100 * (middle[:, None] ^ middle[None, :])
    a = a + a.T
    bounds = [40, 52, 67, 80]
    for metric in ("modularity", "conductance"):
        assert seg.refine_boundaries(a, lt(bounds), metric).tolist() == _brute_force_refine(a, bounds, metric)


def test_refine_ties_keep_boundaries_and_inputs():
    bounds = lt([5, 9, 30])
    ones = torch.ones(40, 40)  # every split of a constant graph has modularity exactly 0
    assert seg.refine_boundaries(ones, bounds, "modularity").tolist() == [5, 9, 30]
    assert seg.refine_boundaries(torch.zeros(40, 40), bounds, "conductance").tolist() == [5, 9, 30]
    assert bounds.tolist() == [5, 9, 30]  # input untouched
    assert seg.refine_boundaries(ones, lt([]), "modularity").tolist() == []
    with pytest.raises(ValueError):
        seg.refine_boundaries(ones, bounds, "density")
    with pytest.raises(ValueError):
        seg.refine_boundaries(ones, lt([0, 5]), "modularity")
    with pytest.raises(ValueError):
        seg.refine_boundaries(torch.ones(4, 5), lt([2]), "modularity")
