"""Many conversations decoding at once: concurrent generations' next-token steps run as one forward.

Decoding a token reads every weight of the model for one row of activations; on a CPU (and on a GPU at small batch)
that read, not the arithmetic, is the cost, so eight rows cost little more than one. Each conversation keeps its own
EpisodicMemory: in the forward's attention (forward.decoding_attention) what reads a row's own memory runs row by row
(its window, its retrieval, the fused kernel) and the rest once for all rows (rotations, merging the parts), while
the projections, MLPs and LM head see all rows at once.

The same tokens alone or together: matmul kernels choose their blocking by the number of rows, so a row's result
can change with the batch it is in (greedy answers of 3 of 8 conversations changed when they shared forwards).
``row_block`` finds, once per model, the row multiple at which every linear layer gives each row the result it
gets in a batch of ``MAX_ROWS``; every decoding forward, a lone conversation's included, is padded to a multiple of
it (padding rows attend to nothing and cost little where reading the weights, not the rows, is the cost). Off the
CPU every forward is padded to ``MAX_ROWS`` itself: GPU GEMMs are chosen by row count, so only one shape is trusted
(row_block). Where no multiple exists, or where padding is not cheap on this CPU (padding_is_cheap: float32 on an
AVX2-only CPU, whose small-row GEMMs cost 3x a one-row forward), each conversation decodes in its own forward.

Who gets batched: every generation of one engine in its decoding loop, whichever thread runs it (MemoryPool callers,
LangChain's batch/abatch, a web server's request threads). A thread that wants a step queues it; the first thread
free to run takes every queued step and runs them together, as a group commit does, so no scheduler thread exists
and a lone generation runs its steps at once. Answers do not depend on who shares a step: each row's computation is
its own (greedy decoding gives the tokens one-at-a-time decoding gives; tests/integration_tests/test_batching.py).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import threading
import time
from collections.abc import Callable, Generator, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import PreTrainedModel

from .attention import decoder_layers

MAX_ROWS = 8
"""Most conversations one forward decodes; more wait for the next forward. Eight rows of a 0.5B model still cost
about what one costs on a CPU; the row-floor probe is checked for every count up to this one."""

GATHER_SECONDS = 0.05
"""How long a step waits for other decoding generations to queue theirs before running without them: long enough
for eight threads to sample and detokenize their last token (a few ms each, one at a time under the GIL), short
next to a step (100-500 ms on a CPU)."""

SHORT_READ_TOKENS = 512
"""Reads of at most this many tokens (a follow-up question with the answer before it: one chunk) go before decoding
steps, as a server's prefills go before its decodes: a step waits for them (READ_PRIORITY_SECONDS at most), so
the conversations that were reading join the next step instead of running beside it. Longer reads (a document)
run beside the steps, which must not stall for their minutes."""

READ_PRIORITY_SECONDS = 1.0
"""Most a decoding step waits for short reads in progress: with reads arriving without end, decoding still makes a
step a second. Measured on the 2-core AMD (benchmarks/serve.py --concurrent 8): eight follow-up questions of ~70
tokens read at once take ~2.5 s; with a bound of 0.5 s the first to finish began decoding 0.6 s before the last,
in steps of fewer rows that slowed the reads still running."""


@dataclass
class Generation:
    """One generation inside StepBatcher.decoding(); ``suspended_since`` is set while its caller holds its last text
    delta (StepBatcher.relay): a stream nobody reads takes no steps, and must not hold the others' forwards."""
    suspended_since: float | None = None


@dataclass
class _Step:
    memory: Any
    token: int
    queued: float = field(default_factory=time.perf_counter)
    done: bool = False
    error: BaseException | None = None


class StepBatcher:
    """Runs the queued decoding steps of concurrent generations together through ``run(memories, tokens)``, which
    returns each row's error (or None): a step raises in its own thread only what its own row raised."""

    def __init__(self, run: Callable[[list[Any], list[int]], Sequence[BaseException | None] | None],
                 max_rows: int = MAX_ROWS,
                 gather_seconds: float = GATHER_SECONDS):
        self._run = run
        self._gather = gather_seconds
        self._cond = threading.Condition()
        self._pending: list[_Step] = []
        self._generations: list[Generation] = []  # inside decoding(): whose steps a batch waits for
        self._running = False
        self._short_reads = 0  # reads of at most SHORT_READ_TOKENS in progress (StepBatcher.reading)
        self._last_end = 0.0
        self.max_rows = max_rows
        self.batch_sizes: list[int] = []  # rows of each forward run, for benchmarks (kept short)

    @contextlib.contextmanager
    def decoding(self) -> Iterator[Generation]:
        """Marks a generation as decoding, so steps run while it is inside wait (a little) for its next step."""
        generation = Generation()
        with self._cond:
            self._generations.append(generation)
        try:
            yield generation
        finally:
            with self._cond:
                self._generations.remove(generation)
                self._cond.notify_all()
            release_thread_workers()  # this thread is done with torch for now (see release_thread_workers)

    @contextlib.contextmanager
    def reading(self, tokens: int) -> Iterator[None]:
        """Marks a read of ``tokens`` in progress (EMEngine.read): while a short one runs (SHORT_READ_TOKENS),
        decoding steps wait for it, up to READ_PRIORITY_SECONDS."""
        if tokens > SHORT_READ_TOKENS:
            yield
            return
        with self._cond:
            self._short_reads += 1
        try:
            yield
        finally:
            with self._cond:
                self._short_reads -= 1
                self._cond.notify_all()

    def relay(self, generation: Generation, deltas: Generator[str, None, Any]) -> Generator[str, None, Any]:
        """``deltas`` yielded on, the generation marked suspended while its caller holds each one; returns what
        ``deltas`` returns. A caller that stops reading for longer than the gather window is no longer waited for
        (a stream held open must not slow every other conversation's steps); it is again from its next step."""
        try:
            while True:
                try:
                    delta = next(deltas)
                except StopIteration as end:
                    return end.value
                generation.suspended_since = time.perf_counter()
                try:
                    yield delta
                finally:
                    generation.suspended_since = None
        finally:
            deltas.close()

    @property
    def _decoding(self) -> int:
        """Generations whose next step a batch waits for: those decoding, less those whose caller has held a delta
        for longer than the gather window (read under the lock)."""
        now = time.perf_counter()
        return sum(1 for g in self._generations
                   if g.suspended_since is None or now - g.suspended_since < self._gather)

    def step(self, memory: Any, token: int) -> None:
        """Feed ``token`` to ``memory`` (its logits land in memory.last_logits), with whatever steps other threads
        have queued; returns once this step has run, raising what the forward raised."""
        if self._decoding > 1:  # others decode: this thread may only wait, and its idle workers would slow the batch
            release_thread_workers()
        mine = _Step(memory, token)
        with self._cond:
            self._pending.append(mine)
            self._cond.notify_all()
            while not mine.done:
                wait = self._wait_before_running()
                if wait is None:
                    self._run_pending()
                else:
                    self._cond.wait(timeout=wait)
        if mine.error is not None:
            raise mine.error

    def _wait_before_running(self) -> float | None:
        """None: run the queue now; else seconds to wait (a batch is running, or others may still queue)."""
        if self._running or not self._pending:
            return 1.0  # woken when the running batch ends
        # Counted from the last batch's end too: steps queued while a batch ran must wait for that batch's rows to
        # sample their next token, or the two groups would alternate for ever, each half the size it could be.
        waited = time.perf_counter() - max(self._pending[0].queued, self._last_end)
        if self._short_reads and waited < READ_PRIORITY_SECONDS:  # woken when a read ends
            return READ_PRIORITY_SECONDS - waited
        if len(self._pending) >= min(self._decoding, self.max_rows) or waited >= self._gather:
            return None
        return self._gather - waited

    def _run_pending(self) -> None:
        """Run every queued step as one batch, outside the lock (other threads queue meanwhile); called locked."""
        batch, self._pending = self._pending[:self.max_rows], self._pending[self.max_rows:]
        self._running = True
        self._cond.release()
        errors: Sequence[BaseException | None] = [None] * len(batch)
        try:
            errors = self._run([s.memory for s in batch], [s.token for s in batch]) or errors  # each row's own
        except BaseException as raised:  # the forward itself failed: every row fails, each in its own thread
            errors = [raised] * len(batch)
        finally:
            self._cond.acquire()
            self._running, self._last_end = False, time.perf_counter()
            self.batch_sizes = (self.batch_sizes + [len(batch)])[-4096:]
            for queued, error in zip(batch, errors):
                queued.done, queued.error = True, error
            self._cond.notify_all()


def row_block(model: PreTrainedModel, most: int = MAX_ROWS) -> int | None:
    """The row multiple from which the model's linear layers give every row the same result whatever the batch:
    decoding forwards padded to a multiple of it (up to ``most`` rows) give a row what it would get alone. None
    where no such multiple exists up to ``most``; ``most`` itself off the CPU (one shape for every forward).

    On the CPU, probed once with random inputs of each layer's own shape, dtype and device, in inference mode as
    decoding runs them (the kernel is chosen by shape, not values; one decoder layer stands for all). Measured on this
    project's CPU: float32 computes rows in blocks of 4 (a batch of 4 or 8 agrees with itself, 5 does not), bfloat16
    agrees from 2 rows on. One row in 16-bit weights is never trusted: a single row takes a matrix-vector kernel whose
    rounding differs from the matrix kernels' only near a bf16 rounding boundary (1 element in 896 on a real
    activation, none in the probe's random ones), so a probe cannot see it, yet it changed greedy answers."""
    linears = decoding_linears(model)
    if linears[-1].weight.device.type != "cpu":
        # Off the CPU every decoding forward has ``most`` rows. Measured on an H200 (Llama-3.1-8B shape, bf16): the
        # probe found a block of 2, yet 4 of 8 conversations decoded together got other greedy tokens than alone:
        # cuBLAS picks its GEMM (and its split of the reduction) by the row count, and bf16 outputs hide that from
        # a probe. At one fixed shape the kernel is one, and a row's result is a function of that row alone; a
        # decoding step reads the weights, not the rows, so eight rows cost a lone conversation next to nothing.
        return most
    low_precision = linears[-1].weight.element_size() < 4
    generator = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        probes = []
        for linear in linears:
            weight = linear.weight
            x = torch.randn(most, 1, weight.shape[1], generator=generator).to(weight.device, weight.dtype)
            probes.append((linear, x, linear(x)))                             # full: [most, 1, out]
        for block in (1, 2, 4, 8):
            if block > most or (block == 1 and low_precision):
                continue
            if all(torch.equal(linear(x[:rows]), full[:rows])
                   for linear, x, full in probes for rows in range(block, most, block)):
                return block
    return None


def decoding_linears(model: PreTrainedModel) -> list[torch.nn.Linear]:
    """One decoder layer's linear layers and the LM head: what a decoding step's cost and rounding depend on (every
    decoder layer has the same shapes, so one stands for all)."""
    linears = [m for m in decoder_layers(model)[0].modules() if isinstance(m, torch.nn.Linear)]
    return [*linears, model.get_output_embeddings()]


def padding_is_cheap(linears: Sequence[torch.nn.Linear], block: int, extra: float = 1.0, repeats: int = 3) -> bool:
    """Whether ``block`` rows through ``linears`` (a model's decoding_linears) cost at most ``extra`` more than a
    single row on this CPU, timed once (best of ``repeats``). A lone conversation, the common case, pays for
    padding to the row block on every token, so padding is worth it only if it is cheap. Measured on an AVX2-only
    CPU in float32 (Qwen2.5-Coder-0.5B): a 4-row step's linears took 363 ms and a one-row step's 120 ms (small-row
    GEMMs pack the weights, the one-row kernel streams them; the LM head alone 135 vs 42 ms), so a lone
    conversation decoded 3x slower padded and four together gained only 1.3x. Always one row is as batch-invariant
    as always a block: each row's result is then a function of that row alone. ``extra`` is wide of both sides
    (3-12x measured there; 1.1-1.4x for eight bf16 rows on Intel AMX, docs/notes/batching.md) so that processes on
    one machine decide alike, and so answer alike."""
    if block <= 1:
        return True
    generator = torch.Generator().manual_seed(0)

    def best_seconds(rows: int) -> float:
        inputs = [torch.randn(rows, 1, linear.in_features, generator=generator).to(linear.weight.dtype)
                  for linear in linears]
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            for linear, x in zip(linears, inputs):
                linear(x)
            times.append(time.perf_counter() - start)
        return min(times)

    with torch.inference_mode():
        best_seconds(block)  # the first call of a shape sets up its kernel
        return best_seconds(block) <= (1 + extra) * best_seconds(1)


def decoding_block(model: PreTrainedModel) -> int | None:
    """The row count decoding forwards are padded to a multiple of (row_block), or None where there is none or
    where, on the CPU, padding to it is not cheap (padding_is_cheap): conversations then decode one forward each."""
    block = row_block(model)
    linears = decoding_linears(model)
    if block and linears[-1].weight.device.type == "cpu" and not padding_is_cheap(linears, block):
        return None
    return block


@functools.cache
def libgomp_pause() -> Callable[[int], int] | None:
    """libgomp's omp_pause_resource_all, if the OpenMP runtime torch loaded is libgomp (Linux wheels); else None."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "libgomp" in line and line.rstrip().endswith(".so.1")}
    except OSError:
        return None
    for path in sorted(paths):
        pause = getattr(ctypes.CDLL(path), "omp_pause_resource_all", None)
        if pause is not None:
            pause.argtypes, pause.restype = [ctypes.c_int], ctypes.c_int
            return pause
    return None


def release_thread_workers() -> None:
    """Let this thread's idle OpenMP workers go (libgomp; elsewhere nothing happens); its next parallel torch op
    starts new ones (tens of microseconds).

    Why: every thread that runs a parallel torch op keeps its own OpenMP worker pool, and once the pools hold more
    threads than the machine has cores, libgomp makes every worker stop spinning after 100 tries and sleep, so each
    parallel op pays a futex wake-up. On the 2-core CPU a batched decoding step run by one of 8 generating threads
    took ~270 ms where the same step in a process with one pool took ~190 ms (matmul and attention 30% slower), which
    held 8 conversations at 2.7x one conversation's tokens/s. So a generation releases its thread's pool before it
    waits on others' steps and when it ends, as do a read, a fork and the engine's load: while a batch runs, only
    its leader's pool is alive. Numerics do not change (the thread count stays torch's)."""
    pause = libgomp_pause()
    if pause is not None:
        pause(1)  # omp_pause_soft: the calling thread's pool only (its workers exit; the runtime stays initialised)
