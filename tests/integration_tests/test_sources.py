"""Where an EMLLMQueryEngine answer came from, on the default Qwen2.5-Coder-0.5B: two essays (~1,000 tokens each,
so the first's fact is evicted from a 1,024-token window when the question comes) each hold one fact; each question's
sources credit the document holding its fact first, the retriever and chat engines built on them answer, and no
response prints as 'None'."""

from __future__ import annotations

import pytest
from llama_index.core import Document
from llama_index.core.chat_engine import CondensePlusContextChatEngine, CondenseQuestionChatEngine

from emllm_integrations.bench.tasks import essay_document
from emllm_integrations.llama_index import EMLLM, EMLLMQueryEngine

QUESTIONS = {"lighthouse": ("What is the lighthouse keeper's cat called?", "biscuit"),
             "ferry": ("When does the ferry to the island leave?", "7:40")}



@pytest.fixture(scope="module")
def two_documents() -> EMLLMQueryEngine:
    lighthouse = essay_document(1100, ["The lighthouse keeper's cat is named Biscuit."], seed=1, depths=[0.4])
    ferry = essay_document(1100, ["The ferry to the island leaves at 7:40 each morning."], seed=2, depths=[0.6])
    engine = EMLLMQueryEngine.from_documents([Document(text=lighthouse, metadata={"name": "lighthouse"}),
                                              Document(text=ferry, metadata={"name": "ferry"})], max_tokens=24,
                                             n_local=1024, n_mem=1024, chunk_size=256)
    yield engine
    engine.close()


@pytest.mark.parametrize("name", QUESTIONS)
def test_sources_credit_the_document_the_answer_came_from(two_documents, name):
    question, answer = QUESTIONS[name]
    response = two_documents.query(question)
    assert answer in str(response).lower()
    assert response.source_nodes[0].node.metadata["name"] == name and response.source_nodes[0].score > 0.6
    assert response.source_nodes[0].node.get_content().count(".") > 25  # the node is the whole document


def test_the_retriever_returns_the_documents_an_answer_draws_on(two_documents):
    nodes = two_documents.as_retriever().retrieve("When does the ferry leave?")
    assert nodes[0].node.metadata["name"] == "ferry" and nodes[0].score > 0.6


def test_chat_engines_over_the_query_engine_and_its_retriever_answer(two_documents):
    condense = CondenseQuestionChatEngine.from_defaults(query_engine=two_documents, llm=EMLLM(max_tokens=32))
    assert "biscuit" in str(condense.chat("What is the cat of the lighthouse keeper called?")).lower()
    context = CondensePlusContextChatEngine.from_defaults(retriever=two_documents.as_retriever(),
                                                          llm=EMLLM(max_tokens=32))
    reply = context.chat("When does the ferry to the island leave?")
    assert "7:40" in str(reply) and reply.source_nodes[0].node.metadata["name"] == "ferry"
