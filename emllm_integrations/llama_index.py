"""LlamaIndex adapters: ``EMLLM`` (an LLM whose attention has an episodic memory) and ``EMLLMQueryEngine`` (every
document read into that memory once; questions answered by retrieval inside attention instead of chunk retrieval).

    Settings.llm = EMLLM(preset="S", max_tokens=128)            # no weights are loaded until the first call
    engine = EMLLMQueryEngine.from_documents(documents, preset="S", progress=True)   # reads everything once
    response = engine.query("Who wrote the letter?")            # reads only the question's tokens
    response.source_nodes                                       # documents the retrieved events came from

Both share one loaded model per (model, dtype, device) through ``emllm.sessions.shared_engine``. EMLLM keeps one
MemoryPool per (model, config), so a follow-up call whose prompt extends an earlier one reads only the new tokens;
the query engine owns its pool, whose pinned checkpoint is the documents.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Callable, Generator, Iterator, Sequence
from pathlib import Path
from typing import Any

from llama_index.core.base.base_retriever import BaseRetriever
from llama_index.core.base.llms.types import (ChatMessage, ChatResponse, ChatResponseAsyncGen, ChatResponseGen,
                                              CompletionResponse, CompletionResponseAsyncGen, CompletionResponseGen,
                                              LLMMetadata, MessageRole, TextBlock, ToolCallBlock)
from llama_index.core.base.response.schema import AsyncStreamingResponse, Response, StreamingResponse
from llama_index.core.bridge.pydantic import Field, PrivateAttr
from llama_index.core.llms.callbacks import llm_chat_callback, llm_completion_callback
from llama_index.core.llms.function_calling import FunctionCallingLLM
from llama_index.core.llms.llm import ToolSelection
from llama_index.core.query_engine import CustomQueryEngine
from llama_index.core.schema import BaseNode, ImageNode, MetadataMode, NodeWithScore, QueryBundle
from llama_index.core.storage.docstore.utils import doc_to_json, json_to_doc

from emllm import DEFAULT_MODEL, DEFAULT_PRESET, EMConfig, EMEngine, GenerationResult, MemoryPool, TextStream
from emllm.models import check_model
from emllm.persistence import read_metadata
from emllm.sessions import shared_engine, shared_pool
from emllm.tools import InvalidToolCall, ReplyStream, ToolCall, ToolSchemas

from .async_bridge import iterate_in_thread
from .prompts import chat_frame, chat_header, check_template, qa_suffix
from .sampling import sampling_options
from .sources import attention_shares, document_shares, tokenize_documents
from .tool_choice import chosen_tools, tool_decoding

DEFAULT_CONTEXT_WINDOW = 1 << 20
"""What EMLLM reports as its context window when ``max_input_tokens`` is not set. The episodic memory has no fixed
limit (evicted tokens go to RAM, then disk), so any finite number is a policy: 1M tokens is large enough that
LlamaIndex's response synthesizers never truncate or split a context, which is the point of the memory."""

CALL_OPTIONS = ("temperature", "max_tokens", "top_p", "top_k", "seed", "stop", "reread")
"""Settings a single call may override by keyword (``llm.complete(prompt, max_tokens=32)``)."""
TOOL_OPTIONS = ("tools", "tool_choice")
"""What chat_with_tools passes to chat (OpenAI function dicts, and "auto" / "required" / a tool name)."""

_ROLES = {MessageRole.SYSTEM: "system", MessageRole.DEVELOPER: "system", MessageRole.USER: "user",
          MessageRole.ASSISTANT: "assistant", MessageRole.MODEL: "assistant", MessageRole.CHATBOT: "assistant"}


SOURCE_MIN_SHARE = 0.05
"""A document is a source when it drew at least this share of the attention the answer gave the documents."""

SAVE_KIND = "emllm-query-engine/1"  # what EMLLMQueryEngine.save() puts in a saved memory's metadata


# ---------------------------------------------------------------------- shared pieces
def usage(result: GenerationResult) -> dict[str, Any]:
    """Token counts and timings in the names LlamaIndex's token counter looks for (prompt_/completion_tokens)."""
    return {"prompt_tokens": result.input_tokens, "completion_tokens": result.output_tokens,
            "total_tokens": result.input_tokens + result.output_tokens,
            "new_input_tokens": result.new_input_tokens, "finish_reason": result.finish_reason,
            "prefill_seconds": result.prefill_seconds, "decode_seconds": result.decode_seconds}


def deltas_with_result(stream: TextStream) -> Iterator[tuple[str, GenerationResult | None]]:
    """(delta, None) for every delta but the last, which comes with the GenerationResult, so a streamed response
    ends with its token counts without an extra empty chunk. Stopping early closes the stream (its memory)."""
    iterator = iter(stream)
    try:
        pending: str | None = None
        for delta in iterator:
            if pending is not None:
                yield pending, None
            pending = delta
        yield pending or "", stream.result
    finally:
        close = getattr(iterator, "close", None)
        if close is not None:
            close()


# ---------------------------------------------------------------------- the LLM
class EMLLM(FunctionCallingLLM):
    """A LlamaIndex LLM on the emllm engine: a Hugging Face causal LM whose attention has an episodic memory, so
    it reads prompts far beyond its trained context. Chat renders the model's chat template; complete reads raw
    text. Use it as ``Settings.llm`` in any query or chat engine. A FunctionCallingLLM: ``chat_with_tools``,
    ``FunctionAgent`` and ``structured_predict`` work, their calls decoded under a grammar of the tools'
    parameters (emllm.grammar), so arguments always parse."""

    model: str | None = Field(default=None, description="Embedded model name, local HF dir or hub id (org/name); "
                                                         "None = default.")
    revision: str | None = Field(default=None, description="A hub id's branch, tag or commit.")
    token: str | None = Field(default=None, exclude=True, repr=False,
                                 description="Hub token for private or gated models (else HF_TOKEN or a login).")
    preset: str = Field(default=DEFAULT_PRESET, description="EM-LLM preset: S, SM, SC, S+C, SM+C, F, FM, FC or full.")
    temperature: float = Field(default=0.0, description="0 = greedy.")
    max_tokens: int = Field(default=256, description="Tokens to generate per call (LLMMetadata.num_output).")
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] | None = None
    reread: bool = Field(default=False, description="Answer from the retrieved events re-read as text under full "
                         "attention (emllm.reread): better on questions asking for several items, slower.")
    dtype: Any = Field(default="auto", description="'auto' (bf16 where fast), 'float32', 'bfloat16', ...")
    device: str | None = None
    progress: bool = Field(default=False, description="Show progress bars while loading and reading.")
    engine_fields: dict[str, Any] = Field(default_factory=dict, description="EMConfig overrides, by field name.")

    _config: EMConfig = PrivateAttr()
    _pool: MemoryPool | None = PrivateAttr(default=None)
    _engine: EMEngine | None = PrivateAttr(default=None)

    def __init__(self, model: str | None = None, preset: str = DEFAULT_PRESET, temperature: float = 0.0,
                 max_tokens: int = 256, *, engine: EMEngine | None = None, **kwargs: Any):
        """Keywords that are fields of this LLM (top_p, dtype, revision, system_prompt, callback_manager, ...) set
        them; any other keyword is an EMConfig field (n_local=1024, ...). Nothing is loaded until the first call.
        ``engine=EMEngine(model, tokenizer)`` runs a model already loaded instead of ``model``."""
        own = {k: kwargs.pop(k) for k in list(kwargs) if k in EMLLM.model_fields}
        fields = {**own.pop("engine_fields", {}), **kwargs}
        config = EMConfig.from_preset(preset, **fields)  # ConfigError names an unknown preset or field
        sampling_options(max_tokens, temperature, own.get("top_p", 1.0), own.get("top_k", 0), own.get("seed"),
                         own.get("stop"), own.get("reread", False))
        if engine is None:
            check_model(model, revision=own.get("revision"))  # nothing is loaded or downloaded to find out
        elif model is None:
            model = engine.model_name
        super().__init__(model=None if model is None else str(model), preset=preset, temperature=temperature,
                         max_tokens=max_tokens, engine_fields=fields, **own)
        self._config, self._engine = config, engine

    @classmethod
    def class_name(cls) -> str:
        return "EMLLM"

    @property
    def config(self) -> EMConfig:
        return self._config

    @property
    def pool(self) -> MemoryPool:
        """The shared MemoryPool (loads the model on first use)."""
        if self._pool is None:
            engine = self._engine or shared_engine(self.model, dtype=self.dtype, device=self.device,
                                                   revision=self.revision, token=self.token, progress=self.progress)
            self._pool = shared_pool(engine, self._config)
        return self._pool

    @property
    def context_window(self) -> int:
        """Prompt + answer tokens one call may use. Full attention is bound by the model's trained context (which
        needs the model's config, so it loads the model); episodic memory by max_input_tokens if set."""
        if self._config.attention == "full":
            return self.pool.engine.shape.max_positions
        if self._config.max_input_tokens is not None:
            return self._config.max_input_tokens + self.max_tokens
        return DEFAULT_CONTEXT_WINDOW

    @property
    def metadata(self) -> LLMMetadata:
        return LLMMetadata(context_window=self.context_window, num_output=self.max_tokens, is_chat_model=True,
                           is_function_calling_model=True, model_name=self.model or DEFAULT_MODEL)

    def call_options(self, overrides: dict[str, Any], tools_allowed: bool = False) -> dict[str, Any]:
        """This call's MemoryPool.stream keywords: per-call ``overrides`` over the instance's values, tools only
        where ``tools_allowed`` (chat, not complete), all checked before any work. Public so that a caller (and the
        unit tests) can see what a call would run with, and have bad options refused, without loading a model."""
        allowed = CALL_OPTIONS + (TOOL_OPTIONS if tools_allowed else ())
        unknown = sorted(set(overrides) - set(allowed))
        if unknown:
            raise TypeError(f"EMLLM got unknown keyword argument(s) {unknown}; a call may override only "
                            f"{', '.join(allowed)}.")
        values = {name: overrides.get(name, getattr(self, name)) for name in CALL_OPTIONS}
        options = {**sampling_options(**values), "progress": self.progress}
        if overrides.get("tools"):
            chosen_tools(overrides["tools"], overrides.get("tool_choice"))  # a wrong name fails before the model loads
            options["tools"], options["tool_choice"] = overrides["tools"], overrides.get("tool_choice")
        return options

    # ------------------------------------------------------------------ tools (FunctionCallingLLM)
    def _prepare_chat_with_tools(self, tools: Sequence[Any], user_msg: str | ChatMessage | None = None,
                                 chat_history: list[ChatMessage] | None = None, verbose: bool = False,
                                 allow_parallel_tool_calls: bool = False, tool_required: bool = False,
                                 tool_choice: Any = None, **kwargs: Any) -> dict[str, Any]:
        """chat() arguments: the conversation, the tools as OpenAI function dicts, and the choice ("required"
        when ``tool_required``: the reply is then calls only)."""
        messages = list(chat_history or [])
        if user_msg is not None:
            messages.append(ChatMessage(role=MessageRole.USER, content=user_msg) if isinstance(user_msg, str)
                            else user_msg)
        choice = tool_choice if tool_choice is not None else ("required" if tool_required else "auto")
        return {"messages": messages, "tools": [tool.metadata.to_openai_tool() for tool in tools] or None,
                "tool_choice": choice, **kwargs}

    def _validate_chat_with_tools_response(self, response: ChatResponse, tools: Sequence[Any],
                                           allow_parallel_tool_calls: bool = False, **kwargs: Any) -> ChatResponse:
        """One call only unless parallel calls are allowed (as LlamaIndex's hosted integrations do)."""
        if not allow_parallel_tool_calls:
            calls = [b for b in response.message.blocks if isinstance(b, ToolCallBlock)]
            response.message.blocks = [b for b in response.message.blocks
                                       if not isinstance(b, ToolCallBlock) or b is calls[0]]
        return response

    def get_tool_calls_from_response(self, response: ChatResponse, error_on_no_tool_call: bool = True,
                                     **kwargs: Any) -> list[ToolSelection]:
        calls = [ToolSelection(tool_id=block.tool_call_id or "", tool_name=block.tool_name,
                               tool_kwargs=block.tool_kwargs if isinstance(block.tool_kwargs, dict) else {})
                 for block in response.message.blocks if isinstance(block, ToolCallBlock)]
        if not calls and error_on_no_tool_call:
            invalid = response.message.additional_kwargs.get("invalid_tool_calls")
            raise ValueError("The model answered without calling a tool" + (
                f" (it wrote calls that do not parse: {invalid})" if invalid else "") +
                ". Pass tool_required=True to make it call one.")
        return calls

    # ------------------------------------------------------------------ completion (raw text)
    # The decorated methods fire LlamaIndex's callback events (token counting, tracing) once; each calls an
    # undecorated body, which the async methods run in a thread, so an async call is counted once too.
    @llm_completion_callback()
    def complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        return self._complete_body(prompt, formatted, self.call_options(kwargs))

    @llm_completion_callback()
    def stream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseGen:
        return self._stream_complete_body(prompt, formatted, self.call_options(kwargs))

    def _complete_body(self, prompt: str, formatted: bool, options: dict[str, Any]) -> CompletionResponse:
        text = prompt if formatted else self.completion_to_prompt(prompt)  # type: ignore[misc]  # LLM sets it, never None
        return _completion(self.pool.generate(text, **options))

    def _stream_complete_body(self, prompt: str, formatted: bool, options: dict[str, Any]) -> CompletionResponseGen:
        text = prompt if formatted else self.completion_to_prompt(prompt)  # type: ignore[misc]  # LLM sets it, never None
        return _cumulative(self.pool.stream(text, **options), _completion)

    # ------------------------------------------------------------------ chat (the model's chat template)
    @llm_chat_callback()
    def chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        return self._chat_body(messages, self.call_options(kwargs, tools_allowed=True))

    @llm_chat_callback()
    def stream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseGen:
        return self._stream_chat_body(messages, self.call_options(kwargs, tools_allowed=True))

    def _chat_body(self, messages: Sequence[ChatMessage], options: dict[str, Any]) -> ChatResponse:
        last = None
        for response in self._stream_chat_body(messages, options):
            last = response
        assert last is not None  # _chat_stream always ends with a response (the one with the token counts)
        return last

    def _stream_chat_body(self, messages: Sequence[ChatMessage], options: dict[str, Any]) -> ChatResponseGen:
        tools = options.pop("tools", None)
        choice = options.pop("tool_choice", None)
        schemas = ToolSchemas(tools) if tools else None  # checked before anything is read
        if tools:
            options.update(tool_decoding(self.pool.engine, tools, choice))
        stream = self.pool.stream(to_engine_messages(messages), **options)
        return _chat_stream(stream, schemas)

    # ------------------------------------------------------------------ async: the work runs in a thread
    @llm_completion_callback()
    async def acomplete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        return await asyncio.to_thread(self._complete_body, prompt, formatted, self.call_options(kwargs))

    @llm_completion_callback()
    async def astream_complete(self, prompt: str, formatted: bool = False,
                               **kwargs: Any) -> CompletionResponseAsyncGen:
        options = self.call_options(kwargs)
        return iterate_in_thread(lambda: self._stream_complete_body(prompt, formatted, options))

    @llm_chat_callback()
    async def achat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        return await asyncio.to_thread(self._chat_body, messages, self.call_options(kwargs, tools_allowed=True))

    @llm_chat_callback()
    async def astream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseAsyncGen:
        options = self.call_options(kwargs, tools_allowed=True)
        return iterate_in_thread(lambda: self._stream_chat_body(messages, options))


def to_engine_messages(messages: Sequence[ChatMessage]) -> list[dict[str, Any]]:
    """LlamaIndex ChatMessages as the engine's {'role', 'content'} dicts: an assistant's ToolCallBlocks become its
    tool_calls, a "tool" message a tool result; other non-text content is refused, not dropped."""
    converted = []
    for message in messages:
        role = "tool" if message.role in (MessageRole.TOOL, MessageRole.FUNCTION) else _ROLES.get(message.role)
        if role is None:
            raise ValueError(f"EMLLM cannot take a {message.role.value!r} message; it reads system, user, "
                             "assistant and tool messages.")
        calls = [b for b in message.blocks if isinstance(b, ToolCallBlock)]
        others = sorted({type(block).__name__ for block in message.blocks
                         if not isinstance(block, (TextBlock, ToolCallBlock))})
        if others:
            raise ValueError(f"EMLLM reads text only, but a {role} message holds {', '.join(others)}. "
                             "Pass the content as text (e.g. a transcript or description of the media).")
        turn: dict[str, Any] = {"role": role, "content": message.content or ""}
        if calls:
            turn["tool_calls"] = [{"type": "function", "id": call.tool_call_id, "function": {
                "name": call.tool_name, "arguments": _arguments(call.tool_kwargs)}} for call in calls]
        if role == "tool" and message.additional_kwargs.get("tool_call_id"):
            turn["tool_call_id"] = message.additional_kwargs["tool_call_id"]
        converted.append(turn)
    return converted


def _arguments(kwargs: dict | str) -> dict:
    """A call's arguments as a dict (LlamaIndex may keep them as the JSON text the model wrote)."""
    if isinstance(kwargs, dict):
        return kwargs
    try:
        value = json.loads(kwargs or "{}")
    except json.JSONDecodeError:
        value = None
    if not isinstance(value, dict):
        raise ValueError(f"A tool call's arguments must be a JSON object, got {kwargs!r}.")
    return value


def _chat_stream(stream: TextStream, schemas: ToolSchemas | None) -> ChatResponseGen:
    """ChatResponses as LlamaIndex streams them (the message so far and the new delta); with tools, the text and
    each complete call (a ToolCallBlock) parsed from the deltas (emllm.tools); the last carries the token counts."""
    replies = ReplyStream(schemas) if schemas is not None else None
    text, calls, invalid = "", [], []
    for delta, result in deltas_with_result(stream):
        pieces = replies.feed(delta) if replies else [delta]
        if result is not None and replies:
            pieces += replies.close()
        new_text = ""
        for piece in pieces:
            if isinstance(piece, str):
                new_text += piece
            elif isinstance(piece, ToolCall):
                calls.append(ToolCallBlock(tool_call_id=piece.id, tool_name=piece.name, tool_kwargs=piece.arguments))
            elif isinstance(piece, InvalidToolCall):
                invalid.append({"name": piece.name, "text": piece.text, "error": piece.error})
        text += new_text
        message = ChatMessage(role=MessageRole.ASSISTANT, blocks=[TextBlock(text=text), *calls],
                              additional_kwargs={"invalid_tool_calls": invalid} if invalid else {})
        counts = usage(result) if result is not None else {}
        yield ChatResponse(message=message, delta=new_text, additional_kwargs=counts,
                           raw={"usage": counts, "generation": result} if result is not None else None)


def _cumulative(stream: TextStream, respond: Callable[..., Any]) -> Generator[Any, None, None]:
    """LlamaIndex streams carry the new piece (delta) and the whole text so far (text)."""
    so_far = ""
    for delta, result in deltas_with_result(stream):
        so_far += delta
        yield respond(result, text=so_far, delta=delta)


def _completion(result: GenerationResult | None, text: str | None = None,
                delta: str | None = None) -> CompletionResponse:
    if result is None:
        return CompletionResponse(text=text or "", delta=delta)
    counts = usage(result)
    return CompletionResponse(text=result.text if text is None else text, delta=delta, additional_kwargs=counts,
                              raw={"usage": counts, "generation": result})


# ---------------------------------------------------------------------- documents
def node_texts(nodes: Sequence[BaseNode], metadata_mode: MetadataMode = MetadataMode.NONE) -> list[str]:
    """Each node's text, refusing what cannot be read: no nodes, non-nodes, images, empty text."""
    if isinstance(nodes, (str, bytes)) or not isinstance(nodes, Sequence):
        raise TypeError(f"Pass a list of LlamaIndex documents or nodes, got {type(nodes).__name__}.")
    if not nodes:
        raise ValueError("No documents were given: pass at least one Document(text=...) to read into memory.")
    texts = []
    for i, node in enumerate(nodes):
        if not isinstance(node, BaseNode):
            raise TypeError(f"Item {i} is a {type(node).__name__}, not a LlamaIndex document or node; wrap text "
                            "as Document(text=...).")
        text = node.get_content(metadata_mode=metadata_mode)
        if not isinstance(text, str) or not text.strip():
            media = isinstance(node, ImageNode) or any(getattr(node, name, None) is not None for name in
                                                       ("image_resource", "audio_resource", "video_resource"))
            kind = "an image/media document without text" if media else "empty (no text)"
            raise ValueError(f"Document {i} (id {node.node_id!r}) is {kind}; EMLLM reads text only. Remove it, "
                             "or give it text (e.g. a caption or transcript).")
        texts.append(text)
    return texts


# ---------------------------------------------------------------------- the query engine
class EMLLMRetriever(BaseRetriever):
    """EMLLMQueryEngine.as_retriever(): nodes by where the memory's answer looks, not by embedding similarity."""

    def __init__(self, query_engine: EMLLMQueryEngine, max_tokens: int = 16, **kwargs: Any):
        sampling_options(max_tokens, 0.0, 1.0, 0, None, None)
        super().__init__(**kwargs)
        self._query_engine, self._max_tokens = query_engine, max_tokens

    def _retrieve(self, query_bundle: QueryBundle) -> list[NodeWithScore]:
        return self._query_engine.sources(query_bundle.query_str, self._max_tokens)



class EMLLMQueryEngine(CustomQueryEngine):
    """Reads every document into one episodic memory once, then answers each question from that memory: the
    prompt is the documents' tokens followed by the question, so only the question is read per query, and the
    model retrieves the relevant events inside its attention. ``source_nodes`` are the documents those events
    came from. Build it with ``from_documents`` or ``from_nodes``.

    ``template="chat"`` (the default) asks as people ask a chat model: the documents, a blank line and the question
    in one user turn of the model's chat template (``prompts.chat_frame``); an instruct model given the raw text
    frame tends to continue the document instead of answering. ``"text"`` is the raw ``prompts.qa_suffix`` frame,
    for models without a usable chat template. ``spans`` are positions in the prompt, past the turn's header."""

    nodes: list[BaseNode] = Field(description="The documents, in the order they were read.")
    spans: list[tuple[int, int]] = Field(description="Each document's token span [start, end) in the context.")
    model: str = DEFAULT_MODEL
    streaming: bool = False
    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] | None = None
    reread: bool = Field(default=False, description="Answer from the retrieved events re-read as text (emllm.reread).")
    progress: bool = False
    template: str = "chat"
    separator_in_context: bool = Field(default=True, description="The chat frame's blank line was read with the "
                                       "documents (prompts.chat_context); False for saves made before it was.")

    _pool: MemoryPool = PrivateAttr()
    _context_ids: list[int] = PrivateAttr()

    def __init__(self, *, pool: MemoryPool, context_ids: list[int], **fields: Any):
        """Use from_documents / from_nodes: they read the documents into ``pool`` first."""
        super().__init__(**fields)
        self._pool, self._context_ids = pool, context_ids

    @classmethod
    def from_documents(cls, documents: Sequence[BaseNode], model: str | None = None, preset: str = DEFAULT_PRESET,
                       **kwargs: Any) -> EMLLMQueryEngine:
        """Whole documents, not chunks: the memory, not a retriever, decides what is relevant."""
        return cls.from_nodes(documents, model=model, preset=preset, **kwargs)

    @classmethod
    def from_nodes(cls, nodes: Sequence[BaseNode], model: str | None = None, preset: str = DEFAULT_PRESET, *,
                   max_tokens: int = 256, temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0,
                   seed: int | None = None, stop: Sequence[str] | None = None, reread: bool = False,
                   streaming: bool = False, progress: bool = False, dtype: Any = "auto", device: str | None = None,
                   revision: str | None = None, token: str | None = None, engine: EMEngine | None = None,
                   metadata_mode: MetadataMode = MetadataMode.NONE, template: str = "chat",
                   **engine_fields: Any) -> EMLLMQueryEngine:
        """Read the nodes (in order) into a new episodic memory; ``engine_fields`` are EMConfig fields. ``model`` is
        as EMLLM's (a hub id with ``revision``/``token``), or ``engine=EMEngine(model, tokenizer)`` for a model
        already loaded.

        Everything is validated before the model loads; then the reading takes a while (a few hundred tokens/s on
        a CPU; ``progress=True`` shows a bar)."""
        texts = node_texts(nodes, metadata_mode)
        check_template(template)
        config = EMConfig.from_preset(preset, **engine_fields)
        sampling_options(max_tokens, temperature, top_p, top_k, seed, stop, reread)
        if engine is None:
            check_model(model, revision=revision)
            engine = shared_engine(model, dtype=dtype, device=device, revision=revision, token=token,
                                   progress=progress)
        # Queries rarely extend each other, so few automatic checkpoints are kept; the documents stay pinned.
        pool = MemoryPool(engine, config, max_memories=2)
        document_ids, spans = tokenize_documents(engine, texts, chat=template == "chat")
        header = chat_header(engine, template)
        context_ids = header + document_ids
        spans = [(start + len(header), end + len(header)) for start, end in spans]
        try:
            pool.read(context_ids, progress=progress)
        except BaseException:
            pool.close()
            raise
        return cls(pool=pool, context_ids=context_ids, nodes=list(nodes), spans=spans,
                   model=str(model or engine.model_name), streaming=streaming, max_tokens=max_tokens,
                   temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
                   stop=list(stop) if stop else None, reread=reread, progress=progress, template=template)

    @property
    def pool(self) -> MemoryPool:
        return self._pool

    @property
    def context_tokens(self) -> int:
        return len(self._context_ids)

    @property
    def context_ids(self) -> list[int]:
        """The prompt every query extends (the chat turn's header, then the documents' tokens), as read into the
        pool; a copy. Public so that a caller can checkpoint or save the memory of exactly what was read
        (``pool.checkpoint(engine.context_ids)``) without the documents' framing being rebuilt."""
        return list(self._context_ids)

    def question_ids(self, question: str) -> list[int]:
        """The question's tokens (with the end of the chat turn and the assistant's header, in the chat frame),
        tokenised on their own so the documents' tokens stay a prefix of every prompt."""
        if self.template == "chat":
            return chat_frame(self._pool.engine, question, separator_in_context=self.separator_in_context)[1]
        return self._pool.engine.tokenize(qa_suffix(question))

    def as_retriever(self, max_tokens: int = 16, **kwargs: Any) -> EMLLMRetriever:
        """A retriever over the read documents, for chat engines (CondensePlusContextChatEngine): a query is
        answered briefly and the documents that answer attended to are its nodes, scored by their share."""
        return EMLLMRetriever(self, max_tokens=max_tokens, **kwargs)

    def _start(self, question: str, max_tokens: int | None = None) -> tuple[TextStream, int]:
        options = sampling_options(max_tokens or self.max_tokens, self.temperature, self.top_p, self.top_k, self.seed,
                                   self.stop, self.reread)
        suffix = self.question_ids(question)
        # allow_empty=False: an answer that ended at once would print as 'None' (LlamaIndex's text for no answer).
        return self._pool.stream(self._context_ids + suffix, progress=self.progress, allow_empty=False,
                                 attribute=True, **options), len(suffix)

    def custom_query(self, query_str: str) -> Response | StreamingResponse:
        if not self.streaming:
            return self._answer(query_str)
        stream, question_tokens = self._start(query_str)
        sources: list[NodeWithScore] = []
        metadata: dict[str, Any] = {}
        return StreamingResponse(response_gen=self._stream_into(stream, question_tokens, sources, metadata),
                                 source_nodes=sources, metadata=metadata)

    def _answer(self, query_str: str) -> Response:
        """custom_query's answer when not streaming: the whole text, with its sources."""
        stream, question_tokens = self._start(query_str)
        for _ in stream:
            pass
        sources, metadata = self._describe(stream.result, question_tokens)
        return Response(stream.result.text, source_nodes=sources, metadata=metadata)

    async def acustom_query(self, query_str: str) -> Response | AsyncStreamingResponse:
        """Like custom_query, with the reading and generating in a worker thread (the event loop stays free)."""
        if not self.streaming:
            return await asyncio.to_thread(self._answer, query_str)
        self.question_ids(query_str)  # a bad question fails here, not at the first delta
        sources: list[NodeWithScore] = []
        metadata: dict[str, Any] = {}

        def start() -> Generator[str, None, None]:
            stream, question_tokens = self._start(query_str)
            return self._stream_into(stream, question_tokens, sources, metadata)
        return AsyncStreamingResponse(response_gen=iterate_in_thread(start), source_nodes=sources, metadata=metadata)

    def _stream_into(self, stream: TextStream, question_tokens: int, sources: list[NodeWithScore],
                     metadata: dict[str, Any]) -> Generator[str, None, None]:
        """Yield the answer's deltas; once it is complete, fill the response's ``sources`` and ``metadata`` in place
        (they are known only once the answer began, so a streaming response has them when the stream is done)."""
        for delta, result in deltas_with_result(stream):
            if delta:
                yield delta
            if result is not None:
                found, described = self._describe(result, question_tokens)
                sources.extend(found)
                metadata.update(described)

    def _describe(self, result: GenerationResult, question_tokens: int) -> tuple[list[NodeWithScore], dict]:
        """Sources: the documents the answer's tokens attended to (local window and retrieved events; not the
        sinks, see attention_shares), each scored by its share of that attention; those under SOURCE_MIN_SHARE are
        left to the metadata."""
        config = self._pool.config
        shares = attention_shares(self.spans, result.attention, config.n_init if config.attention == "episodic" else 0)
        order = sorted(range(len(shares)), key=lambda d: -shares[d])
        sources = [NodeWithScore(node=self.nodes[d], score=shares[d]) for d in order if shares[d] >= SOURCE_MIN_SHARE]
        retrieved = document_shares(self.spans, result.retrieved_events)
        # retrieved_spans: the exact passages in attention ([start, end) token positions in the prompt, with the
        # number of layers, out of num_layers, that retrieved each), for finer attribution than whole documents.
        metadata = {**usage(result), "model": self.model, "context_tokens": len(self._context_ids),
                    "question_tokens": question_tokens, "retrieved_events": len(result.retrieved_events),
                    "document_shares": {self.nodes[d].node_id: shares[d] for d in order},
                    "retrieved_shares": {self.nodes[d].node_id: retrieved[d] for d in order if retrieved[d] > 0},
                    "retrieved_spans": [(e.start, e.end, e.layers) for e in result.retrieved_events],
                    "num_layers": self._pool.engine.shape.num_layers}
        return sources, metadata

    def sources(self, question: str, max_tokens: int | None = None) -> list[NodeWithScore]:
        """The documents an answer to ``question`` draws on (what as_retriever returns)."""
        stream, question_tokens = self._start(question, max_tokens)
        for _ in stream:
            pass
        return self._describe(stream.result, question_tokens)[0]

    def close(self) -> None:
        """Free the documents' memory (its disk pages are removed); the engine stays loaded for others."""
        self._pool.close()

    # ------------------------------------------------------------------ read once, serve many times
    def save(self, path: str | os.PathLike) -> Path:
        """Save the documents' memory and the documents themselves in one atomic save (see emllm.persistence),
        so another process answers from them with from_memory() without reading them again."""
        memory = self._pool.checkpoint(self._context_ids)
        documents = {"kind": SAVE_KIND, "nodes": [doc_to_json(node) for node in self.nodes],
                     "spans": [list(span) for span in self.spans], "context_tokens": len(self._context_ids),
                     "template": self.template, "separator_in_context": self.separator_in_context}
        return self._pool.engine.save_memory(memory, path, metadata={"llama_index": documents})

    @classmethod
    def from_memory(cls, path: str | os.PathLike, model: str | None = None, *, dtype: Any = "auto",
                    device: str | None = None, revision: str | None = None, token: str | None = None,
                    engine: EMEngine | None = None, max_tokens: int = 256, temperature: float = 0.0,
                    top_p: float = 1.0, top_k: int = 0, seed: int | None = None, stop: Sequence[str] | None = None,
                    reread: bool = False, streaming: bool = False, progress: bool = False) -> EMLLMQueryEngine:
        """A query engine over documents saved by save(): the memory is loaded and verified, nothing is re-read."""
        documents = read_metadata(path).get("llama_index")
        if not isinstance(documents, dict) or documents.get("kind") != SAVE_KIND:
            raise ValueError(f"{path} is a saved episodic memory but not one saved by EMLLMQueryEngine.save(); "
                             "load it with EMEngine.load_memory instead.")
        sampling_options(max_tokens, temperature, top_p, top_k, seed, stop, reread)
        if engine is None:
            check_model(model, revision=revision)
            engine = shared_engine(model, dtype=dtype, device=device, revision=revision, token=token,
                                   progress=progress)
        memory = engine.load_memory(path)
        if memory.total_tokens != documents["context_tokens"]:
            memory.close()
            raise ValueError(f"{path} holds {memory.total_tokens} tokens but its documents span "
                             f"{documents['context_tokens']}: the save is inconsistent; build it again.")
        pool = MemoryPool(engine, memory.config, max_memories=2)
        pool.adopt(memory)
        return cls(pool=pool, context_ids=list(memory.token_ids), nodes=[json_to_doc(d) for d in documents["nodes"]],
                   spans=[tuple(span) for span in documents["spans"]], model=str(model or engine.model_name),
                   streaming=streaming, max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                   seed=seed, stop=list(stop) if stop else None, reread=reread, progress=progress,
                   template=documents.get("template", "text"),  # saves before the chat frame used the text one
                   separator_in_context=documents.get("separator_in_context", False))  # saves before it was

