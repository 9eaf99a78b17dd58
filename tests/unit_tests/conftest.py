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
