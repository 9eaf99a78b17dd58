"""A Hugging Face hub cache laid out as huggingface_hub writes it, from a model folder on disk, so hub ids can be
tested offline: ``models--org--name/blobs/<sha256>`` holds each file once, ``snapshots/<commit>/<file>`` links to its
blob, ``refs/<branch or tag>`` names the commit."""

from __future__ import annotations

import hashlib
import os
import pathlib
import shutil


def add_snapshot(cache: pathlib.Path, repo_id: str, source: pathlib.Path, *, refs: tuple[str, ...] = ("main",),
                 link_only: bool = False) -> str:
    """Put every file of ``source`` into ``cache`` as one commit of ``repo_id``; returns the commit hash.

    ``link_only`` links blobs to the source files instead of copying them (for large weights read only)."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    files = sorted(p for p in source.iterdir() if p.is_file())
    digest = hashlib.sha1()
    for path in files:
        digest.update(path.name.encode() + b"\0" + str(path.stat().st_size).encode())
    digest.update(str(source.resolve()).encode())
    commit = digest.hexdigest()  # 40 hex digits, like a git commit
    snapshot = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True, exist_ok=True)
    for path in files:
        blob = repo / "blobs" / _blob_name(path, link_only)
        if not blob.exists():
            if link_only:
                blob.symlink_to(path.resolve())
            else:
                shutil.copyfile(path, blob)
        (snapshot / path.name).symlink_to(os.path.relpath(blob, snapshot))
    (repo / "refs").mkdir(exist_ok=True)
    for ref in refs:
        (repo / "refs" / ref).write_text(commit)
    return commit


def _blob_name(path: pathlib.Path, cheap: bool) -> str:
    """The content hash huggingface_hub names blobs by (a size-and-path hash for linked weights: reading GBs to
    name a symlink buys nothing)."""
    if cheap:
        return hashlib.sha256(f"{path.resolve()}:{path.stat().st_size}".encode()).hexdigest()
    return hashlib.sha256(path.read_bytes()).hexdigest()
