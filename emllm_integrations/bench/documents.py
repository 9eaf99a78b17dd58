"""What every task family of the suite builds and shares: a document holding many questions, how an answer is scored,
the checks on a generator's arguments, and sizing a document to a length in tokens. The families that make them are
ruler.py (RULER's and the facts built like them) and heldout.py (documents built another way, kept for testing)."""

from __future__ import annotations

import math
import operator
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from .tasks import check_counter, check_num_tokens, grow_to_length

TOLERANCE = 0.03        # a context is at most this much longer than asked
AIM = 1.005             # size estimates aim this far over num_tokens, so that one count usually lands in range
MAX_QUESTIONS = 500     # needles are drawn distinct pairwise (quadratic): 500 x 4 needles take seconds


@dataclass(frozen=True)
class Question:
    question: str              # asked after the document, RULER-style wording, no answer lead-in
    answers: tuple[str, ...]   # every string a correct answer must contain (all of them; case-insensitive)
    depth: float               # where its evidence sits in the context, 0 = start .. 1 = end (mean over its needles)
    evidence: tuple[str, ...] = ()  # the inserted sentences it needs (all of them), where it has any: what a
                                    # retriever must bring back (benchmarks/rag_tuning.py measures that)


@dataclass(frozen=True)
class TaskDocument:
    task: str
    context: str               # the instruction + haystack with everything inserted: read once
    questions: tuple[Question, ...]


def score(output: str, answers: str | Sequence[str]) -> float:
    """The fraction of ``answers`` found in ``output``, case-insensitive (RULER's string_match_all): a question with
    four expected values scores 0.5 when two are given. A single string counts as one answer."""
    answers = (answers,) if isinstance(answers, str) else tuple(answers)
    if not answers:
        raise ValueError("answers must hold at least one expected string (score is the fraction found).")
    found = str(output).lower()
    return sum(answer.lower() in found for answer in answers) / len(answers)


# Argument checks: all made before any work, each error naming the fix.
def check_questions(questions: object, cap: int = MAX_QUESTIONS) -> int:
    if isinstance(questions, bool) or not isinstance(questions, int) or not 1 <= questions <= cap:
        raise ValueError(f"questions must be an integer in [1, {cap}] (how many questions the document holds), got "
                         f"{questions!r}.")
    return questions


def check_seed(seed: object) -> int:
    try:
        if isinstance(seed, bool):
            raise TypeError
        return operator.index(seed)  # type: ignore[arg-type]
    except TypeError:
        raise ValueError(f"seed must be an integer (the same seed gives the same document), got {seed!r}.") from None


def check_family_args(task: str, num_tokens: object, count_tokens: object, questions: object, seed: object,
                      cap: int = MAX_QUESTIONS) -> tuple[int, Callable[[str], int], int, random.Random]:
    """Every generator's arguments, checked; returns them with the generator's random source, seeded by the family's
    name too (one seed gives each family other keys and values, not the same numbers in every document)."""
    num_tokens, count_tokens = check_num_tokens(num_tokens), check_counter(count_tokens)
    questions, seed = check_questions(questions, cap), check_seed(seed)
    return num_tokens, count_tokens, questions, random.Random(f"{task}:{seed}")


def too_small(task: str, num_tokens: int, questions: int, needed: int, what: str) -> ValueError:
    return ValueError(f"num_tokens={num_tokens} is too small for {questions} questions of {task}: {what}. Ask for at "
                      f"least {needed} tokens or fewer questions.")


def fit_length(num_tokens: int, count_tokens: Callable[[str], int], build: Callable[[int], str], fixed: int,
               per_unit: float) -> str:
    """``build(units)`` sized to [num_tokens, (1 + TOLERANCE) * num_tokens] tokens: first from the estimated density
    (``per_unit`` tokens a unit on top of ``fixed``), then, if out of range, from the density of that text itself,
    grown until long enough (tasks.grow_to_length). Two or three counts of the whole context."""
    units = max(1, math.ceil((num_tokens * AIM - fixed) / per_unit))
    text = build(units)
    got = count_tokens(text)
    if num_tokens <= got <= num_tokens * (1 + TOLERANCE / 2):  # half the tolerance: a growth step may follow
        return text
    per_unit = max((got - fixed) / units, 1e-3)
    return grow_to_length(count_tokens, num_tokens, build, max(1, math.ceil((num_tokens * AIM - fixed) / per_unit)),
                          per_unit)
