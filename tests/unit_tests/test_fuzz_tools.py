"""Fuzzed tools and tool-call replies: every outcome is a call valid for its tool, an invalid call with a reason,
or a clear refusal (TypeError/ValueError naming the tool) before anything is read. No model weights.

The properties, drawn by hypothesis (600 examples a run in all):
- random tool definitions, well formed or not (parameters of every JSON type, nested, with bad keywords), are
  accepted by check_tools exactly when a grammar can be built for them, or refused with a message;
- random replies to random valid tools (tagged calls, bare JSON, fenced JSON, text around calls, a document's text
  quoting call tags, cut-off calls, arguments of every shape), streamed in random pieces, come out as text, calls
  whose arguments validate against their tool's parameters (checked independently with jsonschema), and invalid
  calls with a reason; the streamed split is the whole reply's split.
"""

from __future__ import annotations

import json
from collections import Counter

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from emllm.grammar import Grammar
from emllm.tools import CALL_CLOSE, CALL_OPEN, InvalidToolCall, ReplyStream, ToolCall, ToolSchemas, check_tools

pytestmark = pytest.mark.timeout(300)

CASES: Counter = Counter()

NAMES = st.text(alphabet="abcdefghijklmnopqrstuvwxyz_", min_size=1, max_size=12)
SCALARS = st.sampled_from([{"type": "string"}, {"type": "integer"}, {"type": "number"}, {"type": "boolean"},
                           {"type": "string", "enum": ["a", "b"]}, {"type": "integer", "minimum": 0}])
SCHEMAS = st.recursive(SCALARS, lambda inner: st.one_of(
    st.builds(lambda items: {"type": "array", "items": items}, inner),
    st.builds(lambda props, req: {"type": "object", "properties": props,
                                  "required": sorted(set(req) & set(props))},
              st.dictionaries(NAMES, inner, max_size=3), st.lists(NAMES, max_size=2))), max_leaves=6)
OBJECTS = st.builds(lambda props, req: {"type": "object", "properties": props,
                                        "required": sorted(set(req) & set(props))},
                    st.dictionaries(NAMES, SCHEMAS, max_size=4), st.lists(NAMES, max_size=3))
BAD_PARAMETERS = st.one_of(SCALARS, st.just({"type": "array"}), st.text(max_size=5), st.integers(),
                           st.just({"type": "object", "properties": {"a": {"type": "strin"}}}),
                           st.just({"type": "object", "required": "a"}))
JSON_VALUES = st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=8),
                           lambda inner: st.lists(inner, max_size=3) | st.dictionaries(NAMES, inner, max_size=3),
                           max_leaves=8)


def instance(schema: dict):
    """A small value valid for one of these schemas (a fuzzed reply is then often a valid call)."""
    kind = schema.get("type")
    if "enum" in schema:
        return schema["enum"][0]
    if kind == "object":
        return {key: instance(schema["properties"][key]) for key in schema.get("required", [])}
    return {"array": [], "string": "x", "integer": 1, "number": 1.5, "boolean": True}[kind]


def tool(name: str, parameters) -> dict:
    return {"type": "function", "function": {"name": name, "description": "fuzzed", "parameters": parameters}}


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(NAMES, st.one_of(OBJECTS, BAD_PARAMETERS)), min_size=1, max_size=3))
def test_tool_definitions_are_accepted_only_when_a_call_can_satisfy_them(specs):
    tools = [tool(name, parameters) for name, parameters in specs]
    CASES["tool sets"] += 1
    try:
        accepted = check_tools(tools)
    except (TypeError, ValueError) as error:
        CASES["tools refused"] += 1
        assert str(error)  # a message naming the problem
        return
    CASES["tools accepted"] += 1
    for spec in accepted:
        jsonschema.Draft202012Validator.check_schema(spec["function"]["parameters"])
        assert spec["function"]["parameters"].get("type", "object") == "object"
    Grammar.tool_calls(accepted, "<tool_call>", "</tool_call>", required=False)  # a grammar can be built


def _reply(draw_kind: str, name: str, arguments, text: str) -> str:
    call = json.dumps({"name": name, "arguments": arguments})
    return {
        "tagged": f"{text}{CALL_OPEN}\n{call}\n{CALL_CLOSE}",
        "bare": call,
        "fenced": f"```json\n{call}\n```",
        "quoted tags": f"The document says {CALL_OPEN} and {CALL_CLOSE} in passing. {text}",
        "tag inside argument": f"{CALL_OPEN}\n{json.dumps({'name': name, 'arguments': {'q': CALL_CLOSE}})}\n"
                               f"{CALL_CLOSE}",
        "cut off": f"{text}{CALL_OPEN}\n{call[:len(call) // 2]}",
        "garbage": f"{CALL_OPEN}{text}{{not json{CALL_CLOSE}",
    }[draw_kind]


@settings(max_examples=450, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(NAMES, OBJECTS), min_size=1, max_size=3, unique_by=lambda t: t[0]),
       st.sampled_from(["tagged", "bare", "fenced", "quoted tags", "tag inside argument", "cut off", "garbage"]),
       st.one_of(NAMES, st.just("")), JSON_VALUES, st.text(max_size=20), st.lists(st.integers(1, 9), min_size=1))
def test_every_reply_splits_into_valid_calls_invalid_calls_and_text(specs, kind, name, arguments, text, cuts):
    CASES["replies"] += 1
    tools = [tool(n, p) for n, p in specs]
    if not name:
        name = specs[0][0]  # often a bound tool, with arguments valid for it
        arguments = instance(specs[0][1])
    reply = _reply(kind, name, arguments, text)
    validators = {n: jsonschema.Draft202012Validator({**p, "additionalProperties": False}) for n, p in specs}
    pieces, stream, at = [], ReplyStream(ToolSchemas(tools)), 0
    for size in cuts * (len(reply) // sum(cuts) + 1):
        if at >= len(reply):
            break
        pieces += stream.feed(reply[at:at + size])
        at += size
    pieces += stream.close()
    whole = ReplyStream(ToolSchemas(tools))
    once = whole.feed(reply) + whole.close()
    for piece in pieces:
        if isinstance(piece, ToolCall):
            CASES["valid call"] += 1
            assert piece.name in validators
            assert validators[piece.name].is_valid(piece.arguments), (piece, reply)
        elif isinstance(piece, InvalidToolCall):
            CASES["invalid call"] += 1
            assert piece.error
        else:
            assert isinstance(piece, str)
    key = [(type(p).__name__, getattr(p, "arguments", None)) for p in pieces if not isinstance(p, str)]
    assert key == [(type(p).__name__, getattr(p, "arguments", None)) for p in once if not isinstance(p, str)]
    assert "".join(p for p in pieces if isinstance(p, str)) == "".join(p for p in once if isinstance(p, str))


def test_zz_report_cases():
    """The examples each property ran (pytest -s prints them), and proof they ran at all."""
    print(dict(CASES))
    assert CASES["tool sets"] + CASES["replies"] >= 600 or not CASES
