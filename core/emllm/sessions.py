"""Sharing one loaded model between many callers, and reusing what a conversation has already read.

Framework adapters (LangChain, LlamaIndex) are stateless per call: every call passes the whole conversation. Re-reading
a 32K-token document for each follow-up question would cost minutes, so a MemoryPool keeps *checkpoints*: memories
right after a prompt was read (and right after an answer was generated). A new call whose token ids extend a
checkpoint's tokens forks it (evicted pages are shared, see EpisodicMemory.fork) and reads only the new tokens.
Checkpoints are never generated from directly, so concurrent calls can fork the same one safely; each call
generates in its own memory, which is why two conversations can never mix.

    engine = shared_engine()                         # loaded once per (model, dtype, device), lazily
    pool = MemoryPool(engine, EMConfig.from_preset("S"))
    pool.read(document_ids)                          # pinned checkpoint: read once
    pool.generate(document_ids + question_ids)       # reads only the question's tokens
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from .codec import Prompt
from .config import EMConfig
from .conversation import converse
from .decoding import GenerationResult, TextStream
from .engine import EMEngine
from .memory import EpisodicMemory, held_bytes

_ENGINES: dict[tuple, EMEngine] = {}
_ENGINES_LOCK = threading.Lock()


def shared_engine(model: str | None = None, *, dtype: torch.dtype | str = "auto", device: str | None = None,
                  device_map: str | dict | None = None, revision: str | None = None, token: str | bool | None = None,
                  progress: bool = True) -> EMEngine:
    """The one EMEngine for this model, dtype and placement in this process (loaded on first use).

    The engine's own config is only a default: each MemoryPool (or memory) brings its own, so callers with
    different presets share the weights. A hub id is keyed by its snapshot folder, so two revisions are two engines.
    """
    from .models import DEFAULT_MODEL, resolve_model_dir

    folder = resolve_model_dir(model, revision=revision, token=token, progress=progress)
    key = (str(folder), str(dtype), str(device), repr(device_map))
    with _ENGINES_LOCK:
        engine = _ENGINES.get(key)
        if engine is None:
            engine = EMEngine.from_pretrained(key[0], dtype=dtype, device=device, device_map=device_map,
                                              progress=progress)
            engine.model_name = str(model or DEFAULT_MODEL)  # the name asked for, not the folder it resolved to
            _ENGINES[key] = engine
        return engine


_POOLS: dict[tuple, MemoryPool] = {}
_POOLS_LOCK = threading.Lock()


def shared_pool(engine: EMEngine, config: EMConfig, max_memories: int = 4) -> MemoryPool:
    """The one MemoryPool for this engine and memory config in this process: every adapter instance with the same
    settings reuses the same checkpoints (frameworks build a new prompt per turn; each extends the last)."""
    key = (id(engine), config, max_memories)  # engines from shared_engine live for the whole process
    with _POOLS_LOCK:
        pool = _POOLS.get(key)
        if pool is None:
            pool = _POOLS[key] = MemoryPool(engine, config, max_memories=max_memories)
        return pool


def loaded_engines() -> int:
    """How many engines (sets of weights) this process has loaded through shared_engine."""
    return len(_ENGINES)


class MemoryPool:
    """Checkpointed memories of one engine and config; thread-safe.

    ``max_memories`` counts conversations, not checkpoints: the pool keeps the latest checkpoint of that many
    conversations (a checkpoint no other kept one extends; least recently used first out), and beside them up to
    twice as many earlier ones that a kept conversation extends (a document before its question, a prompt before
    its answer). Each call keeps up to three checkpoints, so counting them made four slots about one conversation."""

    def __init__(self, engine: EMEngine, config: EMConfig | None = None, max_memories: int = 4):
        if max_memories < 1:
            raise ValueError(f"max_memories must be at least 1 (conversations kept for reuse), got {max_memories}.")
        self.engine = engine
        self.config = config or engine.config
        self.config.validate_for_model(engine.shape.max_positions, engine.shape.num_layers)
        self.max_memories = max_memories
        self._pinned: list[EpisodicMemory] = []                          # from read(): kept until close()
        self._recent: OrderedDict[int, EpisodicMemory] = OrderedDict()  # automatic, least recent first
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ checkpoints
    def _checkpoints(self) -> list[EpisodicMemory]:
        return self._pinned + list(self._recent.values())

    def _longest(self, ids: Sequence[int]) -> EpisodicMemory | None:
        """The kept checkpoint whose tokens are the longest prefix of ``ids``, marked recently used (under the lock)."""
        best: EpisodicMemory | None = None
        for memory in self._checkpoints():
            n = memory.total_tokens
            if (best is None or n > best.total_tokens) and n <= len(ids) and memory.last_logits is not None \
                    and memory.token_ids == list(ids[:n]):
                best = memory
        if best is not None and id(best) in self._recent:
            self._recent.move_to_end(id(best))
        return best

    def acquire(self, ids: Sequence[int]) -> EpisodicMemory:
        """A memory of the caller's own whose tokens are the longest kept prefix of ``ids`` (possibly none)."""
        with self._lock:
            best = self._longest(ids)
            return self.engine.new_memory(self.config) if best is None else best.fork()

    @contextmanager
    def held(self, ids: Sequence[int]) -> Iterator[EpisodicMemory | None]:
        """The kept checkpoint that has read the longest prefix of ``ids`` (None if none has), itself rather than a
        fork, for a caller that only reads it (e.g. saves it): a fork would copy its window and index for nothing.
        The pool's other calls wait until the block ends, so the checkpoint cannot be evicted while in use."""
        with self._lock:
            yield self._longest(ids)

    def keep(self, memory: EpisodicMemory) -> None:
        """Keep a memory (no longer used by its caller) as a checkpoint; the least recent beyond max are closed."""
        if memory.closed or memory.last_logits is None:
            return
        with self._lock:
            if any(m.token_ids == memory.token_ids for m in self._checkpoints()):
                memory.close()  # the same tokens are already kept
                return
            memory.compact()  # from now on it is only forked or saved
            self._recent[id(memory)] = memory
            self._evict()

    def _evict(self) -> None:
        """Close the least recently used latest checkpoints past max_memories, then the least recently used earlier
        ones past twice that (closing a conversation's latest may make an earlier one its latest)."""
        while True:
            recent = list(self._recent.values())
            latest = [m for m in recent if not any(_extends(other, m) for other in self._checkpoints())]
            earlier = [m for m in recent if m not in latest]
            if len(latest) > self.max_memories:
                victim = latest[0]
            elif len(earlier) > 2 * self.max_memories:
                victim = earlier[0]
            else:
                return
            del self._recent[id(victim)]
            victim.close()

    def adopt(self, memory: EpisodicMemory) -> None:
        """Pin a memory made elsewhere (e.g. loaded from disk) as a checkpoint; the pool closes it on close()."""
        if memory.config != self.config:
            raise ValueError("This memory was made with other memory settings than the pool's; load it with the "
                             "pool's config or make a pool with the memory's config (memory.config).")
        with self._lock:
            self._pinned.append(memory)

    def checkpoint(self, prompt: Prompt, *, progress: bool = False) -> EpisodicMemory:
        """The kept memory that has read exactly this prompt (read and pinned now if none has), e.g. to save it."""
        ids = self.engine.prompt_ids(prompt)
        with self._lock:
            for memory in self._checkpoints():
                if memory.token_ids == ids and memory.last_logits is not None:
                    return memory
        return self._read_and_pin(ids, progress)[0]

    # ------------------------------------------------------------------ reading and generating
    def read(self, prompt: Prompt, *, progress: bool = False) -> int:
        """Read a prefix (e.g. every document) once and pin it; later prompts that extend it read only the rest.

        Returns how many tokens were read now (0 if a checkpoint already held them all)."""
        return self._read_and_pin(self.engine.prompt_ids(prompt), progress)[1]

    def _read_and_pin(self, ids: list[int], progress: bool) -> tuple[EpisodicMemory, int]:
        """(the pinned memory that has read ids, how many tokens it read now)."""
        memory = self.acquire(ids)
        try:
            read = self.engine.read(memory, ids[memory.total_tokens:], progress=progress)
        except BaseException:
            memory.close()
            raise
        with self._lock:
            self._pinned.append(memory)
        return memory, read

    def stream(self, prompt: Prompt, *, progress: bool = False, tools: list[dict] | None = None,
               **options: Any) -> TextStream:
        """Generate like EMEngine.stream, starting from the longest checkpoint the prompt extends.

        Before the prompt's question (its last paragraph, EMEngine.encode_prompt) a fork is kept (another question
        about the same document extends it); after the prompt is read, another (the conversation's next turn
        extends this prompt); after the answer, the generating memory is kept too (the next turn may extend
        prompt + answer token for token).
        """
        return converse(self.engine, self.engine.request(prompt, tools=tools, progress=progress, **options),
                        _PoolPolicy(self))

    def generate(self, prompt: Prompt, **kwargs: Any) -> GenerationResult:
        stream = self.stream(prompt, **kwargs)
        for _ in stream:
            pass
        return stream.result

    def close(self) -> None:
        """Close every checkpoint (their disk pages are removed)."""
        with self._lock:
            for memory in self._checkpoints():
                memory.close()
            self._pinned.clear()
            self._recent.clear()

    @property
    def num_checkpoints(self) -> int:
        return len(self._pinned) + len(self._recent)

    def held_bytes(self) -> dict[str, int]:
        """The bytes the checkpoints hold in RAM and on a device, all of it (memory.held_bytes), storages that forks
        share counted once."""
        with self._lock:
            memories = self._checkpoints()
        return held_bytes(memories)

    def kv_bytes(self) -> dict[str, int]:
        """Evicted KV bytes the checkpoints hold per tier ("device", "ram", "disk"; the local windows aside); pages
        forks share count once per checkpoint, as each store's budget counts them (what a server's metrics report)."""
        with self._lock:
            memories = self._checkpoints()
        held: dict[str, int] = {"ram": 0, "disk": 0}
        for memory in memories:
            if memory.closed:
                continue
            for tier, n in evicted_kv_bytes(memory).items():
                held[tier] = held.get(tier, 0) + n
        return held


def evicted_kv_bytes(memory: EpisodicMemory) -> dict[str, int]:
    """The evicted KV bytes one memory's store holds per tier ("device", "ram", "disk"; its local window aside)."""
    per_token = memory.store.page_bytes // memory.store.page_tokens
    return {tier: tokens * per_token for tier, tokens in memory.store.tier_tokens().items()}


def _extends(memory: EpisodicMemory, prefix: EpisodicMemory) -> bool:
    """Whether ``memory`` has read everything ``prefix`` has, and more."""
    n = prefix.total_tokens
    return memory.total_tokens > n and memory.token_ids[:n] == prefix.token_ids


class _PoolPolicy:
    """A pool's turn (conversation.MemoryPolicy): fork the longest checkpoint, keep forks at the question and after
    the prompt, keep the answered memory; a failed or abandoned turn's memory is closed."""

    checkpoints_question = True

    def __init__(self, pool: MemoryPool):
        self.pool = pool

    def acquire(self, ids: list[int]) -> EpisodicMemory:
        return self.pool.acquire(ids)

    def checkpoint(self, memory: EpisodicMemory) -> None:
        self.pool.keep(memory.fork())

    def release(self, memory: EpisodicMemory, answered: bool) -> None:
        if answered:
            self.pool.keep(memory)
        else:
            memory.close()
