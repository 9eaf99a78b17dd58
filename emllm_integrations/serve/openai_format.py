"""OpenAI's chat-completions format: checking a request into what the engine needs, and building its responses.

Everything a request asks that the server cannot do (``n`` > 1, log-probabilities, images, audio) is refused with a
400 naming the field, never ignored; so is any field OpenAI's API does not define, but ``reread`` (this server's
one extension, sent with ``extra_body`` by OpenAI's clients: answer from the retrieved events re-read as text).
"""

from __future__ import annotations

import json
import re
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any

from emllm.tools import InvalidToolCall, ParsedReply, ToolCall, check_tools

SESSION_ID = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,127}")
"""A session id: letters, digits, '.', '_' and '-', up to 128, not starting with '.': a file name in the store."""

_IGNORED = {"user", "metadata", "store", "service_tier", "parallel_tool_calls", "stream_options", "session_id",
            "prompt_cache_key", "model"}
"""Fields read elsewhere (session ids, the model, the stream's usage chunk) or that change nothing here."""
_SAMPLING = {"messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "seed", "stop", "stream",
             "tools", "tool_choice", "response_format", "reread"}
_UNSUPPORTED = {"n": 1, "logprobs": False, "top_logprobs": None, "logit_bias": None, "presence_penalty": 0,
                "frequency_penalty": 0, "audio": None, "modalities": None, "prediction": None,
                "reasoning_effort": None, "web_search_options": None, "functions": None, "function_call": None}
"""Fields the server cannot honour, with the only value it accepts for each (the default OpenAI gives them)."""


class RequestError(ValueError):
    """A request refused in OpenAI's error format: ``status`` (400, 401, 404, 413, 429), ``param`` (the field)."""

    def __init__(self, message: str, status: int = 400, param: str | None = None,
                 code: str | None = None, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.param, self.code, self.kind = status, param, code, kind

    def body(self) -> dict[str, Any]:
        return error_body(str(self), self.kind, self.param, self.code)

    def fields(self) -> dict[str, Any]:
        """What rebuilds it (RequestError(**fields)) on the other side of a process boundary."""
        return {"message": str(self), "status": self.status, "param": self.param, "code": self.code,
                "kind": self.kind}


def refusal(error: Exception) -> RequestError | None:
    """The 400 a request gets for ``error``: itself when a RequestError; a TypeError or ValueError the engine raised
    refusing the call before reading anything, with its message; None for any other failure (a 500)."""
    if isinstance(error, RequestError):
        return error
    return RequestError(str(error)) if isinstance(error, (TypeError, ValueError)) else None


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    """OpenAI's error object."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_event(error: BaseException) -> str:
    """The server-sent event that ends a stream which failed after it began (its status is already sent)."""
    return f"data: {json.dumps(error_body(f'{type(error).__name__}: {error}', 'server_error'))}\n\n"


@dataclass
class Reply:
    """How a backend answers a completion: a whole body, or server-sent events (an iterator, sync or async), and
    headers to send with either (X-Replica-Id)."""
    body: dict[str, Any] | None = None
    events: Iterator[str] | AsyncIterator[str] | None = None
    headers: dict[str, str] = field(default_factory=dict)


@dataclass
class ChatCall:
    """A checked chat-completions request."""
    messages: list[dict[str, Any]]
    options: dict[str, Any]                   # sampling options for MemoryPool.stream (sampling.sampling_options)
    stream: bool = False
    include_usage: bool = False
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    response_format: dict[str, Any] | None = None
    session_id: str | None = None
    text: str | None = None                   # /v1/completions: the raw prompt, read without the chat template


def check_chat_request(body: Any, served_model: str, default_max_tokens: int, session_header: str | None
                       ) -> ChatCall:
    """The request as a ChatCall, or RequestError naming the field. Sampling values themselves are checked where
    they are used (sampling.sampling_options), before anything is read."""
    _check_fields(body, _SAMPLING, _UNSUPPORTED)
    model = body.get("model")
    if model is not None and model != served_model:
        raise RequestError(f"The model {model!r} does not exist here; this server serves {served_model!r} "
                           "(GET /v1/models).", status=404, param="model", code="model_not_found")
    messages = _check_messages(body.get("messages"))
    if "max_tokens" in body and "max_completion_tokens" in body:
        raise RequestError("Give max_tokens or max_completion_tokens, not both.", param="max_completion_tokens")
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]  # OpenAI: a string is one stop sequence
    stream_options = body.get("stream_options") or {}
    if not isinstance(stream_options, dict):
        raise RequestError("stream_options must be an object.", param="stream_options")
    tools = body.get("tools")
    if tools is not None:
        tools = _check_tools(tools)
    response_format = body.get("response_format")
    if response_format is not None and (not isinstance(response_format, dict)
                                        or response_format.get("type") not in ("text", "json_object", "json_schema")):
        raise RequestError("response_format.type must be 'text', 'json_object' or 'json_schema'.",
                           param="response_format")
    if response_format is not None and response_format["type"] == "text":
        response_format = None
    reread = False if body.get("reread") is None else body["reread"]
    if not isinstance(reread, bool):
        raise RequestError(f"reread must be true or false (true: answer from the retrieved events re-read as text, "
                           f"slower, better on questions that ask for several items), got {reread!r}.", param="reread")
    session = session_header or body.get("session_id") or body.get("prompt_cache_key") or body.get("user")
    if session is not None and (not isinstance(session, str) or not SESSION_ID.fullmatch(session)):
        raise RequestError("A session id (X-Session-Id, session_id, prompt_cache_key or user) is 1-128 letters, "
                           "digits, '.', '_' or '-', not starting with '.'.", param="session_id")
    return ChatCall(
        messages=messages,
        options={"max_tokens": default_max_tokens if max_tokens is None else max_tokens,
                 "temperature": body.get("temperature", 1.0) if body.get("temperature") is not None else 1.0,
                 "top_p": body.get("top_p") if body.get("top_p") is not None else 1.0,
                 "seed": body.get("seed"), "stop": stop, "reread": reread},
        stream=bool(body.get("stream", False)), include_usage=bool(stream_options.get("include_usage", False)),
        tools=tools, tool_choice=body.get("tool_choice"), response_format=response_format, session_id=session)


_TEXT_FIELDS = {"prompt", "max_tokens", "temperature", "top_p", "seed", "stop", "stream", "reread"}
_TEXT_UNSUPPORTED = {"n": 1, "best_of": 1, "echo": False, "logprobs": None, "suffix": None, "logit_bias": None,
                     "presence_penalty": 0, "frequency_penalty": 0}


def check_completion_request(body: Any, served_model: str, default_max_tokens: int, session_header: str | None
                             ) -> ChatCall:
    """A /v1/completions request (what OpenAILike(is_chat_model=False) sends) as a ChatCall whose ``prompt`` is the
    raw text: read as it is, without the chat template."""
    _check_fields(body, _TEXT_FIELDS, _TEXT_UNSUPPORTED)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str) or not prompt:
        raise RequestError("prompt must be one non-empty string (several prompts in one request are not supported).",
                           param="prompt")
    chat = check_chat_request({**{k: v for k, v in body.items() if k not in _TEXT_UNSUPPORTED and k != "prompt"},
                               "messages": [{"role": "user", "content": prompt}]},
                              served_model, default_max_tokens, session_header)
    chat.text = prompt
    return chat


def _check_fields(body: Any, used: set[str], unsupported: dict[str, Any]) -> None:
    """Refuse a body that is not an object, a field OpenAI's API does not define for this route, and a field the
    server cannot honour set to anything but its default."""
    if not isinstance(body, dict):
        raise RequestError("The request body must be a JSON object.")
    unknown = sorted(set(body) - _IGNORED - used - set(unsupported))
    if unknown:
        raise RequestError(f"Unrecognized request argument supplied: {unknown[0]}", param=unknown[0])
    for name, accepted in unsupported.items():
        if name in body and body[name] != accepted and not (accepted is None and body[name] is None):
            raise RequestError(f"{name}={body[name]!r} is not supported by this server (only {accepted!r}).",
                               param=name)


def _check_messages(messages: Any) -> list[dict[str, Any]]:
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages must be a non-empty list.", param="messages")
    checked = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in ("system", "developer", "user", "assistant",
                                                                         "tool"):
            raise RequestError(f"messages[{i}] must be an object whose role is system, developer, user, assistant "
                               "or tool.", param=f"messages[{i}]")
        role = "system" if message["role"] == "developer" else message["role"]
        out: dict[str, Any] = {"role": role, "content": _text_of(message.get("content"), i)}
        if role == "assistant" and message.get("tool_calls"):
            out["tool_calls"] = _engine_tool_calls(message["tool_calls"], i)
        if role == "tool":
            if not isinstance(message.get("tool_call_id"), str):
                raise RequestError(f"messages[{i}] (a tool result) needs its tool_call_id.",
                                   param=f"messages[{i}].tool_call_id")
            out["tool_call_id"] = message["tool_call_id"]
        checked.append(out)
    return checked


def _text_of(content: Any, i: int) -> str:
    """A message's text: a string, or a list of text parts (anything else, an image, is refused)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise RequestError(f"messages[{i}].content[{j}] is of type {kind!r}; this server reads text only.",
                                   param=f"messages[{i}].content[{j}]")
            texts.append(part["text"])
        return "".join(texts)
    raise RequestError(f"messages[{i}].content must be a string or a list of text parts.",
                       param=f"messages[{i}].content")


def _engine_tool_calls(calls: Any, i: int) -> list[dict[str, Any]]:
    """An assistant message's tool calls as the chat template renders them (arguments as an object)."""
    out = []
    for call in calls if isinstance(calls, list) else [None]:
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(call, dict) or not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise RequestError(f"messages[{i}].tool_calls holds a call without a function name.",
                               param=f"messages[{i}].tool_calls")
        arguments = function.get("arguments", "{}")
        try:
            arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
        except json.JSONDecodeError:
            raise RequestError(f"messages[{i}].tool_calls: the arguments of {function['name']!r} are not JSON.",
                               param=f"messages[{i}].tool_calls") from None
        out.append({"id": call.get("id"), "type": "function",
                    "function": {"name": function["name"], "arguments": arguments}})
    return out


def _check_tools(tools: Any) -> list[dict[str, Any]]:
    try:
        return check_tools(tools)
    except (TypeError, ValueError) as error:
        raise RequestError(str(error), param="tools") from None


# ---------------------------------------------------------------------------------------- responses
def completion_id() -> str:
    return f"chatcmpl-{uuid.uuid4().hex}"


def usage(result: Any) -> dict[str, Any]:
    """OpenAI's usage, with the prompt tokens the memory already held as cached_tokens."""
    return {"prompt_tokens": result.input_tokens, "completion_tokens": result.output_tokens,
            "total_tokens": result.input_tokens + result.output_tokens,
            "prompt_tokens_details": {"cached_tokens": result.input_tokens - result.new_input_tokens}}


def message_of(reply: ParsedReply) -> tuple[dict[str, Any], str | None]:
    """(the assistant message, "tool_calls" when it calls tools, else None) from a parsed reply. Calls that break
    their schema are not passed on as calls: their text stays in the content, so nothing is lost."""
    message: dict[str, Any] = {"role": "assistant", "content": reply.content or None}
    if reply.invalid:
        kept = "\n".join(invalid_call_text(call) for call in reply.invalid)
        message["content"] = f"{reply.content}\n{kept}".strip()
    if reply.calls:
        message["tool_calls"] = [tool_call_json(call) for call in reply.calls]
        return message, "tool_calls"
    if message["content"] is None:
        message["content"] = ""
    return message, None


def invalid_call_text(call: InvalidToolCall) -> str:
    """A call that breaks its schema, passed on as text with the reason (never as a call, never dropped)."""
    return f"<tool_call>{call.text}</tool_call> ({call.error})"


def tool_call_json(call: ToolCall) -> dict[str, Any]:
    """A tool call as OpenAI's API sends it: its arguments a JSON string."""
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": json.dumps(call.arguments)}}


def completion(call_id: str, model: str, message: dict[str, Any], finish_reason: str, result: Any
               ) -> dict[str, Any]:
    return {"id": call_id, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "message": message, "finish_reason": finish_reason, "logprobs": None}],
            "usage": usage(result)}


def text_completion(call_id: str, model: str, text: str, finish_reason: str, result: Any) -> dict[str, Any]:
    return {"id": call_id, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "text": text, "finish_reason": finish_reason, "logprobs": None}],
            "usage": usage(result)}


def chunk(call_id: str, model: str, delta: dict[str, Any], finish_reason: str | None = None,
          with_usage: dict[str, Any] | None = None, choices: bool = True, text: bool = False) -> str:
    """One server-sent event of a streamed completion (``text``: of /v1/completions, whose choices carry text)."""
    choice: dict[str, Any] = {"index": 0, "finish_reason": finish_reason, "logprobs": None}
    if text:
        choice["text"] = delta.get("content", "")
    else:
        choice["delta"] = delta
    body: dict[str, Any] = {"id": call_id, "object": "text_completion" if text else "chat.completion.chunk",
                            "created": int(time.time()), "model": model, "choices": [choice] if choices else []}
    if with_usage is not None:
        body["usage"] = with_usage
    return f"data: {json.dumps(body)}\n\n"
