"""A small tmpfs mounted for one test: a real file system that fills up, to test full-disk handling."""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest


@contextlib.contextmanager
def mounted_tmpfs(mount_point: Path, size: str) -> Iterator[Path]:
    """Mount a tmpfs of ``size`` (e.g. "1m") at mount_point; skip the test (saying why) where mounting is not
    allowed (not root, no mount binary)."""
    mount_point.mkdir()
    reason = f"cannot mount a {size} tmpfs to fill a disk (needs root and mount)"
    try:
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount_point)],
                              capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as error:
        pytest.skip(f"{reason}: {error}")
    if done.returncode != 0:
        pytest.skip(f"{reason}: {done.stderr.strip()}")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], capture_output=True, timeout=30)
