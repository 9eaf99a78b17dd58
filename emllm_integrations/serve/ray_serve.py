"""`emllm serve --ray`: the same app on Ray Serve, its sessions following their replica (the [ray] extra).

    emllm serve --ray --replicas 2 --sessions s3://bucket/sessions       # a local cluster, or --ray-address
    serve run deploy/ray-serve.yaml                                      # a real cluster: build() below

Two deployments:
- ``Ingress`` runs the app of `emllm serve` (app.create_app) as it is: the key, the body and the session id are
  checked there, before any replica works. Its Backend (ToReplicas) sends each turn to the model deployment with the
  session as Ray Serve's multiplexed model id, so a returning session lands on the replica that holds its memory.
- ``SessionReplica`` holds one engine and an InProcess backend, exactly what `emllm serve` runs. Its sessions are
  its multiplexed "models" (``@serve.multiplexed``): Ray Serve routes by them, and when a replica holds more than
  ``max_resident_sessions`` it drops the least recently used, which leaves RAM for the store (every completed turn
  is saved). A session new to a replica comes back from the shared store, so a replica's death loses no completed
  turn: the next turn is routed to another replica and read from the store there.

Every response names the replica that answered it in an ``X-Replica-Id`` header. Requests without a session go to
any replica. Ray Serve gives routing, replicas, autoscaling and the least-recently-used bookkeeping; this module
only maps sessions onto them.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
import threading
from collections.abc import AsyncIterator, Awaitable
from dataclasses import asdict, fields
from typing import Any, TypeVar

from emllm import DEFAULT_PRESET
from ray import serve
from ray.exceptions import RayActorError, RayTaskError
from ray.serve.exceptions import RayServeException
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator
from starlette.concurrency import run_in_threadpool

from .answers import InProcess
from .app import ServeSettings, close_events, create_app
from .metrics import Metrics
from .openai_format import ChatCall, Reply, RequestError, error_event, refusal
from .sessions import Sessions, StoreUnavailable

T = TypeVar("T")

REPLICA_HEADER = "X-Replica-Id"
ATTEMPTS = 3
"""Tries a turn gets when its replica is found dead before it began (Ray Serve starts a replacement, and its router
learns of the death meanwhile): the store holds every completed turn, so another replica answers alike."""


class HeldSession:
    """A session a replica holds, as Ray Serve's multiplexing sees it: dropping it (``__del__``, called by Ray
    Serve's least-recently-used eviction) lets the session leave the replica's RAM."""

    def __init__(self, sessions: Sessions, key: str):
        self.sessions, self.key, self.released = sessions, key, False

    def __del__(self) -> None:
        if not self.released:  # Ray Serve calls it on eviction; the collector may again later
            self.released = True
            self.sessions.retire(*self.key.split("/", 1))


class SessionReplica:
    """A model replica: the engine and the InProcess backend `emllm serve` runs; its sessions multiplexed."""

    def __init__(self, model: str | None, preset: str, engine_fields: dict[str, Any], settings: ServeSettings):
        from emllm import EMConfig

        from ..bench import config_overrides
        from .loading import prepared_engine

        config = EMConfig.from_preset(preset, **config_overrides(engine_fields))
        engine = prepared_engine(model, config)
        self.backend = InProcess(engine, config, settings)
        self._hold: Any = None
        try:
            self.replica = serve.get_replica_context().replica_tag
        except RayServeException:  # Ray Serve's local testing mode: one in-process replica, nothing to route
            self.replica = "local"
            return

        async def hold(key: str) -> HeldSession:
            return HeldSession(self.backend.sessions, key)

        self._hold = serve.multiplexed(max_num_models_per_replica=settings.max_resident_sessions)(hold)

    def model_name(self) -> str:
        return self.backend.model

    async def respond(self, call: ChatCall, space: str) -> AsyncIterator[Any]:
        """First a head (the replica, and the whole answer, or a refusal, or that a stream follows), then a
        stream's server-sent events, each read off the turn in a thread (a turn decodes in its caller's thread)."""
        if call.session_id is not None and self._hold is not None:
            await self._hold(f"{space}/{call.session_id}")
        try:
            reply = await self.backend.answer(call, space)
        except (TypeError, ValueError) as error:
            refused = refusal(error)
            if refused is None:
                raise
            yield {"replica": self.replica, "refused": refused.fields()}
            return
        if reply.events is None:
            yield {"replica": self.replica, "body": reply.body}
            return
        yield {"replica": self.replica, "stream": True}
        events = iter(reply.events)  # type: ignore[arg-type]  # InProcess streams synchronously
        try:
            while (event := await run_in_threadpool(next, events, None)) is not None:
                yield event
        finally:  # a client gone cancels this stream: its turn must still let its session go (app.EventStream)
            await close_events(events)

    async def describe(self, space: str, session_id: str) -> dict[str, Any] | None:
        info = await self.backend.describe(space, session_id)
        return None if info is None else {**info, "replica": self.replica}

    async def forget(self, space: str, session_id: str) -> bool:
        return await self.backend.forget(space, session_id)

    def __del__(self) -> None:
        backend = getattr(self, "backend", None)
        if backend is not None:
            backend.close()


class ToReplicas:
    """The ingress's Backend: each turn to the model deployment, routed by its session (multiplexed model id)."""

    def __init__(self, replicas: DeploymentHandle, model: str):
        self.replicas, self.model, self.metrics = replicas, model, Metrics()

    def _to(self, space: str, session_id: str | None) -> DeploymentHandle:
        key = "" if session_id is None else f"{space}/{session_id}"
        return self.replicas.options(multiplexed_model_id=key)

    async def answer(self, call: ChatCall, space: str) -> Reply:
        stream: Any = None
        for attempt in range(ATTEMPTS):
            stream = self._to(space, call.session_id).options(stream=True).respond.remote(call, space)
            try:
                head = await _from_replica(stream.__anext__())
                break
            except RayActorError:  # the replica died before the turn began: another one answers from the store
                if attempt == ATTEMPTS - 1:
                    raise
                await asyncio.sleep(1.0)
        headers = {REPLICA_HEADER: head["replica"]}
        if "refused" in head:
            raise RequestError(**head["refused"])
        if "body" in head:
            return Reply(body=head["body"], headers=headers)
        return Reply(events=_events(stream), headers=headers)

    async def describe(self, space: str, session_id: str) -> dict[str, Any] | None:
        return await _from_replica(self._to(space, session_id).describe.remote(space, session_id))

    async def forget(self, space: str, session_id: str) -> bool:
        return await _from_replica(self._to(space, session_id).forget.remote(space, session_id))

    def health(self) -> dict[str, Any]:
        return {"deployment": "ray-serve"}

    def close(self) -> None:
        """The replicas close with their deployment."""


async def _from_replica(result: Awaitable[T]) -> T:
    """A replica's answer. A store that timed out there is raised here as itself, so the app answers 503 with the
    replica's message (naming the store, the call and --store-timeout) rather than 500 with Ray's wrapper of it."""
    try:
        return await result
    except RayTaskError as error:
        if isinstance(error.cause, StoreUnavailable):
            raise error.cause from None
        raise


async def _events(stream: DeploymentResponseGenerator) -> AsyncIterator[str]:
    ended = False
    try:
        async for event in stream:
            yield event
        ended = True
    except Exception as error:  # the replica died mid-answer: the stream ends with an error event
        ended = True
        yield error_event(error)
    finally:
        if not ended:  # the client left (app.EventStream closes this): the replica's turn is cancelled, not left
            stream.cancel()  # holding its session


@serve.ingress()
class Ingress:
    """The HTTP app of `emllm serve`, answering through the model deployment."""

    async def __init__(self, replicas: DeploymentHandle, settings: ServeSettings):  # type: ignore[misc]  # Ray awaits it
        self.backend = ToReplicas(replicas, await replicas.model_name.remote())
        self.settings = settings

    def __serve_build_asgi_app__(self) -> Any:
        return create_app(self.backend, self.settings)


def application(settings: ServeSettings, model: str | None = None, preset: str = DEFAULT_PRESET,
                engine_fields: dict[str, Any] | None = None, replicas: int = 1, max_replicas: int | None = None,
                replica_cpus: float = 1.0) -> Any:
    """The Ray Serve application: the ingress over ``replicas`` model replicas (autoscaled up to ``max_replicas``
    by requests in flight when given). Each replica answers at most ``settings.max_concurrent`` requests at once,
    decoding them together."""
    check_replicas(replicas, max_replicas)
    autoscaling = None if max_replicas is None else {
        "min_replicas": replicas, "max_replicas": max_replicas,
        "target_ongoing_requests": max(1, settings.max_concurrent // 2)}
    model_replicas = serve.deployment(num_replicas="auto" if autoscaling else replicas, autoscaling_config=autoscaling,
                                      max_ongoing_requests=settings.max_concurrent,
                                      ray_actor_options={"num_cpus": replica_cpus})(SessionReplica)
    ingress = serve.deployment(max_ongoing_requests=4 * settings.max_concurrent,
                               ray_actor_options={"num_cpus": 0})(Ingress)
    return ingress.bind(model_replicas.bind(model, preset, engine_fields or {}, settings), settings)


def check_replicas(replicas: int, max_replicas: int | None) -> None:
    if replicas < 1 or (max_replicas is not None and max_replicas < replicas):
        raise ValueError(f"--replicas must be >= 1 and --max-replicas >= --replicas, got {replicas} and "
                         f"{max_replicas}.")


def build(args: dict[str, Any]) -> Any:
    """The application for `serve run` / `serve deploy` (import_path: emllm_integrations.serve.ray_serve:build):
    ``args`` are ``sessions`` (required: a store every node reaches, s3://...), ``model``, ``preset``,
    ``engine_fields``, ``replicas``, ``max_replicas``, ``replica_cpus``, and any ServeSettings field."""
    known = {f.name for f in fields(ServeSettings)}
    own = {"model", "preset", "engine_fields", "replicas", "max_replicas", "replica_cpus"}
    unknown = set(args) - known - own
    if unknown or "sessions" not in args:
        raise ValueError(f"Unknown args {sorted(unknown)} or no 'sessions' store; give sessions and any of "
                         f"{sorted((known | own) - {'sessions'})}.")
    given: dict[str, Any] = {k: tuple(v) if k == "api_keys" else v for k, v in args.items() if k in known}
    settings = ServeSettings(**given)
    return application(settings, **{k: v for k, v in args.items() if k in own})


def run(args: argparse.Namespace, settings: ServeSettings) -> int:
    """`emllm serve --ray`: join or start a Ray cluster, run the application, serve until SIGINT/SIGTERM."""
    import ray

    check_replicas(args.replicas, args.max_replicas)  # before a cluster starts
    if args.ray_address is None and "://" not in settings.sessions:
        print("note: a local --sessions folder is shared only by replicas on this machine; on a cluster give a store "
              "every node reaches (s3://bucket/prefix).", file=sys.stderr)
    if args.ray_address:
        ray.init(address=args.ray_address, include_dashboard=False)
    else:
        ray.init(include_dashboard=False, _node_ip_address="127.0.0.1")
    serve.start(http_options={"host": args.host, "port": args.port})
    serve.run(application(settings, args.model, args.preset, args.engine_fields(args), args.replicas,
                          args.max_replicas), name="emllm", route_prefix="/")
    print(f"serving on http://{args.host}:{args.port}/v1 through Ray Serve ({args.replicas} replicas, "
          f"{asdict(settings)['sessions']})", file=sys.stderr, flush=True)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    serve.shutdown()  # replicas finish or fail their open requests; every completed turn is saved
    ray.shutdown()
    return 0
