"""The sampling settings (and the reading, ``reread``) both chat adapters accept, checked and turned into
``MemoryPool.stream`` keywords.

LangChain and LlamaIndex both name the answer length ``max_tokens`` where the engine says ``max_new_tokens``; the
check runs before anything is read, so a bad per-call value fails at once rather than after a long prefill.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from emllm.decoding import check_reread, check_sampling


def sampling_options(max_tokens: int, temperature: float, top_p: float, top_k: int, seed: int | None,
                     stop: Sequence[str] | None, reread: bool = False) -> dict[str, Any]:
    """Validated keyword arguments for MemoryPool.stream (``stop``: a list of non-empty strings; ``reread``: answer
    from the retrieved events re-read as text, emllm.reread)."""
    check_sampling(max_tokens, temperature, top_p, top_k, seed=seed, stop=stop, length_name="max_tokens")
    check_reread(reread)
    return dict(max_new_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
                stop=list(stop) if stop else None, reread=reread)
