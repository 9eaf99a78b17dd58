"""`emllm serve`: an OpenAI-compatible server whose conversations keep their episodic memory across requests and
restarts (FastAPI + uvicorn; the optional extra ``[serve]``).

    emllm serve --model smollm2 --port 8000 --sessions ./sessions

    from openai import OpenAI
    client = OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="unused")
    client.chat.completions.create(model=..., messages=[...], extra_headers={"X-Session-Id": "alice"})
"""

from __future__ import annotations

import argparse
import faulthandler
import os
import signal
import sys
from typing import Any

from .defaults import STORE_TIMEOUT_S

# The app itself: emllm_integrations.serve.app (needs the [serve] extra).
__all__ = ["add_parser", "serve", "settings_of"]

INSTALL = "pip install 'emllm-integrations[serve]'"


def add_parser(sub: Any, common: Any, engine_fields: Any) -> None:
    """The `serve` subcommand of the `emllm` command line; ``common`` adds the model and engine flags, and
    ``engine_fields(args)`` reads them back."""
    parser = sub.add_parser("serve", help="an OpenAI-compatible server whose sessions keep their memory")
    common(parser)
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--sessions", default="./emllm-sessions",
                        help="the session store: a directory (default ./emllm-sessions)")
    parser.add_argument("--api-key", action="append", default=[],
                        help="require this bearer key (repeat for several); each key has its own sessions")
    parser.add_argument("--max-resident-sessions", type=int, default=64,
                        help="sessions kept in RAM; the others come back from the store (default 64)")
    parser.add_argument("--max-resident-gb", type=float, default=None,
                        help="RAM the resident sessions' memories may take (windows, caches, indexes, KV pages); past "
                             "it the least recently used leave RAM for the store (default: half the machine's RAM)")
    parser.add_argument("--max-body-mb", type=float, default=8.0, help="larger request bodies get 413 (default 8)")
    parser.add_argument("--default-max-tokens", type=int, default=512,
                        help="answer length when a request gives none (default 512)")
    parser.add_argument("--max-messages", type=int, default=1000, help="messages per request (default 1000)")
    parser.add_argument("--max-concurrent", type=int, default=32,
                        help="requests answered at once; more get 429 with Retry-After (default 32)")
    parser.add_argument("--store-timeout", type=float, default=STORE_TIMEOUT_S,
                        help="seconds one call to a remote --sessions store (s3://...) may take before the turn "
                             "waiting on it fails with 503; the session stays as its last completed turn saved it "
                             f"(default {STORE_TIMEOUT_S:g})")
    scale = parser.add_argument_group("scaling out on Ray Serve (the [ray] extra; sessions follow their replica)")
    scale.add_argument("--ray", action="store_true",
                       help="serve through Ray Serve: replicas of the model, each session routed to the replica "
                            "holding it (use a shared --sessions store, e.g. s3://bucket/prefix, across machines)")
    scale.add_argument("--replicas", type=int, default=1, help="model replicas (default 1)")
    scale.add_argument("--max-replicas", type=int, default=None,
                       help="autoscale between --replicas and this many by requests in flight (default: fixed)")
    scale.add_argument("--ray-address", default=None,
                       help="join this Ray cluster (default: start a local one on 127.0.0.1)")
    parser.set_defaults(run=serve, engine_fields=engine_fields)


def serve(args: argparse.Namespace) -> int:
    """Load the model, then serve until SIGINT/SIGTERM (uvicorn finishes open requests first); with --ray, the same
    app on Ray Serve (ray_serve.run)."""
    try:
        import uvicorn

        from .answers import InProcess
        from .app import create_app
    except ImportError as error:
        print(f"emllm serve needs FastAPI and uvicorn ({error}): {INSTALL}", file=sys.stderr)
        return 2
    from emllm import EMConfig

    from ..bench import config_overrides

    config = EMConfig.from_preset(args.preset, **config_overrides(args.engine_fields(args)))  # refused before loading
    settings = settings_of(args)
    if args.ray:
        try:
            from .ray_serve import run
        except ImportError as error:
            print(f"emllm serve --ray needs Ray Serve ({error}): pip install 'emllm-integrations[ray]'",
                  file=sys.stderr)
            return 2
        return run(args, settings)
    from .loading import prepared_engine

    from .sessions import StoreUnavailable

    engine = prepared_engine(args.model, config)
    try:
        backend = InProcess(engine, config, settings)
    except StoreUnavailable as error:  # the store did not answer its first listing
        print(f"emllm serve: {error}", file=sys.stderr)
        return 2
    app = create_app(backend, settings)
    print(f"serving {engine.model_name} (preset {args.preset}) on http://{args.host}:{args.port}/v1, sessions in "
          f"{args.sessions}", file=sys.stderr, flush=True)
    if hasattr(signal, "SIGUSR1"):  # `kill -USR1 PID`: every thread's stack on stderr, for a turn that stalls
        faulthandler.register(signal.SIGUSR1, all_threads=True)
    # SIGTERM: stop accepting, let open requests finish (at most 60 s), then close every session (all saved).
    uvicorn.run(app, host=args.host, port=args.port, log_level="info", timeout_graceful_shutdown=60)
    return 0


def half_the_ram() -> int | None:
    """Half the machine's physical RAM (None where the OS does not say): the default bound on resident sessions.
    A session's memory is hundreds of MB (a SmolLM2 session of one 1,400-token turn held ~400 MB), so 64 resident
    sessions and no byte bound let a server outgrow a 24 GB machine; the rest of the RAM is the model's and the
    requests'."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2
    except (ValueError, OSError, AttributeError):
        return None


def settings_of(args: argparse.Namespace) -> Any:
    """The ServeSettings the command line gives, its limits checked before anything loads."""
    from .app import ServeSettings

    if min(args.max_resident_sessions, args.default_max_tokens, args.max_messages, args.max_concurrent) < 1 \
            or min(args.max_body_mb, args.store_timeout) <= 0 \
            or (args.max_resident_gb is not None and args.max_resident_gb <= 0):
        raise ValueError("--max-resident-sessions, --default-max-tokens, --max-messages and --max-concurrent must "
                         "be >= 1, --max-body-mb, --max-resident-gb and --store-timeout > 0.")
    return ServeSettings(sessions=args.sessions, api_keys=tuple(args.api_key),
                         max_resident_sessions=args.max_resident_sessions,
                         max_resident_bytes=half_the_ram() if args.max_resident_gb is None
                         else int(args.max_resident_gb * 2**30),
                         max_body_bytes=int(args.max_body_mb * 2**20), default_max_tokens=args.default_max_tokens,
                         max_messages=args.max_messages, max_concurrent=args.max_concurrent,
                         store_timeout=args.store_timeout)
