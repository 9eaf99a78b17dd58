"""OpenAI's ``response_format`` as the engine enforces it: a grammar the answer must follow, and the schema asked for
in the conversation (ChatEMLLM's structured output and the server's /v1/chat/completions share both)."""

from __future__ import annotations

import json
from typing import Any

from emllm import Grammar


def with_format_request(prompt: list[dict[str, Any]], response_format: dict[str, Any]) -> list[dict[str, Any]]:
    """The conversation with the schema asked for just before the last message's last paragraph (its question).
    The grammar makes the answer parse; the model must also know the fields to fill them well (measured: with the
    grammar alone Qwen2.5-Coder-0.5B looped inside the first string of a joke until max_tokens). Before the
    question, so the question still decides what the memory retrieves; after the document, so a long document's
    memory is still reused."""
    spec = response_format.get("json_schema") or {}
    schema = spec.get("schema")
    request = ("Answer with a JSON object that matches this JSON schema:\n" + json.dumps(schema) if schema
               else "Answer with a JSON object.")
    last = prompt[-1]
    if last["role"] != "user":
        return [*prompt, {"role": "user", "content": request}]
    text = last["content"]
    cut = text.rstrip().rfind("\n\n")
    content = f"{text[:cut]}\n\n{request}\n\n{text[cut + 2:]}" if cut >= 0 else f"{request}\n\n{text}"
    return [*prompt[:-1], {**last, "content": content}]


def response_grammar(response_format: dict[str, Any]) -> Grammar:
    """The grammar of an OpenAI-style response_format: {"type": "json_schema", "json_schema": {"name", "schema"}}
    or {"type": "json_object"} (any JSON object)."""
    kind = response_format.get("type") if isinstance(response_format, dict) else None
    if kind == "json_object":
        return Grammar.json_schema({"type": "object"}, "json_object")
    if kind == "json_schema" and isinstance(response_format.get("json_schema"), dict):
        spec = response_format["json_schema"]
        return Grammar.json_schema(spec.get("schema") or {"type": "object"}, spec.get("name", "response"))
    raise ValueError("response_format must be {'type': 'json_schema', 'json_schema': {'name': ..., 'schema': {...}}} "
                     f"or {{'type': 'json_object'}}, got {response_format!r}.")
