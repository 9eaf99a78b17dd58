"""The OpenAI-compatible HTTP app: FastAPI routes over a Backend, which answers the completions.

`emllm serve` runs it over InProcess (answers.py: one engine, its sessions); under Ray Serve the same app is the
ingress and its Backend routes each session's turns to the replica holding it (ray_serve.py). The app checks what
needs no model (the key, the body's size and shape, the session id) before a backend sees a request; a request's
failure is its own: it is answered in OpenAI's error format and the server goes on.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
import types
import weakref
from collections.abc import AsyncGenerator, AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, Protocol

import anyio
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from .metrics import Metrics
from .openai_format import (SESSION_ID, ChatCall, Reply, RequestError, check_chat_request, check_completion_request,
                            error_body, refusal)
from .defaults import STORE_TIMEOUT_S
from .sessions import StoreUnavailable, namespace

log = logging.getLogger("emllm.serve")


@dataclass(frozen=True)
class ServeSettings:
    """What `emllm serve` is started with."""
    sessions: str                         # the session store: a local directory
    api_keys: tuple[str, ...] = ()        # when any: one of them is required as a bearer token
    max_resident_sessions: int = 64       # sessions kept in RAM; the rest come back from the store
    max_resident_bytes: int | None = None  # RAM their memories may take (MemoryPool.held_bytes), else no limit
    max_body_bytes: int = 8 * 2**20       # larger requests get 413
    default_max_tokens: int = 512         # when a request gives neither max_tokens nor max_completion_tokens
    max_messages: int = 1000              # more messages in one request get 413
    max_concurrent: int = 32              # requests answered at once; more get 429 with Retry-After
    store_timeout: float | None = STORE_TIMEOUT_S  # one call to a remote store, seconds; past it the turn gets 503


class Backend(Protocol):
    """What answers the app's completions and sessions: InProcess (answers.py) or a Ray Serve deployment's handle
    (ray_serve.py). ``metrics`` is the app's Prometheus registry owner: the app counts requests on it."""
    model: str
    metrics: Metrics

    async def answer(self, call: ChatCall, space: str) -> Reply: ...

    async def describe(self, space: str, session_id: str) -> dict[str, Any] | None: ...

    async def forget(self, space: str, session_id: str) -> bool: ...

    def health(self) -> dict[str, Any]: ...

    def close(self) -> None: ...


def create_app(backend: Backend, settings: ServeSettings) -> FastAPI:
    """The app answering through ``backend``."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        backend.close()

    app = FastAPI(title="emllm serve", docs_url=None, redoc_url=None, lifespan=lifespan)
    model, metrics = backend.model, backend.metrics
    app.state.backend = backend

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
        return {"status": "ok", "model": model, **backend.health()}

    @app.get("/metrics")
    def prometheus() -> Response:
        return Response(metrics.text(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": model, "object": "model", "created": 0, "owned_by": "emllm"}]}

    @app.get("/v1/sessions/{session_id}")
    async def get_session(session_id: str, request: Request) -> Any:
        _check_session_id(session_id)
        info = await backend.describe(_space(request, settings), session_id)
        if info is None:
            return _error(RequestError(f"No session {session_id!r}.", status=404, code="session_not_found"))
        return info

    @app.delete("/v1/sessions/{session_id}")
    async def delete_session(session_id: str, request: Request) -> Any:
        _check_session_id(session_id)
        if not await backend.forget(_space(request, settings), session_id):
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
            reply = await backend.answer(call, _space(request, settings))
            if reply.events is not None:
                return EventStream(slot.held_by(reply.events), headers=reply.headers)
            return JSONResponse(reply.body, headers=reply.headers)
        except (TypeError, ValueError) as error:  # RequestError, or the engine refusing before it read anything
            refused = refusal(error)
            if refused is None:
                raise
            return _error(refused)
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

    @app.exception_handler(StoreUnavailable)
    async def store_unavailable(request: Request, error: StoreUnavailable) -> JSONResponse:
        log.error("%s", error)
        return JSONResponse(error_body(str(error), "server_error", code="session_store_unavailable"),
                            status_code=503, headers={"Retry-After": "30"})

    @app.exception_handler(Exception)
    async def failed(request: Request, error: Exception) -> JSONResponse:
        log.exception("request failed")
        return JSONResponse(error_body(f"The server failed on this request: {type(error).__name__}: {error}",
                                       "server_error"), status_code=500)

    return app


def _space(request: Request, settings: ServeSettings) -> str:
    """The caller's namespace: its key's (checked by the guard), or the public one when the server has no keys."""
    if not settings.api_keys:
        return namespace(None)
    return namespace(request.headers.get("authorization", "").removeprefix("Bearer "))


def _check_session_id(session_id: str) -> None:
    if not SESSION_ID.fullmatch(session_id):
        raise RequestError("A session id is 1-128 letters, digits, '.', '_' or '-', not starting with '.'.",
                           param="session_id")


class EventStream(StreamingResponse):
    """A streamed answer whose events are closed when the response ends, however it ends. A turn's events hold its
    session until they are closed; a client that disconnects mid-stream leaves Starlette's iteration of them cut
    but not closed, and they would hold the session until the garbage collector found them (on an idle server,
    never): every later turn of that session would wait behind them."""

    def __init__(self, events: Iterator[str] | AsyncIterator[str], headers: dict[str, str] | None = None):
        super().__init__(events, media_type="text/event-stream", headers=headers)
        self._events = events

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await close_events(self._events)


async def close_events(events: Any) -> None:
    """Close a stream's events (a generator, or an async generator) even inside a cancelled request: closing runs
    the turn's own cleanup (its memory let go, its session released), which must happen whatever cut the stream."""
    with anyio.CancelScope(shield=True):
        if isinstance(events, AsyncGenerator):
            await events.aclose()
        elif isinstance(events, types.GeneratorType):
            await anyio.to_thread.run_sync(close_when_idle, events)


def close_when_idle(events: types.GeneratorType) -> None:
    """Close a generator once the step it may be running in another thread has ended (a step reads a prompt or
    decodes a token: it cannot be cut). Ray delivers a cancellation to a replica's stream while its worker thread
    is still inside the generator, where close() would raise 'generator already executing' and leave the turn
    holding its session; nobody steps it again after the stream is cut, so waiting for the step is enough."""
    while events.gi_running:
        time.sleep(0.01)
    events.close()


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

    def held_by(self, events: Iterator[str] | AsyncIterator[str]) -> Iterator[str] | AsyncIterator[str]:
        self._held = True
        held: Iterator[str] | AsyncIterator[str]
        if isinstance(events, AsyncIterator):
            async def async_stream() -> AsyncIterator[str]:
                try:
                    async for event in events:
                        yield event
                finally:
                    self.release()
                    await close_events(events)

            held = async_stream()
        else:
            def stream() -> Iterator[str]:
                try:
                    yield from events
                finally:
                    self.release()

            held = stream()
        weakref.finalize(held, self.release)
        return held
