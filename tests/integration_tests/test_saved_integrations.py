"""Read once, serve many times: a query engine and a chat model started from a saved memory answer exactly as the
ones that read the documents, and read only the question."""

from __future__ import annotations

import pytest
from langchain_core.messages import HumanMessage

from emllm import MemoryFileError
from emllm_integrations.langchain import ChatEMLLM
from emllm_integrations.llama_index import EMLLMQueryEngine

from .conftest import SMALL, SMOL
from .test_llama_index import FLOWER_QUESTION, town_documents


def test_query_engine_saved_and_served_by_another_engine(tmp_path):
    reader = EMLLMQueryEngine.from_documents(town_documents(), model=SMOL, preset="S", max_tokens=10, **SMALL)
    first = reader.query(FLOWER_QUESTION)
    path = reader.save(tmp_path / "town")
    reader.close()

    server = EMLLMQueryEngine.from_memory(path, model=SMOL, max_tokens=10)
    try:
        again = server.query(FLOWER_QUESTION)
        assert str(again) == str(first)
        assert again.metadata["new_input_tokens"] == len(server.question_ids(FLOWER_QUESTION))
        assert again.metadata["context_tokens"] == first.metadata["context_tokens"]
        assert [n.node.node_id for n in again.source_nodes] == [n.node.node_id for n in first.source_nodes]
        assert again.source_nodes[0].node.metadata == first.source_nodes[0].node.metadata
    finally:
        server.close()


def test_a_plain_memory_is_not_taken_for_a_query_engine_save(tmp_path):
    reader = EMLLMQueryEngine.from_documents(town_documents()[:2], model=SMOL, preset="S", max_tokens=4, **SMALL)
    memory = reader.pool.checkpoint(reader.context_ids)
    reader.pool.engine.save_memory(memory, tmp_path / "plain")  # a memory without the documents
    reader.close()
    with pytest.raises(ValueError, match="not one saved by EMLLMQueryEngine.save"):
        EMLLMQueryEngine.from_memory(tmp_path / "plain", model=SMOL)
    (tmp_path / "empty").mkdir()
    with pytest.raises(MemoryFileError, match="manifest.json is missing"):
        EMLLMQueryEngine.from_memory(tmp_path / "empty", model=SMOL)


def test_chat_model_continues_from_a_saved_memory(tmp_path):
    document = " ".join(town_documents()[i].text for i in range(6))
    messages = [HumanMessage(f"{document}\n\nQuestion: {FLOWER_QUESTION}")]
    reader = ChatEMLLM(model=SMOL, preset="S", max_tokens=10, max_memories=2, **SMALL)
    first = reader.invoke(messages)
    path = reader.save_memory(messages, tmp_path / "chat")

    # Another instance with the same memory settings but its own pool (max_memories differs), started from the file.
    server = ChatEMLLM(model=SMOL, preset="S", max_tokens=10, max_memories=3, memory_path=str(path), **SMALL)
    assert server.pool() is not reader.pool()
    again = server.invoke(messages)
    assert again.content == first.content
    assert again.response_metadata["new_input_tokens"] == 0
    assert again.usage_metadata["input_tokens"] == first.usage_metadata["input_tokens"]

    mismatched = ChatEMLLM(model=SMOL, preset="SM", max_tokens=10, memory_path=str(path), **SMALL)
    with pytest.raises(MemoryFileError):
        mismatched.invoke(messages)
