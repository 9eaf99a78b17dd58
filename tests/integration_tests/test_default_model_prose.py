"""What a new user tries first, on the default model and the default preset: a document of real prose (Paul Graham's
essays, 8K tokens: 3.7 times the default window of 2,176, so most of it is evicted into events and retrieved) holding
ten facts about people, each asked in other words than the fact uses, through compare() (EM-LLM against RAG on the
same LLM); the LCEL chain and the query engine give compare's answers word for word
(test_default_model_surfaces.py).

What is asserted, and why a rate: Qwen2.5-Coder-0.5B does not answer every such fact even with the whole document
in view. On the bench's 20-fact cell at 16K (benchmarks/RESULTS.md) plain full attention answered 12/20 [39-78%],
preset E 14/20 [48-85%], RAG 9/20. On this document (10 facts) compare's EM-LLM answered 7 and RAG 3, with E and
with the default EG alike (and on its 16K-token version, which the suite read until its time had to come down, E 5,
RAG 2). So EM-LLM must answer at
least 4 of the 10 (slack for other CPUs' arithmetic, e.g. float32 where bf16 is emulated) and at least as many as
RAG; how the default does at more lengths and questions is the benchmark's job, not the suite's."""

from __future__ import annotations

import pytest

from emllm import DEFAULT_MODEL
from emllm_integrations.bench.ruler import family_document, score

TOKENS = 8_100
FACTS = 10
AT_LEAST = 4


@pytest.fixture(scope="module")
def document():
    from emllm import shared_engine

    engine = shared_engine()  # the default model, shared with every surface below
    assert engine.model_name == DEFAULT_MODEL or DEFAULT_MODEL in engine.model_name.lower()
    doc = family_document("fact_qa", TOKENS, engine.count_tokens, questions=FACTS, seed=11)
    assert engine.count_tokens(doc.context) >= 8_000  # 3.7x n_init + n_local: answers come from evicted events
    return doc


def _right(doc, answers: list[str]) -> int:
    return sum(score(a, q.answers) == 1.0 for q, a in zip(doc.questions, answers))


def _report(doc, answers: list[str]) -> str:
    """How many were right and what each question got, for the assertion message."""
    return f"{_right(doc, answers)}/{len(answers)} right: " + "; ".join(
        f"{q.question} [{', '.join(q.answers)}] -> {a[:80]!r}" for q, a in zip(doc.questions, answers))


@pytest.fixture(scope="module")
def compared(document):
    from emllm_integrations.compare import compare

    return compare([document.context], [q.question for q in document.questions], max_new_tokens=40)


@pytest.mark.slow(seconds=350)
@pytest.mark.timeout(3600)  # 320 s on an AVX512-BF16 EPYC; float32 on an AVX2-only CPU is 2-6x slower than that
def test_compare_answers_the_facts_with_em_llm_at_least_as_often_as_rag(document, compared):
    em, rag = compared.answers("em-llm"), compared.answers("rag")
    assert _right(document, em) >= AT_LEAST, _report(document, em)
    assert _right(document, em) >= _right(document, rag), (_report(document, em), _report(document, rag))
    assert all(row.tokens_read < 100 for row in compared.rows_for("em-llm"))  # only the question is read per query
