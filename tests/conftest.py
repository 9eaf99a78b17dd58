"""How the suite shares the machine when pytest-xdist runs it on several workers (`make test` uses two).

Measured on the 2-core machine: two one-thread processes forward SmolLM2 at 840 tokens/s together, one two-thread
process at 630, so each worker gets an equal share of the cores. Modules stay whole on one worker because their
module fixtures read long documents once; the passkey demonstration's 16K runs are independent, so they spread.
Work starts longest first (the `slow(seconds=...)` estimates), so no worker is left with a long tail.

The grouping is a scheduler of our own (`pytest_xdist_make_scheduler`): xdist's `loadgroup` marks do not work with
this pytest (xdist 3.8 renames `item._nodeid`, which pytest 9 no longer reads), so every test became its own unit
and a module's fixtures were built once on each worker.
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


def _unit(nodeid: str) -> str:
    """What one worker runs as a whole: the test module, or the single test in SPREAD_MODULES."""
    path = nodeid.split("::", 1)[0]
    return nodeid if path.rsplit("/", 1)[-1] in SPREAD_MODULES else path


@pytest.hookimpl(optionalhook=True)  # xdist may be absent: plain `pytest` still runs
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    from xdist.scheduler import LoadScopeScheduling

    class ModuleScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _unit(nodeid)

    return ModuleScheduling(config, log)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Longest units first; xdist keeps this order with --no-loadscope-reorder."""
    cost: dict[str, float] = {}
    for item in items:
        cost[_unit(item.nodeid)] = cost.get(_unit(item.nodeid), 0.0) + _estimated_seconds(item)
    order = {item.nodeid: index for index, item in enumerate(items)}
    items.sort(key=lambda item: (-cost[_unit(item.nodeid)], order[item.nodeid]))
