"""LangChain chat model on the EM-LLM engine: ``ChatEMLLM``.

    from emllm_integrations.langchain import ChatEMLLM
    llm = ChatEMLLM()                                   # embedded Qwen2.5-Coder-0.5B-Instruct, the default preset, lazy
    llm = ChatEMLLM(model="/path/to/hf/model", preset="S", n_local=1024, n_mem=1024, max_tokens=64)
    chain = ChatPromptTemplate.from_messages([("human", "{document}\\n\\n{question}")]) | llm

Why it looks the way it does:

* **Cheap instances.** Constructing validates every setting (preset, engine fields, sampling, model name) but loads
  nothing. The first call fetches the process-wide engine for the model (``emllm.sessions.shared_engine``), so ten
  instances of one model load its weights once. Instances with the same model and memory settings share one
  ``MemoryPool``.
* **Stateless calls, reused memory.** LangChain passes the whole conversation on every call. The pool keeps
  checkpoints of what earlier calls read, so a call whose messages extend an earlier call's messages reads only the
  new tokens; ``response_metadata["new_input_tokens"]`` says how many (``usage_metadata`` counts the whole prompt,
  with the reused part as ``input_token_details["cache_read"]``). Concurrent calls (``batch``, ``abatch``) each
  generate in their own memory, so they never mix.
* **Async without blocking.** The engine is synchronous CPU work: async calls run it in a thread and pass the text
  deltas back through an ``asyncio.Queue`` (``emllm_integrations.async_bridge``, shared with the LlamaIndex adapter).
* **Text only.** Messages become ``{"role", "content"}`` turns rendered by the model's chat template (the engine
  merges consecutive same-role turns or folds system turns only when a template rejects them). A message ``name``
  is kept by prefixing the content (``"alice: hi"``), since chat templates drop it. Images, audio, files, tool
  messages and tool calls raise a ValueError: the model reads text and has no tool-calling format.

Long documents with the small SmolLM2-135M: state the question *before* the document as well as after it.
Measured on a 32K-token passkey document (key ~29K tokens before the end, preset S, n_local = n_mem = 1024): with
the question only after the document the chat model answered with haystack text although the event holding the key
was retrieved in 26 of 30 layers; with the question first (it stays among the attention sinks) it answered the key.
The default Qwen2.5-Coder-0.5B answers questions asked after the document (tests/integration_tests/
test_default_model_prose.py).

    ChatPromptTemplate.from_messages([("human", "Answer the question about the text below.\\n"
                                       "Question: {question}\\n\\n{document}\\n\\nQuestion: {question}")])
"""

from __future__ import annotations

import dataclasses
import json
import threading
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from contextlib import aclosing
from pathlib import Path
from typing import Any, NamedTuple, cast

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.language_models import BaseChatModel, LangSmithParams
from langchain_core.language_models.chat_models import agenerate_from_stream, generate_from_stream
from langchain_core.language_models.model_profile import ModelProfile
from langchain_core.messages import AIMessage, AIMessageChunk, BaseMessage, ChatMessage, ToolMessage
from langchain_core.messages.ai import InputTokenDetails, UsageMetadata
from langchain_core.messages.tool import tool_call_chunk
from langchain_core.output_parsers import JsonOutputKeyToolsParser, JsonOutputParser, PydanticOutputParser
from langchain_core.output_parsers.openai_tools import PydanticToolsParser
from langchain_core.outputs import ChatGenerationChunk, ChatResult
from langchain_core.runnables import Runnable, RunnableConfig, RunnableMap, RunnablePassthrough
from langchain_core.tools import BaseTool
from langchain_core.utils.function_calling import convert_to_json_schema, convert_to_openai_tool
from langchain_core.utils.pydantic import is_basemodel_subclass
from langchain_core.utils.utils import secret_from_env
from pydantic import BaseModel, ConfigDict, Field, SecretStr, model_validator

from emllm import (DEFAULT_MODEL, DEFAULT_PRESET, EMConfig, EMEngine, GenerationResult, MemoryPool,
                   shared_engine)
from emllm.decoding import check_reread, check_sampling
from emllm.models import check_model
from emllm.sessions import shared_pool
from emllm.tools import InvalidToolCall, ReplyStream, ToolCall, ToolSchemas

from .async_bridge import iterate_in_thread
from .response_format import response_grammar, with_format_request
from .sampling import sampling_options
from .tool_choice import chosen_tools, tool_decoding

#: EMConfig fields, settable on ChatEMLLM by name (``ChatEMLLM(n_local=1024)``).
ENGINE_FIELDS = tuple(f.name for f in dataclasses.fields(EMConfig) if f.name != "extra")
#: Per-call keyword arguments (``llm.invoke(x, temperature=0.7)`` or ``llm.bind(max_tokens=16)``).
CALL_OPTIONS = ("model", "temperature", "max_tokens", "top_p", "top_k", "seed", "reread", "tools", "tool_choice",
                "response_format")

_CALL_BLOCKS = ("tool_use", "tool_call", "function_call")
_REASONING_BLOCKS = ("thinking", "redacted_thinking", "reasoning")
_ROLES = {"system": "system", "human": "user", "user": "user", "ai": "assistant", "assistant": "assistant"}


class ChatEMLLM(BaseChatModel):
    """A local Hugging Face chat model whose attention has an episodic memory (EM-LLM): it reads documents far
    beyond its trained context and answers from them. See the module docstring for the design."""

    model_name: str | None = Field(default=None, alias="model")
    """An embedded model name, a local Hugging Face model directory or a hub id (``org/name``, from
    huggingface_hub's cache, downloaded when the hub is reachable); None = the embedded default."""
    revision: str | None = None
    """A hub id's branch, tag or commit, as in transformers."""
    token: SecretStr | None = None
    """A hub token for private or gated models (else huggingface_hub's own: HF_TOKEN or a saved login)."""
    loaded_engine: EMEngine | None = Field(default=None, alias="engine", exclude=True)
    """An engine over a model already loaded (``engine=EMEngine(model, tokenizer)``) instead of ``model``."""
    preset: str = DEFAULT_PRESET
    """The engine preset: S, SM, SC, S+C, SM+C, F, FM, FC or full."""
    engine_fields: dict[str, Any] = Field(default_factory=dict)
    """EMConfig fields over the preset. Pass them flat (``n_local=1024``); they are collected here."""
    dtype: str = "auto"
    """Weights dtype: "auto" (bfloat16 where the CPU is fast at it, else float32), "float32", "bfloat16"."""
    device: str | None = None
    progress: bool = False
    """Show progress bars (stderr) while the model loads and a long prompt is read (a first use converts the model
    and says so either way)."""
    max_memories: int = 4
    """Conversations the shared pool keeps resumable (MemoryPool: the latest checkpoint of each, and up to twice as
    many earlier ones they extend; the least recently used go first)."""
    memory_path: str | None = None
    """A memory saved by ``save_memory`` (e.g. a long document already read): conversations that extend what it
    read continue from it instead of reading again. It must have this instance's memory settings."""

    temperature: float = 0.0
    """0 = greedy."""
    max_tokens: int = 256
    """Most tokens to generate per call."""
    top_p: float = 1.0
    top_k: int = 0
    """0 = off."""
    seed: int | None = None
    """Sampling seed (with temperature > 0): the same seed gives the same answer."""
    stop: list[str] | None = None
    """Stop strings (any length, cut from the answer). A per-call ``stop`` replaces these."""
    reread: bool = False
    """Answer from the events the memory retrieves re-read as text under full attention (emllm.reread): better on
    questions that ask for several items at once, a few-thousand-token prefill per answer. Per call:
    ``llm.invoke(x, reread=True)``."""
    streaming: bool = False
    """Invoke through the streaming path (callbacks see each delta either way)."""

    # LangChain's standard parameters for hosted models. A local model has no network, retries or key; they are
    # accepted so code (and the standard test suite) written for hosted chat models runs unchanged, and unused.
    timeout: float | None = None
    max_retries: int = 0
    api_key: SecretStr | None = Field(default_factory=secret_from_env("EMLLM_API_KEY", default=None))

    model_config = ConfigDict(validate_by_name=True, validate_by_alias=True, arbitrary_types_allowed=True)

    # ------------------------------------------------------------------ construction (validates, loads nothing)
    @model_validator(mode="before")
    @classmethod
    def _collect_engine_fields(cls, values: Any) -> Any:
        """Flat engine fields go into ``engine_fields``; any other unknown argument is an error, not ignored."""
        if not isinstance(values, dict):
            return values
        own = set(cls.model_fields) | {f.alias for f in cls.model_fields.values() if f.alias}
        values = dict(values)
        flat = {k: values.pop(k) for k in list(values) if k in ENGINE_FIELDS and k not in own}
        unknown = sorted(k for k in values if k not in own)
        if unknown:
            raise ValueError(
                f"Unknown argument(s) {unknown} for ChatEMLLM. Engine fields: {', '.join(ENGINE_FIELDS)}. "
                "Chat fields: model, revision, token, engine, preset, dtype, device, progress, max_memories, "
                "temperature, "
                "max_tokens, top_p, top_k, "
                "seed, stop, reread, streaming (and LangChain's own, e.g. callbacks, tags, cache).")
        if flat:
            values["engine_fields"] = {**(values.get("engine_fields") or {}), **flat}
        return values

    @model_validator(mode="after")
    def _validate_eagerly(self) -> ChatEMLLM:
        """Bad settings fail here, at construction, rather than minutes later inside the first call."""
        self.em_config()  # unknown preset or field, impossible layout -> emllm.ConfigError (a ValueError)
        if self.loaded_engine is None:
            check_model(self.model_name, revision=self.revision)  # nothing is loaded or downloaded to find out
        elif self.model_name is None:
            self.model_name = self.loaded_engine.model_name
        check_sampling(self.max_tokens, self.temperature, self.top_p, self.top_k, length_name="max_tokens")
        check_reread(self.reread)
        if self.max_memories < 1:
            raise ValueError(f"max_memories must be at least 1, got {self.max_memories}.")
        if self.stop is not None and not all(isinstance(s, str) for s in self.stop):
            raise ValueError(f"stop must be a list of strings, got {self.stop!r}.")
        return self

    def em_config(self) -> EMConfig:
        """The memory settings of this instance (preset + engine fields)."""
        return EMConfig.from_preset(self.preset, **self.engine_fields)

    # ------------------------------------------------------------------ LangChain identity
    @property
    def _llm_type(self) -> str:
        return "emllm-chat"

    @property
    def _identifying_params(self) -> dict[str, Any]:
        """Everything that changes the answer (also the key of LangChain's response cache)."""
        return {"model_name": self._display_name(), "revision": self.revision, "preset": self.preset,
                **self.engine_fields,
                "dtype": self.dtype, "device": self.device, "temperature": self.temperature,
                "max_tokens": self.max_tokens, "top_p": self.top_p, "top_k": self.top_k, "seed": self.seed,
                "stop": self.stop}

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any) -> LangSmithParams:
        params = LangSmithParams(ls_provider="emllm", ls_model_name=self._display_name(kwargs.get("model")),
                                 ls_model_type="chat", ls_temperature=kwargs.get("temperature", self.temperature),
                                 ls_max_tokens=kwargs.get("max_tokens", self.max_tokens))
        if stop or self.stop:
            params["ls_stop"] = stop or self.stop
        return params

    def _display_name(self, override: str | None = None) -> str:
        return override or self.model_name or DEFAULT_MODEL

    # ------------------------------------------------------------------ engine and pool (loaded on first use)
    def engine(self, model: str | None = None) -> EMEngine:
        """The engine given, else the process-wide engine of this model (loaded on the first call in the process)."""
        if self.loaded_engine is not None and model in (None, self.model_name):
            return self.loaded_engine
        token = self.token.get_secret_value() if self.token is not None else None
        return shared_engine(model or self.model_name, dtype=self.dtype, device=self.device, revision=self.revision,
                             token=token, progress=self.progress)

    def pool(self, model: str | None = None) -> MemoryPool:
        """The MemoryPool shared by every instance with this model and these memory settings."""
        pool = shared_pool(self.engine(model), self.em_config(), self.max_memories)
        if self.memory_path is not None and model in (None, self.model_name):
            _adopt_saved(pool, self.memory_path)
        return pool

    def batch(self, inputs: list[Any], config: RunnableConfig | list[RunnableConfig] | None = None, *,
              return_exceptions: bool = False, **kwargs: Any) -> list[AIMessage]:
        """LangChain's batch with every input in flight at once unless ``max_concurrency`` says otherwise (the
        executor's default is the CPU count + 4): concurrent conversations decode their tokens in shared forwards
        (emllm.batching), so more at once is faster, not slower. abatch runs them all at once already."""
        if not isinstance(config, list) and "max_concurrency" not in (config or {}):
            config = {**(config or {}), "max_concurrency": max(1, len(inputs))}
        return super().batch(inputs, config, return_exceptions=return_exceptions, **kwargs)

    def save_memory(self, messages: Sequence[BaseMessage], path: str | Path) -> Path:
        """Save the memory of these messages (read now unless a call already did) to ``path``, atomically; start
        ``ChatEMLLM(memory_path=path)`` in any process to continue conversations from it without re-reading."""
        pool = self.pool()
        memory = pool.checkpoint(to_engine_messages(list(messages)))
        return pool.engine.save_memory(memory, path)

    # ------------------------------------------------------------------ token counting (the model's own tokenizer)
    def get_token_ids(self, text: str) -> list[int]:
        if self.custom_get_token_ids is not None:
            return self.custom_get_token_ids(text)
        return self.engine().text_ids(text)

    def get_num_tokens_from_messages(self, messages: list[BaseMessage],
                                     tools: Sequence[dict[str, Any] | type | Any | BaseTool] | None = None) -> int:
        """The prompt tokens these messages cost: the chat template with the assistant's turn opened, exactly what
        a call reads (and reports as ``usage_metadata["input_tokens"]``)."""
        listed = [convert_to_openai_tool(tool) for tool in tools] if tools else None
        return len(self.engine().encode_prompt(to_engine_messages(messages), listed).ids)

    # ------------------------------------------------------------------ serialisation and profile
    @classmethod
    def is_lc_serializable(cls) -> bool:
        """Settings only (no weights, no memory): ``load(dumpd(llm), valid_namespaces=["emllm_integrations"])``
        gives an equal model."""
        return True

    @classmethod
    def get_lc_namespace(cls) -> list[str]:
        return ["emllm_integrations", "langchain"]

    @property
    def lc_secrets(self) -> dict[str, str]:
        """The unused ``api_key`` and the hub ``token`` are written as references to these variables, never as
        their values."""
        return {"api_key": "EMLLM_API_KEY", "token": "HF_TOKEN"}

    def _resolve_model_profile(self) -> ModelProfile | None:
        """What this model does, for code that picks models by capability. An episodic memory has no input limit
        unless ``max_input_tokens`` is set."""
        profile = ModelProfile(name=self._display_name(), open_weights=True, text_inputs=True, text_outputs=True,
                               image_inputs=False, audio_inputs=False, pdf_inputs=False, video_inputs=False,
                               tool_calling=True, tool_choice=True, structured_output=True, temperature=True)
        limit = self.em_config().max_input_tokens
        if limit is not None:
            profile["max_input_tokens"] = limit
        return profile

    # ------------------------------------------------------------------ tools and structured output
    def bind_tools(self, tools: Sequence[dict[str, Any] | type | Callable | BaseTool], *,
                   tool_choice: str | bool | dict | None = None, **kwargs: Any) -> Runnable:
        """Tools as LangChain tools, pydantic models, functions or OpenAI dicts. ``tool_choice``: "auto" (default),
        "none", "any"/"required", or a tool's name. Listed through the model's chat template where it carries
        tools (Qwen2.5, Qwen3), else through emllm.tools.TOOL_PROMPT; the calls are decoded under a grammar of
        the tools' parameters (emllm.grammar), so their arguments always parse."""
        formatted = [convert_to_openai_tool(tool) for tool in tools]
        chosen_tools(formatted, tool_choice)  # a wrong name fails here
        return super().bind(tools=formatted, tool_choice=tool_choice, **kwargs)

    def with_structured_output(self, schema: dict | type | None = None, *, method: str = "json_schema",
                               include_raw: bool = False, strict: bool | None = None,
                               **kwargs: Any) -> Runnable:
        """Answers as ``schema`` (a pydantic class, a TypedDict or a JSON schema dict), decoded under that schema
        so the result always parses. method: "json_schema" (the answer is the JSON), "function_calling" (a
        forced call of a tool with the schema as its parameters), "json_mode" (a JSON object; the schema's, if
        one is given). ``strict`` is accepted for compatibility: decoding is always strict here."""
        if kwargs:
            raise TypeError(f"Unknown argument(s) {sorted(kwargs)} for with_structured_output.")
        if method not in ("json_schema", "function_calling", "json_mode"):
            raise ValueError(f"method must be 'json_schema', 'function_calling' or 'json_mode', got {method!r}.")
        if schema is None and method != "json_mode":
            raise ValueError(f"method={method!r} needs a schema; only method='json_mode' works without one.")
        pydantic = isinstance(schema, type) and is_basemodel_subclass(schema)
        trace = {"ls_structured_output_format": {"kwargs": {"method": method},
                                                 "schema": convert_to_json_schema(schema) if schema else None}}
        if method == "function_calling":
            assert schema is not None  # only json_mode goes without one (checked above)
            name = convert_to_openai_tool(schema)["function"]["name"]
            llm = self.bind_tools([schema], tool_choice=name, **trace)
            parser: Runnable = (PydanticToolsParser(tools=[cast("type[BaseModel]", schema)], first_tool_only=True)
                                if pydantic else JsonOutputKeyToolsParser(key_name=name, first_tool_only=True))
        else:
            json_schema = convert_to_json_schema(schema) if schema is not None else {"type": "object"}
            llm = self.bind(response_format={"type": "json_schema", "json_schema": {
                "name": json_schema.get("title", "response"), "schema": json_schema}}, **trace)
            parser = (PydanticOutputParser(pydantic_object=cast("type[BaseModel]", schema)) if pydantic
                      else JsonOutputParser())
        if not include_raw:
            return llm | parser
        parsed = RunnablePassthrough.assign(parsed=lambda x: parser.invoke(x["raw"]), parsing_error=lambda _: None)
        failed = RunnablePassthrough.assign(parsed=lambda _: None)
        return RunnableMap(raw=llm) | parsed.with_fallbacks([failed], exception_key="parsing_error")

    # ------------------------------------------------------------------ generation
    def _generate(self, messages: list[BaseMessage], stop: list[str] | None = None,
                  run_manager: CallbackManagerForLLMRun | None = None, **kwargs: Any) -> ChatResult:
        return _with_llm_output(generate_from_stream(self._stream(messages, stop=stop, run_manager=run_manager,
                                                                  **kwargs)))

    def _stream(self, messages: list[BaseMessage], stop: list[str] | None = None,
                run_manager: CallbackManagerForLLMRun | None = None, **kwargs: Any) -> Iterator[ChatGenerationChunk]:
        """One chunk per text delta (with tools: per piece of text and per whole tool call; with a response
        format: the JSON in one chunk), then a last, empty chunk with the usage and response metadata."""
        prompt = to_engine_messages(messages)
        call = self.call_options(stop, kwargs)
        schemas = ToolSchemas(call.tools) if call.tools else None  # checked before the model loads
        pool = self.pool(call.model)
        options = {**call.sampling, "progress": self.progress}
        if call.tools:
            options.update(tool_decoding(pool.engine, call.tools, call.tool_choice))
        if call.response_format is not None:
            options["grammar"] = response_grammar(call.response_format)
            prompt = with_format_request(prompt, call.response_format)
        stream = pool.stream(prompt, **options)
        replies = _ReplyChunks(schemas, whole=call.response_format is not None)
        deltas = iter(stream)
        try:
            for delta in deltas:
                for chunk in replies.feed(delta):
                    if run_manager:
                        run_manager.on_llm_new_token(chunk.text, chunk=chunk)
                    yield chunk
        finally:
            close = getattr(deltas, "close", None)  # a consumer that stops early releases the memory at once
            if close is not None:
                close()
        result = stream.result
        # Calls only (a forced call) or a structured answer: cut by max_tokens, it cannot parse. Text that may hold
        # calls (tool_choice auto) is parsed as it is; a call left open is an invalid_tool_call.
        forced = call.tools and chosen_tools(call.tools, call.tool_choice)[1] == "required"
        if (forced or call.response_format is not None) and result.finish_reason == "length":
            raise ValueError(f"The answer reached max_tokens={options['max_new_tokens']} before "
                             f"{options['grammar'].what} were complete, so it would not parse: raise max_tokens.")
        yield from replies.close()
        yield _last_chunk(result, self._display_name(call.model))

    async def _agenerate(self, messages: list[BaseMessage], stop: list[str] | None = None,
                         run_manager: AsyncCallbackManagerForLLMRun | None = None, **kwargs: Any) -> ChatResult:
        return _with_llm_output(await agenerate_from_stream(self._astream(messages, stop=stop,
                                                                          run_manager=run_manager, **kwargs)))

    async def _astream(self, messages: list[BaseMessage], stop: list[str] | None = None,
                       run_manager: AsyncCallbackManagerForLLMRun | None = None,
                       **kwargs: Any) -> AsyncIterator[ChatGenerationChunk]:
        """``_stream`` in a worker thread (see async_bridge): the event loop keeps running while the model works."""
        # aclosing: a consumer that stops early stops the worker now, not when the bridge is garbage-collected.
        async with aclosing(iterate_in_thread(lambda: self._stream(messages, stop=stop, **kwargs),
                                              name="ChatEMLLM")) as chunks:
            async for chunk in chunks:
                if run_manager and chunk.text:
                    await run_manager.on_llm_new_token(chunk.text, chunk=chunk)
                yield chunk

    def call_options(self, stop: list[str] | None, kwargs: dict[str, Any]) -> CallOptions:
        """This call's options: per-call values over the instance's, checked before any work. Public so that a
        caller (and the unit tests) can see what a call would run with, and have bad options refused, without
        loading a model."""
        kwargs = {k: v for k, v in kwargs.items() if k != "stream"}  # LangChain's own streaming switch
        unknown = sorted(set(kwargs) - set(CALL_OPTIONS))
        if unknown:
            raise TypeError(f"Unknown call option(s) {unknown} for ChatEMLLM; per-call options are "
                            f"{', '.join(CALL_OPTIONS)} (and stop).")
        options = sampling_options(kwargs.get("max_tokens", self.max_tokens),
                                   kwargs.get("temperature", self.temperature), kwargs.get("top_p", self.top_p),
                                   kwargs.get("top_k", self.top_k), kwargs.get("seed", self.seed),
                                   stop if stop is not None else self.stop, kwargs.get("reread", self.reread))
        return CallOptions(kwargs.get("model"), options, kwargs.get("tools"), kwargs.get("tool_choice"),
                           kwargs.get("response_format"))


class CallOptions(NamedTuple):
    model: str | None
    sampling: dict[str, Any]               # MemoryPool.stream keywords
    tools: list[dict[str, Any]] | None     # OpenAI function dicts, from bind_tools
    tool_choice: Any
    response_format: dict[str, Any] | None  # from with_structured_output


# ---------------------------------------------------------------------- messages
_ADOPTED: set[tuple[int, str]] = set()
_ADOPTED_LOCK = threading.Lock()


def _adopt_saved(pool: MemoryPool, path: str) -> None:
    """Load a saved memory into a pool once per process (verified by emllm.persistence before use)."""
    key = (id(pool), str(Path(path).absolute()))
    with _ADOPTED_LOCK:
        if key in _ADOPTED:
            return
        pool.adopt(pool.engine.load_memory(path, pool.config))
        _ADOPTED.add(key)


def to_engine_messages(messages: Sequence[BaseMessage]) -> list[dict[str, Any]]:
    """LangChain messages as the engine's ``{"role", "content"}`` turns (text; names kept as a prefix; an AI
    message's tool calls as ``tool_calls``; a ToolMessage as a "tool" turn)."""
    if not messages:
        raise ValueError("The message list is empty: pass at least one message (e.g. a HumanMessage).")
    return [_engine_message(m) for m in messages]


def _engine_message(message: BaseMessage) -> dict[str, Any]:
    role = _role(message)
    if isinstance(message, ToolMessage):
        return {"role": "tool", "content": _text(message), "tool_call_id": message.tool_call_id}
    turn: dict[str, Any] = {"role": role, "content": _named(message, _text(message))}
    if isinstance(message, AIMessage) and message.tool_calls:
        turn["tool_calls"] = [{"type": "function", "id": call.get("id"),
                               "function": {"name": call["name"], "arguments": call["args"]}}
                              for call in message.tool_calls]
    return turn


def _role(message: BaseMessage) -> str:
    kind = message.role if isinstance(message, ChatMessage) else message.type
    if kind == "tool":
        return "tool"
    if kind == "function":
        raise ValueError("FunctionMessage is OpenAI's legacy format: pass the result as a ToolMessage with the "
                         "tool_call_id of the call it answers.")
    if kind not in _ROLES:
        raise ValueError(f"Unknown message role {kind!r}; ChatEMLLM reads system, human/user, ai/assistant and "
                         "tool messages.")
    return _ROLES[kind]


def _text(message: BaseMessage) -> str:
    """The message's text; a non-text content block is an error rather than silently dropped."""
    if isinstance(message.content, str):
        return message.content
    parts = []
    for block in message.content:
        if isinstance(block, str):
            parts.append(block)
        elif isinstance(block, dict) and block.get("type") == "text":
            parts.append(block.get("text", ""))
        elif isinstance(block, dict) and block.get("type") in _CALL_BLOCKS and getattr(message, "tool_calls", None):
            continue  # a provider's copy of a call that message.tool_calls holds (and the template renders)
        elif isinstance(block, dict) and block.get("type") in _REASONING_BLOCKS and isinstance(message, AIMessage):
            continue  # an earlier answer's reasoning: chat templates of reasoning models drop it from the history
        else:
            kind = block.get("type") if isinstance(block, dict) else type(block).__name__
            raise ValueError(f"ChatEMLLM reads text only, but a {message.type} message has a {kind!r} content block. "
                             "Images, audio, files and tool blocks are not supported: pass their text (a caption, "
                             "a transcript, the extracted text) as a text block or a string.")
    return "".join(parts)


def _named(message: BaseMessage, text: str) -> str:
    """Chat templates drop a message's name; keep it visible to the model as a prefix."""
    return f"{message.name}: {text}" if message.name else text


# ---------------------------------------------------------------------- helpers
def _last_chunk(result: GenerationResult, model_name: str) -> ChatGenerationChunk:
    """The final chunk: no text, the call's usage (the tokenizer's counts) and metadata, marked last."""
    reused = result.input_tokens - result.new_input_tokens
    usage = UsageMetadata(input_tokens=result.input_tokens, output_tokens=result.output_tokens,
                          total_tokens=result.input_tokens + result.output_tokens,
                          input_token_details=InputTokenDetails(cache_read=reused))
    metadata = {"model_name": model_name, "finish_reason": result.finish_reason,
                "new_input_tokens": result.new_input_tokens, "prefill_seconds": result.prefill_seconds,
                "decode_seconds": result.decode_seconds}
    message = AIMessageChunk(content="", usage_metadata=usage, response_metadata=metadata, chunk_position="last")
    return ChatGenerationChunk(message=message, generation_info={"finish_reason": result.finish_reason})


INVALID_CALL_ERRORS = "invalid_tool_call_errors"
"""additional_kwargs key of a streamed invalid call's chunk: {call id: [reason, what the model wrote]}."""


def _invalid_args(call: InvalidToolCall) -> str:
    """A streamed invalid call's args: LangChain's chunks carry no error field, so the reason leads (which also
    keeps text that happens to be JSON from being parsed into a call); an invoke() gets the two apart."""
    return f"invalid tool call ({call.error}): {call.text}"


def _with_call_errors(message: Any) -> None:
    """Each invalid tool call of a whole message gets its reason as ``error`` and what the model wrote as ``args``
    (see _invalid_args)."""
    errors = message.additional_kwargs.pop(INVALID_CALL_ERRORS, None) or {}
    for call in message.invalid_tool_calls:
        if call.get("id") in errors:
            call["error"], call["args"] = errors[call["id"]]


def _with_llm_output(result: ChatResult) -> ChatResult:
    """The call's model and token usage as ``llm_output`` too, where ``on_llm_end`` handlers look for them; invalid
    tool calls with their reasons."""
    message = result.generations[0].message
    _with_call_errors(message)
    usage = getattr(message, "usage_metadata", None) or {}
    result.llm_output = {"model_name": message.response_metadata.get("model_name"),
                         "token_usage": {"prompt_tokens": usage.get("input_tokens", 0),
                                         "completion_tokens": usage.get("output_tokens", 0),
                                         "total_tokens": usage.get("total_tokens", 0)}}
    return result


class _ReplyChunks:
    """Text deltas as LangChain chunks: with tools, text pieces and one tool_call_chunk per whole call (emllm.tools
    parses them); with ``whole``, everything in one chunk at the end (a streamed structured answer is parsed
    whole: partial JSON would not validate)."""

    def __init__(self, schemas: ToolSchemas | None, whole: bool):
        self._replies = ReplyStream(schemas) if schemas is not None else None
        self._whole, self._calls = whole, 0
        self._held: list[str] = []

    def feed(self, delta: str) -> list[ChatGenerationChunk]:
        if self._whole:
            self._held.append(delta)
            return []
        return self._chunks(self._replies.feed(delta) if self._replies else [delta])

    def close(self) -> list[ChatGenerationChunk]:
        if self._whole:
            return self._chunks(["".join(self._held)] if self._held else [])
        return self._chunks(self._replies.close() if self._replies else [])

    def _chunks(self, pieces: list) -> list[ChatGenerationChunk]:
        out = []
        for piece in pieces:
            if isinstance(piece, str):
                message = AIMessageChunk(content=piece)
            elif isinstance(piece, ToolCall):
                message = AIMessageChunk(content="", tool_call_chunks=[
                    tool_call_chunk(name=piece.name, args=json.dumps(piece.arguments), id=piece.id, index=self._calls)])
                self._calls += 1
            else:  # an invalid call: its args say why first, so LangChain cannot parse it into a valid call
                message = AIMessageChunk(
                    content="", tool_call_chunks=[tool_call_chunk(name=piece.name, args=_invalid_args(piece),
                                                                  id=piece.id, index=self._calls)],
                    additional_kwargs={INVALID_CALL_ERRORS: {piece.id: [piece.error, piece.text]}})
                self._calls += 1
            out.append(ChatGenerationChunk(message=message))
        return out
