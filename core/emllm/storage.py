"""Evicted keys and values, in pages that move between tiers: compute device -> CPU RAM -> disk.

KV of evicted tokens is the bulk of an episodic memory (1M tokens of SmolLM2-135M in bf16 is ~23 GB), so it
lives in fixed-size pages of ``page_tokens`` tokens for all layers at once:

    page: [num_layers, 2 (key, value), page_tokens, num_kv_heads, head_dim]

Tokens are appended in order (events are contiguous spans of the input), so an event is just a token range and
a layer's retrieval is one gather of token indices. A page is written once, then sealed. Each tier holds
pages up to a byte budget; the least recently used page of a full tier moves one tier down, and a page read from a
lower memory tier moves back to the top. The disk tier is a ``.npy`` file per page (never a pickle) in
a private folder removed when the store is closed, on garbage collection and at interpreter exit; a disk page stays
there and a read takes only the bytes of the layer it needs (1/num_layers of the page).

Because sealed pages never change, a store can be forked cheaply: the fork shares every sealed page (tensors and
disk files) and copies only the page being filled. A disk folder lives while any store still refers to it.

With a CUDA top tier, pages in CPU RAM are pinned (page-locked) and disk reads land in pinned buffers, so bringing
them up is an asynchronous copy on the current stream: the kernels that read the result are queued behind it on that
stream, and PyTorch's pinned-memory allocator keeps a source buffer until its copy has finished. Copies down (device
to RAM) stay synchronous: the CPU reads or writes those bytes next.
"""

from __future__ import annotations

import contextlib
import copy
import ctypes
import errno
import functools
import math
import os
import re
import shutil
import tempfile
import warnings
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import torch

TAIL_MIN_TOKENS = 64  # the page being filled starts this large and doubles (PageStore._tail_with_room)

# numpy has no bfloat16: such pages are stored bit-for-bit as int16 and viewed back.
_NUMPY_VIEW = {torch.bfloat16: (torch.int16, np.int16), torch.float16: (torch.float16, np.float16),
               torch.float32: (torch.float32, np.float32)}


@dataclass
class _Tier:
    device: torch.device
    budget_bytes: float          # inf = unlimited
    pages: OrderedDict[int, torch.Tensor]  # LRU order: oldest first
    used_bytes: int = 0
    held_bytes: int = 0          # what the memory holds here besides pages (its event index), counted in the budget
    index_warned: bool = False   # the index alone outgrew the budget and the user was told


@dataclass
class _Disk:
    budget_bytes: float                    # inf = unlimited
    pages: OrderedDict[int, torch.Tensor]  # the pages written to disk, each an empty tensor as a marker


class _Folder:
    """A private temporary folder, removed when no store refers to it any more and at interpreter exit. Its name
    carries the owning process's id and start time, so folders a crashed process left behind are removed by the
    next one, even where the id has since been given to another process."""

    def __init__(self, root: str | None):
        if root is not None:
            os.makedirs(root, exist_ok=True)
        root = root if root is not None else tempfile.gettempdir()
        remove_orphan_folders(root)
        self.path = tempfile.mkdtemp(prefix=f"{_FOLDER_PREFIX}{owner_mark(os.getpid())}-", dir=root)
        weakref.finalize(self, shutil.rmtree, self.path, True)


_FOLDER_PREFIX = "emllm-kv-"


def owner_mark(pid: int) -> str:
    """"PID.START" (START: when the process began, in clock ticks since boot) where /proc says, else "PID"."""
    start = process_start(pid)
    return f"{pid}.{start}" if start is not None else str(pid)


def remove_orphan_folders(root: str) -> list[str]:
    """Remove the page folders in ``root`` whose owning process is gone (a crash or a kill skips the clean-up at
    exit); folders of live processes, and ones without an owner in their name, are left alone."""
    removed = []
    with contextlib.suppress(OSError):
        for entry in os.scandir(root):
            owner = re.fullmatch(r"(\d+)(?:\.(\d+))?", entry.name[len(_FOLDER_PREFIX):].split("-", 1)[0])
            if entry.name.startswith(_FOLDER_PREFIX) and owner and entry.is_dir(follow_symlinks=False) \
                    and not process_alive(int(owner[1]), owner[2]):
                shutil.rmtree(entry.path, ignore_errors=True)
                removed.append(entry.path)
    return removed


def process_alive(pid: int, start: str | None = None) -> bool:
    """Whether a process with this id exists (one we may not signal counts as alive), and, given the start time
    it had, is still that process and not a later one that reused the id."""
    if pid == os.getpid():
        return start is None or start == process_start(pid)
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    now = process_start(pid) if start is not None else None
    return now is None or now == start


def process_start(pid: int) -> str | None:
    """The process's start time from /proc/PID/stat (field 22; the command name before it may hold spaces), or
    None where there is no /proc (macOS) or no such process."""
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8", errors="replace") as handle:
            return handle.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


class StorageFullError(OSError):
    """A page could not be written to disk (no space left); the message says where and how much."""


class PageStore:
    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, *,
                 page_tokens: int = 1024, device: torch.device | str = "cpu",
                 device_budget_mb: float | None = None, ram_budget_mb: float | None = None,
                 offload_dir: str | None = None, disk_budget_mb: float | None = None) -> None:
        if dtype not in _NUMPY_VIEW:
            raise TypeError(f"KV dtype {dtype} is not supported for storage; use float32, bfloat16 or float16.")
        self.page_shape = (num_layers, 2, page_tokens, num_kv_heads, head_dim)
        self.page_tokens = page_tokens
        self.dtype = dtype
        self.page_bytes = int(np.prod(self.page_shape)) * torch.tensor([], dtype=dtype).element_size()
        budget = lambda mb: float("inf") if mb is None else mb * 2**20  # noqa: E731
        device = torch.device(device)
        self.tiers: list[_Tier] = []
        self.pin = device.type == "cuda"  # pinning needs CUDA, and only a CUDA device copies from it asynchronously
        if device.type != "cpu":
            self.tiers.append(_Tier(device, budget(device_budget_mb), OrderedDict()))
        self.tiers.append(_Tier(torch.device("cpu"), budget(ram_budget_mb), OrderedDict()))
        self.disk = _Disk(budget(disk_budget_mb), OrderedDict())
        self._offload_root = offload_dir
        self._folder: _Folder | None = None          # where this store writes pages
        # page id -> (folder kept alive, path, byte offset of the array's data after the .npy header)
        self._disk_files: dict[int, tuple[_Folder, str, int]] = {}
        self.num_tokens = 0
        self._tail: torch.Tensor | None = None  # the page being filled: outside the tiers until sealed
        # Sealed pages' content digests, kept by whoever computes them (a save writing a page, a load reading one):
        # a sealed page never changes, so a later save can tell which pages an earlier save already holds.
        self.digests: dict[int, str] = {}
        self.closed = False

    # ------------------------------------------------------------------ writing
    def append(self, kv: torch.Tensor) -> None:
        """kv: [num_layers, 2, n, num_kv_heads, head_dim], the next n evicted tokens in input order."""
        self._check_open()
        n = kv.shape[2]
        done = 0
        while done < n:
            page_id, offset = divmod(self.num_tokens, self.page_tokens)
            take = min(n - done, self.page_tokens - offset)
            tail = self._tail_with_room(offset, offset + take)
            tail[:, :, offset:offset + take].copy_(kv[:, :, done:done + take])
            done += take
            self.num_tokens += take
            if offset + take == self.page_tokens:  # sealed: from now on it lives in the tiers
                self._put(0, page_id, tail)
                self._tail = None

    def _tail_with_room(self, filled: int, rows: int) -> torch.Tensor:
        """The page being filled, with room for ``rows`` rows (its first ``filled`` kept). It grows by doubling up
        to a whole page instead of being allocated whole: a conversation's checkpoints each hold a copy of it (a
        fork copies the page being filled), and whole pages made a server session of three checkpoints of
        SmolLM2 hold 141 MB of tails for ~400 evicted tokens. The last growth makes it exactly a page."""
        tail = self._tail if filled else None
        capacity = 0 if tail is None else tail.shape[2]
        if capacity >= rows:
            assert tail is not None
            return tail
        grown = torch.empty((*self.page_shape[:2], min(self.page_tokens, max(rows, 2 * capacity, TAIL_MIN_TOKENS)),
                             *self.page_shape[3:]), dtype=self.dtype, device=self.tiers[0].device)
        if filled:
            assert tail is not None  # a part-filled page is always the tail
            grown[:, :, :filled].copy_(tail[:, :, :filled])
        self._tail = grown
        return grown

    # ------------------------------------------------------------------ reading
    def gather(self, layer: int, token_index: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of the given evicted tokens for one layer: two [num_kv_heads, n, head_dim] tensors.

        token_index is sorted (events are placed in input order); the result keeps that order. A page in memory is
        promoted to the top tier (LRU); a page on disk stays there and only the asked tokens' bytes of this layer
        are read from its file: a page holds every layer and each layer retrieves its own events, so bringing whole
        pages up would read num_layers times the bytes and push recent pages out of RAM at every layer's gather.
        The operating system's file cache keeps the disk pages that are read often.
        """
        self._check_open()
        token_index = token_index.to("cpu")
        page_of = token_index // self.page_tokens
        pages, counts = torch.unique_consecutive(page_of, return_counts=True)
        within = token_index - page_of * self.page_tokens  # each token's row in its page
        # The rows go to a page's device once per gather, not once per page: a copy the CPU waits for would stall
        # on all the work queued before it (non_blocking from pageable memory is staged at once, so it is safe).
        within_on: dict[torch.device, torch.Tensor] = {torch.device("cpu"): within}
        parts: list[torch.Tensor] = []
        start = 0
        for page_id, count in zip(pages.tolist(), counts.tolist()):
            page = self._in_memory(page_id)
            if page is None:
                kv = self._read_disk_rows(page_id, layer, within[start:start + count])          # [2, count, kv, d]
            else:
                if page.device not in within_on:
                    within_on[page.device] = within.to(page.device, non_blocking=True)
                kv = page[layer].index_select(1, within_on[page.device][start:start + count])
            start += count
            parts.append(kv.to(device, non_blocking=True))
        kv = torch.cat(parts, dim=1) if len(parts) != 1 else parts[0]  # [2, n, kv_heads, head_dim]
        kv = kv.transpose(1, 2)  # [2, kv_heads, n, head_dim]
        return kv[0], kv[1]

    def layer_keys(self, layer: int, device: torch.device, start: int = 0) -> torch.Tensor:
        """The stored keys of one layer from token ``start`` on, in input order: [num_kv_heads, num_tokens - start,
        head_dim]. Whole pages are sliced, not indexed, and values are left where they are: attention-scored
        retrieval reads all keys, or (keeping a copy) only those stored since it last looked."""
        self._check_open()
        if not 0 <= start <= self.num_tokens:
            raise ValueError(f"start must be in [0, {self.num_tokens}] (tokens stored), got {start}.")
        pages = -(-self.num_tokens // self.page_tokens)
        first = start // self.page_tokens
        parts = [self._layer_keys_of_page(page_id, layer)[max(0, start - page_id * self.page_tokens):
                                                           self._page_fill(page_id)].to(device, non_blocking=True)
                 for page_id in range(first, pages)]                                      # each [fill, kv, d]
        if not parts:
            _, _, _, kv, d = self.page_shape
            return torch.empty(kv, 0, d, dtype=self.dtype, device=device)
        keys = torch.cat(parts) if len(parts) != 1 else parts[0]                       # [num_tokens - start, kv, d]
        return keys.transpose(0, 1)

    def read_page(self, page_id: int) -> torch.Tensor:
        """A whole page from whichever tier holds it, moving nothing (saving must not reshuffle or write the
        store)."""
        page = self._in_memory(page_id, promote=False)
        return self._read_disk(page_id) if page is None else page

    def _layer_keys_of_page(self, page_id: int, layer: int) -> torch.Tensor:
        """[page_tokens, kv_heads, head_dim]: from memory (promoted, as in gather) or from the page's file."""
        page = self._in_memory(page_id)
        return self._read_disk(page_id, (layer, 0), pinned=self.pin) if page is None else page[layer, 0]

    def _in_memory(self, page_id: int, promote: bool = True) -> torch.Tensor | None:
        """The page if it is being filled or a memory tier holds it, else None (it is on disk). With ``promote``
        a page found in a lower memory tier moves to the top one (least recently used pages move down)."""
        if self._tail is not None and page_id == self.num_tokens // self.page_tokens:
            return self._tail
        for level, tier in enumerate(self.tiers):
            if page_id in tier.pages:
                if not promote:
                    return tier.pages[page_id]
                if level == 0:
                    tier.pages.move_to_end(page_id)
                    return tier.pages[page_id]
                page = self._pop(level, page_id).to(self.tiers[0].device, non_blocking=True)  # pinned: async
                self._put(0, page_id, page, strict=False)
                return page
        return None

    # ------------------------------------------------------------------ tiers
    def _put(self, level: int, page_id: int, page: torch.Tensor, strict: bool = True) -> None:
        """Add a page to a tier, demoting least recently used pages past its budget.

        strict=False (reads): if the disk is full, stay over budget rather than fail a read; the next write
        reports the full disk.
        """
        tier = self.tiers[level]
        tier.pages[page_id] = page
        tier.used_bytes += self.page_bytes
        self._fit(level, strict)

    def _fit(self, level: int, strict: bool = True) -> None:
        """Demote the tier's least recently used pages until its pages and held bytes fit its budget."""
        tier = self.tiers[level]
        while tier.pages and tier.used_bytes + tier.held_bytes > tier.budget_bytes:
            try:
                self._demote(level, next(iter(tier.pages)), strict)
            except StorageFullError:
                if strict:
                    raise
                return

    def hold(self, held: dict[torch.device, int]) -> None:
        """Count the bytes the memory holds on each device besides its pages (the event index: representatives
        and event-text embeddings) against that tier's budget, demoting pages to make room: a RAM budget bounds
        everything a memory keeps in RAM, not only its KV. At a million tokens of SmolLM2 the representatives alone
        are ~1.7 GB. Where the index outgrows a budget, every page goes down and a warning names the fix."""
        for level, tier in enumerate(self.tiers):
            tier.held_bytes = _bytes_on(held, tier.device)
            if tier.held_bytes > tier.budget_bytes and not tier.index_warned:
                tier.index_warned = True
                name = "ram_budget_mb" if tier.device.type == "cpu" else "device_budget_mb"
                warnings.warn(
                    f"This memory's event index holds {tier.held_bytes / 2**20:.0f} MB on {tier.device}, more than "
                    f"{name}={tier.budget_bytes / 2**20:g}: every KV page now goes to the tier below, and the index "
                    f"alone exceeds the budget. Raise {name}.", ResourceWarning, stacklevel=3)
            self._fit(level)

    def _pop(self, level: int, page_id: int) -> torch.Tensor:
        tier = self.tiers[level]
        tier.used_bytes -= self.page_bytes
        return tier.pages.pop(page_id)

    def _demote(self, level: int, page_id: int, strict: bool = True) -> None:
        """Move a page one tier down. The page leaves its tier only after the lower copy exists, so a failed
        disk write leaves it readable where it was."""
        page = self.tiers[level].pages[page_id]
        if level + 1 < len(self.tiers):
            self._pop(level, page_id)
            self._put(level + 1, page_id, self._moved_down(page, self.tiers[level + 1].device), strict)
        else:
            self._write_disk(page_id, page)
            self._pop(level, page_id)
            del page
            release_freed_memory()

    def _moved_down(self, page: torch.Tensor, device: torch.device) -> torch.Tensor:
        """The page on a lower tier's device; into pinned RAM under a CUDA top tier, so that bringing it back up
        is asynchronous. A synchronous copy: the page is complete when this returns."""
        if not (self.pin and device.type == "cpu" and page.device.type != "cpu"):
            return page.to(device)
        return torch.empty(page.shape, dtype=page.dtype, pin_memory=True).copy_(page)

    # ------------------------------------------------------------------ disk
    def _own_folder(self) -> _Folder:
        if self._folder is None:
            self._folder = _Folder(self._offload_root or None)
        return self._folder

    def _write_disk(self, page_id: int, page: torch.Tensor) -> None:
        """Write a sealed page as .npy with ordinary file I/O, so a full disk is an OSError (a memory map of a
        sparse file would instead kill the process with SIGBUS when the disk fills)."""
        if page_id in self.disk.pages:  # pages are immutable once sealed: the disk copy is still valid
            return
        self.check_disk_budget(len(self.disk.pages) + 1)
        folder = self._own_folder()
        path = os.path.join(folder.path, f"page-{page_id:08d}.npy")
        torch_view, _ = _NUMPY_VIEW[self.dtype]
        tmp = path + ".tmp"
        try:
            array = np.ascontiguousarray(page.detach().to("cpu").view(torch_view).numpy())
            with open(tmp, "wb") as handle:
                np.lib.format.write_array_header_1_0(handle, np.lib.format.header_data_from_array_1_0(array))
                data_offset = handle.tell()
                handle.write(array.data.cast("B"))  # plain write(): keeps errno (numpy's tofile does not)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(tmp, path)
        except OSError as error:
            if os.path.exists(tmp):
                os.remove(tmp)
            free = shutil.disk_usage(os.path.dirname(path)).free
            raise StorageFullError(
                error.errno, f"Could not write a {self.page_bytes / 2**20:.2f} MB KV page to {path} "
                f"({error.strerror}; {free / 2**20:.1f} MB free there). Free disk space, point offload_dir at a "
                "larger disk, or raise ram_budget_mb.") from error
        self.disk.pages[page_id] = torch.empty(0)  # a marker; the data is on disk
        self._disk_files[page_id] = (folder, path, data_offset)

    def check_disk_budget(self, disk_pages: int) -> None:
        """Refuse, before anything is written, a state with ``disk_pages`` pages on disk over disk_budget_mb."""
        if disk_pages * self.page_bytes > self.disk.budget_bytes:
            raise StorageFullError(
                errno.EDQUOT, f"{disk_pages} KV pages of {self.page_bytes / 2**20:.3f} MB on disk would exceed "
                f"disk_budget_mb={self.disk.budget_bytes / 2**20:g} for this memory. Raise disk_budget_mb or "
                "ram_budget_mb, or read less.")

    def pages_beyond_memory(self, sealed_pages: int, held: dict[torch.device, int] | None = None) -> int:
        """How many of ``sealed_pages`` at least cannot fit in the device and RAM budgets, so must be on disk, while
        the event index holds ``held`` bytes on each device (default: what it holds now). A lower bound, so nothing
        is refused that could fit."""
        room = 0.0
        for tier in self.tiers:
            index = tier.held_bytes if held is None else _bytes_on(held, tier.device)
            room += max(0.0, tier.budget_bytes - index)
        fit = room / self.page_bytes
        return 0 if fit == float("inf") else max(0, sealed_pages - int(fit))

    @property
    def spills_to_disk(self) -> bool:
        """Whether pages can reach the disk (RAM has a budget): only then can storing what is read fail."""
        return math.isfinite(self.tiers[-1].budget_bytes)

    def _read_disk(self, page_id: int, index: tuple[int, ...] = (), pinned: bool = False) -> torch.Tensor:
        """page[index] from the page's file: a leading index of a C-ordered page is one contiguous byte range.
        ``pinned``: read into page-locked memory (it is about to be copied to a CUDA device)."""
        shape = self.page_shape[len(index):]
        first = 0
        for i, size in zip(index, self.page_shape):  # the range's start, in units of the indexed block
            first = first * size + i
        out = torch.empty(shape, dtype=self.dtype, pin_memory=pinned)
        raw = _bytes_of(out)
        with self._page_file(page_id) as (fd, data_offset):
            _pread_into(fd, raw, data_offset + first * raw.nbytes)
        return out

    def _read_disk_rows(self, page_id: int, layer: int, rows: torch.Tensor) -> torch.Tensor:
        """page[layer][:, rows] from the page's file, [2, len(rows), kv_heads, head_dim]: one read per run of
        consecutive rows (a retrieved event is one run), keys and values apart, so only the retrieved tokens'
        bytes are read, not the page's other layers and tokens. Into pinned memory under a CUDA top tier (gather
        copies the rows up asynchronously)."""
        _, _, tokens, kv_heads, head_dim = self.page_shape
        n = len(rows)
        out = torch.empty(2, n, kv_heads, head_dim, dtype=self.dtype, pin_memory=self.pin)
        raw, row_bytes = _bytes_of(out), kv_heads * head_dim * out.element_size()
        begins = [0, *(torch.nonzero(rows[1:] - rows[:-1] != 1).flatten() + 1).tolist()]
        runs = list(zip(begins, [*begins[1:], n], rows[begins].tolist()))  # (first, end) in out, first row in page
        with self._page_file(page_id) as (fd, data_offset):
            for kind in range(2):
                block = data_offset + (layer * 2 + kind) * tokens * row_bytes
                for begin, end, row in runs:
                    _pread_into(fd, raw[(kind * n + begin) * row_bytes:(kind * n + end) * row_bytes],
                                block + row * row_bytes)
        return out

    @contextlib.contextmanager
    def _page_file(self, page_id: int) -> Iterator[tuple[int, int]]:
        """(an open file descriptor of the page's file, where the array's data starts in it). Reads go straight into
        tensors with pread: nothing is mapped or cached by us; the operating system's file cache keeps the pages
        read often."""
        _, path, data_offset = self._disk_files[page_id]
        fd = os.open(path, os.O_RDONLY)
        try:
            yield fd, data_offset
        finally:
            os.close(fd)

    # ------------------------------------------------------------------ housekeeping
    def tier_tokens(self) -> dict[str, int]:
        """Evicted tokens per tier (a page counts in the highest tier that holds it)."""
        counts: dict[str, int] = {"ram": 0}
        if self._tail is not None:
            counts["ram" if self.tiers[0].device.type == "cpu" else "device"] = self.num_tokens % self.page_tokens
        seen: set[int] = set()
        for tier in self.tiers:
            name = "device" if tier.device is not None and tier.device.type != "cpu" else "ram"
            ids = set(tier.pages) - seen
            counts[name] = counts.get(name, 0) + sum(self._page_fill(i) for i in ids)
            seen |= ids
        counts["disk"] = sum(self._page_fill(i) for i in set(self.disk.pages) - seen)
        return counts

    def _page_fill(self, page_id: int) -> int:
        return min(self.page_tokens, self.num_tokens - page_id * self.page_tokens)

    def resident_bytes(self) -> dict[str, int]:
        return {("device" if t.device is not None and t.device.type != "cpu" else "ram"): t.used_bytes
                for t in self.tiers}

    @property
    def disk_dir(self) -> str | None:
        """The folder this store writes its pages to (None until the first page goes to disk)."""
        return None if self._folder is None else self._folder.path

    def held_tensors(self) -> list[torch.Tensor]:
        """The pages this store holds in memory (RAM or a device), the page being filled included; not the disk's."""
        pages = [page for tier in self.tiers for page in tier.pages.values()]
        return pages if self._tail is None else [*pages, self._tail]

    def fork(self) -> PageStore:
        """An independent store with the same content. Sealed pages are shared (they never change); only the
        page being filled is copied. Budgets count shared pages in every store that holds them."""
        self._check_open()
        child = copy.copy(self)
        child.tiers = [_Tier(t.device, t.budget_bytes, OrderedDict(t.pages), t.used_bytes, t.held_bytes)
                       for t in self.tiers]
        child.disk = _Disk(self.disk.budget_bytes, OrderedDict(self.disk.pages))
        child._disk_files = dict(self._disk_files)
        child._folder = None  # the child writes its own files; it keeps the parent's folder alive via _disk_files
        child._tail = None if self._tail is None else self._tail[:, :, :self.num_tokens % self.page_tokens].clone()
        child.digests = dict(self.digests)
        return child

    def close(self) -> None:
        """Drop every page and remove the disk folder."""
        for tier in self.tiers:
            tier.pages.clear()
            tier.used_bytes = 0
        self.disk.pages.clear()
        self._disk_files.clear()
        self._tail = None
        self.digests.clear()
        # Dropping the last reference removes the folder now (its finalizer runs); a fork that still reads
        # pages from it keeps it alive until that fork is closed too.
        self._folder = None
        self.closed = True

    def _check_open(self) -> None:
        if self.closed:
            raise RuntimeError("This episodic memory was closed; start a new one.")


def _bytes_on(held: dict[torch.device, int], device: torch.device) -> int:
    """The bytes of ``held`` (by device) that lie on ``device``."""
    return sum(n for where, n in held.items() if _same_device(where, device))


def _same_device(a: torch.device, b: torch.device) -> bool:
    """The same device, where one of the two may name no index ("cuda" and "cuda:0")."""
    return a.type == b.type and (a.index is None or b.index is None or a.index == b.index)


@functools.cache
def malloc_trim() -> Callable[[int], int] | None:
    """glibc's malloc_trim, or None where the C library is not glibc. Public so that a caller can tell whether
    release_freed_memory does anything on this platform."""
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc (macOS, musl): its allocator gives memory back its own way
        return None


def release_freed_memory() -> None:
    """Give the C heap's free pages back to the system once a page has gone to disk. A page is tens of MB; glibc
    serves blocks that size from its main heap once its mmap threshold has risen (it does after the first such
    block is freed), and a hole inside the heap is not returned by free(): at 220K tokens of a 1M-token read with a
    2 GB RAM budget, 0.5 GB of a 3.7 GB heap was free but resident (malloc_stats)."""
    trim = malloc_trim()
    if trim is not None:
        trim(0)


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    """A contiguous tensor's memory as writable bytes."""
    return tensor.view(torch.uint8).numpy().data.cast("B")


def _pread_into(fd: int, buffer: memoryview, offset: int) -> None:
    """Fill buffer with the file's bytes from offset on. A regular file gives them in one read; a short read is
    continued, and an early end of file (a page file truncated since it was written whole) is an error."""
    done = 0
    while done < buffer.nbytes:
        got = os.preadv(fd, [buffer[done:]], offset + done)
        if got == 0:
            raise OSError(errno.EIO, f"A KV page file ended {buffer.nbytes - done} bytes early: it was written whole, "
                          "so it was truncated since.")
        done += got
