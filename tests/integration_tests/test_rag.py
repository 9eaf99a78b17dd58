"""The RAG baseline and the one-call comparison on the real LLM (embedded SmolLM2-135M-Instruct, shared engine).

Inputs are small so the file runs in minutes on 2 CPU cores: three documents around 1-2K tokens in all."""

from __future__ import annotations

import pytest

from emllm.sessions import shared_engine
from emllm_integrations.bench.tasks import PASSKEY_NOISE
from emllm_integrations.compare import compare
from emllm_integrations.prompts import format_context, qa_prompt, qa_suffix
from emllm_integrations.rag import RAGBaseline
from emllm_integrations.rag.langchain import RAGRetriever, rag_chain
from emllm_integrations.rag.llama_index import rag_query_engine

from .conftest import SMALL, SMOL

FACT = "The museum vault opens with the code 48213."
QUESTION = "Which code opens the museum vault?"


def corpus(repeats: int) -> list[str]:
    """Three documents of filler; the middle one holds the fact halfway through."""
    half = repeats // 2
    return [PASSKEY_NOISE * repeats, PASSKEY_NOISE * half + FACT + " " + PASSKEY_NOISE * half, PASSKEY_NOISE * repeats]


@pytest.fixture(scope="module")
def engine():
    return shared_engine(SMOL)


@pytest.fixture(scope="module")
def baseline(engine):
    rag = RAGBaseline(llm_model=SMOL, engine=engine)
    rag.add_documents(corpus(24))
    return rag


def test_rag_answers_from_the_retrieved_chunks_with_full_attention(baseline, engine):
    answer = baseline.answer(QUESTION, max_new_tokens=10)
    texts = [c.text for c in answer.chunks]
    assert len(answer.chunks) == 5 and sum(FACT in t for t in texts) == 1
    assert [(c.doc_id, c.chunk_id) for c in answer.chunks] == sorted((c.doc_id, c.chunk_id) for c in answer.chunks)
    assert answer.prompt == qa_prompt(format_context(texts), QUESTION)  # the shared template, as EM-LLM's
    context, suffix = engine.tokenize(format_context(texts)), engine.tokenize(qa_suffix(QUESTION))
    assert answer.input_tokens == len(context) + len(suffix)
    assert answer.output_tokens >= 1 and isinstance(answer.text, str)
    # Whether the 135M model then reads the code off the prompt depends on the layout (measured: right with one
    # corpus, wrong with a slightly shorter one), so the answer's content is the model's, not asserted here.


def test_lcel_rag_chain_with_a_real_runnable_llm(baseline, engine):
    """Any runnable works as the chain's LLM: here the engine itself under full attention."""
    from langchain_core.runnables import RunnableLambda

    from emllm import EMConfig

    seen: list[str] = []

    def llm(prompt) -> str:
        seen.append(prompt.to_string())
        memory = engine.new_memory(EMConfig.from_preset("full"))
        try:
            return engine.generate(prompt.to_string(), memory=memory, max_new_tokens=10).text
        finally:
            memory.close()

    out = rag_chain(RAGRetriever(baseline=baseline, top_k=1), RunnableLambda(llm)).invoke(QUESTION)  # short prompt
    assert len(seen) == 1 and FACT in seen[0] and seen[0].endswith(qa_suffix(QUESTION))
    assert isinstance(out, str) and out.strip()


def test_llama_index_query_engine_with_the_em_llm_adapter():
    """rag_query_engine over a real VectorStoreIndex + FaissVectorStore, answered by the LlamaIndex EM-LLM adapter
    in plain full attention: the retrieved nodes hold the fact and the LLM gives an answer."""
    llama_index = pytest.importorskip("emllm_integrations.llama_index", reason="the LlamaIndex adapter is absent")
    llm = llama_index.EMLLM(model=SMOL, preset="full", max_tokens=10)
    response = rag_query_engine(corpus(24), llm, top_k=2).query(QUESTION)  # 2 chunks keep the prompt short
    assert len(response.source_nodes) == 2
    assert sum(FACT in n.node.get_content() for n in response.source_nodes) == 1
    assert isinstance(response.response, str) and response.response.strip()


def test_compare_end_to_end_small_layout(engine):
    docs = corpus(14)  # about 1.1K tokens: past n_init + n_local, so EM-LLM's retrieval is used
    questions = [QUESTION, "What colour is the sky?"]
    # The raw-text frame: SmolLM2 reads it better than its chat template, and its token counts are checked below.
    result = compare(docs, questions, preset="SM", max_new_tokens=8, chunk_words=100, top_k=2, llm_model=SMOL,
                     template="text", **SMALL)

    assert [(r.question, r.method) for r in result.rows] == [(q, m) for q in questions for m in ("em-llm", "rag")]
    assert result.document_tokens == len(engine.tokenize(format_context(docs)))
    assert result.document_tokens > SMALL["n_init"] + SMALL["n_local"]
    for row in result.rows:
        assert isinstance(row.answer, str) and row.output_tokens >= 1 and row.finish_reason in ("stop", "length")
    em, rag = result.rows_for("em-llm"), result.rows_for("rag")
    # EM-LLM read the documents once: each question reads only its own suffix tokens.
    assert [r.tokens_read for r in em] == [len(engine.tokenize(qa_suffix(q))) for q in questions]
    for row in em:  # what episodic retrieval held in attention, mapped back to document text
        assert row.context and len(row.context) == len(row.sources)
        assert all(docs[s["doc_id"]][s["start_char"]:s["end_char"]] == t for t, s in zip(row.context, row.sources))
    # RAG: top 2 of the 100-word chunks, re-read in full for every question.
    assert all(len(r.context) == 2 for r in rag)
    assert any(FACT in c for c in rag[0].context)
    assert all(r.tokens_read > 2 * 100 for r in rag)
    table = result.to_markdown()
    assert table.count("| EM-LLM SM |") == 2 and table.count("| RAG |") == 2
