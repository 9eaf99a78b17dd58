"""The CUDA attention path, covered where there is no GPU: which kernel each part takes, the bias as the
memory-efficient kernel wants it, and the wiring around aten's fused operators (log-sum-exp cut back, outputs in
the kernels' layouts, grouped query heads, merging), with stand-ins that keep those operators' contracts. The
kernels themselves are checked against the reference on a GPU by benchmarks/cuda_check.py."""

import warnings

import pytest
import torch

from emllm import attention
from emllm.attention import (BIAS_ALIGNMENT, attend_fused_cuda, attend_reference, cuda_kernel, efficient_bias,
                             episodic_attention, group_heads, kernel_for)

TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=3e-2, rtol=3e-2),
       torch.float16: dict(atol=3e-3, rtol=3e-3)}


def fake_flash(query, key, value, causal, scaling):
    """aten's flash attention as a contract: 16-bit q/k/v with equal heads and a contiguous last dimension; the
    output [B, H, q, d] laid out as [B, q, H, d] in memory, the log-sum-exp [B, H, q] float32."""
    assert query.dtype in (torch.float16, torch.bfloat16) and key.dtype == value.dtype == query.dtype
    assert query.shape[1] == key.shape[1] == value.shape[1]
    assert query.stride(-1) == key.stride(-1) == value.stride(-1) == 1
    out, lse = attend_reference(query, key, value, scaling, causal)
    return out.transpose(1, 2).contiguous().transpose(1, 2), lse


def fake_efficient(query, key, value, mask, causal, scaling):
    """aten's memory-efficient attention as a contract: a bias of exactly [B, H, q, keys] in the queries' dtype,
    last dimension contiguous, every stride of a dimension longer than one aligned; the log-sum-exp padded along
    the queries to a multiple of 32 (NaN there, so an uncut one shows)."""
    assert query.shape[1] == key.shape[1] == value.shape[1]
    logits = torch.matmul(query, key.transpose(-1, -2)).float() * scaling
    if mask is not None:
        b, h, q, n = query.shape[0], query.shape[1], query.shape[2], key.shape[2]
        assert mask.dim() == 4 and tuple(mask.shape) == (b, h, q, n) and mask.dtype == query.dtype
        assert mask.stride(-1) == 1
        align = 16 // mask.element_size()
        assert all(mask.stride(i) % align == 0 for i in range(3) if mask.shape[i] > 1)
        assert mask.data_ptr() % 16 == 0
        logits = logits + mask.float()
    if causal:
        n, m = logits.shape[-2:]
        logits = logits.masked_fill(~attention.causal_mask(n, m, logits.device), float("-inf"))
    lse = torch.logsumexp(logits, dim=-1)
    out = torch.matmul(torch.exp(logits - lse[..., None]).to(value.dtype), value)
    padded = torch.full((*lse.shape[:-1], -(-lse.shape[-1] // 32) * 32), float("nan"))
    padded[..., :lse.shape[-1]] = lse
    return out, padded


@pytest.fixture
def fused_on_cpu(monkeypatch):
    """Route attend on CPU tensors through cuda_kernel's choice and the stand-in operators."""
    monkeypatch.setattr(attention, "flash_op", fake_flash)
    monkeypatch.setattr(attention, "efficient_op", fake_efficient)
    chosen = []

    def route(query, bias):
        kernel = cuda_kernel(query.dtype, bias is not None, query.shape[-1])
        chosen.append(kernel[0])
        return kernel

    monkeypatch.setattr(attention, "kernel_for", route)
    return chosen


def qkv(heads, q, n, d=16, dtype=torch.float32, seed=0, kv_heads=None):
    g = torch.Generator().manual_seed(seed)
    make = lambda h, rows: torch.randn(1, h, rows, d, generator=g).to(dtype)  # noqa: E731
    return make(heads, q), make(kv_heads or heads, n), make(kv_heads or heads, n)


# ----------------------------------------------------------------------------- the choice
@pytest.mark.parametrize("dtype, bias, head_dim, flash, kernel", [
    (torch.bfloat16, False, 128, True, "flash"),
    (torch.float16, False, 64, True, "flash"),
    (torch.bfloat16, False, 256, True, "flash"),
    (torch.bfloat16, True, 128, True, "efficient"),
    (torch.float32, False, 64, True, "efficient"),
    (torch.float32, True, 64, True, "efficient"),
    (torch.bfloat16, False, 128, False, "efficient"),   # a GPU before compute capability 8.0
    (torch.float64, False, 64, True, "reference"),
    (torch.bfloat16, False, 100, True, "reference"),    # not a multiple of 8
    (torch.bfloat16, False, 264, True, "reference"),    # past 256
    (torch.float32, True, 4, True, "reference"),
])
def test_cuda_kernel_choice(dtype, bias, head_dim, flash, kernel):
    chosen, why = cuda_kernel(dtype, bias, head_dim, flash)
    assert chosen == kernel and why


def test_reference_reasons_name_the_cause():
    assert "head dimension 100" in cuda_kernel(torch.bfloat16, False, 100)[1]
    assert "float64" in cuda_kernel(torch.float64, False, 64)[1]


def test_kernel_for_keeps_cpu_on_the_cpu_kernel_and_other_devices_on_the_reference():
    assert kernel_for(torch.zeros(1, 2, 3, 8), None)[0] == "cpu"
    assert kernel_for(torch.zeros(1, 2, 3, 8), torch.zeros(4))[0] == "cpu"
    kernel, why = kernel_for(torch.zeros(1, 2, 3, 8, device="meta"), None)
    assert kernel == "reference" and "meta" in why


def test_reference_path_warns_once_per_reason():
    reason = "a reason only this test gives"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        attention.note_reference(reason)
        attention.note_reference(reason)
    assert len([w for w in caught if reason in str(w.message)]) == 1


# ----------------------------------------------------------------------------- the bias
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("keys, heads, queries", [(5, 3, 7), (16, 2, 1), (33, 1, 4), (1, 4, 40)])
def test_efficient_bias_is_a_broadcast_view_of_one_padded_row(dtype, keys, heads, queries):
    bias = torch.linspace(-2, 0, keys)
    mask = efficient_bias(bias, heads, queries, dtype)
    assert tuple(mask.shape) == (1, heads, queries, keys) and mask.dtype == dtype
    assert mask.stride(-1) == 1
    for dim in range(3):  # a broadcast dimension reads the one row again; the others step by its padded length
        assert mask.stride(dim) == 0 if mask.shape[dim] > 1 else mask.stride(dim) % BIAS_ALIGNMENT == 0
    assert mask.untyped_storage().nbytes() == mask.stride(0) * mask.element_size()  # one row, no copies
    torch.testing.assert_close(mask.float(), bias.to(dtype).float().expand(1, heads, queries, keys))


# ----------------------------------------------------------------------------- the operators' wiring
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("causal, q, n", [(False, 7, 13), (False, 1, 40), (False, 33, 20), (True, 9, 9),
                                          (True, 40, 40)])
def test_fused_path_matches_reference(fused_on_cpu, dtype, causal, q, n):
    query, key, value = qkv(4, q, n, dtype=dtype, seed=q + n)
    out, lse = attention.attend(query, key, value, 16 ** -0.5, causal)
    ref_out, ref_lse = attend_reference(query, key, value, 16 ** -0.5, causal)
    assert fused_on_cpu == ["efficient" if dtype == torch.float32 else "flash"]
    assert out.shape == ref_out.shape and lse.shape == ref_lse.shape and lse.dtype == torch.float32
    torch.testing.assert_close(out.float(), ref_out.float(), **TOL[dtype])
    torch.testing.assert_close(lse, ref_lse, **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("q", [1, 5, 40])
def test_fused_path_with_a_bias_takes_the_efficient_kernel(fused_on_cpu, dtype, q):
    query, key, value = qkv(2, q, 11, dtype=dtype, seed=q)
    bias = -0.25 * torch.arange(11, dtype=torch.float32)   # exact in bfloat16
    out, lse = attention.attend(query, key, value, 0.25, False, bias)
    ref_out, ref_lse = attend_reference(query, key, value, 0.25, False, bias)
    assert fused_on_cpu == ["efficient"] and lse.shape == (1, 2, q) and not lse.isnan().any()
    torch.testing.assert_close(out.float(), ref_out.float(), **TOL[dtype])
    torch.testing.assert_close(lse, ref_lse, **TOL[dtype])


def test_attend_fused_cuda_cuts_the_padded_log_sum_exp(monkeypatch):
    monkeypatch.setattr(attention, "efficient_op", fake_efficient)
    query, key, value = qkv(3, 5, 8)
    _, lse = attend_fused_cuda("efficient", query, key, value, 0.3, False)
    assert lse.shape == (1, 3, 5) and not lse.isnan().any()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("q, window, memory, with_bias", [(6, 20, 9, False), (6, 20, 9, True), (1, 20, 9, False),
                                                          (1, 20, 9, True), (8, 8, 0, False), (5, 30, 17, True)])
def test_episodic_attention_through_the_fused_path_equals_the_cpu_path(fused_on_cpu, dtype, q, window, memory,
                                                                     with_bias):
    """Grouped query heads (6 heads over 2 KV heads) through every part: the chunk's causal square, the older
    window, the memory part with its bias; merged by log-sum-exp as on CPU."""
    heads, kv, d = 6, 2, 16
    q_local, keys, values = qkv(heads, q, window, d, dtype, seed=window + q, kv_heads=kv)
    _, memory_keys, memory_values = qkv(heads, 1, memory, d, dtype, seed=memory, kv_heads=kv)
    q_memory = group_heads(qkv(heads, q, 1, d, dtype, seed=99)[0], kv)
    bias = -0.5 * torch.arange(memory, dtype=torch.float32) if with_bias else None
    args = (q_local, keys, values, q_memory, memory_keys, memory_values, d ** -0.5, bias)
    out, lse = episodic_attention(*args)
    assert fused_on_cpu and ("efficient" in fused_on_cpu) == (dtype == torch.float32 or with_bias)
    with pytest.MonkeyPatch.context() as undo:
        undo.setattr(attention, "kernel_for", lambda query, bias: ("cpu", ""))
        want_out, want_lse = episodic_attention(*args)
    torch.testing.assert_close(out.float(), want_out.float(), **TOL[dtype])
    torch.testing.assert_close(lse, want_lse, **TOL[dtype])
