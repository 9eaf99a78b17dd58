"""Every knob of the engine in one dataclass, the paper's presets, and validation with clear errors.

The context that attention sees for each layer is

    [ n_init attention sinks | retrieved events (<= n_mem tokens) | local window (n_local recent tokens) ]

Input is read in chunks of ``chunk_size`` tokens. Events are cut where the model is surprised
(``segmentation="surprise"``) or every ``max_block_size`` tokens (``"fixed"``, InfLLM), optionally refined
by graph modularity or conductance, and retrieved per layer by k-NN over representative keys.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass
from typing import Any, Literal, get_args

from .scoring import (AnswerText, EventText, ForQuestions, Fused, Representatives, Scorer, relevance_bias_of,
                      representative_search)

Segmentation = Literal["surprise", "fixed"]
Refinement = Literal["none", "modularity", "conductance"]
AttentionMode = Literal["episodic", "full"]
MemoryPositions = Literal["fixed", "ordered"]

DEFAULT_PRESET = "EG"
"""The preset EMEngine.from_pretrained(), the adapters, compare and the command line use unless told otherwise: E's
text ranking with only the events near the best (look-alikes stay out) and three neighbours of each. On the bench's
test split (benchmarks/RESULTS.md, 20 questions a cell) it ties E on facts, chains and the chronicle and leads it on
needles from 32K (single needles +25 points at 32K, +40 at 128K), at the same decode cost (0.99x)."""


class ConfigError(ValueError):
    """An impossible or contradictory setting; the message names the field and the fix."""


@dataclass(frozen=True)
class EMConfig:
    """What a user sets, in four sections (SECTIONS): the context layout, how events are cut, how they are retrieved,
    and where they are stored. Every field is a keyword (``EMConfig(n_local=4096)``, ``EMConfig.from_preset("E",
    n_mem=1024)``); a scorer's own parameters live on the scorer object (``scorer=Representatives(backend="faiss")``).
    """

    # --- layout: what attention spans (tokens) ---
    n_init: int = 128
    """Attention-sink tokens kept from the very start of the input."""
    n_local: int = 2048
    """Most recent tokens, attended with exact relative positions."""
    n_mem: int = 2048
    """Token budget of retrieved events (similarity buffer + contiguity buffer)."""
    chunk_size: int = 512
    """Tokens per forward pass while reading input; retrieval runs once per chunk."""
    full_until: int = 0
    """Inputs up to this many tokens are read in plain full attention (at most half the trained length); 0 = off."""

    attention: AttentionMode = "episodic"
    """"full" is plain full attention over every token (the baseline; fails past the trained context)."""
    memory_positions: MemoryPositions = "fixed"
    """Memory keys all at one distance ("fixed", paper/InfLLM) or in input order before the window ("ordered")."""

    # --- segmentation: where events are cut ---
    segmentation: Segmentation = "surprise"
    """Where events are cut: "surprise" (the paper, Eq. 1) or "fixed" every max_block_size tokens (InfLLM)."""
    refinement: Refinement = "none"
    """Boundary refinement by graph "modularity" or "conductance" over key similarity (paper 3.3), or "none"."""
    gamma: float = 1.0
    """Threshold T = mean + gamma * std of the preceding ``surprise_window`` surprise values (Eq. 1)."""
    surprise_window: int = 512
    """tau: how many preceding surprise values set the moving threshold."""
    min_block_size: int = 8
    """The shortest event, in tokens."""
    max_block_size: int = 128
    """The longest event, in tokens (a longer surprise-free stretch is cut)."""

    # --- retrieval: which events each layer attends to ---
    repr_topk: int = 4
    """Tokens per event (per KV head) whose keys, averaged, represent the event for k-NN."""
    contiguity: float = 0.0
    """Fraction of ``n_mem`` given to the contiguity buffer (neighbours of retrieved events); 0 = off."""
    contiguity_neighbours: int = 1
    """Neighbours on each side of a retrieved event that enter the contiguity buffer."""
    scorer: Scorer = Representatives()
    """Ranks each layer's events for retrieval (emllm.scoring): Representatives() is the paper's k-NN."""
    event_embedding: str = "minilm"
    """The sentence-transformers model that embeds event text for EventText scorers: "minilm", "mpnet" or a folder."""
    # A scorer's own parameters live on the scorer: Representatives(backend=..., faiss_min_events=...) for how the
    # representatives are searched, EventText(relevance_bias=...) for EpMAN's differentiating attention.

    # --- storage: where evicted events live, and how much may be read ---
    page_tokens: int = 1024
    """Evicted tokens per storage page (the unit moved between device, RAM and disk)."""
    ram_budget_mb: float | None = None
    """RAM for the memory: evicted KV pages and the event index; pages past it go to disk (LRU). None = no limit."""
    device_budget_mb: float | None = None
    """On an accelerator, device memory for KV pages and the event index held there; pages past it go to RAM."""
    offload_dir: str | None = None
    """Where disk pages go (a private temporary folder inside it, removed on close). None = system temp."""
    disk_budget_mb: float | None = None
    """Disk for one memory's pages; a read that cannot fit is refused first, one cut short leaves it as it was."""
    max_input_tokens: int | None = None
    """Refuse inputs longer than this before any work starts. None = no limit."""

    def __post_init__(self) -> None:
        self.validate()

    # ------------------------------------------------------------------ validation
    def validate(self) -> None:
        positive = ["n_local", "n_mem", "chunk_size", "min_block_size", "max_block_size", "repr_topk",
                    "surprise_window", "contiguity_neighbours", "page_tokens"]
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}.")
        for name in ("n_init", "full_until"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ConfigError(f"{name} must be an integer >= 0, got {value!r}.")
        _check_choice("segmentation", self.segmentation, get_args(Segmentation))
        _check_choice("refinement", self.refinement, get_args(Refinement))
        _check_choice("attention", self.attention, get_args(AttentionMode))
        _check_choice("memory_positions", self.memory_positions, get_args(MemoryPositions))
        if not isinstance(self.scorer, Scorer):
            raise ConfigError(f"scorer must be a scorer object with a score(step) method (emllm.scoring: "
                              f"Representatives(), Pooled(ForQuestions()), ...), got {self.scorer!r}.")
        try:  # one search setting and one relevance bias per memory, however the scorer is composed
            representative_search(self.scorer)
            relevance_bias_of(self.scorer)
        except ValueError as error:
            raise ConfigError(f"scorer {self.scorer!r}: {error}") from None
        if not isinstance(self.event_embedding, (str, os.PathLike)) or not str(self.event_embedding).strip():
            raise ConfigError(f"event_embedding must name a sentence-transformers model (\"minilm\", \"mpnet\" or a "
                              f"local folder), got {self.event_embedding!r}.")
        if self.min_block_size > self.max_block_size:
            raise ConfigError(
                f"min_block_size ({self.min_block_size}) is larger than max_block_size ({self.max_block_size}): "
                "no event size satisfies both; lower min_block_size or raise max_block_size.")
        if self.max_block_size < 2 * self.min_block_size - 1:
            raise ConfigError(
                f"max_block_size ({self.max_block_size}) must be at least 2 * min_block_size - 1 "
                f"({2 * self.min_block_size - 1}): otherwise an event a little longer than max_block_size cannot be "
                "cut into pieces of at least min_block_size; lower min_block_size or raise max_block_size.")
        if not isinstance(self.contiguity, (int, float)) or isinstance(self.contiguity, bool) \
                or not 0.0 <= self.contiguity < 1.0:
            raise ConfigError(f"contiguity is a fraction of n_mem in [0, 1), got {self.contiguity!r}.")
        most_neighbours = max(8, self.n_mem // self.min_block_size)  # more could never fit in the buffer
        if self.contiguity_neighbours > most_neighbours:
            raise ConfigError(
                f"contiguity_neighbours ({self.contiguity_neighbours}) is more than the {most_neighbours} events "
                "n_mem // min_block_size could hold (at least 8): more neighbours never fit; lower it.")
        if self.max_block_size > self.similarity_tokens:
            raise ConfigError(
                f"max_block_size ({self.max_block_size}) exceeds the similarity buffer ({self.similarity_tokens} "
                f"tokens: n_mem ({self.n_mem}) minus the contiguity share): a full-size event could never be "
                "retrieved; raise n_mem, lower contiguity or lower max_block_size.")
        if not isinstance(self.gamma, (int, float)) or isinstance(self.gamma, bool) or not math.isfinite(self.gamma):
            raise ConfigError(f"gamma must be a finite number, got {self.gamma!r}.")
        if self.offload_dir is not None and not isinstance(self.offload_dir, (str, os.PathLike)):
            raise ConfigError(f"offload_dir must be a folder path or None, got {self.offload_dir!r}.")
        if self.offload_dir is not None and os.path.exists(self.offload_dir) and not os.path.isdir(self.offload_dir):
            raise ConfigError(f"offload_dir {str(self.offload_dir)!r} is a file, not a folder: give a folder (it is "
                              "created if missing).")
        for name in ("ram_budget_mb", "device_budget_mb", "disk_budget_mb"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, (int, float)) or isinstance(value, bool)
                                      or not value >= 0):
                raise ConfigError(f"{name} must be a number >= 0 (MB) or None (no limit), got {value!r}.")
        if self.max_input_tokens is not None and (not isinstance(self.max_input_tokens, int)
                                                  or isinstance(self.max_input_tokens, bool)
                                                  or self.max_input_tokens < 1):
            raise ConfigError(f"max_input_tokens must be >= 1 or None, got {self.max_input_tokens!r}.")

    def validate_for_model(self, max_positions: int, num_layers: int) -> None:
        """Refuse layouts the model cannot address: positions beyond its trained range are what EM-LLM avoids."""
        if self.attention == "full":
            return
        needed = self.rope_positions()
        if needed > max_positions:
            layout, fields = "n_init + n_local + 2*max_block_size + chunk_size", f"n_local (now {self.n_local})"
            if self.memory_positions == "ordered":
                layout = "n_init + n_mem + n_local + 2*max_block_size + chunk_size (memory_positions='ordered')"
                fields += f", n_mem (now {self.n_mem})"
            raise ConfigError(
                f"{layout} = {needed} relative positions, but the model was trained on {max_positions}. Lower "
                f"{fields} or chunk_size (now {self.chunk_size}) so the context fits the model's trained length.")

    def max_position(self) -> int:
        """The largest relative position the local window can reach (see EpisodicMemory.evict for why)."""
        return self.n_init + self.n_local + 2 * self.max_block_size + self.chunk_size

    def full_attention_tokens(self, max_positions: int) -> int:
        """How long an input is read in plain full attention before the first eviction (full_until, at most half the
        model's trained positions ``max_positions``); 0 when episodic attention starts at once."""
        return min(self.full_until, max_positions // 2) if self.attention == "episodic" else 0

    def window_capacity(self, max_positions: int) -> int:
        """The most tokens a local window can hold: max_position(), or while full attention lasts, that many tokens
        and one more chunk (nothing is evicted until a forward ends past full_until)."""
        full = self.full_attention_tokens(max_positions)
        return max(self.max_position(), full + self.chunk_size if full else 0)

    def rope_positions(self) -> int:
        """Positions the rotary table must cover: the window's, and under ordered memory positions the memory part
        (sinks + at most n_mem retrieved tokens) laid out before it."""
        return self.max_position() + (self.n_mem if self.memory_positions == "ordered" else 0)

    # ------------------------------------------------------------------ derived values
    @property
    def contiguity_tokens(self) -> int:
        return round(self.n_mem * self.contiguity)

    @property
    def similarity_tokens(self) -> int:
        return self.n_mem - self.contiguity_tokens

    def replace(self, **changes: Any) -> EMConfig:
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_preset(cls, preset: str = DEFAULT_PRESET, **overrides: Any) -> EMConfig:
        """A preset by the paper's name, with any field overridden by keyword."""
        key = _PRESET_ALIASES.get(preset.strip().upper().replace(" ", "")) if isinstance(preset, str) else None
        if key is None:
            raise ConfigError(f"Unknown preset {preset!r}. Choose one of: {', '.join(PRESETS)}.")
        moved = [f"{name} is now {MOVED_FIELDS[name]}" for name in overrides if name in MOVED_FIELDS]
        if moved:
            raise ConfigError(f"{'; '.join(moved)}: a scorer's own parameters live on the scorer, e.g. "
                              "scorer=ForQuestions(answering=EventText(relevance_bias=2.0)) (preset ED).")
        unknown = sorted(set(overrides) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise ConfigError(f"Unknown config field(s) {unknown}. Valid fields: "
                              f"{', '.join(f.name for f in dataclasses.fields(cls))}.")
        return cls(**{**PRESETS[key], **overrides})


SECTIONS: dict[str, tuple[str, ...]] = {
    "layout": ("n_init", "n_local", "n_mem", "chunk_size", "full_until", "attention", "memory_positions"),
    "segmentation": ("segmentation", "refinement", "gamma", "surprise_window", "min_block_size", "max_block_size"),
    "retrieval": ("repr_topk", "contiguity", "contiguity_neighbours", "scorer", "event_embedding"),
    "storage": ("page_tokens", "ram_budget_mb", "device_budget_mb", "offload_dir", "disk_budget_mb",
                "max_input_tokens"),
}
"""EMConfig's fields by section, in order: docs/config.md is laid out by it (a test holds every field to one)."""


def _check_choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(f"{name} must be one of {choices}, got {value!r}.")


PRESETS: dict[str, dict[str, Any]] = {
    # S: surprise boundaries only. M: refined by modularity. C (after +): contiguity buffer.
    "S": dict(segmentation="surprise", refinement="none", contiguity=0.0),
    "SM": dict(segmentation="surprise", refinement="modularity", contiguity=0.0),
    "SC": dict(segmentation="surprise", refinement="conductance", contiguity=0.0),
    "S+C": dict(segmentation="surprise", refinement="none", contiguity=0.3),
    "SM+C": dict(segmentation="surprise", refinement="modularity", contiguity=0.3),
    # F: fixed-size events (InfLLM), optionally refined.
    "F": dict(segmentation="fixed", refinement="none", contiguity=0.0),
    "FM": dict(segmentation="fixed", refinement="modularity", contiguity=0.0),
    "FC": dict(segmentation="fixed", refinement="conductance", contiguity=0.0),
    "full": dict(attention="full"),
    # E (ours, after EpMAN without training): a question ranks events by their text's embedding, alone (E) or fused
    # with the model's representative keys (ER); neighbours of each retrieved event come along (its BroadAttn).
    "E": dict(segmentation="surprise", refinement="none", contiguity=0.3,
              scorer=ForQuestions(answering=EventText())),
    "ER": dict(segmentation="surprise", refinement="none", contiguity=0.3,
               scorer=ForQuestions(answering=Fused((EventText(), Representatives())))),
    # ED: E with EpMAN's differentiating attention (attention leans to the events the question ranks first).
    "ED": dict(segmentation="surprise", refinement="none", contiguity=0.3,
               scorer=ForQuestions(answering=EventText(relevance_bias=2.0))),
    # EA: E whose ranking follows the answer (what it has written so far joins the question, every 4 tokens).
    "EA": dict(segmentation="surprise", refinement="none", contiguity=0.3,
               scorer=ForQuestions(answering=Fused((EventText(), AnswerText())))),
    # EG: E that retrieves only the events whose text ranks within 0.1 of the best (look-alikes of a fact stay out),
    # with three neighbours on each side of each (few events retrieved would leave a value cut by surprise in parts).
    "EG": dict(segmentation="surprise", refinement="none", contiguity=0.3, contiguity_neighbours=3,
               scorer=ForQuestions(answering=EventText(within=0.1))),
    # EGT: EG whose filter stands aside when three or more events tie near the best (a chain's links rank flat):
    # those questions fill the whole budget as E does; the rest are EG's.
    "EGT": dict(segmentation="surprise", refinement="none", contiguity=0.3, contiguity_neighbours=3,
                scorer=ForQuestions(answering=EventText(within=0.1, ties=3))),
}
#: Fields of earlier EMConfigs that are now parameters of a scorer (saved memories with them still load).
MOVED_FIELDS = {"relevance_bias": "EventText(relevance_bias=...)", "retrieval_backend": "Representatives(backend=...)",
                "faiss_min_events": "Representatives(faiss_min_events=...)"}
_PRESET_ALIASES = {name.upper(): name for name in PRESETS}


def reference_markdown() -> str:
    """docs/config.md: one row per EMConfig field (name, default, its one-line doc), the presets, from this source,
    so the page cannot drift from the code (tests/unit_tests/test_config_reference.py compares them)."""
    import ast
    import inspect
    import itertools
    import textwrap

    class_def = ast.parse(textwrap.dedent(inspect.getsource(EMConfig))).body[0]
    assert isinstance(class_def, ast.ClassDef)
    docs = {node.target.id: " ".join(next_node.value.value.split())
            for node, next_node in itertools.pairwise(class_def.body)
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(next_node, ast.Expr)
            and isinstance(next_node.value, ast.Constant) and isinstance(next_node.value.value, str)}
    defaults = EMConfig()
    rows = [line for section, names in SECTIONS.items()
            for line in (f"| **{section}** | | |",
                         *(f"| `{name}` | `{getattr(defaults, name)!r}` | {docs.get(name, '')} |" for name in names))]
    presets = [f"| `{name}` | {', '.join(f'{k}={v!r}' for k, v in fields.items())} |"
               for name, fields in PRESETS.items()]
    return "\n".join([
        "# EMConfig reference", "",
        "Generated from `core/emllm/config.py` by `make docs` (`emllm.config.reference_markdown()`); a test keeps it "
        "current.",
        f"Every field can be passed to `EMEngine.from_pretrained(...)`, `EMConfig.from_preset(...)` and the adapters' "
        f"`config=`. The default preset is `{DEFAULT_PRESET}`.", "",
        "| field | default | what it does |", "|---|---|---|", *rows, "",
        "## Presets (the paper's, and E, ER: the question ranks events by their text)", "",
        "| preset | fields it sets |", "|---|---|", *presets, "",
        "Scorers (`emllm.scoring`): `Representatives()` (the paper's k-NN), `AttentionMass()`, `EventText()` (the "
        "question's embedding against each event's text), `AnswerText(every=4)` (the answer written so far against "
        "each event's text, re-embedded every 4 tokens; preset EA), `ForQuestions(reading, answering)`, "
        "`Pooled(inner)`, "
        "`Fused(parts, weights)`; compose them, e.g. `scorer=ForQuestions(answering=Fused((EventText(), "
        "Representatives())))`. A scorer's own parameters are set on it: `Representatives(backend=\"auto\", "
        "faiss_min_events=20000)` (how each layer's representatives are searched: torch, faiss, or faiss from that "
        "many events on) and `EventText(relevance_bias=0.0)` (EpMAN's differentiating attention: answering forwards "
        "lean to the retrieved events whose text the question ranks first; preset ED sets 2.0) and "
        "`EventText(within=None)` (retrieve only the events whose text cosine is within this of the best one's: a "
        "fact's look-alikes stay out of attention; preset EG sets 0.1, with `contiguity_neighbours=3`) and "
        "`EventText(ties=None)` (with within: when this many events are within the margin, nothing is filtered; "
        "preset EGT sets 3).", ""])
