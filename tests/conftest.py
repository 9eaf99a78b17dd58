"""How the suite shares the machine when pytest-xdist runs it on several workers (`make test` uses two).

Measured on the 2-core machine: two one-thread processes forward SmolLM2 at 840 tokens/s together, one two-thread
process at 633, so each worker gets an equal share of the cores. Modules stay whole on one worker because their
module fixtures read long documents once; the passkey demonstration's 32K runs are independent, so they spread.
Work starts longest first (the `slow(seconds=...)` estimates), so no worker is left with a long tail.
"""

from __future__ import annotations

import os

import pytest

SPREAD_MODULES = {"test_passkey_demo.py"}


def pytest_configure(config: pytest.Config) -> None:
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if workers:
        import torch

        torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))


def _estimated_seconds(item: pytest.Item) -> float:
    marker = item.get_closest_marker("slow")
    return float(marker.kwargs.get("seconds", 60)) if marker is not None else 0.0


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups into the test ids
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    unit_of = {}
    for item in items:
        if item.path.name in SPREAD_MODULES:
            unit_of[item.nodeid] = item.nodeid
        else:
            unit_of[item.nodeid] = item.module.__name__
            item.add_marker(pytest.mark.xdist_group(item.module.__name__))
    cost: dict[str, float] = {}
    for item in items:
        cost[unit_of[item.nodeid]] = cost.get(unit_of[item.nodeid], 0.0) + _estimated_seconds(item)
    order = {item.nodeid: index for index, item in enumerate(items)}
    items.sort(key=lambda item: (-cost[unit_of[item.nodeid]], order[item.nodeid]))
