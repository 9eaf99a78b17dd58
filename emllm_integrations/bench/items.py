"""The documents and questions of a task at one length: what every method of a bench cell is asked, and what the
scripts in benchmarks/ ask to trace the bench's questions one by one."""

from __future__ import annotations

import zlib
from collections.abc import Callable
from dataclasses import dataclass

from . import ruler
from . import tasks as builders
from .settings import BenchSettings


@dataclass(frozen=True)
class TaskItem:
    """One document set read once, and the questions asked about it."""
    task: str
    documents: tuple[str, ...]
    questions: tuple[tuple[str, str | tuple[str, ...], float, str], ...]
    """(question, expected answer or every string the answer must hold, depth, answer lead-in); an empty lead-in
    asks the question as a chat turn after the document (the RULER families), with nothing written for the model."""


def document_seed(seed: int, task: str, length: int, depth: float) -> int:
    """A seed per document that every method shares (a stable hash: Python's hash() of a str varies per process).
    Depth -1 seeds a document set asked at every depth (kv, multidoc)."""
    return zlib.crc32(f"{seed}:{task}:{length}:{depth:.6f}".encode())


def task_items(task: str, length: int, settings: BenchSettings,
               count_tokens: Callable[[str], int]) -> list[TaskItem]:
    """The documents of a task at one length, the same for every method (seeded by task, length and depth)."""
    if task in ruler.FAMILIES:  # one document holding every question (each asked from a fork of one read)
        doc = ruler.family_document(task, length, count_tokens, questions=settings.questions,
                                    seed=document_seed(settings.seed, task, length, -1.0))
        return [TaskItem(task, (doc.context,), tuple((q.question, q.answers, q.depth, "") for q in doc.questions))]
    if task == "multidoc":
        qa = builders.multidoc_documents(length, list(settings.depths), count_tokens,
                                         seed=document_seed(settings.seed, task, length, -1.0),
                                         doc_tokens=min(settings.multidoc_tokens_per_doc, length))
        return [TaskItem(task, qa.documents, tuple((q.question, q.answer, q.depth, q.answer_lead)
                                                   for q in qa.questions))]
    if task == "kv":  # one JSON object per length, a question per depth (a pair further in): read once
        first = builders.kv_document(length, settings.depths[0], count_tokens,
                                     seed=document_seed(settings.seed, task, length, -1.0))
        docs = [first.asking_at(depth) for depth in settings.depths]
        return [TaskItem(task, (docs[0].context,), tuple((d.question, d.answer, d.depth, d.answer_lead)
                                                         for d in docs))]
    haystacks: dict[str, Callable[..., builders.PasskeyDocument | builders.NeedleDocument]] = {
        "passkey": builders.passkey_document, "needle": builders.needle_document}
    build = haystacks[task]
    items = []
    for depth in settings.depths:  # one haystack, a needle (with its own answer) per depth: see read_each
        haystack = build(length, depth, count_tokens, seed=document_seed(settings.seed, task, length, depth))
        items.append(TaskItem(task, (haystack.context,),
                              ((haystack.question, haystack.answer, depth, haystack.answer_lead),)))
    return items
