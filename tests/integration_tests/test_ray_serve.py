"""`emllm serve` on Ray Serve (issue 60): a real local Ray cluster on 127.0.0.1 (no dashboard, memory bounded), two
replicas of SmolLM2 holding sessions through Ray Serve's multiplexing, their store an S3 bucket on a loopback S3
server (moto) reached through s3fs, and the official openai client over real HTTP to Serve's proxy.

Every response names its replica (X-Replica-Id): a returning session must land on the replica that holds it; a
replica killed with ray.kill must lose no completed turn. The replicas reach the bucket through a loopback relay that
the store-failure test stops, so a replica's store timeout must reach the client as the 503 `emllm serve` gives.
"""

from __future__ import annotations

import concurrent.futures
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from .conftest import SMOL
from .test_serve import DOCUMENT, LAYOUT, QUESTION, Relay, free_port, loopback_s3

ray = pytest.importorskip("ray", reason="the [ray] extra is not installed")
pytest.importorskip("fastapi", reason="the [serve] extra is not installed")
openai = pytest.importorskip("openai", reason="the openai client is a dev dependency")

from ray import serve  # noqa: E402

from emllm_integrations.serve.app import ServeSettings  # noqa: E402
from emllm_integrations.serve.ray_serve import REPLICA_HEADER, application  # noqa: E402

SESSIONS = 16
FOLLOW_UP = "And what is the harbour master's cat called?"
STORE_TIMEOUT_S = 30.0
"""The replicas' --store-timeout: past one store call under the module's heaviest load, short enough to wait out."""


@pytest.fixture(scope="module")
def s3_relay() -> Iterator[tuple[dict[str, str], Relay]]:
    """The S3 server, and the relay in front of it through which the replicas reach the bucket."""
    with loopback_s3() as env:
        relay = Relay(env["AWS_ENDPOINT_URL"])
        try:
            yield {**env, "AWS_ENDPOINT_URL": relay.url}, relay
        finally:
            relay.close()


@pytest.fixture(scope="module")
def cluster(s3_relay) -> Iterator[str]:
    """The application on a local cluster (2 model replicas, 1 logical CPU each), served on a free loopback port;
    the cluster and the S3 server stop with the module."""
    env, _ = s3_relay
    ray.init(num_cpus=4, include_dashboard=False, _node_ip_address="127.0.0.1",
             object_store_memory=256 * 2**20, runtime_env={"env_vars": {**env, "HF_HUB_OFFLINE": "1",
                                                                         "OMP_NUM_THREADS": "1"}},
             log_to_driver=False)
    try:
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        settings = ServeSettings(sessions="s3://emllm-sessions/ray", max_concurrent=SESSIONS,
                                 store_timeout=STORE_TIMEOUT_S)
        serve.run(application(settings, model=SMOL, preset="S", engine_fields=LAYOUT, replicas=2),
                  name="emllm", route_prefix="/")
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


def turn(url: str, messages: list[dict], session: str | None, max_tokens: int = 10) -> tuple[Any, str]:
    """(the completion, the replica that answered it)."""
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=300, max_retries=0)
    raw = client.chat.completions.with_raw_response.create(
        model=SMOL, messages=messages, max_tokens=max_tokens, temperature=0,
        extra_headers={"X-Session-Id": session} if session else None)
    return raw.parse(), raw.headers[REPLICA_HEADER]


def conversation(i: int = 0) -> list[dict]:
    return [{"role": "user", "content": f"Note {i}: the keeper's boat is called Gull {i}.\n\n{DOCUMENT}\n\n"
                                        f"{QUESTION}"}]


def note(i: int) -> list[dict]:
    return [{"role": "user", "content": f"Note {i}: the keeper's boat is called Gull {i}. The harbour master's cat "
                                        f"is named Pebble {i}.\n\nWhat is the keeper's boat called?"}]


def follow_up(first: list[dict], answer: Any) -> list[dict]:
    return [*first, {"role": "assistant", "content": answer.choices[0].message.content},
            {"role": "user", "content": FOLLOW_UP}]


def test_a_returning_session_lands_on_its_replica_and_reads_only_its_new_tokens(cluster):
    first = conversation()
    one, replica = turn(cluster, first, "affine")
    two, again = turn(cluster, follow_up(first, one), "affine")
    assert again == replica
    assert two.usage.prompt_tokens_details.cached_tokens >= one.usage.prompt_tokens
    assert two.usage.prompt_tokens - two.usage.prompt_tokens_details.cached_tokens < 60  # its own tokens


def test_sixteen_sessions_over_two_replicas_answer_as_alone_and_return_to_their_replicas(cluster):
    """16 sessions at once, each answering as it does alone (short notes: the point is routing and batching, not
    reading); their second turns return to the replica of their first, the affinity hit rate printed."""
    alone = [turn(cluster, note(i), f"alone-{i}")[0] for i in range(SESSIONS)]
    with concurrent.futures.ThreadPoolExecutor(SESSIONS) as pool:
        together = list(pool.map(lambda i: turn(cluster, note(i), f"together-{i}"), range(SESSIONS)))
    for i, (answer, _) in enumerate(together):
        assert answer.choices[0].message.content == alone[i].choices[0].message.content, i
    with concurrent.futures.ThreadPoolExecutor(SESSIONS) as pool:
        returns = list(pool.map(lambda i: turn(cluster, follow_up(note(i), together[i][0]), f"together-{i}"),
                                range(SESSIONS)))
    hits = sum(back == first for (_, first), (_, back) in zip(together, returns, strict=True))
    placed = {r: sum(1 for _, first in together if first == r) for r in {r for _, r in together}}
    print(f"affinity: {hits} of {SESSIONS} returning sessions on their first replica; first turns per replica: "
          f"{placed}")
    assert hits >= SESSIONS * 3 // 4
    for back, _ in returns:  # wherever a turn landed, it read only its own tokens
        assert back.usage.prompt_tokens_details.cached_tokens > 0


def test_requests_without_a_session_and_refusals_go_through_the_ingress(cluster):
    answer, replica = turn(cluster, conversation(7), None)
    assert answer.choices[0].message.content and replica
    bad = httpx.post(f"{cluster}/v1/chat/completions", json={"messages": conversation(7), "n": 2}, timeout=60)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "n"
    assert httpx.get(f"{cluster}/v1/models", timeout=60).json()["data"][0]["id"] == SMOL


def test_a_client_that_leaves_mid_stream_lets_its_session_go_on_its_replica(cluster):
    """A streaming client that disconnects after a few events: the ingress cancels the replica's stream and the
    replica closes the turn, so the session's next turn is answered (not left waiting on a turn nobody reads)."""
    body = {"model": SMOL, "messages": conversation(3), "max_tokens": 400, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{cluster}/v1/chat/completions", headers={"X-Session-Id": "walks-away"}, json=body,
                      timeout=120) as response:
        assert response.status_code == 200
        for count, _ in enumerate(response.iter_lines()):
            if count >= 3:
                break  # the client is gone: the connection closes with the stream unread
    client = openai.OpenAI(base_url=f"{cluster}/v1", api_key="unused", timeout=90, max_retries=0)
    again = client.chat.completions.create(model=SMOL, messages=conversation(3), max_tokens=10, temperature=0,
                                           extra_headers={"X-Session-Id": "walks-away"})
    assert again.choices[0].message.content == turn(cluster, conversation(3), "stays")[0].choices[0].message.content


def test_a_store_that_stops_answering_gets_503_through_the_ingress(cluster, s3_relay):
    """A replica whose store stops answering fails the turn with StoreUnavailable; Ray carries it to the ingress
    wrapped in its RayTaskError, and the client must still get what `emllm serve` gives: 503 in OpenAI's format,
    the replica's message, Retry-After. Once the store answers again, the same session is served."""
    _, relay = s3_relay
    request = {"model": SMOL, "messages": note(9), "max_tokens": 6, "temperature": 0}
    relay.answering.clear()
    try:
        started = time.monotonic()
        stalled = httpx.post(f"{cluster}/v1/chat/completions", headers={"X-Session-Id": "stalled"}, json=request,
                             timeout=300)
        waited = time.monotonic() - started
    finally:
        relay.answering.set()
    assert stalled.status_code == 503, stalled.text
    error = stalled.json()["error"]
    assert error["type"] == "server_error" and error["code"] == "session_store_unavailable", error
    assert "--store-timeout" in error["message"] and "RayTaskError" not in error["message"], error
    assert stalled.headers["retry-after"]
    assert waited < 4 * STORE_TIMEOUT_S, f"the turn waited {waited:.0f} s on a store with a {STORE_TIMEOUT_S} s timeout"
    again, _ = turn(cluster, note(9), "stalled")
    assert again.choices[0].message.content


def test_a_killed_replica_loses_no_completed_turn(cluster):
    """Kill the replica holding a session (ray.kill): its next turn is answered by another replica from the
    store, as a session that saw no kill is answered. Last in the module: Serve's replacement replica is still
    loading when the module's cluster stops."""
    first = conversation(1)
    kept, replica = turn(cluster, first, "doomed")
    reference, _ = turn(cluster, first, "unharmed")
    actor = next(ray.get_actor(name, namespace=space) for space, name in _replica_actors()
                 if name.endswith(f"#{replica}"))
    ray.kill(actor, no_restart=True)
    after, other = turn(cluster, follow_up(first, kept), "doomed")
    unharmed, _ = turn(cluster, follow_up(first, reference), "unharmed")
    assert other != replica
    assert after.choices[0].message.content == unharmed.choices[0].message.content
    assert after.usage.prompt_tokens_details.cached_tokens >= kept.usage.prompt_tokens  # from the store


def _replica_actors() -> list[tuple[str, str]]:
    return [(actor["namespace"], actor["name"]) for actor in ray.util.list_named_actors(all_namespaces=True)
            if actor["name"].startswith("SERVE_REPLICA::") and "SessionReplica" in actor["name"]]


def test_a_replica_in_local_testing_mode_answers_and_holds_its_session():
    """Ray Serve's local testing mode (no cluster, one process, no multiplexing): the model deployment answers a
    turn through its handle, and the session's next turn reads only its new tokens."""
    from emllm_integrations.serve.openai_format import check_chat_request
    from emllm_integrations.serve.ray_serve import SessionReplica

    replica = serve.deployment(SessionReplica)
    with tempfile.TemporaryDirectory() as store:
        handle = serve.run(replica.bind(SMOL, "S", LAYOUT, ServeSettings(sessions=store)), name="local",
                           _local_testing_mode=True)
        heads = []
        for messages in (note(3), [*note(3), {"role": "assistant", "content": "Gull 3."},
                                   {"role": "user", "content": "And the cat?"}]):
            call = check_chat_request({"messages": messages, "max_tokens": 6, "temperature": 0}, SMOL, 6, "local-1")
            stream = handle.options(stream=True, multiplexed_model_id="public/local-1").respond.remote(call, "public")
            heads.append(next(iter(stream)))
    first, second = (head["body"]["usage"] for head in heads)
    assert heads[0]["replica"] == heads[1]["replica"] == "local"
    assert second["prompt_tokens_details"]["cached_tokens"] >= first["prompt_tokens"]
