"""The attention function every layer calls: one softmax over [sinks | retrieved events | local window].

It plugs into transformers through ``AttentionInterface`` (no model class is patched). The model's rotary module
is given a forward hook that makes it return identity cos/sin, so layers hand us un-rotated queries and keys; we
rotate them ourselves with the model's own table (rope.py):

    local window   queries at their window position, keys at theirs   -> exact relative positions
    memory part    queries at position n_local, keys at position 0    -> one fixed distance (InfLLM)
                   or, with memory_positions="ordered", memory keys at 0..m-1 in input order and the window's
                   queries right after them (at m + their window position): one contiguous context

Shapes (batch 1 per memory): query [1, heads, q, d], key/value [1, kv_heads, q, d]. Query heads are grouped by the
KV head they share (heads = kv_heads * groups, as transformers' repeat_kv orders them), so keys are never copied.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface

from .memory import EpisodicMemory

ATTENTION_NAME = "emllm"


SCORE_QUERIES = 64
"""Query positions per chunk (strided sample, all heads) whose attention probabilities rank tokens for the
event representatives. All queries would double the cost of attention; a sample ranks the same heavy hitters."""


def episodic_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                       emllm_memory: EpisodicMemory | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    if emllm_memory is None:
        raise RuntimeError("This model's attention is managed by emllm: run it through EMEngine (which passes an "
                           "episodic memory), or load a fresh copy of the model for plain use.")
    if query.shape[0] != 1:
        raise ValueError(f"emllm attention runs one sequence per memory (batch 1), got batch {query.shape[0]}; "
                         "give each conversation its own EpisodicMemory.")
    memory = emllm_memory
    layer = memory.layers[module.layer_idx]
    _, heads, q, d = query.shape
    kv_heads = key.shape[1]
    groups = heads // kv_heads
    scaling = d ** -0.5 if scaling is None else scaling

    layer.append(key[0], value[0])
    window = layer.length
    rope = layer.rope
    rope.ensure(window)
    q_local = rope.rotate(query, torch.arange(window - q, window, device=query.device))  # [1, heads, q, d]
    keys, values = layer.window_keys()[None], layer.window_values()[None]                # [1, kv, window, d]
    # One softmax over all parts, computed as fused pieces merged by their log-sum-exp:
    #   the chunk itself (causal), the older window (fully visible), the memory part (fully visible).
    # A single query (decoding) sees the whole window including itself: one unmasked part.
    visible = window - q if q > 1 else window  # keys every query may see
    parts = []
    if q > 1:
        parts.append(_attend(q_local, _expand(keys[:, :, visible:], groups), _expand(values[:, :, visible:], groups),
                             scaling, causal=True))
    if visible:
        parts.append(_grouped(_attend(_group(q_local, kv_heads), keys[:, :, :visible], values[:, :, :visible],
                                      scaling, causal=False), heads, q))
    if memory.has_memory_part:
        retrieving = memory.retrieve_now and layer.index.size
        fixed = memory.config.memory_positions == "fixed"
        # Retrieval ranks with the query at the fixed memory distance under either position rule.
        q_fixed = _group(rope.rotate_at(query, memory.config.n_local), kv_heads) if fixed or retrieving else None
        if retrieving:
            layer.retrieve(q_fixed[0], memory, scaling)                                 # q_fixed [1, kv, g*q, d]
        if fixed:
            q_memory, memory_keys = q_fixed, layer.memory_keys
        else:  # ordered: memory keys at 0..m-1, the window's queries right after them
            m = layer.memory_keys.shape[1]
            q_memory = _group(rope.rotate(query, torch.arange(m + window - q, m + window, device=query.device)),
                              kv_heads)
            memory_keys = layer.ordered_memory_keys()
        parts.append(_grouped(_attend(q_memory, memory_keys[None], layer.memory_values[None], scaling,
                                      causal=False), heads, q))
    out, lse = _merge(parts)                                                            # [1, heads, q, d], [1, heads, q]
    if memory.config.attention == "episodic":
        _accumulate_scores(layer, q_local, keys, lse, scaling, kv_heads)
    return out.transpose(1, 2), None  # [1, q, heads, d]


def _accumulate_scores(layer, q_local: torch.Tensor, keys: torch.Tensor, lse: torch.Tensor, scaling: float,
                       kv_heads: int) -> None:
    """Add the attention probability each window key received from a strided sample of this step's queries."""
    _, heads, q, d = q_local.shape
    window = keys.shape[2]
    rows = torch.arange(q - 1, -1, -max(1, q // SCORE_QUERIES), device=q_local.device)  # always includes the last
    sample = q_local[:, :, rows]                                                          # [1, heads, s, d]
    logits = torch.matmul(_group(sample, kv_heads)[0], keys[0].transpose(1, 2)).float() * scaling  # [kv, g*s, window]
    logits = logits.view(kv_heads, heads // kv_heads, len(rows), window)
    probs = torch.exp(logits - lse[0].view(kv_heads, heads // kv_heads, q)[:, :, rows, None])
    visible = torch.arange(window, device=keys.device)[None, :] <= (window - q + rows)[:, None]  # [s, window]
    layer.scores[:, :window] += (probs * visible).sum(dim=(1, 2))


def _attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float,
            causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention output [1, h, n, d] and its log-sum-exp [1, h, n] (float32), for merging with other parts.

    causal=True is only for a square block (the chunk attending to itself): the fused kernel aligns a
    rectangular causal mask top-left, the opposite of a window's last rows.
    """
    if causal and query.shape[-2] != key.shape[-2]:
        raise ValueError(f"causal attention needs a square block, got {query.shape[-2]} queries and "
                         f"{key.shape[-2]} keys")
    if key.shape[-2] == 0:  # nothing to attend to (no sinks, nothing retrieved): a part that weighs nothing
        return torch.zeros_like(query), torch.full(query.shape[:-1], float("-inf"), device=query.device)
    if query.device.type == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            query, key, value, 0.0, causal, scale=scaling)
        return out, lse.float()
    return attend_reference(query, key, value, scaling, causal)


def attend_reference(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float,
                     causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The same in plain tensor ops: used on accelerators and as the reference in tests."""
    logits = torch.matmul(query, key.transpose(-1, -2)).float() * scaling
    if causal:
        n, m = logits.shape[-2:]
        logits = logits.masked_fill(~_causal_mask(n, m, logits.device), float("-inf"))
    lse = torch.logsumexp(logits, dim=-1)
    return torch.matmul(torch.exp(logits - lse[..., None]).to(value.dtype), value), lse


def _merge(parts: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    if len(parts) == 1:
        return parts[0]
    lse = torch.logsumexp(torch.stack([p[1] for p in parts]), dim=0)             # [1, heads, q]
    out = sum(o.float() * torch.exp(l - lse)[..., None] for o, l in parts)
    return out.to(parts[0][0].dtype), lse


def _group(x: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """[1, heads, q, d] -> [1, kv_heads, groups * q, d]: each KV head with all query rows that use it (a view)."""
    return x.reshape(1, kv_heads, -1, x.shape[-1])


def _grouped(part: tuple[torch.Tensor, torch.Tensor], heads: int, q: int) -> tuple[torch.Tensor, torch.Tensor]:
    out, lse = part
    return out.reshape(1, heads, q, out.shape[-1]), lse.reshape(1, heads, q)


def _expand(x: torch.Tensor, groups: int) -> torch.Tensor:
    """[1, kv, n, d] -> [1, kv * groups, n, d] for the small square chunk part only."""
    return x.repeat_interleave(groups, dim=1) if groups > 1 else x


def _causal_mask(q: int, window: int, device: torch.device) -> torch.Tensor:
    """[q, window] True where query i (the last q positions of the window) may see key j."""
    return torch.arange(window, device=device)[None, :] <= torch.arange(window - q, window, device=device)[:, None]


def _identity_rotation(module: torch.nn.Module, args: tuple, output: tuple[torch.Tensor, torch.Tensor]):
    cos, sin = output
    return torch.ones_like(cos), torch.zeros_like(sin)


def find_rotary_module(model: torch.nn.Module) -> torch.nn.Module:
    """The decoder's shared rotary embedding (``model.model.rotary_emb`` in Llama, Mistral, Qwen2/3, Phi-3)."""
    inner = getattr(model, "model", model)
    rotary = getattr(inner, "rotary_emb", None)
    if rotary is None or not hasattr(rotary, "inv_freq"):
        raise ValueError(f"{type(model).__name__} has no shared rotary embedding module (model.rotary_emb); "
                         "emllm supports decoder models with standard RoPE (Llama, Mistral, Qwen2, Qwen3, Phi-3).")
    return rotary


def install(model: torch.nn.Module) -> torch.nn.Module:
    """Route the model's attention through episodic_attention; returns its rotary module (for the tables).

    Idempotent. After this, the model must be run with an ``emllm_memory=`` keyword (EMEngine does).
    """
    AttentionInterface.register(ATTENTION_NAME, episodic_attention)
    rotary = find_rotary_module(model)
    if not getattr(rotary, "_emllm_identity", False):
        rotary.register_forward_hook(_identity_rotation)
        rotary._emllm_identity = True
    model.config._attn_implementation = ATTENTION_NAME
    for sub in model.modules():  # some layers keep their own reference to a (sub-)config
        cfg = getattr(sub, "config", None)
        if cfg is not None and hasattr(cfg, "_attn_implementation"):
            cfg._attn_implementation = ATTENTION_NAME
    return rotary
