"""The bench's questions as token ids with the answering sentence located: what the diagnostic scripts in
benchmarks/ (retrieval_scoring.py, multidoc_trace.py) read to see whether retrieval brings the answer into attention.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..prompts import format_context
from .items import task_items
from .settings import BenchSettings
from .tasks import needle_document, probe_suffix

if TYPE_CHECKING:
    from emllm import EMEngine


@dataclass(frozen=True)
class Probe:
    """One question's whole prompt and where its answer is stated."""
    depth: float
    answer: str
    ids: list[int]              # the whole prompt: context, question, answer lead-in
    span: tuple[int, int]       # the answering sentence's tokens (a boundary token may straddle: spans overlap)
    context_tokens: int         # ids[:context_tokens] is the context, the rest the question and answer lead-in


@dataclass(frozen=True)
class Probes:
    questions: list[Probe]
    shared_context: list[int] | None  # multidoc: one context for every question, read once, asked from forks


def token_span(engine: EMEngine, text: str, start: int, end: int) -> tuple[int, int]:
    """The tokens of text[start:end], counted as the engine tokenises the text before each end."""
    return engine.count_tokens(text[:start]), engine.count_tokens(text[:end])


def needle_probes(engine: EMEngine, tokens: int, depths: list[float], seed: int = 7) -> Probes:
    """An essay needle document per depth (tasks.needle_document), each its own context."""
    docs = [needle_document(tokens, depth, engine.count_tokens, seed=seed) for depth in depths]
    questions = []
    for doc in docs:
        context = engine.tokenize(doc.context)
        questions.append(Probe(doc.depth, doc.answer,
                               context + engine.tokenize(probe_suffix(doc.question, doc.answer_lead)),
                               token_span(engine, doc.context, doc.needle_offset,
                                          doc.needle_offset + len(doc.needle)), len(context)))
    return Probes(questions, None)


def multidoc_probes(engine: EMEngine, tokens: int, depths: list[float]) -> Probes:
    """The bench's multidoc item at this length (its documents, seed and prompts), one question per depth."""
    (item,) = task_items("multidoc", tokens, BenchSettings(("multidoc",), tuple(depths)), engine.count_tokens)
    context = format_context(list(item.documents))
    context_ids = engine.tokenize(context)
    questions = []
    for question, answer, depth, lead in item.questions:
        assert isinstance(answer, str)  # multidoc asks one fact per question
        fact = f"{lead} {answer}."  # the fact sentence, stated in exactly one document (tasks.MULTIDOC_FACT)
        where = context.index(fact)
        questions.append(Probe(depth, answer, context_ids + engine.tokenize(probe_suffix(question, lead)),
                               token_span(engine, context, where, where + len(fact)), len(context_ids)))
    return Probes(questions, context_ids)
