"""Saving and loading an episodic memory of the real model (SmolLM2-135M-Instruct, in its fast dtype).

A memory that read a ~1K-token document with most of its evicted pages on disk (64-token pages, a RAM budget of
one and a half pages) is saved, loaded and questioned: the loaded memory must give exactly the same greedy tokens
as the memory it was saved from, and keep doing so when both read more text. Damaged files, a memory of another
model and of the same model in another dtype are refused; a save killed at random moments leaves the old or the
new save; a full disk raises StorageFullError with the previous save intact.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import time

import pytest
import torch

from emllm import StorageFullError, load_model
from emllm.persistence import KV_FILE, MemoryFileError, load_memory, save_memory
from tests.tmpfs import mounted_tmpfs
from tests.unit_tests.test_persistence_unit import (flip_bit, kill_after, memory_differences, open_memories,
                                                    run_child, siblings, tiny_engine)

from .conftest import SMOL, make_engine, page_mb


def document(words: int = 800, seed: int = 0) -> str:
    """Varied filler sentences with one fact in the middle (what the questions ask about)."""
    rng = random.Random(seed)
    subjects = ["The river", "An old clock", "The harbour master", "A grey cat", "The north road", "The baker",
                "A lantern", "The library", "The orchard", "A fisherman", "The mill", "The choir"]
    verbs = ["waited near", "talked about", "walked past", "remembered", "painted", "ignored", "repaired", "watched"]
    objects = ["the bridge", "the winter market", "a broken cart", "the lighthouse", "the school bell",
               "the apple trees", "a letter from the city", "the evening train", "the stone wall", "a blue boat"]
    sentences = []
    while sum(len(s.split()) for s in sentences) < words:
        sentences.append(f"{rng.choice(subjects)} {rng.choice(verbs)} {rng.choice(objects)}.")
    sentences.insert(len(sentences) // 2, "The secret pass key is 48213. Remember the pass key 48213.")
    return " ".join(sentences)


QUESTION = "\n\nQuestion: What is the secret pass key? Answer: The secret pass key is"


@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread():
    """On this busy 2-core machine two intra-op threads made these small forwards ~10x slower than one (measured:
    the round-trip test took 150 s with 2 threads, 9 s with 1)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def offload(tmp_path_factory):
    return tmp_path_factory.mktemp("offload")


@pytest.fixture(scope="module")
def engine(smol_fast, offload):
    budget = 1.5 * page_mb(smol_fast, 64)  # one 64-token page of SmolLM2 is 1.4 MB in bf16, 2.8 MB in fp32
    return make_engine(smol_fast, "SM", page_tokens=64, ram_budget_mb=budget, offload_dir=str(offload))


@pytest.fixture(scope="module")
def read_memory(engine):
    memory = engine.new_memory()
    engine.read(memory, document())
    tiers = memory.store.tier_tokens()
    assert tiers["disk"] > tiers["ram"] > 0 and memory.num_events > 5  # mostly on disk, with a partial tail
    return memory


@pytest.fixture(scope="module")
def saved(read_memory, engine, tmp_path_factory):
    return save_memory(read_memory, tmp_path_factory.mktemp("saved") / "memory", engine=engine)


def test_loaded_memory_answers_and_continues_exactly(engine, read_memory, saved):
    original = read_memory.fork()
    loaded = load_memory(saved, engine)
    assert memory_differences(original, loaded) == []
    assert loaded.store.tier_tokens()["disk"] > 0  # the loaded pages went to disk past the RAM budget too
    ids = original.token_ids + engine.tokenize(QUESTION)
    a = engine.generate(ids, memory=original, max_new_tokens=6)
    b = engine.generate(ids, memory=loaded, max_new_tokens=6)
    print(f"\nanswer: {a.text!r}; retrieved {len(a.retrieved_events)} events")
    assert a.token_ids == b.token_ids and a.text == b.text
    assert a.retrieved_events == b.retrieved_events and a.retrieved_events
    # Both read more text and a second question: still the same tokens, and the same memory bit for bit.
    more = original.token_ids + engine.tokenize(" " + document(150, seed=1) + QUESTION)
    a = engine.generate(more, memory=original, max_new_tokens=6)
    b = engine.generate(more, memory=loaded, max_new_tokens=6)
    assert a.token_ids == b.token_ids and a.new_input_tokens == b.new_input_tokens > 150
    assert memory_differences(original, loaded) == []


def test_a_memory_of_another_model_is_refused(engine, saved, tmp_path):
    toy = tiny_engine(name="toy")
    with pytest.raises(MemoryFileError, match="saved with model 'smollm2'.*this engine runs 'toy'"):
        load_memory(saved, toy)
    toy_memory = toy.new_memory()
    toy.read(toy_memory, list(range(2, 60)))
    toy_save = save_memory(toy_memory, tmp_path / "toy", engine=toy)
    with pytest.raises(MemoryFileError, match="saved with model 'toy'.*this engine runs 'smollm2'"):
        load_memory(toy_save, engine)


def test_the_same_model_in_another_dtype_is_refused(engine, saved):
    saved_dtype = str(engine.model.dtype).removeprefix("torch.")
    other_dtype = "float32" if saved_dtype == "bfloat16" else "bfloat16"
    other = make_engine(load_model(SMOL, dtype=other_dtype, device="cpu", progress=False), "SM")
    with pytest.raises(MemoryFileError, match=f"dtype: saved '{saved_dtype}', engine '{other_dtype}'"):
        load_memory(saved, other)
    assert open_memories(other) == []


@pytest.mark.parametrize("damage", ["truncated", "bit flip"])
def test_a_damaged_real_save_is_refused(damage, engine, saved, offload, tmp_path):
    path = tmp_path / "copy"
    shutil.copytree(saved, path)
    kv = path / KV_FILE
    if damage == "truncated":
        os.truncate(kv, kv.stat().st_size // 2)
    else:
        flip_bit(kv, kv.stat().st_size * 3 // 4)  # deep inside a page: found only by the checksum, after streaming
    folders = set(os.listdir(offload))
    with pytest.raises(MemoryFileError, match=f"{KV_FILE} is damaged: " + ("truncated" if damage == "truncated"
                                                                         else "its blake2b checksum")):
        load_memory(path, engine)
    assert set(os.listdir(offload)) == folders  # the half-built memory's disk pages were removed


def test_a_save_killed_at_random_moments_leaves_the_old_or_the_new_save(engine, read_memory, tmp_path):
    old = engine.new_memory()
    engine.read(old, document(80, seed=2))
    target = save_memory(old, tmp_path / "m", engine=engine)
    read_end, write_end = os.pipe()

    def timed_save():  # in a forked process, like the runs below; the time only spreads the kill points
        started = time.perf_counter()
        save_memory(read_memory, target, engine=engine)
        os.write(write_end, str(time.perf_counter() - started).encode())

    assert os.WEXITSTATUS(run_child(timed_save)) == 0
    duration = float(os.read(read_end, 100))
    os.close(read_end), os.close(write_end)
    save_memory(old, target, engine=engine)
    rng = random.Random(1)
    delays = sorted(rng.uniform(0, 1.3 * duration) for _ in range(20))
    seen, killed = {"old": 0, "new": 0}, 0
    for delay in delays:
        status = kill_after(lambda: save_memory(read_memory, target, engine=engine), delay)
        killed += os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
        loaded = load_memory(target, engine)
        which = "old" if loaded.total_tokens == old.total_tokens else "new"
        assert memory_differences(old if which == "old" else read_memory, loaded) == []
        assert siblings(target) == []
        loaded.close()
        seen[which] += 1
        if which == "new":
            save_memory(old, target, engine=engine)
    print(f"\n{len(delays)} kill points over {duration * 1000:.0f} ms; {killed} killed mid-save; outcomes {seen}")
    assert sum(seen.values()) == len(delays)


def test_reads_with_disk_offload_killed_at_random_moments_leave_no_folders_and_the_save_answers_alike(
        engine, saved, offload):
    """A read killed mid-way skips every clean-up: its page folder stays until the next store in the same
    offload_dir sees that the process which made it is gone. The save made before is untouched."""
    def answer():
        memory = load_memory(saved, engine)
        try:
            return engine.generate(memory.token_ids + engine.tokenize(QUESTION), memory=memory,
                                   max_new_tokens=6).token_ids
        finally:
            memory.close()

    before = answer()
    read_end, write_end = os.pipe()

    def read(report: bool = False):
        started = time.perf_counter()
        memory = engine.new_memory()
        engine.read(memory, document(seed=3))
        if report:
            os.write(write_end, f"{time.perf_counter() - started} {os.getpid()}".encode())

    assert os.WEXITSTATUS(run_child(lambda: read(report=True))) == 0
    duration = float(os.read(read_end, 100).split()[0])
    os.close(read_end), os.close(write_end)
    rng = random.Random(2)
    delays = sorted(rng.uniform(0, 1.2 * duration) for _ in range(20))
    killed = sum(os.WIFSIGNALED(kill_after(read, delay)) for delay in delays)
    left = [name for name in os.listdir(offload) if name.startswith("emllm-kv-")]
    fresh = engine.new_memory()  # the next store in this offload_dir
    engine.read(fresh, document(seed=4))
    assert fresh.store.tier_tokens()["disk"] > 0
    owners = {name.split("-")[2].split(".")[0] for name in os.listdir(offload) if name.startswith("emllm-kv-")}
    fresh.close()
    print(f"\n{len(delays)} kill points over {duration * 1000:.0f} ms; {killed} killed mid-read; "
          f"{len(left)} page folders before the next store, owners after it: {sorted(owners)}")
    assert killed >= 10  # most kill points fell inside the read
    assert owners <= {str(os.getpid())}  # only this (live) process's folders remain
    assert answer() == before


@pytest.fixture
def small_tmpfs(tmp_path):
    with mounted_tmpfs(tmp_path / "small", "12m") as mount_point:
        yield mount_point


def test_a_full_disk_raises_storage_full_error_and_keeps_the_previous_save(engine, read_memory, small_tmpfs):
    small = engine.new_memory()
    engine.read(small, document(60, seed=3))
    target = save_memory(small, small_tmpfs / "m", engine=engine)
    with pytest.raises(StorageFullError) as error:
        save_memory(read_memory, target, engine=engine)  # ~30 MB (window state and KV) on a 12 MB disk
    assert error.value.errno == 28 and str(target) in str(error.value)
    assert memory_differences(small, load_memory(target, engine)) == []
    assert siblings(target) == []
