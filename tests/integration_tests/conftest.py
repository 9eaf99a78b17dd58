"""Shared real-model fixtures: the embedded SmolLM2-135M-Instruct, loaded once per session."""

from __future__ import annotations

import pytest
import torch

from emllm import EMConfig, EMEngine, load_model

# A small layout keeps the real-model tests fast while exercising every part of the method:
# sinks, a local window, retrieved events, eviction and refinement.
SMALL = dict(n_init=64, n_local=512, n_mem=512, chunk_size=256, max_block_size=64)


@pytest.fixture(scope="session")
def smol_fp32():
    """(model, tokenizer) in float32 with emllm attention installed (exactness needs fp32)."""
    return load_model(dtype="float32", device="cpu")


@pytest.fixture(scope="session")
def smol_vanilla():
    """An untouched fp32 copy: the reference the engine must reproduce."""
    return load_model(dtype="float32", device="cpu")


@pytest.fixture(scope="session")
def smol_bf16():
    """(model, tokenizer) in the fast dtype for long inputs."""
    return load_model(dtype="bfloat16", device="cpu")


def make_engine(pair, preset: str = "SM", **overrides) -> EMEngine:
    model, tokenizer = pair
    return EMEngine(model, tokenizer, EMConfig.from_preset(preset, **{**SMALL, **overrides}), model_name="smollm2")
