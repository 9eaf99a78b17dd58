"""Unit tests for emllm.storage.PageStore: gathers equal a reference tensor whatever tier a page is in,
LRU between RAM and disk, disk folder lifetime, and disk errors.

Shapes are tiny: 2 layers, 2 KV heads, head_dim 4, 8 tokens per page (1 KiB per float32 page).
"""

import gc
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from emllm import storage
from emllm.storage import PageStore, StorageFullError, owner_mark, process_start
from tests.tmpfs import mounted_tmpfs

LAYERS, KV, D, PAGE = 2, 2, 4, 8
STORAGE_PY = str(Path(storage.__file__).resolve())


def make_store(dtype=torch.float32, pages_in_ram=None, offload_dir=None, page_tokens=PAGE):
    probe = PageStore(LAYERS, KV, D, dtype, page_tokens=page_tokens)
    budget = None if pages_in_ram is None else pages_in_ram * probe.page_bytes / 2**20
    probe.close()
    return PageStore(LAYERS, KV, D, dtype, page_tokens=page_tokens, ram_budget_mb=budget,
                     offload_dir=offload_dir)


def fill(store, pieces, seed=0):
    """Append random KV in pieces of the given sizes; returns the concatenation (the reference)."""
    generator = torch.Generator().manual_seed(seed)
    parts = []
    for n in pieces:
        kv = torch.randn(LAYERS, 2, n, KV, D, generator=generator).to(store.dtype)
        store.append(kv)
        parts.append(kv)
    return torch.cat(parts, dim=2)


def expected(reference, layer, index):
    rows = reference[layer, :, index]           # [2, n, kv, d]
    return rows[0].transpose(0, 1), rows[1].transpose(0, 1)


def check_gather(store, reference, index):
    index = torch.as_tensor(index, dtype=torch.long)
    for layer in range(LAYERS):
        keys, values = store.gather(layer, index, torch.device("cpu"))
        want_k, want_v = expected(reference, layer, index)
        assert keys.dtype == store.dtype and keys.shape == (KV, len(index), D)
        assert torch.equal(keys, want_k)
        assert torch.equal(values, want_v)


def page_ids(tier):
    return list(tier.pages)


# ----------------------------------------------------------------------------- round trips
PIECES = [3, 8, 1, 13, 0, 5, 2, 9]  # 41 tokens: 5 sealed pages and a tail of 1, pieces straddle pages


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("pages_in_ram", [None, 0, 2.5])
def test_gather_equals_reference_in_every_tier(dtype, pages_in_ram, tmp_path):
    store = make_store(dtype, pages_in_ram, offload_dir=str(tmp_path))
    reference = fill(store, PIECES)
    total = sum(PIECES)
    assert store.num_tokens == total
    generator = torch.Generator().manual_seed(1)
    cases = [
        torch.arange(total),                                 # everything, tail included
        torch.tensor([0]), torch.tensor([total - 1]),        # first and last (tail) token
        torch.tensor([7, 8]),                                # a page border
        torch.tensor([1, 2, 3, 17, 18, 30, 39, 40]),
    ] + [torch.sort(torch.randperm(total, generator=generator)[:k]).values for k in (1, 5, 12, 30)]
    for index in cases:
        check_gather(store, reference, index)
        tiers = store.tier_tokens()
        assert sum(tiers.values()) == store.num_tokens
    store.close()


@pytest.mark.parametrize("pieces", [PIECES, [16], [5]])  # a tail; whole pages only; a tail only
@pytest.mark.parametrize("pages_in_ram", [None, 0])
def test_layer_keys_are_every_stored_key_in_order(pieces, pages_in_ram, tmp_path):
    store = make_store(torch.bfloat16, pages_in_ram, offload_dir=str(tmp_path))
    reference = fill(store, pieces)
    for layer in range(LAYERS):
        want, _ = expected(reference, layer, torch.arange(sum(pieces)))
        assert torch.equal(store.layer_keys(layer, torch.device("cpu")), want)
        for start in sorted({0, 1, PAGE - 1, PAGE, PAGE + 3, sum(pieces) - 1, sum(pieces)}):
            if 0 <= start <= sum(pieces):  # mid-page, page borders, the last token, nothing left
                assert torch.equal(store.layer_keys(layer, torch.device("cpu"), start=start), want[:, start:])
    with pytest.raises(ValueError, match="start must be in"):
        store.layer_keys(0, torch.device("cpu"), start=sum(pieces) + 1)
    store.close()


def test_gather_returns_a_copy():
    store = make_store()
    reference = fill(store, [PAGE * 2])
    keys, _ = store.gather(0, torch.arange(4), torch.device("cpu"))
    keys.zero_()  # a caller writing into its result must not corrupt the store
    check_gather(store, reference, torch.arange(2 * PAGE))


def test_unsupported_dtype_is_refused():
    with pytest.raises(TypeError, match="float32"):
        PageStore(LAYERS, KV, D, torch.int32)


# ----------------------------------------------------------------------------- disk tier
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_zero_ram_budget_puts_every_sealed_page_on_disk(dtype, tmp_path):
    store = make_store(dtype, pages_in_ram=0, offload_dir=str(tmp_path))
    reference = fill(store, [5, 12, 7, 3])  # 27 tokens: 3 sealed pages + a tail of 3
    disk_dir = Path(store.disk_dir)
    assert disk_dir.parent == tmp_path  # a private folder inside offload_dir
    files = sorted(p.name for p in disk_dir.iterdir())
    assert files == ["page-00000000.npy", "page-00000001.npy", "page-00000002.npy"]
    assert store.resident_bytes()["ram"] == 0
    assert store.tier_tokens() == {"ram": 3, "disk": 24}
    # the files are plain .npy arrays holding the page bit for bit (bf16 as int16)
    page1 = np.load(disk_dir / "page-00000001.npy")
    assert page1.shape == (LAYERS, 2, PAGE, KV, D)
    restored = torch.from_numpy(page1).view(dtype)
    assert torch.equal(restored, reference[:, :, PAGE:2 * PAGE])
    check_gather(store, reference, torch.arange(27))
    check_gather(store, reference, torch.tensor([2, 9, 23, 26]))
    assert store.resident_bytes()["ram"] == 0  # reading did not keep anything over budget
    store.close()
    assert not disk_dir.exists()
    assert tmp_path.exists()  # only the private folder is removed


def test_no_disk_folder_without_offloading(tmp_path):
    store = make_store(offload_dir=str(tmp_path))
    fill(store, [40])
    assert store.disk_dir is None
    assert list(tmp_path.iterdir()) == []
    store.close()


def test_lru_keeps_recent_pages_in_ram(tmp_path):
    store = make_store(pages_in_ram=2.5, offload_dir=str(tmp_path))
    reference = fill(store, [5 * PAGE + 3])  # pages 0..4 sealed, tail of 3
    ram = store.tiers[-1]
    page_bytes = store.page_bytes
    assert store.resident_bytes()["ram"] == 2 * page_bytes
    assert page_ids(ram) == [3, 4]
    assert store.tier_tokens() == {"ram": 2 * PAGE + 3, "disk": 3 * PAGE}

    check_gather(store, reference, torch.tensor([3 * PAGE + 1]))  # page 3 touched: page 4 is least recent
    assert page_ids(ram) == [4, 3]
    reference = torch.cat([reference, fill(store, [PAGE], seed=1)], dim=2)  # page 5 sealed: page 4 goes to disk
    assert page_ids(ram) == [3, 5]
    assert store.tier_tokens() == {"ram": 2 * PAGE + 3, "disk": 4 * PAGE}
    check_gather(store, reference, torch.arange(6 * PAGE + 3))
    assert store.resident_bytes()["ram"] == 2 * page_bytes
    store.close()


def test_the_event_index_held_in_ram_counts_against_the_ram_budget(tmp_path):
    """A RAM budget bounds what the memory keeps in RAM: bytes held by its event index push the least recently
    used pages to disk, and an index larger than the whole budget says so and leaves no page in RAM."""
    store = make_store(pages_in_ram=3.5, offload_dir=str(tmp_path))
    reference = fill(store, [5 * PAGE])
    ram, cpu = store.tiers[-1], torch.device("cpu")
    assert page_ids(ram) == [2, 3, 4]
    assert store.pages_beyond_memory(10) == 7
    store.hold({cpu: store.page_bytes, torch.device("meta"): 10 * store.page_bytes})  # another device: not RAM
    assert page_ids(ram) == [3, 4] and ram.held_bytes == store.page_bytes
    assert store.pages_beyond_memory(10) == 8  # the disk budget's check counts the index too
    reference = torch.cat([reference, fill(store, [PAGE], seed=1)], dim=2)  # a new page still leaves room for it
    assert page_ids(ram) == [4, 5]
    with pytest.warns(ResourceWarning, match="ram_budget_mb"):
        store.hold({cpu: 4 * store.page_bytes})
    assert page_ids(ram) == [] and store.tier_tokens() == {"ram": 0, "disk": 6 * PAGE}
    check_gather(store, reference, torch.arange(6 * PAGE))  # every page still reads back exactly
    store.hold({cpu: 0})
    reference = torch.cat([reference, fill(store, [PAGE], seed=2)], dim=2)
    assert page_ids(ram) == [6]
    check_gather(store, reference, torch.arange(7 * PAGE))
    store.close()


def test_reading_a_disk_page_leaves_it_on_disk(tmp_path):
    """A gather reads one layer's part of a disk page and moves nothing: bringing the page (every layer) up to
    RAM would read num_layers times the bytes and push a recent page out."""
    store = make_store(pages_in_ram=2.5, offload_dir=str(tmp_path))
    reference = fill(store, [5 * PAGE + 3])
    ram = store.tiers[-1]
    check_gather(store, reference, torch.tensor([1, 2 * PAGE + 4]))  # pages 0 and 2, both on disk
    for layer in range(LAYERS):
        assert torch.equal(store.layer_keys(layer, torch.device("cpu")), reference[layer, 0].transpose(0, 1))
    assert page_ids(ram) == [3, 4]
    assert store.tier_tokens() == {"ram": 2 * PAGE + 3, "disk": 3 * PAGE}
    store.close()


def test_a_truncated_page_file_is_an_error_not_garbage(tmp_path):
    store = make_store(pages_in_ram=0, offload_dir=str(tmp_path))
    reference = fill(store, [2 * PAGE])
    path = Path(store.disk_dir) / "page-00000001.npy"
    path.write_bytes(path.read_bytes()[:-16])  # the last token's values of the last layer are gone
    check_gather(store, reference, torch.arange(PAGE))  # page 0 is whole
    with pytest.raises(OSError, match="ended 16 bytes early"):
        store.gather(LAYERS - 1, torch.tensor([2 * PAGE - 1]), torch.device("cpu"))
    store.close()


def test_sealed_pages_are_written_to_disk_once(tmp_path):
    store = make_store(pages_in_ram=1.5, offload_dir=str(tmp_path))
    reference = fill(store, [3 * PAGE])
    path = Path(store.disk_dir) / "page-00000000.npy"
    inode = path.stat().st_ino
    for _ in range(3):  # reading page 0 (disk) and page 2 (RAM) again and again writes nothing
        check_gather(store, reference, torch.tensor([0]))
        check_gather(store, reference, torch.tensor([2 * PAGE]))
    assert path.stat().st_ino == inode
    assert not [p for p in Path(store.disk_dir).iterdir() if p.suffix == ".tmp"]
    store.close()


def test_closed_store_refuses_use(tmp_path):
    store = make_store(pages_in_ram=0, offload_dir=str(tmp_path))
    fill(store, [2 * PAGE])
    store.close()
    with pytest.raises(RuntimeError, match="closed"):
        store.gather(0, torch.tensor([0]), torch.device("cpu"))
    with pytest.raises(RuntimeError, match="closed"):
        store.append(torch.zeros(LAYERS, 2, 1, KV, D))
    store.close()  # closing twice is harmless


def test_dropping_the_store_removes_its_folder(tmp_path):
    store = make_store(pages_in_ram=0, offload_dir=str(tmp_path))
    fill(store, [2 * PAGE])
    disk_dir = Path(store.disk_dir)
    assert disk_dir.exists()
    del store
    gc.collect()
    assert not disk_dir.exists()


def test_offload_dir_inside_a_file_is_an_error(tmp_path):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("x")
    store = make_store(pages_in_ram=0, offload_dir=str(blocker / "sub"))
    with pytest.raises(OSError) as info:
        fill(store, [PAGE])
    assert "not-a-dir" in str(info.value)
    store.close()


# ----------------------------------------------------------------------------- disk errors (subprocesses)
def run_isolated(body: str, *args: str) -> subprocess.CompletedProcess:
    """Run a script in a fresh interpreter with storage.py loaded on its own (fast: no transformers).

    Needed because a failed write can kill the process (SIGBUS) or needs process-wide limits."""
    prelude = textwrap.dedent(f"""
        import importlib.util, json, os, sys
        import torch
        spec = importlib.util.spec_from_file_location("emllm_storage_under_test", {STORAGE_PY!r})
        storage = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = storage
        spec.loader.exec_module(storage)
        torch.set_num_threads(1)
    """)
    return subprocess.run([sys.executable, "-c", prelude + textwrap.dedent(HELPERS) + textwrap.dedent(body), *args],
                          capture_output=True, text=True, timeout=120)


HELPERS = """
    def gathered_ok(store, reference, index):
        index = torch.as_tensor(index)
        keys, values = store.gather(1, index, torch.device("cpu"))
        rows = reference[1, :, index]
        return torch.equal(keys, rows[0].transpose(0, 1)) and torch.equal(values, rows[1].transpose(0, 1))

    def try_append(store, kv, reference):
        try:
            store.append(kv)
        except storage.StorageFullError as error:
            return error
        reference.append(kv)
        return None
"""


def test_write_error_raises_storage_full_error_and_keeps_earlier_pages(tmp_path):
    """A real OSError from the file system (EFBIG through RLIMIT_FSIZE: portable, no root needed)."""
    result = run_isolated("""
        import resource, signal
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)   # get EFBIG instead of being killed
        store = storage.PageStore(2, 2, 4, torch.bfloat16, page_tokens=8, ram_budget_mb=0,
                                  offload_dir=sys.argv[1])
        reference = []
        g = torch.Generator().manual_seed(0)
        for _ in range(2):
            assert try_append(store, torch.randn(2, 2, 8, 2, 4, generator=g).bfloat16(), reference) is None
        resource.setrlimit(resource.RLIMIT_FSIZE, (300, resource.RLIM_INFINITY))  # a bf16 page file is 640 bytes
        error = try_append(store, torch.randn(2, 2, 8, 2, 4, generator=g).bfloat16(), reference)
        resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
        reference = torch.cat(reference, dim=2)
        files = sorted(os.listdir(store.disk_dir))
        print(json.dumps(dict(
            error=type(error).__name__, message=str(error), errno=getattr(error, "errno", None),
            files=files, disk_dir=store.disk_dir, earlier_ok=gathered_ok(store, reference, list(range(16))),
            tiers=store.tier_tokens(), num_tokens=store.num_tokens)))
        store.close()
    """, str(tmp_path))
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert out["error"] == "StorageFullError"
    assert out["errno"] == 27  # EFBIG, kept from the OSError
    assert out["disk_dir"] in out["message"] and "page-00000002.npy" in out["message"]
    assert "offload_dir" in out["message"] and "ram_budget_mb" in out["message"]  # the fix
    assert out["files"] == ["page-00000000.npy", "page-00000001.npy"]  # no partial .tmp left
    assert out["earlier_ok"]
    assert not os.path.exists(out["disk_dir"])  # close() still cleans up


def test_a_failed_write_leaves_the_store_consistent(tmp_path):
    result = run_isolated("""
        import resource, signal
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        store = storage.PageStore(2, 2, 4, torch.float32, page_tokens=8, ram_budget_mb=0,
                                  offload_dir=sys.argv[1])
        reference = []
        g = torch.Generator().manual_seed(0)
        assert try_append(store, torch.randn(2, 2, 8, 2, 4, generator=g), reference) is None
        resource.setrlimit(resource.RLIMIT_FSIZE, (300, resource.RLIM_INFINITY))
        failed = torch.randn(2, 2, 8, 2, 4, generator=g)
        error = try_append(store, failed, reference)
        resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
        assert error is not None
        # Either the failed append is undone, or its tokens are still readable (kept in RAM).
        if store.num_tokens == 16:
            reference.append(failed)
        reference = torch.cat(reference, dim=2)
        try:
            readable = gathered_ok(store, reference, list(range(store.num_tokens)))
        except Exception as e:
            readable = repr(e)
        print(json.dumps(dict(num_tokens=store.num_tokens, tiers=store.tier_tokens(), readable=readable)))
        store.close()
    """, str(tmp_path))
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert out["num_tokens"] in (8, 16)
    assert sum(out["tiers"].values()) == out["num_tokens"], out
    assert out["readable"] is True, out


@pytest.fixture
def tiny_tmpfs(tmp_path):
    with mounted_tmpfs(tmp_path / "tiny", "1m") as mount_point:
        yield mount_point


def test_full_disk_raises_storage_full_error(tiny_tmpfs):
    # Pages of 256 KiB on a 1 MiB file system: three fit, the fourth does not.
    result = run_isolated("""
        store = storage.PageStore(2, 2, 64, torch.float32, page_tokens=256, ram_budget_mb=0,
                                  offload_dir=sys.argv[1])
        reference, error = [], None
        g = torch.Generator().manual_seed(0)
        for _ in range(6):
            error = try_append(store, torch.randn(2, 2, 256, 2, 64, generator=g), reference)
            if error is not None:
                break
        reference = torch.cat(reference, dim=2)
        n = reference.shape[2]
        print(json.dumps(dict(
            error=type(error).__name__, message=str(error), errno=getattr(error, "errno", None),
            files=sorted(os.listdir(store.disk_dir)), disk_dir=store.disk_dir, appended=n,
            earlier_ok=gathered_ok(store, reference, [0, 1, n // 2, n - 1]))))
        store.close()
    """, str(tiny_tmpfs))
    assert result.returncode == 0, f"the process died (return code {result.returncode}): {result.stderr[-500:]}"
    out = json.loads(result.stdout)
    assert out["error"] == "StorageFullError" and out["errno"] == 28  # ENOSPC
    assert out["disk_dir"] in out["message"]
    assert "offload_dir" in out["message"]
    assert not [f for f in out["files"] if f.endswith(".tmp")]
    assert out["appended"] >= 256
    assert out["earlier_ok"]


def test_page_folders_a_killed_process_left_are_removed_by_the_next_store(tmp_path):
    """A read killed with pages on disk skips the clean-up at exit; the folder names its process, so the next store
    in the same offload_dir removes it. Folders of live processes and foreign ones stay."""
    child = subprocess.run([sys.executable, "-c", textwrap.dedent(f"""
        import os, torch
        from emllm.storage import PageStore
        store = PageStore(2, 1, 4, torch.float32, page_tokens=4, ram_budget_mb=0, offload_dir={str(tmp_path)!r})
        store.append(torch.zeros(2, 2, 9, 1, 4))
        print(store.disk_dir, flush=True)
        os._exit(9)  # killed: no clean-up runs
        """)], capture_output=True, text=True, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    orphan = Path(child.stdout.strip())
    assert child.returncode == 9 and orphan.parent == tmp_path and any(orphan.iterdir())
    parent = os.getppid()
    live = tmp_path / f"emllm-kv-{owner_mark(parent)}-live"      # our parent process: alive
    pid_only = tmp_path / f"emllm-kv-{parent}-no-start-time"      # alive by its id (made where /proc is absent)
    reused = tmp_path / f"emllm-kv-{parent}.1-reused"             # its id now belongs to a process started later
    foreign = tmp_path / "emllm-kv-abcd1234"                      # no owner in its name (an earlier release's)
    for folder in (live, pid_only, reused, foreign):
        folder.mkdir()
    store = make_store(pages_in_ram=0, offload_dir=str(tmp_path))
    fill(store, [12])
    assert not orphan.exists() and not reused.exists()
    assert live.is_dir() and pid_only.is_dir() and foreign.is_dir()
    assert Path(store.disk_dir).name.startswith(f"emllm-kv-{owner_mark(os.getpid())}-")
    if process_start(os.getpid()) is not None:  # Linux: the mark holds the start time
        assert owner_mark(os.getpid()) == f"{os.getpid()}.{process_start(os.getpid())}"
    store.close()


def test_each_page_written_to_disk_hands_the_freed_heap_back(monkeypatch, tmp_path):
    """A page leaving RAM for disk frees tens of MB that glibc keeps inside its heap unless trimmed (1.3 GB held
    at 850K tokens of a 1M read): the store asks for it back once per page written, not per gather."""
    calls = []
    monkeypatch.setattr(storage, "release_freed_memory", lambda: calls.append(1))
    store = make_store(pages_in_ram=1, offload_dir=str(tmp_path))
    reference = fill(store, [PAGE * 4])
    assert store.tier_tokens()["disk"] == 3 * PAGE and len(calls) == 3
    check_gather(store, reference, range(4 * PAGE))
    assert len(calls) == 3
    store.close()
    monkeypatch.undo()
    assert (storage.malloc_trim() is not None) == (sys.platform == "linux" and os.confstr("CS_GNU_LIBC_VERSION")
                                                    is not None)
    storage.release_freed_memory()  # the real call returns


def test_a_memory_counts_its_event_index_in_its_ram_budget(tmp_path):
    """Reading under a RAM budget: the store is told what the representatives and event-text embeddings hold, and
    pages plus index stay within the budget as the index grows (at a million tokens the index is ~1.7 GB)."""
    from tests.unit_tests.tiny import tiny_engine, token_ids

    probe = tiny_engine("S", page_tokens=16).new_memory()
    budget_mb = 4.5 * probe.store.page_bytes / 2**20
    probe.close()
    engine = tiny_engine("S", page_tokens=16, ram_budget_mb=budget_mb, offload_dir=str(tmp_path))
    memory = engine.new_memory()
    engine.read(memory, token_ids(400, seed=3))
    ram = memory.store.tiers[-1]
    index_bytes = sum(layer.index.nbytes for layer in memory.layers)
    assert index_bytes > memory.store.page_bytes  # the index is big enough here to take a page's place
    assert ram.held_bytes == index_bytes
    assert ram.used_bytes + ram.held_bytes <= ram.budget_bytes
    assert len(ram.pages) < 4 and memory.store.tier_tokens()["disk"] > 0
    # Room is made before the index grows: the buffers that 50 more events need are counted first.
    assert memory.count_index_in_budgets(adding=50)
    assert ram.held_bytes == sum(layer.index.nbytes_after(50) for layer in memory.layers) > index_bytes
    assert ram.used_bytes + ram.held_bytes <= ram.budget_bytes
    memory.close()


def test_the_page_being_filled_grows_with_its_rows_and_a_fork_copies_only_the_filled_ones():
    """A conversation's checkpoints each hold a copy of the page being filled: whole pages made three checkpoints
    of SmolLM2 hold 141 MB of tails for ~400 evicted tokens. The tail doubles as it fills and is a whole page
    when sealed; reads and forks see exactly the rows written."""
    page = 1024
    store = make_store(page_tokens=page)
    row_bytes = store.page_bytes // page
    reference = fill(store, [5, 70])
    tail = store.held_tensors()[-1]
    assert tail.nbytes == 2 * storage.TAIL_MIN_TOKENS * row_bytes  # 64 rows, then doubled once for 75
    child = store.fork()
    assert child.held_tensors()[-1].nbytes == 75 * row_bytes  # the filled rows only
    child_reference = torch.cat([reference, fill(child, [page - 75 + 3], seed=1)], dim=2)  # grows, seals, starts anew
    reference = torch.cat([reference, fill(store, [40], seed=2)], dim=2)
    check_gather(store, reference, [0, 4, 74, 75, 114])
    check_gather(child, child_reference, [0, 74, 75, page - 1, page, page + 2])
    assert [t.nbytes for t in child.held_tensors()][0] == store.page_bytes  # the sealed page is a whole page


def test_held_bytes_counts_a_storage_once_however_many_forks_share_it():
    """A fork shares its parent's sealed pages (and key copies): together they hold those bytes once."""
    from emllm.memory import held_bytes
    from tests.unit_tests.tiny import tiny_engine, token_ids

    engine = tiny_engine("S")
    memory = engine.new_memory()
    engine.read(memory, token_ids(300, seed=3))
    fork = memory.fork()
    sealed = memory.store.num_tokens // memory.store.page_tokens * memory.store.page_bytes
    one = held_bytes([memory])["ram"]
    assert sealed > 0 and one > sealed
    assert held_bytes([memory, fork])["ram"] <= 2 * one - sealed
    assert held_bytes([memory, memory]) == held_bytes([memory])
    fork.close()
    assert held_bytes([memory, fork]) == held_bytes([memory])  # a closed memory holds nothing
    memory.close()
