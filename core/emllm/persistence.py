"""Saving and loading a whole episodic memory: durable, atomic, verified.

A memory that read a book is worth minutes of prefill; saved, it can be questioned again tomorrow, by another
process, and answer exactly as before. A saved memory is a directory:

    manifest.json       format and version, the model's fingerprint and shape, the memory's config, its counts
                        (tokens, events, window, sinks, ...), every array's dtype and shape, the size and blake2b
                        of every other file, and a checksum of the manifest itself
    state.safetensors   everything but the evicted KV: token ids, surprise, boundary flags, events, last logits,
                        per layer the local window (raw keys, rotated keys, values, attention received), the sinks,
                        the representatives, the contiguity queue, the retrieved event ids and retrieval counts
    kv.safetensors      the evicted KV as one tensor "pages" [pages, layers, 2, page_tokens, kv_heads, head_dim]
                        (the last page zero-padded), written and read one page at a time: it can be GBs
    kv-NNNNNN.safetensors  more of the same, from page NNNNNN on, where a save replaced an earlier one (below)

A save that replaces an earlier save of the same memory (a conversation's next turn) writes no page it shares. Evicted
pages never change once full, so the manifest records each full page's blake2b; the new save hard-links the earlier
save's KV files whose pages the memory still holds unchanged (digests equal) and writes the pages after them, plus
the state. A 32K-token conversation's turn then writes tens of MB instead of its whole 460 MB.

No pickle anywhere: JSON and safetensors (the KV file is written by hand in the safetensors layout, so it can be
streamed; any safetensors reader opens it).

Atomic: the files are written into a temporary sibling directory and fsynced, then it takes the target's place
(an atomic exchange where the file system offers one, otherwise the old save is renamed aside first; a crash
between the two renames is repaired by the next load or save). A crash at any point leaves either the previous
complete save or the new one. Loading checks the version, the model, the config, every count and shape and every
checksum, and returns either a complete memory or raises MemoryFileError: nothing is half-loaded.
"""

from __future__ import annotations

import ctypes
import dataclasses
import errno
import hashlib
import json
import math
import os
import re
import secrets
import shutil
import struct
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import numpy as np
import safetensors.torch
import torch

from .config import ConfigError, EMConfig
from .memory import EpisodicMemory
from .scoring import (EventText, Representatives, representative_search, scorer_from_names, scorer_from_spec,
                      scorer_to_spec, with_parameters)
from .storage import PageStore, StorageFullError, process_alive

if TYPE_CHECKING:
    from transformers import PreTrainedModel

T = TypeVar("T")  # _split's items


class EngineLike(Protocol):
    """What saving and loading use of an EMEngine (named structurally, so this module does not import the engine)."""

    model: PreTrainedModel
    tokenizer: Any
    model_name: str
    shape: Any
    config: EMConfig
    input_device: torch.device

    def new_memory(self, config: EMConfig | None = None) -> EpisodicMemory: ...

FORMAT = "emllm-episodic-memory"
FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2)  # 1: one KV file and no page digests (read as one segment)
MANIFEST = "manifest.json"
STATE_FILE = "state.safetensors"
KV_FILE = "kv.safetensors"  # the KV segment from page 0 (in version 1 the only one)
_SEGMENT_FILE = re.compile(r"^kv(-\d{6,})?\.safetensors$")
PAGE_DIGEST_BYTES = 16

#: Config fields that say where a memory's pages live and how much may be read, not what it is: a loaded memory
#: takes them from the loading side (its machine, its disks), everything else from the save.
PLACEMENT_FIELDS = ("page_tokens", "ram_budget_mb", "device_budget_mb", "disk_budget_mb", "offload_dir",
                    "max_input_tokens")
# Fields the loading engine decides whatever the save says. A save holds no event-text embeddings (a loaded memory
# embeds its events again on its first question), so the model that embeds them is the engine's own choice; taking
# it from the manifest would let whoever wrote the file choose a folder of weights for this process to load.
ENGINE_FIELDS = ("event_embedding",)
# Config fields added after FORMAT_VERSION 1 was written, with the value that files lacking them were read with.
ADDED_FIELDS: dict[str, Any] = {"memory_positions": "fixed", "event_embedding": "minilm", "full_until": 0}
# Config fields of earlier releases that the scorer objects replaced (retrieval_scoring, retrieval_pooling) or that
# were removed, with the values a file may hold and still load: read_question_alone only chose how later prompts are
# cut into forwards (now always alone), so either; decode_retrieve_every and refine_layers only their kept value (1;
# None, the top third of the layers).
REPLACED_FIELDS: dict[str, tuple[Any, ...]] = {"read_question_alone": (True, False), "decode_retrieve_every": (1,),
                                               "refine_layers": (None,)}

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
           "int64": torch.int64, "bool": torch.bool}
_SAFETENSORS_CODE = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}
_FULL_DISK = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
_SIBLING = re.compile(r"^\.(?P<name>.+)\.(?P<kind>saving|old|trash)-(?P<pid>\d+)-[0-9a-f]+$")


class MemoryFileError(ValueError):
    """A saved memory cannot be loaded: missing, damaged, foreign, or made for another model or version.
    The message names the file and the problem."""


# ====================================================================== saving
def save_memory(memory: EpisodicMemory, path: str | os.PathLike, *, engine: EngineLike,
                metadata: dict[str, Any] | None = None, earlier: dict[str, Any] | None = None) -> Path:
    """Save everything ``memory`` has read into the directory ``path`` (replaced atomically if it holds a save).

    ``engine`` is the engine that made the memory: its model's fingerprint goes into the manifest so the memory is
    never loaded into another model. Raises StorageFullError (the previous save intact, nothing left behind) when
    the disk is full. Returns the directory. ``metadata`` (JSON) is stored in the checksummed manifest, so what an
    adapter needs besides the memory (e.g. its documents) is saved in the same atomic step; see read_metadata.

    A save over an earlier save of the same memory hard-links the earlier KV files whose pages it still holds and
    writes only the rest. ``earlier`` (a verified manifest, parse_manifest) names an earlier save kept elsewhere (a
    bucket's last generation) instead: its reusable KV files are listed in the new manifest but not written, and the
    caller puts them beside the new save (as server-side copies) before anyone loads it.
    """
    try:
        json.dumps(metadata)
    except (TypeError, ValueError) as error:
        raise TypeError(f"metadata must be JSON-serialisable (dicts, lists, strings, numbers): {error}") from error
    if memory.closed:
        raise ValueError("This episodic memory was closed; there is nothing to save.")
    if memory.shape != engine.shape:
        raise ValueError(f"This memory was made for a model of shape {memory.shape}, but the engine passed runs "
                         f"{engine.shape}; pass the engine that made the memory.")
    target = Path(path).absolute()
    if target.is_symlink():  # a link to a save: the save it names is replaced, the link stays
        target = target.resolve()
    _check_replaceable(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    _tidy_siblings(target)
    store = memory.store
    kv_pages = math.ceil(store.num_tokens / store.page_tokens)
    state = _state_tensors(memory)
    state_bytes = safetensors.torch.save(state, metadata={"format": FORMAT})
    kept, earlier_files = _reusable_segments(earlier if earlier is not None else target, memory, engine)
    first_new = sum(segment["used"] for segment in kept)
    needed = (kv_pages - first_new) * store.page_bytes + len(state_bytes) + 2**16
    free = shutil.disk_usage(target.parent).free
    if free < needed:
        raise StorageFullError(errno.ENOSPC, _full_message(target, "the save", needed, free, "(checked before "
                                                           "writing anything)"))
    temp = _sibling(target, "saving")
    current = "a temporary directory"
    try:
        os.mkdir(temp)
        files: dict[str, dict[str, Any]] = {}
        try:
            for segment in kept:
                current = segment["file"]
                if earlier is None:
                    _link_or_copy(target / segment["file"], temp / segment["file"])
                files[segment["file"]] = earlier_files[segment["file"]]
        except FileNotFoundError:  # the earlier save was replaced meanwhile (another process): write everything
            for name in files:
                (temp / name).unlink(missing_ok=True)
            kept, files, first_new = [], {}, 0
        segments = list(kept)
        if first_new < kv_pages or not segments:
            current = segment_file(first_new)
            files[current] = _write_file(temp / current, _kv_chunks(store, first_new, kv_pages))
            files[current]["tensors"] = {"pages": _spec(store.dtype, [kv_pages - first_new, *store.page_shape])}
            segments.append({"file": current, "first_page": first_new, "pages": kv_pages - first_new,
                             "used": kv_pages - first_new})
        current = STATE_FILE
        files[STATE_FILE] = _write_file(temp / STATE_FILE, [state_bytes])
        files[STATE_FILE]["tensors"] = {name: _spec(t.dtype, list(t.shape)) for name, t in state.items()}
        current = MANIFEST
        manifest = _manifest(memory, engine, files, kv_pages, segments, metadata or {})
        _write_file(temp / MANIFEST, [json.dumps(manifest, indent=1, sort_keys=True).encode()])
        _fsync_dir(temp)
        current = "the directory entry"
        _install(temp, target)
    except BaseException as error:
        shutil.rmtree(temp, ignore_errors=True)
        if isinstance(error, OSError) and error.errno in _FULL_DISK:
            free = shutil.disk_usage(target.parent).free
            raise StorageFullError(error.errno, _full_message(target, current, needed, free,
                                                              f"({error.strerror})")) from error
        raise
    return target


def _full_message(target: Path, what: str, needed: int, free: int, detail: str) -> str:
    return (f"Could not save the episodic memory to {target}: no room for {what} {detail}; the save needs about "
            f"{needed / 2**20:.1f} MB and {free / 2**20:.1f} MB are free there. The previous save there (if any) is "
            "intact and nothing was left behind; free disk space or save to a larger disk.")


def _check_replaceable(target: Path) -> None:
    """Only a saved memory (or nothing, or an empty directory) may be replaced: never a user's other data."""
    if not target.exists():
        return
    if not target.is_dir():
        raise ValueError(f"{target} is a file, not a saved memory; choose a directory path for save_memory.")
    if any(target.iterdir()) and not (target / MANIFEST).is_file():
        raise ValueError(f"{target} is a non-empty directory without {MANIFEST}: it is not a saved memory and "
                         "will not be replaced. Choose a new or empty directory.")


def _state_tensors(memory: EpisodicMemory) -> dict[str, torch.Tensor]:
    """memory.state_dict() as the file's flat CPU tensors (layers stacked on dim 0; ragged lists flattened with
    per-layer counts); its scalars go to the manifest."""
    state = memory.state_dict()
    layers = state["layers"]
    _uniform(memory.layers, "length")
    rotated = min(layer["window_rotated"].shape[1] for layer in layers)  # rotated again on demand where it differs
    queues = [layer["contiguity"] for layer in layers]
    retrieved = [layer["retrieved_ids"] for layer in layers]
    cpu = lambda t: t.detach().to("cpu").contiguous().clone()  # noqa: E731  (safetensors refuses shared memory)
    stack = lambda name: cpu(torch.stack([layer[name].to("cpu") for layer in layers]))  # noqa: E731
    tensors = {
        "token_ids": torch.tensor(state["token_ids"], dtype=torch.int64),
        "surprise": cpu(state["surprise"].float()),
        "boundary_flags": cpu(state["boundary_flags"].bool()),
        "event_starts": cpu(state["event_starts"].long()),
        "event_sizes": cpu(state["event_sizes"].long()),
        "window_keys": stack("window_keys"),
        "window_values": stack("window_values"),
        "window_rotated": cpu(torch.stack([layer["window_rotated"][:, :rotated].to("cpu") for layer in layers])),
        "window_scores": cpu(torch.stack([layer["window_scores"].float().to("cpu") for layer in layers])),
        "sink_keys": stack("sink_keys"),
        "sink_values": stack("sink_values"),
        "representatives": cpu(torch.stack([layer["representatives"].float().to("cpu") for layer in layers])),
        "contiguity_ids": torch.tensor([e for q in queues for e, _ in q], dtype=torch.int64),
        "contiguity_sizes": torch.tensor([s for q in queues for _, s in q], dtype=torch.int64),
        "contiguity_counts": torch.tensor([len(q) for q in queues], dtype=torch.int64),
        "retrieved_ids": torch.tensor([e for r in retrieved for e in r], dtype=torch.int64),
        "retrieved_counts": torch.tensor([len(r) for r in retrieved], dtype=torch.int64),
        "retrievals": torch.tensor([layer["retrievals"] for layer in layers], dtype=torch.int64),
    }
    if state["last_logits"] is not None:
        tensors["last_logits"] = cpu(state["last_logits"])
    return tensors


def _uniform(layers: list, name: str) -> int:
    values = {getattr(layer, name) for layer in layers}
    if len(values) != 1:
        raise RuntimeError(f"Layers disagree on {name} ({sorted(values)}): the memory is mid-forward or damaged "
                           "and cannot be saved.")
    return values.pop()


def segment_file(first_page: int) -> str:
    """The name of the KV file holding pages from ``first_page`` on."""
    return KV_FILE if first_page == 0 else f"kv-{first_page:06d}.safetensors"


def _kv_chunks(store: PageStore, first: int, pages: int) -> Iterator[memoryview]:
    """A KV file's bytes: a safetensors header, then pages [first, pages) in order (one page in RAM at a time). A
    full page's digest is kept in the store as it passes, so the next save can tell it is already on disk."""
    count = pages - first
    yield memoryview(_safetensors_header("pages", store.dtype, [count, *store.page_shape], count * store.page_bytes))
    for page_id in range(first, pages):
        page = store.read_page(page_id).detach().to("cpu")
        fill = min(store.page_tokens, store.num_tokens - page_id * store.page_tokens)
        if fill < store.page_tokens:  # the tail: its unused rows are uninitialised memory, write zeros instead
            padded = torch.zeros(store.page_shape, dtype=store.dtype)
            padded[:, :, :fill] = page[:, :, :fill]
            page = padded
        data = _bytes_of(page)
        if fill == store.page_tokens:
            store.digests[page_id] = page_digest(data)
        yield data


def page_digest(data: bytes | bytearray | memoryview) -> str:
    """A full KV page's digest, as the manifest records it."""
    return hashlib.blake2b(data, digest_size=PAGE_DIGEST_BYTES).hexdigest()


def _stored_digest(store: PageStore, page_id: int) -> str:
    """The digest of a full page of ``store``, computed (and kept) if no save or load has yet."""
    if page_id not in store.digests:
        store.digests[page_id] = page_digest(_bytes_of(store.read_page(page_id).detach().to("cpu")))
    return store.digests[page_id]


def _reusable_segments(earlier: Path | dict[str, Any], memory: EpisodicMemory,
                       engine: EngineLike) -> tuple[list[dict], dict]:
    """The KV segments of the earlier save (a folder, or its verified manifest) that hold, from page 0 on, only full
    pages this memory still holds unchanged, each cut to the pages it may give (a segment's last page may have been
    the tail then); with that save's file entries. Nothing (a full save) where there is no readable save of this
    model's pages with this page size and their digests, or where the first page already differs."""
    from . import models

    try:
        manifest = _read_manifest(earlier) if isinstance(earlier, Path) else \
            check_manifest(earlier, "the earlier save's manifest")
        info, store = manifest["memory"], memory.store
        recorded = info.get("kv_page_digests") or []
        if (manifest["model"].get("fingerprint") != models.model_fingerprint(engine.model)
                or info.get("kv_page_tokens") != store.page_tokens or not isinstance(recorded, list)):
            return [], {}
        full_now = min(len(recorded), store.num_tokens // store.page_tokens)
        kept, page = [], 0
        for segment in _segments_of(info):
            used = 0
            while (used < segment["used"] and page + used < full_now
                   and recorded[page + used] == _stored_digest(store, page + used)):
                used += 1
            if used:
                kept.append({**segment, "used": used})
                page += used
            if used < segment["used"]:
                break
        return kept, manifest["files"]
    except (MemoryFileError, KeyError, TypeError, ValueError):
        return [], {}  # not a save this one can build on: write everything


def _link_or_copy(source: Path, destination: Path) -> None:
    """A hard link (no bytes written; the file outlives the save it came from), or a copy where the file system
    has no links."""
    try:
        os.link(source, destination)
    except OSError as error:
        if error.errno not in (errno.EPERM, errno.EOPNOTSUPP, errno.EXDEV, errno.EMLINK, errno.ENOTSUP):
            raise
        shutil.copyfile(source, destination)
        with open(destination, "rb+") as handle:
            os.fsync(handle.fileno())


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    return tensor.contiguous().reshape(-1).view(torch.uint8).numpy().data  # the array's buffer, as a memoryview


def _safetensors_header(name: str, dtype: torch.dtype, shape: list[int], nbytes: int) -> bytes:
    header = {"__metadata__": {"format": FORMAT},
              name: {"dtype": _SAFETENSORS_CODE[dtype], "shape": shape, "data_offsets": [0, nbytes]}}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # tensor data starts 8-byte aligned
    return struct.pack("<Q", len(raw)) + raw


def _write_file(path: Path, chunks: Iterable[bytes | memoryview]) -> dict[str, Any]:
    """Write chunks to a new file, fsync it, and return its size and blake2b."""
    digest, size = hashlib.blake2b(digest_size=32), 0
    with open(path, "xb") as handle:
        for chunk in chunks:
            handle.write(chunk)
            digest.update(chunk)
            size += len(chunk)
        handle.flush()
        os.fsync(handle.fileno())
    return {"bytes": size, "blake2b": digest.hexdigest()}


def _spec(dtype: torch.dtype, shape: list[int]) -> dict[str, Any]:
    return {"dtype": str(dtype).removeprefix("torch."), "shape": [int(s) for s in shape]}


def _manifest(memory: EpisodicMemory, engine: EngineLike, files: dict, kv_pages: int, segments: list[dict],
              metadata: dict[str, Any]) -> dict[str, Any]:
    from . import models

    layer = memory.layers[0]
    shape = memory.shape
    logits = memory.last_logits
    manifest = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "model": {"name": engine.model_name, "fingerprint": models.model_fingerprint(engine.model),
                  "weights": models.weights_fingerprint(engine.model),
                  "tokenizer": models.tokenizer_fingerprint(engine.tokenizer),
                  "num_layers": shape.num_layers, "num_heads": shape.num_heads, "num_kv_heads": shape.num_kv_heads,
                  "head_dim": shape.head_dim, "dtype": _spec(shape.dtype, [])["dtype"],
                  "max_positions": shape.max_positions},
        "config": _config_fields(memory.config),
        "memory": {
            "total_tokens": memory.total_tokens, "events": memory.num_events,
            "evicted_tokens": memory.store.num_tokens, "sink_tokens": int(layer.sink_keys.shape[1]),
            "window_tokens": layer.length, "rotated_tokens": files[STATE_FILE]["tensors"]["window_rotated"]["shape"][2],
            "local_start": memory.local_start, "sinks_split": memory.sinks_split,
            "track_surprise": memory.track_surprise, "pinned_spans": [list(span) for span in memory.pinned_spans],
            "contiguity_entries": files[STATE_FILE]["tensors"]["contiguity_ids"]["shape"][0],
            "retrieved_entries": sum(len(layer.retrieved_ids) for layer in memory.layers),
            "last_logits": None if logits is None else _spec(logits.dtype, list(logits.shape)),
            "kv_pages": kv_pages, "kv_page_tokens": memory.store.page_tokens, "kv_segments": segments,
            "kv_page_digests": [_stored_digest(memory.store, page)
                                for page in range(memory.store.num_tokens // memory.store.page_tokens)],
        },
        "files": files,
        "metadata": metadata,
    }
    manifest["checksum"] = manifest_checksum(manifest)
    return manifest


def _config_fields(config: EMConfig) -> dict[str, Any]:
    fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
    return {**fields, "scorer": scorer_to_spec(config.scorer)}


def manifest_checksum(manifest: dict[str, Any]) -> str:
    """The checksum a manifest carries (blake2b of every other field, keys sorted); load_memory refuses a manifest
    whose checksum differs. Public so that a tool (or a test) that rewrites a manifest on purpose can sign it again,
    and so reach the checks that come after this one."""
    body = {k: v for k, v in manifest.items() if k != "checksum"}
    return hashlib.blake2b(json.dumps(body, sort_keys=True, separators=(",", ":")).encode(),
                           digest_size=32).hexdigest()


# ---------------------------------------------------------------------- atomic replacement
def _install(temp: Path, target: Path) -> None:
    """Put the finished temp directory at target; afterwards exactly one complete save is at target."""
    parent = target.parent
    if not target.exists():
        os.rename(temp, target)
        _fsync_dir(parent)
        return
    if exchange(temp, target):  # atomic swap: target is the new save, temp now holds the old one
        _fsync_dir(parent)
        shutil.rmtree(temp, ignore_errors=True)
        return
    # No atomic exchange here: rename the old save aside, then the new one in. A crash between the two leaves the
    # complete old save under the ".old-" name, which _tidy_siblings renames back.
    aside = _sibling(target, "old")
    os.rename(target, aside)
    try:
        os.rename(temp, target)
    except BaseException:
        os.rename(aside, target)  # put the old save back before reporting the failure
        raise
    _fsync_dir(parent)
    trash = _sibling(target, "trash")  # renamed first, so a half-removed old save is never mistaken for a whole one
    os.rename(aside, trash)
    shutil.rmtree(trash, ignore_errors=True)


def _sibling(target: Path, kind: str) -> Path:
    return target.parent / f".{target.name}.{kind}-{os.getpid()}-{secrets.token_hex(4)}"


_RENAME_EXCHANGE = 2
HAVE_EXCHANGE = True
"""Whether to try an atomic exchange (renameat2 RENAME_EXCHANGE) when a save replaces another: cleared on the first
platform without it. Public so that the rename-aside path can be forced (the crash tests cover both paths)."""


def exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths (Linux renameat2); False where unsupported. Public as one of the file-system steps
    a save takes, so that a crash test can stop a save at each of them."""
    global HAVE_EXCHANGE
    if not HAVE_EXCHANGE:
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        HAVE_EXCHANGE = False
        return False
    at_fdcwd = -100
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False  # this file system cannot exchange; another might, so only the platform check is cached
    raise OSError(code, os.strerror(code), str(b))


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _tidy_siblings(target: Path) -> None:
    """Repair and clean up after a crashed save of target: restore an old save that was renamed aside (the new
    one never arrived), then remove temp/old/trash siblings whose process is gone."""
    if not target.parent.is_dir():
        return
    found = []
    for entry in target.parent.iterdir():
        match = _SIBLING.match(entry.name)
        if match and match["name"] == target.name and not process_alive(int(match["pid"])):
            found.append((match["kind"], entry))
    if not target.exists():
        olds = sorted((e for kind, e in found if kind == "old" and (e / MANIFEST).is_file()),
                      key=lambda e: e.stat().st_mtime)
        if olds:
            os.rename(olds[-1], target)
            _fsync_dir(target.parent)
    for _, entry in found:
        if entry.exists():
            shutil.rmtree(entry, ignore_errors=True)


# ====================================================================== loading
def load_memory(path: str | os.PathLike, engine: EngineLike, *, config: EMConfig | None = None) -> EpisodicMemory:
    """Load a memory saved by save_memory into a new memory of ``engine``; it answers exactly as the saved one.

    The saved config is restored; only the placement fields (page_tokens, ram_budget_mb, device_budget_mb,
    disk_budget_mb, offload_dir, max_input_tokens) come from ``config`` (default: the engine's), so evicted pages go
    to this machine's RAM within its budget and the rest to its disk, and so does event_embedding (ENGINE_FIELDS: the
    file never chooses weights to load). A ``config`` whose other fields differ from the saved ones is refused.
    Raises MemoryFileError if anything is missing, damaged, foreign or incompatible; then no memory is returned and
    nothing is left behind.
    """
    target = Path(path).absolute()
    for attempt in range(_LOAD_ATTEMPTS):
        before = _identity(target)
        try:
            return _load_once(target, engine, config)
        except MemoryFileError:
            # Another process replaced the save while this one read it (files of two saves mix): read it again.
            if attempt == _LOAD_ATTEMPTS - 1 or before is None or _replaced_identity(target) in (before, None):
                raise
    raise AssertionError("unreachable")


def _replaced_identity(target: Path, wait_seconds: float = 1.0) -> tuple[int, int] | None:
    """_identity(target), waiting a little while it is missing: a save renames the old directory aside before the
    new one arrives."""
    deadline = time.monotonic() + wait_seconds
    while (now := _identity(target)) is None and time.monotonic() < deadline:
        time.sleep(0.02)
    return now


_LOAD_ATTEMPTS = 3


def _identity(target: Path) -> tuple[int, int] | None:
    """Which directory ``target`` names now (device, inode); None if none. A save replaces it whole."""
    try:
        info = os.stat(target)
    except OSError:
        return None
    return info.st_dev, info.st_ino


def _load_once(target: Path, engine: EngineLike, config: EMConfig | None) -> EpisodicMemory:
    _tidy_siblings(target)
    if not target.is_dir():
        raise MemoryFileError(f"No saved memory at {target}: " + ("it is a file, not a directory."
                              if target.exists() else "the directory does not exist."))
    manifest = _read_manifest(target)
    _check_model(manifest, engine, target)
    memory_config = _restore_config(manifest, engine, config, target)
    info = manifest["memory"]
    expected = _expected_specs(info, manifest["model"])
    files = _check_files(manifest, expected, target)
    state = read_state(target / STATE_FILE, files[STATE_FILE], expected[STATE_FILE])
    _check_consistency(state, info, memory_config, engine.shape.max_positions, target)
    memory = engine.new_memory(memory_config)
    try:
        _stream_kv(memory.store, target, files, info)
        memory.load_state_dict(_state_dict(state, info, engine))
    except BaseException:
        memory.close()
        raise
    return memory


def read_metadata(path: str | os.PathLike) -> dict[str, Any]:
    """The ``metadata`` a save was made with, from its verified manifest (MemoryFileError if damaged); a save
    interrupted between its two renames is repaired first, as load_memory does."""
    target = Path(path).absolute()
    _tidy_siblings(target)
    if not target.is_dir():
        raise MemoryFileError(f"No saved memory at {target}: the directory does not exist.")
    metadata = _read_manifest(target).get("metadata", {})
    if not isinstance(metadata, dict):
        raise MemoryFileError(f"{target / MANIFEST} has a 'metadata' section that is not a JSON object.")
    return metadata


def _read_manifest(target: Path) -> dict[str, Any]:
    path = target / MANIFEST
    if not path.is_file():
        raise MemoryFileError(f"{path} is missing: {target} is not a saved episodic memory (or the save is "
                              "incomplete). Save one with save_memory().")
    return parse_manifest(path.read_bytes(), path)


def parse_manifest(data: bytes, path: str | os.PathLike) -> dict[str, Any]:
    """A manifest's bytes (read from ``path``, named in errors) as the verified manifest: format, version, checksum
    and sections checked; MemoryFileError otherwise. Public for a store that keeps saves elsewhere than a folder (a
    bucket): it reads a save's manifest alone, to save the next one over it (save_memory's ``earlier``)."""
    try:
        manifest = json.loads(data)
    except (ValueError, UnicodeDecodeError) as error:
        raise MemoryFileError(f"{path} is damaged: not valid JSON ({error}).") from error
    return check_manifest(manifest, path)


def check_manifest(manifest: Any, path: str | os.PathLike) -> dict[str, Any]:
    """``manifest`` (JSON already parsed, from ``path``) if it is a whole, signed manifest of a version this emllm
    reads; MemoryFileError otherwise."""
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        found = manifest.get("format") if isinstance(manifest, dict) else None
        raise MemoryFileError(f"{path} is not an emllm episodic-memory manifest (format {found!r}, expected "
                              f"{FORMAT!r}).")
    version = manifest.get("format_version")
    if version not in READABLE_VERSIONS:
        raise MemoryFileError(f"{path} has format version {version!r}; this emllm reads versions "
                              f"{', '.join(map(str, READABLE_VERSIONS))}. Load it with the emllm release that saved "
                              "it, or read the document again.")
    if manifest.get("checksum") != manifest_checksum(manifest):
        raise MemoryFileError(f"{path} is damaged: its checksum does not match its content (edited or corrupted).")
    for key in ("model", "config", "memory", "files"):
        if not isinstance(manifest.get(key), dict):
            raise MemoryFileError(f"{path} lacks its {key!r} section.")
    return manifest


def _check_model(manifest: dict[str, Any], engine: EngineLike, target: Path) -> None:
    from . import models

    saved = manifest["model"]
    fingerprint = models.model_fingerprint(engine.model)
    if saved.get("fingerprint") != fingerprint:
        raise MemoryFileError(
            f"The memory at {target} was saved with model {saved.get('name')!r} (fingerprint "
            f"{saved.get('fingerprint')}), but this engine runs {engine.model_name!r} (fingerprint {fingerprint}). "
            "A memory holds one model's keys and values; load it with the model that made it.")
    # Saves from before these two were recorded are checked by architecture and file sizes alone.
    for part, print_of, what in (("weights", lambda: models.weights_fingerprint(engine.model), "weights' content"),
                                 ("tokenizer", lambda: models.tokenizer_fingerprint(engine.tokenizer),
                                  "tokenizer (vocabulary, added tokens, chat template)")):
        if part in saved and saved[part] != print_of():
            raise MemoryFileError(
                f"The memory at {target} was saved with a model whose {what} differ from this engine's "
                f"({engine.model_name!r}), though its architecture and file sizes match (a fine-tune and its base, "
                "or another tokenizer): its keys, values and token ids belong to that model. Load it with the model "
                "and tokenizer that made it.")
    logits = manifest["memory"].get("last_logits")
    head = engine.model.get_output_embeddings()
    if isinstance(logits, dict) and head is not None and logits.get("shape") != [head.weight.shape[0]]:
        raise MemoryFileError(f"The memory at {target} holds logits over {logits.get('shape')} tokens, but this "
                              f"model's vocabulary has {head.weight.shape[0]}; load it with the model that made it.")
    shape = engine.shape
    ours = {"num_layers": shape.num_layers, "num_heads": shape.num_heads, "num_kv_heads": shape.num_kv_heads,
            "head_dim": shape.head_dim, "dtype": _spec(shape.dtype, [])["dtype"]}
    differ = {k: (saved.get(k), v) for k, v in ours.items() if saved.get(k) != v}
    if differ:
        detail = ", ".join(f"{k}: saved {a!r}, engine {b!r}" for k, (a, b) in differ.items())
        raise MemoryFileError(f"The memory at {target} does not fit this engine's model ({detail}). Load it with "
                              "the same model in the same dtype it was saved with.")


def _restore_config(manifest: dict[str, Any], engine: EngineLike, config: EMConfig | None,
                    target: Path) -> EMConfig:
    saved = _current_config_fields({**ADDED_FIELDS, **manifest["config"]}, target)
    names = {f.name for f in dataclasses.fields(EMConfig)}
    if set(saved) != names:
        raise MemoryFileError(f"{target / MANIFEST}: the saved config fields do not match this emllm's EMConfig "
                              f"(unknown: {sorted(set(saved) - names)}, missing: {sorted(names - set(saved))}).")
    placement = config or engine.config
    if config is not None:
        differ = [f"{k}={saved[k]!r} (given {getattr(config, k)!r})"
                  for k in sorted(names - set(PLACEMENT_FIELDS) - set(ENGINE_FIELDS)) if saved[k] != getattr(config, k)]
        if differ:
            raise MemoryFileError(
                f"The memory at {target} was built with {', '.join(differ)} (see its {MANIFEST}); a memory's "
                "layout and method cannot change after it was read. Pass a config with the saved values, or none "
                "(the saved one is used).")
    saved.update({k: getattr(placement, k) for k in (*PLACEMENT_FIELDS, *ENGINE_FIELDS)})
    try:
        restored = EMConfig(**saved)
        restored.validate_for_model(engine.shape.max_positions, engine.shape.num_layers)
    except (ConfigError, TypeError) as error:
        raise MemoryFileError(f"{target / MANIFEST}: the saved config cannot be used with this engine: {error}") \
            from error
    return restored


def _current_config_fields(saved: dict[str, Any], target: Path) -> dict[str, Any]:
    """The saved config in today's fields: the scorer rebuilt from its description (or from the retrieval_scoring
    and retrieval_pooling names files of earlier releases hold), removed fields dropped if they hold a value that
    can still be read."""
    saved = dict(saved)
    try:
        if "scorer" in saved:
            saved["scorer"] = scorer_from_spec(saved["scorer"])
        else:
            saved["scorer"] = scorer_from_names(saved.pop("retrieval_scoring", "representatives"),
                                                saved.pop("retrieval_pooling", "none"))
    except ValueError as error:
        raise MemoryFileError(f"{target / MANIFEST}: the saved scorer cannot be rebuilt: {error}") from error
    # Fields that became scorer parameters (config.MOVED_FIELDS): the saved value goes onto the scorer's parts.
    backend, faiss_min_events = saved.pop("retrieval_backend", None), saved.pop("faiss_min_events", None)
    bias = saved.pop("relevance_bias", None)
    try:
        if backend is not None or faiss_min_events is not None:
            search = dict(zip(("backend", "faiss_min_events"), representative_search(saved["scorer"])))
            search.update({k: v for k, v in (("backend", backend), ("faiss_min_events", faiss_min_events))
                           if v is not None})
            saved["scorer"] = with_parameters(saved["scorer"], Representatives, **search)
        if bias:
            saved["scorer"] = with_parameters(saved["scorer"], EventText, relevance_bias=bias)
    except ValueError as error:
        raise MemoryFileError(f"{target / MANIFEST}: the saved retrieval settings cannot be restored: {error}") \
            from error
    for name, readable in REPLACED_FIELDS.items():
        if name in saved and saved.pop(name) not in readable:
            raise MemoryFileError(f"{target / MANIFEST}: saved with {name} set to a value this emllm no longer "
                                  f"supports (only {readable}); read the document again.")
    return saved


def _expected_specs(info: dict[str, Any], model: dict[str, Any]) -> dict[str, dict[str, dict]]:
    """Every array's dtype and shape, derived from the manifest's counts and the model's shape."""
    try:
        L, kv, d = model["num_layers"], model["num_kv_heads"], model["head_dim"]
        dtype = _DTYPES[model["dtype"]]
        T, E = info["total_tokens"], info["events"]
        W, R, S = info["window_tokens"], info["rotated_tokens"], info["sink_tokens"]
        state = {
            "token_ids": _spec(torch.int64, [T]), "surprise": _spec(torch.float32, [T]),
            "boundary_flags": _spec(torch.bool, [T]),
            "event_starts": _spec(torch.int64, [E]), "event_sizes": _spec(torch.int64, [E]),
            "window_keys": _spec(dtype, [L, kv, W, d]), "window_values": _spec(dtype, [L, kv, W, d]),
            "window_rotated": _spec(dtype, [L, kv, R, d]), "window_scores": _spec(torch.float32, [L, kv, W]),
            "sink_keys": _spec(dtype, [L, kv, S, d]), "sink_values": _spec(dtype, [L, kv, S, d]),
            "representatives": _spec(torch.float32, [L, E, kv * d]),
            "contiguity_ids": _spec(torch.int64, [info["contiguity_entries"]]),
            "contiguity_sizes": _spec(torch.int64, [info["contiguity_entries"]]),
            "contiguity_counts": _spec(torch.int64, [L]),
            "retrieved_ids": _spec(torch.int64, [info["retrieved_entries"]]),
            "retrieved_counts": _spec(torch.int64, [L]), "retrievals": _spec(torch.int64, [L]),
        }
        if info["last_logits"] is not None:
            state["last_logits"] = dict(info["last_logits"])
        page_shape = [L, 2, info["kv_page_tokens"], kv, d]
        counts = [T, E, W, R, S, info["contiguity_entries"], info["retrieved_entries"], info["kv_pages"],
                  info["kv_page_tokens"], info["evicted_tokens"], info["local_start"]]
    except (KeyError, TypeError) as error:
        raise MemoryFileError(f"{MANIFEST} lacks or garbles a required entry: {error!r}.") from error
    if any(not isinstance(c, int) or isinstance(c, bool) or c < 0 for c in counts) or info["kv_page_tokens"] < 1 \
            or info["kv_pages"] != -(-info["evicted_tokens"] // info["kv_page_tokens"]):
        raise MemoryFileError(f"{MANIFEST} holds impossible counts in its 'memory' section: {info}.")
    kv_files = {segment["file"]: {"pages": _spec(dtype, [segment["pages"], *page_shape])}
                for segment in _segments_of(info)}
    return {STATE_FILE: state, **kv_files}


def _segments_of(info: dict[str, Any]) -> list[dict[str, Any]]:
    """The manifest's KV segments, checked: files named as saves name them, each giving pages [first_page,
    first_page + used) of its ``pages``, together every page once and in order. A version-1 manifest has one."""
    segments = info.get("kv_segments", [{"file": KV_FILE, "first_page": 0, "pages": info.get("kv_pages"),
                                         "used": info.get("kv_pages")}])
    fields = ("file", "first_page", "pages", "used")
    problem = None
    if not isinstance(segments, list) or not segments:
        problem = "no KV segments"
    else:
        page = 0
        for segment in segments:
            if not isinstance(segment, dict) or set(segment) != set(fields):
                problem = f"a KV segment is not {{{', '.join(fields)}}}: {segment!r}"
            elif any(not isinstance(segment[k], int) or isinstance(segment[k], bool) for k in fields[1:]) \
                    or segment["first_page"] != page or not 0 <= segment["used"] <= segment["pages"] \
                    or (segment["used"] == 0 and len(segments) > 1):
                problem = f"KV segments do not give every page once, in order: {segments!r}"
            elif not isinstance(segment["file"], str) or not _SEGMENT_FILE.match(segment["file"]) \
                    or segment["file"] != segment_file(segment["first_page"]):
                problem = f"a KV segment's file name is not one a save writes: {segment['file']!r}"
            if problem:
                break
            page += segment["used"]
        if not problem and (page != info.get("kv_pages") or len({s["file"] for s in segments}) != len(segments)):
            problem = f"its KV segments do not match the memory's counts ({info.get('kv_pages')} pages): {segments!r}"
    if problem:
        raise MemoryFileError(f"{MANIFEST} is inconsistent: {problem}.")
    return segments


def _check_files(manifest: dict[str, Any], expected: dict, target: Path) -> dict[str, dict]:
    """Every file listed, present, of the recorded size, with the shapes the counts imply (no data read yet)."""
    files = manifest["files"]
    for name in expected:
        entry = files.get(name)
        path = target / name
        if not isinstance(entry, dict) or not {"bytes", "blake2b", "tensors"} <= set(entry):
            raise MemoryFileError(f"{target / MANIFEST} does not describe {name}.")
        if entry["tensors"] != expected[name]:
            raise MemoryFileError(f"{target / MANIFEST}: the arrays listed for {name} do not match the memory's "
                                  "counts (the manifest is inconsistent).")
        if not path.is_file():
            raise MemoryFileError(f"{path} is missing: the saved memory is incomplete.")
        size = path.stat().st_size
        if size != entry["bytes"]:
            what = "truncated" if size < entry["bytes"] else "longer than saved"
            raise MemoryFileError(f"{path} is damaged: {what} ({size} bytes, the save wrote {entry['bytes']}).")
    return files


def read_state(path: Path, entry: dict, expected: dict) -> dict[str, torch.Tensor]:
    """The arrays of a save's state file, checked against its manifest ``entry`` (size and blake2b) and the
    ``expected`` {name: dtype and shape}; MemoryFileError otherwise. Public as the step of load_memory that reads
    the state after the manifest, so that a test can have a save land between the two (a load that races a save)."""
    data = path.read_bytes()
    if len(data) != entry["bytes"] or hashlib.blake2b(data, digest_size=32).hexdigest() != entry["blake2b"]:
        raise MemoryFileError(f"{path} is damaged: its blake2b checksum does not match the one saved (corrupted, "
                              "or a file from another save).")
    try:
        state = safetensors.torch.load(data)
    except Exception as error:  # safetensors raises its own error type for a malformed file
        raise MemoryFileError(f"{path} is not a valid safetensors file: {error}") from error
    got = {name: _spec(t.dtype, list(t.shape)) for name, t in state.items()}
    if got != expected:
        differing = sorted(k for k in set(got) | set(expected) if got.get(k) != expected.get(k))
        raise MemoryFileError(f"{path} holds arrays that do not match the manifest (differing: {differing}).")
    return state


def _check_consistency(state: dict[str, torch.Tensor], info: dict, config: EMConfig, max_positions: int,
                       target: Path) -> None:
    """Relations between the arrays that a well-formed memory always satisfies (cheap; catches a manifest whose
    counts were forged consistently but do not describe a real memory)."""
    starts, sizes = state["event_starts"], state["event_sizes"]
    E = starts.shape[0]
    problems = []
    if int(sizes.sum()) != info["evicted_tokens"] or (E and bool((sizes < 1).any())):
        problems.append("event sizes do not add up to the evicted tokens")
    if E and not torch.equal(starts, torch.cumsum(sizes, 0) - sizes):
        problems.append("events are not contiguous")
    if info["sink_tokens"] + info["evicted_tokens"] + info["window_tokens"] != info["total_tokens"]:
        problems.append("sinks + evicted + window tokens != tokens read")
    if info["local_start"] != info["sink_tokens"] + info["evicted_tokens"]:
        problems.append("local_start is not sinks + evicted tokens")
    if info["rotated_tokens"] > info["window_tokens"] or info["sink_tokens"] > config.n_init or (
            config.attention == "episodic" and info["window_tokens"] > config.window_capacity(max_positions)):
        problems.append("window or sink sizes exceed the layout")
    if info["kv_pages"] != math.ceil(info["evicted_tokens"] / info["kv_page_tokens"]):
        problems.append("KV page count does not match the evicted tokens")
    for name in ("contiguity", "retrieved"):
        ids = state[f"{name}_ids"]
        if int(state[f"{name}_counts"].sum()) != ids.shape[0] or (ids.numel() and
                                                                    (int(ids.min()) < 0 or int(ids.max()) >= E)):
            problems.append(f"{name} ids are out of range")
    if state["contiguity_ids"].numel() and E and not torch.equal(
            state["contiguity_sizes"], sizes[state["contiguity_ids"].clamp(0, E - 1)]):
        problems.append("contiguity sizes disagree with the events")
    if any(not (0 <= start < end <= info["total_tokens"]) for start, end in info.get("pinned_spans", [])):
        problems.append("a pinned span lies outside the tokens read")
    if (info["last_logits"] is None) != (info["total_tokens"] == 0):
        problems.append("last logits present without tokens read (or missing after reading)")
    if problems:
        raise MemoryFileError(f"The saved memory at {target} is inconsistent ({MANIFEST} vs {STATE_FILE}): "
                              f"{'; '.join(problems)}.")


def _state_dict(state: dict[str, torch.Tensor], info: dict, engine: EngineLike) -> dict[str, Any]:
    """The file's tensors and the manifest's scalars as EpisodicMemory.state_dict() gives them."""
    last_logits = None
    if "last_logits" in state:
        head = engine.model.get_output_embeddings()
        last_logits = state["last_logits"].to(head.weight.device if head is not None else engine.input_device)
    counts = state["contiguity_counts"].tolist()
    contiguity = _split(list(zip(state["contiguity_ids"].tolist(), state["contiguity_sizes"].tolist())), counts)
    retrieved = _split(state["retrieved_ids"].tolist(), state["retrieved_counts"].tolist())
    layers: list[dict[str, Any]]  # tensors and lists by name: the union of the two dicts would be dict[str, object]
    layers = [{name: state[name][i] for name in ("window_keys", "window_values", "window_rotated", "window_scores",
                                                  "sink_keys", "sink_values", "representatives")}
              | {"contiguity": contiguity[i], "retrieved_ids": retrieved[i], "retrievals": int(state["retrievals"][i])}
              for i in range(len(counts))]
    for layer in layers:  # the file's layers share one stacked tensor; each layer keeps its own sinks
        layer["sink_keys"], layer["sink_values"] = layer["sink_keys"].clone(), layer["sink_values"].clone()
    return {"token_ids": state["token_ids"].tolist(), "surprise": state["surprise"],
            "boundary_flags": state["boundary_flags"], "event_starts": state["event_starts"],
            "event_sizes": state["event_sizes"], "last_logits": last_logits, "sinks_split": bool(info["sinks_split"]),
            "local_start": int(info["local_start"]), "track_surprise": bool(info["track_surprise"]),
            "pinned_spans": [tuple(span) for span in info.get("pinned_spans", [])], "layers": layers}


def _split(flat: list[T], counts: list[int]) -> list[list[T]]:
    out: list[list[T]] = []
    start = 0
    for n in counts:
        out.append(flat[start:start + n])
        start += n
    return out


def _stream_kv(store: PageStore, target: Path, files: dict, info: dict) -> None:
    """Append the saved pages to the new store one at a time, segment by segment (it spills to disk past its RAM
    budget). Each file is hashed as it is read and compared at its end; each full page with the digest the manifest
    records (a page from another save fails at once). A mismatch fails the whole load. Where this store pages as
    the save did, the verified digests are kept, so this memory's next save links these files."""
    pages, page_tokens, total = info["kv_pages"], info["kv_page_tokens"], info["evicted_tokens"]
    recorded = info.get("kv_page_digests")
    if recorded is not None and (not isinstance(recorded, list) or len(recorded) != total // page_tokens):
        raise MemoryFileError(f"{target / MANIFEST} is inconsistent: its page digests do not match its "
                              f"{total // page_tokens} full pages.")
    page_shape = (*store.page_shape[:2], page_tokens, *store.page_shape[3:])
    page_bytes = int(np.prod(page_shape)) * torch.empty(0, dtype=store.dtype).element_size()
    digests: dict[int, str] = {}
    buffer = bytearray(page_bytes if pages else 0)
    for segment in _segments_of(info):
        path, count = target / segment["file"], segment["pages"]
        digest = hashlib.blake2b(digest_size=32)
        with open(path, "rb") as handle:
            _read_kv_header(handle, path, digest, store.dtype, [count, *page_shape], count * page_bytes)
            for index in range(count):
                page_id = segment["first_page"] + index
                if handle.readinto(buffer) != page_bytes:
                    raise MemoryFileError(f"{path} is damaged: truncated at page {index} of {count}.")
                digest.update(buffer)
                if index >= segment["used"]:
                    continue  # an earlier save's tail page, rewritten in a later segment: hashed, not loaded
                fill = min(page_tokens, total - page_id * page_tokens)
                if fill == page_tokens:
                    digests[page_id] = page_digest(buffer)
                    if recorded is not None and digests[page_id] != recorded[page_id]:
                        raise MemoryFileError(f"{path} is damaged: its blake2b checksum does not match the one "
                                              f"saved for page {page_id} (corrupted, or a page from another save).")
                page = torch.frombuffer(buffer, dtype=torch.uint8).view(store.dtype).reshape(page_shape)
                store.append(page[:, :, :fill])  # copies into the store's own page
            if handle.read(1):
                raise MemoryFileError(f"{path} is damaged: it has data past the saved pages.")
        if digest.hexdigest() != files[segment["file"]]["blake2b"]:
            raise MemoryFileError(f"{path} is damaged: its blake2b checksum does not match the one saved "
                                  "(corrupted, or a file from another save).")
    if store.page_tokens == page_tokens:
        store.digests.update(digests)


def _read_kv_header(handle: Any, path: Path, digest: Any, dtype: torch.dtype, shape: list[int], nbytes: int) -> None:
    """Read and check a KV file's safetensors header (hashing it); refuse a file too short for its pages before a
    page buffer is filled: a forged page size cannot make the loader read more than the file holds."""
    prefix = handle.read(8)
    digest.update(prefix)
    header_len = struct.unpack("<Q", prefix)[0] if len(prefix) == 8 else -1
    if not 0 < header_len <= 2**20:
        raise MemoryFileError(f"{path} is damaged: its safetensors header length ({header_len}) is impossible.")
    raw = handle.read(header_len)
    digest.update(raw)
    try:
        spec = json.loads(raw)["pages"]
    except (ValueError, KeyError, TypeError) as error:
        raise MemoryFileError(f"{path} is damaged: unreadable safetensors header ({error!r}).") from error
    if spec != {"dtype": _SAFETENSORS_CODE[dtype], "shape": shape, "data_offsets": [0, nbytes]}:
        raise MemoryFileError(f"{path} is damaged: its header describes {spec}, not the saved pages.")
    if os.fstat(handle.fileno()).st_size - 8 - header_len < nbytes:
        raise MemoryFileError(f"{path} is damaged: truncated, it holds fewer bytes than its {shape[0]} pages.")
