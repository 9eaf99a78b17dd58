"""The default model's two framework surfaces on one document of real prose: an LCEL chain with ChatEMLLM() and
LlamaIndex's EMLLMQueryEngine put the same question after the same document in the same chat turn, so greedy
decoding must give the same answer word for word. A defect in one surface's reading or retrieval shows as a
difference; one was the pool forgetting the question after the first answer token, which left an LCEL chain 3 of
10 right where compare() had 5 (test_default_model_prose.py, 16K tokens).

The document is 4.6K tokens, three facts: past the default window (n_init 128 + n_local 2048) and retrieval budget, so
both surfaces evict, cut events and retrieve them for the questions; how many facts the default answers at
scale is asserted in test_default_model_prose.py (through compare, against RAG) and measured by the bench."""

from __future__ import annotations

import pytest

from emllm_integrations.bench.ruler import family_document, score

SAME = 3  # questions both surfaces ask
TOKENS = 4_600


@pytest.fixture(scope="module")
def document():
    from emllm import shared_engine

    engine = shared_engine()
    doc = family_document("fact_qa", TOKENS, engine.count_tokens, questions=SAME, seed=12)
    assert engine.count_tokens(doc.context) > 128 + 2048 + 2048  # events were evicted and must be retrieved
    return doc


@pytest.fixture(scope="module")
def lcel_answers(document):
    from langchain_core.output_parsers import StrOutputParser
    from langchain_core.prompts import ChatPromptTemplate

    from emllm_integrations.langchain import ChatEMLLM

    chain = (ChatPromptTemplate.from_messages([("user", "{document}\n\n{question}")])
             | ChatEMLLM(max_tokens=40) | StrOutputParser())
    return [chain.invoke({"document": document.context, "question": q.question}) for q in document.questions[:SAME]]


@pytest.mark.slow(seconds=130)
def test_the_query_engine_and_an_lcel_chain_answer_alike(document, lcel_answers):
    from llama_index.core import Document

    from emllm_integrations.llama_index import EMLLMQueryEngine

    engine = EMLLMQueryEngine.from_documents([Document(text=document.context)], max_tokens=40)
    try:
        responses = [engine.query(q.question) for q in document.questions[:SAME]]
    finally:
        engine.close()
    answers = [str(r) for r in responses]
    assert answers == lcel_answers  # the same chat frame, the same tokens, greedy
    assert all(r.source_nodes for r in responses)  # the one document is where retrieved events came from
    assert any(score(a, q.answers) == 1.0 for q, a in zip(document.questions, answers)), answers
