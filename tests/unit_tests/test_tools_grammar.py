"""Tool calls (emllm.tools) and constrained decoding (emllm.grammar) without model weights: the Hermes format is
parsed whole and streamed; a tiny random model with Qwen2.5's real tokenizer and chat template, decoding under a
grammar, still writes JSON valid for the schema and calls of the tools it was given (random weights make no
sense of the prompt, so whatever parses was made to parse by the grammar)."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from emllm import EMConfig, EMEngine, Grammar, GrammarError
from emllm.tools import (CallStream, InvalidToolCall, ReplyStream, ToolCall, ToolSchemas, bare_calls, check_tools,
                         parse_reply, plain_tool_messages)

from .tiny import TINY, tiny_model

ADD = {"type": "function", "function": {"name": "add", "description": "Add two integers.", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}
TODAY = {"type": "function", "function": {"name": "today", "description": "Today's date.",
                                          "parameters": {"type": "object", "properties": {}}}}
REPLY = ('Let me add.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n'
         '<tool_call>\n{"name": "add", "arguments": {"a": 1,}}\n</tool_call>\n<tool_call>\n{"name": "today"')


def test_a_reply_splits_into_text_calls_and_invalid_calls():
    reply = parse_reply(REPLY)
    assert reply.content == "Let me add."
    assert [(c.name, c.arguments) for c in reply.calls] == [("add", {"a": 1, "b": 2})]
    assert [(c.name, c.error.split(":")[0]) for c in reply.invalid] == [("add", "not JSON"), (None, "the call was "
                                                                        "not closed with </tool_call> (cut by "
                                                                        "max_tokens?)")]
    assert len({c.id for c in reply.calls + reply.invalid}) == 3  # every call has its own id


@pytest.mark.parametrize("step", [1, 3, 7])
def test_a_streamed_reply_gives_what_the_whole_reply_gives(step):
    stream, pieces = CallStream(), []
    for i in range(0, len(REPLY), step):
        pieces += stream.feed(REPLY[i:i + step])
    pieces += stream.close()
    text = "".join(p for p in pieces if isinstance(p, str))
    assert text.strip() == "Let me add."  # no piece of a tag leaks into the text
    calls = [p for p in pieces if isinstance(p, ToolCall)]
    invalid = [p for p in pieces if isinstance(p, InvalidToolCall)]
    assert [(c.name, c.arguments) for c in calls] == [("add", {"a": 1, "b": 2})] and len(invalid) == 2


def test_bare_json_calls_are_calls_only_when_they_name_bound_tools():
    fenced = '```json\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n```'
    assert [(c.name, c.arguments) for c in bare_calls(fenced, {"add"})] == [("add", {"a": 1, "b": 2})]
    assert len(bare_calls('{"name": "add", "parameters": {"a": 1}}\n{"name": "today", "arguments": {}}',
                          {"add", "today"})) == 2
    assert bare_calls('{"name": "hello", "arguments": {}}', {"add"}) is None  # not a bound tool: text
    assert bare_calls('{"name": "add", "arguments": {}} and more', {"add"}) is None
    stream = ReplyStream(ToolSchemas([ADD]))
    pieces = stream.feed('{"result": ') + stream.feed("3}") + stream.close()
    assert "".join(pieces) == '{"result": 3}'  # JSON that is not a call stays the answer's text
    stream = ReplyStream(ToolSchemas([ADD]))
    assert stream.feed("The sum") == ["The sum"]  # plain text streams at once


WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}


@pytest.mark.parametrize("reply, reason", [
    ('{"name": "get_weather", "arguments": {"city": 123, "admin": true}}', "city: 123 is not of type 'string'"),
    ('{"name": "get_weather", "arguments": {"city": "Oslo", "admin": true}}', "Additional properties"),
    ('{"name": "get_weather", "arguments": {}}', "'city' is a required property"),
    ('<tool_call>\n{"name": "delete_everything", "arguments": {}}\n</tool_call>', "no bound tool is named"),
])
def test_every_call_passed_on_is_valid_for_its_tool_and_the_rest_say_why(reply, reason):
    """Issue 57: bare JSON or tagged, a call that names no bound tool or whose arguments do not match the tool's
    parameters is an invalid call with the reason, never a call."""
    stream = ReplyStream(ToolSchemas([WEATHER]))
    pieces = [p for p in stream.feed(reply) + stream.close() if not isinstance(p, str)]
    assert len(pieces) == 1 and isinstance(pieces[0], InvalidToolCall), pieces
    assert reason in pieces[0].error
    good = ReplyStream(ToolSchemas([WEATHER]))
    calls = good.feed('{"name": "get_weather", "arguments": {"city": "Oslo"}}') + good.close()
    assert [(c.name, c.arguments) for c in calls] == [("get_weather", {"city": "Oslo"})]


@pytest.mark.parametrize("reply", [
    '{"name": "get_weather", "arguments": {"city": "Paris"}}',                       # Qwen2.5-Coder's bare call
    '```json\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n```',
    '{"name": "get_weather", "arguments": {"city": "Oslo"}}\n{"name": "get_weather", "arguments": {"city": "Rome"}}',
    '{"name": "get_weather", "arguments": {"city": 7}}',                              # bare, against its schema
    'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>',
    '{"temperature": 21}',                                                            # JSON, not a call
    "It is sunny in Paris.",
])
def test_a_whole_reply_gives_the_calls_and_text_its_stream_gives(reply):
    """The server answers a non-streaming request with parse_reply and a streaming one with ReplyStream: a bare
    JSON call (what the default model writes under tool_choice="auto") must be a call either way, not a call
    streamed and text whole."""
    schemas = ToolSchemas([WEATHER])
    whole = parse_reply(reply, schemas)
    stream, pieces = ReplyStream(schemas), []
    for i in range(0, len(reply), 3):
        pieces += stream.feed(reply[i:i + 3])
    pieces += stream.close()
    assert [(c.name, c.arguments) for c in whole.calls] == \
        [(p.name, p.arguments) for p in pieces if isinstance(p, ToolCall)]
    assert [(c.name, c.error) for c in whole.invalid] == \
        [(p.name, p.error) for p in pieces if isinstance(p, InvalidToolCall)]
    assert whole.content == "".join(p for p in pieces if isinstance(p, str)).strip()
    if reply.lstrip("`json\n").startswith('{"name"'):
        assert whole.calls or whole.invalid  # a bare call of a bound tool is never passed on as text


def test_a_closing_tag_inside_an_argument_stays_in_the_argument():
    """The tag's text inside a JSON string (a document quoting a call) does not end the call, streamed or whole."""
    text = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "a </tool_call> \\" b"}}\n</tool_call>'
            " done")
    whole = parse_reply(text, ToolSchemas([WEATHER]))
    assert [c.arguments for c in whole.calls] == [{"city": 'a </tool_call> " b'}] and whole.content == "done"
    stream, pieces = CallStream(), []
    for i in range(0, len(text), 3):
        pieces += stream.feed(text[i:i + 3])
    pieces += stream.close()
    assert [p.arguments for p in pieces if isinstance(p, ToolCall)] == [{"city": 'a </tool_call> " b'}]


def test_streamed_arguments_are_parsed_in_linear_time():
    """Megabytes of arguments streamed a few characters at a time: each delta is scanned once (issue 57 measured
    520K characters in 60 s before). Counted in scanned characters, not seconds."""
    import emllm.tools as tools

    scanned = []
    real = tools._CALL_TOKENS

    class Counting:
        def finditer(self, text, *args):
            scanned.append(len(text))
            return real.finditer(text, *args)

    body = json.dumps({"name": "get_weather", "arguments": {"city": 'x"y\\' * 50_000}})
    text = f"<tool_call>\n{body}\n</tool_call>"
    stream, pieces = CallStream(), []
    try:
        tools._CALL_TOKENS = Counting()
        for i in range(0, len(text), 4):
            pieces += stream.feed(text[i:i + 4])
    finally:
        tools._CALL_TOKENS = real
    assert [len(p.arguments["city"]) for p in pieces if isinstance(p, ToolCall)] == [200_000]
    assert sum(scanned) < 5 * len(text)  # each character scanned a bounded number of times


@pytest.mark.parametrize("parameters, error, words", [
    ({"type": "array"}, ValueError, "must describe an object"),
    ("x", TypeError, "must be a JSON schema dict"),
    ({"type": "object", "properties": {"a": {"type": "strin"}}}, ValueError, "not a valid JSON schema"),
])
def test_tools_no_call_could_satisfy_are_refused_with_the_reason(parameters, error, words):
    tool = {"type": "function", "function": {"name": "f", "parameters": parameters}}
    with pytest.raises(error, match=words):
        check_tools([tool])
    with pytest.raises(error, match=words):
        Grammar.tool_calls([tool], "<tool_call>", "</tool_call>", required=False)


def test_a_schema_nested_thousands_deep_is_refused_without_recursion():
    deep: dict = {"type": "string"}
    for _ in range(3000):
        deep = {"type": "object", "properties": {"x": deep}}
    with pytest.raises(ValueError, match="nest more than 64 levels"):
        check_tools([{"type": "function", "function": {"name": "f", "parameters": deep}}])


def test_templates_without_tools_get_the_documented_tool_prompt():
    turns = plain_tool_messages([
        {"role": "user", "content": "1+2?"},
        {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {
            "name": "add", "arguments": {"a": 1, "b": 2}}}]},
        {"role": "tool", "content": "3"}], [ADD])
    assert turns[0]["role"] == "system" and json.dumps(ADD) in turns[0]["content"]
    assert turns[2] == {"role": "assistant", "content": '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}'
                                                        "\n</tool_call>"}
    assert turns[3] == {"role": "user", "content": "<tool_response>\n3\n</tool_response>"}


# ---------------------------------------------------------------------- decoding under a grammar
@pytest.fixture(scope="module")
def qwen_engine():
    """Qwen2.5's real tokenizer and chat template (files only) on a tiny random model with its vocabulary."""
    transformers = pytest.importorskip("transformers")
    from emllm.models import resolve_model_dir

    tokenizer = transformers.AutoTokenizer.from_pretrained(resolve_model_dir(None, progress=False))
    model = tiny_model(vocab=151936, hidden=16, intermediate=32)
    for config in (model.config, model.generation_config):  # the toy's ids 0/1 are ordinary tokens here
        config.bos_token_id = config.pad_token_id = config.eos_token_id = tokenizer.eos_token_id
    return EMEngine(model, tokenizer, EMConfig.from_preset("SM+C", **TINY), model_name="tiny-qwen-vocab")


SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "size": {"enum": ["S", "M", "L"]},
                                           "count": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["ok", "size", "count"], "additionalProperties": False}


@pytest.mark.parametrize("seed", range(4))
def test_random_weights_under_a_schema_still_write_valid_json(qwen_engine, seed):
    torch.manual_seed(seed)
    result = qwen_engine.chat([{"role": "user", "content": "Describe the box."}], grammar=Grammar.json_schema(SCHEMA),
                              max_new_tokens=40, temperature=1.0, seed=seed)
    assert result.finish_reason == "stop"
    jsonschema.validate(json.loads(result.text), SCHEMA)


@pytest.mark.parametrize("required", [True, False])
def test_random_weights_under_a_tool_grammar_call_only_listed_tools_with_valid_arguments(qwen_engine, required):
    digit = {"type": "integer", "minimum": 0, "maximum": 9}  # bounded: random weights would write digits forever
    bounded = {"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": digit, "b": digit}, "required": ["a", "b"]}}}
    tools = [bounded, TODAY]
    grammar = qwen_engine.tool_grammar(tools, required=required)
    result = qwen_engine.chat([{"role": "user", "content": "What is 1 + 2?"}], tools=tools, grammar=grammar,
                              max_new_tokens=60, seed=3, temperature=0.7)
    reply = parse_reply(result.text)
    if required:  # calls only, and they end
        assert result.finish_reason == "stop" and reply.calls and not reply.content and not reply.invalid
    else:  # free text may run to max_tokens, and a call cut there is unclosed; every closed call is valid
        assert all("not closed" in call.error for call in reply.invalid)
    for call in reply.calls:
        schema = {t["function"]["name"]: t["function"]["parameters"] for t in tools}[call.name]
        jsonschema.validate(call.arguments, {**schema, "additionalProperties": False})


def test_tools_are_listed_by_a_template_that_carries_them(qwen_engine):
    ids = qwen_engine.chat_ids([{"role": "user", "content": "1+2?"}], tools=[ADD])
    text = qwen_engine.tokenizer.decode(ids)
    assert "<tools>" in text and '"name": "add"' in text
    history = qwen_engine.tokenizer.decode(qwen_engine.chat_ids([
        {"role": "user", "content": "1+2?"},
        {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {
            "name": "add", "arguments": {"a": 1, "b": 2}}}]},
        {"role": "tool", "content": "3"}], tools=[ADD]))
    assert '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>' in history
    assert "<tool_response>\n3\n</tool_response>" in history


def test_a_schema_the_decoder_cannot_enforce_is_refused_before_reading(qwen_engine):
    memory = qwen_engine.new_memory()
    with pytest.raises(GrammarError, match="cannot be enforced.*not"):
        qwen_engine.stream([{"role": "user", "content": "x"}], memory=memory,
                           grammar=Grammar.json_schema({"not": {"type": "string"}}))
    assert memory.total_tokens == 0
    with pytest.raises(GrammarError, match="must be a JSON schema dict"):
        Grammar.json_schema(["type", "object"])
    with pytest.raises(TypeError, match="must be an emllm Grammar"):
        qwen_engine.stream("x", grammar='start: "a"')


def test_tool_calls_must_be_well_formed_messages(qwen_engine):
    with pytest.raises(TypeError, match="A tool call is"):
        qwen_engine.chat_ids([{"role": "assistant", "content": "", "tool_calls": [{"name": "add"}]}])
    with pytest.raises(ValueError, match="Only assistant messages carry tool_calls"):
        qwen_engine.chat_ids([{"role": "user", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "add", "arguments": {}}}]}])
