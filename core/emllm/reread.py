"""Answering from the retrieved events re-read as text (``reread=True``): the same retrieval, read afresh.

The episodic memory answers from stored keys and values: each event's KV was computed when it was read, in its own
context, and every retrieved event sits in the memory part at fixed positions. A RAG reader instead reads its chunks
afresh, one after another. On questions that ask for several items at once (two keys, every value of a key) the
fresh read answers far more (benchmarks/RESULTS.md: EG re-read, 9 of 20 multi-query lists at 8K against 5), at the
price of a full-attention prefill of everything the memory attends to, a few thousand tokens per answer.

``reread=True`` keeps the memory's retrieval exactly (the memory reads the prompt and its question ranks the events
as always) and then answers from what it attends to, as text: the sinks, the retrieved events in document order and
the local window (which ends with the question), one prompt under plain full attention with contiguous positions.
The answer's tokens are then read into the conversation's memory, as a normal answer's are, so the next turn
extends it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .config import EMConfig
from .memory import EpisodicMemory

if TYPE_CHECKING:
    from .engine import EMEngine


def attended_positions(memory: EpisodicMemory) -> torch.Tensor:
    """The absolute positions of the tokens ``memory`` attends to as its answer begins, in document order: its sinks,
    the events the layers retrieved (their union, each token once) and its local window
    up to the last token read. A memory that has evicted nothing attends to every token."""
    total = memory.total_tokens
    stats = memory.stats()
    sinks = stats["tokens_sinks"]
    local = sinks + stats["tokens_evicted"]
    events = memory.retrieved_events()
    # +1 where an event starts, -1 where it ends: a running sum above zero marks the tokens some event covers.
    edges = torch.zeros(total + 1, dtype=torch.int32)
    if events:
        spans = torch.tensor([(event.start, event.end) for event in events], dtype=torch.long)
        edges.index_add_(0, spans[:, 0], torch.ones(len(events), dtype=torch.int32))
        edges.index_add_(0, spans[:, 1], torch.full((len(events),), -1, dtype=torch.int32))
    kept = torch.cumsum(edges, 0)[:total] > 0
    kept[:sinks] = True
    kept[local:] = True
    return torch.nonzero(kept).flatten()


def read_attended(engine: EMEngine, memory: EpisodicMemory, ids: list[int], *,
                  progress: bool = False) -> tuple[EpisodicMemory, torch.Tensor]:
    """A full-attention memory that has read, as one prompt, the tokens of ``ids`` (the prompt ``memory`` has just
    read) that ``memory`` attends to; with their positions in ``ids``. The caller closes it."""
    kept = attended_positions(memory)
    reader = engine.new_memory(EMConfig.from_preset("full"))
    try:
        engine.read(reader, torch.tensor(ids)[kept].tolist(), progress=progress)
    except BaseException:
        reader.close()
        raise
    return reader, kept


def attention_in_prompt(attention: torch.Tensor, kept: torch.Tensor, prompt_tokens: int) -> torch.Tensor:
    """The re-read answer's attention (over the re-read prompt, then the answer) at the positions of the original
    prompt and answer (GenerationResult.attention): what ``attribute=True`` credits sources from."""
    answer = attention[kept.numel():]
    placed = torch.zeros(prompt_tokens + answer.numel(), dtype=attention.dtype)
    placed[kept] = attention[:kept.numel()]
    placed[prompt_tokens:] = answer
    return placed
