"""What a new user tries first, on the default model and the default preset: a document of real prose (Paul Graham's
essays, over 16K tokens) holding facts, each asked in other words than the fact uses, through the three surfaces
people use: a LangChain LCEL chain with ChatEMLLM(), LlamaIndex's EMLLMQueryEngine, and compare() (EM-LLM against
RAG). Every surface must answer every question. How the default does past the model's window, and against RAG on
many questions, is the benchmark's job (benchmarks/RESULTS.md), not the suite's.

Each surface reads the document once (about 16K tokens: 1-2 minutes on 2 cores), then only each question."""

from __future__ import annotations

import pytest

from emllm import DEFAULT_MODEL
from emllm_integrations.bench.ruler import family_document, score

TOKENS = 16_100
FACTS = 3


@pytest.fixture(scope="module")
def document():
    from emllm import shared_engine

    engine = shared_engine()  # the default model, shared with every surface below
    assert engine.model_name == DEFAULT_MODEL or DEFAULT_MODEL in engine.model_name.lower()
    doc = family_document("fact_qa", TOKENS, engine.count_tokens, questions=FACTS, seed=11)
    assert engine.count_tokens(doc.context) >= 16_000
    return doc


def _missed(doc, answers: list[str]) -> list[tuple[str, str, str]]:
    return [(q.question, "; ".join(q.answers), a) for q, a in zip(doc.questions, answers)
            if score(a, q.answers) < 1.0]


@pytest.mark.slow(seconds=200)
def test_an_lcel_chain_with_the_default_chat_model_answers_every_fact(document):
    from langchain_core.output_parsers import StrOutputParser
    from langchain_core.prompts import ChatPromptTemplate

    from emllm_integrations.langchain import ChatEMLLM

    chain = (ChatPromptTemplate.from_messages([("user", "{document}\n\n{question}")])
             | ChatEMLLM(max_tokens=48) | StrOutputParser())
    answers = [chain.invoke({"document": document.context, "question": q.question}) for q in document.questions]
    assert not _missed(document, answers)


@pytest.mark.slow(seconds=200)
def test_the_query_engine_answers_every_fact(document):
    from llama_index.core import Document

    from emllm_integrations.llama_index import EMLLMQueryEngine

    engine = EMLLMQueryEngine.from_documents([Document(text=document.context)], max_tokens=48)
    answers = [str(engine.query(q.question)) for q in document.questions]
    assert not _missed(document, answers)


@pytest.mark.slow(seconds=260)
def test_compare_answers_every_fact_with_em_llm_and_reports_rag_beside_it(document):
    from emllm_integrations.compare import compare

    result = compare([document.context], [q.question for q in document.questions], max_new_tokens=48)
    assert not _missed(document, result.answers("em-llm"))
    rag = result.rows_for("rag")
    assert len(rag) == FACTS and all(row.answer.strip() for row in rag)
    assert all(row.tokens_read < 100 for row in result.rows_for("em-llm"))  # only the question is read per query
