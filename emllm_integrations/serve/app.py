"""The OpenAI-compatible HTTP app: FastAPI routes over one engine, its sessions and the anonymous pool.

Requests run in FastAPI's thread pool, so concurrent conversations decode together through emllm.batching (one
forward per step), each with its own memory. A request's failure is its own: it is answered in OpenAI's error
format and the server goes on.
"""

from __future__ import annotations

import json
import logging
import secrets
import threading
import time
import weakref
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from emllm import EMConfig, EMEngine
from emllm.tools import InvalidToolCall, ReplyStream, ToolCall, ToolSchemas, parse_reply

from ..response_format import response_grammar, with_format_request
from ..sampling import sampling_options
from ..tool_choice import tool_decoding
from .metrics import Metrics
from .openai_format import (SESSION_ID, ChatCall, RequestError, check_chat_request, check_completion_request, chunk,
                            completion, completion_id, error_body, invalid_call_text, message_of, text_completion,
                            tool_call_json, usage)
from .sessions import Sessions, namespace

log = logging.getLogger("emllm.serve")


@dataclass(frozen=True)
class ServeSettings:
    """What `emllm serve` is started with."""
    sessions: str                         # the session store: a local directory
    api_keys: tuple[str, ...] = ()        # when any: one of them is required as a bearer token
    max_resident_sessions: int = 64       # sessions kept in RAM; the rest come back from the store
    max_resident_bytes: int | None = None  # RAM their stored KV may take (MemoryPool.kv_bytes), else no limit
    max_body_bytes: int = 8 * 2**20       # larger requests get 413
    default_max_tokens: int = 512         # when a request gives neither max_tokens nor max_completion_tokens
    max_messages: int = 1000              # more messages in one request get 413
    max_concurrent: int = 32              # requests answered at once; more get 429 with Retry-After


def create_app(engine: EMEngine, config: EMConfig, settings: ServeSettings) -> FastAPI:
    """The app serving ``engine`` with memories of ``config``."""
    sessions = Sessions(engine, config, settings.sessions, settings.max_resident_sessions,
                        settings.max_resident_bytes)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        sessions.close()  # every completed turn is already saved: closing frees RAM and disk pages only

    app = FastAPI(title="emllm serve", docs_url=None, redoc_url=None, lifespan=lifespan)
    model = engine.model_name
    metrics = Metrics(sessions)
    app.state.sessions = sessions

    @app.middleware("http")
    async def guard(request: Request, call_next: Any) -> Any:
        """The key and the body size, before a route reads anything."""
        if settings.api_keys and request.url.path.startswith("/v1/"):
            given = request.headers.get("authorization", "").encode()
            if not any(secrets.compare_digest(given, f"Bearer {key}".encode()) for key in settings.api_keys):
                return _error(RequestError("Incorrect or missing API key: send Authorization: Bearer KEY.",
                                           status=401, code="invalid_api_key"))
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > settings.max_body_bytes:
            return _error(RequestError(f"The request body is {int(length):,} bytes, over this server's "
                                       f"{settings.max_body_bytes:,}.", status=413))
        started = time.perf_counter()
        response = await call_next(request)
        name = getattr(request.scope.get("route"), "path", "unmatched")  # the route's template, not the session id
        metrics.requests.labels(name, str(response.status_code)).inc()
        metrics.latency.labels(name).observe(time.perf_counter() - started)
        return response

    @app.get("/health")
    def health() -> dict[str, Any]:
        return {"status": "ok", "model": model, "sessions_resident": sessions.resident}

    @app.get("/metrics")
    def prometheus() -> Response:
        return Response(metrics.text(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": model, "object": "model", "created": 0, "owned_by": "emllm"}]}

    @app.get("/v1/sessions/{session_id}")
    def get_session(session_id: str, request: Request) -> Any:
        _check_session_id(session_id)
        info = sessions.describe(_space(request, settings), session_id)
        if info is None:
            return _error(RequestError(f"No session {session_id!r}.", status=404, code="session_not_found"))
        return info

    @app.delete("/v1/sessions/{session_id}")
    def delete_session(session_id: str, request: Request) -> Any:
        _check_session_id(session_id)
        if not sessions.forget(_space(request, settings), session_id):
            return _error(RequestError(f"No session {session_id!r}.", status=404, code="session_not_found"))
        return {"id": session_id, "object": "session", "deleted": True}

    slots = threading.BoundedSemaphore(settings.max_concurrent)

    async def complete(request: Request, check: Any) -> Any:
        """A completion route: the body checked by ``check`` (its OpenAI shape), then answered or streamed, holding
        one of max_concurrent slots until its answer ends."""
        try:
            body = await request.json()
        except ValueError:
            return _error(RequestError("The request body is not valid JSON."))
        if isinstance(body, dict) and isinstance(body.get("messages"), list) \
                and len(body["messages"]) > settings.max_messages:
            return _error(RequestError(f"{len(body['messages'])} messages are more than this server's "
                                       f"{settings.max_messages}.", status=413, param="messages"))
        if not slots.acquire(blocking=False):
            return _error(RequestError(f"The server is answering {settings.max_concurrent} requests; retry shortly.",
                                       status=429, code="rate_limit_exceeded"), {"Retry-After": "1"})
        slot = _Slot(slots)
        try:
            call = check(body, model, settings.default_max_tokens, request.headers.get("x-session-id"))
            turn = _Turn(engine, sessions, call, _space(request, settings), model, metrics)
            if call.stream:
                return StreamingResponse(slot.held_by(turn.events()), media_type="text/event-stream")
            return await _in_thread(turn.answer)
        except RequestError as error:
            return _error(error)
        except (TypeError, ValueError) as error:  # refused by the engine before it read anything
            return _error(RequestError(str(error)))
        finally:
            slot.release_unless_held()

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Any:
        return await complete(request, check_chat_request)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        """Plain-text completion (OpenAILike(is_chat_model=False)): the prompt read as it is, no chat template."""
        return await complete(request, check_completion_request)

    @app.exception_handler(RequestError)
    async def refused(request: Request, error: RequestError) -> JSONResponse:
        return _error(error)

    @app.exception_handler(Exception)
    async def failed(request: Request, error: Exception) -> JSONResponse:
        log.exception("request failed")
        return JSONResponse(error_body(f"The server failed on this request: {type(error).__name__}: {error}",
                                       "server_error"), status_code=500)

    return app


class _Turn:
    """One chat completion: its options checked and its prompt built before anything is read."""

    def __init__(self, engine: EMEngine, sessions: Sessions, call: ChatCall, space: str, model: str,
                 metrics: Metrics):
        self.engine, self.sessions, self.call, self.space, self.model = engine, sessions, call, space, model
        self.metrics, self.text = metrics, call.text is not None
        try:
            options = sampling_options(call.options["max_tokens"], call.options["temperature"],
                                       call.options["top_p"], 0, call.options["seed"], call.options["stop"])
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
            yield f"data: {json.dumps(error_body(f'{type(error).__name__}: {error}', 'server_error'))}\n\n"
            return
        yield chunk(self.id, self.model, {}, "tool_calls" if calls else result.finish_reason, text=self.text)
        if self.call.include_usage:
            yield chunk(self.id, self.model, {}, with_usage=usage(result), choices=False, text=self.text)
        yield "data: [DONE]\n\n"


def _text_unless_valid(part: str | ToolCall | InvalidToolCall) -> str | ToolCall:
    return invalid_call_text(part) if isinstance(part, InvalidToolCall) else part


def _space(request: Request, settings: ServeSettings) -> str:
    """The caller's namespace: its key's (checked by the guard), or the public one when the server has no keys."""
    if not settings.api_keys:
        return namespace(None)
    return namespace(request.headers.get("authorization", "").removeprefix("Bearer "))


def _check_session_id(session_id: str) -> None:
    if not SESSION_ID.fullmatch(session_id):
        raise RequestError("A session id is 1-128 letters, digits, '.', '_' or '-', not starting with '.'.",
                           param="session_id")


def _error(error: RequestError, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=headers)


class _Slot:
    """One of max_concurrent places, given back exactly once: when the answer ends, or, for a stream, when the
    stream ends however it ends (a client gone, or a stream never started and dropped)."""

    def __init__(self, slots: threading.BoundedSemaphore):
        self._slots, self._held, self._released = slots, False, False
        self._lock = threading.Lock()

    def release(self) -> None:
        with self._lock:
            if not self._released:
                self._released = True
                self._slots.release()

    def release_unless_held(self) -> None:
        if not self._held:
            self.release()

    def held_by(self, events: Iterator[str]) -> Iterator[str]:
        self._held = True

        def stream() -> Iterator[str]:
            try:
                yield from events
            finally:
                self.release()

        held = stream()
        weakref.finalize(held, self.release)
        return held


async def _in_thread(function: Any) -> Any:
    """Run blocking work in the thread pool: the event loop keeps serving other requests meanwhile."""
    from starlette.concurrency import run_in_threadpool

    return await run_in_threadpool(function)
