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

import math
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from . import segmentation
from .batching import release_thread_workers
from .config import EMConfig
from .event_texts import EventTexts
from .layer_memory import LayerMemory, ModelShape
from .retrieval import gather_events, token_index_of_events
from .rope import RotaryTable
from .scoring import RetrievalPlan, answer_cadence, relevance_bias_of
from .storage import PageStore, release_freed_memory


@dataclass(frozen=True)
class RetrievedEvent:
    start: int   # absolute token position of the event's first token
    end: int     # one past its last token
    layers: int  # how many layers hold it in attention


class EpisodicMemory:
    """Everything one conversation has read. Created by EMEngine.new_memory(); not shared between threads."""

    def __init__(self, config: EMConfig, shape: ModelShape, layer_devices: list[torch.device],
                 ropes: dict[torch.device, RotaryTable], store_device: torch.device, store: PageStore | None = None):
        self.config, self.shape = config, shape
        self._placement = (layer_devices, ropes, store_device)  # what a fork is built with
        self.layers = [LayerMemory(i, config, shape, device, ropes[device]) for i, device in enumerate(layer_devices)]
        self.store = store or PageStore(shape.num_layers, shape.num_kv_heads, shape.head_dim, shape.dtype,
                                        page_tokens=config.page_tokens, device=store_device,
                                        device_budget_mb=config.device_budget_mb, ram_budget_mb=config.ram_budget_mb,
                                        offload_dir=config.offload_dir, disk_budget_mb=config.disk_budget_mb)
        self.token_ids: list[int] = []
        self.surprise = torch.empty(0, dtype=torch.float32)     # [total] (NaN for the first token)
        self.boundary_flags = torch.empty(0, dtype=torch.bool)  # [total] surprise above threshold
        self.sinks_split = False
        self.local_start = 0
        self.full_tokens = config.full_attention_tokens(shape.max_positions)  # read in full attention up to this
        self.event_starts = torch.empty(0, dtype=torch.long)    # [events] store-relative token positions
        self.event_sizes = torch.empty(0, dtype=torch.long)     # [events]
        self.last_logits: torch.Tensor | None = None            # [vocab] predicting the next token
        self.plan = RetrievalPlan()                             # this forward's, set by begin_forward
        # Surprise of every token is needed to cut events by surprise (and for inspection); otherwise only the
        # tokens whose predicting logits are at hand (the first of each forward) get one.
        self.track_surprise = config.segmentation == "surprise" and config.attention == "episodic"
        self.pinned_spans: tuple[tuple[int, int], ...] = ()     # absolute token spans every layer retrieves
        # [positions] attention the generated tokens gave each absolute position, summed over layers and heads;
        # None unless the engine was asked to attribute an answer (EMEngine.stream(attribute=True)).
        self.attribution: torch.Tensor | None = None
        # Set by the engine when the scorer reads event text (scoring.EventText): token id lists -> [n, dim] unit rows.
        # The events' text and the question's (scoring.EventText); the engine gives it an embedder when the scorer
        # reads event text.
        self.texts = EventTexts()
        # EpMAN's differentiating attention (EventText(relevance_bias=...)): how strongly answering forwards lean to
        # the retrieved events whose text the question ranks first; 0 = off.
        self.relevance_bias = relevance_bias_of(config.scorer)
        # AnswerText: re-embed the answer written so far every this many generated tokens; 0 = not followed.
        self.answer_every = answer_cadence(config.scorer)
        self.on_fork: Callable[[EpisodicMemory], None] | None = None  # set by the engine: forks close with it
        # Facts that change only when events are evicted, pins change or a question is asked, kept for every forward
        # (and every layer of it) until then: (what they were computed from, the fact).
        self._boundaries: tuple[torch.Tensor | None, torch.Tensor] = (None, torch.empty(0, dtype=torch.long))
        self._pinned: tuple[tuple | None, tuple[int, ...]] = (None, ())
        self.closed = False
        self.closed_reason = ""

    # ------------------------------------------------------------------ bookkeeping
    @property
    def total_tokens(self) -> int:
        return len(self.token_ids)

    def stored_after(self, n: int) -> int:
        """The fewest tokens in storage once ``n`` more are read: none while the input still fits full attention
        (EMConfig.full_until), else all but the most a window keeps between forwards (max_position)."""
        total = self.total_tokens + n
        return 0 if self.in_full_attention(total) else max(0, total - self.config.max_position())

    def in_full_attention(self, tokens: int) -> bool:
        """Whether a memory holding ``tokens`` is still read in plain full attention (nothing evicted yet)."""
        return not self.sinks_split and tokens <= self.full_tokens

    @property
    def num_events(self) -> int:
        return int(self.event_starts.shape[0])

    @property
    def has_memory_part(self) -> bool:
        """Sinks and events sit at a fixed position only once something has been evicted."""
        return self.sinks_split

    def begin_forward(self, plan: RetrievalPlan) -> None:
        """Called by the engine before each forward with what its layers do with memory (see RetrievalPlan)."""
        self.plan = plan

    def plan_forward(self, retrieve: bool, answering: bool) -> RetrievalPlan:
        """The plan of this memory's next forward, with the facts every retrieving layer reads (the pinned events, the
        question's text scores) computed once for the forward, or taken from the last forward while no event was
        evicted, no pin changed and no question was asked since."""
        ranks = answering and retrieve
        if ranks and self.answer_every:
            self.texts.follow(self.token_ids, self.answer_every)
        return RetrievalPlan(retrieve=retrieve, answering=answering, pinned=self._pinned_events(),
                             text_scores=self.text_scores() if ranks else None,
                             answer_scores=self.answer_scores() if ranks else None,
                             answer_version=self.texts.answer_tokens)

    def begin_answer(self) -> None:
        """Forget what the last answer's queries attended to: a new prompt's question ranks events afresh. Called by
        EMEngine.read, the one path every prompt is read by; forwards that do not answer never add to the mass."""
        for layer in self.layers:
            layer.answer_mass = None
            layer.fixed_retrieval = None
        self.texts.forget_question()

    def begin_question(self) -> None:
        """Empty every layer's contiguity buffer as the question's first forward starts: its memory part holds its own
        retrieval's neighbours, not those queued while the text before it was read. A read with no question (a
        document read in several calls) keeps them, so it reads as it would in one call."""
        for layer in self.layers:
            layer.contiguity.clear()

    # ------------------------------------------------------------------ event text (scoring.EventText)
    def ask(self, question_ids: list[int], answer_from: int | None = None) -> None:
        """Embed the prompt's question (token ids), which EventText compares with every event's text; its answer
        starts at token ``answer_from`` (the prompt's end), which AnswerText follows from there."""
        self.texts.ask(question_ids, answer_from)

    def embed_events(self) -> None:
        """Embed the text of the events formed since the last call (EventTexts.embed)."""
        self.texts.embed(self.token_ids, self.event_boundaries(), self.event_sizes)

    def text_scores(self) -> torch.Tensor | None:
        """[events] cosine of the question with each event's text; None without a question or an embedder. Computed
        once per eviction and question: an answer's decoding steps reuse it."""
        return self._cosines(self.texts.question, self.texts.scores)

    def answer_scores(self) -> torch.Tensor | None:
        """[events] cosine of the answer written so far with each event's text (AnswerText); None before it is
        embedded. Recomputed only when the answer is re-embedded or events are evicted."""
        return self._cosines(self.texts.answer, self.texts.answer_scores)

    def _cosines(self, vector: torch.Tensor | None,
                 cosines: Callable[[int], torch.Tensor | None]) -> torch.Tensor | None:
        """``cosines`` of every event once the events formed since the last call are embedded; None without
        ``vector`` (no question, or no answer embedded yet)."""
        if vector is None:
            return None
        self.embed_events()
        return cosines(self.num_events)

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
        # A copy, not a view: a view keeps the forward's whole logits alive (a 256-token chunk's are 50 MB of
        # SmolLM2's; 19 MB of every checkpoint a server session kept).
        self.last_logits = logits[-1].detach().clone()

    # ------------------------------------------------------------------ eviction
    def evict(self) -> int:
        """Move complete events from the oldest part of the window to storage; returns tokens evicted."""
        config = self.config
        if config.attention == "full":
            return 0
        window = self.layers[0].length
        if self.in_full_attention(window):
            return 0
        sinks = 0 if self.sinks_split else min(config.n_init, window)
        overflow = window - sinks - config.n_local
        if overflow < config.max_block_size:
            return 0
        crossing = not self.sinks_split  # the first eviction: a full-attention start gives its room back after it
        if crossing:
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
        # Room first: every layer's index grows by a quarter in this same call, and the old buffers it frees are
        # heap holes until trimmed. Counted after, a 1M-token read under a 2 GB budget peaked 0.5 GB above the RSS
        # at its 64K segments' ends (3,918 MB at 655K; counted first, 3,680 MB at most). Counted once: after
        # the add the index holds exactly what was counted here.
        grows = self.count_index_in_budgets(adding=len(starts))
        kv = torch.stack([layer.add_events(starts, sizes, config.repr_topk).to(self.store.tiers[0].device)
                          for layer in self.layers])  # [layers, 2, end, kv, d]
        self.store.append(kv)
        self.event_starts = torch.cat([self.event_starts, starts + (self.local_start - config.n_init)])
        self.event_sizes = torch.cat([self.event_sizes, sizes])
        for layer in self.layers:
            layer.drop_oldest(end)
            if crossing:
                layer.fit_capacity()
        self.local_start += end
        if grows:
            release_freed_memory()
        return end

    def count_index_in_budgets(self, adding: int = 0) -> bool:
        """Tell the store what the event index holds on each device once ``adding`` more events are indexed
        (index_bytes), so that ram_budget_mb and device_budget_mb bound the memory, not only its KV pages. Returns
        whether a layer's index buffer will grow."""
        grows = any(layer.index.nbytes_after(adding) > layer.index.nbytes for layer in self.layers)
        self.store.hold(self.index_bytes(adding, texts_adding=0))
        return grows

    def index_bytes(self, adding: int, texts_adding: int | None = None) -> dict[torch.device, int]:
        """Bytes the event index holds on each device once ``adding`` more events are indexed: the representatives
        of every layer (on its device) and the event-text embeddings (in RAM; ``texts_adding`` more of them, by
        default as many). Eviction indexes an event before its text is embedded, hence the two counts."""
        held: dict[torch.device, int] = {}
        for layer in self.layers:
            held[layer.device] = held.get(layer.device, 0) + layer.index.nbytes_after(adding)
        cpu = torch.device("cpu")
        held[cpu] = held.get(cpu, 0) + self.texts.nbytes_after(adding if texts_adding is None else texts_adding)
        return held

    def segment(self, region: int) -> torch.Tensor:
        """Event starts (window-relative, in (0, region)) for the first `region` window tokens."""
        config = self.config
        if config.segmentation == "fixed":
            boundaries = segmentation.fixed_boundaries(region, config.max_block_size)
        else:
            flags = self.boundary_flags[self.local_start + 1:self.local_start + region]
            boundaries = torch.nonzero(flags).flatten() + 1
        if config.refinement != "none" and boundaries.numel():
            layers = range(self.shape.num_layers * 2 // 3, self.shape.num_layers)  # the top third (paper 3.3)
            keys = torch.stack([self.layers[i].keys[:, :region].to(self.layers[layers[0]].device)
                                for i in layers])  # [refine_layers, kv, region, d]
            adjacency = segmentation.key_similarity(keys)
            boundaries = segmentation.refine_boundaries(adjacency, boundaries.to(adjacency.device),
                                                        config.refinement).cpu()
        return segmentation.enforce_event_sizes(boundaries.cpu(), region, config.min_block_size,
                                                config.max_block_size, last_is_open=True)

    # ------------------------------------------------------------------ forking
    def compact(self) -> None:
        """Give back the windows' unused room (LayerMemory.compact): a checkpoint kept only to be forked or saved
        need not hold room to read on."""
        for layer in self.layers:
            layer.compact()

    def held_tensors(self) -> list[torch.Tensor]:
        """Every tensor this memory holds in RAM or on a device: its layers' windows, caches and indexes, its pages
        in memory, its event-text embeddings and its own bookkeeping (held_bytes counts them)."""
        own = [v for v in (*vars(self).values(), *vars(self.texts).values()) if isinstance(v, torch.Tensor)]
        return [*own, *(t for layer in self.layers for t in layer.held_tensors()), *self.store.held_tensors()]

    def fork(self) -> EpisodicMemory:
        """An independent memory that has read exactly what this one has: reading into either never changes the
        other. Evicted pages are shared (they are immutable), so a fork costs a copy of the local windows and
        indexes, not of the evicted KV: a document read once can be questioned many times."""
        if self.closed:
            raise RuntimeError(f"This episodic memory was closed{because(self.closed_reason)}; it cannot be forked.")
        self.embed_events()  # events whose text waits to be embedded (EMEngine.embeds_on_eviction): once, for both
        child = EpisodicMemory(self.config, self.shape, *self._placement, store=self.store.fork())
        child.load_state_dict(self.state_dict(with_caches=True))
        for mine, theirs in zip(child.layers, self.layers):
            mine.share_key_copy(theirs)
        child.on_fork, child.texts.embedder = self.on_fork, self.texts.embedder
        if self.on_fork is not None:
            self.on_fork(child)
        release_thread_workers()  # the copies' idle OpenMP workers would slow other threads' forwards (batching.py)
        return child

    # ------------------------------------------------------------------ state
    def state_dict(self, with_caches: bool = False) -> dict[str, Any]:
        """Everything this memory holds outside its page store, tensors by reference (as torch's state_dict):
        persistence writes it, fork loads it into a new memory over the same pages. ``with_caches`` adds what can
        be rebuilt from the rest (the retrieved events' KV, the current answer's accumulated attention)."""
        layers = [layer.state_dict() for layer in self.layers]
        if with_caches:
            for state, layer in zip(layers, self.layers):
                state["retrieved_kv"] = (layer.memory_keys, layer.memory_values)
                state["answer_mass"] = layer.answer_mass
        return {
            "token_ids": self.token_ids, "surprise": self.surprise, "boundary_flags": self.boundary_flags,
            "event_starts": self.event_starts, "event_sizes": self.event_sizes, "last_logits": self.last_logits,
            "sinks_split": self.sinks_split, "local_start": self.local_start, "track_surprise": self.track_surprise,
            "pinned_spans": self.pinned_spans, "layers": layers,
            "event_embeddings": self.texts.embeddings, "question_embedding": self.texts.question,
            "answer_from": self.texts.answer_from, "answer_tokens": self.texts.answer_tokens,
            "answer_embedding": self.texts.answer,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take a state_dict() into this fresh memory, whose store already holds the pages that state refers to."""
        if self.total_tokens or len(state["layers"]) != len(self.layers):
            raise ValueError("load_state_dict needs a fresh memory of the same model (nothing read yet, "
                             f"{len(self.layers)} layers); got {len(state['layers'])} layers of state.")
        self.token_ids = list(state["token_ids"])
        self.surprise, self.boundary_flags = state["surprise"], state["boundary_flags"]
        self.event_starts, self.event_sizes = state["event_starts"], state["event_sizes"]
        self.last_logits = state["last_logits"]
        self.sinks_split, self.local_start = bool(state["sinks_split"]), int(state["local_start"])
        self.track_surprise = bool(state["track_surprise"])
        # Embeddings are derived from the tokens: a saved memory leaves them out and embed_events() rebuilds them.
        self.texts.embeddings = state.get("event_embeddings", self.texts.embeddings)
        self.texts.question = state.get("question_embedding")
        # The answer being followed (AnswerText): a fork made after a prompt was read follows the answer it generates.
        self.texts.answer_from, self.texts.answer = state.get("answer_from"), state.get("answer_embedding")
        self.texts.answer_tokens = int(state.get("answer_tokens", 0))
        for start, end in state["pinned_spans"]:  # pin() checks each span against the budget
            self.pin(int(start), int(end))
        for layer, layer_state in zip(self.layers, state["layers"]):
            layer.load_state_dict(layer_state)
            layer.answer_mass = layer_state.get("answer_mass")
            if "retrieved_kv" in layer_state:
                layer.memory_keys, layer.memory_values = layer_state["retrieved_kv"]
            elif layer.retrieved_ids:
                layer.set_retrieved(layer.retrieved_ids, *gather_events(self, layer, layer.retrieved_ids))
        self.count_index_in_budgets()

    def memory_positions(self, layer: LayerMemory) -> torch.Tensor:
        """[sinks + retrieved tokens] the absolute position of each key in the layer's memory part, in its order
        (the sinks, then the retrieved events' tokens in the order held)."""
        sinks = torch.arange(layer.sink_keys.shape[1])
        if not layer.retrieved_ids:
            return sinks
        events = token_index_of_events(torch.tensor(layer.retrieved_ids), self.event_boundaries(), self.event_sizes)
        return torch.cat([sinks, events.cpu()])

    def attribute(self, positions: torch.Tensor, mass: torch.Tensor) -> None:
        """Add attention ``mass`` [n] given to absolute ``positions`` [n] to this answer's attribution."""
        if self.attribution is None:
            raise RuntimeError("attribute() records an answer's attention: set memory.attribution (a zero tensor of "
                               "the positions) first, as EMEngine.stream(attribute=True) does.")
        needed = int(positions.max()) + 1 if positions.numel() else 0
        if needed > self.attribution.shape[0]:
            self.attribution = torch.cat([self.attribution, torch.zeros(needed - self.attribution.shape[0])])
        self.attribution.index_add_(0, positions, mass.float().cpu())

    def retrieved_events(self) -> list[RetrievedEvent]:
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
        return list(self._pinned_events())

    def _pinned_events(self) -> tuple[int, ...]:
        """pinned_events(), computed once per eviction or change of pins; the tuple every forward's plan shares."""
        key = (self.num_events, self.pinned_spans)
        if self._pinned[0] != key:
            events = sorted({e for span in self.pinned_spans for e in self.events_overlapping(*span)})
            self._pinned = (key, tuple(events))
        return self._pinned[1]

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
        """Absolute start positions of all events formed so far (sinks start at 0 and are not an event); computed once
        per eviction (event_starts is a new tensor each time events are added). Read-only: clone to change it."""
        if self._boundaries[0] is not self.event_starts:
            self._boundaries = (self.event_starts, self.event_starts + self.config.n_init)
        return self._boundaries[1]

    def adopt(self, trial: EpisodicMemory) -> None:
        """Become ``trial``, a fork of this memory that has read on from it (EMEngine.read reads into a fork where
        storing can fail part-way, and keeps the result only on success): its state replaces this memory's, whose
        own copies are freed (the pages both hold stay), and ``trial`` is left closed, owning nothing."""
        if trial.closed or self.closed:
            raise RuntimeError("adopt() takes an open fork into an open memory.")
        replaced = self.store
        attribution = self.attribution
        vars(self).update(vars(trial))
        self.attribution = attribution  # a generation's running attribution stays with the memory it was set on
        replaced.close()
        trial.layers, trial.closed, trial.closed_reason = [], True, "its state was adopted by the memory it forked"

    def close(self, reason: str = "") -> None:
        """Free the memory; ``reason`` (e.g. a forward pass that failed part-way) is shown to later callers. Closing
        a closed memory does nothing (an adopted fork shares its store with the memory that adopted it)."""
        if self.closed:
            return
        self.store.close()
        self.layers = []
        self.closed = True
        self.closed_reason = reason


def because(reason: str) -> str:
    return f" ({reason})" if reason else ""


def held_bytes(memories: Sequence[EpisodicMemory]) -> dict[str, int]:
    """The bytes ``memories`` hold together, "ram" and "device": each storage once however many tensors view it
    and however many forks share it (sealed pages, a key copy), and whole (a window's or page's unused capacity is
    allocated all the same). What a server's RAM limit must count: evicted KV alone was a quarter of a SmolLM2
    session's 360 MB (three checkpoints, each with its windows, retrieved events' KV and page being filled)."""
    storages: dict[tuple[torch.device, int], int] = {}
    for memory in memories:
        if memory.closed:
            continue
        for tensor in memory.held_tensors():
            storage = tensor.untyped_storage()
            storages[(tensor.device, storage.data_ptr())] = storage.nbytes()
    held = {"ram": 0, "device": 0}
    for (device, _), n in storages.items():
        held["ram" if device.type == "cpu" else "device"] += n
    return held
