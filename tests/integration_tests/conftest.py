"""Shared real-model fixtures: the embedded SmolLM2-135M-Instruct (fast, for mechanical tests; the default model is
Qwen2.5-Coder-0.5B-Instruct), loaded once per session."""

from __future__ import annotations

import pytest
import torch

from emllm import EMConfig, EMEngine, load_model
from emllm.storage import PageStore

# The small model of the mechanical tests (named explicitly: the library default is Qwen2.5-Coder-0.5B-Instruct).
SMOL = "smollm2"

# A small layout keeps the real-model tests fast while exercising every part of the method:
# sinks, a local window, retrieved events, eviction and refinement.
SMALL = dict(n_init=64, n_local=512, n_mem=512, chunk_size=256, max_block_size=64)


@pytest.fixture(autouse=True, scope="session")
def one_torch_thread():
    """One intra-op thread per test process: the suite runs two xdist workers on 2 cores, and with 2 threads each
    they spin waiting for each other (measured under load: a 24-token answer took 42 s with 2 threads and 3.7 s
    with 1; reading 4,100 tokens 150-290 s against 43-47 s). Answers are unchanged."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def smol_fp32():
    """(model, tokenizer) in float32 with emllm attention installed (exactness needs fp32)."""
    return load_model(SMOL, dtype="float32", device="cpu")


@pytest.fixture(scope="session")
def smol_vanilla():
    """An untouched fp32 copy: the reference the engine must reproduce."""
    return load_model(SMOL, dtype="float32", device="cpu")


@pytest.fixture(scope="session")
def smol_fast():
    """(model, tokenizer) in the fastest dtype this CPU has for long inputs (what users get from dtype="auto").

    That is bfloat16 only on CPUs with native bf16 instructions (AVX512-BF16 or AMX). Elsewhere torch emulates bf16:
    on an AVX2-only EPYC a 512x576x1536 matmul took 59x as long in bf16 as in fp32, and the 32K passkey tests ran
    past their 15-minute limit. Tests must hold in either dtype.
    """
    return load_model(SMOL, dtype="auto", device="cpu")


def page_mb(pair, page_tokens: int) -> float:
    """Size of one KV page in the loaded dtype, as the engine's own store counts it, for RAM budgets in pages."""
    shape = make_engine(pair).shape
    store = PageStore(shape.num_layers, shape.num_kv_heads, shape.head_dim, shape.dtype, page_tokens=page_tokens)
    return store.page_bytes / 2**20


def make_engine(pair, preset: str = "SM", **overrides) -> EMEngine:
    model, tokenizer = pair
    return EMEngine(model, tokenizer, EMConfig.from_preset(preset, **{**SMALL, **overrides}), model_name=SMOL)
