"""The engine: a causal LM whose attention has an episodic memory, read in chunks and generating token by token.

    engine = EMEngine.from_pretrained()                 # embedded Qwen2.5-Coder-0.5B-Instruct, DEFAULT_PRESET
    memory = engine.new_memory()
    result = engine.chat([{"role": "user", "content": book + "\\n\\nWho wrote the letter?"}], memory=memory)
    result = engine.chat(messages + [answer, follow_up], memory=memory)   # reads only the new tokens

One engine holds the model; each conversation has its own EpisodicMemory, so many conversations can share one
loaded model. A memory remembers the exact token ids it has read: a prompt that extends them is read from where
the memory stopped (continuation), anything else is refused rather than silently mixed.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import time
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Union

import torch
from tqdm.auto import tqdm

from . import attention, persistence
from .config import DEFAULT_PRESET, EMConfig
from .lossless import LosslessCheck
from .batching import StepBatcher, release_thread_workers, row_block
from .forward import layer_attention
from .memory import EpisodicMemory, ModelShape, RetrievedEvent, because
from .models import prepare_loaded
from .grammar import Grammar, GrammarCompiler
from .scoring import RetrievalPlan, uses_event_text
from .tools import CALL_CLOSE, CALL_OPEN, plain_tool_messages, template_carries_tools
from .rope import RotaryTable

Message = dict[str, Any]  # {'role', 'content'}, and 'tool_calls' / 'name' / 'tool_call_id' for tools
Prompt = Union[str, Sequence[Message], Sequence[int], "EncodedPrompt"]  # EncodedPrompt: encode_prompt()'s result


class Rendered(NamedTuple):
    """A prompt as text, tiled by character spans (start, end, is_user_text): user text is tokenised as text,
    the chat template's own spans with its control tokens."""
    text: str
    pieces: tuple[tuple[int, int, bool], ...]

    @classmethod
    def user_text(cls, text: str) -> "Rendered":
        return cls(text, ((0, len(text), True),))


class EncodedPrompt(NamedTuple):
    """A prompt tokenised once (EMEngine.encode_prompt), accepted wherever a prompt is: a document of a million
    tokens is then not tokenised again for its question (the tokenizer's transient there is ~420 MB)."""
    ids: list[int]
    question_start: int | None  # token index where the prompt's last paragraph begins; None: ids, or no paragraphs

    def checked(self) -> "EncodedPrompt":
        if not isinstance(self.ids, list) or not self.ids or not all(isinstance(i, int) for i in self.ids):
            raise TypeError("An EncodedPrompt's ids are a non-empty list of token ids: make it with "
                            "EMEngine.encode_prompt(prompt).")
        if self.question_start is not None and not 0 < self.question_start < len(self.ids):
            raise ValueError(f"An EncodedPrompt's question_start ({self.question_start}) must fall inside its "
                             f"{len(self.ids)} ids, or be None: make it with EMEngine.encode_prompt(prompt).")
        return self


class Decoding(NamedTuple):
    """How one answer is decoded (checked by check_sampling and GrammarCompiler.check before it is used)."""
    max_new_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    stop: list[str]
    grammar: Grammar | None = None
    allow_empty: bool = True
    keep: int | None = None  # the prompt's first tokens to keep in attention (its tool listing)
    attribute: bool = False  # record where the answer's attention went (GenerationResult.attention)


class MemoryMismatchError(ValueError):
    """The prompt does not extend what the memory has read; continuing would mix two conversations."""


@dataclass
class GenerationResult:
    text: str
    finish_reason: str              # "stop" (end of turn or a stop string) or "length"
    input_tokens: int               # prompt tokens, including those the memory had already read
    output_tokens: int              # tokens generated (what the tokenizer counts for `text` plus any stop)
    new_input_tokens: int           # prompt tokens actually read by this call
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    token_ids: list[int] = field(default_factory=list)
    retrieved_events: list[RetrievedEvent] = field(default_factory=list)  # memory in attention as the answer began
    # [positions] with stream(attribute=True): the attention the generated tokens gave each absolute position of the
    # prompt and answer (local window, sinks, retrieved events), summed over tokens, layers and heads
    attention: torch.Tensor | None = None


@dataclass
class Inspection:
    tokens: list[str]
    surprise: torch.Tensor          # [n] float32, NaN for the first token
    event_starts: torch.Tensor      # [events] absolute start positions (sinks are tokens [0, n_init))
    stats: dict[str, Any]


class TextStream:
    """An iterator of text deltas; ``result`` holds the GenerationResult once it is exhausted."""

    def __init__(self, deltas: Iterator[str], holder: dict):
        self._deltas, self._holder = deltas, holder

    def __iter__(self) -> Iterator[str]:
        return self._deltas

    def __next__(self) -> str:
        return next(self._deltas)

    @property
    def result(self) -> GenerationResult:
        if "result" not in self._holder:
            raise RuntimeError("The stream has not finished yet: iterate it to the end first.")
        return self._holder["result"]


class EMEngine:
    def __init__(self, model: torch.nn.Module, tokenizer: Any, config: EMConfig | None = None, *,
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
        self.layer_devices = [next(layer.parameters()).device for layer in model.model.layers]
        table_size = self.config.rope_positions() if self.config.attention == "episodic" else self.shape.max_positions
        self._rotary = rotary
        self._ropes = {d: RotaryTable.from_rotary_module(rotary, table_size, self.shape.dtype, d)
                       for d in dict.fromkeys(self.layer_devices)}
        attention.install(model, layer_attention)
        self.input_device = model.get_input_embeddings().weight.device
        self.store_device = self.layer_devices[0]
        self.eos_ids = _end_of_turn_ids(model, tokenizer)
        self._lossless = LosslessCheck(tokenizer)
        self._controls: re.Pattern | None = None  # finds the tokenizer's control-token strings
        self._memories: "weakref.WeakSet[EpisodicMemory]" = weakref.WeakSet()
        self.grammars = GrammarCompiler(tokenizer, model.config.vocab_size, self.eos_ids)  # llguidance, on first use
        self.batcher = StepBatcher(self._step)  # concurrent generations decode their tokens in one forward
        self._row_block: int | None | bool = False  # batching.row_block, probed at the first decoding step
        release_thread_workers()  # the load's idle OpenMP workers would slow other threads' forwards (batching.py)

    @classmethod
    def from_pretrained(cls, model: str | None = None, *, preset: str | None = None, config: EMConfig | None = None,
                        dtype: torch.dtype | str = "auto", device: str | None = None,
                        device_map: str | dict | None = None, revision: str | None = None,
                        token: str | bool | None = None, progress: bool = True, **overrides: Any) -> "EMEngine":
        """Load a model and give it an episodic memory: None = the embedded default, an embedded name, a local
        directory, or a hub id (huggingface_hub's cache; ``revision`` and ``token`` as in transformers). A model
        already loaded goes straight to ``EMEngine(model, tokenizer, config)``.

        ``preset`` is one of S, SM, SC, S+C, SM+C, F, FM, FC, full; any EMConfig field can be overridden by name.
        """
        from .models import DEFAULT_MODEL, load_model

        if config is None and (preset is not None or overrides):  # None of both: the default, checked on use
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
            memory.text_embedder = self._event_text_embedder(config.event_embedding)
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

    def save_memory(self, memory: EpisodicMemory, path: "str | os.PathLike", metadata: dict | None = None) -> Any:
        """Write a memory to a directory atomically (safetensors + a checked manifest); see persistence.py."""
        return persistence.save_memory(memory, path, engine=self, metadata=metadata)

    def load_memory(self, path: "str | os.PathLike", config: EMConfig | None = None) -> EpisodicMemory:
        """A memory saved by save_memory, verified (version, model, shapes, checksums) before anything is used."""
        memory = persistence.load_memory(path, self, config=config)
        memory.on_fork = self._memories.add
        self._memories.add(memory)
        return memory

    def close(self) -> None:
        """Close every memory this engine made (their disk pages are removed)."""
        for memory in list(self._memories):
            memory.close()

    # ------------------------------------------------------------------ text <-> tokens
    # Text is text: a control-token string inside it ("<|im_end|>", "<|im_start|>system") is read as those
    # characters, never as the control token, so a document, a question or a message cannot forge a chat turn.
    # Control tokens come only from the chat template, where it puts them, or from token ids the caller passes.
    def tokenize(self, text: str) -> list[int]:
        _check_text(text)
        return self._refuse_lost_text(text, self.text_ids(text))

    def text_ids(self, text: str) -> list[int]:
        """The text's token ids, control-token strings kept as text, without tokenize()'s checks (for counting)."""
        return list(self.tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"])

    def tokenize_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """tokenize() plus each token's character span in the text (needs a fast tokenizer), for mapping
        retrieved tokens back to the documents they came from."""
        _check_text(text)
        encoded = self.tokenizer(text, add_special_tokens=False, split_special_tokens=True,
                                 return_offsets_mapping=True)
        ids = self._refuse_lost_text(text, list(encoded["input_ids"]))
        return ids, [tuple(span) for span in encoded["offset_mapping"]]

    def template_ids(self, text: str) -> list[int]:
        """Ids of text a chat template wrote (its control-token strings become control tokens); never user text."""
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def _refuse_lost_text(self, text: str, ids: list[int]) -> list[int]:
        """The ids, if they represent the text; else a ValueError naming the characters the tokenizer lacks."""
        if not ids:  # a tokenizer without a token for these characters drops them
            raise ValueError(f"The text {text[:40]!r} gives no tokens: this model's tokenizer cannot represent its "
                             "characters. Remove or replace them.")
        self._lossless.check(text, ids)
        return ids

    def chat_ids(self, messages: Sequence[Message], add_generation_prompt: bool = True,
                 tools: list[dict] | None = None) -> list[int]:
        """Token ids of a conversation in the model's chat template (consecutive same-role turns merged), with
        ``tools`` (OpenAI function dicts) listed as the template lists them, or by tools.TOOL_PROMPT."""
        rendered = self._render_chat(normalize_messages(messages, merge=False), add_generation_prompt, tools)
        return self._rendered_ids(rendered)

    def _render_chat(self, messages: list[Message], add_generation_prompt: bool,
                     tools: list[dict] | None = None) -> Rendered:
        """The conversation as text, and which of its characters are the messages' (tokenised as text) and which
        the template's (whose control-token strings are control tokens)."""
        if tools or any(m["role"] == "tool" or m.get("tool_calls") for m in messages):
            if not template_carries_tools(self.tokenizer):
                messages, tools = plain_tool_messages(messages, tools), None
        if getattr(self.tokenizer, "chat_template", None) is None:
            text = "".join(f"{m['role']}: {m['content']}\n" for m in messages) + ("assistant: " * add_generation_prompt)
            return Rendered.user_text(text)  # no control tokens at all
        # Render the turns as given (so a longer conversation extends a shorter one token for token); only a
        # template that rejects them (consecutive same-role turns, a system turn) gets them merged.
        try:
            text = self._apply_template(messages, add_generation_prompt, tools)
        except Exception:  # jinja2 raises TemplateError subclasses via the template's raise_exception
            messages = normalize_messages(fold_system(messages))
            text = self._apply_template(messages, add_generation_prompt, tools)
        found = (self._control_pattern().search(m["content"]) for m in messages)
        forged = next((match.group() for match in found if match), None)
        if forged is None:  # the usual case: every control-token string in the text is the template's
            return Rendered(text, ((0, len(text), False),))
        return Rendered(text, self._message_spans(messages, add_generation_prompt, text, forged, tools))

    def _message_spans(self, messages: list[Message], add_generation_prompt: bool, text: str,
                       forged: str, tools: list[dict] | None) -> tuple[tuple[int, int, bool], ...]:
        """Where each message's text lies in the rendered conversation, found by rendering the template around
        placeholders: the placeholders' places are the messages' places if putting the messages back (as given,
        or stripped by a template that trims them) gives the same text."""
        slots = [f"\ue000{i}\ue001" for i in range(len(messages))]
        framed = re.split("\ue000(\\d+)\ue001", self._apply_template(
            [{**m, "content": slot} for m, slot in zip(messages, slots)], add_generation_prompt, tools))
        for contents in ([m["content"] for m in messages], [m["content"].strip() for m in messages]):
            parts = [(contents[int(p)] if k % 2 else p, bool(k % 2)) for k, p in enumerate(framed)]
            if "".join(part for part, _ in parts) == text:
                ends = list(itertools.accumulate(len(part) for part, _ in parts))
                return tuple((end - len(part), end, own) for (part, own), end in zip(parts, ends) if part)
        raise ValueError(f"A message holds {forged!r}, a control token of this model, and this model's chat template "
                         "changes message text, so it cannot be kept as text: remove it from the message.")

    def _control_strings(self) -> list[str]:
        """The strings the tokenizer turns into control tokens (its special added tokens)."""
        added = getattr(self.tokenizer, "added_tokens_decoder", {}) or {}
        return [token.content for token in added.values() if getattr(token, "special", False)]

    def _control_pattern(self) -> re.Pattern:
        """Finds the first control-token string in a text (compiled once: a book's messages are searched whole)."""
        if self._controls is None:
            strings = sorted(self._control_strings(), key=len, reverse=True)  # the longest match wins, as in tokenizers
            self._controls = re.compile("|".join(map(re.escape, strings)) or "(?!)")
        return self._controls

    def _rendered_ids(self, rendered: Rendered, start: int = 0) -> list[int]:
        """Token ids of rendered.text[start:], each span tokenised as what it is (checked to lose nothing)."""
        if start == 0:
            _check_text(rendered.text)
        ids = [i for lo, hi, own in rendered.pieces if hi > start
               for i in (self.text_ids if own else self.template_ids)(rendered.text[max(lo, start):hi])]
        return self._refuse_lost_text(rendered.text[start:], ids) if start == 0 else ids

    def _apply_template(self, messages: list[Message], add_generation_prompt: bool,
                        tools: list[dict] | None = None) -> str:
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                  tokenize=False, **({"tools": tools} if tools else {}))

    def prompt_ids(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenize(prompt)
        if isinstance(prompt, EncodedPrompt):
            return list(prompt.checked().ids)
        _refuse_bytes(prompt)
        if isinstance(prompt, dict) or not isinstance(prompt, Iterable):
            raise TypeError("A prompt is a string, a list of {'role', 'content'} messages, or a list of token ids; "
                            f"got {type(prompt).__name__}.")
        prompt = list(prompt)
        if not prompt:
            raise ValueError("The prompt is empty: pass text, a non-empty list of messages, or token ids.")
        if all(isinstance(p, int) for p in prompt):
            return prompt
        if all(isinstance(p, dict) for p in prompt):
            return self.chat_ids(prompt)
        raise TypeError("A prompt is a string, a list of {'role', 'content'} messages, or a list of token ids; "
                        f"got a list of {sorted({type(p).__name__ for p in prompt})}.")

    def encode_prompt(self, prompt: Prompt, tools: list[dict] | None = None) -> EncodedPrompt:
        """prompt_ids() and where the question starts: the prompt's last paragraph, i.e. the text after its last
        blank line, or the last message if that starts later. read() gives it forwards of its own. Token ids carry
        no paragraphs: their question_start is None. An EncodedPrompt is returned as it is (checked)."""
        if isinstance(prompt, EncodedPrompt):
            if tools:
                raise ValueError("Tools are listed in a chat: pass the prompt as a list of messages, not an "
                                 "EncodedPrompt.")
            return prompt.checked()
        if isinstance(prompt, str):
            ids = self.tokenize(prompt)
            return EncodedPrompt(ids, self._token_at(Rendered.user_text(prompt), ids, _last_paragraph(prompt, 0)))
        if isinstance(prompt, Iterable) and not isinstance(prompt, (bytes, bytearray, dict)):
            prompt = list(prompt)  # a generator is walked once, here
        if not (isinstance(prompt, list) and prompt and all(isinstance(p, dict) for p in prompt)):
            if tools:
                raise ValueError("Tools are listed in a chat: pass the prompt as a list of messages, not text or ids.")
            return EncodedPrompt(self.prompt_ids(prompt), None)  # token ids, or refused there with the reason
        messages = normalize_messages(prompt, merge=False)
        rendered = self._render_chat(messages, True, tools)
        ids = self._rendered_ids(rendered)  # = chat_ids(prompt, tools=tools), rendered once
        try:
            before = self._render_chat(messages[:-1], False, tools).text if len(messages) > 1 else ""
        except Exception:  # a template that refuses the shorter conversation (e.g. one ending on a system turn)
            before = rendered.text + "\0"
        last_turn = len(before) if rendered.text.startswith(before) else 0  # a template that merged turns: 0
        return EncodedPrompt(ids, self._token_at(rendered, ids, _last_paragraph(rendered.text, last_turn)))

    def _token_at(self, rendered: Rendered, ids: list[int], char: int) -> int | None:
        """The index of the token where the text from char on begins (None at the very start: nothing to split
        off). Only the tail is tokenised again (a follow-up turn must not pay for re-tokenising a book); where its
        first token differs from the whole text's (a merge across the cut, a leading-space marker) the split moves
        to the first token both share."""
        if char == 0:
            return None
        tail = self._rendered_ids(rendered, char)
        start = len(ids) - _common_prefix(ids[max(0, len(ids) - len(tail)):][::-1], tail[::-1])
        return start if 0 < start < len(ids) else None

    def tool_listing_end(self, prompt: Prompt, tools: list[dict] | None) -> int | None:
        """How many of the prompt's first tokens list the tools (the template's opening system turn, up to the
        first other message), or None without tools. The engine keeps them in attention (pin_prefix): evicted
        like any text, a long conversation's tool list would be retrieved only when a question resembles it
        (measured: with a 512-token window Qwen2.5-Coder-1.5B answered a tool task in prose, calling nothing)."""
        if not tools or not isinstance(prompt, list) or not all(isinstance(m, dict) for m in prompt):
            return None
        system = [m for m in normalize_messages(prompt, merge=False)[:1] if m["role"] == "system"]
        marker = "\ue000"
        rendered = self._render_chat([*system, {"role": "user", "content": marker}], False, tools).text
        return max(len(self.template_ids(rendered[:rendered.index(marker)])) - 1, 0) or None

    def pin_prefix(self, memory: EpisodicMemory, ids: list[int], end: int | None) -> None:
        """Read the prompt's first ``end`` tokens (if not read yet) and keep them in every layer's attention; a
        prefix longer than the retrieval budget is left to retrieval (pinning it would crowd out everything), with
        a warning that says so: the model may then not see a tool when the question does not resemble it."""
        if end is None or end <= memory.config.n_init or (0, end) in memory.pinned_spans:
            return
        if memory.total_tokens < end:
            self.read(memory, ids[memory.total_tokens:end])
        try:
            memory.pin(0, end)
        except ValueError as error:
            warnings.warn(f"The tool listing ({end} tokens) is not kept in attention, it is left to retrieval: "
                          f"{error}", stacklevel=2)

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

    def count_tokens(self, text: str) -> int:
        return len(self.text_ids(text))

    # ------------------------------------------------------------------ reading
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
        chunk = memory.config.chunk_size
        question = len(tokens) if question_start is None else min(max(question_start - memory.total_tokens, 0),
                                                                      len(tokens))
        memory.begin_answer()  # these tokens are a new prompt: its question must not inherit the last answer's ranking
        memory.ask(tokens[question:].tolist())
        starts = [*range(0, question, chunk), *range(question, len(tokens), chunk)]
        with tqdm(total=len(tokens), unit="tok", desc="reading into memory", disable=not progress,
                  dynamic_ncols=True) as bar:
            for start, end in zip(starts, [*starts[1:], len(tokens)]):
                piece = tokens[start:end]
                self._forward(memory, piece, retrieve=True, answering=end > question)
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
        _refuse_bytes(ids)
        if isinstance(ids, dict) or not isinstance(ids, Iterable):
            raise TypeError(f"Expected text (str) or a list of token ids, got {type(ids).__name__}.")
        ids = list(ids)
        if not set(map(type, ids)) <= {int}:  # one C-level pass; bool is refused too (type(True) is bool)
            position = next(i for i, token in enumerate(ids) if type(token) is not int)
            raise TypeError(f"Token ids are integers; position {position} holds {ids[position]!r} "
                            f"({type(ids[position]).__name__}).")
        vocab = self.model.get_input_embeddings().num_embeddings
        if ids and not (0 <= min(ids) and max(ids) < vocab):
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
            # At most max_position() tokens stay in the window, so at least the rest is evicted into sealed pages;
            # those beyond the RAM (and device) budgets must go to disk.
            evicted = memory.total_tokens + n - memory.config.max_position()
            sealed = max(0, evicted) // memory.store.page_tokens
            memory.store.check_disk_budget(memory.store.pages_beyond_memory(sealed))

    def _forward(self, memory: EpisodicMemory, ids: torch.Tensor, retrieve: bool,
                 answering: bool = False) -> torch.Tensor:
        """Read ids [q] into the memory; returns the logits [q or 1, vocab]."""
        plan = RetrievalPlan(retrieve=retrieve, answering=answering,
                             text_scores=memory.text_scores() if answering and retrieve else None)
        # Surprise needs every position's log-probabilities; without it only the last position's logits are
        # computed (the LM head over a 50K-150K vocabulary is a real share of a chunk's cost).
        return self._forward_rows([memory], ids[None], [plan], keep=0 if memory.track_surprise else 1)[0]

    def _step(self, memories: list[EpisodicMemory], tokens: list[int]) -> None:
        """One decoding step of one or more conversations as one forward (the StepBatcher calls it): each token is
        fed to its own memory, whose last_logits then predict the next. The weights are read once for all rows,
        padded to the row block so each row's result does not depend on the batch (emllm.batching)."""
        if self._row_block is False:
            self._row_block = row_block(self.model)
            self.batcher.max_rows = 1 if self._row_block is None else self.batcher.max_rows
        if self._row_block is None and len(memories) > 1:  # no batch-invariant row count: one forward each
            for memory, token in zip(memories, tokens):
                self._step([memory], [token])
            return
        block = self._row_block or 1
        padding = -len(memories) % block
        plans = [RetrievalPlan(retrieve=True, answering=True, text_scores=memory.text_scores()) for memory in memories]
        self._forward_rows(memories + [None] * padding, torch.tensor(tokens + tokens[:1] * padding)[:, None],
                           plans, keep=1)

    def _forward_rows(self, memories: list[EpisodicMemory], ids: torch.Tensor, plans: list[RetrievalPlan],
                      keep: int) -> torch.Tensor:
        """ids [rows, q], row i read into memories[i] under plans[i] (a None memory is a padding row: it attends to
        nothing and its logits are dropped); returns the logits [rows, q or keep, vocab]."""
        real = [memory for memory in memories if memory is not None]
        for memory, plan in zip(real, plans):
            memory.begin_forward(plan)
        try:
            with torch.inference_mode():
                out = self.model(input_ids=ids.to(self.input_device), use_cache=False, logits_to_keep=keep,
                                 emllm_memory=memories if len(memories) > 1 else memories[0])
                for row, memory in enumerate(real):  # real rows come first
                    memory.observe(ids[row], out.logits[row])
                    if memory.evict():
                        memory.embed_events()  # each event's text is embedded once, when it leaves the window
        except BaseException as error:
            # The layers may have taken the chunk's keys and some of its events, the rest not: such a memory would
            # answer from a state no input produces, so it is closed rather than left half-updated.
            shared = f" (one forward with {len(real) - 1} other conversations)" if len(real) > 1 else ""
            for memory in real:
                memory.close(f"a forward pass{shared} failed part-way with {type(error).__name__}: {error}")
            raise
        return out.logits

    # ------------------------------------------------------------------ generating
    def stream(self, prompt: Prompt, *, memory: EpisodicMemory | None = None, max_new_tokens: int = 256,
               temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0, seed: int | None = None,
               stop: Sequence[str] | None = None, progress: bool = False, tools: list[dict] | None = None,
               grammar: Grammar | None = None, allow_empty: bool = True, attribute: bool = False) -> TextStream:
        """Generate from a prompt, yielding text deltas. With ``memory``, the prompt must extend what it has read.

        ``tools`` (OpenAI function dicts) are listed in the chat (emllm.tools); ``grammar`` constrains what is
        generated (emllm.grammar: a JSON schema, tool calls), checked before anything is read; ``allow_empty=False``
        keeps the end of turn away until the answer has a visible character; ``attribute=True`` records where the
        answer's attention went (GenerationResult.attention: what sources are credited from)."""
        check_sampling(max_new_tokens, temperature, top_p, top_k, seed=seed, stop=stop)
        if memory is not None and not isinstance(memory, EpisodicMemory):
            raise TypeError(f"memory must be an EpisodicMemory (engine.new_memory()) or None, got "
                            f"{type(memory).__name__} {memory!r}.")
        if grammar is not None:
            self.grammars.check(grammar)
        stop = list(stop or [])
        ids, question_start = self.encode_prompt(prompt, tools)
        own_memory = memory is None
        memory = memory if memory is not None else self.new_memory()
        holder: dict = {}
        decoding = Decoding(max_new_tokens, temperature, top_p, top_k, seed, stop, grammar, allow_empty,
                            self.tool_listing_end(prompt, tools), attribute)
        return TextStream(self._run(memory, ids, question_start, own_memory, decoding, progress, holder), holder)

    def generate(self, prompt: Prompt, **kwargs: Any) -> GenerationResult:
        stream = self.stream(prompt, **kwargs)
        for _ in stream:
            pass
        return stream.result

    def chat(self, messages: Sequence[Message], **kwargs: Any) -> GenerationResult:
        return self.generate(list(messages), **kwargs)

    def _run(self, memory: EpisodicMemory, ids: list[int], question_start: int | None, own_memory: bool,
             decoding: "Decoding", progress: bool, holder: dict) -> Iterator[str]:
        try:
            seen = memory.total_tokens
            if memory.token_ids != ids[:seen] or (seen == len(ids) and memory.last_logits is None):
                raise MemoryMismatchError(
                    f"The prompt ({len(ids)} tokens) does not extend the {seen} tokens this memory has read "
                    f"(they first differ at token {_common_prefix(memory.token_ids, ids)}). Use a new memory "
                    "for a different conversation.")
            started = time.perf_counter()
            self.pin_prefix(memory, ids, decoding.keep)
            self.read_prompt(memory, ids, question_start, progress=progress)
            prefill = time.perf_counter() - started
            retrieved = memory.retrieved_events()
            generator = torch.Generator(device="cpu").manual_seed(decoding.seed) if decoding.seed is not None else None
            constraint = self.grammars.constraint(decoding.grammar) if decoding.grammar is not None else None
            stop = decoding.stop
            if decoding.attribute:
                memory.attribution = torch.zeros(len(ids) + decoding.max_new_tokens)
            generated: list[int] = []
            emitted, text, finish = "", "", "length"
            started = time.perf_counter()
            with self.batcher.decoding():  # concurrent generations' steps wait briefly for this one's
                for step in range(decoding.max_new_tokens):
                    logits = memory.last_logits
                    if constraint is not None:
                        logits = constraint.mask(logits)
                    if not decoding.allow_empty and not text.strip():
                        held = logits.clone()
                        held[sorted(self.eos_ids)] = float("-inf")
                        logits = held if torch.isfinite(held).any() else logits  # a grammar may allow only the end
                    token = sample_token(logits, decoding.temperature, decoding.top_p, decoding.top_k, generator)
                    if token in self.eos_ids:
                        finish = "stop"
                        generated.append(token)
                        break
                    if constraint is not None:
                        constraint.advance(token)
                    generated.append(token)
                    text = self.tokenizer.decode(generated, skip_special_tokens=True)
                    cut = _find_stop(text, stop, len(emitted))
                    if cut is not None:
                        if cut > len(emitted):
                            yield text[len(emitted):cut]
                        emitted, finish = text[:cut], "stop"
                        break
                    done = constraint is not None and constraint.finished
                    safe = len(text) if done else _safe_length(text, stop)
                    if safe > len(emitted):
                        yield text[len(emitted):safe]
                        emitted = text[:safe]
                    if done:  # the grammar is complete and allows nothing more
                        finish = "stop"
                        break
                    if step + 1 < decoding.max_new_tokens:
                        self.batcher.step(memory, token)
                else:
                    text = self.tokenizer.decode(generated, skip_special_tokens=True)
                    if len(text) > len(emitted):
                        yield text[len(emitted):]
                    emitted = text
            holder["result"] = GenerationResult(
                text=emitted, finish_reason=finish, input_tokens=len(ids), output_tokens=len(generated),
                new_input_tokens=len(ids) - seen, prefill_seconds=prefill,
                decode_seconds=time.perf_counter() - started, token_ids=generated, retrieved_events=retrieved,
                attention=memory.attribution)
        finally:
            memory.attribution = None
            if own_memory:
                memory.close()

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


# ---------------------------------------------------------------------- helpers
def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading token ids two sequences share: where they first differ, or the shorter length."""
    n = min(len(a), len(b))
    differs = (torch.tensor(a[:n], dtype=torch.long) != torch.tensor(b[:n], dtype=torch.long)).nonzero()
    return int(differs[0]) if len(differs) else n


def _last_paragraph(text: str, last_turn: int) -> int:
    """Where the last paragraph of text begins: after its last blank line (trailing whitespace ignored), or at
    last_turn (the last message's start in a rendered chat) if that is later; 0 when it has neither."""
    blank = text.rstrip().rfind("\n\n")
    return max(blank + 2 if blank >= 0 else 0, last_turn)


def sample_token(logits: torch.Tensor, temperature: float, top_p: float, top_k: int,
                 generator: torch.Generator | None) -> int:
    """Greedy when temperature is 0; otherwise temperature, then top-k, then nucleus (top-p) sampling."""
    if temperature <= 0:
        return int(torch.argmax(logits))
    # In float64 from the best logit down: a temperature near zero (1e-195) then gives -inf to every other token
    # and 0 to the best, where float32 would overflow to inf - inf = nan.
    logits = logits.detach().double().cpu()
    logits = (logits - logits.max()) / temperature
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        outside = torch.cumsum(probs, dim=-1) - probs > top_p  # keep the smallest set reaching top_p
        logits = logits.masked_fill(torch.zeros_like(outside).scatter(0, order, outside), float("-inf"))
    return int(torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator))


def fold_system(messages: list[Message]) -> list[Message]:
    """System turns become part of the next user turn, for templates without a system role."""
    folded: list[Message] = []
    pending: list[str] = []
    for message in messages:
        if message["role"] == "system":
            pending.append(message["content"])
        elif message["role"] == "user" and pending:
            folded.append({"role": "user", "content": "\n\n".join(pending + [message["content"]])})
            pending = []
        else:
            folded.append(message)
    if pending:
        folded.append({"role": "user", "content": "\n\n".join(pending)})
    return folded


def normalize_messages(messages: Sequence[Message], merge: bool = True) -> list[Message]:
    """Validated {'role', 'content'} messages (a tool result is role 'tool'; an assistant turn may carry
    'tool_calls'); with merge, consecutive same-role plain turns become one."""
    merged: list[Message] = []
    for message in messages:
        if not isinstance(message, dict) or "role" not in message or "content" not in message:
            raise TypeError(f"A chat message is a dict with 'role' and 'content', got {message!r}.")
        role, content = message["role"], message["content"]
        if not isinstance(content, str):
            raise TypeError(f"Message content must be text, got {type(content).__name__} for role {role!r}.")
        _check_encodable(content)
        if role not in ("system", "user", "assistant", "tool"):
            raise ValueError(f"Unknown message role {role!r}; use 'system', 'user', 'assistant' or 'tool'.")
        if message.get("tool_calls"):
            _check_tool_calls(role, message["tool_calls"])
        plain = role != "tool" and not message.get("tool_calls")
        previous = merged[-1] if merged else None
        if merge and plain and previous is not None and previous["role"] == role and not previous.get("tool_calls"):
            merged[-1] = {**previous, "content": previous["content"] + "\n\n" + content}
        else:
            merged.append({key: message[key] for key in _MESSAGE_KEYS if key in message})
    if not merged:
        raise ValueError("The conversation is empty: pass at least one message.")
    if not any(m["content"].strip() or m.get("tool_calls") for m in merged):
        raise ValueError("Every message is empty or whitespace: there is nothing to answer.")
    return merged


_MESSAGE_KEYS = ("role", "content", "tool_calls", "tool_call_id")  # other keys are not passed to the template


def _check_tool_calls(role: str, calls: Any) -> None:
    """An assistant's tool calls as chat templates read them: [{"type": "function", "function": {"name": str,
    "arguments": dict}}, ...]."""
    if role != "assistant":
        raise ValueError(f"Only assistant messages carry tool_calls, not a {role!r} message.")
    for call in calls if isinstance(calls, list) else [calls]:
        function = call.get("function") if isinstance(call, dict) else None
        if not (isinstance(function, dict) and isinstance(function.get("name"), str)
                and isinstance(function.get("arguments"), dict)):
            raise TypeError("A tool call is {'type': 'function', 'function': {'name': str, 'arguments': dict}}, got "
                            f"{call!r}.")


def _end_of_turn_ids(model: torch.nn.Module, tokenizer: Any) -> set[int]:
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), model.config, tokenizer):
        value = getattr(source, "eos_token_id", None)
        if value is not None:
            ids.update(value if isinstance(value, (list, tuple, set)) else [value])
    for token in ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end|>"):
        token_id = tokenizer.convert_tokens_to_ids(token) if token in tokenizer.get_vocab() else None
        if token_id is not None:
            ids.add(token_id)
    return ids


def _check_text(text: Any) -> None:
    _refuse_bytes(text)
    if not isinstance(text, str):
        raise TypeError(f"Expected text (str), got {type(text).__name__}.")
    if not text.strip():
        raise ValueError("The input text is empty or only whitespace: give the model something to read.")
    _check_encodable(text)


def _check_encodable(text: str) -> None:
    """A lone surrogate (e.g. from decoding with errors='surrogateescape') is not text any tokenizer can encode."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise ValueError(f"The text holds {text[error.start]!r} at index {error.start}, a lone surrogate that is not "
                         "valid Unicode: decode the source bytes with errors='replace' (or remove it).") from None


def _refuse_bytes(value: Any) -> None:
    """Bytes iterate as small integers, so they would be read as token ids: refuse them with the fix."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        raise TypeError(f"Got {type(value).__name__}, not text or token ids: decode it first, e.g. "
                        "data.decode('utf-8', errors='replace').")


def check_sampling(max_new_tokens: int, temperature: float, top_p: float, top_k: int, *, seed: Any = None,
                   stop: Any = None, length_name: str = "max_new_tokens") -> None:
    """Refuse bad sampling settings before any reading; adapters pass their own name for the length
    (LangChain and LlamaIndex call it max_tokens) so the message names what the user typed. A lone string as
    ``stop`` is refused: iterated, it would stop at any of its characters."""
    if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 1:
        raise ValueError(f"{length_name} must be a positive integer (the most tokens to generate), "
                         f"got {max_new_tokens!r}.")
    if not isinstance(temperature, (int, float)) or not temperature >= 0 or temperature == float("inf"):
        raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {temperature!r}.")
    if not isinstance(top_p, (int, float)) or not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p!r}.")
    if not isinstance(top_k, int) or isinstance(top_k, bool) or top_k < 0:
        raise ValueError(f"top_k must be an integer >= 0 (0 = off), got {top_k!r}.")
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 2 ** 64):
        raise ValueError(f"seed must be None or an integer in [0, 2**64), got {seed!r}.")
    if stop is None:
        return
    # A dict would stop at its keys; an iterator would be used up by this check and leave no stops.
    if isinstance(stop, (str, bytes, Mapping, Iterator)) or not isinstance(stop, Iterable):
        raise TypeError(f"stop must be a list of strings, e.g. stop=[{stop!r}], got {type(stop).__name__} {stop!r}.")
    bad = [s for s in stop if not isinstance(s, str) or not s]
    if bad:
        raise TypeError(f"stop must hold non-empty strings only; got {bad!r} in {list(stop)!r}.")


def _find_stop(text: str, stop: list[str], emitted: int) -> int | None:
    """Earliest position of any stop string that ends after what was already emitted."""
    hits = [i for s in stop if (i := text.find(s, max(0, emitted - len(s) + 1))) != -1]
    return min(hits) if hits else None


def _safe_length(text: str, stop: list[str]) -> int:
    """How much text can be emitted: hold back a trailing partial character or a possible stop-string start."""
    end = len(text)
    while end and text[end - 1] == "\ufffd":
        end -= 1
    holdback = 0
    for s in stop:
        for k in range(min(len(s) - 1, end), holdback, -1):
            if text[:end].endswith(s[:k]):
                holdback = k
                break
    return end - holdback
