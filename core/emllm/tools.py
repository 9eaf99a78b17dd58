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


MAX_SCHEMA_DEPTH = 64
"""How deeply a tool's parameters may nest (objects in arrays in objects...): far past any real tool, and short of
the recursion limits of the JSON and schema libraries that read them."""


def check_tools(tools: Any) -> list[dict[str, Any]]:
    """Refuse, before anything is read, tools that no call could satisfy or that the decoder and the parser cannot
    handle, naming the tool and the fix: each must be an OpenAI function dict with a name; its ``parameters`` a
    JSON schema of an object (a call's arguments are an object), valid (Draft 2020-12), nested at most
    MAX_SCHEMA_DEPTH deep. Returns the tools as a list."""
    from jsonschema import Draft202012Validator
    from jsonschema.exceptions import SchemaError

    if isinstance(tools, (str, bytes, dict)) or not isinstance(tools, (list, tuple)):
        raise TypeError(f"tools must be a list of OpenAI function dicts, got {type(tools).__name__}.")
    names: set[str] = set()
    for tool in tools:
        function = tool.get("function") if isinstance(tool, dict) else None
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(function, dict) or not isinstance(name, str) or not name:
            raise TypeError("A tool must be an OpenAI function dict {'type': 'function', 'function': {'name': ..., "
                            f"'parameters': {{...}}}}}}, got {tool!r}.")
        if name in names:
            raise ValueError(f"Two tools are named {name!r}: a call names its tool, so names must differ.")
        names.add(name)
        parameters = function.get("parameters", {"type": "object", "properties": {}})
        where = f"The parameters of the tool {name!r}"
        if not isinstance(parameters, dict):
            raise TypeError(f"{where} must be a JSON schema dict, got {type(parameters).__name__} {parameters!r}.")
        if parameters.get("type", "object") != "object":
            raise ValueError(f"{where} must describe an object (\"type\": \"object\"), got type "
                             f"{parameters.get('type')!r}: a call's arguments are a JSON object. Wrap the value in "
                             "an object's property.")
        if _depth(parameters) > MAX_SCHEMA_DEPTH:
            raise ValueError(f"{where} nest more than {MAX_SCHEMA_DEPTH} levels deep: flatten the schema.")
        try:
            Draft202012Validator.check_schema(parameters)
        except SchemaError as error:
            raise ValueError(f"{where} are not a valid JSON schema: {error.message}.") from None
    return list(tools)


def _depth(schema: Any) -> int:
    """How deeply dicts and lists nest in a JSON value, counted without recursion (a hostile schema may nest
    thousands deep)."""
    deepest, stack = 0, [(schema, 1)]
    while stack:
        value, depth = stack.pop()
        deepest = max(deepest, depth)
        if depth > MAX_SCHEMA_DEPTH:
            return depth
        children = value.values() if isinstance(value, dict) else value if isinstance(value, list) else ()
        stack.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))
    return deepest


class ToolSchemas:
    """The bound tools' argument schemas: ``checked`` passes a parsed call on only when it names a bound tool and
    its arguments are valid for that tool's parameters; anything else becomes an InvalidToolCall saying why (the
    grammar enforces the same where one is built; where none is, or a call came as bare JSON, this is the check)."""

    def __init__(self, tools: list[dict[str, Any]]):
        from jsonschema import Draft202012Validator

        self._validators = {}
        for tool in check_tools(tools):
            function = tool["function"]
            parameters = dict(function.get("parameters") or {"type": "object", "properties": {}})
            parameters.setdefault("additionalProperties", False)  # as the grammar: no arguments beyond those declared
            self._validators[function["name"]] = Draft202012Validator(parameters)

    @property
    def names(self) -> set[str]:
        return set(self._validators)

    def checked(self, call: ToolCall | InvalidToolCall) -> ToolCall | InvalidToolCall:
        if isinstance(call, InvalidToolCall):
            return call
        text = json.dumps({"name": call.name, "arguments": call.arguments})
        validator = self._validators.get(call.name)
        if validator is None:
            bound = ", ".join(sorted(self._validators)) or "none"
            return InvalidToolCall(text, f"no bound tool is named {call.name!r} (bound: {bound})", call.name, call.id)
        errors = sorted(validator.iter_errors(call.arguments), key=lambda e: [str(p) for p in e.absolute_path])
        if errors:
            reasons = "; ".join(f"{'/'.join(map(str, e.absolute_path)) or 'arguments'}: {e.message}"
                                for e in errors[:5])
            return InvalidToolCall(text, f"the arguments do not match the parameters of {call.name!r}: {reasons}",
                                   call.name, call.id)
        return call


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


def parse_reply(text: str, schemas: ToolSchemas | None = None) -> ParsedReply:
    """A whole answer split into its text and its tool calls; a block left open (cut by max_tokens) is invalid.
    With ``schemas`` (the request's tools) it is read as ReplyStream reads it streamed: calls written as bare JSON
    count, and each call is checked against its tool. So a reply asked for whole gives the calls it gives streamed
    (a server's non-streaming answer and its stream agree)."""
    stream: CallStream | ReplyStream = CallStream() if schemas is None else ReplyStream(schemas)
    reply = ParsedReply("")
    pieces: list[str] = []
    for piece in stream.feed(text) + stream.close():
        if isinstance(piece, str):
            pieces.append(piece)
        else:
            _add(reply, piece)
    reply.content = "".join(pieces).strip()
    return reply


def _add(reply: ParsedReply, call: ToolCall | InvalidToolCall) -> None:
    if isinstance(call, ToolCall):
        reply.calls.append(call)
    else:
        reply.invalid.append(call)


_CALL_TOKENS = re.compile(r'\\.|"|' + re.escape(CALL_CLOSE), re.S)
"""What decides where a call's JSON ends: string quotes, escapes inside strings, and the closing tag."""


class CallStream:
    """Splits streamed text deltas into text and whole tool calls as they complete: ``feed`` returns what can be
    passed on now (text that cannot be the start of a tag, then each call once its closing tag arrives).

    A call ends at the first closing tag outside a JSON string: the tag's text inside an argument (a document
    quoting a call) stays part of the argument. Inside a call each delta is scanned once, with only the few
    characters before it that could still begin a token, and kept as a list of pieces: a call of megabytes
    streamed a few characters at a time costs linear time."""

    def __init__(self) -> None:
        self._buffer = ""          # outside a call: text not passed on yet
        self._in_call = False
        self._body: list[str] = []  # in a call: the body scanned so far
        self._tail = ""            # in a call: the end not scanned yet (a token may still be growing there)
        self._in_string = False    # in a call: whether the body so far ends inside a JSON string

    def feed(self, delta: str) -> list[str | ToolCall | InvalidToolCall]:
        out: list[str | ToolCall | InvalidToolCall] = []
        if self._in_call:
            delta = self._call_feed(delta, out)
            if self._in_call:
                return out
        self._buffer += delta
        while True:
            start = self._buffer.find(CALL_OPEN)
            if start < 0:
                keep = _partial_tag(self._buffer)
                text, self._buffer = self._buffer[:len(self._buffer) - keep], self._buffer[len(self._buffer) - keep:]
                if text:
                    out.append(text)
                return out
            if start:
                out.append(self._buffer[:start])
            rest, self._buffer = self._buffer[start + len(CALL_OPEN):], ""
            self._in_call, self._body, self._tail, self._in_string = True, [], "", False
            rest = self._call_feed(rest, out)
            if self._in_call:
                return out
            self._buffer = rest

    def _call_feed(self, delta: str, out: list[str | ToolCall | InvalidToolCall]) -> str:
        """Scan more of a call; once its closing tag arrives outside a string, the call goes to ``out`` and what
        followed the tag is returned (else "")."""
        text = self._tail + delta
        scanned = 0
        for match in _CALL_TOKENS.finditer(text):  # every match is a whole token; a partial one is not matched
            if match.group() == CALL_CLOSE and not self._in_string:
                self._body.append(text[:match.start()])
                out.append(parse_call("".join(self._body)))
                self._in_call, self._body, self._tail = False, [], ""
                return text[match.end():].lstrip("\n")
            if match.group() == '"':
                self._in_string = not self._in_string
            scanned = match.end()
        keep = max(scanned, len(text) - len(CALL_CLOSE) + 1)  # the end may begin a tag or an escape: kept
        self._body.append(text[:keep])
        self._tail = text[keep:]
        return ""

    def close(self) -> list[str | ToolCall | InvalidToolCall]:
        """What is left at the end: held-back text, or a call that never closed (invalid)."""
        if self._in_call:
            rest = "".join(self._body) + self._tail
            self._in_call, self._body, self._tail = False, [], ""
            return [InvalidToolCall(rest.strip(), f"the call was not closed with {CALL_CLOSE} (cut by max_tokens?)")]
        rest, self._buffer = self._buffer, ""
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
    calls, otherwise it is passed on as text (and any tagged calls in it still parsed). Every call is checked
    against the tools' schemas (ToolSchemas.checked): one that is not valid for its tool comes out invalid."""

    def __init__(self, schemas: ToolSchemas):
        self._schemas = schemas
        self._names = schemas.names
        self._tagged = CallStream()
        self._held: str | None = ""  # None once the reply can no longer be bare JSON

    def feed(self, delta: str) -> list[str | ToolCall | InvalidToolCall]:
        if self._held is None:
            return self._checked(self._tagged.feed(delta))
        self._held += delta
        start = self._held.lstrip()
        if not start or ((start.startswith("{") or "```".startswith(start[:3])) and self._names):
            return []
        held, self._held = self._held, None
        return self._checked(self._tagged.feed(held))

    def close(self) -> list[str | ToolCall | InvalidToolCall]:
        if self._held is not None:
            held, self._held = self._held, None
            calls = bare_calls(held, self._names)
            if calls:
                return self._checked(list(calls))
            return self._checked(self._tagged.feed(held) + self._tagged.close())
        return self._checked(self._tagged.close())

    def _checked(self, pieces: list) -> list[str | ToolCall | InvalidToolCall]:
        return [piece if isinstance(piece, str) else self._schemas.checked(piece) for piece in pieces]


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
