"""KV or text? The same retrieval read two ways (issue 61, item 4).

The default preset ranks events by their text and attends to the retrieved events' stored keys and values: KV
computed when each event was read, in its own context, placed in the memory part at fixed positions. A RAG reader
instead reads its chunks afresh, one after another. To tell whether the default's losses come from what it
retrieves or from how it reads it, ``answer_as_text`` keeps the retrieval exactly (the memory reads the prompt and
its question ranks the events as always) and then reads what the memory attends to as text: the sinks, the
retrieved events in document order, the local window (which ends with the question), as one prompt under plain
full attention, with contiguous positions as any RAG prompt has. The bench calls this method ``E-text``.
"""

from __future__ import annotations

import dataclasses
from typing import Any


def attended_ids(ids: list[int], memory: Any, spans: list[tuple[int, int]]) -> list[int]:
    """The prompt's tokens the memory attends to as its answer begins, in document order: its sinks, the retrieved
    event ``spans`` (absolute [start, end); the union over layers, which under the default preset all hold the same
    events) and its local window. ``ids`` is the prompt the
    memory has just read (its token positions are the memory's)."""
    stats = memory.stats()
    sinks = stats["tokens_sinks"]
    local = sinks + stats["tokens_evicted"]
    kept = list(ids[:sinks])
    reach = sinks
    for start, end in sorted(spans):
        start, end = max(start, reach), min(end, local)
        if start < end:
            kept.extend(ids[start:end])
            reach = end
    return kept + list(ids[local:])


def answer_as_text(engine: Any, memory: Any, ids: list[int], max_new_tokens: int) -> Any:
    """Read ``ids`` into ``memory`` (a preset that ranks events by a question), take the events it retrieves for the
    answer, and answer from attended_ids under full attention. The GenerationResult's times add both steps; its
    new_input_tokens are the memory's (what this call read that it had not)."""
    from emllm import EMConfig

    ranked = engine.generate(ids, memory=memory, max_new_tokens=1)
    text = attended_ids(ids, memory, [(event.start, event.end) for event in ranked.retrieved_events])
    reader = engine.new_memory(EMConfig.from_preset("full"))
    try:
        answer = engine.generate(text, memory=reader, max_new_tokens=max_new_tokens)
    finally:
        reader.close()
    return dataclasses.replace(answer, new_input_tokens=ranked.new_input_tokens,
                               prefill_seconds=ranked.prefill_seconds + answer.prefill_seconds,
                               retrieved_events=ranked.retrieved_events)
