"""The engine: a causal LM whose attention has an episodic memory, read in chunks and generating token by token.

    engine = EMEngine.from_pretrained()                 # embedded Qwen2.5-Coder-0.5B-Instruct, DEFAULT_PRESET
    memory = engine.new_memory()
    result = engine.chat([{"role": "user", "content": book + "\\n\\nWho wrote the letter?"}], memory=memory)
    result = engine.chat(messages + [answer, follow_up], memory=memory)   # reads only the new tokens

One engine holds the model; each conversation has its own EpisodicMemory, so many conversations can share one
loaded model. A memory remembers the exact token ids it has read: a prompt that extends them is read from where
the memory stopped (continuation), anything else is refused rather than silently mixed.

The engine is a facade over one job each: codec.py turns prompts into ids, this module reads ids into a memory
(chunks, forwards, batched decoding steps), conversation.py runs a turn, decoding.py the token loop.
"""

from __future__ import annotations

import json
import os
import warnings
import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from tqdm.auto import tqdm
from transformers import PreTrainedModel

from . import attention, persistence
from .batching import StepBatcher, decoding_block, release_thread_workers
from .codec import EncodedPrompt, Message, Prompt, PromptCodec, refuse_bytes
from .config import DEFAULT_PRESET, EMConfig
from .conversation import MemoryMismatchError, OwnMemory, Request, converse
from .decoding import Decoding, GenerationResult, TextStream, check_sampling, decoding, end_of_turn_ids
from .forward import FailedRow, layer_attention
from .grammar import Grammar, GrammarCompiler
from .layer_memory import ModelShape
from .memory import EpisodicMemory, because
from .models import prepare_loaded
from .rope import RotaryTable
from .scoring import RetrievalPlan, uses_event_text
from .tools import CALL_CLOSE, CALL_OPEN, check_tools

__all__ = ["EMEngine", "EncodedPrompt", "GenerationResult", "Inspection", "MemoryMismatchError", "TextStream",
           "check_sampling"]


@dataclass
class Inspection:
    tokens: list[str]
    surprise: torch.Tensor          # [n] float32, NaN for the first token
    event_starts: torch.Tensor      # [events] absolute start positions (sinks are tokens [0, n_init))
    stats: dict[str, Any]


class EMEngine:
    def __init__(self, model: PreTrainedModel, tokenizer: Any, config: EMConfig | None = None, *,
                 model_name: str = "model"):
        prepare_loaded(model, tokenizer)  # any loaded model: an unsupported family is refused here
        self.model, self.tokenizer = model, tokenizer
        self.config = config or EMConfig.from_preset(DEFAULT_PRESET)
        self.model_name = model_name
        mc = model.config
        heads = mc.num_attention_heads
        self.shape = ModelShape(
            num_layers=mc.num_hidden_layers, num_heads=heads,
            num_kv_heads=getattr(mc, "num_key_value_heads", None) or heads,
            head_dim=getattr(mc, "head_dim", None) or mc.hidden_size // heads,
            dtype=model.dtype, max_positions=mc.max_position_embeddings)
        # A config given is checked now; the default one only when a memory uses it (a shared engine's pools bring
        # their own, so a small model must not be refused for a default layout it never runs).
        if config is not None:
            config.validate_for_model(self.shape.max_positions, self.shape.num_layers)
        self._config_fits = config is not None
        rotary = attention.find_rotary_module(model)
        self.layer_devices = [next(layer.parameters()).device for layer in attention.decoder_layers(model)]
        table_size = self.config.rope_positions() if self.config.attention == "episodic" else self.shape.max_positions
        self._rotary = rotary
        self._ropes = {d: RotaryTable.from_rotary_module(rotary, table_size, self.shape.dtype, d)
                       for d in dict.fromkeys(self.layer_devices)}
        attention.install(model, layer_attention)
        embeddings: Any = model.get_input_embeddings()  # an nn.Embedding, typed as a plain Module by transformers
        self.input_device: torch.device = embeddings.weight.device
        self.vocab_size = int(embeddings.num_embeddings)  # ids at or past it are refused (_check_ids)
        self.store_device = self.layer_devices[0]
        # On the CPU an event's text is embedded as it leaves the window, a small share of reading. On an accelerator
        # a read is bound by launching kernels, and the embedder's launches and host copies in every eviction made
        # preset E read at 0.54x S (an H100); there the events wait, and the first question that ranks by text
        # embeds them all in one batched call (EpisodicMemory.text_scores, fork).
        self.embeds_on_eviction = self.store_device.type == "cpu"
        self.eos_ids = end_of_turn_ids(model, tokenizer)
        self.codec = PromptCodec(tokenizer)  # prompts to token ids, one template render per call
        self._memories: weakref.WeakSet[EpisodicMemory] = weakref.WeakSet()  # every memory made, forks included
        # llguidance, compiled on first use
        self.grammars = GrammarCompiler(tokenizer, int(model.config.vocab_size), self.eos_ids)
        self.batcher = StepBatcher(self.step)  # concurrent generations decode their tokens in one forward
        self._row_block: int | bool | None = False  # batching.decoding_block, probed at the first decoding step
        release_thread_workers()  # the load's idle OpenMP workers would slow other threads' forwards (batching.py)

    @classmethod
    def from_pretrained(cls, model: str | None = None, *, preset: str | None = None, config: EMConfig | None = None,
                        dtype: torch.dtype | str = "auto", device: str | None = None,
                        device_map: str | dict | None = None, revision: str | None = None,
                        token: str | bool | None = None, progress: bool = True, **overrides: Any) -> EMEngine:
        """Load a model and give it an episodic memory: None = the embedded default, an embedded name, a local
        directory, or a hub id (huggingface_hub's cache; ``revision`` and ``token`` as in transformers). A model
        already loaded goes straight to ``EMEngine(model, tokenizer, config)``.

        ``preset`` is one of S, SM, SC, S+C, SM+C, F, FM, FC, full; any EMConfig field can be overridden by name.
        """
        from .models import DEFAULT_MODEL, load_model

        if config is None:
            if preset is not None or overrides:  # None of both: the default, checked on use
                config = EMConfig.from_preset(preset or DEFAULT_PRESET, **overrides)
        elif overrides:
            config = config.replace(**overrides)
        hf_model, tokenizer = load_model(model, dtype=dtype, device=device, device_map=device_map, revision=revision,
                                         token=token, progress=progress)
        return cls(hf_model, tokenizer, config, model_name=str(model or DEFAULT_MODEL))

    # ------------------------------------------------------------------ memories
    def new_memory(self, config: EMConfig | None = None) -> EpisodicMemory:
        """A fresh, empty episodic memory (optionally with other memory settings for this conversation)."""
        config = config or self.config
        if config is not self.config or not self._config_fits:
            config.validate_for_model(self.shape.max_positions, self.shape.num_layers)
        ropes = self._ropes
        if config.attention == "episodic" and config.rope_positions() > next(iter(ropes.values())).cos.shape[0]:
            ropes = {d: RotaryTable.from_rotary_module(self._rotary, config.rope_positions(), self.shape.dtype, d)
                     for d in ropes}
        memory = EpisodicMemory(config, self.shape, self.layer_devices, ropes, self.store_device)
        if uses_event_text(config.scorer):
            memory.texts.embedder = self._event_text_embedder(config.event_embedding)
        memory.on_fork = self._memories.add
        self._memories.add(memory)
        return memory

    def _event_text_embedder(self, name: str) -> Callable[[list[list[int]]], torch.Tensor]:
        """Token id lists -> unit vectors of their text, for scoring.EventText. The sentence-transformers model is
        loaded once per process and device (embeddings.load_embedding_model) and shared by every memory; on the
        model's own device (measured on an H100: with the embedder on the host CPU, preset E read at 0.44x S)."""
        from .embeddings import TextEmbedder

        embedder = TextEmbedder(name, device=str(self.store_device))
        return lambda id_lists: embedder.embed(self.tokenizer.batch_decode(id_lists, skip_special_tokens=True))

    def save_memory(self, memory: EpisodicMemory, path: str | os.PathLike, metadata: dict | None = None,
                    earlier: dict | None = None) -> Any:
        """Write a memory to a directory atomically (safetensors + a checked manifest); see persistence.py."""
        return persistence.save_memory(memory, path, engine=self, metadata=metadata, earlier=earlier)

    def load_memory(self, path: str | os.PathLike, config: EMConfig | None = None) -> EpisodicMemory:
        """A memory saved by save_memory, verified (version, model, shapes, checksums) before anything is used."""
        memory = persistence.load_memory(path, self, config=config)
        memory.on_fork = self._memories.add
        self._memories.add(memory)
        return memory

    def open_memories(self) -> list[EpisodicMemory]:
        """The memories this engine made (forks and loaded ones included) that are still open: what close() would
        close, and what a caller checks to see that nothing it started was left open."""
        return [memory for memory in list(self._memories) if not memory.closed]

    def close(self) -> None:
        """Close every memory this engine made (their disk pages are removed)."""
        for memory in list(self._memories):
            memory.close()

    # ------------------------------------------------------------------ text <-> tokens (codec.py)
    # Text is text: a control-token string inside it ("<|im_end|>", "<|im_start|>system") is read as those
    # characters, never as the control token, so a document, a question or a message cannot forge a chat turn.
    def tokenize(self, text: str) -> list[int]:
        return self.codec.tokenize(text)

    def text_ids(self, text: str) -> list[int]:
        """The text's token ids, control-token strings kept as text, without tokenize()'s checks (for counting)."""
        return self.codec.text_ids(text)

    def tokenize_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """tokenize() plus each token's character span in the text, for mapping retrieved tokens to their sources."""
        return self.codec.tokenize_with_offsets(text)

    def template_ids(self, text: str) -> list[int]:
        """Ids of text a chat template wrote (its control-token strings become control tokens); never user text."""
        return self.codec.template_ids(text)

    def chat_ids(self, messages: Sequence[Message], add_generation_prompt: bool = True,
                 tools: list[dict] | None = None) -> list[int]:
        """Token ids of a conversation in the model's chat template, with ``tools`` (OpenAI function dicts) listed
        as the template lists them, or by tools.TOOL_PROMPT."""
        return self.codec.chat_ids(messages, add_generation_prompt, tools)

    def prompt_ids(self, prompt: Prompt) -> list[int]:
        return self.codec.prompt_ids(prompt)

    def encode_prompt(self, prompt: Prompt, tools: list[dict] | None = None) -> EncodedPrompt:
        """The prompt's ids, where its question starts and the spans kept in attention (the tool listing), from one
        render (PromptCodec.encode). An EncodedPrompt is accepted wherever a prompt is."""
        return self.codec.encode(prompt, tools)

    def count_tokens(self, text: str) -> int:
        return len(self.codec.text_ids(text))

    def tool_grammar(self, tools: list[dict], required: bool) -> Grammar | None:
        """What a reply may be when ``tools`` are listed: tool calls only (required), or text and then calls, each
        valid for its tool (emllm.tools' format). None for the second where the tags are not single tokens of
        this tokenizer: free text could then spell a tag, so the reply is parsed instead of constrained."""
        tags = [self.template_ids(tag) for tag in (CALL_OPEN, CALL_CLOSE)]
        if all(len(ids) == 1 for ids in tags):
            return Grammar.tool_calls(tools, *(f"<[{ids[0]}]>" for ids in tags), required=required)
        if not required:
            return None
        return Grammar.tool_calls(tools, json.dumps(CALL_OPEN), json.dumps(CALL_CLOSE), required=True)

    # ------------------------------------------------------------------ reading
    def pin(self, memory: EpisodicMemory, ids: list[int], start: int, end: int) -> None:
        """Read the prompt up to ``end`` (if not read yet) and keep tokens [start, end) in every layer's attention; a
        span longer than the retrieval budget is left to retrieval (pinning it would crowd out everything), with
        a warning that says so: the model may then not see a tool when the question does not resemble it."""
        if end <= memory.config.n_init or (start, end) in memory.pinned_spans:
            return
        if memory.total_tokens < end:
            self.read(memory, ids[memory.total_tokens:end])
        try:
            memory.pin(start, end)
        except ValueError as error:
            warnings.warn(f"The tool listing ({end - start} tokens) is not kept in attention, it is left to "
                          f"retrieval: {error}", stacklevel=2)

    def pin_prefix(self, memory: EpisodicMemory, ids: list[int], end: int | None) -> None:
        """pin() the prompt's first ``end`` tokens (None: nothing to pin)."""
        if end is not None:
            self.pin(memory, ids, 0, end)

    def read(self, memory: EpisodicMemory, ids: Sequence[int] | str, *, progress: bool = False,
             question_start: int | None = None) -> int:
        """Read tokens (or text) into the memory in chunks; returns how many were read.

        ``question_start`` is a position counted from the memory's first token (EncodedPrompt.question_start): if
        it falls inside these tokens, the chunks restart there, so the question's retrieval is driven by its own
        queries rather than by the document's last chunk (a chunk's retrieval serves all its tokens: on SmolLM2 at
        32K, 1/3 needles answered with the question in the last chunk, 3/3 read alone). The forwards from the
        question on are answering ones."""
        if isinstance(ids, str):
            ids = self.tokenize(ids)
        if memory.closed:
            raise RuntimeError(f"This episodic memory was closed{because(memory.closed_reason)}; start a new one "
                               "with engine.new_memory().")
        tokens = self._check_ids(ids)
        if not len(tokens):
            # Nothing new (a pool read the whole prompt before generating from it): the prompt's question, and
            # what its queries attended to, must keep ranking events for the answer's tokens.
            return 0
        self._check_budget(memory, len(tokens))
        with self.batcher.reading(len(tokens)):  # a short read goes before other conversations' decoding steps
            if not self._storing_can_fail(memory, len(tokens)):
                return self._read_tokens(memory, tokens, progress, question_start)
            # Storing what is read can fail part-way (a disk budget met by more events than foreseen, a full disk):
            # the read goes into a fork, adopted only once it has succeeded, so a failure leaves this memory as it was.
            trial = memory.fork()
            trial.attribution = memory.attribution
            try:
                read = self._read_tokens(trial, tokens, progress, question_start)
            except BaseException:
                trial.close("a trial read failed")
                raise
            memory.adopt(trial)
            return read

    def _storing_can_fail(self, memory: EpisodicMemory, n: int) -> bool:
        """Whether reading ``n`` more tokens seals a page that may be written to disk (RAM has a budget). Reads that
        do not, the usual follow-up question, are made in place: a trial fork copies the window and the index."""
        if memory.config.attention != "episodic" or not memory.store.spills_to_disk:
            return False
        page = memory.store.page_tokens
        return memory.stored_after(n) // page > memory.store.num_tokens // page

    def _read_tokens(self, memory: EpisodicMemory, tokens: torch.Tensor, progress: bool,
                     question_start: int | None) -> int:
        """read()'s forwards, chunk by chunk, the question's in answering forwards."""
        chunk = memory.config.chunk_size
        question = len(tokens) if question_start is None else min(max(question_start - memory.total_tokens, 0),
                                                                      len(tokens))
        memory.begin_answer()  # these tokens are a new prompt: its question must not inherit the last answer's ranking
        memory.ask(tokens[question:].tolist(), answer_from=memory.total_tokens + len(tokens))
        starts = [*range(0, question, chunk), *range(question, len(tokens), chunk)]
        with tqdm(total=len(tokens), unit="tok", desc="reading into memory", disable=not progress,
                  dynamic_ncols=True) as bar:
            for start, end in zip(starts, [*starts[1:], len(tokens)]):
                piece = tokens[start:end]
                if start == question:
                    memory.begin_question()
                self.forward(memory, piece, retrieve=True, answering=end > question)
                bar.update(len(piece))
                bar.set_postfix(events=memory.num_events, refresh=False)
        release_thread_workers()  # idle OpenMP workers would slow other threads' forwards (batching.py)
        return len(tokens)

    def read_prompt(self, memory: EpisodicMemory, ids: list[int], question_start: int | None, *,
                    progress: bool = False) -> int:
        """Read the part of a prompt (EncodedPrompt) the memory has not read yet, its question in answering
        forwards; token ids have no known question: their last chunk is taken for it (all of it when they are a
        follow-up question shorter than a chunk)."""
        seen = memory.total_tokens
        if question_start is None:
            chunk = memory.config.chunk_size
            question_start = seen + max(0, len(ids) - seen - 1) // chunk * chunk
        return self.read(memory, ids[seen:], progress=progress, question_start=question_start)

    def _check_ids(self, ids: Sequence[int]) -> torch.Tensor:
        """Token ids as a tensor, refusing (before any work) what the model cannot read: a wrong id would raise
        inside the model part-way through a read, or (a float, a bool) be silently read as another token."""
        refuse_bytes(ids)
        if isinstance(ids, dict) or not isinstance(ids, Iterable):
            raise TypeError(f"Expected text (str) or a list of token ids, got {type(ids).__name__}.")
        ids = list(ids)
        if not set(map(type, ids)) <= {int}:  # one C-level pass; bool is refused too (type(True) is bool)
            position = next(i for i, token in enumerate(ids) if type(token) is not int)
            raise TypeError(f"Token ids are integers; position {position} holds {ids[position]!r} "
                            f"({type(ids[position]).__name__}).")
        vocab = self.vocab_size
        if ids and not (min(ids) >= 0 and max(ids) < vocab):
            outside = [i for i, token in enumerate(ids) if not 0 <= token < vocab]  # only to name them
            raise ValueError(f"Token id {ids[outside[0]]} at position {outside[0]} ({len(outside)} such ids) is "
                             f"outside this model's vocabulary [0, {vocab}): use ids from this model's tokenizer.")
        return torch.tensor(ids, dtype=torch.long)

    def _check_budget(self, memory: EpisodicMemory, n: int) -> None:
        limit = memory.config.max_input_tokens
        if limit is not None and memory.total_tokens + n > limit:
            raise ValueError(f"Reading {n} more tokens would bring this memory to {memory.total_tokens + n} tokens, "
                             f"over max_input_tokens={limit}. Raise max_input_tokens or shorten the input.")
        if memory.config.attention == "episodic" and memory.config.disk_budget_mb is not None:
            # At most max_position() tokens stay in the window (once past full_until), so at least the rest is
            # evicted into sealed pages; those beyond the RAM (and device) budgets must go to disk.
            # The event index grows with every event and takes RAM from the pages: at least one event per
            # max_block_size tokens evicted by this read is indexed (a lower bound; surprise cuts more).
            evicted = memory.stored_after(n)
            sealed = evicted // memory.store.page_tokens
            events = max(0, evicted - memory.store.num_tokens) // memory.config.max_block_size
            held = memory.index_bytes(adding=events)
            memory.store.check_disk_budget(memory.store.pages_beyond_memory(sealed, held))

    def forward(self, memory: EpisodicMemory, ids: torch.Tensor, retrieve: bool,
                 answering: bool = False) -> torch.Tensor:
        """One forward: read ids [q] into the memory (retrieving events if ``retrieve``; ``answering``: a question's or
        a generated token's forward); returns the logits [q or 1, vocab]. read() and decoding call it; so do
        benchmarks that drive the memory forward by forward."""
        plan = memory.plan_forward(retrieve, answering)
        # Surprise needs every position's log-probabilities; without it only the last position's logits are
        # computed (the LM head over a 50K-150K vocabulary is a real share of a chunk's cost).
        return self.forward_rows([memory], ids[None], [plan], keep=0 if memory.track_surprise else 1)[0]

    @property
    def row_block(self) -> int | None:
        """The row multiple from which this model's decoding forwards give each row what it gets alone
        (batching.row_block), probed at the first call; None where there is none, or where on this CPU a forward of
        that many rows costs much more than one of a single row (batching.padding_is_cheap): conversations then
        decode one forward each, each row always alone."""
        if self._row_block is False:
            self._row_block = decoding_block(self.model)
            self.batcher.max_rows = 1 if self._row_block is None else self.batcher.max_rows
        return None if self._row_block is False else self._row_block

    def step(self, memories: list[EpisodicMemory], tokens: list[int]) -> list[BaseException | None]:
        """One decoding step of one or more conversations as one forward (the StepBatcher calls it): each token is
        fed to its own memory, whose last_logits then predict the next. The weights are read once for all rows,
        padded to the row block so each row's result does not depend on the batch (emllm.batching). Returns each
        row's error (None: it went well): a conversation whose own memory fails gets its error, the others go on."""
        block = self.row_block
        if block is None and len(memories) > 1:  # one forward each, and each one's failure its own
            return [self._step_alone(memory, token) for memory, token in zip(memories, tokens)]
        errors: list[BaseException | None] = [None] * len(memories)
        rows, plans = [], []
        for row, memory in enumerate(memories):
            try:
                plans.append(memory.plan_forward(retrieve=True, answering=True))
                rows.append(row)
            except Exception as error:  # nothing was read: the memory stays as it was
                errors[row] = error
        if not rows:
            return errors
        padding = -len(rows) % (block or 1)
        failures: dict[int, BaseException] = {}
        batch = [tokens[row] for row in rows]
        self.forward_rows([*(memories[row] for row in rows), *[None] * padding],
                          torch.tensor(batch + batch[:1] * padding)[:, None], plans, keep=1, failures=failures)
        for index, failure in failures.items():
            errors[rows[index]] = failure
        return errors

    def _step_alone(self, memory: EpisodicMemory, token: int) -> BaseException | None:
        """One conversation's decoding step in its own forward; an error of that forward is this row's alone (its
        memory was closed by forward_rows): the conversations after it in the step still run theirs."""
        try:
            return self.step([memory], [token])[0]
        except Exception as error:
            return error

    def forward_rows(self, memories: Sequence[EpisodicMemory | None], ids: torch.Tensor, plans: list[RetrievalPlan],
                     keep: int, failures: dict[int, BaseException] | None = None) -> torch.Tensor:
        """ids [rows, q], row i read into memories[i] under plans[i] (a None memory is a padding row: it attends to
        nothing and its logits are dropped); returns the logits [rows, q or keep, vocab].

        A memory that fails part-way has taken some of the forward's keys and events but not the rest: it would
        answer from a state no input produces, so it is closed. With ``failures`` (a batched decoding step), a row
        whose own memory raises (in a layer, or storing what it read) is closed alone and its error recorded there
        by row; the others finish as they would alone. Without it, or when the forward itself fails, every row's
        memory is closed and the error raised."""
        real = [memory for memory in memories if memory is not None]
        for memory, plan in zip(real, plans):
            memory.begin_forward(plan)
        rows: list[Any] = list(memories)  # the layers mark a row whose memory raised (forward.FailedRow) in it
        try:
            with torch.inference_mode():
                out = self.model(input_ids=ids.to(self.input_device), use_cache=False, logits_to_keep=keep,
                                 emllm_memory=rows if len(rows) > 1 else rows[0])
                for row, memory in enumerate(real):  # real rows come first
                    try:
                        if isinstance(rows[row], FailedRow):
                            raise rows[row].error
                        memory.observe(ids[row], out.logits[row])
                        if memory.evict() and self.embeds_on_eviction:
                            memory.embed_events()  # each event's text is embedded once, when it leaves the window
                    except Exception as error:
                        if failures is None:
                            raise
                        memory.close(f"a forward pass failed part-way with {type(error).__name__}: {error}")
                        failures[row] = error
        except BaseException as error:
            shared = f" (one forward with {len(real) - 1} other conversations)" if len(real) > 1 else ""
            for memory in real:
                memory.close(f"a forward pass{shared} failed part-way with {type(error).__name__}: {error}")
            raise
        return out.logits

    # ------------------------------------------------------------------ generating (conversation.py)
    def request(self, prompt: Prompt, *, tools: list[dict] | None = None, progress: bool = False,
                **options: Any) -> Request:
        """A call checked and encoded before anything is read: the decoding ``options`` (decoding.decoding: a bad
        setting is refused with its name), the grammar (one llguidance can enforce), then the prompt, once."""
        return self._request(prompt, decoding(**options), tools, progress)

    def _request(self, prompt: Prompt, settings: Decoding, tools: list[dict] | None, progress: bool) -> Request:
        if tools is not None:
            tools = check_tools(tools)
        if settings.grammar is not None:
            self.grammars.check(settings.grammar)
        return Request(self.encode_prompt(prompt, tools), settings, progress)

    def stream(self, prompt: Prompt, *, memory: EpisodicMemory | None = None, max_new_tokens: int = 256,
               temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0, seed: int | None = None,
               stop: Sequence[str] | None = None, progress: bool = False, tools: list[dict] | None = None,
               grammar: Grammar | None = None, allow_empty: bool = True, attribute: bool = False,
               reread: bool = False) -> TextStream:
        """Generate from a prompt, yielding text deltas. With ``memory``, the prompt must extend what it has read.

        ``tools`` (OpenAI function dicts) are listed in the chat (emllm.tools); ``grammar`` constrains what is
        generated (emllm.grammar: a JSON schema, tool calls), checked before anything is read; ``allow_empty=False``
        keeps the end of turn away until the answer has a visible character; ``attribute=True`` records where the
        answer's attention went (GenerationResult.attention: what sources are credited from); ``reread=True``
        answers from the events the memory retrieves re-read as text under full attention (emllm.reread: better on
        questions asking for several items, a few-thousand-token prefill per answer)."""
        settings = decoding(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
                            stop=stop, grammar=grammar, allow_empty=allow_empty, attribute=attribute,
                            reread=reread)
        if memory is not None and not isinstance(memory, EpisodicMemory):
            raise TypeError(f"memory must be an EpisodicMemory (engine.new_memory()) or None, got "
                            f"{type(memory).__name__} {memory!r}.")
        return converse(self, self._request(prompt, settings, tools, progress), OwnMemory(self, memory))

    def generate(self, prompt: Prompt, **kwargs: Any) -> GenerationResult:
        stream = self.stream(prompt, **kwargs)
        for _ in stream:
            pass
        return stream.result

    def chat(self, messages: Sequence[Message], **kwargs: Any) -> GenerationResult:
        return self.generate(list(messages), **kwargs)

    # ------------------------------------------------------------------ inspection
    def inspect(self, text: str, *, progress: bool = False) -> Inspection:
        """Surprise per token and event boundaries for a text (read into a throwaway memory)."""
        memory = self.new_memory()
        memory.track_surprise = True
        try:
            self.read(memory, text, progress=progress)
            window = memory.layers[0].length
            none = torch.empty(0, dtype=torch.long)
            provisional = memory.segment(window) + memory.local_start if window else none
            # The window's first token opens an event once events were evicted before it (segment() lists only
            # starts inside the window, after its first token).
            window_start = torch.tensor([memory.local_start]) if window and memory.num_events else none
            starts = torch.cat([memory.event_boundaries(), window_start, provisional])
            tokens = self.tokenizer.convert_ids_to_tokens(memory.token_ids)
            return Inspection(tokens=tokens, surprise=memory.surprise.clone(), event_starts=starts,
                              stats=memory.stats())
        finally:
            memory.close()


