"""Which stored events a layer attends to: scorers, small objects with one method each, composed.

A scorer gives every stored event of one layer a score for the forward being run (higher: retrieve first). The
retriever (retrieval.retrieve) takes the best-scored events that fit the similarity budget, adds the contiguity
buffer's neighbours and loads their KV; attention then attends to exactly that. Scorers hold no state: what they
accumulate lives in the forward's RetrievalPlan (shared by the layers of one forward) or in the layer's memory
(shared by the forwards of one answer), so one scorer object serves every memory, fork and thread.

    EMConfig(scorer=Representatives())                     # the paper: k-NN over representative keys (default)
    EMConfig(scorer=Pooled(ForQuestions()))                 # the needle recipe: attention ranks the question's
                                                            #   events, pooled over layers
    EMConfig(scorer=ForQuestions(answering=AttentionMass()))  # compose your own
    EMConfig(scorer=ForQuestions(answering=Fused((EventText(), Representatives()))))
                                                            # EpMAN without training: the question's embedding
                                                            #   ranks the events' text, fused with the model's own
    EMConfig(scorer=ForQuestions(answering=Fused((EventText(), AnswerText()))))
                                                            # retrieval that follows the answer (preset EA): what
                                                            #   the answer has written joins the question

Pins (EpisodicMemory.pin) are applied by the retriever around whatever scorer the config names (``Pinned``).
"""

from __future__ import annotations

import dataclasses
import functools
import operator
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Protocol, cast, get_args, runtime_checkable

import torch

from .retrieval import ATTENTION_SCORING_ROWS, attention_mass_per_event

if TYPE_CHECKING:
    from .layer_memory import LayerMemory
    from .storage import PageStore


@dataclass
class RetrievalPlan:
    """What one forward's layers do with memory, decided by the engine before the forward runs."""

    retrieve: bool = True
    """Rank and load events in this forward (a layer with no stored events has nothing to rank)."""
    answering: bool = False
    """A question's or a generated token's forward: ForQuestions ranks these by attention."""
    pool: torch.Tensor | None = None
    """[e] Pooled's running sum of standardised scores over this forward's layers so far."""
    text_scores: torch.Tensor | None = None
    """[e] cosine of the question's embedding with each event's text (answering forwards, for EventText); the same
    for every layer, so computed once per forward by the engine."""
    answer_scores: torch.Tensor | None = None
    """[e] cosine of the answer written so far with each event's text (answering forwards, for AnswerText): the same
    for every layer, computed once per forward and refreshed at AnswerText's cadence; None before it has written any."""
    answer_version: int = 0
    """Tokens the answer had when answer_scores were computed (0: none): the retriever's reuse key, so a refreshed
    answer ranks afresh while the steps between refreshes reuse the last choice."""
    similar: dict[tuple, list[int]] = dataclasses.field(default_factory=dict)
    """A query-free ranking's similarity choice (the best events that fit the budget), by what it depends on: the
    first layer to rank makes it, the forward's other layers take it, since every layer would rank the same."""
    pinned: tuple[int, ...] = ()
    """Stored events overlapping a pinned span (EpisodicMemory.pin), in input order: every retrieving layer puts them
    first; the same for every layer, so computed once per forward (once per eviction, in fact)."""


@dataclass
class ScoringStep:
    """Everything a scorer may read to score one layer's events in one forward."""

    layer: LayerMemory
    queries: torch.Tensor       # [kv, rows, d] the forward's queries, rotated at the fixed memory distance
    scaling: float              # the model's attention scaling (1/sqrt(d) unless the model says otherwise)
    event_sizes: torch.Tensor   # [e] tokens per stored event
    store: PageStore
    plan: RetrievalPlan
    candidates: int | None      # only this many best events need exact scores; None: every event's score


@runtime_checkable
class Scorer(Protocol):
    def score(self, step: ScoringStep) -> torch.Tensor:
        """[e] float32, one score per stored event of step.layer (higher: retrieve first; -inf: never)."""
        ...


def short_repr(scorer: Any) -> str:
    """A scorer as it would be written: only the parameters that differ from their defaults (Representatives(), not
    Representatives(backend='auto', faiss_min_events=20000)), so presets, docs and errors read as code does."""
    changed = [f"{f.name}={getattr(scorer, f.name)!r}" for f in dataclasses.fields(scorer)
               if f.default is dataclasses.MISSING or getattr(scorer, f.name) != f.default]
    return f"{type(scorer).__name__}({', '.join(changed)})"


SearchBackend = Literal["auto", "torch", "faiss"]


@dataclass(frozen=True)
class Representatives:
    """The paper's retrieval: the forward's mean query dotted with each event's representative key (the mean key of
    its most-attended tokens). Cheap and independent of memory size; with faiss only the best ``candidates`` events
    are scored exactly, the rest get -inf."""

    __repr__ = short_repr

    backend: SearchBackend = "auto"
    """Search the representatives with "torch", "faiss", or "auto" (faiss from faiss_min_events events on)."""
    faiss_min_events: int = 20_000
    """With backend "auto", layers holding at least this many events are searched with faiss."""

    def __post_init__(self) -> None:
        if self.backend not in get_args(SearchBackend):
            raise ValueError(f"Representatives' backend must be one of {get_args(SearchBackend)}, got "
                             f"{self.backend!r}.")
        value = self.faiss_min_events
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"Representatives' faiss_min_events must be a positive integer, got {value!r}.")

    def score(self, step: ScoringStep) -> torch.Tensor:
        index = step.layer.index
        mean_query = step.queries.float().mean(dim=1).reshape(-1)                             # [kv * d]
        if step.candidates is None or not index.uses_faiss():
            return index.scores(mean_query)
        top, ids = index.search(mean_query, step.candidates)
        return torch.full((index.size,), float("-inf"), device=top.device).index_copy_(0, ids, top.float())


@dataclass(frozen=True)
class AttentionMass:
    """The attention a strided sample of the forward's queries (at most 256 rows per KV head) would give each
    event's stored tokens under one softmax over all of them: what full attention over the memory would look at.
    Reads every stored key of the layer (a float32 copy of them with no memory budget, the pages otherwise)."""

    __repr__ = short_repr

    uses_stored_keys = True

    def score(self, step: ScoringStep) -> torch.Tensor:
        queries = step.queries
        sample = queries[:, ::max(1, -(-queries.shape[1] // ATTENTION_SCORING_ROWS))]         # [kv, <=256, d]
        keys = step.layer.stored_keys(step.store)                                              # [kv, n, d]
        # Summed over rows, so forwards of different lengths add up in proportion to their queries.
        return attention_mass_per_event(sample, keys, step.event_sizes, step.scaling) * sample.shape[1]


@dataclass(frozen=True)
class ForQuestions:
    """``reading`` for the forwards that read a document, ``answering`` for the forwards that answer (a prompt's
    question and every generated token), each answering forward ranking by the sum of what all the answer's
    forwards so far gave each event: one generated token's query is a noisy guide (at 128K the token before the
    number dropped the needle from 23 to 15 of 30 layers). Reading keeps the paper's cost; the question decides."""

    __repr__ = short_repr

    reading: Scorer = Representatives()
    answering: Scorer = AttentionMass()

    @property
    def uses_stored_keys(self) -> bool:
        return uses_stored_keys(self.reading) or uses_stored_keys(self.answering)

    @property
    def uses_event_text(self) -> bool:
        return uses_event_text(self.reading) or uses_event_text(self.answering)

    @property
    def query_free(self) -> bool:
        """Answering forwards are what the retriever caches on (forward.retrieve); reading ones are never cached."""
        return query_free(self.answering)

    def score(self, step: ScoringStep) -> torch.Tensor:
        if not step.plan.answering:
            return self.reading.score(step)
        scores = self.answering.score(dataclasses.replace(step, candidates=None))
        if query_free(self.answering):  # the same scores every forward: a sum would rank as they do, except that
            return scores               # events stored mid-answer, summed fewer times, would rank last
        return step.layer.add_to_answer(scores)


@dataclass(frozen=True)
class Pooled:
    """Each layer ranks by the sum of its own and every earlier layer's standardised scores in the same forward (mean
    0, deviation 1, so no layer's scale dominates): a fact a question points at is often found first by a few middle
    layers, and pooled, their evidence reaches every later layer instead of staying in those few."""

    __repr__ = short_repr

    inner: Scorer = Representatives()

    @property
    def uses_stored_keys(self) -> bool:
        return uses_stored_keys(self.inner)

    @property
    def uses_event_text(self) -> bool:
        return uses_event_text(self.inner)

    def score(self, step: ScoringStep) -> torch.Tensor:
        standard = standardise(self.inner.score(dataclasses.replace(step, candidates=None)))
        pool = step.plan.pool
        fresh = pool is None or pool.shape != standard.shape
        step.plan.pool = standard if pool is None or fresh else pool.to(standard.device) + standard
        return step.plan.pool


@dataclass(frozen=True)
class EventText:
    """EpMAN's episodic attention without its training: the cosine between the question's embedding and each event's
    text embedding (both from the config's ``event_embedding`` sentence-transformers model; events are embedded when
    evicted, or on an accelerator at the first question). The same ranking for every layer, and it sees what the
    words mean, where the model's representative keys see what its layers attend to: a fact asked in other words
    than it was written in is found by the first far more often past the window. Only an answering forward has a
    question: compose it as ``ForQuestions(answering=EventText())``; a prompt with no new text to ask gets no
    preference (all zeros)."""

    __repr__ = short_repr

    relevance_bias: float = 0.0
    """Answering: add this * (event's text cosine - best retrieved one's) to its keys' logits (EpMAN's differentiating
    attention, forward.relevance_bias); 0 = off."""

    within: float | None = None
    """Answering: retrieve only the events whose text cosine is within this of the best event's (None: fill the
    similarity budget best first). A question one fact answers ranks that fact far above the rest, so its
    look-alikes stay out of attention. A question whose evidence ranks flat keeps only the near-ties, not the whole
    budget: a chain's later links, which rank 7th to 300th of ~1,000 events, are dropped unless ``ties`` is set."""

    ties: int | None = None
    """Answering, with ``within``: when at least this many events are within the margin, the question names no one
    fact (a chain's links or a list's items rank flat, where a fact's look-alikes tie with it as one or two), so
    nothing is filtered and the whole budget fills best first (None: always filter)."""

    uses_event_text = True
    query_free = True

    def __post_init__(self) -> None:
        value = self.relevance_bias
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 <= value < float("inf"):
            raise ValueError(f"EventText's relevance_bias is a finite number >= 0 (0 = off), got {value!r}.")
        within = self.within
        if within is not None and (not isinstance(within, (int, float)) or isinstance(within, bool)
                                   or not 0 < within <= 2):
            raise ValueError(f"EventText's within is a cosine margin in (0, 2] (None = off), got {within!r}.")
        ties = self.ties
        if ties is not None and (not isinstance(ties, int) or isinstance(ties, bool) or ties < 2):
            raise ValueError(f"EventText's ties is a number of events >= 2 (None = off), got {ties!r}.")
        if ties is not None and within is None:
            raise ValueError("EventText's ties says when within's filter stands aside; set within too "
                             "(EventText(within=0.1, ties=3)) or leave ties None.")

    def score(self, step: ScoringStep) -> torch.Tensor:
        scores = answering_scores(step, step.plan.text_scores, "EventText ranks events by a question, which only "
                                  "answering forwards have: compose it as ForQuestions(answering=EventText()) so "
                                  "reading uses another scorer.")
        return self.keep_within(scores)

    def keep_within(self, scores: torch.Tensor) -> torch.Tensor:
        """``scores`` with every event further than ``within`` below the best set to -inf (never retrieved); all of
        them where ``within`` is None, or where ``ties`` or more events are within it. Public so that analyses rank
        exactly as the scorer does."""
        if self.within is None or not scores.numel():
            return scores
        far = scores < scores.max() - self.within
        if self.ties is not None and int((~far).sum()) >= self.ties:
            return scores
        return scores.masked_fill(far, float("-inf"))


@dataclass(frozen=True)
class AnswerText:
    """Retrieval that follows the answer: the cosine between the text the answer has written so far and each event's
    text, re-embedded every ``every`` generated tokens (the same embedding model as EventText). A chain whose links
    share no words with the question (variable tracking: "VAR B = VAR A", asked for A's value) is found link by link
    as the answer names each one; composed with the question's ranking, ``Fused((EventText(), AnswerText()))``,
    before the answer has written anything it adds nothing (all zeros, which Fused standardises to zeros)."""

    __repr__ = short_repr

    every: int = 4
    """Re-embed the answer after every this many generated tokens (cost each time: one short embedding, one ranking
    for the forward, and each layer gathering the events it chose; the steps between reuse the last choice)."""

    uses_event_text = True
    query_free = True

    def __post_init__(self) -> None:
        value = self.every
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"AnswerText's every is a positive number of generated tokens, got {value!r}.")

    def score(self, step: ScoringStep) -> torch.Tensor:
        return answering_scores(step, step.plan.answer_scores, "AnswerText ranks events by what an answer has "
                                "written, which only answering forwards have: compose it as ForQuestions(answering="
                                "Fused((EventText(), AnswerText()))) so reading uses another scorer.")


def answering_scores(step: ScoringStep, scores: torch.Tensor | None, refusal: str) -> torch.Tensor:
    """A text scorer's scores, computed once per forward into the plan: all zeros (no preference) in an answering
    forward with nothing to rank by yet, and a reading forward, which has no question, refused with ``refusal``."""
    if scores is not None:
        return scores
    if not step.plan.answering:
        raise ValueError(refusal)
    return torch.zeros(step.event_sizes.shape[0])


@dataclass(frozen=True)
class Fused:
    """The sum of several scorers' standardised scores (each mean 0, deviation 1, times its weight): two views of the
    same events, e.g. what the question means (EventText) and what the model's layers attend to
    (Representatives), each rescuing facts the other ranks low. Every part scores every event exactly."""

    __repr__ = short_repr

    parts: tuple[Scorer, ...] = (Representatives(),)
    weights: tuple[float, ...] = ()
    """One weight per part; empty: all 1."""

    def __post_init__(self) -> None:
        if not self.parts or not all(isinstance(p, Scorer) for p in self.parts):
            raise ValueError(f"Fused needs a non-empty tuple of scorers, got {self.parts!r}.")
        if self.weights and len(self.weights) != len(self.parts):
            raise ValueError(f"Fused has {len(self.parts)} parts but {len(self.weights)} weights: give one weight per "
                             "part, or none for equal weights.")

    @property
    def uses_stored_keys(self) -> bool:
        return any(uses_stored_keys(p) for p in self.parts)

    @property
    def uses_event_text(self) -> bool:
        return any(uses_event_text(p) for p in self.parts)

    @property
    def query_free(self) -> bool:
        return all(query_free(p) for p in self.parts)

    def score(self, step: ScoringStep) -> torch.Tensor:
        exact = dataclasses.replace(step, candidates=None)
        weights = self.weights or (1.0,) * len(self.parts)
        return functools.reduce(operator.add, [w * standardise(p.score(exact)) for p, w in zip(self.parts, weights)])


def standardise(scores: torch.Tensor) -> torch.Tensor:
    """Mean 0, deviation 1 (float32), so scores of different scale can be added; constant scores become zeros."""
    scores = scores.float()
    spread = scores.std() if scores.numel() > 1 else scores.new_tensor(0.0)
    return (scores - scores.mean()) / spread.clamp_min(1e-12)


@dataclass(frozen=True)
class Pinned:
    """``inner``'s scores with the events holding pinned spans (EpisodicMemory.pin) at +inf, so they are retrieved
    first, in input order, inside the similarity budget."""

    __repr__ = short_repr

    inner: Scorer
    events: tuple[int, ...]

    @property
    def uses_stored_keys(self) -> bool:
        return uses_stored_keys(self.inner)

    @property
    def uses_event_text(self) -> bool:
        return uses_event_text(self.inner)

    @property
    def query_free(self) -> bool:
        return query_free(self.inner)

    def score(self, step: ScoringStep) -> torch.Tensor:
        scores = self.inner.score(step).float().clone()
        scores[list(self.events)] = float("inf")
        return scores


def parts(scorer: Scorer) -> Iterator[Scorer]:
    """The scorer and every scorer composed into it, depth first."""
    yield scorer
    if dataclasses.is_dataclass(scorer):
        for field in dataclasses.fields(scorer):
            value = getattr(scorer, field.name)
            for inner in value if isinstance(value, tuple) else (value,):
                if isinstance(inner, Scorer):
                    yield from parts(inner)


def with_parameters(scorer: Scorer, kind: type, **changes: Any) -> Scorer:
    """The scorer with ``changes`` made to every part of type ``kind`` (e.g. every Representatives' backend)."""
    if not dataclasses.is_dataclass(scorer):
        return scorer
    inner: dict[str, Any] = {}
    for field in dataclasses.fields(scorer):
        value = getattr(scorer, field.name)
        if isinstance(value, tuple) and value and all(isinstance(v, Scorer) for v in value):
            inner[field.name] = tuple(with_parameters(v, kind, **changes) for v in value)
        elif isinstance(value, Scorer):
            inner[field.name] = with_parameters(value, kind, **changes)
    own = changes if isinstance(scorer, kind) else {}
    return dataclasses.replace(cast(Any, scorer), **inner, **own) if inner or own else scorer


def representative_search(scorer: Scorer) -> tuple[str, int]:
    """(backend, faiss_min_events) of the scorer's Representatives parts, which every layer's index searches with;
    the defaults where it has none. Parts that disagree are refused: one index serves them all."""
    settings = {(p.backend, p.faiss_min_events) for p in parts(scorer) if isinstance(p, Representatives)}
    if len(settings) > 1:
        raise ValueError(f"The scorer's Representatives parts search differently ({sorted(settings)}); one index per "
                         "layer serves them all: give them the same backend and faiss_min_events.")
    default = Representatives()
    return settings.pop() if settings else (default.backend, default.faiss_min_events)


def relevance_bias_of(scorer: Scorer) -> float:
    """The relevance_bias of the scorer's EventText parts (0 where it has none); parts that disagree are refused:
    attention takes one bias."""
    biases = {float(p.relevance_bias) for p in parts(scorer) if isinstance(p, EventText)}
    if len(biases) > 1:
        raise ValueError(f"The scorer's EventText parts ask for different relevance_bias values ({sorted(biases)}); "
                         "attention takes one: give them the same.")
    return biases.pop() if biases else 0.0


def answer_cadence(scorer: Scorer) -> int:
    """Every how many generated tokens the answer is re-embedded for the scorer's AnswerText parts (the most frequent
    they ask for); 0 where it has none."""
    return min((p.every for p in parts(scorer) if isinstance(p, AnswerText)), default=0)


def uses_stored_keys(scorer: Scorer) -> bool:
    """Whether the scorer reads every stored key of a layer (the layer then keeps its float32 key copy current)."""
    return bool(getattr(scorer, "uses_stored_keys", False))


def uses_event_text(scorer: Scorer) -> bool:
    """Whether the scorer ranks by event text (the memory then embeds each event's text when it is evicted)."""
    return bool(getattr(scorer, "uses_event_text", False))


def query_free(scorer: Scorer) -> bool:
    """Whether the scorer's answering scores read no queries, only the forward's plan (EventText's question), so
    every forward of one answer ranks the same until events are stored: the retriever then reuses its last choice
    instead of ranking again at every decoded token of every layer (forward.retrieve). A scorer of your own that
    reads nothing but ``step.plan`` and the event sizes may say so with a ``query_free = True`` attribute."""
    return bool(getattr(scorer, "query_free", False))


def rank_events(scores: torch.Tensor, candidates: int, pinned: Sequence[int] = ()) -> torch.Tensor:
    """Event ids best first (CPU): the pinned events (scored +inf by Pinned) in input order, then the best
    ``candidates`` others; events scored -inf are left out. One copy to the host per call: on a GPU each
    ``nonzero`` or boolean index on the device made the host wait (measured: 3 of ~3.2 waits per layer and chunk)."""
    k = min(scores.numel(), candidates + len(pinned))
    top, ids = torch.topk(scores, k)
    ids = torch.where(torch.isfinite(top), ids, -1).cpu()  # the one copy; -1 marks the pinned and the -inf
    return torch.cat([torch.tensor(sorted(pinned), dtype=torch.long), ids[ids >= 0]])


SCORINGS = ("representatives", "attention", "attention_for_questions")
POOLINGS = ("none", "cumulative")


def scorer_from_names(scoring: str = "representatives", pooling: str = "none") -> Scorer:
    """The scorer the command line's --retrieval-scoring and --retrieval-pooling name."""
    base: dict[str, Scorer] = {"representatives": Representatives(), "attention": AttentionMass(),
                               "attention_for_questions": ForQuestions()}
    if scoring not in base:
        raise ValueError(f"retrieval scoring must be one of {SCORINGS}, got {scoring!r}.")
    if pooling not in POOLINGS:
        raise ValueError(f"retrieval pooling must be one of {POOLINGS}, got {pooling!r}.")
    return Pooled(base[scoring]) if pooling == "cumulative" else base[scoring]


# ---------------------------------------------------------------------- saving a scorer with a memory
BUILT_IN: dict[str, type] = {cls.__name__: cls for cls in (Representatives, AttentionMass, ForQuestions, Pooled,
                                                             EventText, AnswerText, Fused)}


def scorer_to_spec(scorer: Scorer) -> dict[str, Any]:
    """A JSON-able description of a built-in scorer composition (a saved memory records how it ranks events)."""
    name = type(scorer).__name__
    if BUILT_IN.get(name) is not type(scorer):
        raise TypeError(f"{name} is not one of emllm's scorers ({', '.join(BUILT_IN)}): a memory using it cannot be "
                        "saved, because loading could not rebuild it. Compose the built-in scorers instead.")
    fields = dataclasses.fields(cast(Any, scorer))  # every built-in scorer is a dataclass
    return {"type": name, **{f.name: _field_to_spec(getattr(scorer, f.name)) for f in fields}}


def _field_to_spec(value: Any) -> Any:
    if isinstance(value, tuple):
        return [_field_to_spec(v) for v in value]
    return value if value is None or isinstance(value, (int, float, str)) else scorer_to_spec(value)


def scorer_from_spec(spec: Any) -> Scorer:
    """The scorer scorer_to_spec described; ValueError naming what is wrong otherwise."""
    if not isinstance(spec, dict) or spec.get("type") not in BUILT_IN:
        raise ValueError(f"not a description of one of emllm's scorers ({', '.join(BUILT_IN)}): {spec!r}")
    cls = BUILT_IN[spec["type"]]
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = set(spec) - {"type"} - fields
    if unknown:
        raise ValueError(f"{spec['type']} takes {sorted(fields)}, the description has {sorted(set(spec) - {'type'})}")
    # A parameter added since the description was written is left at its default (what the memory was read with).
    return cls(**{name: _field_from_spec(spec[name]) for name in fields if name in spec})


def _field_from_spec(value: Any) -> Any:
    if isinstance(value, list):
        return tuple(_field_from_spec(v) for v in value)
    if value is None or (isinstance(value, (int, float, str)) and not isinstance(value, bool)):
        return value
    return scorer_from_spec(value)
