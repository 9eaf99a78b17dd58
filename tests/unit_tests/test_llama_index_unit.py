"""EMLLM and EMLLMQueryEngine without model weights: settings, validation, message and document handling, the
document-to-token-span bookkeeping, source scoring and the thread-to-event-loop streaming. Every test here would
load a model if the code under test tried to (the model is a directory with a config.json and no weights, so
loading it fails), so "fails before loading" is checked for real, and ``loaded_engines()`` confirms no weights were
read."""

from __future__ import annotations

import asyncio
import base64
import tempfile
import threading

import pytest
from llama_index.core.base.llms.types import ChatMessage, ImageBlock, MessageRole, TextBlock, ToolCallBlock
from llama_index.core.schema import Document, ImageDocument, MetadataMode, TextNode

from emllm import DEFAULT_MODEL, ConfigError, GenerationResult, RetrievedEvent, TextStream
from emllm.sessions import loaded_engines
from emllm_integrations.async_bridge import iterate_in_thread
from emllm_integrations.llama_index import (DEFAULT_CONTEXT_WINDOW, EMLLM, EMLLMQueryEngine, deltas_with_result,
                                            node_texts, to_engine_messages)
from emllm_integrations.sources import document_shares, spans_from_offsets

def _config_only_model() -> str:
    """A model directory that passes every construction-time check but has no weights: loading it raises OSError."""
    from transformers import LlamaConfig

    folder = tempfile.mkdtemp(prefix="emllm-no-weights-")
    LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                num_key_value_heads=1).save_pretrained(folder)
    return folder


MISSING = _config_only_model()
PNG = base64.b64encode(bytes.fromhex("89504e470d0a1a0a0000000d4948445200000001000000010806000000"
                                     "1f15c4890000000d49444154789c6360000002000100e221bc330000000049454e44ae426082"))


# ---------------------------------------------------------------------- EMLLM settings
def test_constructing_loads_no_weights_and_first_call_does():
    before = loaded_engines()
    llm = EMLLM(model=MISSING, preset="S", max_tokens=32, n_local=1024)
    assert llm.metadata.num_output == 32  # metadata of an episodic preset needs no weights either
    assert loaded_engines() == before
    with pytest.raises(OSError, match="safetensors|weights|model"):
        llm.complete("hello")


def test_a_model_that_cannot_load_fails_at_construction():
    with pytest.raises(ValueError, match="neither an existing local model directory, a hub id"):
        EMLLM(model="/nonexistent/emllm-test-model")
    with pytest.raises(ValueError, match="neither an existing local model directory, a hub id"):
        EMLLMQueryEngine.from_documents([Document(text="Some text.")], model="no-such-model")


def test_metadata_is_honest():
    llm = EMLLM(model=MISSING, max_tokens=64)
    meta = llm.metadata
    assert meta.is_chat_model and meta.num_output == 64 and meta.model_name == MISSING
    assert meta.context_window == DEFAULT_CONTEXT_WINDOW >= 1_000_000
    assert EMLLM().metadata.model_name == DEFAULT_MODEL == "qwen2.5-coder-0.5b-instruct"
    # A declared input limit becomes the window: prompt budget = context_window - num_output = max_input_tokens.
    limited = EMLLM(model=MISSING, max_tokens=10, max_input_tokens=5000).metadata
    assert limited.context_window - limited.num_output == 5000


def test_keywords_go_to_the_llm_or_the_engine_config():
    llm = EMLLM(model=MISSING, preset="S+C", top_p=0.9, stop=["\n"], system_prompt="Be brief.", n_local=1024,
                engine_fields={"n_mem": 1024})
    assert (llm.top_p, llm.stop, llm.system_prompt) == (0.9, ["\n"], "Be brief.")
    assert llm.engine_fields == {"n_local": 1024, "n_mem": 1024}
    assert (llm.config.n_local, llm.config.n_mem, llm.config.contiguity) == (1024, 1024, 0.3)


@pytest.mark.parametrize("kwargs, error, words", [
    (dict(preset="XL"), ConfigError, ["Unknown preset 'XL'", "SM+C"]),
    (dict(max_tokens=0), ValueError, ["max_tokens", "positive integer"]),
    (dict(max_tokens=-5), ValueError, ["max_tokens"]),
    (dict(max_tokens=2.5), ValueError, ["max_tokens"]),
    (dict(temperature=-1.0), ValueError, ["temperature"]),
    (dict(top_p=0.0), ValueError, ["top_p"]),
    (dict(stop="\n"), TypeError, ["stop must be a list of strings"]),
    (dict(n_locl=10), ConfigError, ["n_locl", "n_local"]),
    (dict(min_block_size=100, max_block_size=10), ConfigError, ["min_block_size", "max_block_size"]),
])
def test_bad_settings_are_named(kwargs, error, words):
    with pytest.raises(error) as raised:
        EMLLM(model=MISSING, **kwargs)
    for word in words:
        assert word in str(raised.value)


def test_unknown_call_keywords_fail_before_loading():
    llm = EMLLM(model=MISSING)
    messages = [ChatMessage(role="user", content="hi")]
    for call in (lambda: llm.complete("hi", tools=[]), lambda: llm.chat(messages, foo=1),
                 lambda: llm.stream_complete("hi", max_new_tokens=3)):
        with pytest.raises(TypeError, match="temperature, max_tokens, top_p, top_k, seed, stop"):
            call()
    with pytest.raises(ValueError, match="max_tokens"):
        llm.complete("hi", max_tokens=0)


async def test_async_calls_check_keywords_before_starting():
    llm = EMLLM(model=MISSING)
    messages = [ChatMessage(role="user", content="hi")]
    with pytest.raises(TypeError, match="unknown keyword"):
        await llm.acomplete("hi", foo=1)
    with pytest.raises(TypeError, match="unknown keyword"):
        await llm.astream_chat(messages, foo=1)
    with pytest.raises(OSError):  # the work itself runs (and fails to load the weights) in the thread
        gen = await llm.astream_chat(messages)
        async for _ in gen:
            pass


# ---------------------------------------------------------------------- messages
def test_messages_become_engine_dicts():
    messages = [ChatMessage(role=MessageRole.SYSTEM, content="Be brief."),
                ChatMessage(role=MessageRole.DEVELOPER, content="No lists."),
                ChatMessage(role=MessageRole.USER, blocks=[TextBlock(text="a"), TextBlock(text="b")]),
                ChatMessage(role=MessageRole.ASSISTANT, content=None),
                ChatMessage(role=MessageRole.MODEL, content="c")]
    assert to_engine_messages(messages) == [
        {"role": "system", "content": "Be brief."}, {"role": "system", "content": "No lists."},
        {"role": "user", "content": "a\nb"}, {"role": "assistant", "content": ""},
        {"role": "assistant", "content": "c"}]


def test_images_are_refused_and_tool_calls_and_results_become_engine_turns():
    image = ChatMessage(role="user", blocks=[TextBlock(text="What is this?"), ImageBlock(image=PNG)])
    with pytest.raises(ValueError, match="text only.*ImageBlock"):
        to_engine_messages([image])
    call = ChatMessage(role="assistant", blocks=[ToolCallBlock(tool_call_id="c1", tool_name="add",
                                                               tool_kwargs='{"a": 1, "b": 2}')])
    result = ChatMessage(role=MessageRole.TOOL, content="3", additional_kwargs={"tool_call_id": "c1"})
    assert to_engine_messages([call, result]) == [
        {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "id": "c1", "function": {
            "name": "add", "arguments": {"a": 1, "b": 2}}}]},
        {"role": "tool", "content": "3", "tool_call_id": "c1"}]
    broken = ChatMessage(role="assistant", blocks=[ToolCallBlock(tool_name="add", tool_kwargs="{'a': 1")])
    with pytest.raises(ValueError, match="arguments must be a JSON object"):
        to_engine_messages([broken])



def test_reread_is_a_field_and_a_call_option_checked_before_any_work():
    assert EMLLM(reread=True).call_options({})["reread"] is True
    assert EMLLM().call_options({"reread": True})["reread"] is True
    with pytest.raises(TypeError, match="reread must be True or False"):
        EMLLM().call_options({"reread": "no"})


def test_tools_are_prepared_for_chat_and_calls_read_back_without_loading_a_model():
    from llama_index.core.base.llms.types import ChatResponse
    from llama_index.core.tools import FunctionTool

    def add(a: int, b: int) -> int:
        """Add two integers."""
        return a + b

    llm = EMLLM()
    assert llm.metadata.is_function_calling_model
    prepared = llm._prepare_chat_with_tools([FunctionTool.from_defaults(add)], user_msg="1+2?", tool_required=True)
    assert prepared["tool_choice"] == "required" and prepared["messages"][-1].content == "1+2?"
    assert prepared["tools"][0]["function"]["name"] == "add"
    with pytest.raises(ValueError, match="names 'sub', which is not among the bound tools"):
        llm.call_options({"tools": prepared["tools"], "tool_choice": "sub"}, tools_allowed=True)
    with pytest.raises(TypeError, match="unknown keyword argument"):
        llm.call_options({"tools": prepared["tools"]})  # complete() takes no tools
    answer = ChatResponse(message=ChatMessage(role="assistant", blocks=[
        TextBlock(text=""), ToolCallBlock(tool_call_id="c1", tool_name="add", tool_kwargs={"a": 1, "b": 2}),
        ToolCallBlock(tool_call_id="c2", tool_name="add", tool_kwargs={"a": 3, "b": 4})]))
    assert [(c.tool_name, c.tool_kwargs) for c in llm.get_tool_calls_from_response(answer)] == [
        ("add", {"a": 1, "b": 2}), ("add", {"a": 3, "b": 4})]
    single = llm._validate_chat_with_tools_response(answer, [], allow_parallel_tool_calls=False)
    assert [c.tool_id for c in llm.get_tool_calls_from_response(single)] == ["c1"]
    with pytest.raises(ValueError, match="answered without calling a tool.*tool_required=True"):
        llm.get_tool_calls_from_response(ChatResponse(message=ChatMessage(role="assistant", content="3")))
    assert llm.get_tool_calls_from_response(ChatResponse(message=ChatMessage(role="assistant", content="3")),
                                            error_on_no_tool_call=False) == []


# ---------------------------------------------------------------------- documents
def test_node_texts_reads_text_and_metadata_on_request():
    docs = [Document(text="First.", metadata={"title": "One"}), TextNode(text="Second.")]
    assert node_texts(docs) == ["First.", "Second."]
    assert "title: One" in node_texts(docs, MetadataMode.LLM)[0]


@pytest.mark.parametrize("documents, error, words", [
    ([], ValueError, ["No documents", "Document(text=...)"]),
    ("just a string", TypeError, ["list of LlamaIndex documents"]),
    (["plain text"], TypeError, ["Item 0 is a str", "Document(text=...)"]),
    ([Document(text="ok"), Document(text="")], ValueError, ["Document 1", "empty"]),
    ([Document(text="   \n")], ValueError, ["Document 0", "empty"]),
    ([Document(text="ok"), ImageDocument(image=PNG.decode())], ValueError, ["Document 1", "image", "text only"]),
])
def test_bad_documents_fail_before_loading(documents, error, words):
    before = loaded_engines()
    with pytest.raises(error) as raised:
        EMLLMQueryEngine.from_documents(documents, model=MISSING)
    for word in words:
        assert word in str(raised.value)
    assert loaded_engines() == before


@pytest.mark.parametrize("kwargs, error, word", [
    (dict(preset="nope"), ConfigError, "Unknown preset"),
    (dict(max_tokens=0), ValueError, "max_tokens"),
    (dict(n_local=0), ConfigError, "n_local"),
    (dict(template="markdown"), ValueError, "template must be one of"),
])
def test_bad_query_engine_settings_fail_before_loading(kwargs, error, word):
    with pytest.raises(error, match=word):
        EMLLMQueryEngine.from_documents([Document(text="Some text.")], model=MISSING, **kwargs)


# ---------------------------------------------------------------------- spans and sources
def test_spans_tile_the_context_by_last_character():
    # Documents "aaaa", "bb", "cccccc" joined by "\n\n" start at characters 0, 6, 10.
    char_starts = [0, 6, 10]
    # Tokens end at: 2, 4, 6 (separator after doc 0), 8 ("bb"), 11 ("\n\nc": its last char is in doc 2), 16.
    token_ends = [2, 4, 6, 8, 11, 16]
    assert spans_from_offsets(char_starts, token_ends) == [(0, 3), (3, 4), (4, 6)]


def test_spans_of_a_document_without_own_tokens_are_empty():
    assert spans_from_offsets([0, 3, 5], [2, 9]) == [(0, 1), (1, 1), (1, 2)]


def test_document_shares_weight_tokens_by_layers():
    spans = [(0, 100), (100, 200), (200, 300)]
    events = [RetrievedEvent(10, 30, 2),    # doc 0: 20 tokens x 2 layers = 40
              RetrievedEvent(190, 210, 3),  # doc 1: 10 x 3 = 30, doc 2: 10 x 3 = 30
              RetrievedEvent(250, 260, 10)]  # doc 2: 100
    shares = document_shares(spans, events)
    assert shares == pytest.approx([40 / 200, 30 / 200, 130 / 200])
    assert sum(shares) == pytest.approx(1.0)
    assert document_shares(spans, []) == [0.0, 0.0, 0.0]
    # Events beyond the documents (the question, the answer) count for none of them.
    assert document_shares(spans, [RetrievedEvent(300, 320, 5)]) == [0.0, 0.0, 0.0]


# ---------------------------------------------------------------------- streaming helpers
def _stream(deltas: list[str], closed: list[bool]) -> TextStream:
    holder: dict = {}

    def gen():
        try:
            yield from deltas
            holder["result"] = GenerationResult(text="".join(deltas), finish_reason="stop", input_tokens=3,
                                                output_tokens=len(deltas), new_input_tokens=1)
        finally:
            closed.append(True)
    return TextStream(gen(), holder)


def test_last_delta_carries_the_result():
    closed: list[bool] = []
    items = list(deltas_with_result(_stream(["a", "b", "c"], closed)))
    assert [d for d, _ in items] == ["a", "b", "c"]
    assert [r is None for _, r in items] == [True, True, False]
    assert items[-1][1].text == "abc" and closed == [True]


def test_an_empty_answer_still_yields_its_result_once():
    items = list(deltas_with_result(_stream([], [])))
    assert len(items) == 1 and items[0][0] == "" and items[0][1].output_tokens == 0


def test_stopping_early_closes_the_stream():
    closed: list[bool] = []
    gen = deltas_with_result(_stream(["a", "b", "c"], closed))
    next(gen)
    gen.close()
    assert closed == [True]


async def test_iterate_in_thread_keeps_the_loop_free():
    """The worker blocks until a task on the event loop sets an event: only possible if the loop is not blocked
    while the worker runs (a blocking implementation would fail the wait below)."""
    loop_ran = threading.Event()

    def work():
        yield "first"
        if not loop_ran.wait(timeout=30):
            raise AssertionError("the event loop was blocked while the worker ran")
        yield "second"

    async def on_the_loop():
        await asyncio.sleep(0)
        loop_ran.set()

    task = asyncio.create_task(on_the_loop())
    items = [item async for item in iterate_in_thread(work)]
    await task
    assert items == ["first", "second"]


async def test_iterate_in_thread_raises_the_workers_error():
    def work():
        yield 1
        raise KeyError("boom")

    got = []
    with pytest.raises(KeyError, match="boom"):
        async for item in iterate_in_thread(work):
            got.append(item)
    assert got == [1]


async def test_iterate_in_thread_stops_and_closes_the_iterator_when_abandoned():
    closed = threading.Event()
    produced = []

    def work():
        try:
            for i in range(1000):
                produced.append(i)
                yield i
                threading.Event().wait(0.001)
        finally:
            closed.set()

    agen = iterate_in_thread(work)
    assert await agen.__anext__() == 0
    await agen.aclose()
    assert await asyncio.to_thread(closed.wait, 30)
    assert len(produced) < 1000


def test_attention_shares_leave_out_the_sinks_that_every_answer_attends():
    """The sinks (the prompt's first n_init positions, always in attention) draw attention whatever the answer
    draws on; counted, they credit the first document with every answer."""
    import torch

    from emllm_integrations.sources import attention_shares

    spans = [(0, 8), (8, 16)]
    attention = torch.zeros(16)
    attention[0], attention[9:11] = 10.0, 1.0  # a sink in the first document; the answer's passage in the second
    assert attention_shares(spans, attention) == pytest.approx([10 / 12, 2 / 12])
    assert attention_shares(spans, attention, sinks=4) == pytest.approx([0.0, 1.0])
    assert attention[0] == 10.0  # the caller's tensor is left as it was
