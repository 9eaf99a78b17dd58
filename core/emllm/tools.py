"""Tool calls in the Hermes format that Qwen2.5 and Qwen3 are trained on, and a tool prompt for other models.

A model calls a tool by writing

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Chat templates that carry tools in this format (their source mentions ``<tool_call>``) render the tool list, the
assistant's calls and the tools' results themselves. For any other template, ``plain_tool_messages`` writes the
same thing as ordinary turns: a system turn listing the tools (TOOL_PROMPT), calls as assistant text, results as
user turns in ``<tool_response>`` tags; the model's answer is parsed the same way either way.
"""

from __future__ import annotations

import contextlib
import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"

TOOL_PROMPT = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within <tool_call></tool_call> "
    'XML tags:\n<tool_call>\n{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>')
"""The documented tool prompt for templates without tools: Qwen2.5's own wording, so the parse is the same."""

_CALL = re.compile(re.escape(CALL_OPEN) + r"(.*?)" + re.escape(CALL_CLOSE), re.S)


def template_carries_tools(tokenizer: Any) -> bool:
    """Whether the chat template renders tools and calls in the Hermes format itself."""
    template = getattr(tokenizer, "chat_template", None)
    return isinstance(template, str) and "tools" in template and CALL_OPEN in template


def plain_tool_messages(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """The conversation with tools, calls and results as plain system/user/assistant turns (TOOL_PROMPT)."""
    out: list[dict[str, Any]] = []
    if tools:
        listing = TOOL_PROMPT.format(tools="\n".join(json.dumps(t) for t in tools))
        if messages and messages[0]["role"] == "system":
            out.append({"role": "system", "content": messages[0]["content"] + "\n\n" + listing})
            messages = messages[1:]
        else:
            out.append({"role": "system", "content": listing})
    for message in messages:
        if message["role"] == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{message['content']}\n</tool_response>"})
        elif message.get("tool_calls"):
            calls = "\n".join(format_call(c["function"]["name"], c["function"]["arguments"])
                              for c in message["tool_calls"])
            text = (message["content"] + "\n" if message["content"] else "") + calls
            out.append({"role": "assistant", "content": text})
        else:
            out.append({"role": message["role"], "content": message["content"]})
    return out


def format_call(name: str, arguments: dict[str, Any]) -> str:
    return f"{CALL_OPEN}\n{json.dumps({'name': name, 'arguments': arguments})}\n{CALL_CLOSE}"


@dataclass
class ToolCall:
    name: str
    arguments: dict[str, Any]
    id: str = field(default_factory=lambda: new_call_id())


@dataclass
class InvalidToolCall:
    text: str           # what the model wrote between the tags
    error: str
    name: str | None = None
    id: str = field(default_factory=lambda: new_call_id())


@dataclass
class ParsedReply:
    content: str                                   # the text outside the tool-call blocks
    calls: list[ToolCall] = field(default_factory=list)
    invalid: list[InvalidToolCall] = field(default_factory=list)


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def parse_call(body: str) -> ToolCall | InvalidToolCall:
    """One block's JSON: a call with a name and an arguments object, or why it is not one."""
    try:
        value = json.loads(body)
    except json.JSONDecodeError as error:
        name = re.search(r'"name"\s*:\s*"([^"]*)"', body)
        return InvalidToolCall(body.strip(), f"not JSON: {error}", name.group(1) if name else None)
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return InvalidToolCall(body.strip(), 'not an object with a "name" string')
    arguments = value.get("arguments", {})
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        with contextlib.suppress(json.JSONDecodeError):
            arguments = json.loads(arguments)
    if not isinstance(arguments, dict):
        return InvalidToolCall(body.strip(), '"arguments" is not a JSON object', value["name"])
    return ToolCall(value["name"], arguments)


def parse_reply(text: str) -> ParsedReply:
    """A whole answer split into its text and its tool calls; a block left open (cut by max_tokens) is invalid."""
    reply = ParsedReply("")
    pieces, last = [], 0
    for match in _CALL.finditer(text):
        pieces.append(text[last:match.start()])
        _add(reply, parse_call(match.group(1)))
        last = match.end()
    rest = text[last:]
    if CALL_OPEN in rest:
        cut = rest.index(CALL_OPEN)
        pieces.append(rest[:cut])
        reply.invalid.append(InvalidToolCall(rest[cut + len(CALL_OPEN):].strip(),
                                             f"the call was not closed with {CALL_CLOSE} (cut by max_tokens?)"))
    else:
        pieces.append(rest)
    reply.content = "".join(pieces).strip()
    return reply


def _add(reply: ParsedReply, call: ToolCall | InvalidToolCall) -> None:
    if isinstance(call, ToolCall):
        reply.calls.append(call)
    else:
        reply.invalid.append(call)


class CallStream:
    """Splits streamed text deltas into text and whole tool calls as they complete: ``feed`` returns what can be
    passed on now (text that cannot be the start of a tag, then each call once its closing tag arrives)."""

    def __init__(self) -> None:
        self._buffer = ""
        self._in_call = False

    def feed(self, delta: str) -> list[str | ToolCall | InvalidToolCall]:
        self._buffer += delta
        out: list[str | ToolCall | InvalidToolCall] = []
        while True:
            if self._in_call:
                end = self._buffer.find(CALL_CLOSE)
                if end < 0:
                    return out
                out.append(parse_call(self._buffer[:end]))
                self._buffer, self._in_call = self._buffer[end + len(CALL_CLOSE):].lstrip("\n"), False
                continue
            start = self._buffer.find(CALL_OPEN)
            if start < 0:
                keep = _partial_tag(self._buffer)
                text, self._buffer = self._buffer[:len(self._buffer) - keep], self._buffer[len(self._buffer) - keep:]
                if text:
                    out.append(text)
                return out
            if start:
                out.append(self._buffer[:start])
            self._buffer, self._in_call = self._buffer[start + len(CALL_OPEN):], True

    def close(self) -> list[str | ToolCall | InvalidToolCall]:
        """What is left at the end: held-back text, or a call that never closed (invalid)."""
        rest, self._buffer = self._buffer, ""
        if self._in_call:
            return [InvalidToolCall(rest.strip(), f"the call was not closed with {CALL_CLOSE} (cut by max_tokens?)")]
        return [rest] if rest else []


def _partial_tag(text: str) -> int:
    """How many trailing characters could be the start of CALL_OPEN."""
    for k in range(min(len(CALL_OPEN) - 1, len(text)), 0, -1):
        if text.endswith(CALL_OPEN[:k]):
            return k
    return 0


class ReplyStream:
    """CallStream for a reply of a model that has tools, which also accepts calls written as bare JSON: some
    models (Qwen2.5-Coder among them) answer ``{"name": ..., "arguments": ...}``, fenced or not, without the tags.
    A reply that starts like JSON is held until it ends; if it is nothing but calls of the given tools, they are
    calls, otherwise it is passed on as text (and any tagged calls in it still parsed)."""

    def __init__(self, tool_names: set[str]):
        self._names = tool_names
        self._tagged = CallStream()
        self._held: str | None = ""  # None once the reply can no longer be bare JSON

    def feed(self, delta: str) -> list[str | ToolCall | InvalidToolCall]:
        if self._held is None:
            return self._tagged.feed(delta)
        self._held += delta
        start = self._held.lstrip()
        if not start or ((start.startswith("{") or "```".startswith(start[:3])) and self._names):
            return []
        held, self._held = self._held, None
        return self._tagged.feed(held)

    def close(self) -> list[str | ToolCall | InvalidToolCall]:
        if self._held is not None:
            held, self._held = self._held, None
            calls = bare_calls(held, self._names)
            if calls:
                return list(calls)
            return self._tagged.feed(held) + self._tagged.close()
        return self._tagged.close()


def bare_calls(text: str, names: set[str]) -> list[ToolCall] | None:
    """The calls, if ``text`` (optionally in a ``` fence) is only JSON objects each naming one of ``names`` with an
    arguments object ("parameters" as Llama writes it is read too); None otherwise."""
    body = text.strip()
    if body.startswith("```"):
        body = body.split("\n", 1)[1] if "\n" in body else ""
        body = body.rsplit("```", 1)[0] if body.rstrip().endswith("```") else body
    decoder, calls, at = json.JSONDecoder(), [], 0
    body = body.strip()
    while at < len(body):
        try:
            value, end = decoder.raw_decode(body, at)
        except json.JSONDecodeError:
            return None
        arguments = value.get("arguments", value.get("parameters")) if isinstance(value, dict) else None
        if not (isinstance(value, dict) and value.get("name") in names and isinstance(arguments, dict)):
            return None
        calls.append(ToolCall(value["name"], arguments))
        at = end
        while at < len(body) and body[at] in " \t\r\n,":
            at += 1
    return calls or None
