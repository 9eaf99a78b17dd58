"""Unit tests for emllm.persistence: saving and loading a whole episodic memory.

No model weights: a tiny randomly initialised Llama (2 layers, 2 KV heads, head_dim 8) runs the real engine, so
memories go through the real flow (chunked reading, surprise, eviction, refinement, retrieval, contiguity, pages in
RAM and on disk). Tests check that a loaded memory equals the saved one in every field and answers and continues
exactly like it; that damaged, foreign or incompatible saves fail with MemoryFileError naming the file and leave
nothing behind; that a save killed at any point leaves the previous or the new save; and that a full disk raises
StorageFullError with the previous save intact.
"""

from __future__ import annotations

import json
import math
import os
import random
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from emllm import EMConfig, StorageFullError, persistence
from emllm.persistence import KV_FILE, MANIFEST, STATE_FILE, MemoryFileError, load_memory, save_memory
from tests.tmpfs import mounted_tmpfs

from .tiny import TINY, VOCAB, tiny_engine, tiny_model, tiny_tokenizer, token_ids  # noqa: F401 (re-exported)


# ============================================================================ helpers (also used by integration tests)
def same_tensor(a, b) -> bool:
    if a is None or b is None:
        return a is None and b is None
    a, b = a.detach().cpu(), b.detach().cpu()
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.is_floating_point():
        return torch.equal(torch.isnan(a), torch.isnan(b)) and torch.equal(a.nan_to_num(0.0), b.nan_to_num(0.0))
    return torch.equal(a, b)


def memory_differences(a, b) -> list[str]:
    """Every field that decides how a memory answers and continues, compared bit for bit; [] if all equal."""
    diffs = []
    check = lambda name, ok: diffs.append(name) if not ok else None  # noqa: E731
    check("token_ids", a.token_ids == b.token_ids)
    for name in ("surprise", "boundary_flags", "event_starts", "event_sizes", "last_logits"):
        check(name, same_tensor(getattr(a, name), getattr(b, name)))
    for name in ("sinks_split", "local_start", "track_surprise", "total_tokens", "num_events"):
        check(name, getattr(a, name) == getattr(b, name))
    check("layers", len(a.layers) == len(b.layers))
    for i, (x, y) in enumerate(zip(a.layers, b.layers)):
        check(f"layer{i}.length", x.length == y.length)
        check(f"layer{i}.rotated_length", x.rotated_length == y.rotated_length)
        n, r = x.length, x.rotated_length
        for name in ("keys", "values", "scores"):
            check(f"layer{i}.{name}", same_tensor(getattr(x, name)[:, :n], getattr(y, name)[:, :n]))
        check(f"layer{i}.rotated", same_tensor(x.rotated[:, :r], y.rotated[:, :r]))
        for name in ("sink_keys", "sink_values", "memory_keys", "memory_values"):
            check(f"layer{i}.{name}", same_tensor(getattr(x, name), getattr(y, name)))
        check(f"layer{i}.representatives", same_tensor(x.index.vectors, y.index.vectors))
        check(f"layer{i}.contiguity", x.contiguity.entries() == y.contiguity.entries())
        check(f"layer{i}.retrieved_ids", x.retrieved_ids == y.retrieved_ids)
        check(f"layer{i}.retrievals", x.retrievals == y.retrievals)
    check("store.num_tokens", a.store.num_tokens == b.store.num_tokens)
    check("store.content", same_tensor(store_tokens(a.store), store_tokens(b.store)))
    return diffs


def store_tokens(store) -> torch.Tensor:
    """All evicted KV in token order, [layers, 2, tokens, kv, d], read page by page from whatever tier holds it
    (without gather, which would promote pages from lower memory tiers)."""
    pages = []
    for page_id in range(math.ceil(store.num_tokens / store.page_tokens)):
        fill = min(store.page_tokens, store.num_tokens - page_id * store.page_tokens)
        pages.append(store.read_page(page_id)[:, :, :fill].to("cpu"))
    return torch.cat(pages, dim=2) if pages else torch.empty(0)


def siblings(path: Path) -> list[str]:
    """Leftovers of saving next to the target (temp, aside or trash directories)."""
    return sorted(p.name for p in path.parent.iterdir() if p.name.startswith(f".{path.name}."))


def open_memories(engine) -> list:
    return engine.open_memories()


# ============================================================================ fixtures
@pytest.fixture(scope="module")
def engine():
    return tiny_engine()


@pytest.fixture(scope="module")
def read_memory(engine):
    """A memory that read 300 tokens: sinks, ~30 events, pages sealed and a partial tail, retrieval done."""
    memory = engine.new_memory(engine.config.replace(page_tokens=7))
    engine.read(memory, token_ids(300))
    assert memory.num_events > 5 and memory.store.num_tokens % memory.store.page_tokens != 0
    assert any(layer.retrieved_ids for layer in memory.layers)
    assert any(layer.contiguity.entries() for layer in memory.layers)
    return memory


@pytest.fixture(scope="module")
def saved(read_memory, engine, tmp_path_factory):
    path = tmp_path_factory.mktemp("saved") / "memory"
    save_memory(read_memory, path, engine=engine)
    return path


# ============================================================================ round trips
@pytest.mark.parametrize("preset,dtype,ram_budget_mb", [
    ("SM+C", torch.float32, None), ("S", torch.bfloat16, 0), ("F", torch.float16, None), ("SC", torch.float32, 0),
    ("full", torch.float32, None)])
def test_round_trip_restores_every_field(preset, dtype, ram_budget_mb, tmp_path):
    engine = tiny_engine(preset, dtype, ram_budget_mb=ram_budget_mb, offload_dir=str(tmp_path / "offload"))
    memory = engine.new_memory()
    engine.read(memory, token_ids(230, seed=1))
    if ram_budget_mb == 0 and preset != "full":
        assert memory.store.tier_tokens()["disk"] > 0  # the save reads pages back from disk
    save_memory(memory, tmp_path / "m", engine=engine)
    loaded = load_memory(tmp_path / "m", engine)
    assert memory_differences(memory, loaded) == []
    assert loaded.config == memory.config
    assert sorted(os.listdir(tmp_path / "m")) == sorted([MANIFEST, STATE_FILE, KV_FILE])
    assert siblings(tmp_path / "m") == []


@pytest.mark.parametrize("tokens", [0, 20])
def test_round_trip_of_an_empty_or_short_memory(tokens, engine, tmp_path):
    memory = engine.new_memory()
    if tokens:
        engine.read(memory, token_ids(tokens, seed=2))
    assert memory.store.num_tokens == 0 and not memory.sinks_split
    save_memory(memory, tmp_path / "m", engine=engine)
    loaded = load_memory(tmp_path / "m", engine)
    assert memory_differences(memory, loaded) == []
    more = token_ids(tokens + 40, seed=2)
    if not tokens:  # a fresh memory has no logits to generate from: read first, then both must agree
        engine.read(memory, more[:10])
        engine.read(loaded, more[:10])
    a = engine.generate(more, memory=memory, max_new_tokens=6)
    b = engine.generate(more, memory=loaded, max_new_tokens=6)
    assert a.token_ids == b.token_ids
    assert memory_differences(memory, loaded) == []


def test_loaded_memory_answers_and_continues_exactly(engine, read_memory, saved):
    original = read_memory.fork()
    loaded = load_memory(saved, engine)
    assert memory_differences(original, loaded) == []
    ids = list(original.token_ids)
    for step, extra in enumerate([token_ids(5, seed=3), token_ids(90, seed=4), token_ids(40, seed=5)]):
        ids = ids + extra
        a = engine.generate(ids, memory=original, max_new_tokens=10)
        b = engine.generate(ids, memory=loaded, max_new_tokens=10)
        assert a.token_ids == b.token_ids and a.retrieved_events == b.retrieved_events, step
        assert memory_differences(original, loaded) == [], step
        ids = list(original.token_ids)  # the answer read so far (all but its last token) is part of the memory


def test_load_places_pages_by_the_loading_config(engine, read_memory, saved, tmp_path):
    """Page size and budgets belong to the loading machine: pages are re-cut and spill to its disk."""
    offload = tmp_path / "offload"
    config = read_memory.config.replace(page_tokens=5, ram_budget_mb=0, offload_dir=str(offload))
    loaded = load_memory(saved, engine, config=config)
    assert loaded.store.page_tokens == 5 and loaded.config.ram_budget_mb == 0
    assert loaded.store.tier_tokens()["disk"] == loaded.store.num_tokens - loaded.store.num_tokens % 5  # all sealed
    assert len(os.listdir(offload)) == 1
    assert memory_differences(read_memory, loaded) == []
    ids = read_memory.token_ids + token_ids(50, seed=6)
    original = read_memory.fork()
    assert (engine.generate(ids, memory=original, max_new_tokens=8).token_ids
            == engine.generate(ids, memory=loaded, max_new_tokens=8).token_ids)
    loaded.close()
    assert os.listdir(offload) == []


def test_a_config_that_changes_the_method_is_refused(engine, saved):
    before = set(open_memories(engine))
    with pytest.raises(MemoryFileError, match=r"n_local=32 \(given 64\)"):
        load_memory(saved, engine, config=EMConfig.from_preset("SM+C", **{**TINY, "n_local": 64}))
    assert set(open_memories(engine)) - before == set()  # nothing new left open


def test_files_are_plain_json_and_safetensors(read_memory, saved):
    from safetensors import safe_open

    store = read_memory.store
    with safe_open(str(saved / KV_FILE), framework="pt") as handle:
        pages = handle.get_tensor("pages")
    assert pages.dtype == store.dtype and pages.shape[1:] == store.page_shape
    flat = pages.permute(0, 3, 1, 2, 4, 5).reshape(-1, *pages.shape[1:3], *pages.shape[4:])  # [tokens, L, 2, kv, d]
    flat = flat[: store.num_tokens]
    every = torch.arange(store.num_tokens)
    for layer in range(len(read_memory.layers)):
        keys, values = store.gather(layer, every, torch.device("cpu"))
        assert torch.equal(flat[:, layer, 0].transpose(0, 1), keys)
        assert torch.equal(flat[:, layer, 1].transpose(0, 1), values)
    with safe_open(str(saved / STATE_FILE), framework="pt") as handle:
        assert "token_ids" in handle.keys()
    manifest = json.loads((saved / MANIFEST).read_text())
    assert manifest["format_version"] == persistence.FORMAT_VERSION
    assert manifest["memory"]["total_tokens"] == read_memory.total_tokens
    for name in (KV_FILE, STATE_FILE):
        assert manifest["files"][name]["bytes"] == (saved / name).stat().st_size
        assert len(manifest["files"][name]["blake2b"]) == 64
    assert sorted(p.name for p in saved.iterdir()) == sorted([MANIFEST, STATE_FILE, KV_FILE])  # JSON + safetensors


# ============================================================================ replacing a save
@pytest.mark.parametrize("atomic_exchange", [True, False], ids=["renameat2-exchange", "rename-aside"])
def test_save_replaces_the_previous_save(atomic_exchange, engine, tmp_path, monkeypatch):
    """With an atomic exchange the two saves swap in one step; without it the old one is renamed aside first."""
    monkeypatch.setattr(persistence, "HAVE_EXCHANGE", persistence.HAVE_EXCHANGE and atomic_exchange)
    first, second = engine.new_memory(), engine.new_memory()
    engine.read(first, token_ids(120, seed=7))
    engine.read(second, token_ids(200, seed=8))
    target = tmp_path / "m"
    save_memory(first, target, engine=engine)
    save_memory(second, target, engine=engine)
    assert memory_differences(second, load_memory(target, engine)) == []
    assert siblings(target) == []


def dead_pid() -> int:
    process = subprocess.Popen(["true"])
    process.wait()
    return process.pid


def test_a_crash_between_the_two_renames_is_repaired_on_load(engine, read_memory, saved, tmp_path):
    """Without an atomic exchange the old save is renamed aside before the new one arrives; if the process dies
    in between, the target is missing and the complete old save sits aside: loading puts it back."""
    target = tmp_path / "m"
    save_memory(read_memory, target, engine=engine)
    aside = tmp_path / f".m.old-{dead_pid()}-0123abcd"
    os.rename(target, aside)
    half_written = tmp_path / f".m.saving-{dead_pid()}-89abcdef"  # the new save that never arrived
    half_written.mkdir()
    (half_written / KV_FILE).write_bytes(b"partial")
    loaded = load_memory(target, engine)
    assert memory_differences(read_memory, loaded) == []
    assert target.is_dir() and siblings(target) == []


def test_reading_the_metadata_repairs_a_crash_between_the_two_renames_too(engine, read_memory, tmp_path):
    """EMLLMQueryEngine.from_memory reads the metadata before loading: it must find the save load_memory would."""
    from emllm.persistence import read_metadata

    target = tmp_path / "m"
    save_memory(read_memory, target, engine=engine, metadata={"kind": "documents"})
    os.rename(target, tmp_path / f".m.old-{dead_pid()}-0123abcd")
    assert read_metadata(target) == {"kind": "documents"}
    assert target.is_dir() and siblings(target) == []


def test_saving_through_a_symlink_replaces_the_save_it_names_and_keeps_the_link(engine, read_memory, tmp_path):
    real = tmp_path / "saves" / "m"
    save_memory(read_memory, real, engine=engine, metadata={"round": 1})
    link = tmp_path / "current"
    link.symlink_to(real, target_is_directory=True)
    from emllm.persistence import read_metadata

    save_memory(read_memory, link, engine=engine, metadata={"round": 2})
    assert link.is_symlink() and link.resolve() == real.resolve()
    assert read_metadata(real) == {"round": 2} and read_metadata(link) == {"round": 2}
    assert siblings(real) == [] and sorted(p.name for p in tmp_path.iterdir()) == ["current", "saves"]


def test_a_load_that_races_a_save_of_the_same_path_reads_the_new_save(engine, read_memory, tmp_path, monkeypatch):
    """Another process replaces the save after this load read its manifest: the files of two saves mix and the
    checksums disagree, but both saves are good, so the load reads the path again instead of calling it damaged."""
    target = tmp_path / "m"
    save_memory(read_memory, target, engine=engine, metadata={"round": 1})
    other = engine.new_memory()
    engine.read(other, token_ids(260, seed=21))
    real_read_state = persistence.read_state
    raced = []

    def read_state_while_a_save_lands(*args, **kwargs):
        if not raced:
            raced.append(True)
            save_memory(other, target, engine=engine, metadata={"round": 2})  # the save lands mid-load
        return real_read_state(*args, **kwargs)

    monkeypatch.setattr(persistence, "read_state", read_state_while_a_save_lands)
    loaded = load_memory(target, engine)
    assert raced and memory_differences(other, loaded) == []
    loaded.close()
    other.close()


def test_siblings_of_a_live_save_are_left_alone(engine, read_memory, tmp_path):
    target = tmp_path / "m"
    save_memory(read_memory, target, engine=engine)
    live = tmp_path / f".m.saving-{os.getppid()}-0123abcd"  # our parent process: alive
    live.mkdir()
    load_memory(target, engine)
    save_memory(read_memory, target, engine=engine)
    assert live.is_dir()


@pytest.mark.parametrize("kind", ["file", "other directory"])
def test_save_refuses_to_replace_data_that_is_not_a_save(kind, engine, read_memory, tmp_path):
    target = tmp_path / "precious"
    if kind == "file":
        target.write_text("keep me")
    else:
        target.mkdir()
        (target / "notes.txt").write_text("keep me")
    with pytest.raises(ValueError, match="precious"):
        save_memory(read_memory, target, engine=engine)
    assert (target if kind == "file" else target / "notes.txt").read_text() == "keep me"
    assert siblings(target) == []


def test_save_refuses_a_closed_memory_and_a_foreign_engine(engine, tmp_path):
    memory = engine.new_memory()
    engine.read(memory, token_ids(30))
    other = tiny_engine(hidden=48, name="wider")  # 2 KV heads of 12 dims: another shape
    with pytest.raises(ValueError, match="pass the engine that made the memory"):
        save_memory(memory, tmp_path / "m", engine=other)
    memory.close()
    with pytest.raises(ValueError, match="closed"):
        save_memory(memory, tmp_path / "m", engine=engine)
    assert not (tmp_path / "m").exists() and siblings(tmp_path / "m") == []


# ============================================================================ a save that builds on the last one
def kv_files(path: Path) -> dict[str, int]:
    """The save's KV files by name, with their inode (a linked file keeps the inode of the save it came from)."""
    return {p.name: p.stat().st_ino for p in path.iterdir() if p.name.startswith("kv")}


def test_a_later_save_of_the_same_memory_links_its_full_pages_and_writes_the_rest(engine, tmp_path):
    """A conversation's next turn is saved over its last save: the pages that save holds are linked, not written
    again, and the result loads exactly (also after a third save, and from a store paging another way)."""
    memory = engine.new_memory(engine.config.replace(page_tokens=7))
    engine.read(memory, token_ids(300, seed=3))
    path = tmp_path / "m"
    save_memory(memory, path, engine=engine)
    first = kv_files(path)
    assert list(first) == [KV_FILE]
    for turn, extra in enumerate((40, 25)):
        sealed_before = memory.store.num_tokens // 7
        engine.read(memory, token_ids(extra, seed=10 + turn))
        assert memory.store.num_tokens // 7 > sealed_before  # the turn sealed pages
        earlier = kv_files(path)
        save_memory(memory, path, engine=engine)
        now = kv_files(path)
        assert {name: now[name] for name in earlier if name in now} == {name: earlier[name] for name in earlier
                                                                         if name in now}
        assert KV_FILE in now and now[KV_FILE] == first[KV_FILE]  # the first save's pages: the same file
        manifest = json.loads((path / MANIFEST).read_text())
        segments = manifest["memory"]["kv_segments"]
        written = segments[-1]
        assert written["first_page"] >= sealed_before - 1 and written["file"] not in earlier
        assert sum(s["used"] for s in segments) == math.ceil(memory.store.num_tokens / 7)
        assert memory_differences(memory, load_memory(path, engine)) == []
    assert siblings(path) == []
    loaded = load_memory(path, engine, config=memory.config.replace(page_tokens=5))  # pages cut otherwise
    assert memory_differences(memory, loaded) == []


def test_a_loaded_memory_saved_again_links_the_files_it_was_loaded_from(engine, tmp_path):
    memory = engine.new_memory(engine.config.replace(page_tokens=7))
    engine.read(memory, token_ids(300, seed=4))
    path = save_memory(memory, tmp_path / "m", engine=engine)
    loaded = load_memory(path, engine, config=memory.config)  # paged as saved: the digests it verified are kept
    before = kv_files(path)
    engine.read(loaded, token_ids(30, seed=5))
    save_memory(loaded, path, engine=engine)
    assert kv_files(path)[KV_FILE] == before[KV_FILE]
    engine.read(memory, token_ids(30, seed=5))
    assert memory_differences(memory, load_memory(path, engine)) == []


def test_a_save_over_another_memory_shares_only_the_pages_both_hold(engine, tmp_path):
    """A fork that read other tokens after a shared prefix, saved over the other fork's save: only the shared full
    pages may be linked; what differs is written. A different memory's save shares nothing."""
    base = engine.new_memory(engine.config.replace(page_tokens=7))
    engine.read(base, token_ids(200, seed=6))
    one, two = base.fork(), base.fork()
    engine.read(one, token_ids(120, seed=7))
    engine.read(two, token_ids(120, seed=8))
    path = tmp_path / "m"
    save_memory(one, path, engine=engine)
    save_memory(two, path, engine=engine)
    manifest = json.loads((path / MANIFEST).read_text())
    shared = sum(s["used"] for s in manifest["memory"]["kv_segments"][:-1])
    assert shared > 0  # the pages of tokens both read before the fork, evicted alike after it too
    assert all(torch.equal(one.store.read_page(i), two.store.read_page(i)) for i in range(shared))
    assert not torch.equal(one.store.read_page(shared), two.store.read_page(shared))
    assert memory_differences(two, load_memory(path, engine)) == []
    other = engine.new_memory(engine.config.replace(page_tokens=7))
    engine.read(other, token_ids(300, seed=9))
    before = kv_files(path)
    save_memory(other, path, engine=engine)
    assert kv_files(path) == {KV_FILE: kv_files(path)[KV_FILE]} and kv_files(path)[KV_FILE] != before[KV_FILE]
    assert memory_differences(other, load_memory(path, engine)) == []


def test_a_damaged_linked_file_fails_the_load_of_the_save_that_links_it(engine, tmp_path):
    memory = engine.new_memory(engine.config.replace(page_tokens=7))
    engine.read(memory, token_ids(300, seed=12))
    path = save_memory(memory, tmp_path / "m", engine=engine)
    engine.read(memory, token_ids(40, seed=13))
    save_memory(memory, path, engine=engine)
    flip_bit(path / KV_FILE, (path / KV_FILE).stat().st_size // 2)
    with pytest.raises(MemoryFileError, match=f"{KV_FILE} is damaged: .*checksum"):
        load_memory(path, engine)


def test_a_version_1_save_loads(engine, read_memory, tmp_path):
    """Saves from before the KV segments (one KV file, no page digests) load, and a save over one writes all."""
    path = save_memory(read_memory, tmp_path / "m", engine=engine)

    def as_version_1(manifest):
        manifest["format_version"] = 1
        del manifest["memory"]["kv_segments"], manifest["memory"]["kv_page_digests"]

    rewrite_manifest(path, as_version_1)
    loaded = load_memory(path, engine)
    assert memory_differences(read_memory, loaded) == []
    before = kv_files(path)
    save_memory(loaded, path, engine=engine)
    assert kv_files(path)[KV_FILE] != before[KV_FILE]
    assert memory_differences(read_memory, load_memory(path, engine)) == []


@pytest.mark.parametrize("segments", [
    [{"file": "../kv.safetensors", "first_page": 0, "pages": 43, "used": 43}],
    [{"file": KV_FILE, "first_page": 0, "pages": 43, "used": 20}, {"file": KV_FILE, "first_page": 20, "pages": 23,
                                                                  "used": 23}],
    [{"file": KV_FILE, "first_page": 0, "pages": 43, "used": 20}, {"file": "kv-000021.safetensors",
                                                                  "first_page": 21, "pages": 22, "used": 22}],
    [{"file": KV_FILE, "first_page": 0, "pages": 43, "used": 44}],
    [{"file": "kv-000009.safetensors", "first_page": 0, "pages": 43, "used": 43}],
    [{"file": KV_FILE, "first_page": "0", "pages": 43, "used": 43}],
])
def test_forged_kv_segments_are_refused_before_any_file_is_read(segments, engine, saved, tmp_path):
    import shutil

    path = tmp_path / "forged"
    shutil.copytree(saved, path)
    rewrite_manifest(path, lambda m: m["memory"].__setitem__("kv_segments", segments))
    with pytest.raises(MemoryFileError, match="KV segment"):
        load_memory(path, engine)


# ============================================================================ refusing damaged or foreign saves
def copy_save(source: Path, tmp_path: Path) -> Path:
    import shutil

    target = tmp_path / "copy"
    shutil.copytree(source, target)
    return target


def flip_bit(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x10
    path.write_bytes(bytes(data))


def rewrite_manifest(path: Path, change, recompute_checksum=True) -> None:
    manifest = json.loads((path / MANIFEST).read_text())
    change(manifest)
    if recompute_checksum:
        manifest["checksum"] = persistence.manifest_checksum(manifest)
    (path / MANIFEST).write_text(json.dumps(manifest))


def other_save(engine, tmp_path) -> Path:
    memory = engine.new_memory()
    engine.read(memory, token_ids(300, seed=11))
    return save_memory(memory, tmp_path / "other", engine=engine)


def swap_first_pages(path: Path) -> None:
    """Same size, every byte a real saved value, only the order wrong: only the checksum can tell."""
    data = bytearray(path.read_bytes())
    start = 8 + int.from_bytes(data[:8], "little")
    page = (len(data) - start) // json.loads(data[8:start])["pages"]["shape"][0]
    first, second = data[start:start + page], data[start + page:start + 2 * page]
    assert first != second
    data[start:start + 2 * page] = second + first
    path.write_bytes(bytes(data))


def _set(section, key, value):
    return lambda m: m[section].__setitem__(key, value)


DAMAGE = {
    # name: (how to damage the copy, the file the error must name, words the error must contain)
    "truncated kv": (lambda p, e, t: os.truncate(p / KV_FILE, (p / KV_FILE).stat().st_size - 100),
                     KV_FILE, "truncated"),
    "truncated state": (lambda p, e, t: os.truncate(p / STATE_FILE, 50), STATE_FILE, "truncated"),
    "kv grown": (lambda p, e, t: open(p / KV_FILE, "ab").write(b"\0" * 8), KV_FILE, "longer than saved"),
    "bit flip in kv header": (lambda p, e, t: flip_bit(p / KV_FILE, 20), KV_FILE, "checksum"),
    "bit flip in kv data": (lambda p, e, t: flip_bit(p / KV_FILE, (p / KV_FILE).stat().st_size // 2), KV_FILE,
                            "checksum"),
    "bit flip in last kv byte": (lambda p, e, t: flip_bit(p / KV_FILE, (p / KV_FILE).stat().st_size - 1), KV_FILE,
                                 "checksum"),
    "bit flip in state": (lambda p, e, t: flip_bit(p / STATE_FILE, (p / STATE_FILE).stat().st_size - 30),
                          STATE_FILE, "checksum"),
    "bit flip in manifest": (lambda p, e, t: rewrite_manifest(p, _set("memory", "total_tokens", 301), False),
                             MANIFEST, "checksum"),
    "missing kv": (lambda p, e, t: os.remove(p / KV_FILE), KV_FILE, "missing"),
    "missing state": (lambda p, e, t: os.remove(p / STATE_FILE), STATE_FILE, "missing"),
    "missing manifest": (lambda p, e, t: os.remove(p / MANIFEST), MANIFEST, "missing"),
    "manifest not json": (lambda p, e, t: (p / MANIFEST).write_text("{not json"), MANIFEST, "not valid JSON"),
    "foreign manifest": (lambda p, e, t: (p / MANIFEST).write_text('{"format": "something-else"}'), MANIFEST,
                         "not an emllm"),
    "wrong version": (lambda p, e, t: rewrite_manifest(p, lambda m: m.__setitem__("format_version", 99), False),
                      MANIFEST, "format version 99"),
    "kv of another save": (lambda p, e, t: os.replace(other_save(e, t) / KV_FILE, p / KV_FILE), KV_FILE,
                           ("truncated", "longer than saved", "another save")),
    "state of another save": (lambda p, e, t: os.replace(other_save(e, t) / STATE_FILE, p / STATE_FILE),
                              STATE_FILE, ("truncated", "longer than saved", "another save")),
    "kv pages swapped": (lambda p, e, t: swap_first_pages(p / KV_FILE), KV_FILE, "another save"),
    "counts forged": (lambda p, e, t: rewrite_manifest(p, _set("memory", "total_tokens", 301)), MANIFEST,
                      "do not match the memory's counts"),
    "config forged": (lambda p, e, t: rewrite_manifest(p, _set("config", "n_init", 4)), MANIFEST,
                      "exceed the layout"),
    "impossible config": (lambda p, e, t: rewrite_manifest(p, _set("config", "min_block_size", 999)), MANIFEST,
                          "min_block_size"),
    # A forged page size must be refused before a page buffer of that size is allocated (1e8 tokens per page of
    # even the tiny model would be gigabytes).
    "page size forged": (lambda p, e, t: rewrite_manifest(p, _set("memory", "kv_page_tokens", 10 ** 8)), MANIFEST,
                         "impossible counts"),
    "no pages, huge page size": (lambda p, e, t: rewrite_manifest(p, lambda m: m["memory"].update(
        kv_pages=0, evicted_tokens=0, kv_page_tokens=10 ** 8)), MANIFEST, "do not match the memory's counts"),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_damaged_saves_fail_clearly_and_leave_nothing(damage, engine, saved, tmp_path):
    change, file, words = DAMAGE[damage]
    path = copy_save(saved, tmp_path)
    change(path, engine, tmp_path)
    offload = tmp_path / "offload"
    loader = tiny_engine(ram_budget_mb=0, offload_dir=str(offload))  # the same model; a load writes pages here
    with pytest.raises(MemoryFileError) as error:
        load_memory(path, loader)
    message = str(error.value)
    assert file in message and any(w in message for w in ([words] if isinstance(words, str) else words)), message
    assert open_memories(loader) == []  # no half-loaded memory stays open
    assert not offload.exists() or os.listdir(offload) == []  # its pages were removed
    assert siblings(path) == []


def test_a_memory_of_another_model_is_refused(saved, tmp_path):
    other = tiny_engine(intermediate=80, name="other-model")  # same attention shape, another model
    with pytest.raises(MemoryFileError, match="saved with model 'tiny'.*this engine runs 'other-model'"):
        load_memory(saved, other)


def test_missing_directory(engine, tmp_path):
    with pytest.raises(MemoryFileError, match="does not exist"):
        load_memory(tmp_path / "nothing-here", engine)


# ============================================================================ crashes and full disks
def run_child(save, kill_at_step: int | None = None) -> int:
    """Fork a process that runs save(); with kill_at_step it SIGKILLs itself right before its n-th file-system
    step (mkdir, fsync, rename, exchange, rmtree). Returns the raw wait status."""
    pid = os.fork()
    if pid == 0:  # child: never returns into pytest
        try:
            if kill_at_step is not None:
                steps = [0]

                def step(fn):
                    def wrapped(*args, **kwargs):
                        steps[0] += 1
                        if steps[0] == kill_at_step:
                            os.kill(os.getpid(), signal.SIGKILL)
                        return fn(*args, **kwargs)
                    return wrapped

                import shutil

                os.mkdir, os.fsync, os.rename = step(os.mkdir), step(os.fsync), step(os.rename)
                shutil.rmtree = step(shutil.rmtree)
                persistence.exchange = step(persistence.exchange)
            save()
            os._exit(0)
        except BaseException:
            os._exit(3)
    return os.waitpid(pid, 0)[1]


def kill_after(save, delay: float) -> int:
    pid = os.fork()
    if pid == 0:
        try:
            save()
            os._exit(0)
        except BaseException:
            os._exit(3)
    time.sleep(delay)
    os.kill(pid, signal.SIGKILL)
    return os.waitpid(pid, 0)[1]


def outcome(path, engine, old, new) -> str:
    """Load what a crash left: it must be exactly the old or the new save, with no leftovers after the load."""
    loaded = load_memory(path, engine)
    which = "old" if loaded.total_tokens == old.total_tokens else "new"
    assert memory_differences(old if which == "old" else new, loaded) == []
    assert siblings(path) == []
    loaded.close()
    return which


@pytest.fixture(scope="module")
def old_and_new(engine):
    old = engine.new_memory()
    engine.read(old, token_ids(200, seed=12))
    new = old.fork()
    engine.read(new, token_ids(1000, seed=13))  # continued: a larger save with shared and new pages
    return old, new


@pytest.mark.parametrize("exchange", [True, False], ids=["atomic-exchange", "rename-aside"])
def test_a_save_killed_at_every_step_leaves_the_old_or_the_new_save(exchange, engine, old_and_new, tmp_path,
                                                                    monkeypatch):
    monkeypatch.setattr(persistence, "HAVE_EXCHANGE", exchange)
    old, new = old_and_new
    target = tmp_path / "m"
    save_memory(old, target, engine=engine)
    seen = {"old": 0, "new": 0}
    step = 1
    while True:
        status = run_child(lambda: save_memory(new, target, engine=engine), kill_at_step=step)
        killed = os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
        assert killed or os.WEXITSTATUS(status) == 0, status
        result = outcome(target, engine, old, new)
        seen[result] += 1
        if not killed:
            break
        if result == "new":
            save_memory(old, target, engine=engine)  # start each kill from the old save again
        step += 1
    print(f"\n{'exchange' if exchange else 'rename-aside'}: killed at {step - 1} file-system steps, outcomes {seen}")
    assert step > 8 and seen["old"] >= 6 and seen["new"] >= 1  # the kills really landed inside the save


def test_a_save_killed_at_random_moments_leaves_the_old_or_the_new_save(engine, old_and_new, tmp_path):
    old, new = old_and_new
    target = tmp_path / "m"
    read_end, write_end = os.pipe()

    def timed_save():  # over an existing save, like the runs below; the time only spreads the kill points
        started = time.perf_counter()
        save_memory(new, target, engine=engine)
        os.write(write_end, str(time.perf_counter() - started).encode())

    save_memory(old, target, engine=engine)
    durations = []
    for _ in range(3):
        assert os.WEXITSTATUS(run_child(timed_save)) == 0
        durations.append(float(os.read(read_end, 100)))
        save_memory(old, target, engine=engine)
    os.close(read_end), os.close(write_end)
    duration = sorted(durations)[1]
    rng = random.Random(0)
    # Log-uniform from 0.2 ms: fsync times vary a lot on a shared disk, so early points are dense and late ones
    # still reach past the end of a save.
    delays = sorted(math.exp(rng.uniform(math.log(2e-4), math.log(1.3 * duration))) for _ in range(24))
    seen = {"old": 0, "new": 0}
    killed_mid_save = 0
    for delay in delays:
        status = kill_after(lambda: save_memory(new, target, engine=engine), delay)
        killed_mid_save += os.WIFSIGNALED(status)
        result = outcome(target, engine, old, new)
        seen[result] += 1
        if result == "new":
            save_memory(old, target, engine=engine)  # start each kill from the old save again
    print(f"\n{len(delays)} kill points over {duration * 1000:.0f} ms; {killed_mid_save} killed mid-save; "
          f"outcomes {seen}")
    assert len(delays) >= 20 and sum(seen.values()) == len(delays)


def test_a_write_failure_raises_storage_full_error_and_keeps_the_previous_save(engine, old_and_new, tmp_path):
    """A real OSError from the file system: EFBIG through RLIMIT_FSIZE in a child process (no root needed)."""
    import resource

    old, new = old_and_new
    target = tmp_path / "m"
    save_memory(old, target, engine=engine)
    limit = (target / KV_FILE).stat().st_size + 1000  # the old save's files fit, the new KV file does not
    read_end, write_end = os.pipe()

    def save_with_limit():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # get EFBIG instead of being killed
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))
        try:
            save_memory(new, target, engine=engine)
            report = {"error": None}
        except Exception as error:
            report = {"error": type(error).__name__, "errno": getattr(error, "errno", None), "message": str(error)}
        os.write(write_end, json.dumps(report).encode())

    status = run_child(save_with_limit)
    os.close(write_end)
    report = json.loads(os.read(read_end, 65536))
    os.close(read_end)
    assert os.WEXITSTATUS(status) == 0
    assert report["error"] == "StorageFullError" and report["errno"] == 27, report  # EFBIG
    assert str(target) in report["message"] and "previous save" in report["message"]
    assert memory_differences(old, load_memory(target, engine)) == []
    assert siblings(target) == []


@pytest.fixture
def tiny_tmpfs(tmp_path):
    with mounted_tmpfs(tmp_path / "tiny", "128k") as mount_point:
        yield mount_point


def test_a_full_disk_raises_storage_full_error_and_keeps_the_previous_save(engine, tiny_tmpfs):
    small, large = engine.new_memory(), engine.new_memory()
    engine.read(small, token_ids(100, seed=14))
    engine.read(large, token_ids(1500, seed=15))  # ~190 KB of KV: more than the 128 KB disk
    target = tiny_tmpfs / "m"
    save_memory(small, target, engine=engine)
    with pytest.raises(StorageFullError) as error:
        save_memory(large, target, engine=engine)
    assert error.value.errno == 28 and str(target) in str(error.value)  # ENOSPC
    assert "free disk space" in str(error.value)
    assert memory_differences(small, load_memory(target, engine)) == []
    assert siblings(target) == []


def test_the_engine_chooses_the_event_embedding_not_the_file(saved, engine, tmp_path):
    """A manifest edited to name a folder of weights as its event embedding (checksum recomputed, as a forger would)
    loads with the engine's own embedding: the file never chooses what this process loads."""
    forged = copy_save(saved, tmp_path)
    rewrite_manifest(forged, lambda m: m["config"].update(event_embedding=str(tmp_path / "someone-elses-model")))
    memory = load_memory(forged, engine)
    try:
        assert memory.config.event_embedding == engine.config.event_embedding
    finally:
        memory.close()
    given = engine.config.replace(event_embedding="mpnet")  # a caller's explicit choice is theirs, not a mismatch
    memory = load_memory(saved, engine, config=given)
    try:
        assert memory.config.event_embedding == "mpnet"
    finally:
        memory.close()


def test_a_save_refuses_other_weights_of_the_same_shape_and_another_tokenizer(saved, engine):
    """Issue 57: the same architecture and sizes with other weights (a fine-tune into its base), or the same
    weights with a tokenizer that swaps two ids, are refused by name; the engine that saved it loads it."""
    from emllm import EMEngine

    other_weights = tiny_engine(seed=1)
    with pytest.raises(MemoryFileError, match="weights' content differ"):
        load_memory(saved, other_weights)
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = tiny_tokenizer().get_vocab()
    order = {f"t{i}": i for i in range(VOCAB)}
    order["t5"], order["t6"] = 6, 5
    raw = Tokenizer(models.WordLevel(order, unk_token="t2"))
    raw.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    swapped = PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="t1", unk_token="t2")
    assert swapped.get_vocab() != vocab
    other_tokenizer = EMEngine(engine.model, swapped, engine.config, model_name="tiny")
    with pytest.raises(MemoryFileError, match="tokenizer .vocabulary, added tokens, chat template. differ"):
        load_memory(saved, other_tokenizer)
    load_memory(saved, engine).close()


def test_the_tokenizer_fingerprint_is_hashed_once_yet_follows_every_change_transformers_can_make():
    """Every save asks for it (hashing the vocabulary was half a save's time): it is kept per tokenizer, and a
    chat template set, a token added or a role changed after it was kept still gives another print."""
    from emllm.models import tokenizer_fingerprint

    tokenizer = tiny_tokenizer()
    first = tokenizer_fingerprint(tokenizer)
    assert tokenizer_fingerprint(tokenizer) == first == tokenizer_fingerprint(tiny_tokenizer())
    seen = {first}
    tokenizer.chat_template = "{% for m in messages %}{{ m.content }}{% endfor %}"
    seen.add(tokenizer_fingerprint(tokenizer))
    tokenizer.add_tokens(["brand-new"])
    seen.add(tokenizer_fingerprint(tokenizer))
    tokenizer.add_special_tokens({"pad_token": "brand-new"})
    seen.add(tokenizer_fingerprint(tokenizer))
    assert len(seen) == 4


def test_a_memory_saved_while_read_in_full_attention_loads_and_hands_over_as_the_original(engine, tmp_path):
    """full_until grows the window past the layout's size; a save made then holds that window, loads, and crosses
    into the memory exactly as the memory it was saved from."""
    config = engine.config.replace(full_until=120)
    memory = engine.new_memory(config)
    engine.read(memory, token_ids(100, seed=7))
    assert memory.num_events == 0 and memory.layers[0].length == 100 > config.max_position()
    save_memory(memory, tmp_path / "full", engine=engine)
    loaded = load_memory(tmp_path / "full", engine)
    assert loaded.config.full_until == 120 and memory_differences(memory, loaded) == []
    ids = memory.token_ids + token_ids(60, seed=8)
    a = engine.generate(ids, memory=memory, max_new_tokens=10)
    b = engine.generate(ids, memory=loaded, max_new_tokens=10)
    assert a.token_ids == b.token_ids and memory.num_events > 0 and memory_differences(memory, loaded) == []



def test_a_disk_budget_counts_nothing_stored_while_an_input_fits_full_attention(engine, tmp_path):
    """A read that stays inside full_until stores nothing, so no disk budget refuses it; past it the budget holds."""
    config = engine.config.replace(full_until=200, ram_budget_mb=0, disk_budget_mb=0, offload_dir=str(tmp_path))
    memory = engine.new_memory(config)
    engine.read(memory, token_ids(180, seed=9))
    assert memory.num_events == 0 and memory.store.num_tokens == 0
    with pytest.raises(StorageFullError):
        engine.read(memory, token_ids(200, seed=10))
    assert memory.total_tokens == 180  # the refused read left the memory as it was
