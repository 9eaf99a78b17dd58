"""What a benchmark measures around the engine: documents that begin alike read once each as if read alone
(``read_each``), and the process's peak resident memory (``peak_rss_mb``). Only the engine's public API is used."""

from __future__ import annotations

import resource
import time
from collections.abc import Generator, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from emllm import EMConfig, EMEngine, EpisodicMemory


def peak_rss_mb() -> float:
    """This process's peak resident memory (the demo and every bench cell report it)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading token ids two sequences share: where they first differ, or the shorter length."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def read_each(engine: EMEngine, documents: Sequence[Sequence[int]],
              config: EMConfig | None = None) -> Generator[tuple[EpisodicMemory, float], None, None]:
    """For each document in turn, a memory of ``engine`` (``config``: as engine.new_memory takes it) that has read
    exactly it, and the seconds a separate read costs.

    Benchmarks ask about one haystack with the needle at several depths: those documents are identical up to
    their needles. The part a document shares with the next one, cut at a chunk boundary, is read once into a
    trunk memory that is then forked, so three depths cost about 2.4 reads instead of 3. Because the cut is at a
    chunk boundary, every forward is the one a separate read of the document makes: the memories, and so the
    answers, are those of separate reads. The seconds given are the trunk's reading up to the fork plus the
    document's own tail, i.e. what reading it alone costs. Close each memory when done with it; stopping early
    (closing the generator) closes the trunk.
    """
    trunk: EpisodicMemory | None = None
    trunk_seconds = 0.0
    try:
        for index, ids in enumerate(documents):
            ids = list(ids)
            if trunk is not None and trunk.token_ids != ids[:trunk.total_tokens]:  # diverges before the fork
                trunk.close()
                trunk = None
            if trunk is None:
                trunk, trunk_seconds = engine.new_memory(config), 0.0
            chunk = trunk.config.chunk_size
            later = list(documents[index + 1]) if index + 1 < len(documents) else []
            shared = common_prefix(ids, later) // chunk * chunk
            if later and shared >= trunk.total_tokens:
                started = time.perf_counter()
                engine.read(trunk, ids[trunk.total_tokens:shared])
                trunk_seconds += time.perf_counter() - started
                memory = trunk.fork()
            else:  # the last document, or the next shares less than the trunk holds: this one takes the trunk
                memory, trunk = trunk, None
            try:
                started = time.perf_counter()
                engine.read(memory, ids[memory.total_tokens:])
            except BaseException:
                memory.close()
                raise
            yield memory, trunk_seconds + time.perf_counter() - started
    finally:
        if trunk is not None:
            trunk.close()
