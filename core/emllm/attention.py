"""Attention over [sinks | retrieved events | local window] as one softmax: pure tensor math over the KV it is given.

forward.layer_attention plugs into transformers through ``AttentionInterface`` (no model class is patched): it
stores the chunk's KV, retrieves events per the forward's plan, and calls episodic_attention here. The model's
rotary module is given a forward hook that makes it return identity cos/sin, so layers hand us un-rotated queries and
keys; we rotate them ourselves with the model's own table (rope.py):

    local window   queries at their window position, keys at theirs   -> exact relative positions
    memory part    queries at position n_local, keys at position 0    -> one fixed distance (InfLLM)
                   or, with memory_positions="ordered", memory keys at 0..m-1 in input order and the window's
                   queries right after them (at m + their window position): one contiguous context

Shapes (batch 1 per memory): query [1, heads, q, d], key/value [1, kv_heads, q, d]. Query heads are grouped by the
KV head they share (heads = kv_heads * groups, as transformers' repeat_kv orders them), so keys are never copied.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any

import torch
from transformers import AttentionInterface, PreTrainedModel

ATTENTION_NAME = "emllm"


SCORE_QUERIES = 64
"""Query positions per chunk (strided sample, all heads) whose attention probabilities rank tokens for the
event representatives. All queries would double the cost of attention; a sample ranks the same heavy hitters."""


def episodic_attention(q_local: torch.Tensor, window_keys: torch.Tensor, window_values: torch.Tensor,
                       q_memory: torch.Tensor | None, memory_keys: torch.Tensor | None, memory_values: torch.Tensor,
                       scaling: float, memory_bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One softmax over [memory part | local window], computed as fused pieces merged by their log-sum-exp.

    q_local [1, heads, q, d]: the queries rotated at their window positions; window_keys/values [1, kv, window, d]
    (the chunk's own keys last). q_memory [1, kv, groups * q, d]: the queries grouped by KV head and rotated for the
    memory part (None: no memory part yet); memory_keys/values [1, kv, m, d]: sinks then retrieved events;
    memory_bias [m] (float32) is added to every query's logits for the memory keys (None: nothing).
    Returns the output [1, heads, q, d] and its log-sum-exp [1, heads, q] (float32).
    """
    _, heads, q, _ = q_local.shape
    kv_heads = window_keys.shape[1]
    groups = heads // kv_heads
    # The chunk itself (causal), the older window (fully visible), the memory part (fully visible). A single
    # query (decoding) sees the whole window including itself: one unmasked part.
    visible = window_keys.shape[2] - q if q > 1 else window_keys.shape[2]
    # The memory part runs first, so the window's keys are still in cache when attention_received reads them next
    # (a chunk's; decoding steps are summed later, LayerMemory.defer_received); the parts merge in a fixed order.
    memory_part = None
    if q_memory is not None and memory_keys is not None:
        memory_part = ungroup_part(attend(q_memory, memory_keys, memory_values, scaling, causal=False,
                                          bias=memory_bias), heads, q)
    parts = []
    if q > 1:
        parts.append(attend(q_local, _expand(window_keys[:, :, visible:], groups),
                             _expand(window_values[:, :, visible:], groups), scaling, causal=True))
    if visible:
        parts.append(ungroup_part(attend(group_heads(q_local, kv_heads), window_keys[:, :, :visible],
                                      window_values[:, :, :visible], scaling, causal=False), heads, q))
    if memory_part is not None:
        parts.append(memory_part)
    return merge_parts(parts)


def attention_received(q_local: torch.Tensor, keys: torch.Tensor, lse: torch.Tensor, scaling: float) -> torch.Tensor:
    """[kv, window] the attention probability each window key received from a strided sample of the queries (the
    last always among them), summed over the sample and the query heads sharing the key: what picks an event's
    representative tokens. q_local [1, heads, q, d], keys [1, kv, window, d], lse [1, heads, q] from the attention."""
    _, heads, q, _ = q_local.shape
    kv_heads, window = keys.shape[1], keys.shape[2]
    if q == 1:  # a decoding step: its one query sees the whole window
        return received_by_steps(q_local[0, :, 0][None], keys[0], lse[0, :, 0][None],
                                 on_device([window], keys.device), scaling)
    rows = torch.arange(q - 1, -1, -max(1, q // SCORE_QUERIES), device=q_local.device)  # always includes the last
    sample = q_local[:, :, rows]                                                          # [1, heads, s, d]
    grouped = group_heads(sample, kv_heads)[0]                                            # [kv, g*s, d]
    logits = torch.matmul(grouped, keys[0].transpose(1, 2)).float() * scaling            # [kv, g*s, window]
    logits = logits.view(kv_heads, heads // kv_heads, len(rows), window)
    probs = torch.exp(logits - lse[0].view(kv_heads, heads // kv_heads, q)[:, :, rows, None])
    visible = torch.arange(window, device=keys.device)[None, :] <= (window - q + rows)[:, None]  # [s, window]
    return (probs * visible).sum(dim=(1, 2))


def received_by_steps(queries: torch.Tensor, keys: torch.Tensor, lse: torch.Tensor, visible: torch.Tensor,
                      scaling: float) -> torch.Tensor:
    """[kv, window] attention_received for n decoding steps at once: queries [n, heads, d] (each rotated at its
    window position), keys [kv, window, d], lse [n, heads], visible [n] the window keys each step's query saw (its
    own the last). A decoding step's keys are cold in cache by the time it could be scored alone (reading them again
    was a sixth of a batched step); summed later, n steps read the window once (LayerMemory.defer_received)."""
    n, heads, d = queries.shape
    kv_heads, window = keys.shape[0], keys.shape[1]
    groups = heads // kv_heads
    # keys @ queries, not queries @ keys^T: the same products (bit for bit in 16-bit dtypes), 2-3x faster on CPU.
    grouped = queries.view(n, kv_heads, groups, d).permute(1, 3, 0, 2).reshape(kv_heads, d, n * groups)
    logits = torch.matmul(keys, grouped).float().view(kv_heads, window, n, groups) * scaling    # [kv, w, n, g]
    probs = torch.exp(logits - lse.view(n, kv_heads, groups).transpose(0, 1)[:, None])         # [kv, w, n, g]
    seen = torch.arange(window, device=keys.device)[:, None] < visible.to(keys.device)[None]   # [w, n]
    return (probs.sum(dim=3) * seen).sum(dim=2)


def attention_given(query: torch.Tensor, keys: torch.Tensor, lse: torch.Tensor, scaling: float,
                    bias: torch.Tensor | None = None) -> torch.Tensor:
    """[keys] the attention probability one query position gave each key, summed over the heads: what credits an
    answer's token to the text it came from. query [kv, groups, d] (heads grouped by KV head), keys [kv, n, d],
    lse [kv, groups] the log-sum-exp over every part the query attended to; bias [n] as the attention added it."""
    logits = torch.matmul(query, keys.transpose(1, 2)).float() * scaling                 # [kv, groups, n]
    if bias is not None:
        logits = logits + bias.float().to(logits.device)
    return torch.exp(logits - lse.float()[:, :, None]).sum(dim=(0, 1))


def attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float,
            causal: bool, bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention output [1, h, n, d] and its log-sum-exp [1, h, n] (float32), for merging with other parts;
    ``bias`` [keys] is added to the logits of every query (not with causal).

    causal=True is only for a square block (the chunk attending to itself): the fused kernels align a
    rectangular causal mask top-left, the opposite of a window's last rows.
    """
    if causal and query.shape[-2] != key.shape[-2]:
        raise ValueError(f"causal attention needs a square block, got {query.shape[-2]} queries and "
                         f"{key.shape[-2]} keys")
    if key.shape[-2] == 0:  # nothing to attend to (no sinks, nothing retrieved): a part that weighs nothing
        return torch.zeros_like(query), torch.full(query.shape[:-1], float("-inf"), device=query.device)
    kernel, why = kernel_for(query, bias)
    if kernel == "cpu":
        mask = None if bias is None else bias.to(query.dtype).view(1, 1, 1, -1)
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            query, key, value, 0.0, causal, attn_mask=mask, scale=scaling)
        return out, lse.float()
    if kernel in ("flash", "efficient"):
        return attend_fused_cuda(kernel, query, key, value, scaling, causal, bias)
    note_reference(why)
    return attend_reference(query, key, value, scaling, causal, bias)


def kernel_for(query: torch.Tensor, bias: torch.Tensor | None) -> tuple[str, str]:
    """(kernel, why) for one part: "cpu" (PyTorch's CPU flash kernel), cuda_kernel's choice on CUDA, else
    "reference" (other accelerators: no fused kernel here returns the log-sum-exp)."""
    if query.device.type == "cpu":
        return "cpu", "the CPU flash kernel takes every dtype and a bias"
    if query.device.type == "cuda":
        return cuda_kernel(query.dtype, bias is not None, query.shape[-1], _flash_supported(query.device))
    return "reference", f"no fused kernel returning the log-sum-exp is wired for {query.device.type}"


FUSED_HEAD_DIMS = range(8, 257, 8)
"""Head dimensions both CUDA kernels take as they are: multiples of 8 up to 256 (every supported model's head is
64, 128 or 256). Others would need the head padded, which PyTorch's public SDPA does and its kernels do not."""


def cuda_kernel(dtype: torch.dtype, has_bias: bool, head_dim: int, flash: bool = True) -> tuple[str, str]:
    """Which kernel computes one attention part on CUDA, and why: ("flash" | "efficient" | "reference", reason).

    Both fused kernels return the log-sum-exp the parts are merged by, and never hold the [heads, q, keys] logits.
    Flash attention is the faster, but takes only 16-bit inputs and no additive bias; the memory-efficient kernel
    takes float32 and a bias. ``flash``: whether the device runs flash attention (compute capability 8.0 or later).
    A pure function of the inputs' description, so the choice is tested where there is no GPU.
    """
    if head_dim not in FUSED_HEAD_DIMS:
        return "reference", f"head dimension {head_dim} is not a multiple of 8 up to 256"
    if dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return "reference", f"no fused attention kernel takes {dtype}"
    if dtype == torch.float32:
        return "efficient", "flash attention takes only float16 and bfloat16"
    if has_bias:
        return "efficient", "flash attention takes no additive bias"
    if not flash:
        return "efficient", "this GPU predates flash attention (compute capability 8.0)"
    return "flash", "16-bit inputs without a bias"


def attend_fused_cuda(kernel: str, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float,
                      causal: bool, bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """attend through the fused kernel cuda_kernel chose, by PyTorch's aten operators (the public SDPA returns no
    log-sum-exp). Both give the natural-log log-sum-exp in float32; the memory-efficient one pads it along the
    queries to a multiple of 32, so it is cut back to the queries asked."""
    if kernel == "flash":
        return flash_op(query, key, value, causal, scaling)
    mask = None if bias is None else efficient_bias(bias, query.shape[1], query.shape[2], query.dtype)
    out, lse = efficient_op(query, key, value, mask, causal, scaling)
    return out, lse[..., :query.shape[2]]


def flash_op(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, causal: bool,
             scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """aten's flash attention: (output, log-sum-exp [B, H, q] float32). Apart so tests can stand in for it."""
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention(query, key, value, 0.0, causal, False,
                                                                  scale=scaling)[:2]
    return out, lse


def efficient_op(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
                 causal: bool, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """aten's memory-efficient attention: (output, log-sum-exp [B, H, q rounded up to 32] float32)."""
    out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(query, key, value, mask, True, 0.0, causal,
                                                                      scale=scaling)[:2]
    return out, lse


BIAS_ALIGNMENT = 16
"""Elements the memory-efficient kernel's bias rows are padded to (16 bytes or more for every dtype), as PyTorch's
public SDPA pads an attention mask before that kernel."""


def efficient_bias(bias: torch.Tensor, heads: int, queries: int, dtype: torch.dtype) -> torch.Tensor:
    """bias [keys] as the memory-efficient kernel takes it: [1, heads, queries, keys] in the queries' dtype, a
    broadcast view (no copy per head or query) of one row padded to BIAS_ALIGNMENT, its last dimension contiguous.
    The kernel checks the bias's size along every dimension (it does not broadcast size-1 ones itself)."""
    keys = bias.shape[-1]
    row = torch.zeros(-(-keys // BIAS_ALIGNMENT) * BIAS_ALIGNMENT, dtype=dtype, device=bias.device)
    row[:keys] = bias
    return row.view(1, 1, 1, -1)[..., :keys].expand(1, heads, queries, keys)


@functools.cache
def _flash_supported(device: torch.device) -> bool:
    """Whether this CUDA device runs flash attention (Ampere, compute capability 8.0, or later)."""
    return torch.cuda.get_device_capability(device)[0] >= 8


_REFERENCE_NOTED: set[str] = set()


def note_reference(why: str) -> None:
    """Warn once per reason that attention on an accelerator materialises its logits (slower, more memory)."""
    if why not in _REFERENCE_NOTED:
        _REFERENCE_NOTED.add(why)
        warnings.warn(f"emllm attention uses its reference path (materialised logits): {why}.",
                      RuntimeWarning, stacklevel=3)


def attend_reference(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float,
                     causal: bool, bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The same in plain tensor ops: on devices without a fused kernel, and as the reference in tests."""
    logits = torch.matmul(query, key.transpose(-1, -2)).float() * scaling
    if bias is not None:
        logits = logits + bias.float()
    if causal:
        n, m = logits.shape[-2:]
        logits = logits.masked_fill(~causal_mask(n, m, logits.device), float("-inf"))
    lse = torch.logsumexp(logits, dim=-1)
    return torch.matmul(torch.exp(logits - lse[..., None]).to(value.dtype), value), lse


def merge_parts(parts: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    if len(parts) == 1:
        return parts[0]
    # Pairwise logaddexp, not a stacked logsumexp: the same sums in a third of the small ops (a decoding step
    # merges 2 parts per layer and conversation, where each op's dispatch costs more than its arithmetic).
    lse = functools.reduce(torch.logaddexp, [p[1] for p in parts])                # [1, heads, q]
    out = functools.reduce(torch.add, [o.float() * torch.exp(part_lse - lse)[..., None] for o, part_lse in parts])
    return out.to(parts[0][0].dtype), lse


def on_device(values: list[int], device: torch.device) -> torch.Tensor:
    """Per-row integers (positions, row numbers) as a tensor on ``device``, queued behind the work before it: a
    blocking copy to a GPU waits until that work has run, and a decoding step makes several per layer, so the GPU
    would idle while Python queued each layer's next ops. CUDA stages a non-blocking copy from pageable memory at
    once, so the tensor may be dropped straight after; other devices promise no such thing and copy as usual."""
    return torch.tensor(values).to(device, non_blocking=torch.device(device).type == "cuda")


def group_heads(x: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """[1, heads, q, d] -> [1, kv_heads, groups * q, d]: each KV head with all query rows that use it (a view)."""
    return x.reshape(1, kv_heads, -1, x.shape[-1])


def ungroup_part(part: tuple[torch.Tensor, torch.Tensor], heads: int, q: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A part attended with grouped queries (out [1, kv, groups * q, d], lse [1, kv, groups * q]) back in the
    queries' own layout: out [1, heads, q, d], lse [1, heads, q]."""
    out, lse = part
    return out.reshape(1, heads, q, out.shape[-1]), lse.reshape(1, heads, q)


def _expand(x: torch.Tensor, groups: int) -> torch.Tensor:
    """[1, kv, n, d] -> [1, kv * groups, n, d] for the small square chunk part only."""
    return x.repeat_interleave(groups, dim=1) if groups > 1 else x


def causal_mask(q: int, window: int, device: torch.device) -> torch.Tensor:
    """[q, window] True where query i (the last q positions of the window) may see key j."""
    return torch.arange(window, device=device)[None, :] <= torch.arange(window - q, window, device=device)[:, None]


def _identity_rotation(module: torch.nn.Module, args: tuple, output: tuple[torch.Tensor, torch.Tensor]):
    cos, sin = output
    return torch.ones_like(cos), torch.zeros_like(sin)


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's decoder layers in order (``model.model.layers`` in every supported family)."""
    inner: Any = getattr(model, "model", model)  # the decoder stack; transformers types it as a plain Module
    return list(inner.layers)


def find_rotary_module(model: torch.nn.Module) -> torch.nn.Module:
    """The decoder's shared rotary embedding (``model.model.rotary_emb`` in Llama, Mistral, Qwen2/3, Phi-3)."""
    inner = getattr(model, "model", model)
    rotary = getattr(inner, "rotary_emb", None)
    if rotary is None or not hasattr(rotary, "inv_freq"):
        raise ValueError(f"{type(model).__name__} has no shared rotary embedding module (model.rotary_emb); "
                         "emllm supports decoder models with standard RoPE (Llama, Mistral, Qwen2, Qwen3, Phi-3).")
    return rotary


def install(model: PreTrainedModel, layer_attention: Callable[..., Any]) -> torch.nn.Module:
    """Route the model's attention through ``layer_attention`` (forward.layer_attention, which transformers then
    calls in place of each layer's attention); returns the model's rotary module (for the tables).

    Idempotent. After this, the model must be run with an ``emllm_memory=`` keyword (EMEngine does).
    """
    AttentionInterface.register(ATTENTION_NAME, layer_attention)
    rotary = find_rotary_module(model)
    if not getattr(rotary, "_emllm_identity", False):
        rotary.register_forward_hook(_identity_rotation)
        setattr(rotary, "_emllm_identity", True)  # noqa: B010 (a flag on a torch module, not one of its fields)
    model.config._attn_implementation = ATTENTION_NAME
    for sub in model.modules():  # some layers keep their own reference to a (sub-)config
        cfg = getattr(sub, "config", None)
        if cfg is not None and hasattr(cfg, "_attn_implementation"):
            cfg._attn_implementation = ATTENTION_NAME
    return rotary
