"""Running the bench: every (method, length) cell, by default each in its own process (``run_bench``), and one
cell in this process (``run_cell``), a row per question."""

from __future__ import annotations

import inspect
import json
import math
import os
import pathlib
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Generator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, replace
from typing import Any

from tqdm.auto import tqdm

from ..prompts import chat_context, chat_frame, format_context
from .items import TaskItem, task_items
from .measure import peak_rss_mb, read_each
from .ruler import score
from .settings import (DEFAULT_DEPTHS, DEFAULT_LENGTHS, DEFAULT_METHODS, DEFAULT_QUESTIONS, FULL_MAX_TOKENS,
                       LIST_ANSWER_TOKENS, RAG_METHODS, REREAD_METHODS, ROW_FIELDS, RULER_TASKS, TASKS, BenchSettings,
                       check_depths, check_lengths, check_methods, check_names, check_requirements, config_overrides,
                       finished_tasks)
from .tasks import probe_suffix

_MESSAGE = "@@emllm-bench "  # marks the child's result lines on stdout (libraries may print there too)


def run_bench(tasks: Sequence[str] = RULER_TASKS, methods: Sequence[str] = DEFAULT_METHODS,
              lengths: Sequence[int] = DEFAULT_LENGTHS, depths: Sequence[float] = DEFAULT_DEPTHS, *,
              model: str | None = None, dtype: str = "auto", seed: int = 0, max_new_tokens: int | None = None,
              engine_fields: dict[str, Any] | None = None, full_max_tokens: int = FULL_MAX_TOKENS,
              isolate: bool = True, threads: int | None = None, progress: bool = True,
              questions: int = DEFAULT_QUESTIONS, concurrent: int = 1, done: Sequence[dict[str, Any]] = (),
              on_cell: Callable[[list[dict[str, Any]]], object] | None = None) -> list[dict[str, Any]]:
    """Run every task x method x length x depth (x question) and return one row per question (keys ROW_FIELDS).

    ``engine_fields`` (e.g. ``n_local=1024, n_mem=1024``, or ``ram_budget_mb``/``offload_dir`` for inputs that do
    not fit in RAM) apply to the EM-LLM methods; ``full`` and RAG's LLM use plain full attention. ``full`` cells
    longer than ``full_max_tokens`` are skipped (said on stderr). Every input is checked, and every extra the run
    needs is looked for, before any model is loaded: a long run does not fail at its end for a missing package.
    A cell that fails gives rows with ``error`` set and ``correct`` False rather than ending the run.

    A table of many hours is built in pieces: ``done`` takes the rows of earlier runs with the same settings (see
    ``load_done``); a task of a (method, length) cell whose every depth was answered without error there is not run
    again, and its rows lead the returned ones. ``on_cell`` gets every row so far after each cell, e.g. to write
    the report as the run goes, so a run stopped after hours keeps what it measured. Earlier rows of cells this run
    does not ask for are kept too: the table grows run by run.

    ``concurrent`` questions of one document are answered at once (EM-LLM: each from its own fork of the read
    memory; RAG: each with its own chunks), their decoding steps sharing forwards (emllm.batching): the same answers
    as one at a time, several times the questions per hour on a CPU. Their times are then shared ones, so cost
    tables are measured with 1 (the default).
    """
    tasks, methods = check_names("task", tasks, TASKS), check_methods(methods)
    lengths, depths = check_lengths(lengths), check_depths(depths)
    if max_new_tokens is not None and (isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int)
                                       or max_new_tokens < 1):
        raise ValueError(f"max_new_tokens must be a positive integer (or None for the answer's length + 16, lists "
                         f"128), got {max_new_tokens!r}.")
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
        raise ValueError(f"threads must be a positive integer (or None for torch's default), got {threads!r}.")
    if isinstance(questions, bool) or not isinstance(questions, int) or questions < 1:
        raise ValueError(f"questions (per RULER document) must be a positive integer, e.g. 20, got {questions!r}.")
    if isinstance(concurrent, bool) or not isinstance(concurrent, int) or concurrent < 1:
        raise ValueError(f"concurrent (questions answered at once) must be a positive integer, e.g. 8, got "
                         f"{concurrent!r}.")
    settings = BenchSettings(tuple(tasks), tuple(depths), model, dtype, seed, max_new_tokens,
                             dict(engine_fields or {}), threads=threads, questions=questions, concurrent=concurrent)
    check_requirements(tasks, methods)
    if engine_fields:
        from emllm import EMConfig
        from emllm.config import DEFAULT_PRESET

        # a misspelt or impossible field fails now, not in every cell
        EMConfig.from_preset(DEFAULT_PRESET, **config_overrides(engine_fields))

    cells = []
    for length in lengths:
        for method in methods:
            if method == "full" and length > full_max_tokens:
                print(f"skipping full attention at {length:,} tokens (quadratic; over full_max_tokens="
                      f"{full_max_tokens:,}: raise it to run this cell)", file=sys.stderr)
                continue
            cells.append((method, length))
    finished = finished_tasks(done, settings)
    todo = [(method, length, [t for t in tasks if (t, method, length) not in finished]) for method, length in cells]
    todo = [(method, length, cell_tasks) for method, length, cell_tasks in todo if cell_tasks]
    rerun = {(task, method, length) for method, length, cell_tasks in todo for task in cell_tasks}
    rows: list[dict[str, Any]] = [dict(r) for r in done if (r["task"], r["method"], r["length"]) not in rerun]
    if len(todo) < len(cells):
        print(f"resuming: {len(cells) - len(todo)} of {len(cells)} (method, length) cells were already measured, "
              f"{len(rows)} rows kept", file=sys.stderr)
    with tqdm(total=sum(settings.questions_per_cell(t) for *_, cell_tasks in todo for t in cell_tasks),
              desc="bench", unit="question",
              disable=not progress, dynamic_ncols=True) as bar:
        for method, length, cell_tasks in todo:
            bar.set_postfix(method=method, tokens=length, refresh=True)
            cell_settings = replace(settings, tasks=tuple(cell_tasks))

            def emit(row: dict[str, Any]) -> None:
                rows.append(row)
                bar.update(1)
                if progress:
                    verdict = "ERROR" if row["error"] else ("correct" if row["correct"] else "wrong")
                    tqdm.write(f"{row['method']:>10} {row['task']:>8} {row['tokens'] or row['length']:>8,} tokens "
                               f"depth {row['depth']:.2f}: {verdict} ({(row['error'] or row['output'])[:60]!r})",
                               file=sys.stderr)

            start = len(rows)
            if isolate:
                peak = _run_cell_in_subprocess(method, length, cell_settings, emit)
            else:
                peak = run_cell(method, length, cell_settings, emit)
            if isinstance(peak, float):  # the cell's final peak, for every row it answered
                for row in rows[start:]:
                    if not row["error"]:
                        row["peak_rss_mb"] = peak
            per_cell = sum(settings.questions_per_cell(task) for task in cell_tasks)
            missing = per_cell - (len(rows) - start)
            if missing > 0:  # the cell's process died before answering everything (e.g. killed for memory)
                reason = getattr(peak, "error", None) or "the cell ended before answering these questions"
                for task, depth in _expected_keys(cell_settings)[per_cell - missing:]:
                    emit(_error_row(task, method, length, depth, reason))
            if on_cell is not None:
                on_cell(list(rows))
    return rows


# ---------------------------------------------------------------------------------------------- one cell
def run_cell(method: str, length: int, settings: BenchSettings, emit: Callable[[dict[str, Any]], None]) -> float:
    """Run every task and depth of one (method, length) cell in this process, calling ``emit`` with each row as it
    is answered; returns this process's peak RSS in MB. The model loads once per cell."""
    import torch

    if settings.threads:
        torch.set_num_threads(settings.threads)
    from emllm import EMEngine

    if method in RAG_METHODS:
        engine = EMEngine.from_pretrained(settings.model, preset="full", dtype=settings.dtype, progress=False)
    else:
        fields = {} if method == "full" else config_overrides(settings.engine_fields)
        engine = EMEngine.from_pretrained(settings.model, preset=REREAD_METHODS.get(method, method),
                                          dtype=settings.dtype, progress=False,
                                          **fields)
    engine.generate("Warm up: the first forward pass of a process is slower.", max_new_tokens=2)  # not timed
    rag_warm = False
    for task in settings.tasks:
        try:
            items = task_items(task, length, settings, engine.count_tokens)
        except Exception as error:  # e.g. multidoc depths that fall on one document at this length
            for depth in settings.depths:
                emit(_error_row(task, method, length, depth, _describe(error)))
            continue
        if method not in RAG_METHODS:
            _answer_engine(items, method, length, engine, settings, emit)
            continue
        for item in items:
            answered = []  # the rows this item got before any failure

            def emit_answer(row: dict[str, Any]) -> None:
                answered.append(row)  # noqa: B023  (called only within this iteration, by _answer_rag below)
                emit(row)

            try:
                if not rag_warm:
                    _warm_rag(RAG_METHODS[method][0], engine, settings)
                    rag_warm = True
                _answer_rag(item, method, length, engine, settings, emit_answer)
            except Exception as error:  # one failed document must not end the whole run
                _emit_unanswered(item, len(answered), _describe(error), method, length, emit)
    return peak_rss_mb()


def context_ids(engine: Any, item: TaskItem) -> list[int]:
    """What is read once: the documents (a probe), or the chat turn up to the document's end (a RULER task). Public
    so that a diagnostic script (benchmarks/event_ranking.py) reads a task's context exactly as the bench does."""
    if item.questions[0][3]:
        return engine.tokenize(format_context(list(item.documents)))
    return chat_frame(engine, item.questions[0][0])[0] + engine.tokenize(chat_context(list(item.documents)))


def _question_ids(engine: Any, item: TaskItem, question: str, lead: str) -> list[int]:
    """What follows the context for one question: the probe's question and answer lead-in, or the rest of the chat
    turn (the question, the end of the turn, the assistant's header)."""
    if lead:
        return engine.tokenize(probe_suffix(question, lead))
    return chat_frame(engine, question)[1]


def _answer_engine(items: Sequence[TaskItem], method: str, length: int, engine: Any, settings: BenchSettings,
                   emit: Callable[[dict[str, Any]], None]) -> None:
    """Answer every item's questions, each document read once (read_each shares the reading of documents that
    begin alike, as one haystack with needles at several depths does, and times each as if read alone)."""
    contexts = [context_ids(engine, item) for item in items]
    reads = read_each(engine, contexts)
    for index, (item, context) in enumerate(zip(items, contexts)):
        answered = 0
        try:
            memory, prefill = next(reads)
            answers = _ask_all(engine, memory, item, context, settings, reread=method in REREAD_METHODS)
            try:
                event_size = memory.stats()["mean_event_size"] if method != "full" else None
                for (question, expected, depth, _), (ids, result) in zip(item.questions, answers):
                    emit(answer_row(item.task, method, length, len(ids), depth, question, expected, result.text,
                                    prefill, result.prefill_seconds, result.decode_seconds, result.output_tokens,
                                    result.new_input_tokens, event_size))
                    answered += 1
            finally:
                answers.close()  # questions still running end before their memory closes
                memory.close()
        except Exception as error:  # one failed document (say, a disk budget) must not end the whole run
            _emit_unanswered(item, answered, _describe(error), method, length, emit)
            reads.close()
            reads = read_each(engine, contexts[index + 1:])  # the shared reading broke off: start afresh


def _ask_all(engine: Any, memory: Any, item: TaskItem, context: list[int], settings: BenchSettings,
             reread: bool = False) -> Generator[tuple[list[int], Any], None, None]:
    """(prompt ids, generation) for each of the item's questions, in order, each continuing from the memory that
    read the context: a fork of it when more questions follow (the answer's tokens would otherwise be read into it
    and the next prompt would not extend it). ``reread``: answered from the retrieval re-read as text (emllm.reread)."""
    forking = threading.Lock()  # one fork at a time: a fork reads its parent's whole state

    def ask(question: tuple[str, str, float, str]) -> tuple[list[int], Any]:
        text, expected, _, lead = question
        with forking:
            asking = memory.fork() if len(item.questions) > 1 else memory
        try:
            ids = context + _question_ids(engine, item, text, lead)
            budget = max_new_tokens_for(settings, engine, expected)
            return ids, engine.generate(ids, memory=asking, max_new_tokens=budget, reread=reread)
        finally:
            if asking is not memory:
                asking.close()

    return _in_order(ask, item.questions, settings.concurrent)


def _in_order(ask: Callable[[Any], Any], questions: Sequence[Any], concurrent: int) -> Generator[Any, None, None]:
    """ask(question) for each question, yielded in order. With ``concurrent`` > 1 that many run at once in threads,
    whose decoding steps the engine batches into shared forwards (emllm.batching); an error ends the iteration,
    and closing it returns once the questions already begun have ended (those not begun never start)."""
    if concurrent == 1 or len(questions) == 1:
        yield from map(ask, questions)
        return
    with ThreadPoolExecutor(max_workers=concurrent, thread_name_prefix="bench-question") as pool:
        futures = [pool.submit(ask, question) for question in questions]
        try:
            for future in futures:
                yield future.result()
        finally:
            for future in futures:
                future.cancel()


def _emit_unanswered(item: TaskItem, answered: int, reason: str, method: str, length: int,
                     emit: Callable[[dict[str, Any]], None]) -> None:
    for question, answer, depth, _ in item.questions[answered:]:
        emit(_error_row(item.task, method, length, depth, reason or "not answered", question, answer))


def _warm_rag(embedding: str, engine: Any, settings: BenchSettings) -> None:
    from ..rag import RAGBaseline, encode

    rag = RAGBaseline(embedding, llm_model=settings.model, engine=engine, dtype=settings.dtype)  # loads the model
    encode(rag.model, ["Warm up: the first embedding of a process is slower."])


def _answer_rag(item: TaskItem, method: str, length: int, engine: Any, settings: BenchSettings,
                emit: Callable[[dict[str, Any]], None]) -> int:
    from ..rag import RAGBaseline

    # A fresh index per document set (the embedding model itself is loaded once per process and shared).
    embedding, recipe = RAG_METHODS[method]
    rag = RAGBaseline.from_recipe(recipe, embedding, llm_model=settings.model, engine=engine, dtype=settings.dtype)
    started = time.perf_counter()
    rag.add_documents(list(item.documents))
    prefill = time.perf_counter() - started
    tokens = len(engine.tokenize(format_context(list(item.documents))))

    def ask(question: tuple[str, str, float, str]) -> Any:
        text, expected, _, lead = question
        suffix = probe_suffix(text, lead) if lead else None
        return rag.answer(text, max_new_tokens_for(settings, engine, expected), suffix=suffix, chat=not lead)

    answered = 0
    answers = _in_order(ask, item.questions, settings.concurrent)
    try:
        for (question, expected, depth, lead), answer in zip(item.questions, answers):
            asked = tokens + len(_question_ids(engine, item, question, lead))
            emit(answer_row(item.task, method, length, asked, depth, question,
                            expected, answer.text, prefill, answer.retrieve_seconds + answer.prefill_seconds,
                            answer.decode_seconds, answer.output_tokens, answer.input_tokens, None))
            answered += 1
    finally:
        answers.close()
    return answered


# ---------------------------------------------------------------------------------------------- subprocess cells
def _run_cell_in_subprocess(method: str, length: int, settings: BenchSettings,
                            emit: Callable[[dict[str, Any]], None]) -> float | _CellFailure:
    """Run one cell in a fresh Python process so that its peak RSS is its own; rows stream back line by line (for
    the progress bar). Returns the cell's peak RSS in MB, or a _CellFailure saying why the process failed."""
    spec = json.dumps({"method": method, "length": length, "settings": asdict(settings)})
    with tempfile.TemporaryFile("w+", encoding="utf-8", errors="replace") as stderr:
        # stderr goes to a file, not a pipe: a child that writes a lot there while we read stdout cannot block.
        child = subprocess.Popen([sys.executable, "-m", "emllm_integrations.bench", "--child"], stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, stderr=stderr, text=True, env=_child_env())
        assert child.stdin is not None and child.stdout is not None
        child.stdin.write(spec)
        child.stdin.close()
        peak = None
        for line in child.stdout:
            if not line.startswith(_MESSAGE):
                continue
            message = json.loads(line[len(_MESSAGE):])
            if "row" in message:
                emit(message["row"])
            elif "peak_rss_mb" in message:
                peak = float(message["peak_rss_mb"])
        code = child.wait()
        if code == 0 and peak is not None:
            return peak
        stderr.seek(0)
        tail = [line for line in stderr.read().strip().splitlines() if line.strip()][-1:]
        return _CellFailure(f"the cell's process exited with code {code}: {tail[0] if tail else 'no message'}")


@dataclass(frozen=True)
class _CellFailure:
    error: str


def _child_env() -> dict[str, str]:
    """The child imports the same emllm and emllm_integrations as this process, wherever they came from."""
    import emllm
    import emllm_integrations

    roots = [str(pathlib.Path(inspect.getfile(package)).resolve().parents[1])
             for package in (emllm, emllm_integrations)]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(roots + [p for p in env.get("PYTHONPATH", "").split(os.pathsep)
                                                              if p]))
    env.setdefault("HF_HUB_OFFLINE", "1")  # never reach for a model hub from a benchmark
    return env


def child_main() -> int:
    """The cell process (python -m emllm_integrations.bench --child): its spec on stdin, its rows on stdout."""
    spec = json.loads(sys.stdin.read())
    settings = BenchSettings(**{**spec["settings"], "tasks": tuple(spec["settings"]["tasks"]),
                                "depths": tuple(spec["settings"]["depths"])})

    def emit(row: dict[str, Any]) -> None:
        print(_MESSAGE + json.dumps({"row": row}), flush=True)

    peak = run_cell(spec["method"], spec["length"], settings, emit)
    print(_MESSAGE + json.dumps({"peak_rss_mb": peak}), flush=True)
    return 0


# ---------------------------------------------------------------------------------------------- rows and checks
def answer_row(task: str, method: str, length: int, tokens: int, depth: float, question: str,
               expected: str | tuple[str, ...], output: str, prefill: float, query: float, decode: float,
               output_tokens: int, tokens_read: int, event_size: float | None) -> dict[str, Any]:
    """One answered question's row (ROW_FIELDS): the output scored against every expected answer (RULER's string
    match; right only with all of a list's items) and the measurements. Public so that the unit tests check a row's
    scoring without a model."""
    answers = (expected,) if isinstance(expected, str) else tuple(expected)
    found = score(output, answers)
    return {"task": task, "method": method, "length": length, "tokens": tokens, "depth": depth,
            "question": question, "expected": "; ".join(answers), "output": output.strip(), "correct": found == 1.0,
            "score": found,
            "prefill_seconds": prefill, "query_seconds": query,
            "decode_ms_per_token": 1000 * decode / max(output_tokens, 1), "output_tokens": output_tokens,
            "tokens_read": tokens_read, "peak_rss_mb": peak_rss_mb(),
            "mean_event_size": None if event_size is None or math.isnan(event_size) else event_size, "error": None}


def _error_row(task: str, method: str, length: int, depth: float, error: str, question: str = "",
               expected: str | tuple[str, ...] = "") -> dict[str, Any]:
    row = dict.fromkeys(ROW_FIELDS)
    row.update(task=task, method=method, length=length, depth=depth, question=question,
               expected=expected if isinstance(expected, str) else "; ".join(expected),
               output="", correct=False, score=0.0, error=error or "unknown error")
    return row


def _expected_keys(settings: BenchSettings) -> list[tuple[str, float]]:
    """(task, depth) of every row a cell gives, in order (a RULER task's depths are its questions' order)."""
    return [(task, depth) for task in settings.tasks
            for depth in (settings.depths if task not in RULER_TASKS else
                          [i / settings.questions for i in range(settings.questions)])]


def max_new_tokens_for(settings: BenchSettings, engine: Any, expected: str | tuple[str, ...]) -> int:
    """The tokens an answer may generate. One answer: its tokens + 16 (room for a restated question); a list:
    LIST_ANSWER_TOKENS or its items' tokens + 64 if more; ``settings.max_new_tokens`` overrides both. Public so
    that the unit tests check the budget without a model."""
    if isinstance(expected, str):
        return settings.max_new_tokens or engine.count_tokens(expected) + 16
    return settings.max_new_tokens or max(LIST_ANSWER_TOKENS, engine.count_tokens(" ".join(expected)) + 64)


def _describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"
