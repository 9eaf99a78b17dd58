"""Answering chat completions in this process: one engine, its sessions and the anonymous pool (InProcess), and
one completion as it is read, decoded, saved and rendered in OpenAI's shapes (_Turn).

The HTTP app (app.py) serves any Backend; this is the one `emllm serve` runs, and the one each Ray Serve replica
runs inside (ray_serve.py). Turns run in the caller's threads, so concurrent conversations decode together through
emllm.batching (one forward per step), each with its own memory.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

from starlette.concurrency import run_in_threadpool

from emllm import EMConfig, EMEngine
from emllm.tools import InvalidToolCall, ReplyStream, ToolCall, ToolSchemas, parse_reply

from ..response_format import response_grammar, with_format_request
from ..sampling import sampling_options
from ..tool_choice import tool_decoding
from .app import ServeSettings
from .metrics import Metrics
from .openai_format import (ChatCall, Reply, RequestError, chunk, completion, completion_id, error_event,
                            invalid_call_text, message_of, text_completion, tool_call_json, usage)
from .sessions import Sessions

log = logging.getLogger("emllm.serve")


class InProcess:
    """The Backend that answers with an engine in this process: sessions kept in RAM and the store, and the
    Prometheus counters of what it reads and decodes."""

    def __init__(self, engine: EMEngine, config: EMConfig, settings: ServeSettings):
        self.engine, self.model = engine, engine.model_name
        self.sessions = Sessions(engine, config, settings.sessions, settings.max_resident_sessions,
                                 settings.max_resident_bytes, settings.store_timeout)
        self.metrics = Metrics(self.sessions)

    async def answer(self, call: ChatCall, space: str) -> Reply:
        """The completion (a stream: its server-sent events, decoded as they are read); RequestError, TypeError or
        ValueError when the engine refuses the call before reading anything."""
        turn = _Turn(self.engine, self.sessions, call, space, self.model, self.metrics)
        if call.stream:
            return Reply(events=turn.events())
        return Reply(body=await run_in_threadpool(turn.answer))

    async def describe(self, space: str, session_id: str) -> dict[str, Any] | None:
        return await run_in_threadpool(self.sessions.describe, space, session_id)

    async def forget(self, space: str, session_id: str) -> bool:
        return await run_in_threadpool(self.sessions.forget, space, session_id)

    def health(self) -> dict[str, Any]:
        return {"sessions_resident": self.sessions.resident}

    def close(self) -> None:
        """Every completed turn is already saved: closing frees RAM and disk pages only."""
        self.sessions.close()


class _Turn:
    """One chat completion: its options checked and its prompt built before anything is read."""

    def __init__(self, engine: EMEngine, sessions: Sessions, call: ChatCall, space: str, model: str,
                 metrics: Metrics):
        self.engine, self.sessions, self.call, self.space, self.model = engine, sessions, call, space, model
        self.metrics, self.text = metrics, call.text is not None
        try:
            options = sampling_options(call.options["max_tokens"], call.options["temperature"],
                                       call.options["top_p"], 0, call.options["seed"], call.options["stop"],
                                       call.options["reread"])
        except (TypeError, ValueError) as error:
            raise RequestError(str(error)) from None
        prompt: Any = call.text if call.text is not None else call.messages
        self.schemas = None
        if call.tools:
            try:
                options.update(tool_decoding(engine, call.tools, call.tool_choice))
            except ValueError as error:
                raise RequestError(str(error), param="tool_choice") from None
            self.schemas = ToolSchemas(call.tools)
        if call.response_format is not None:
            try:
                options["grammar"] = response_grammar(call.response_format)
            except ValueError as error:
                raise RequestError(str(error), param="response_format") from None
            prompt = with_format_request(prompt, call.response_format)
        self.options = options
        # tokenised once: the pool reads these ids, and the session saves the checkpoint that read them
        self.prompt = engine.encode_prompt(prompt, options.get("tools"))
        self.id = completion_id()

    def _generate(self) -> Iterator[Any]:
        """The text deltas of the answer, then (last) the GenerationResult; the session is held throughout and saved
        once the answer is complete."""
        if self.call.session_id is None:
            stream = self.sessions.anonymous.stream(self.prompt, **self.options)
            yield from stream
            self.sessions.anonymous_turn_ended()
            self.metrics.answered(stream.result)
            yield stream.result
            return
        with self.sessions.turn(self.space, self.call.session_id) as session:
            self.sessions.start_from_shared(session, self.prompt.ids)
            stream = session.pool.stream(self.prompt, **self.options)
            yield from stream
            result = stream.result
            # the checkpoint that read the prompt is saved, not the answered memory: a next request extends it either
            # way, and one that resends the same prompt (a retry after a lost response, a regenerated answer) extends
            # only it, so after a restart it is not re-read; restored, a next turn re-reads only the answer's tokens
            self.sessions.save(self.space, self.call.session_id, session, self.prompt.ids)
            self.metrics.answered(result)
            yield result

    def _message(self, result: Any) -> tuple[dict[str, Any], str | None]:
        """(the assistant message answered, "tool_calls" when it calls tools, else None)."""
        if self.schemas is None:
            return {"role": "assistant", "content": result.text}, None
        return message_of(parse_reply(result.text, self.schemas))

    def answer(self) -> dict[str, Any]:
        *_, result = self._generate()
        if self.text:
            return text_completion(self.id, self.model, result.text, result.finish_reason, result)
        message, calls = self._message(result)
        return completion(self.id, self.model, message, calls or result.finish_reason, result)

    def _parts(self) -> Iterator[Any]:
        """The answer as a client streams it: text pieces (with tools: text outside calls, each whole call once it
        closes, and a call that breaks its schema as text with the reason, as a whole answer keeps it), then, last,
        the GenerationResult."""
        replies = ReplyStream(self.schemas) if self.schemas else None
        for piece in self._generate():
            if not isinstance(piece, str):
                if replies:
                    yield from map(_text_unless_valid, replies.close())
                yield piece
                return
            yield from (map(_text_unless_valid, replies.feed(piece)) if replies else [piece])

    def events(self) -> Iterator[str]:
        """Server-sent events: the role, the text deltas (with tools: text pieces and each whole call), the finish
        reason, the usage when asked, and [DONE]. An error after the first event ends the stream with an error
        event in OpenAI's format."""
        if not self.text:
            yield chunk(self.id, self.model, {"role": "assistant", "content": ""})
        calls = 0
        try:
            for part in self._parts():
                if isinstance(part, ToolCall):
                    yield chunk(self.id, self.model, {"tool_calls": [{"index": calls, **tool_call_json(part)}]})
                    calls += 1
                elif isinstance(part, str):
                    if part:
                        yield chunk(self.id, self.model, {"content": part}, text=self.text)
                else:
                    result = part
        except Exception as error:  # the stream has begun: the error goes in the stream
            log.exception("streamed request failed")
            yield error_event(error)
            return
        yield chunk(self.id, self.model, {}, "tool_calls" if calls else result.finish_reason, text=self.text)
        if self.call.include_usage:
            yield chunk(self.id, self.model, {}, with_usage=usage(result), choices=False, text=self.text)
        yield "data: [DONE]\n\n"


def _text_unless_valid(part: str | ToolCall | InvalidToolCall) -> str | ToolCall:
    return invalid_call_text(part) if isinstance(part, InvalidToolCall) else part

