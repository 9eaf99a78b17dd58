"""Conversations that keep their memory across requests and restarts.

A session (named by the client) owns a MemoryPool of its own: a request whose messages extend what the session has
read reads only the new tokens; one that rewrites history forks the longest prefix the session still holds. After
every completed turn the memory that has read its prompt is saved to the store (``engine.save_memory``: atomic,
checked on load), so a server killed at any moment loses at most the turn in flight, and a request sent again (a
retry, a regenerated answer) is served from the store too. Sessions past ``max_resident`` leave RAM,
least recently used first, and come back from the store on their next request, in this process or another.

Requests without a session share one pool keyed by token prefix: an app that resends its whole history each turn
is served from memory without naming a session. A new session starts from that pool's longest prefix of its prompt.

The store is a local directory or any fsspec URL (``s3://bucket/prefix`` through s3fs): ``ROOT/NAMESPACE/SESSION``,
the namespace derived from the API key, so one key's sessions are out of reach of another's. A remote save is made
locally (atomic, checked), uploaded as a new generation, and only then named current by a small pointer object;
a server killed during an upload leaves the previous generation current. A save over an earlier one does not
write again the full KV pages that save holds (persistence: they never change), only the rest and the state:
locally the earlier KV files are hard-linked, in a bucket copied from the current generation server-side.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import os
import shutil
import tempfile
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from emllm import EMConfig, EMEngine, MemoryPool
from emllm.persistence import MANIFEST, MemoryFileError, parse_manifest, read_metadata
from emllm.sessions import evicted_kv_bytes

from .defaults import STORE_TIMEOUT_S

ANONYMOUS_CONVERSATIONS = 8
"""Conversations the pool of requests without a session keeps resumable."""


class StoreUnavailable(TimeoutError):
    """A remote session store did not answer within its timeout. The turn waiting on it fails (503) and lets its
    session go; the store keeps the session as its last completed turn saved it (a save cut here never named its
    half-uploaded generation current)."""


def namespace(api_key: str | None) -> str:
    """The store folder of an API key's sessions (a digest: the key itself is never written down)."""
    return "public" if api_key is None else "key-" + hashlib.sha256(api_key.encode()).hexdigest()[:24]


@dataclass
class Session:
    pool: MemoryPool
    lock: threading.Lock = field(default_factory=threading.Lock)
    last_used: float = field(default_factory=time.time)
    kv_bytes: dict[str, int] = field(default_factory=dict)  # its pool's, counted after each turn (for /metrics)
    held: dict[str, int] = field(default_factory=dict)  # all its pool holds (MemoryPool.held_bytes), likewise
    retired: bool = False  # out of the resident set: closed as soon as no turn holds it
    closed: bool = False

    @property
    def ram_bytes(self) -> int:
        """What its checkpoints hold in RAM (and on a device): windows, caches, indexes and KV pages, as counted
        after its last turn."""
        return self.held.get("ram", 0) + self.held.get("device", 0)

    def count(self) -> None:
        """Count what its pool holds now (after a turn or a load; with its lock held)."""
        self.kv_bytes, self.held = self.pool.kv_bytes(), self.pool.held_bytes()

    def close_if_idle(self) -> None:
        """Close it now if no turn holds it; else the turn that does closes it when it ends (turn())."""
        self.retired = True
        if self.lock.acquire(blocking=False):
            try:
                self.close()
            finally:
                self.lock.release()

    def close(self) -> None:
        """Close its pool (with its lock held)."""
        if not self.closed:
            self.closed = True
            self.pool.close()


def summary(memory: Any) -> dict[str, Any]:
    """What a save records about its memory (in the manifest's metadata), shown by GET /v1/sessions/{id}."""
    return {"tokens": memory.total_tokens, "events": memory.num_events, "saved_at": int(time.time()),
            "kv_bytes": evicted_kv_bytes(memory)}


class LocalStore:
    """Sessions saved in a local directory, each by engine.save_memory (atomic: the old save or the new)."""

    def __init__(self, root: str | Path):
        self.root = Path(root).expanduser()
        self.root.mkdir(parents=True, exist_ok=True)

    def has(self, key: str) -> bool:
        return (self.root / key / "manifest.json").exists()

    def save(self, engine: EMEngine, memory: Any, key: str) -> None:
        (self.root / key).parent.mkdir(parents=True, exist_ok=True)
        engine.save_memory(memory, self.root / key, metadata=summary(memory))

    def load(self, engine: EMEngine, key: str, config: EMConfig) -> Any:
        return engine.load_memory(self.root / key, config=config)

    def summary(self, key: str) -> dict[str, Any]:
        """The saved memory's summary, from its verified manifest."""
        return read_metadata(self.root / key)

    def remove(self, key: str) -> bool:
        existed = (self.root / key).exists()
        shutil.rmtree(self.root / key, ignore_errors=True)
        return existed

    def count(self) -> int:
        return sum(1 for _ in self.root.glob("*/*/manifest.json"))

    def close(self) -> None:
        """Nothing to release: the saves are the store."""


class RemoteStore:
    """Sessions in an fsspec location (s3://bucket/prefix, gcs://, memory://...): each save a new generation folder,
    made current by rewriting ``KEY/current`` once its upload is complete; every other generation (the previous one,
    and any a killed server left half uploaded) is removed after.

    Saves and loads stage in a local folder of this process's own (``emllm-staging/PID-*`` in the temp directory);
    a server killed mid-save leaves its folder behind, and the next server to start removes every folder whose
    process is gone, so kills never fill the disk."""

    def __init__(self, url: str, timeout: float | None = STORE_TIMEOUT_S):
        import fsspec

        self.url, self.timeout = url, timeout
        self.fs, self.root = fsspec.core.url_to_fs(url)
        self.root = self.root.rstrip("/")
        self._call("makedirs", self.root, exist_ok=True)
        self.staging = Path(tempfile.gettempdir()) / "emllm-staging"
        self.staging.mkdir(exist_ok=True)
        self.uploaded_bytes = 0  # what this process's saves put up (files copied within the bucket not counted)
        _remove_orphaned_staging(self.staging)

    def _call(self, operation: str, *args: Any, **kwargs: Any) -> Any:
        """``self.fs.<operation>(...)``, bounded by the store's timeout where fsspec can bound it: an async filesystem
        (s3fs, gcsfs, adlfs) runs each call on its event loop, and fsspec's own ``timeout`` cancels it there. s3fs
        bounds each HTTP attempt (5 s to connect, 15 s to read) but not waiting for a pooled connection, nor its
        retries together (up to 25 attempts), so without this a store that stops answering holds a turn, and its
        session, for ever. A synchronous filesystem's calls cannot be cancelled from outside and run unbounded."""
        method = getattr(self.fs, operation)
        if self.timeout is None or not _cancellable(method):
            return method(*args, **kwargs)
        from fsspec.exceptions import FSTimeoutError

        try:
            return method(*args, timeout=self.timeout, **kwargs)
        except FSTimeoutError:
            raise StoreUnavailable(f"The session store {self.url} did not answer {operation} within "
                                   f"{self.timeout:g} s (emllm serve --store-timeout); the session is as its last "
                                   "completed turn left it.") from None

    def _stage(self, purpose: str) -> tempfile.TemporaryDirectory:
        return tempfile.TemporaryDirectory(prefix=f"{os.getpid()}-{purpose}-", dir=self.staging)

    def _current(self, key: str) -> str | None:
        pointer = f"{self.root}/{key}/current"
        return self._call("cat_file", pointer).decode().strip() if self._call("exists", pointer) else None

    def has(self, key: str) -> bool:
        return self._current(key) is not None

    def save(self, engine: EMEngine, memory: Any, key: str) -> None:
        """Upload a new generation and name it current. The KV files the current generation already holds (pages
        this memory still holds unchanged) are copied within the bucket, not uploaded again; should that generation
        vanish meanwhile (another server saved the session), the save is made whole."""
        current = self._current(key)
        earlier = self._manifest(key, current) if current is not None else None
        try:
            generation = self._upload(engine, memory, key, current, earlier)
        except FileNotFoundError:
            generation = self._upload(engine, memory, key, None, None)
        self._call("pipe_file", f"{self.root}/{key}/current", generation.encode())
        self.fs.invalidate_cache(f"{self.root}/{key}")
        for path in self._call("ls", f"{self.root}/{key}", detail=False):
            if path.rstrip("/").rsplit("/", 1)[-1] not in (generation, "current"):
                self._call("rm", path, recursive=True)

    def _manifest(self, key: str, generation: str) -> dict[str, Any] | None:
        """A generation's verified manifest, or None where it is gone or unreadable (then the save is whole)."""
        path = f"{self.root}/{key}/{generation}/{MANIFEST}"
        try:
            return parse_manifest(self._call("cat_file", path), path)
        except (FileNotFoundError, MemoryFileError):
            return None

    def _upload(self, engine: EMEngine, memory: Any, key: str, current: str | None,
                earlier: dict[str, Any] | None) -> str:
        """Stage the save, put up the files it wrote and copy the rest from ``current``: the new generation."""
        generation = f"g{time.time_ns()}-{uuid.uuid4().hex[:8]}"
        with self._stage("save") as staging:  # the save, on its way up
            staged = Path(staging) / generation
            engine.save_memory(memory, staged, metadata=summary(memory), earlier=earlier)
            listed = json.loads((staged / MANIFEST).read_bytes())["files"]
            for name in (*listed, MANIFEST):  # the manifest last: a generation is complete once it has one
                remote = f"{self.root}/{key}/{generation}/{name}"
                if (staged / name).exists():
                    self._call("put_file", str(staged / name), remote)
                    self.uploaded_bytes += (staged / name).stat().st_size
                else:
                    self._call("copy", f"{self.root}/{key}/{current}/{name}", remote)
        return generation

    def load(self, engine: EMEngine, key: str, config: EMConfig) -> Any:
        generation = self._current(key)
        if generation is None:
            raise FileNotFoundError(f"No session {key!r} in {self.root}.")
        with self._stage("load") as staging:  # a loaded memory keeps nothing open here
            self._call("get", f"{self.root}/{key}/{generation}", f"{staging}/{generation}", recursive=True)
            return engine.load_memory(Path(staging) / generation, config=config)

    def summary(self, key: str) -> dict[str, Any]:
        """The saved memory's summary, from its verified manifest (fetched alone, not the KV)."""
        generation = self._current(key)
        if generation is None:
            raise FileNotFoundError(f"No session {key!r} in {self.root}.")
        with self._stage("manifest") as staging:
            self._call("get", f"{self.root}/{key}/{generation}/{MANIFEST}", f"{staging}/{MANIFEST}")
            return read_metadata(staging)

    def remove(self, key: str) -> bool:
        existed = self._call("exists", f"{self.root}/{key}")
        if existed:
            self._call("rm", f"{self.root}/{key}", recursive=True)
        return existed

    def count(self) -> int:
        return len(self._call("glob", f"{self.root}/*/*/current"))

    def close(self) -> None:
        """Nothing to release: each save and load stages in a temporary folder of its own."""


def _cancellable(method: Any) -> bool:
    """Whether an fsspec method is the blocking face of a coroutine (fsspec.asyn's sync wrapper), which takes a
    ``timeout`` of its own; an async filesystem's methods written as plain functions do not."""
    return inspect.iscoroutinefunction(getattr(method, "__wrapped__", None))


def _remove_orphaned_staging(staging: Path) -> None:
    """Remove staging folders whose process (the PID their name begins with) is no longer running."""
    for folder in staging.iterdir():
        pid = folder.name.split("-", 1)[0]
        if pid.isdigit() and not _running(int(pid)):
            shutil.rmtree(folder, ignore_errors=True)


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def open_store(location: str | Path, timeout: float | None = STORE_TIMEOUT_S) -> LocalStore | RemoteStore:
    """A local directory, or an fsspec URL (anything with "://") whose calls may each take ``timeout`` seconds."""
    return RemoteStore(str(location), timeout) if "://" in str(location) else LocalStore(location)


class Sessions:
    """Resident sessions (LRU), the store behind them, and the anonymous pool.

    What /metrics reports is counted as sessions change, never by walking them on a scrape: each session's KV bytes
    after its turn, and the stored sessions once at start (one listing) and then as this process saves and forgets
    (other processes sharing the store are not seen until a restart)."""

    def __init__(self, engine: EMEngine, config: EMConfig, store: str | Path, max_resident: int = 64,
                 max_resident_bytes: int | None = None, store_timeout: float | None = STORE_TIMEOUT_S):
        self.engine, self.config = engine, config
        self.max_resident, self.max_resident_bytes = max_resident, max_resident_bytes
        self.store = open_store(store, store_timeout)
        self.anonymous = MemoryPool(engine, config, max_memories=ANONYMOUS_CONVERSATIONS)
        self._anonymous_kv: dict[str, int] = {}
        self._anonymous_held: dict[str, int] = {}
        self._resident: OrderedDict[tuple[str, str], Session] = OrderedDict()
        self._lock = threading.Lock()  # the resident set; never held while waiting for a session's lock
        self._stored = self.store.count()

    @staticmethod
    def key(space: str, session_id: str) -> str:
        return f"{space}/{session_id}"

    @contextmanager
    def turn(self, space: str, session_id: str) -> Iterator[Session]:
        """The session, held for one turn: a session's turns run one at a time (a conversation has one history). A
        session retired from RAM while the turn ran is closed when it ends."""
        while True:
            session = self._session(space, session_id)
            with session.lock:
                if session.closed:  # retired and closed between the lookup and the lock: look it up again
                    continue
                session.last_used = time.time()
                try:
                    yield session
                finally:
                    if session.retired:
                        session.close()
                return

    def _session(self, space: str, session_id: str) -> Session:
        """The resident session, or a new one entered in the resident set at once and loaded from the store
        holding only its own lock: a load (seconds from a bucket) never holds the set's lock, so other sessions'
        turns go on meanwhile, and this session's next turn waits on its lock as it would for a turn."""
        key = (space, session_id)
        with self._lock:
            session = self._resident.get(key)
            if session is not None:
                self._resident.move_to_end(key)
                return session
            session = self._resident[key] = Session(MemoryPool(self.engine, self.config, max_memories=1))
            session.lock.acquire()  # given back once its memory is in
            retired = self._over_limits(keep=key)
        try:
            self._load(session, self.key(space, session_id))
        except BaseException:
            with self._lock:
                if self._resident.get(key) is session:
                    del self._resident[key]
            session.close()  # a turn waiting on it looks the session up again, and loads it itself
            raise
        finally:
            session.lock.release()
        for old in retired:
            old.close_if_idle()
        return session

    def _load(self, session: Session, key: str) -> None:
        """Put the stored memory (if any) into a new session's pool; with its lock held."""
        if self.store.has(key):
            session.pool.adopt(self.store.load(self.engine, key, self.config))
        session.count()

    def _over_limits(self, keep: tuple[str, str]) -> list[Session]:
        """Take out of the resident set, least recently used first and never ``keep``, the sessions past
        max_resident or past max_resident_bytes of RAM (every completed turn is saved: they come back from the
        store). Called with the set's lock held; the caller closes them after letting it go."""
        retired = []
        ram = sum(session.ram_bytes for session in self._resident.values())
        for key in list(self._resident):
            over_bytes = self.max_resident_bytes is not None and ram > self.max_resident_bytes
            if len(self._resident) <= self.max_resident and not over_bytes:
                break
            if key != keep:
                retired.append(self._resident.pop(key))
                ram -= retired[-1].ram_bytes
        return retired

    def start_from_shared(self, session: Session, prompt: list[int]) -> None:
        """A session that has read nothing (new, and not in the store) starts from the longest prefix of its prompt
        that the pool of requests without a session holds, as a fork (exact: it reads on as a memory that read every
        token), instead of reading it again: sixteen users' new sessions over one document read it once. Only a
        prefix of this request's own tokens is shared, so nothing another user sent reaches it but the time saved.
        Called with the session's lock held."""
        if session.pool.num_checkpoints:
            return
        with self.anonymous.held(prompt) as shared:
            start = shared.fork() if shared is not None else None
        if start is not None:
            session.pool.keep(start)

    def save(self, space: str, session_id: str, session: Session, prompt: list[int]) -> None:
        """Save the session's checkpoint that has read the most of ``prompt`` (the turn's prompt ids; the pool keeps
        one that has read them all): the checkpoint itself, held in its pool while it is written."""
        key = self.key(space, session_id)
        with session.pool.held(prompt) as memory:
            if memory is not None and memory.total_tokens:
                new = not self.store.has(key)
                self.store.save(self.engine, memory, key)
                if new:
                    with self._lock:
                        self._stored += 1
        session.count()
        with self._lock:
            retired = self._over_limits(keep=(space, session_id))
        for old in retired:
            old.close_if_idle()

    def retire(self, space: str, session_id: str) -> None:
        """Let a session leave RAM now (every completed turn is saved: it comes back from the store); a turn in
        flight finishes first. For a router that keeps its own least-recently-used set (Ray Serve's multiplexing)."""
        with self._lock:
            session = self._resident.pop((space, session_id), None)
        if session is not None:
            session.close_if_idle()

    def anonymous_turn_ended(self) -> None:
        """Count the anonymous pool's KV bytes after one of its turns (for /metrics)."""
        self._anonymous_kv, self._anonymous_held = self.anonymous.kv_bytes(), self.anonymous.held_bytes()

    def describe(self, space: str, session_id: str) -> dict[str, Any] | None:
        """What GET /v1/sessions/{id} shows: where it lives, when it was last used, and its saved memory's tokens,
        events and KV bytes per tier (from the save's manifest)."""
        key = (space, session_id)
        with self._lock:
            session = self._resident.get(key)
        stored = self.store.has(self.key(space, session_id))
        if session is None and not stored:
            return None
        info: dict[str, Any] = {"id": session_id, "object": "session", "resident": session is not None,
                                "stored": stored}
        if stored:
            saved = self.store.summary(self.key(space, session_id))
            info.update({"tokens": saved.get("tokens"), "events": saved.get("events"),
                         "kv_bytes": saved.get("kv_bytes"), "last_used": saved.get("saved_at")})
        if session is not None:
            info["last_used"] = int(session.last_used)
            info["checkpoints"] = session.pool.num_checkpoints
        return info

    def forget(self, space: str, session_id: str) -> bool:
        """Drop a session from RAM and from the store; whether there was one."""
        key = (space, session_id)
        with self._lock:
            session = self._resident.pop(key, None)
        if session is not None:
            with session.lock:  # a turn in flight finishes first
                session.close()
        removed = self.store.remove(self.key(space, session_id))
        if removed:
            with self._lock:
                self._stored = max(0, self._stored - 1)
        return session is not None or removed

    @property
    def resident(self) -> int:
        return len(self._resident)

    @property
    def stored(self) -> int:
        """Sessions in the store, every namespace (as this process has seen them change)."""
        return self._stored

    def kv_bytes(self) -> dict[str, int]:
        """KV bytes per tier held by the resident sessions and the anonymous pool, as counted after their last turns
        (MemoryPool.kv_bytes)."""
        with self._lock:
            return _summed([session.kv_bytes for session in self._resident.values()] + [self._anonymous_kv])

    def held_bytes(self) -> dict[str, int]:
        """All the resident sessions and the anonymous pool hold ("ram", "device"), as counted after their last
        turns (MemoryPool.held_bytes): what --max-resident-gb bounds."""
        with self._lock:
            return _summed([session.held for session in self._resident.values()] + [self._anonymous_held])

    def close(self) -> None:
        with self._lock:
            sessions = list(self._resident.values())
            self._resident.clear()
        for session in sessions:
            session.close()
        self.anonymous.close()
        self.store.close()


def _summed(counts: list[dict[str, int]]) -> dict[str, int]:
    """Byte counts per tier, added up."""
    total: dict[str, int] = {}
    for count in counts:
        for tier, n in count.items():
            total[tier] = total.get(tier, 0) + n
    return total
