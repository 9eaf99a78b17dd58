"""The demonstration: a pass key hidden in 32K+ tokens (4x the trained context of the default model).

EM-LLM with surprise events (S) and with modularity-refined events (SM) must answer at three depths. Plain full
attention cannot answer (positions past 8K are outside what the model was trained on). Full attention is asserted at
one depth here: 32K tokens of quadratic attention take 5-10 minutes on 2 cores, so three depths would not fit the
suite's 20 minutes; `python benchmarks/passkey.py` runs it at every depth and benchmarks/README.md records the result.
"""

from __future__ import annotations

import pytest

from emllm import EMConfig, EMEngine
from emllm.tasks import passkey_document

TOKENS = 32_768
DEPTHS = (0.1, 0.5, 0.9)
# A lighter layout than the defaults keeps three depths x two methods within the suite's time budget.
LAYOUT = dict(n_local=1024, n_mem=1024)


def _ask(engine: EMEngine, depth: float):
    doc = passkey_document(TOKENS, depth, engine.count_tokens, seed=int(depth * 1000))
    memory = engine.new_memory()
    result = engine.generate(doc.prompt, memory=memory, max_new_tokens=8)
    events = memory.num_events
    memory.close()
    return doc, result, events


@pytest.mark.slow(seconds=150)
@pytest.mark.parametrize("preset", ["S", "SM"])
@pytest.mark.parametrize("depth", DEPTHS)
def test_episodic_memory_finds_the_key(smol_bf16, preset, depth):
    engine = EMEngine(*smol_bf16, EMConfig.from_preset(preset, **LAYOUT))
    doc, result, events = _ask(engine, depth)
    assert result.input_tokens >= TOKENS
    assert events > TOKENS // engine.config.max_block_size  # the document really went through memory
    assert doc.answer in result.text, f"{preset} at depth {depth}: expected {doc.answer}, got {result.text!r}"


@pytest.mark.slow(seconds=500)
@pytest.mark.timeout(2400)  # quadratic: 32K tokens of full attention take 5-10 minutes on 2 cores
def test_full_attention_cannot(smol_bf16):
    engine = EMEngine(*smol_bf16, EMConfig.from_preset("full"))
    doc, result, _ = _ask(engine, 0.5)
    assert result.input_tokens >= TOKENS
    assert doc.answer not in result.text, f"full attention unexpectedly found the key: {result.text!r}"
