"""The server's resident sessions (serve.sessions.Sessions) on the tiny random model and a local store: which
sessions stay in RAM, which leave it for the store, and that leaving never waits on, or breaks, a turn in flight."""

from __future__ import annotations

import json
import threading

import pytest
import torch

from emllm_integrations.serve.sessions import Sessions

from .tiny import tiny_engine, token_ids


@pytest.fixture
def engine():
    return tiny_engine("S")


def answer_turn(sessions: Sessions, session_id: str, prompt: list[int]) -> int:
    """One turn as the app runs it: generate in the session's pool, save; the prompt tokens it read."""
    with sessions.turn("public", session_id) as session:
        result = session.pool.generate(prompt, max_new_tokens=3)
        sessions.save("public", session_id, session, prompt)
    return result.new_input_tokens


def test_a_session_counts_all_its_checkpoints_hold(engine, tmp_path):
    """--max-resident-gb bounds what sessions really hold: evicted KV alone was a quarter of a SmolLM2 session's RAM
    (its checkpoints' windows, retrieved events' KV and pages being filled are the rest)."""
    sessions = Sessions(engine, engine.config, tmp_path, max_resident=8)
    prompt = token_ids(300, seed=1)
    answer_turn(sessions, "a", prompt)
    with sessions.turn("public", "a") as session:
        held, kv = session.pool.held_bytes(), session.pool.kv_bytes()
        with session.pool.held(prompt) as memory:
            windows = sum(layer.keys.nbytes + layer.values.nbytes for layer in memory.layers)
    assert kv["ram"] > 0 and held["device"] == 0
    assert held["ram"] >= kv["ram"] + windows
    assert sessions.held_bytes()["ram"] == held["ram"]
    sessions.close()


def test_past_the_ram_budget_the_least_recently_used_session_leaves_ram_and_comes_back_from_the_store(engine,
                                                                                                        tmp_path):
    one = Sessions(engine, engine.config, tmp_path, max_resident=8)
    answer_turn(one, "a", token_ids(300, seed=1))
    budget = one.held_bytes()["ram"] + 1  # room for one session like it, not two
    assert budget > 1
    one.close()

    sessions = Sessions(engine, engine.config, tmp_path / "budgeted", max_resident=8, max_resident_bytes=budget)
    first, second = token_ids(300, seed=1), token_ids(300, seed=2)
    answer_turn(sessions, "a", first)
    answer_turn(sessions, "b", second)
    assert sessions.resident == 1 and sessions.stored == 2  # "a" left RAM; both are saved
    assert sessions.describe("public", "a")["resident"] is False
    follow_up = token_ids(6, seed=3)
    assert answer_turn(sessions, "a", first + follow_up) == len(follow_up)  # back from the store: only the new ones
    assert sessions.describe("public", "b")["resident"] is False
    sessions.close()


def test_a_session_retired_during_its_turn_finishes_the_turn_and_then_closes(engine, tmp_path):
    """Retiring never waits for a turn (two turns retiring each other's sessions would wait forever): the session
    leaves the resident set at once and is closed by its own turn when that ends."""
    sessions = Sessions(engine, engine.config, tmp_path, max_resident=1)
    inside, release = threading.Event(), threading.Event()
    seen = {}

    def long_turn() -> None:
        with sessions.turn("public", "slow") as session:
            inside.set()
            release.wait(60)
            seen["closed_during_turn"] = session.closed
            prompt = token_ids(120, seed=5)
            seen["read"] = session.pool.generate(prompt, max_new_tokens=2).new_input_tokens
            sessions.save("public", "slow", session, prompt)
        seen["session"] = session

    worker = threading.Thread(target=long_turn)
    worker.start()
    assert inside.wait(60)
    other = threading.Thread(target=answer_turn, args=(sessions, "quick", token_ids(80, seed=6)))
    other.start()
    other.join(timeout=60)
    assert not other.is_alive(), "a new session waited on another session's turn"
    assert sessions.resident == 1 and sessions.describe("public", "slow") is None  # out of RAM, not yet saved
    release.set()
    worker.join(timeout=60)
    assert not worker.is_alive()
    assert seen["closed_during_turn"] is False and seen["read"] == 120  # the turn ran whole on its open pool
    assert seen["session"].closed  # and its own end closed it
    assert sessions.describe("public", "slow")["stored"]  # its turn was saved first
    sessions.close()


def _two_stored_sessions(engine, root) -> tuple[list[int], list[int]]:
    """Sessions "a" and "b" saved in ``root`` by a server now gone; their prompts."""
    first, second = token_ids(200, seed=11), token_ids(200, seed=12)
    gone = Sessions(engine, engine.config, root)
    answer_turn(gone, "a", first)
    answer_turn(gone, "b", second)
    gone.close()
    return first, second


def test_a_session_loading_from_the_store_holds_up_no_other_session(engine, tmp_path):
    """A load (seconds from a bucket) holds only its own session: another session's turn runs meanwhile, and a
    second turn of the loading session waits for the load and reads only its own new tokens."""
    first, second = _two_stored_sessions(engine, tmp_path)
    sessions = Sessions(engine, engine.config, tmp_path)
    loading, release, loads = threading.Event(), threading.Event(), []
    load = sessions.store.load

    def slow_load(engine_, key, config):
        loads.append(key)
        if key.endswith("/a"):
            loading.set()
            release.wait(60)
        return load(engine_, key, config)

    sessions.store.load = slow_load
    read: dict[str, int] = {}
    follow_a = token_ids(5, seed=13)
    worker = threading.Thread(target=lambda: read.setdefault("a", answer_turn(sessions, "a", first + follow_a)))
    worker.start()
    assert loading.wait(60)
    other = threading.Thread(target=lambda: read.setdefault("b", answer_turn(sessions, "b", second + [7, 8])))
    other.start()
    other.join(timeout=60)
    assert not other.is_alive(), "a session's turn waited for another session's load"
    assert read["b"] == 2 and worker.is_alive()
    release.set()
    worker.join(timeout=60)
    assert read["a"] == len(follow_a) and loads.count("public/a") == 1
    sessions.close()


def test_a_load_that_fails_fails_its_turn_alone_and_the_next_turn_loads_again(engine, tmp_path):
    first, _ = _two_stored_sessions(engine, tmp_path)
    sessions = Sessions(engine, engine.config, tmp_path)
    load, failures = sessions.store.load, [OSError("the bucket is unreachable")]

    def flaky_load(engine_, key, config):
        if failures:
            raise failures.pop()
        return load(engine_, key, config)

    sessions.store.load = flaky_load
    with pytest.raises(OSError, match="unreachable"):
        answer_turn(sessions, "a", first + [5])
    assert sessions.resident == 0  # not left resident with an empty memory
    assert answer_turn(sessions, "a", first + [5, 6]) == 2
    sessions.close()


def test_ray_serves_eviction_of_a_session_lets_it_leave_ram_once(engine, tmp_path):
    """Ray Serve's multiplexing evicts a replica's least recently used session by calling its holder's __del__: the
    session leaves RAM for the store (its next turn reads only its new tokens), and the holder's later collection
    does not retire the session loaded again since."""
    pytest.importorskip("ray", reason="the [ray] extra is not installed")
    from emllm_integrations.serve.ray_serve import HeldSession

    sessions = Sessions(engine, engine.config, tmp_path)
    first = token_ids(150, seed=21)
    answer_turn(sessions, "a", first)
    held = HeldSession(sessions, "public/a")
    held.__del__()  # as Ray Serve's eviction calls it
    assert sessions.resident == 0
    assert answer_turn(sessions, "a", first + [9, 10]) == 2  # back from the store
    del held  # the collector's call
    assert sessions.resident == 1
    sessions.close()


def test_a_bucket_store_copies_the_pages_its_last_generation_holds_instead_of_uploading_them(engine, tmp_path):
    """fsspec's in-memory file system stands for a bucket: a session's next save puts up only what its turn added
    and copies the rest within the bucket; the generation loads as the memory. Should the last generation vanish
    between the two steps (another server saved the session), the save is made whole."""
    from emllm.persistence import MANIFEST

    from emllm_integrations.serve.sessions import RemoteStore

    store = RemoteStore(f"memory://bucket-{tmp_path.name}/sessions")
    memory = engine.new_memory(engine.config.replace(page_tokens=7))
    engine.read(memory, token_ids(300, seed=21))
    store.save(engine, memory, "space/a")
    whole = store.uploaded_bytes
    engine.read(memory, token_ids(30, seed=22))
    store.save(engine, memory, "space/a")
    assert 0 < store.uploaded_bytes - whole < whole / 2
    loaded = store.load(engine, "space/a", memory.config)
    assert loaded.token_ids == memory.token_ids and loaded.store.num_tokens == memory.store.num_tokens
    assert all(torch.equal(loaded.store.read_page(i), memory.store.read_page(i))
               for i in range(memory.store.num_tokens // 7))

    folder = f"{store.root}/space/a/" + store.fs.cat_file(f"{store.root}/space/a/current").decode()  # the layout
    manifest = json.loads(store.fs.cat_file(f"{folder}/{MANIFEST}"))
    store.fs.rm(f"{folder}/{manifest['memory']['kv_segments'][0]['file']}")
    engine.read(memory, token_ids(30, seed=23))
    before = store.uploaded_bytes
    store.save(engine, memory, "space/a")
    assert store.uploaded_bytes - before > whole / 2  # whole again
    assert store.load(engine, "space/a", memory.config).token_ids == memory.token_ids


def test_a_new_session_starts_from_the_shared_pools_prefix_and_answers_as_if_it_had_read_it_all(engine, tmp_path):
    """A new session whose prompt begins with what a request without a session read forks that read instead of
    reading it again, and greedy decoding gives the tokens a session that read everything gives; a session with a
    memory of its own (here: loaded from the store) keeps it."""
    sessions = Sessions(engine, engine.config, tmp_path)
    document, question = token_ids(300, seed=1), token_ids(8, seed=2)
    sessions.anonymous.generate(document, max_new_tokens=3)  # a request without a session read the document

    def turn(session_id: str, share: bool) -> tuple[int, list[int]]:
        with sessions.turn("public", session_id) as session:
            if share:
                sessions.start_from_shared(session, document + question)
            result = session.pool.generate(document + question, max_new_tokens=4)
            sessions.save("public", session_id, session, document + question)
        return result.new_input_tokens, result.token_ids

    read_shared, shared_tokens = turn("shared", share=True)
    read_all, own_tokens = turn("alone", share=False)
    assert read_all == len(document) + len(question) and read_shared < read_all
    assert shared_tokens == own_tokens
    sessions.close()

    restarted = Sessions(engine, engine.config, tmp_path)
    with restarted.turn("public", "alone") as session:
        held = session.pool.num_checkpoints
        restarted.start_from_shared(session, document + question)
        assert held == 1 and session.pool.num_checkpoints == held  # its own memory, from the store, is kept
    restarted.close()


def test_a_bucket_that_never_answers_fails_its_call_within_the_store_timeout(monkeypatch):
    """s3fs against an endpoint on 127.0.0.1 that accepts connections and never replies: each of the store's calls
    (here its first, making the prefix) is cancelled after the store's timeout and named, instead of waiting through
    s3fs's and botocore's retries (up to 25 attempts of 15 s) or, for a pooled connection, for ever."""
    import socket
    import time

    pytest.importorskip("s3fs", reason="the [s3] extra is not installed")
    from emllm_integrations.serve.sessions import RemoteStore, StoreUnavailable

    with socket.create_server(("127.0.0.1", 0), backlog=16) as silent:  # connections complete; nothing is read
        endpoint = f"http://127.0.0.1:{silent.getsockname()[1]}"
        for name, value in {"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "testing",
                            "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}.items():
            monkeypatch.setenv(name, value)
        import s3fs

        s3fs.S3FileSystem.clear_instance_cache()
        started = time.monotonic()
        with pytest.raises(StoreUnavailable, match=r"s3://silent/sessions did not answer makedirs within 2 s"):
            RemoteStore("s3://silent/sessions", timeout=2)
        assert time.monotonic() - started < 10
        s3fs.S3FileSystem.clear_instance_cache()
