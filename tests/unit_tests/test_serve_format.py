"""The server's reading of OpenAI's chat-completions request (weightless): what it accepts, what it refuses and
with which field named, and where a session id comes from."""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi", reason="the [serve] extra is not installed")

from emllm_integrations.serve.openai_format import (RequestError, check_chat_request,
                                                    check_completion_request)

MODEL = "smollm2"


def call(body=None, header=None, **fields):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **(body or {}), **fields}
    return check_chat_request(body, MODEL, 64, header)


def test_a_plain_request_becomes_sampling_options():
    checked = call(max_tokens=5, temperature=0, stop="END", seed=3)
    assert checked.options == {"max_tokens": 5, "temperature": 0, "top_p": 1.0, "seed": 3, "stop": ["END"],
                               "reread": False}
    assert checked.messages == [{"role": "user", "content": "hi"}] and not checked.stream
    assert call().options["max_tokens"] == 64 and call().options["temperature"] == 1.0  # OpenAI's defaults
    assert call(max_completion_tokens=7).options["max_tokens"] == 7


def test_reread_is_the_one_extension_field_and_must_be_a_boolean():
    """``reread`` (sent with extra_body) switches the re-read on; a string such as "false" is refused, not read as
    true, and the 400 names the field."""
    assert call(reread=True).options["reread"] is True and call(reread=None).options["reread"] is False
    for bad in ("false", 1):
        with pytest.raises(RequestError, match="reread must be true or false") as refused:
            call(reread=bad)
        assert refused.value.param == "reread" and refused.value.status == 400
    with pytest.raises(RequestError, match="reread_everything"):
        call(reread_everything=True)


def test_developer_messages_are_system_and_text_parts_join():
    checked = call(messages=[{"role": "developer", "content": "Be brief."},
                             {"role": "user", "content": [{"type": "text", "text": "a"},
                                                          {"type": "text", "text": "b"}]}])
    assert checked.messages == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "ab"}]


def test_assistant_tool_calls_and_tool_results_render_for_the_template():
    checked = call(messages=[
        {"role": "user", "content": "price?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "lookup", "arguments": "{\"item\": \"pear\"}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "3 euros"}])
    assert checked.messages[1]["tool_calls"][0]["function"] == {"name": "lookup", "arguments": {"item": "pear"}}
    assert checked.messages[2] == {"role": "tool", "content": "3 euros", "tool_call_id": "c1"}


@pytest.mark.parametrize(("fields", "param", "status"), [
    ({"n": 2}, "n", 400), ({"logprobs": True}, "logprobs", 400), ({"frequency_penalty": 0.5}, "frequency_penalty", 400),
    ({"frobnicate": 1}, "frobnicate", 400), ({"model": "gpt-9"}, "model", 404),
    ({"messages": []}, "messages", 400), ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0]", 400),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "messages[0].content[0]", 400),
    ({"messages": [{"role": "tool", "content": "3"}]}, "messages[0].tool_call_id", 400),
    ({"max_tokens": 3, "max_completion_tokens": 4}, "max_completion_tokens", 400),
    ({"response_format": {"type": "yaml"}}, "response_format", 400),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]}, "tools", 400),
    ({"user": "../x"}, "session_id", 400),
])
def test_what_cannot_be_honoured_is_refused_naming_the_field(fields, param, status):
    with pytest.raises(RequestError) as refused:
        call(**fields)
    assert refused.value.param == param and refused.value.status == status
    assert refused.value.body()["error"]["param"] == param


def test_a_session_id_comes_from_the_header_then_the_body():
    assert call(header="h", session_id="s", prompt_cache_key="p", user="u").session_id == "h"
    assert call(session_id="s", prompt_cache_key="p", user="u").session_id == "s"
    assert call(prompt_cache_key="p", user="u").session_id == "p"
    assert call(user="u").session_id == "u" and call().session_id is None
    for bad in ("", ".hidden", "a/b", "a" * 129, "é"):
        with pytest.raises(RequestError, match="session id"):
            call(header=bad) if bad else call(session_id="../" + bad)


def test_a_text_completion_reads_its_prompt_as_it_is():
    checked = check_completion_request({"model": MODEL, "prompt": ["Once upon"], "max_tokens": 4, "echo": False},
                                       MODEL, 64, None)
    assert checked.text == "Once upon" and checked.options["max_tokens"] == 4
    for fields, param in [({"prompt": ["a", "b"]}, "prompt"), ({"prompt": ""}, "prompt"), ({"echo": True}, "echo"),
                          ({"best_of": 3}, "best_of"), ({"suffix": "x"}, "suffix"), ({"tools": []}, "tools")]:
        with pytest.raises(RequestError) as refused:
            check_completion_request({"model": MODEL, "prompt": "a", **fields}, MODEL, 64, None)
        assert refused.value.param == param


def test_ray_serve_refuses_bad_settings_before_a_cluster_starts(tmp_path, capsys):
    """`emllm serve --ray` checks its replica counts and the store's settings before ray.init; `build` (the
    entry of `serve run` configs) names what it does not know."""
    pytest.importorskip("ray", reason="the [ray] extra is not installed")
    from emllm_integrations.cli import main
    from emllm_integrations.serve.ray_serve import build

    assert main(["serve", "--ray", "--replicas", "0", "--sessions", str(tmp_path)]) == 2
    assert "--replicas must be >= 1" in capsys.readouterr().err
    assert main(["serve", "--ray", "--replicas", "2", "--max-replicas", "1", "--sessions", str(tmp_path)]) == 2
    with pytest.raises(ValueError, match=r"Unknown args \['replica'\]"):
        build({"sessions": "s3://bucket/x", "replica": 2})
    with pytest.raises(ValueError, match="no 'sessions' store"):
        build({"replicas": 2})


def test_resident_sessions_are_bounded_by_half_the_ram_unless_told_otherwise():
    """A session holds hundreds of MB; 64 of them unbounded outgrew a 24 GB machine (docs/notes/test-suite-time.md)."""
    import argparse
    import os

    from emllm_integrations.serve import settings_of

    args = argparse.Namespace(sessions="./s", api_key=[], max_resident_sessions=64, max_resident_gb=None,
                              max_body_mb=8.0, default_max_tokens=512, max_messages=256, max_concurrent=8,
                              store_timeout=30.0)
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert settings_of(args).max_resident_bytes == ram // 2 > 0
    args.max_resident_gb = 1.5
    assert settings_of(args).max_resident_bytes == int(1.5 * 2**30)
