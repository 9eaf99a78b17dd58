"""Shared fixtures for the unit tests (tiny tensors only, no model weights)."""

import sys
from pathlib import Path

import pytest
import torch

try:
    import emllm  # noqa: F401
except ImportError:  # package not installed: import from the source tree
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "core"))


@pytest.fixture(autouse=True, scope="session")
def _one_torch_thread():
    """Tiny tensors gain nothing from intra-op threads, and on a busy 2-core machine the thread pool's
    synchronisation makes them many times slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def smol_engine():
    """The real SmolLM2 tokenizer (files only, no weights) on a tiny model with its vocabulary."""
    transformers = pytest.importorskip("transformers")
    from emllm import EMConfig, EMEngine
    from emllm.models import ModelNotAvailableError, resolve_model_dir

    from .tiny import TINY, tiny_model

    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(resolve_model_dir("smollm2", progress=False))
    except ModelNotAvailableError as error:
        pytest.skip(f"the embedded SmolLM2 package is not installed, so its tokenizer is not here: {error}")
    model = tiny_model(vocab=len(tokenizer), hidden=16, intermediate=32)
    return EMEngine(model, tokenizer, EMConfig.from_preset("SM+C", **TINY), model_name="tiny-smollm2-vocab")
