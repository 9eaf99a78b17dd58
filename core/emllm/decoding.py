"""Turning a read prompt's logits into an answer: sampling settings checked once, the token loop, stop strings.

decode() is the loop every answer runs, alone or beside other conversations: the logits a memory holds after its
prompt pick a token (greedy, or sampled), the token is fed back through a step function (which may batch it with
other conversations' tokens, batching.StepBatcher), and text is yielded as soon as no stop string can still begin in
it. A grammar (llguidance) masks the logits; the end of turn or a complete grammar ends the answer.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from .grammar import Grammar, GrammarConstraint
from .memory import EpisodicMemory, RetrievedEvent


class Decoding(NamedTuple):
    """How one answer is decoded (made by ``decoding()``, which checks every setting before anything is read)."""
    max_new_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    stop: list[str]
    grammar: Grammar | None = None
    allow_empty: bool = True
    attribute: bool = False  # record where the answer's attention went (GenerationResult.attention)
    reread: bool = False     # answer from the retrieved events re-read as text under full attention (emllm.reread)


@dataclass
class GenerationResult:
    text: str
    finish_reason: str              # "stop" (end of turn or a stop string) or "length"
    input_tokens: int               # prompt tokens, including those the memory had already read
    output_tokens: int              # tokens generated (what the tokenizer counts for `text` plus any stop)
    new_input_tokens: int           # prompt tokens actually read by this call
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    token_ids: list[int] = field(default_factory=list)
    retrieved_events: list[RetrievedEvent] = field(default_factory=list)  # memory in attention as the answer began
    # [positions] with stream(attribute=True): the attention the generated tokens gave each absolute position of the
    # prompt and answer (local window, sinks, retrieved events), summed over tokens, layers and heads
    attention: torch.Tensor | None = None


class Answer(NamedTuple):
    """What decode() returns once its text deltas are yielded."""
    text: str
    finish_reason: str
    token_ids: list[int]


class TextStream:
    """An iterator of text deltas; ``result`` holds the GenerationResult once it is exhausted."""

    def __init__(self, deltas: Iterator[str], holder: dict):
        self._deltas, self._holder = deltas, holder

    def __iter__(self) -> Iterator[str]:
        return self._deltas

    def __next__(self) -> str:
        return next(self._deltas)

    def close(self) -> None:
        """Stop generating here, as a generator's close() does: the memory keeps what it has read, no result is
        made, and concurrent conversations stop waiting for this one's steps."""
        close = getattr(self._deltas, "close", None)
        if close is not None:
            close()

    @property
    def result(self) -> GenerationResult:
        if "result" not in self._holder:
            raise RuntimeError("The stream has not finished yet: iterate it to the end first.")
        return self._holder["result"]


def decoding(max_new_tokens: int = 256, temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0,
             seed: int | None = None, stop: Iterable[str] | None = None, grammar: Grammar | None = None,
             allow_empty: bool = True, attribute: bool = False, reread: bool = False) -> Decoding:
    """The decoding settings of one answer, each checked (check_sampling) before any reading."""
    check_sampling(max_new_tokens, temperature, top_p, top_k, seed=seed, stop=stop)
    check_reread(reread)
    return Decoding(max_new_tokens, temperature, top_p, top_k, seed, list(stop or []), grammar, allow_empty,
                    attribute, reread)


def check_reread(reread: Any) -> None:
    """``reread`` switches a slow reading on: a truthy string such as "false" must not switch it on by accident."""
    if not isinstance(reread, bool):
        raise TypeError(f"reread must be True or False (True: answer from the retrieved events re-read as text, "
                        f"slower, better on questions that ask for several items), got {type(reread).__name__} "
                        f"{reread!r}.")


def decode(memory: EpisodicMemory, settings: Decoding, *, tokenizer: Any, eos_ids: set[int],
           constraint: GrammarConstraint | None, step: Callable[[EpisodicMemory, int], None]
           ) -> Generator[str, None, Answer]:
    """Yield the answer's text deltas from the memory's last logits, feeding each token back through ``step``
    (which reads it into the memory, leaving the next logits there); returns the Answer."""
    generator = torch.Generator(device="cpu").manual_seed(settings.seed) if settings.seed is not None else None
    stop = settings.stop
    generated: list[int] = []
    emitted, text, finish = "", "", "length"
    for index in range(settings.max_new_tokens):
        logits = memory.last_logits
        if logits is None:
            raise RuntimeError("decode() starts from the logits of a read prompt: read the prompt first.")
        if constraint is not None:
            logits = constraint.mask(logits)
        if not settings.allow_empty and not text.strip():
            held = logits.clone()
            held[sorted(eos_ids)] = float("-inf")
            logits = held if torch.isfinite(held).any() else logits  # a grammar may allow only the end
        token = sample_token(logits, settings.temperature, settings.top_p, settings.top_k, generator)
        if token in eos_ids:
            finish = "stop"
            generated.append(token)
            break
        if constraint is not None:
            constraint.advance(token)
        generated.append(token)
        text = tokenizer.decode(generated, skip_special_tokens=True)
        cut = find_stop(text, stop, len(emitted))
        if cut is not None:
            if cut > len(emitted):
                yield text[len(emitted):cut]
            emitted, finish = text[:cut], "stop"
            break
        done = constraint is not None and constraint.finished
        safe = len(text) if done else safe_length(text, stop)
        if safe > len(emitted):
            yield text[len(emitted):safe]
            emitted = text[:safe]
        if done:  # the grammar is complete and allows nothing more
            finish = "stop"
            break
        if index + 1 < settings.max_new_tokens:
            step(memory, token)
    else:
        text = tokenizer.decode(generated, skip_special_tokens=True)
        if len(text) > len(emitted):
            yield text[len(emitted):]
        emitted = text
    return Answer(emitted, finish, generated)


def sample_token(logits: torch.Tensor, temperature: float, top_p: float, top_k: int,
                 generator: torch.Generator | None) -> int:
    """Greedy when temperature is 0; otherwise temperature, then top-k, then nucleus (top-p) sampling."""
    if temperature <= 0:
        return int(torch.argmax(logits))
    # In float64 from the best logit down: a temperature near zero (1e-195) then gives -inf to every other token
    # and 0 to the best, where float32 would overflow to inf - inf = nan.
    logits = logits.detach().double().cpu()
    logits = (logits - logits.max()) / temperature
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        outside = torch.cumsum(probs, dim=-1) - probs > top_p  # keep the smallest set reaching top_p
        logits = logits.masked_fill(torch.zeros_like(outside).scatter(0, order, outside), float("-inf"))
    return int(torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator))


def check_sampling(max_new_tokens: int, temperature: float, top_p: float, top_k: int, *, seed: Any = None,
                   stop: Any = None, length_name: str = "max_new_tokens") -> None:
    """Refuse bad sampling settings before any reading; adapters pass their own name for the length
    (LangChain and LlamaIndex call it max_tokens) so the message names what the user typed. A lone string as
    ``stop`` is refused: iterated, it would stop at any of its characters."""
    if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 1:
        raise ValueError(f"{length_name} must be a positive integer (the most tokens to generate), "
                         f"got {max_new_tokens!r}.")
    if not isinstance(temperature, (int, float)) or not temperature >= 0 or temperature == float("inf"):
        raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {temperature!r}.")
    if not isinstance(top_p, (int, float)) or not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p!r}.")
    if not isinstance(top_k, int) or isinstance(top_k, bool) or top_k < 0:
        raise ValueError(f"top_k must be an integer >= 0 (0 = off), got {top_k!r}.")
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 2 ** 64):
        raise ValueError(f"seed must be None or an integer in [0, 2**64), got {seed!r}.")
    if stop is None:
        return
    # A dict would stop at its keys; an iterator would be used up by this check and leave no stops.
    if isinstance(stop, (str, bytes, Mapping, Iterator)) or not isinstance(stop, Iterable):
        raise TypeError(f"stop must be a list of strings, e.g. stop=[{stop!r}], got {type(stop).__name__} {stop!r}.")
    bad = [s for s in stop if not isinstance(s, str) or not s]
    if bad:
        raise TypeError(f"stop must hold non-empty strings only; got {bad!r} in {list(stop)!r}.")


def find_stop(text: str, stop: list[str], emitted: int) -> int | None:
    """Earliest position of any stop string that ends after what was already emitted."""
    hits = [i for s in stop if (i := text.find(s, max(0, emitted - len(s) + 1))) != -1]
    return min(hits) if hits else None


def safe_length(text: str, stop: list[str]) -> int:
    """How much text can be emitted: hold back a trailing partial character or a possible stop-string start."""
    end = len(text)
    while end and text[end - 1] == "\ufffd":
        end -= 1
    holdback = 0
    for s in stop:
        for k in range(min(len(s) - 1, end), holdback, -1):
            if text[:end].endswith(s[:k]):
                holdback = k
                break
    return end - holdback


def end_of_turn_ids(model: torch.nn.Module, tokenizer: Any) -> set[int]:
    """Token ids that end a turn: the model's and tokenizer's eos ids and the common chat end tokens it has."""
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), model.config, tokenizer):
        value = getattr(source, "eos_token_id", None)
        if value is not None:
            ids.update(value if isinstance(value, (list, tuple, set)) else [value])
    for token in ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end|>"):
        token_id = tokenizer.convert_tokens_to_ids(token) if token in tokenizer.get_vocab() else None
        if token_id is not None:
            ids.add(token_id)
    return ids
