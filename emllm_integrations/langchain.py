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
import threading
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import aclosing
from pathlib import Path
from typing import Any

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.language_models import BaseChatModel, LangSmithParams
from langchain_core.language_models.model_profile import ModelProfile
from langchain_core.language_models.chat_models import agenerate_from_stream, generate_from_stream
from langchain_core.messages import AIMessage, AIMessageChunk, BaseMessage, ChatMessage
from langchain_core.messages.ai import InputTokenDetails, UsageMetadata
from langchain_core.outputs import ChatGenerationChunk, ChatResult
from langchain_core.tools import BaseTool
from pydantic import ConfigDict, Field, SecretStr, model_validator

from emllm import DEFAULT_MODEL, DEFAULT_PRESET, EMConfig, EMEngine, GenerationResult, MemoryPool, shared_engine
from emllm.engine import check_sampling
from emllm.sessions import shared_pool
from emllm.models import is_embedded_available, resolve_model_dir

from .async_bridge import iterate_in_thread
from .sampling import sampling_options

#: EMConfig fields, settable on ChatEMLLM by name (``ChatEMLLM(n_local=1024)``).
ENGINE_FIELDS = tuple(f.name for f in dataclasses.fields(EMConfig) if f.name != "extra")
#: Per-call keyword arguments (``llm.invoke(x, temperature=0.7)`` or ``llm.bind(max_tokens=16)``).
CALL_OPTIONS = ("model", "temperature", "max_tokens", "top_p", "top_k", "seed")

_ROLES = {"system": "system", "human": "user", "user": "user", "ai": "assistant", "assistant": "assistant"}


class ChatEMLLM(BaseChatModel):
    """A local Hugging Face chat model whose attention has an episodic memory (EM-LLM): it reads documents far
    beyond its trained context and answers from them. See the module docstring for the design."""

    model_name: str | None = Field(default=None, alias="model")
    """A known embedded model name or a local Hugging Face model directory; None = the embedded default."""
    preset: str = DEFAULT_PRESET
    """The engine preset: S, SM, SC, S+C, SM+C, F, FM, FC or full."""
    engine_fields: dict[str, Any] = Field(default_factory=dict)
    """EMConfig fields over the preset. Pass them flat (``n_local=1024``); they are collected here."""
    dtype: str = "auto"
    """Weights dtype: "auto" (bfloat16 where the CPU is fast at it, else float32), "float32", "bfloat16"."""
    device: str | None = None
    max_memories: int = 4
    """Conversation checkpoints the shared pool keeps for reuse (least recently used ones are dropped)."""
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
    streaming: bool = False
    """Invoke through the streaming path (callbacks see each delta either way)."""

    # LangChain's standard parameters for hosted models. A local model has no network, retries or key; they are
    # accepted so code (and the standard test suite) written for hosted chat models runs unchanged, and unused.
    timeout: float | None = None
    max_retries: int = 0
    api_key: SecretStr | None = None

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
                "Chat fields: model, preset, dtype, device, max_memories, temperature, max_tokens, top_p, top_k, "
                "seed, stop, streaming (and LangChain's own, e.g. callbacks, tags, cache).")
        if flat:
            values["engine_fields"] = {**(values.get("engine_fields") or {}), **flat}
        return values

    @model_validator(mode="after")
    def _validate_eagerly(self) -> "ChatEMLLM":
        """Bad settings fail here, at construction, rather than minutes later inside the first call."""
        self.em_config()  # unknown preset or field, impossible layout -> emllm.ConfigError (a ValueError)
        _check_model(self.model_name)
        check_sampling(self.max_tokens, self.temperature, self.top_p, self.top_k, length_name="max_tokens")
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
        return {"model_name": self._display_name(), "preset": self.preset, **self.engine_fields,
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
        """The process-wide engine of this model (loads the weights on the first call in the process)."""
        return shared_engine(model or self.model_name, dtype=self.dtype, device=self.device, progress=False)

    def pool(self, model: str | None = None) -> MemoryPool:
        """The MemoryPool shared by every instance with this model and these memory settings."""
        pool = shared_pool(self.engine(model), self.em_config(), self.max_memories)
        if self.memory_path is not None and model in (None, self.model_name):
            _adopt_saved(pool, self.memory_path)
        return pool

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
        if tools:
            raise ValueError("ChatEMLLM has no tool calling, so tools cannot be counted: pass tools=None.")
        return len(self.engine().prompt_ids(to_engine_messages(messages)))

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
        """The unused ``api_key`` is written as a reference to this variable, never as its value."""
        return {"api_key": "EMLLM_API_KEY"}

    def _resolve_model_profile(self) -> ModelProfile | None:
        """What this model does, for code that picks models by capability. An episodic memory has no input limit
        unless ``max_input_tokens`` is set."""
        profile = ModelProfile(name=self._display_name(), open_weights=True, text_inputs=True, text_outputs=True,
                               image_inputs=False, audio_inputs=False, pdf_inputs=False, video_inputs=False,
                               tool_calling=False, tool_choice=False, structured_output=False, temperature=True)
        limit = self.em_config().max_input_tokens
        if limit is not None:
            profile["max_input_tokens"] = limit
        return profile

    # ------------------------------------------------------------------ what is not supported, said plainly
    def bind_tools(self, tools: Sequence[Any], **kwargs: Any) -> Any:
        raise NotImplementedError(
            "ChatEMLLM has no tool calling yet. Call the tool yourself and pass its result as text in a "
            "HumanMessage, or use a chat model with tool calling for the agent and ChatEMLLM for the long-document "
            "questions.")

    def with_structured_output(self, schema: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(
            "ChatEMLLM has no structured output yet: its decoding is not constrained by a schema. Ask for the fields "
            "in the prompt and parse the text (e.g. with langchain_core.output_parsers.PydanticOutputParser), and "
            "check the result.")

    # ------------------------------------------------------------------ generation
    def _generate(self, messages: list[BaseMessage], stop: list[str] | None = None,
                  run_manager: CallbackManagerForLLMRun | None = None, **kwargs: Any) -> ChatResult:
        return _with_llm_output(generate_from_stream(self._stream(messages, stop=stop, run_manager=run_manager,
                                                                  **kwargs)))

    def _stream(self, messages: list[BaseMessage], stop: list[str] | None = None,
                run_manager: CallbackManagerForLLMRun | None = None, **kwargs: Any) -> Iterator[ChatGenerationChunk]:
        """One chunk per text delta, then a last, empty chunk with the usage and response metadata."""
        prompt = to_engine_messages(messages)
        model, options = self._call_options(stop, kwargs)
        stream = self.pool(model).stream(prompt, **options)
        deltas = iter(stream)
        try:
            for delta in deltas:
                chunk = ChatGenerationChunk(message=AIMessageChunk(content=delta))
                if run_manager:
                    run_manager.on_llm_new_token(delta, chunk=chunk)
                yield chunk
        finally:
            deltas.close()  # a consumer that stops early releases the memory at once
        yield _last_chunk(stream.result, self._display_name(model))

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

    def _call_options(self, stop: list[str] | None, kwargs: dict[str, Any]) -> tuple[str | None, dict[str, Any]]:
        """This call's model and sampling options: per-call values over the instance's, checked before any work."""
        kwargs = {k: v for k, v in kwargs.items() if k != "stream"}  # LangChain's own streaming switch
        unknown = sorted(set(kwargs) - set(CALL_OPTIONS))
        if unknown:
            raise TypeError(f"Unknown call option(s) {unknown} for ChatEMLLM; per-call options are "
                            f"{', '.join(CALL_OPTIONS)} (and stop).")
        options = sampling_options(kwargs.get("max_tokens", self.max_tokens),
                                   kwargs.get("temperature", self.temperature), kwargs.get("top_p", self.top_p),
                                   kwargs.get("top_k", self.top_k), kwargs.get("seed", self.seed),
                                   stop if stop is not None else self.stop)
        return kwargs.get("model"), options


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


def to_engine_messages(messages: Sequence[BaseMessage]) -> list[dict[str, str]]:
    """LangChain messages as the engine's ``{"role", "content"}`` turns (text only; names kept as a prefix)."""
    if not messages:
        raise ValueError("The message list is empty: pass at least one message (e.g. a HumanMessage).")
    return [{"role": _role(m), "content": _named(m, _text(m))} for m in messages]


def _role(message: BaseMessage) -> str:
    kind = message.role if isinstance(message, ChatMessage) else message.type
    if kind in ("tool", "function"):
        raise ValueError(f"ChatEMLLM has no tool calling, so a {type(message).__name__} cannot be read. Put the "
                         "tool's result into a HumanMessage as text instead.")
    if isinstance(message, AIMessage) and message.tool_calls:
        raise ValueError("ChatEMLLM has no tool calling: an AIMessage with tool_calls cannot be read. Pass the "
                         "conversation without tool calls.")
    if kind not in _ROLES:
        raise ValueError(f"Unknown message role {kind!r}; ChatEMLLM reads system, human/user and ai/assistant "
                         "messages.")
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


def _with_llm_output(result: ChatResult) -> ChatResult:
    """The call's model and token usage as ``llm_output`` too, where ``on_llm_end`` handlers look for them."""
    message = result.generations[0].message
    usage = getattr(message, "usage_metadata", None) or {}
    result.llm_output = {"model_name": message.response_metadata.get("model_name"),
                         "token_usage": {"prompt_tokens": usage.get("input_tokens", 0),
                                         "completion_tokens": usage.get("output_tokens", 0),
                                         "total_tokens": usage.get("total_tokens", 0)}}
    return result


def _check_model(model: str | None) -> None:
    """A model must be a local HF directory or an installed embedded model; nothing is loaded to find out."""
    if model is None:
        return
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"model={model!r} is a directory without a config.json, so not a Hugging Face model "
                             "directory. Pass a model directory or an embedded model name.")
        return
    try:
        available = is_embedded_available(model)
    except ValueError as error:
        raise ValueError(f"model={model!r} is neither an existing local model directory nor an embedded model. "
                         f"{error}") from None
    if not available:
        resolve_model_dir(model)  # raises ModelNotAvailableError with the pip command that installs it
