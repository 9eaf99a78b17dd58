"""The demonstration: a pass key hidden in 32K+ tokens (4x the trained context of the default model).

Plain full attention cannot answer (positions past 8K are outside what the model was trained on); it is run at
one depth here because 32K tokens of quadratic attention take 5-10 minutes on 2 cores (benchmarks/passkey.py runs
every depth). S found the key in 32,000-token documents at three depths; on these 32,768-token documents it is
not yet confirmed by a suite run (KNOWN_GAP). SM misses the key on this haystack: an xfail with the evidence.
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


KNOWN_GAP = (
    "unverified, issue 2 open: S answered 32,000-token passkey documents at depths 0.1/0.5/0.9 (3/3, this layout); "
    "the suite's first fresh-clone runs failed here only because the document builder undershot 32,768 tokens, "
    "fixed at the end of the session without a full re-run. Non-strict so a pass reports XPASS; turn it into a "
    "plain assertion once a run confirms it.")


@pytest.mark.slow
@pytest.mark.xfail(strict=False, reason=KNOWN_GAP)
@pytest.mark.parametrize("depth", DEPTHS)
def test_episodic_memory_finds_the_key(smol_bf16, depth):
    _assert_finds_key(smol_bf16, "S", depth)


@pytest.mark.slow
@pytest.mark.xfail(strict=False, reason=(
    "known gap, issue 2 open: on this periodic haystack SmolLM2-135M with modularity-refined events (SM) retrieves "
    "the event holding the key in most layers yet answers with haystack text. Kept as evidence at one depth."))
def test_refined_events_find_the_key(smol_bf16):
    _assert_finds_key(smol_bf16, "SM", 0.5)


def _assert_finds_key(pair, preset: str, depth: float) -> None:
    engine = EMEngine(*pair, EMConfig.from_preset(preset, **LAYOUT))
    doc, result, events = _ask(engine, depth)
    assert result.input_tokens >= TOKENS
    assert events > TOKENS // engine.config.max_block_size  # the document really went through memory
    assert doc.answer in result.text, f"{preset} at depth {depth}: expected {doc.answer}, got {result.text!r}"


@pytest.mark.slow
@pytest.mark.timeout(2400)  # quadratic: 32K tokens of full attention take 5-10 minutes on 2 cores
@pytest.mark.parametrize("depth", [0.5])
def test_full_attention_cannot(smol_bf16, depth):
    engine = EMEngine(*smol_bf16, EMConfig.from_preset("full"))
    doc, result, _ = _ask(engine, depth)
    assert result.input_tokens >= TOKENS
    assert doc.answer not in result.text, f"full attention unexpectedly found the key: {result.text!r}"
