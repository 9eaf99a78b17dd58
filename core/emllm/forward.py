"""What one layer does with its memory in one forward, in order: store, retrieve, attend.

transformers calls ``layer_attention`` in place of each decoder layer's attention (attention.install registers it).
It keeps the chunk's keys and values in the layer's window, retrieves events as the forward's RetrievalPlan says
(scorers rank them, the budgets pick them, their KV is gathered from the store) and only then calls the pure
attention over exactly that KV. Retrieval needs this layer's queries, which exist only inside the model's forward:
that is why it runs here, before attention, rather than before the forward.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .attention import attention_given, attention_received, episodic_attention, group_heads
from .layer_memory import LayerMemory
from .memory import EpisodicMemory
from .retrieval import fill_budget, gather_events
from .scoring import Pinned, ScoringStep, query_free, rank_events


def layer_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                    emllm_memory: EpisodicMemory | list[EpisodicMemory] | None = None,
                    **kwargs) -> tuple[torch.Tensor, None]:
    """The AttentionInterface function: query [rows, heads, q, d], key/value [rows, kv_heads, q, d], un-rotated (the
    rotary module is made the identity; rope.py rotates). Returns [rows, q, heads, d]. One memory per row: a list
    of memories is one decoding step of several conversations (batching.StepBatcher), each row attending to its
    own memory."""
    if emllm_memory is None:
        raise RuntimeError("This model's attention is managed by emllm: run it through EMEngine (which passes an "
                           "episodic memory), or load a fresh copy of the model for plain use.")
    memories: list[Any] = emllm_memory if isinstance(emllm_memory, list) else [emllm_memory]
    if query.shape[0] != len(memories):
        raise ValueError(f"emllm attention needs one episodic memory per row: got {query.shape[0]} rows and "
                         f"{len(memories)} memories; give each conversation its own EpisodicMemory.")
    scaling = query.shape[3] ** -0.5 if scaling is None else scaling
    layer_index: int = getattr(module, "layer_idx")  # noqa: B009 (set by transformers on every attention module)
    if len(memories) == 1:
        return memory_attention(layer_index, query, key, value, memories[0], scaling), None
    return torch.cat([row_attention(layer_index, query, key, value, memories, row, scaling)
                      for row in range(len(memories))]), None


@dataclass(frozen=True)
class FailedRow:
    """A row of a batched forward whose own memory raised in some layer: the forward's remaining layers treat it as
    padding, and the engine closes that memory and gives its conversation the error (EMEngine.forward_rows), while
    the other rows finish the forward as they would have alone."""
    memory: EpisodicMemory
    error: Exception


def row_attention(layer_index: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  memories: list[EpisodicMemory | FailedRow | None], row: int, scaling: float) -> torch.Tensor:
    """One row of a batched forward, [1, q, heads, d]: its memory's attention, or zeros for a padding row (None:
    EMEngine.step pads to the row block) or a failed one. A row whose memory raises is marked failed in
    ``memories`` (the list every layer of this forward is given), so one conversation's error stays its own."""
    memory = memories[row]
    if isinstance(memory, EpisodicMemory):
        try:
            return memory_attention(layer_index, query[row:row + 1], key[row:row + 1], value[row:row + 1], memory,
                                    scaling)
        except Exception as error:  # any error of this row's memory is this row's alone
            memories[row] = FailedRow(memory, error)
    return torch.zeros_like(query[row:row + 1]).transpose(1, 2)


def memory_attention(layer_index: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     memory: EpisodicMemory, scaling: float) -> torch.Tensor:
    """One sequence's attention in one layer against its memory: query [1, heads, q, d], key/value
    [1, kv_heads, q, d]; returns [1, q, heads, d]."""
    layer = memory.layers[layer_index]
    q, kv_heads = query.shape[2], key.shape[1]

    layer.append(key[0], value[0])
    window = layer.length
    rope = layer.rope
    rope.ensure(window)
    q_local = (rope.rotate_at(query, window - 1) if q == 1 else                          # [1, heads, q, d]
               rope.rotate(query, torch.arange(window - q, window, device=query.device)))
    keys, values = layer.window_keys()[None], layer.window_values()[None]                # [1, kv, window, d]
    q_memory = memory_keys = None
    if memory.has_memory_part:
        fixed = memory.config.memory_positions == "fixed"
        retrieving = memory.plan.retrieve and layer.index.size
        # Retrieval ranks with the query at the fixed memory distance under either position rule.
        q_fixed = group_heads(rope.rotate_at(query, memory.config.n_local), kv_heads) if fixed or retrieving else None
        if retrieving and q_fixed is not None:
            retrieve(layer, memory, q_fixed[0], scaling)                                 # q_fixed [1, kv, g*q, d]
        if fixed:
            q_memory, memory_keys = q_fixed, layer.memory_keys
        else:  # ordered: memory keys at 0..m-1, the window's queries right after them
            m = layer.memory_keys.shape[1]
            q_memory = group_heads(rope.rotate(query, torch.arange(m + window - q, m + window, device=query.device)),
                              kv_heads)
            memory_keys = layer.ordered_memory_keys()
        memory_keys = memory_keys[None]
    bias = relevance_bias(layer, memory) if q_memory is not None else None
    out, lse = episodic_attention(q_local, keys, values, q_memory, memory_keys,
                                  layer.memory_values[None], scaling, bias)               # [1, heads, q, d]
    if memory.config.attention == "episodic" and q == 1:  # a decoding step: scored with the next ones, later
        layer.defer_received(q_local, lse, scaling)
    elif memory.config.attention == "episodic":
        layer.scores[:, :window] += attention_received(q_local, keys, lse, scaling)
    if memory.attribution is not None and q == 1:
        attribute_token(memory, layer, q_local, keys, q_memory, memory_keys, lse, scaling, bias)
    return out.transpose(1, 2)  # [1, q, heads, d]


def attribute_token(memory: EpisodicMemory, layer: LayerMemory, q_local: torch.Tensor, keys: torch.Tensor,
                    q_memory: torch.Tensor | None, memory_keys: torch.Tensor | None, lse: torch.Tensor,
                    scaling: float, bias: torch.Tensor | None) -> None:
    """Credit a generated token's attention in this layer to the absolute positions it went to: the local window
    and, in the memory part, the sinks and the retrieved events (EpisodicMemory.attribution)."""
    kv_heads, window = keys.shape[1], keys.shape[2]
    lse = lse[0, :, 0].view(kv_heads, -1)                                                 # [kv, groups]
    mass = [attention_given(group_heads(q_local, kv_heads)[0], keys[0], lse, scaling)]   # [window]
    positions = [torch.arange(memory.local_start, memory.local_start + window)]
    if q_memory is not None and memory_keys is not None:
        mass.append(attention_given(q_memory[0], memory_keys[0], lse, scaling, bias))   # [sinks + retrieved]
        positions.append(memory.memory_positions(layer))
    memory.attribute(torch.cat(positions), torch.cat([m.cpu() for m in mass]))


def relevance_bias(layer: LayerMemory, memory: EpisodicMemory) -> torch.Tensor | None:
    """[sinks + retrieved tokens] the logit bias of EpMAN's differentiating attention (EventText(relevance_bias=...)):
    relevance_bias * (each retrieved event's text cosine - the best retrieved one's) on its tokens, 0 on the sinks;
    None where it is off, outside answering forwards, or with nothing retrieved."""
    strength, scores = memory.relevance_bias, memory.plan.text_scores
    if not strength or scores is None or not layer.retrieved_ids:
        return None
    events = torch.tensor(layer.retrieved_ids)
    sizes = memory.event_sizes[events]
    relevance = scores[events].float()
    per_token = torch.repeat_interleave(strength * (relevance - relevance.max()), sizes)   # [retrieved tokens]
    sinks = layer.memory_keys.shape[1] - per_token.shape[0]
    return torch.cat([torch.zeros(sinks), per_token]).to(layer.memory_keys.device)


def retrieve(layer: LayerMemory, memory: EpisodicMemory, queries: torch.Tensor, scaling: float) -> None:
    """Choose this layer's events for the forward from its queries [kv, rows, d] (rotated at the fixed memory
    distance) and load their KV after the sinks: the config's scorer ranks (pinned events first), the similarity
    budget takes the best, the contiguity buffer adds their neighbours."""
    config = memory.config
    pinned = memory.plan.pinned
    scorer = Pinned(config.scorer, pinned) if pinned else config.scorer
    # A query-free ranking of the same events under the same pins picks what it picked last time (the contiguity
    # update is idempotent too), so an answer's decoding steps skip ~30 small ops per layer (memory.begin_answer
    # clears the key for each new question).
    fixed = (layer.index.size, pinned) if memory.plan.answering and query_free(scorer) else None
    if fixed is not None and fixed == layer.fixed_retrieval:
        layer.retrievals += 1
        return
    sizes = memory.event_sizes
    candidates = min(layer.index.size, config.similarity_tokens // config.min_block_size + 1)
    if layer.keeps_key_copy:  # kept current while reading, so an answering forward finds it filled
        layer.stored_keys(memory.store)
    step = ScoringStep(layer, queries, scaling, sizes, memory.store, memory.plan, candidates)
    similar = fill_budget(rank_events(scorer.score(step), candidates, pinned), sizes,
                          config.similarity_tokens).tolist()
    neighbours = layer.contiguity.update(similar, sizes, layer.index.size)
    chosen = tuple(sorted(set(similar).union(neighbours)))
    layer.retrievals += 1
    if chosen != layer.retrieved_ids:
        layer.set_retrieved(chosen, *gather_events(memory, layer, chosen)) if chosen else layer.set_retrieved(())
    layer.fixed_retrieval = fixed

