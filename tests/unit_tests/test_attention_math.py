"""Unit tests for the attention arithmetic in emllm.attention: the CPU fused op vs the plain reference,
merging parts by log-sum-exp, and the causal mask of a chunk at the end of its window."""

import json
import subprocess
import sys
import textwrap

import pytest
import torch

from emllm.attention import attend, attend_reference, causal_mask, merge_parts

TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=3e-2, rtol=3e-2)}


def qkv(heads, q, n, d=16, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    make = lambda rows: torch.randn(1, heads, rows, d, generator=g).to(dtype)  # noqa: E731
    return make(q), make(n), make(n)


def naive(query, key, value, scaling, mask=None):
    """Softmax attention written with explicit loops over heads and query rows (float64)."""
    _, heads, q, _ = query.shape
    out = torch.empty(1, heads, q, value.shape[-1], dtype=torch.float64)
    lse = torch.empty(1, heads, q, dtype=torch.float64)
    for h in range(heads):
        for i in range(q):
            logits = (key[0, h].double() @ query[0, h, i].double()) * scaling
            if mask is not None:
                logits = logits[mask[i]]
                vals = value[0, h][mask[i]].double()
            else:
                vals = value[0, h].double()
            lse[0, h, i] = torch.logsumexp(logits, 0)
            out[0, h, i] = torch.softmax(logits, 0) @ vals
    return out, lse


# ----------------------------------------------------------------------------- causal_mask
@pytest.mark.parametrize("q, window", [(1, 1), (1, 7), (4, 4), (3, 9), (6, 10)])
def test_causal_mask_places_queries_at_the_end_of_the_window(q, window):
    mask = causal_mask(q, window, torch.device("cpu"))
    assert mask.shape == (q, window) and mask.dtype == torch.bool
    for i in range(q):
        position = window - q + i
        for j in range(window):
            assert bool(mask[i, j]) == (j <= position)


def test_causal_mask_hand_cases():
    assert causal_mask(1, 4, torch.device("cpu")).tolist() == [[True, True, True, True]]
    assert causal_mask(3, 3, torch.device("cpu")).tolist() == [[True, False, False],
                                                                [True, True, False],
                                                                [True, True, True]]


# ----------------------------------------------------------------------------- attend_reference
@pytest.mark.parametrize("causal, q, n", [(False, 5, 9), (False, 1, 3), (True, 6, 6), (True, 3, 8)])
def test_reference_equals_a_loop(causal, q, n):
    query, key, value = qkv(3, q, n, d=8, seed=q * n)
    scaling = 0.37
    out, lse = attend_reference(query, key, value, scaling, causal)
    mask = causal_mask(q, n, torch.device("cpu")) if causal else None
    want_out, want_lse = naive(query, key, value, scaling, mask)
    assert lse.dtype == torch.float32
    torch.testing.assert_close(out.double(), want_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), want_lse, atol=1e-5, rtol=1e-5)


# ----------------------------------------------------------------------------- attend (CPU fused op)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("causal, q, n", [(False, 7, 13), (False, 1, 40), (False, 64, 20), (True, 9, 9),
                                          (True, 1, 1), (True, 70, 70)])
def test_fused_op_matches_reference(dtype, causal, q, n):
    query, key, value = qkv(4, q, n, dtype=dtype, seed=q + n)
    scaling = 16 ** -0.5
    out, lse = attend(query, key, value, scaling, causal)
    ref_out, ref_lse = attend_reference(query, key, value, scaling, causal)
    assert out.dtype == dtype and out.shape == (1, 4, q, 16)
    assert lse.dtype == torch.float32 and lse.shape == (1, 4, q)
    torch.testing.assert_close(out.float(), ref_out.float(), **TOL[dtype])
    torch.testing.assert_close(lse, ref_lse, **TOL[dtype])


def test_fused_causal_refuses_a_rectangular_block():
    """The fused kernel would align a rectangular causal mask top-left (not as a window's last rows): refused."""
    query, key, value = qkv(2, 3, 8, seed=5)
    with pytest.raises(ValueError, match="square"):
        attend(query, key, value, 0.25, True)
    out, _ = attend_reference(query, key, value, 0.25, True)  # the reference handles it, bottom-right aligned
    assert torch.isfinite(out).all()


# ----------------------------------------------------------------------------- merge_parts
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cuts", [(5,), (1,), (4, 11), (2, 3, 17)])
@pytest.mark.parametrize("fused", [False, True])
def test_merged_parts_equal_one_softmax(dtype, cuts, fused):
    n = 20
    query, key, value = qkv(3, 6, n, dtype=dtype, seed=sum(cuts))
    # widen the logit range so the parts have very different log-sum-exps
    key = (key.float() * 3).to(dtype)
    scaling = 0.25
    edges = [0, *cuts, n]
    part_attention = attend if fused else attend_reference
    parts = [part_attention(query, key[:, :, a:b], value[:, :, a:b], scaling, False) for a, b in zip(edges, edges[1:])]
    out, lse = merge_parts(parts)
    ref_out, ref_lse = attend_reference(query, key, value, scaling, False)
    assert out.dtype == dtype
    torch.testing.assert_close(lse, ref_lse, **TOL[dtype])
    torch.testing.assert_close(out.float(), ref_out.float(), **TOL[dtype])


def test_merge_of_one_part_is_that_part():
    part = attend_reference(*qkv(2, 3, 5), 0.5, False)
    out, lse = merge_parts([part])
    assert out is part[0] and lse is part[1]


def test_merge_is_order_independent():
    query, key, value = qkv(2, 4, 12, seed=3)
    parts = [attend_reference(query, key[:, :, a:b], value[:, :, a:b], 0.3, False) for a, b in [(0, 5), (5, 12)]]
    out_ab, lse_ab = merge_parts(parts)
    out_ba, lse_ba = merge_parts(parts[::-1])
    torch.testing.assert_close(out_ab, out_ba)
    torch.testing.assert_close(lse_ab, lse_ba)


@pytest.mark.parametrize("fused", [False, True])
def test_window_split_into_causal_chunk_and_visible_past(fused):
    """What episodic_attention does: the chunk's own q keys (causal) + the older window keys (all visible)
    must equal one causal softmax over the whole window with the queries at its end."""
    q, window = 5, 14
    query, key, value = qkv(2, q, window, seed=11)
    part_attention = attend if fused else attend_reference
    chunk = part_attention(query, key[:, :, window - q:], value[:, :, window - q:], 0.3, True)
    past = part_attention(query, key[:, :, :window - q], value[:, :, :window - q], 0.3, False)
    out, lse = merge_parts([chunk, past])
    want_out, want_lse = naive(query, key, value, 0.3, causal_mask(q, window, torch.device("cpu")))
    torch.testing.assert_close(out.double(), want_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), want_lse, atol=1e-5, rtol=1e-5)


def test_reference_part_without_keys_is_neutral_in_a_merge():
    query, key, value = qkv(2, 3, 6, seed=2)
    empty = attend_reference(query, key[:, :, :0], value[:, :, :0], 0.3, False)
    assert torch.all(torch.isneginf(empty[1]))
    part = attend_reference(query, key, value, 0.3, False)
    out, lse = merge_parts([part, empty])
    torch.testing.assert_close(out, part[0])
    torch.testing.assert_close(lse, part[1])


def test_fused_part_without_keys_does_not_crash_and_is_neutral():
    # In a subprocess: the failure mode is a signal that would kill pytest itself.
    code = textwrap.dedent("""
        import json, torch
        from emllm.attention import attend, merge_parts
        torch.set_num_threads(1)
        g = torch.Generator().manual_seed(0)
        query, key, value = (torch.randn(1, 2, r, 8, generator=g) for r in (3, 6, 6))
        part = attend(query, key, value, 0.3, False)
        empty = attend(query, key[:, :, :0], value[:, :, :0], 0.3, False)
        out, lse = merge_parts([part, empty])
        print(json.dumps(dict(neg_inf=bool(torch.isneginf(empty[1]).all()),
                              out=float((out - part[0]).abs().max()), lse=float((lse - part[1]).abs().max()))))
    """)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, f"the process died (return code {result.returncode}): {result.stderr[-500:]}"
    values = json.loads(result.stdout)
    assert values["neg_inf"]
    assert values["out"] < 1e-6 and values["lse"] < 1e-6


# ----------------------------------------------------------------------------- a bias on the keys (relevance_bias)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_key_bias_scales_each_keys_weight_by_its_exponential(dtype):
    """Differentiating attention: adding log(w) to a key's logits multiplies its softmax weight by w, in the fused
    op and the reference alike."""
    query, key, value = qkv(2, 5, 12, dtype=dtype, seed=4)
    bias = -torch.linspace(0, 4, 12)
    out, lse = attend(query, key, value, 0.25, False, bias=bias)
    ref_out, ref_lse = attend_reference(query, key, value, 0.25, False, bias)
    torch.testing.assert_close(out.float(), ref_out.float(), **TOL[dtype])
    torch.testing.assert_close(lse, ref_lse, **TOL[dtype])
    logits = torch.matmul(query.double(), key.double().transpose(-1, -2)) * 0.25 + bias.double()
    want = torch.softmax(logits, dim=-1) @ value.double()
    torch.testing.assert_close(out.double(), want, **TOL[dtype])
    plain, _ = attend(query, key, value, 0.25, False, bias=torch.zeros(12))
    torch.testing.assert_close(plain, attend(query, key, value, 0.25, False)[0], atol=0, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("q", [1, 5])
@pytest.mark.parametrize("memory_mass", [0.0, 1.5])
def test_attention_received_is_each_keys_probability_summed_over_its_query_heads(dtype, q, memory_mass):
    """What picks an event's representative tokens: per KV head and window key, the softmax probability the (here
    every: q < SCORE_QUERIES) query of the heads sharing it gave that key, a query seeing keys up to its own
    position. ``memory_mass`` raises the log-sum-exp as a memory part outside the window would, so the window's
    probabilities sum to less than one. Decoding (q = 1) takes its own path; both are checked against loops."""
    from emllm.attention import attention_received

    kv, groups, window, d, scaling = 2, 3, 11, 16, 0.25
    g = torch.Generator().manual_seed(q)
    query = torch.randn(1, kv * groups, q, d, generator=g).to(dtype)
    keys = torch.randn(1, kv, window, d, generator=g).to(dtype)
    want = torch.zeros(kv, window, dtype=torch.float64)
    lse = torch.empty(1, kv * groups, q)
    for head in range(kv * groups):
        for i in range(q):
            seen = window - q + i + 1
            logits = (keys[0, head // groups, :seen].double() @ query[0, head, i].double()) * scaling
            lse[0, head, i] = torch.logsumexp(logits, 0) + memory_mass
            want[head // groups, :seen] += torch.exp(logits - lse[0, head, i].double())
    got = attention_received(query, keys, lse, scaling)
    assert got.shape == (kv, window) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, **TOL[dtype])
    assert torch.all(got[:, : window - q] > 0)  # no key the queries saw is left out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decoding_steps_scored_together_give_each_steps_own_attention_received(dtype):
    """Decoding steps' attention received is summed later in one pass (LayerMemory.defer_received): each step's query
    must count only the keys it saw (the window grew by one key per step), against its own log-sum-exp."""
    from emllm.attention import attention_received, received_by_steps

    kv, groups, window, d, scaling, steps = 2, 3, 13, 16, 0.25, 4
    g = torch.Generator().manual_seed(7)
    keys = torch.randn(kv, window, d, generator=g).to(dtype)
    queries = torch.randn(steps, kv * groups, d, generator=g).to(dtype)
    lse = torch.randn(steps, kv * groups, generator=g) + 3.0
    visible = torch.arange(window - steps + 1, window + 1)  # step i saw the window up to its own key
    want = torch.zeros(kv, window)
    for i in range(steps):
        seen = int(visible[i])
        want[:, :seen] += attention_received(queries[i][None, :, None], keys[None, :, :seen], lse[i][None, :, None],
                                             scaling)
    got = received_by_steps(queries, keys, lse, visible, scaling)
    torch.testing.assert_close(got, want, **TOL[dtype])
