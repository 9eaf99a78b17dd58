"""The model a server answers with, loaded and made ready before the first request (`emllm serve` and each Ray Serve
replica)."""

from __future__ import annotations

import sys
from typing import Any


def prepared_engine(model: str | None, config: Any) -> Any:
    """The shared engine for ``model``, checked against ``config``, with what the first request would otherwise pay
    paid now: the weights' fingerprint every session save and load is matched to (hashing the weight files: about
    1 s a GB), and a process's first forward, slower than the rest."""
    from emllm import shared_engine
    from emllm.models import weights_fingerprint

    print(f"loading {model or 'the embedded default model'} ...", file=sys.stderr, flush=True)
    engine = shared_engine(model)
    config.validate_for_model(engine.shape.max_positions, engine.shape.num_layers)
    weights_fingerprint(engine.model)
    memory = engine.new_memory(config)
    try:
        engine.generate("Warm up.", memory=memory, max_new_tokens=1)
    finally:
        memory.close()
    return engine
