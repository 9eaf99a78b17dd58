"""GET /metrics: Prometheus text (prometheus-client) on a registry of the app's own, so two apps in one process
never share counters."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from .sessions import Sessions


class Metrics:
    """Requests, latency, tokens read and decoded, sessions resident and stored, and KV bytes per memory tier.

    The gauges read counts Sessions keeps as sessions change: a scrape walks no memory and lists no store. Without
    ``sessions`` (a Ray Serve ingress, whose replicas hold them) only the requests and their latency are counted."""

    def __init__(self, sessions: Sessions | None = None):
        self.registry = CollectorRegistry()
        self.requests = Counter("emllm_requests", "HTTP requests answered", ["route", "status"],
                                registry=self.registry)
        self.latency = Histogram("emllm_request_seconds", "Time to answer a request (a stream: until its end)",
                                 ["route"], registry=self.registry,
                                 buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 900))
        if sessions is not None:
            self._count_sessions(sessions)

    def _count_sessions(self, sessions: Sessions) -> None:
        self.tokens_read = Counter("emllm_tokens_read", "Prompt tokens read into memory (not served from it)",
                                   registry=self.registry)
        self.tokens_cached = Counter("emllm_tokens_cached", "Prompt tokens served from memory instead of read",
                                     registry=self.registry)
        self.tokens_decoded = Counter("emllm_tokens_decoded", "Tokens generated", registry=self.registry)
        Gauge("emllm_sessions_resident", "Sessions held in RAM", registry=self.registry).set_function(
            lambda: sessions.resident)
        Gauge("emllm_sessions_stored", "Sessions in the store", registry=self.registry).set_function(
            lambda: sessions.stored)
        tiers = Gauge("emllm_kv_bytes", "KV bytes held by resident memories, per tier", ["tier"],
                      registry=self.registry)
        for tier in ("device", "ram", "disk"):
            tiers.labels(tier).set_function(_tier_reader(sessions.kv_bytes, tier))
        held = Gauge("emllm_memory_bytes", "Bytes held by resident memories (windows, caches, indexes, KV pages), per "
                     "tier; what --max-resident-gb bounds", ["tier"], registry=self.registry)
        for tier in ("device", "ram"):
            held.labels(tier).set_function(_tier_reader(sessions.held_bytes, tier))

    def answered(self, result: Any) -> None:
        """Count a completed generation's tokens."""
        self.tokens_read.inc(result.new_input_tokens)
        self.tokens_cached.inc(result.input_tokens - result.new_input_tokens)
        self.tokens_decoded.inc(result.output_tokens)

    def text(self) -> bytes:
        return generate_latest(self.registry)


def _tier_reader(count: Callable[[], dict[str, int]], tier: str) -> Callable[[], float]:
    return lambda: float(count().get(tier, 0))
