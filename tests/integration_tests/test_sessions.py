"""Forked memories and the MemoryPool on the real model: a fork reads exactly like a memory that read everything
itself, never disturbs its parent, survives it; the pool reuses what was read and keeps conversations apart."""

from __future__ import annotations

import os
import threading

import pytest
import torch

from emllm import EMConfig, MemoryPool, shared_engine
from emllm.sessions import loaded_engines
from emllm_integrations.bench.tasks import passkey_document

from .conftest import SMALL, SMOL, make_engine, page_mb

# Small pages (128 tokens, ~2.9 MB in bf16, 5.6 MB in fp32) and a RAM budget of two and a half pages: of the ~900
# tokens a 1,500-token document evicts, most pages go to disk, so sharing disk files between forks is tested.
PAGE_TOKENS = 128


@pytest.fixture(scope="module")
def engine(smol_fast):
    return make_engine(smol_fast, "S", page_tokens=PAGE_TOKENS, ram_budget_mb=2.5 * page_mb(smol_fast, PAGE_TOKENS))


@pytest.fixture(scope="module")
def document(engine):
    doc = passkey_document(1500, 0.4, engine.count_tokens, seed=3)
    return doc, engine.tokenize(doc.prompt)


@pytest.fixture(scope="module")
def reference(engine, document):
    """The answer of a fresh memory that read the whole document: what every fork and pool must reproduce."""
    return engine.generate(document[1], memory=engine.new_memory(), max_new_tokens=8)


def test_fork_reads_like_a_memory_that_read_everything(engine, document, reference):
    doc, ids = document
    assert doc.answer in reference.text

    parent = engine.new_memory()
    engine.read(parent, ids[:-40])
    assert parent.store.tier_tokens()["disk"] > 0, "the test needs pages on disk to check they are shared"
    child = parent.fork()
    result = engine.generate(ids, memory=child, max_new_tokens=8)
    assert result.new_input_tokens == 40
    assert result.token_ids == reference.token_ids


def test_fork_never_changes_its_parent(engine, document, reference):
    _, ids = document
    parent = engine.new_memory()
    engine.read(parent, ids[:-40])
    tokens_before = list(parent.token_ids)
    window_before = parent.layers[3].window_keys().clone()
    child = parent.fork()
    engine.read(child, ids[-40:])
    engine.read(child, engine.tokenize(" The grass is green." * 60))  # evicts more events in the child only
    assert child.num_events > parent.num_events
    assert parent.token_ids == tokens_before
    assert torch.equal(parent.layers[3].window_keys(), window_before)
    # The parent still answers exactly as a fresh memory does.
    assert engine.generate(ids, memory=parent, max_new_tokens=8).token_ids == reference.token_ids


def test_fork_outlives_its_parent_and_cleans_up_after_both(engine, document, reference):
    doc, ids = document
    parent = engine.new_memory()
    engine.read(parent, ids[:-40])
    folder = parent.store.disk_dir
    assert folder is not None and os.listdir(folder)
    child = parent.fork()
    parent.close()
    assert os.path.isdir(folder), "the fork still reads pages from the parent's folder"
    assert engine.generate(ids, memory=child, max_new_tokens=8).token_ids == reference.token_ids
    child.close()
    assert not os.path.exists(folder)


def test_pool_reads_only_what_a_call_adds(engine, document, reference):
    doc, ids = document
    pool = MemoryPool(engine, engine.config)
    try:
        assert pool.read(ids[:-40]) == len(ids) - 40
        first = pool.generate(ids, max_new_tokens=8)
        assert first.new_input_tokens == 40 and first.token_ids == reference.token_ids
        assert pool.generate(ids, max_new_tokens=8).new_input_tokens == 0
        # A follow-up that extends prompt + answer continues the generating memory.
        question = engine.tokenize(" Once more: the pass key is")
        follow = pool.generate(ids + first.token_ids[:-1] + question, max_new_tokens=8)
        assert follow.new_input_tokens <= len(question) + 1
        assert doc.answer in follow.text
        # Anything that does not extend a checkpoint starts from scratch rather than mixing.
        other = engine.tokenize("A different conversation entirely.")
        assert pool.generate(other, max_new_tokens=4).new_input_tokens == len(other)
    finally:
        pool.close()


def test_pool_keeps_concurrent_conversations_apart(engine):
    docs = [passkey_document(1500, depth, engine.count_tokens, seed=seed)
            for depth, seed in [(0.2, 1), (0.5, 2), (0.7, 3), (0.4, 4)]]
    assert len({d.answer for d in docs}) == len(docs)
    config = EMConfig.from_preset("S", **SMALL)
    # What each conversation answers alone is the reference: a mixed memory would change the tokens.
    alone = [engine.generate(d.prompt, memory=engine.new_memory(config), max_new_tokens=8) for d in docs]
    pool = MemoryPool(engine, config)
    answers: dict[int, str] = {}
    errors: list[BaseException] = []

    def ask(i: int) -> None:
        try:
            answers[i] = pool.generate(docs[i].prompt, max_new_tokens=8).text
        except BaseException as error:  # re-raised below with the thread's traceback
            errors.append(error)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(docs))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    pool.close()
    assert not errors, errors
    assert [answers[i] for i in range(len(docs))] == [r.text for r in alone]
    assert sum(doc.answer in r.text for doc, r in zip(docs, alone)) >= 3, "most hidden keys should be found"


def test_shared_engine_loads_a_model_once():
    first = shared_engine(SMOL, dtype="bfloat16", progress=False)
    count = loaded_engines()
    assert shared_engine(SMOL, dtype="bfloat16", progress=False) is first
    assert shared_engine("smollm2-135m-instruct", dtype="bfloat16", progress=False) is first  # its canonical name
    assert loaded_engines() == count
