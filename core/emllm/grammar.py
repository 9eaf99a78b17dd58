"""Constrained decoding: the tokens a grammar allows next, so a JSON answer or a tool call always parses.

A Grammar is text in llguidance's Lark dialect (JSON schemas embedded with ``%json``); the engine turns it into a
``GrammarConstraint`` per generation, which masks the logits before each sampled token and follows the tokens
taken. llguidance (Microsoft's Rust engine behind Guidance) was chosen over xgrammar, outlines-core and
lm-format-enforcer, measured on this 2-core CPU with Qwen2.5's 151,936-token vocabulary (docs/notes/
constrained-decoding.md): 0.2-0.8 ms per token mask, 2 ms to compile a schema, and a schema keyword it cannot
enforce (``not``) is refused with its name, where xgrammar accepted ``not`` and ignored it; lm-format-enforcer does not
import with transformers 5 and outlines-core needs a decoded-bytes vocabulary built by hand.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from typing import Any

import torch

from .tools import check_tools

#: JSON as ``json.dumps`` writes it (", " and ": ", no other whitespace): what chat models were trained on, and no
#: room for a small model to loop on blank space inside an object.
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarError(ValueError):
    """A schema or grammar that the constrained decoder cannot enforce; raised before anything is read."""


@dataclass(frozen=True)
class Grammar:
    """What generated text must match: llguidance Lark source. Build with ``json_schema`` or ``tool_calls``."""
    lark: str
    what: str  # for error messages: "the JSON schema 'Joke'", "the tool calls"

    @classmethod
    def json_schema(cls, schema: dict[str, Any], name: str = "response") -> Grammar:
        """The answer is one JSON value valid for ``schema`` (a dict), written compactly."""
        _check_schema(schema, name)
        return cls(f"start: answer\nanswer: %json {_json_with_style(schema)}", f"the JSON schema {name!r}")

    @classmethod
    def tool_calls(cls, tools: list[dict[str, Any]], call_open: str, call_close: str, *,
                   required: bool) -> Grammar:
        """One or more ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks (Hermes format, as
        Qwen2.5's template asks for), each naming one of ``tools`` (OpenAI function dicts) with arguments valid for
        its parameters. required=False also allows plain text first (or only): the model chooses whether to call.
        ``call_open``/``call_close`` are Lark terminals: ``<[id]>`` where the tokenizer has one token for the tag."""
        if not tools:
            raise GrammarError("No tools to call: bind at least one tool, or call without tool_choice.")
        options = [_call_schema(tool) for tool in check_tools(tools)]
        body = options[0] if len(options) == 1 else {"anyOf": options}
        calls = "call+" if required else "TEXT? call*"
        lark = (f"start: {calls}\nTEXT: /(.|\\n)+/\n"
                f'call: {call_open} "\\n" body "\\n" {call_close} "\\n"?\n'
                f"body: %json {_json_with_style(body)}")
        names = ", ".join(tool["function"]["name"] for tool in tools)
        return cls(lark, f"the tool calls of {names}")


def _json_with_style(schema: dict[str, Any]) -> str:
    return json.dumps({**schema, "x-guidance": {**JSON_STYLE, **schema.get("x-guidance", {})}})


def _check_schema(schema: Any, name: str) -> None:
    if not isinstance(schema, dict):
        raise GrammarError(f"The schema {name!r} must be a JSON schema dict, got {type(schema).__name__}.")


def _call_schema(tool: dict[str, Any]) -> dict[str, Any]:
    """The JSON object of one call of an OpenAI-format tool: its name fixed, its arguments its parameters (no
    arguments beyond those declared, unless the tool says otherwise)."""
    function = tool.get("function") if isinstance(tool, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise GrammarError(f"A tool must be an OpenAI function dict {{'type': 'function', 'function': {{'name': ..., "
                           f"'parameters': {{...}}}}}}, got {tool!r}.")
    parameters = dict(function.get("parameters") or {"type": "object", "properties": {}})
    if parameters.get("type", "object") == "object":
        parameters.setdefault("additionalProperties", False)
    return {"type": "object", "properties": {"name": {"const": function["name"]}, "arguments": parameters},
            "required": ["name", "arguments"], "additionalProperties": False}


class GrammarCompiler:
    """llguidance's view of one tokenizer (built once per engine: about 1-2 s for a 150K vocabulary)."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_ids: set[int]):
        self._tokenizer, self.vocab_size, self._eos = tokenizer, vocab_size, sorted(eos_ids)
        self._ll: Any = None
        self._lock = threading.Lock()

    def _ll_tokenizer(self) -> Any:
        with self._lock:
            if self._ll is None:
                import llguidance.hf

                self._ll = llguidance.hf.from_tokenizer(self._tokenizer, n_vocab=self.vocab_size,
                                                        eos_token=self._eos)
            return self._ll

    def check(self, grammar: Grammar) -> None:
        """Refuse a grammar llguidance cannot enforce, naming what it cannot do (before any reading)."""
        from llguidance import LLMatcher

        if not isinstance(grammar, Grammar):
            raise TypeError("grammar must be an emllm Grammar (Grammar.json_schema(...)), "
                            f"got {type(grammar).__name__}.")
        error: str | None = LLMatcher.validate_grammar(grammar.lark, self._ll_tokenizer())
        if not error:  # some grammars validate and fail only when asked for a token (a $ref that is only itself)
            error = self.constraint(grammar).first_error()
        if error:
            raise GrammarError(f"{grammar.what} cannot be enforced by the constrained decoder: "
                               f"{error.strip().splitlines()[0]}. Remove or rewrite that part of the schema "
                               "(e.g. 'not' has no equivalent; use an enum or a pattern; a $ref must lead to a "
                               "schema, not only to itself).")

    def constraint(self, grammar: Grammar) -> GrammarConstraint:
        return GrammarConstraint(self._ll_tokenizer(), grammar, self.vocab_size)


class GrammarConstraint:
    """The state of one constrained generation: which tokens may come next, advanced token by token."""

    def __init__(self, ll_tokenizer: Any, grammar: Grammar, vocab_size: int):
        from llguidance import LLMatcher
        from llguidance.torch import allocate_token_bitmask

        self._matcher = LLMatcher(ll_tokenizer, grammar.lark)
        self._mask = allocate_token_bitmask(1, vocab_size)  # [1, ceil(vocab / 32)] int32 bits
        self.grammar = grammar
        self._raise_if_error()

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [vocab] with every token the grammar forbids at -inf (a new tensor)."""
        from llguidance.torch import apply_token_bitmask_inplace, fill_next_token_bitmask

        fill_next_token_bitmask(self._matcher, self._mask, 0)
        self._raise_if_error()
        masked = logits.detach().float().cpu().clone()[None]        # [1, vocab]
        apply_token_bitmask_inplace(masked, self._mask)
        return masked[0]

    def first_error(self) -> str | None:
        """Why the grammar allows no first token, or None: the check before any reading (computing the first mask
        costs about a millisecond)."""
        from llguidance.torch import fill_next_token_bitmask

        if not self._matcher.is_error():
            fill_next_token_bitmask(self._matcher, self._mask, 0)
        return self._matcher.get_error() if self._matcher.is_error() else None

    def advance(self, token: int) -> None:
        self._matcher.consume_token(token)
        self._raise_if_error()

    @property
    def finished(self) -> bool:
        """The grammar is complete and allows nothing more (end of turn included)."""
        return self._matcher.is_stopped()

    def _raise_if_error(self) -> None:
        if self._matcher.is_error():
            raise GrammarError(f"Constrained decoding of {self.grammar.what} failed: "
                               f"{self._matcher.get_error().strip().splitlines()[0]}")
