"""What one layer does with its memory in one forward, in order: store, retrieve, attend.

transformers calls ``layer_attention`` in place of each decoder layer's attention (attention.install registers it).
It keeps the chunk's keys and values in the layer's window, retrieves events as the forward's RetrievalPlan says
(scorers rank them, the budgets pick them, their KV is gathered from the store) and only then calls the pure
attention over exactly that KV. Retrieval needs this layer's queries, which exist only inside the model's forward:
that is why it runs here, before attention, rather than before the forward.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from .attention import (attend, attention_given, attention_received, episodic_attention, group_heads, on_device,
                        ungroup_part)
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
    if query.shape[2] == 1:  # a decoding step, of one conversation or several
        out = decoding_attention(layer_index, query, key, value, memories, scaling)
        if not isinstance(emllm_memory, list) and isinstance(memories[0], FailedRow):
            raise memories[0].error  # a lone memory's error is its forward's (EMEngine.forward_rows closes it)
        return out, None
    if len(memories) != 1:
        raise ValueError(f"emllm reads a chunk of {query.shape[2]} tokens into one memory at a time; got "
                         f"{len(memories)} rows: read each conversation's prompt on its own (EMEngine.read).")
    return memory_attention(layer_index, query, key, value, memories[0], scaling), None


@dataclass(frozen=True)
class FailedRow:
    """A row of a batched forward whose own memory raised in some layer: the forward's remaining layers treat it as
    padding, and the engine closes that memory and gives its conversation the error (EMEngine.forward_rows), while
    the other rows finish the forward as they would have alone."""
    memory: EpisodicMemory
    error: Exception


LSE_LANES = 64
"""Each row's log-sum-exps are merged in a row of this many lanes (a multiple of every CPU's vector width): an
elementwise op can give an element another result in a vector lane than in the scalar loop that takes a tensor's
tail (logaddexp: 3% of elements, by one ulp), so a row whose lanes moved with the batch it is in would decode other
tokens together than alone."""


def decoding_attention(layer_index: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       memories: list[EpisodicMemory | FailedRow | None], scaling: float) -> torch.Tensor:
    """One decoding step of every row against its own memory: query [rows, heads, 1, d], key/value
    [rows, kv_heads, 1, d]; returns [rows, 1, heads, d], zeros for a padding row (None: EMEngine.step pads to the
    row block) or a failed one.

    What is the same arithmetic for every row (rotating queries and keys at each row's positions, merging the
    memory part with the window) runs once for all rows; what reads a row's own memory (its window, retrieval, the
    fused kernel) runs row by row: eight conversations pay the small ops of one, not eight times them. A row whose
    memory raises is marked failed in ``memories`` (the list every layer of this forward is given), so one
    conversation's error stays its own. A row's result does not depend on the rows beside it: the shared ops are
    elementwise, and the merge keeps each row in its own lanes (LSE_LANES)."""
    rows, heads = query.shape[:2]
    kv_heads = key.shape[1]
    own = {row: memory for row, memory in enumerate(memories) if isinstance(memory, EpisodicMemory)}
    if not own:
        return torch.zeros_like(query).transpose(1, 2)
    layers = {row: memory.layers[layer_index] for row, memory in own.items()}
    rope = next(iter(layers.values())).rope  # one table per device, shared by every memory of an engine
    lengths = [layers[row].length if row in layers else 0 for row in range(rows)]
    rope.ensure(max(lengths) + 1)
    at_window = on_device(lengths, query.device)                       # each row's new token's window position
    q_local, new_keys = rope.rotate_rows(at_window, query, key)               # [rows, heads | kv, 1, d]
    live = each_row(memories, list(own), lambda row: layers[row].append(key[row], value[row], new_keys[row]))
    q_memory = memory_queries(query, memories, {row: own[row] for row in live}, layers, scaling)
    live = [row for row in live if memories[row] is own[row]]  # retrieving may have failed a row

    parts: dict[int, tuple[torch.Tensor, ...]] = {}

    def attend_row(row: int) -> None:
        layer, memory = layers[row], own[row]
        window = ungroup_part(attend(group_heads(q_local[row:row + 1], kv_heads), layer.window_keys()[None],
                                     layer.window_values()[None], scaling, causal=False), heads, 1)
        in_memory = () if row not in q_memory else ungroup_part(
            attend(q_memory[row], memory_part_keys(layer, memory)[None], layer.memory_values[None], scaling,
                   causal=False, bias=relevance_bias(layer, memory)), heads, 1)
        parts[row] = (*window, *in_memory)

    live = each_row(memories, live, attend_row)
    if not live:
        return torch.zeros_like(query).transpose(1, 2)
    out, lse = merge_rows([parts[row] for row in live])                   # [live, heads, 1, d], [live, heads, 1]
    at = {row: i for i, row in enumerate(live)}

    def record_row(row: int) -> None:  # what this step's attention gave the window (and, if asked, each position)
        layer, memory, row_lse = layers[row], own[row], lse[at[row]:at[row] + 1]
        if memory.config.attention == "episodic":
            layer.defer_received(q_local[row:row + 1], row_lse, scaling)
        if memory.attribution is not None:
            memory_keys = memory_part_keys(layer, memory)[None] if row in q_memory else None
            attribute_token(memory, layer, q_local[row:row + 1], layer.window_keys()[None], q_memory.get(row),
                            memory_keys, row_lse, scaling, relevance_bias(layer, memory))

    each_row(memories, live, record_row)
    if len(live) < rows:  # padding and failed rows attend to nothing
        out = torch.zeros_like(query).index_copy_(0, on_device(live, query.device), out)
    return out.transpose(1, 2)  # [rows, 1, heads, d]


def each_row(memories: list[EpisodicMemory | FailedRow | None], rows: list[int],
             work: Callable[[int], None]) -> list[int]:
    """``work(row)`` for each of ``rows`` (rows whose memories[row] is an EpisodicMemory); returns those it went well
    for. A row whose work raises is marked failed in ``memories`` (FailedRow): its conversation gets the error, the
    others go on as they would alone."""
    done = []
    for row in rows:
        try:
            work(row)
            done.append(row)
        except Exception as error:  # any error of this row's memory is this row's alone
            memory = memories[row]
            if isinstance(memory, EpisodicMemory):
                memories[row] = FailedRow(memory, error)
    return done


def memory_queries(query: torch.Tensor, memories: list[EpisodicMemory | FailedRow | None],
                   own: dict[int, EpisodicMemory], layers: dict[int, LayerMemory],
                   scaling: float) -> dict[int, torch.Tensor]:
    """The decoding query [1, kv, groups, d] of each row of ``own`` (its layer in ``layers``) that has a memory
    part, rotated for that part and grouped by KV head, after retrieving the row's events for this forward (its
    plan permitting): at the fixed memory distance (what retrieval ranks with under either position rule), or under
    memory_positions="ordered" right after the memory part's m keys (at m + its window position). A row whose
    retrieval raises is marked failed in ``memories`` and gets no query."""
    rows, heads, _, d = query.shape
    with_memory = [row for row, memory in own.items() if memory.has_memory_part]
    if not with_memory:
        return {}
    rope, kv_heads = layers[with_memory[0]].rope, layers[with_memory[0]].shape.num_kv_heads
    grouped = (rows, kv_heads, heads // kv_heads, d)
    n_local = [own[row].config.n_local if row in own else 0 for row in range(rows)]
    q_fixed = rope.rotate_rows(on_device(n_local, query.device), query)[0].view(grouped)

    def retrieve_row(row: int) -> None:
        if own[row].plan.retrieve and layers[row].index.size:
            retrieve(layers[row], own[row], q_fixed[row], scaling)

    with_memory = each_row(memories, with_memory, retrieve_row)
    queries = {row: q_fixed[row:row + 1] for row in with_memory}
    ordered = [row for row in with_memory if own[row].config.memory_positions != "fixed"]
    if ordered:
        after = [layers[row].memory_keys.shape[1] + layers[row].length - 1 if row in ordered else 0
                 for row in range(rows)]
        q_after = rope.rotate_rows(on_device(after, query.device), query)[0].view(grouped)
        queries.update({row: q_after[row:row + 1] for row in ordered})
    return queries


def memory_part_keys(layer: LayerMemory, memory: EpisodicMemory) -> torch.Tensor:
    """[kv, m, d] the layer's memory part keys as its position rule places them: all at the fixed distance, or
    with memory_positions="ordered" at 0..m-1."""
    return layer.memory_keys if memory.config.memory_positions == "fixed" else layer.ordered_memory_keys()


def merge_rows(parts: list[tuple[torch.Tensor, ...]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's window part and, where it has one, its memory part as one softmax. parts: per row
    (window out [1, heads, 1, d], window lse [1, heads, 1][, memory out, memory lse]), lse in float32. Returns
    out [rows, heads, 1, d] and lse [rows, heads, 1]. The log-sum-exps are laid out LSE_LANES to a row, so each
    row's elements take the same vector lanes whatever the batch."""
    window_out = torch.cat([part[0] for part in parts])
    window_lse = torch.cat([part[1] for part in parts])
    if all(len(part) == 2 for part in parts):  # nothing in memory yet: the window is the whole softmax
        return window_out, window_lse
    rows, heads = window_lse.shape[:2]
    no_memory = (torch.zeros_like(parts[0][0]), torch.full_like(parts[0][1], float("-inf")))  # weighs nothing
    memory_out = torch.cat([part[2] if len(part) > 2 else no_memory[0] for part in parts])
    memory_lse = torch.cat([part[3] if len(part) > 2 else no_memory[1] for part in parts])
    lanes = -(-heads // LSE_LANES) * LSE_LANES
    lses = torch.nn.functional.pad(torch.stack([window_lse, memory_lse]).view(2, rows, heads),
                                   (0, lanes - heads))                                    # [2, rows, lanes]
    lse = torch.logaddexp(lses[0], lses[1])                                               # [rows, lanes]
    weights = torch.exp(lses - lse)[:, :, :heads, None, None]                             # [2, rows, heads, 1, 1]
    out = window_out.float() * weights[0] + memory_out.float() * weights[1]
    return out.to(window_out.dtype), lse[:, :heads, None]


def memory_attention(layer_index: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     memory: EpisodicMemory, scaling: float) -> torch.Tensor:
    """A chunk of q > 1 tokens read into one memory, in one layer: query [1, heads, q, d], key/value
    [1, kv_heads, q, d]; returns [1, q, heads, d]. (Decoding steps, one token a row: decoding_attention.)"""
    layer = memory.layers[layer_index]
    q, kv_heads = query.shape[2], key.shape[1]

    layer.append(key[0], value[0])
    window = layer.length
    rope = layer.rope
    rope.ensure(window)
    q_local = rope.rotate(query, torch.arange(window - q, window, device=query.device))   # [1, heads, q, d]
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
            q_memory = q_fixed
        else:  # ordered: memory keys at 0..m-1, the window's queries right after them
            m = layer.memory_keys.shape[1]
            q_memory = group_heads(rope.rotate(query, torch.arange(m + window - q, m + window, device=query.device)),
                                   kv_heads)
        memory_keys = memory_part_keys(layer, memory)[None]
    bias = relevance_bias(layer, memory) if q_memory is not None else None
    out, lse = episodic_attention(q_local, keys, values, q_memory, memory_keys,
                                  layer.memory_values[None], scaling, bias)               # [1, heads, q, d]
    if memory.config.attention == "episodic":
        layer.scores[:, :window] += attention_received(q_local, keys, lse, scaling)
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
    # A query-free ranking of the same events under the same pins and the same answer so far (AnswerText's refresh)
    # picks what it picked last time (the contiguity update is idempotent too), so an answer's decoding steps skip
    # ~30 small ops per layer (memory.begin_answer clears the key for each new question).
    plan = memory.plan
    fixed = (layer.index.size, pinned, plan.answer_version) if plan.answering and query_free(scorer) else None
    if fixed is not None and fixed == layer.fixed_retrieval:
        layer.retrievals += 1
        return
    sizes = memory.event_sizes
    similar = plan.similar.get(fixed) if fixed is not None else None
    if similar is None:
        candidates = min(layer.index.size, config.similarity_tokens // config.min_block_size + 1)
        if layer.keeps_key_copy:  # kept current while reading, so an answering forward finds it filled
            layer.stored_keys(memory.store)
        step = ScoringStep(layer, queries, scaling, sizes, memory.store, plan, candidates)
        similar = fill_budget(rank_events(scorer.score(step), candidates, pinned), sizes,
                              config.similarity_tokens).tolist()
        if fixed is not None:  # a query-free ranking is the same in every layer: the others take this one
            plan.similar[fixed] = similar
    neighbours = layer.contiguity.update(similar, sizes, layer.index.size)
    chosen = tuple(sorted(set(similar).union(neighbours)))
    layer.retrievals += 1
    if chosen != layer.retrieved_ids:
        layer.set_retrieved(chosen, *gather_events(memory, layer, chosen)) if chosen else layer.set_retrieved(())
    layer.fixed_retrieval = fixed

