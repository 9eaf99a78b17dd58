"""One conversation's episodic memory: attention sinks, the local window, and the events evicted from it.

Token flow (absolute positions count every token read since the memory was created):

    [0, n_init)                 attention sinks, kept forever (exact positions until the first eviction)
    [n_init, n_init + evicted)  events in the PageStore, each a contiguous token range with a representative
    [local_start, total)        the local window, attended with exact relative positions

After every forward pass the engine calls ``evict()``: once the window holds ``max_block_size`` tokens more than
``n_local``, whole events are cut from its oldest part (surprise boundaries, optionally refined, size limits) and
moved to storage. The tokens after the last complete event stay local, so the window is never more than
``n_local + 2 * max_block_size + chunk_size`` tokens long (EMConfig.max_position).
"""

from __future__ import annotations

import copy
import math
import operator
from dataclasses import dataclass

import torch

from . import segmentation
from .config import EMConfig
from .retrieval import (ATTENTION_SCORING_ROWS, ContiguityBuffer, RepresentativeIndex, attention_mass_per_event,
                        fill_budget, token_index_of_events)
from .rope import RotaryTable
from .storage import PageStore


@dataclass(frozen=True)
class RetrievedEvent:
    start: int   # absolute token position of the event's first token
    end: int     # one past its last token
    layers: int  # how many layers hold it in attention


@dataclass(frozen=True)
class ModelShape:
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    max_positions: int


class LayerMemory:
    """The tensors of one layer: local window (raw and rotated keys), sinks, representatives, retrieved KV."""

    def __init__(self, layer_index: int, config: EMConfig, shape: ModelShape, device: torch.device,
                 rope: RotaryTable):
        self.layer_index = layer_index
        self.config, self.shape, self.device, self.rope = config, shape, device, rope
        kv, d = shape.num_kv_heads, shape.head_dim
        capacity = config.max_position() if config.attention == "episodic" else config.chunk_size
        self.keys = torch.empty(kv, capacity, d, dtype=shape.dtype, device=device)        # [kv, cap, d] raw
        self.values = torch.empty_like(self.keys)                                         # [kv, cap, d]
        self.rotated = torch.empty_like(self.keys)        # keys rotated at their window position
        self.scores = torch.zeros(kv, capacity, dtype=torch.float32, device=device)       # attention received
        self.length = 0            # tokens in the window
        self.rotated_length = 0    # prefix of `rotated` that is valid for the current window start
        self.sink_keys = torch.empty(kv, 0, d, dtype=shape.dtype, device=device)  # rotated at position 0
        self.sink_values = torch.empty(kv, 0, d, dtype=shape.dtype, device=device)
        self.index = RepresentativeIndex(kv * d, device, config.retrieval_backend, config.faiss_min_events)
        self.contiguity = ContiguityBuffer(config.contiguity_tokens, config.contiguity_neighbours)
        self.retrieved_ids: tuple[int, ...] = ()
        self.memory_keys = self.sink_keys      # [kv, m, d] sinks + retrieved events, rotated at position 0
        self.memory_values = self.sink_values
        self.ordered_keys = self.sink_keys     # memory_keys rotated at 0..m-1, for memory_positions="ordered"
        self._ordered_source = self.sink_keys  # the memory_keys tensor that ordered_keys was rotated from
        self.retrievals = 0
        self.answer_mass: torch.Tensor | None = None  # [e] attention the answer's queries gave each event so far
        # Attention scoring with no memory budget keeps a float32 copy of this layer's stored keys (_stored_keys).
        self.keeps_key_copy = (config.retrieval_scoring != "representatives" and config.ram_budget_mb is None
                               and config.device_budget_mb is None)
        self.key_copy = torch.empty(kv, 0, d, dtype=torch.float32, device=device)  # [kv, capacity, d]
        self.key_copy_length = 0   # stored tokens copied so far
        self.key_copy_owned = True  # False after a fork: the buffer is shared, so copy before writing

    # ------------------------------------------------------------------ local window
    def append(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """keys, values: [kv, q, d] of the tokens being read (un-rotated)."""
        q = keys.shape[1]
        if self.length + q > self.keys.shape[1]:
            if self.config.attention == "episodic":
                raise RuntimeError("local window overflow: evict() was not called between forward passes")
            self._grow(max(2 * self.keys.shape[1], self.length + q))
        self.keys[:, self.length:self.length + q] = keys
        self.values[:, self.length:self.length + q] = values
        self.scores[:, self.length:self.length + q] = 0
        self.length += q

    def _grow(self, capacity: int) -> None:
        """Only full attention grows; episodic windows are preallocated at their maximum size."""
        for name in ("keys", "values", "rotated"):
            old = getattr(self, name)
            new = torch.empty(old.shape[0], capacity, old.shape[2], dtype=old.dtype, device=old.device)
            new[:, : self.length] = old[:, : self.length]
            setattr(self, name, new)
        scores = torch.zeros(self.scores.shape[0], capacity, dtype=torch.float32, device=self.device)
        scores[:, : self.length] = self.scores[:, : self.length]
        self.scores = scores

    def window_keys(self) -> torch.Tensor:
        """[kv, length, d] keys rotated at their position in the window; only new tokens are rotated."""
        if self.rotated_length < self.length:
            positions = torch.arange(self.rotated_length, self.length, device=self.device)
            self.rotated[:, self.rotated_length:self.length] = self.rope.rotate(
                self.keys[:, self.rotated_length:self.length], positions)
            self.rotated_length = self.length
        return self.rotated[:, : self.length]

    def window_values(self) -> torch.Tensor:
        return self.values[:, : self.length]

    def drop_oldest(self, n: int) -> None:
        """Remove the n oldest window tokens; the rest move to the front and must be re-rotated."""
        keep = self.length - n
        for buffer in (self.keys, self.values, self.scores):
            buffer[:, :keep] = buffer[:, n:self.length].clone()
        self.length = keep
        self.rotated_length = 0

    def fork(self) -> "LayerMemory":
        """An independent copy: window buffers and index copied; sinks and retrieved KV are shared because they
        are only ever replaced, never written in place."""
        child = copy.copy(self)
        for name in ("keys", "values", "rotated", "scores"):
            setattr(child, name, getattr(self, name).clone())
        child.index = self.index.fork()
        child.contiguity = self.contiguity.fork()
        child.key_copy_owned = False  # the parent writes past its own length only, which the child never reads
        return child

    # ------------------------------------------------------------------ memory part
    def set_sinks(self, n: int) -> None:
        """The first n window tokens become attention sinks at the fixed memory position."""
        positions = torch.zeros(n, dtype=torch.long, device=self.device)
        self.sink_keys = self.rope.rotate(self.keys[:, :n], positions).clone()
        self.sink_values = self.values[:, :n].clone()
        self.memory_keys, self.memory_values = self.sink_keys, self.sink_values
        self.drop_oldest(n)

    def ordered_memory_keys(self) -> torch.Tensor:
        """[kv, m, d] the memory part's keys rotated at positions 0..m-1 (memory_positions="ordered"): sinks, then
        retrieved tokens in input order. Rotated once per change of the retrieved set, not per step."""
        if self._ordered_source is not self.memory_keys:
            m = self.memory_keys.shape[1]
            self.ordered_keys = self.rope.rotate(self.memory_keys, torch.arange(m, device=self.device))
            self._ordered_source = self.memory_keys
        return self.ordered_keys

    def add_events(self, starts: torch.Tensor, sizes: torch.Tensor, topk: int) -> torch.Tensor:
        """Representatives of events covering window[0, sum(sizes)); returns their KV rotated at position 0.

        starts, sizes: [e] window-relative. Returns [2, n, kv, d] for storage (n = sum(sizes)).
        """
        n = int(sizes.sum())
        keys = self.rope.rotate(self.keys[:, :n], torch.zeros(n, dtype=torch.long, device=self.device))
        self.index.add(event_representatives(keys, self.scores[:, :n], starts.to(self.device),
                                             sizes.to(self.device), topk))
        return torch.stack([keys, self.values[:, :n]]).transpose(1, 2)  # [2, n, kv, d]

    def retrieve(self, queries: torch.Tensor, memory: "EpisodicMemory", scaling: float) -> None:
        """Choose events for this layer from the chunk's memory-part queries [kv, rows, d] and load their KV after
        the sinks."""
        config = self.config
        candidates = min(self.index.size, config.similarity_tokens // config.min_block_size + 1)
        sizes = memory.event_sizes
        best = self._ranked_events(queries, memory, scaling, candidates)
        similar = fill_budget(_pinned_first(memory.pinned_events(), best.to("cpu")), sizes,
                              config.similarity_tokens).tolist()
        neighbours = self.contiguity.update(similar, sizes, self.index.size)
        chosen = tuple(sorted(set(similar).union(neighbours)))
        self.retrievals += 1
        if chosen == self.retrieved_ids:
            return
        self.retrieved_ids = chosen
        if not chosen:
            self.memory_keys, self.memory_values = self.sink_keys, self.sink_values
            return
        ids = torch.tensor(chosen, dtype=torch.long)
        tokens = token_index_of_events(ids, memory.event_starts, sizes)
        keys, values = memory.store.gather(self.layer_index, tokens, self.device)
        self.memory_keys = torch.cat([self.sink_keys, keys], dim=1)
        self.memory_values = torch.cat([self.sink_values, values], dim=1)

    def _ranked_events(self, queries: torch.Tensor, memory: "EpisodicMemory", scaling: float,
                       candidates: int) -> torch.Tensor:
        """The best ``candidates`` event ids, best first (CPU), by this layer's scores, or under
        retrieval_pooling="cumulative" by the scores pooled over this and the earlier layers of the same forward."""
        if memory.scoring_now == "attention":
            scores = self._attention_mass(queries, memory, scaling)                           # [e]
            if memory.accumulating_answer:
                scores = self._add_to_answer(scores)
        else:
            if self.keeps_key_copy:  # attention_for_questions: keep the copy current, so a question finds it filled
                self._stored_keys(memory.store)
            mean_query = queries.float().mean(dim=1).reshape(-1)                              # [kv * d]
            if self.config.retrieval_pooling == "none":
                return self.index.search(mean_query, candidates)[1].to("cpu")  # faiss top-k where the index uses it
            scores = self.index.scores(mean_query)                                            # [e]
        if self.config.retrieval_pooling == "cumulative":
            scores = memory.pool_scores(scores)
        return torch.argsort(scores, descending=True)[:candidates].to("cpu")

    def _attention_mass(self, queries: torch.Tensor, memory: "EpisodicMemory", scaling: float) -> torch.Tensor:
        """[e] the attention a strided sample of the queries gives each event's stored tokens, summed over the
        sampled rows (so that forwards of different lengths add up in proportion to their queries)."""
        rows = queries.shape[1]
        sample = queries[:, ::max(1, -(-rows // ATTENTION_SCORING_ROWS))]                     # [kv, <=256, d]
        keys = self._stored_keys(memory.store)          # [kv, n, d]: events cover every stored token
        return attention_mass_per_event(sample, keys, memory.event_sizes, scaling) * sample.shape[1]

    def _add_to_answer(self, mass: torch.Tensor) -> torch.Tensor:
        """[e] this forward's attention mass plus what the answer's earlier forwards gave each event (the
        question's among them). Events stored since then (evicted while answering) start from this forward's."""
        total = mass.clone()
        if self.answer_mass is not None:
            total[:self.answer_mass.shape[0]] += self.answer_mass.to(total.device)
        self.answer_mass = total
        return total

    def _stored_keys(self, store: PageStore) -> torch.Tensor:
        """Every stored key of this layer, [kv, n, d]. Read from the store's pages, attention scoring would gather,
        concatenate and convert all of them at every retrieval, i.e. at every decoded token; with the copy only
        the keys stored since the last retrieval are read. The copy costs as many bytes as the stored KV, so with
        a RAM or device budget (memory meant to stay bounded) the pages are read each time instead."""
        if not self.keeps_key_copy:
            return store.layer_keys(self.layer_index, self.device)
        n, copied = store.num_tokens, self.key_copy_length
        if n > copied:
            new = store.layer_keys(self.layer_index, self.device, start=copied)              # [kv, n - copied, d]
            if n > self.key_copy.shape[1] or not self.key_copy_owned:
                kv, capacity, d = self.key_copy.shape
                grown = torch.empty(kv, max(n, 2 * capacity), d, dtype=torch.float32, device=self.device)
                grown[:, :copied] = self.key_copy[:, :copied]
                self.key_copy, self.key_copy_owned = grown, True
            self.key_copy[:, copied:n] = new
            self.key_copy_length = n
        return self.key_copy[:, :n]


def event_representatives(keys: torch.Tensor, scores: torch.Tensor, starts: torch.Tensor, sizes: torch.Tensor,
                          topk: int) -> torch.Tensor:
    """Per event and KV head, the mean key of the topk most-attended tokens: [e, kv * d] float32.

    keys [kv, n, d], scores [kv, n]; events are the contiguous ranges (starts, sizes). Events are padded to the
    longest one so all are handled in one topk, padding scored -inf and excluded from the mean.
    """
    kv, n, d = keys.shape
    e, longest = starts.shape[0], int(sizes.max())
    offsets = torch.arange(longest, device=keys.device)                       # [longest]
    token = starts[:, None] + offsets[None, :]                                # [e, longest]
    valid = offsets[None, :] < sizes[:, None]                                 # [e, longest]
    token = torch.where(valid, token, torch.zeros_like(token))
    padded = scores[:, token].masked_fill(~valid[None], float("-inf"))        # [kv, e, longest]
    k = min(topk, longest)
    top_scores, top = padded.topk(k, dim=-1)                                  # [kv, e, k]
    chosen = torch.gather(token[None].expand(kv, -1, -1), 2, top)             # [kv, e, k] token ids
    weight = torch.isfinite(top_scores).to(torch.float32)                     # [kv, e, k]
    picked = keys.float()[torch.arange(kv, device=keys.device)[:, None, None], chosen]  # [kv, e, k, d]
    mean = (picked * weight[..., None]).sum(2) / weight.sum(2).clamp_min(1)[..., None]  # [kv, e, d]
    return mean.transpose(0, 1).reshape(e, kv * d)


class EpisodicMemory:
    """Everything one conversation has read. Created by EMEngine.new_memory(); not shared between threads."""

    def __init__(self, config: EMConfig, shape: ModelShape, layer_devices: list[torch.device],
                 ropes: dict[torch.device, RotaryTable], store_device: torch.device):
        self.config, self.shape = config, shape
        self.layers = [LayerMemory(i, config, shape, device, ropes[device]) for i, device in enumerate(layer_devices)]
        self.store = PageStore(shape.num_layers, shape.num_kv_heads, shape.head_dim, shape.dtype,
                               page_tokens=config.page_tokens, device=store_device,
                               device_budget_mb=config.device_budget_mb, ram_budget_mb=config.ram_budget_mb,
                               offload_dir=config.offload_dir, disk_budget_mb=config.disk_budget_mb)
        self.token_ids: list[int] = []
        self.surprise = torch.empty(0, dtype=torch.float32)     # [total] (NaN for the first token)
        self.boundary_flags = torch.empty(0, dtype=torch.bool)  # [total] surprise above threshold
        self.sinks_split = False
        self.local_start = 0
        self.event_starts = torch.empty(0, dtype=torch.long)    # [events] store-relative token positions
        self.event_sizes = torch.empty(0, dtype=torch.long)     # [events]
        self.last_logits: torch.Tensor | None = None            # [vocab] predicting the next token
        self.retrieve_now = True                                # set by begin_forward before each forward
        self.scoring_now = "representatives"                    # how this forward ranks events (begin_forward)
        self.accumulating_answer = False  # attention_for_questions: ranking by the answer's queries so far
        self.score_pool: torch.Tensor | None = None             # [events] pooled standardised scores this forward
        # Surprise of every token is needed to cut events by surprise (and for inspection); otherwise only the
        # tokens whose predicting logits are at hand (the first of each forward) get one.
        self.track_surprise = config.segmentation == "surprise" and config.attention == "episodic"
        self.pinned_spans: tuple[tuple[int, int], ...] = ()     # absolute token spans every layer retrieves
        self.on_fork = None  # set by the engine so forks are closed with it
        self.closed = False
        self.closed_reason = ""

    # ------------------------------------------------------------------ bookkeeping
    @property
    def total_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_events(self) -> int:
        return int(self.event_starts.shape[0])

    @property
    def has_memory_part(self) -> bool:
        """Sinks and events sit at a fixed position only once something has been evicted."""
        return self.sinks_split

    def begin_forward(self, retrieve: bool, answering: bool = False) -> None:
        """Called by the engine before each forward: whether its layers retrieve, how they rank events (answering:
        a question's or a generated token's forward, which retrieval_scoring="attention_for_questions" scores by
        attention), and a fresh score pool."""
        self.retrieve_now = retrieve
        scoring = self.config.retrieval_scoring
        self.scoring_now = "attention" if scoring == "attention" or (
            scoring == "attention_for_questions" and answering) else "representatives"
        self.accumulating_answer = scoring == "attention_for_questions" and answering
        self.score_pool = None

    def begin_answer(self) -> None:
        """Forget what the last answer's queries attended to: a new prompt's question ranks events afresh. Called by
        EMEngine.read, the one path every prompt is read by; forwards that do not answer never add to the mass."""
        for layer in self.layers:
            layer.answer_mass = None

    def pool_scores(self, scores: torch.Tensor) -> torch.Tensor:
        """Add one layer's event scores [e], standardised, to this forward's pool and return the pool [e].

        Standardised because scores of different layers live on different scales (logits, attention masses):
        mean 0 and deviation 1 give each layer one vote's weight. Layers run in order, so layer l ranks by the
        sum over layers 0..l (retrieval_pooling="cumulative")."""
        scores = scores.float()
        spread = scores.std() if scores.numel() > 1 else scores.new_tensor(0.0)
        standard = (scores - scores.mean()) / spread.clamp_min(1e-12)
        if self.score_pool is None or self.score_pool.shape != standard.shape:
            self.score_pool = standard
        else:
            self.score_pool = self.score_pool.to(standard.device) + standard
        return self.score_pool

    def observe(self, input_ids: torch.Tensor, logits: torch.Tensor) -> None:
        """Record tokens just read and their surprise.

        input_ids [q]; logits [q, vocab] from the same forward, or [1, vocab] (the last position only) when
        surprise is not tracked, in which case tokens other than the first have NaN surprise.
        """
        ids = input_ids.to("cpu")
        predicted = torch.full((ids.shape[0],), float("nan"))
        if self.last_logits is not None:
            predicted[0] = segmentation.token_surprise(self.last_logits[None], ids[:1].to(logits.device))[0].cpu()
        if ids.shape[0] > 1 and logits.shape[0] == ids.shape[0]:
            predicted[1:] = segmentation.token_surprise(logits[:-1], ids[1:].to(logits.device)).cpu()
        tau = self.config.surprise_window
        flags = segmentation.surprise_boundary_flags(self.surprise[-tau:], predicted, self.config.gamma, tau,
                                                     min_history=min(8, tau))  # a window under 8 trusts all it has
        self.surprise = torch.cat([self.surprise, predicted])
        self.boundary_flags = torch.cat([self.boundary_flags, flags.cpu()])
        self.token_ids.extend(ids.tolist())
        self.last_logits = logits[-1].detach()

    # ------------------------------------------------------------------ eviction
    def evict(self) -> int:
        """Move complete events from the oldest part of the window to storage; returns tokens evicted."""
        config = self.config
        if config.attention == "full":
            return 0
        window = self.layers[0].length
        sinks = 0 if self.sinks_split else min(config.n_init, window)
        overflow = window - sinks - config.n_local
        if overflow < config.max_block_size:
            return 0
        if not self.sinks_split:
            for layer in self.layers:
                layer.set_sinks(sinks)
            self.local_start = sinks
            self.sinks_split = True
            window -= sinks
        region = min(window, overflow + config.max_block_size)
        boundaries = self.segment(region)
        complete = boundaries[boundaries <= overflow]
        end = int(complete[-1]) if complete.numel() else overflow  # no boundary at all: cut at the overflow
        starts = torch.cat([torch.zeros(1, dtype=torch.long), complete[complete < end]])
        sizes = torch.diff(torch.cat([starts, torch.tensor([end])]))
        kv = torch.stack([layer.add_events(starts, sizes, config.repr_topk).to(self.store.tiers[0].device)
                          for layer in self.layers])  # [layers, 2, end, kv, d]
        self.store.append(kv)
        self.event_starts = torch.cat([self.event_starts, starts + (self.local_start - config.n_init)])
        self.event_sizes = torch.cat([self.event_sizes, sizes])
        for layer in self.layers:
            layer.drop_oldest(end)
        self.local_start += end
        return end

    def segment(self, region: int, config: EMConfig | None = None) -> torch.Tensor:
        """Event starts (window-relative, in (0, region)) for the first `region` window tokens.

        ``config``: cut as another preset would on what this memory has read (the segmentation benchmark scores
        several presets on one read). Surprise flags were thresholded when read, so gamma and tau must match.
        """
        config = config or self.config
        if config.segmentation == "surprise" and (config.gamma, config.surprise_window) != (
                self.config.gamma, self.config.surprise_window):
            raise ValueError(f"surprise boundaries were thresholded with gamma={self.config.gamma}, "
                             f"surprise_window={self.config.surprise_window} when read; segmenting with gamma="
                             f"{config.gamma}, surprise_window={config.surprise_window} needs a memory read with those")
        if config.segmentation == "fixed":
            boundaries = segmentation.fixed_boundaries(region, config.max_block_size)
        else:
            flags = self.boundary_flags[self.local_start + 1:self.local_start + region]
            boundaries = torch.nonzero(flags).flatten() + 1
        if config.refinement != "none" and boundaries.numel():
            layers = config.refine_layers or range(self.shape.num_layers * 2 // 3, self.shape.num_layers)
            keys = torch.stack([self.layers[i].keys[:, :region].to(self.layers[layers[0]].device)
                                for i in layers])  # [refine_layers, kv, region, d]
            adjacency = segmentation.key_similarity(keys)
            boundaries = segmentation.refine_boundaries(adjacency, boundaries.to(adjacency.device),
                                                        config.refinement).cpu()
        return segmentation.enforce_event_sizes(boundaries.cpu(), region, config.min_block_size,
                                                config.max_block_size, last_is_open=True)

    # ------------------------------------------------------------------ forking
    def fork(self) -> "EpisodicMemory":
        """An independent memory that has read exactly what this one has: reading into either never changes the
        other. Evicted pages are shared (they are immutable), so a fork costs a copy of the local windows and
        indexes, not of the evicted KV: a document read once can be questioned many times."""
        if self.closed:
            raise RuntimeError(f"This episodic memory was closed{_because(self.closed_reason)}; it cannot be forked.")
        child = copy.copy(self)
        child.layers = [layer.fork() for layer in self.layers]
        child.store = self.store.fork()
        child.token_ids = list(self.token_ids)
        if self.on_fork is not None:
            self.on_fork(child)
        return child

    def retrieved_events(self) -> list["RetrievedEvent"]:
        """The events the layers currently hold in attention (the last retrieval), as absolute token spans with
        the number of layers that retrieved each: what the next generated token can see from memory."""
        counts: dict[int, int] = {}
        for layer in self.layers:
            for event in layer.retrieved_ids:
                counts[event] = counts.get(event, 0) + 1
        starts = self.event_boundaries()
        return [RetrievedEvent(int(starts[e]), int(starts[e] + self.event_sizes[e]), n)
                for e, n in sorted(counts.items())]

    def events_overlapping(self, start: int, end: int) -> list[int]:
        """Indices of the stored events that share a token with absolute tokens [start, end): where a fact sentence
        ended up, which may be more than one event when it straddles a boundary."""
        starts = self.event_boundaries()
        return torch.nonzero((starts < end) & (starts + self.event_sizes > start)).flatten().tolist()

    def pin(self, start: int, end: int) -> None:
        """Keep the tokens [start, end) (absolute positions, already read) in every layer's attention from now on:
        once evicted, the events holding them are put ahead of each retrieval's ranking, inside the similarity
        budget. For what an app knows matters whatever the question (instructions longer than the sinks, the
        passage a user pointed at), and to measure what a model does when retrieval cannot miss a fact."""
        try:
            start, end = operator.index(start), operator.index(end)
        except TypeError:
            raise TypeError(f"pin(start, end) takes integer token positions, got {start!r}, {end!r}; positions come "
                            "from counting tokens (EMEngine.count_tokens or tokenize_with_offsets).") from None
        if not (0 <= start < end <= self.total_tokens):
            raise ValueError(f"pin({start}, {end}): a span of tokens already read is needed, 0 <= start < end <= "
                             f"{self.total_tokens} (tokens read so far); read the text first, then pin its tokens.")
        spans = self.pinned_spans + ((start, end),)
        # Events overhang a span by less than max_block_size at either end: this bounds what the pins can hold.
        worst = sum(e - s + 2 * (self.config.max_block_size - 1) for s, e in spans)
        if worst > self.config.similarity_tokens:
            raise ValueError(f"Pinned spans may hold up to {worst} tokens of events, more than the retrieval budget "
                             f"({self.config.similarity_tokens} tokens: n_mem minus the contiguity share); pin "
                             "fewer or shorter spans, or raise n_mem.")
        self.pinned_spans = spans

    def unpin(self) -> None:
        """Drop every pin: retrieval alone decides again."""
        self.pinned_spans = ()

    def pinned_events(self) -> list[int]:
        """Stored events overlapping a pinned span, in input order (pinned tokens still local need no event)."""
        return sorted({e for span in self.pinned_spans for e in self.events_overlapping(*span)})

    def layers_holding(self, start: int, end: int) -> int:
        """How many layers hold, in their last retrieval, an event overlapping absolute tokens [start, end). A fact
        sentence can straddle an event boundary; a layer holding both halves counts once here, where summing
        ``retrieved_events()``'s per-event layer counts would count it twice."""
        overlapping = set(self.events_overlapping(start, end))
        return sum(1 for layer in self.layers if overlapping.intersection(layer.retrieved_ids))

    # ------------------------------------------------------------------ inspection
    def stats(self) -> dict:
        sizes = self.event_sizes.float()
        tiers = self.store.tier_tokens()
        return {
            "tokens_read": self.total_tokens,
            "events": self.num_events,
            "mean_event_size": float(sizes.mean()) if sizes.numel() else math.nan,
            "tokens_local": self.layers[0].length,
            "tokens_sinks": int(self.layers[0].sink_keys.shape[1]),
            "tokens_evicted": int(self.store.num_tokens),
            "tokens_per_tier": tiers,
            "kv_bytes_resident": self.store.resident_bytes(),
            "key_copy_bytes": sum(layer.key_copy.numel() * layer.key_copy.element_size() for layer in self.layers),
            "retrievals_per_layer": [layer.retrievals for layer in self.layers],
        }

    def event_boundaries(self) -> torch.Tensor:
        """Absolute start positions of all events formed so far (sinks start at 0 and are not an event)."""
        return self.event_starts + self.config.n_init

    def close(self, reason: str = "") -> None:
        """Free the memory; ``reason`` (e.g. a forward pass that failed part-way) is shown to later callers."""
        self.store.close()
        self.layers = []
        self.closed = True
        self.closed_reason = reason


def _pinned_first(pinned: list[int], ranked: torch.Tensor) -> torch.Tensor:
    """Event ids best first with the pinned ones ahead of the ranking (each once)."""
    if not pinned:
        return ranked
    pinned_ids = torch.tensor(pinned, dtype=torch.long)
    return torch.cat([pinned_ids, ranked[~torch.isin(ranked, pinned_ids)]])


def _because(reason: str) -> str:
    return f" ({reason})" if reason else ""
