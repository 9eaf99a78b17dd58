"""`emllm bench`: long-context tasks x methods x lengths x depths on one model in one run.

    rows = run_bench(["passkey", "needle"], ["S", "SM", "full", "rag-minilm"], [4096, 32768], [0.1, 0.5, 0.9])
    paths = write_report(rows, "bench-results")   # bench.json, bench.md, PNG figures

Tasks (core/emllm/tasks.py): ``passkey`` (infinity-Bench Retrieve.PassKey), ``needle`` (needle in a haystack of Paul
Graham essays; a depth x length heatmap), ``kv`` (infinity-Bench Retrieve.KV), ``multidoc`` (many documents, each
question answered by one of them). Methods: any EM-LLM preset (``S``, ``SM``, ``S+C``, ``SM+C``, ``F`` (InfLLM), ...),
``full`` (plain full attention) and the RAG baseline with MiniLM or mpnet embeddings (``rag-minilm``, ``rag-mpnet``).

One prompt for every method: the task's context, then ``prompts.probe_suffix(question, answer_lead)`` (the question
and the start of its answer, as infinity-Bench's prompts end) tokenised apart, as in compare.py. EM-LLM and ``full``
read the context once into a fresh memory (the prefill), then read only the question (the query); when one
document set has several questions (kv: one JSON object, a key per depth; multidoc: one document set, a document per
depth), each question forks the memory that read it, so the prompt extends what the memory has read and the context
is never read twice. The passkey and needle documents of one length are one
haystack with a needle per depth: ``EMEngine.read_each`` reads the haystack before each needle once and forks there,
at a chunk boundary, so each memory is the one a separate read gives and each prefill time is what a separate read
costs. RAG chunks, embeds and indexes the context once (its prefill), then per question retrieves the top 5 chunks
and has the same LLM read them under full attention (its query).

Peak RSS is a per-process number, so by default every (method, length) cell runs in its own subprocess: the
``peak_rss_mb`` of a row is the peak resident memory of the process that ran its cell (model weights, embedding
model, memories and all). With ``isolate=False`` the cells run in this process and ``peak_rss_mb`` is this process's
peak so far, which only grows: comparable between cells only in the order they ran.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import pathlib
import subprocess
import sys
import tempfile
import time
import zlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from tqdm.auto import tqdm

from emllm.cli import peak_rss_mb

from .markdown import table as markdown_table
from .prompts import format_context, probe_suffix

TASKS = ("passkey", "needle", "kv", "multidoc")
RAG_METHODS = {"rag-minilm": "minilm", "rag-mpnet": "mpnet"}
DEFAULT_METHODS = ("S", "SM", "S+C", "SM+C", "F", "full", "rag-minilm", "rag-mpnet")
DEFAULT_LENGTHS = (4096, 8192, 16384, 32768, 65536, 131072)
DEFAULT_DEPTHS = (0.1, 0.5, 0.9)
# Plain full attention is quadratic (32K tokens take about 10 minutes on 2 cores) and past the trained context
# it cannot answer anyway: longer cells are skipped unless asked for.
FULL_MAX_TOKENS = 32_768
EXTRAS = "pip install 'emllm-integrations[rag,langchain,llama-index,notebooks]'"
ROW_FIELDS = ("task", "method", "length", "tokens", "depth", "question", "expected", "output", "correct",
              "prefill_seconds", "query_seconds", "decode_ms_per_token", "output_tokens", "tokens_read",
              "peak_rss_mb", "mean_event_size", "error")
SETTINGS_FILE = "bench-settings.json"  # beside bench.json: what a resumed run must match
_MESSAGE = "@@emllm-bench "  # marks the child's result lines on stdout (libraries may print there too)


class BenchRequirementError(RuntimeError):
    """Something the requested run needs is not installed (an extra, the essays, an embedding model)."""


@dataclass(frozen=True)
class BenchSettings:
    """Everything a cell needs besides its method and length; JSON-able, so a subprocess gets exactly the same."""
    tasks: tuple[str, ...]
    depths: tuple[float, ...]
    model: str | None = None
    dtype: str = "auto"
    seed: int = 0
    max_new_tokens: int | None = None          # None: the answer's tokens + 16, per question
    engine_fields: dict[str, Any] = field(default_factory=dict)  # EMConfig fields for the EM-LLM methods
    multidoc_tokens_per_doc: int = 250
    threads: int | None = None                 # torch threads in each cell (None: torch's default)


@dataclass(frozen=True)
class _Item:
    """One document set read once, and the questions asked about it."""
    task: str
    documents: tuple[str, ...]
    questions: tuple[tuple[str, str, float, str], ...]  # (question, expected answer, depth, answer lead-in)


# ---------------------------------------------------------------------------------------------- the public API
def run_bench(tasks: Sequence[str] = TASKS, methods: Sequence[str] = DEFAULT_METHODS,
              lengths: Sequence[int] = DEFAULT_LENGTHS, depths: Sequence[float] = DEFAULT_DEPTHS, *,
              model: str | None = None, dtype: str = "auto", seed: int = 0, max_new_tokens: int | None = None,
              engine_fields: dict[str, Any] | None = None, full_max_tokens: int = FULL_MAX_TOKENS,
              isolate: bool = True, threads: int | None = None, progress: bool = True,
              done: Sequence[dict[str, Any]] = (),
              on_cell: Callable[[list[dict[str, Any]]], None] | None = None) -> list[dict[str, Any]]:
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
    """
    tasks, methods = _check_names("task", tasks, TASKS), _check_methods(methods)
    lengths, depths = _check_lengths(lengths), _check_depths(depths)
    if max_new_tokens is not None and (isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int)
                                       or max_new_tokens < 1):
        raise ValueError(f"max_new_tokens must be a positive integer (or None for the answer's length + 16), got "
                         f"{max_new_tokens!r}.")
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
        raise ValueError(f"threads must be a positive integer (or None for torch's default), got {threads!r}.")
    settings = BenchSettings(tuple(tasks), tuple(depths), model, dtype, seed, max_new_tokens,
                             dict(engine_fields or {}), threads=threads)
    check_requirements(tasks, methods)
    if engine_fields:
        from emllm import EMConfig

        EMConfig.from_preset("S", **engine_fields)  # a misspelt or impossible field fails now, not in every cell

    cells = []
    for length in lengths:
        for method in methods:
            if method == "full" and length > full_max_tokens:
                print(f"skipping full attention at {length:,} tokens (quadratic; over full_max_tokens="
                      f"{full_max_tokens:,}: raise it to run this cell)", file=sys.stderr)
                continue
            cells.append((method, length))
    finished = _finished_tasks(done, depths)
    todo = [(method, length, [t for t in tasks if (t, method, length) not in finished]) for method, length in cells]
    todo = [(method, length, cell_tasks) for method, length, cell_tasks in todo if cell_tasks]
    rerun = {(task, method, length) for method, length, cell_tasks in todo for task in cell_tasks}
    rows: list[dict[str, Any]] = [dict(r) for r in done if (r["task"], r["method"], r["length"]) not in rerun]
    if len(todo) < len(cells):
        print(f"resuming: {len(cells) - len(todo)} of {len(cells)} (method, length) cells were already measured, "
              f"{len(rows)} rows kept", file=sys.stderr)
    with tqdm(total=sum(len(cell_tasks) for *_, cell_tasks in todo) * len(depths), desc="bench", unit="question",
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
            per_cell = len(cell_tasks) * len(depths)
            missing = per_cell - (len(rows) - start)
            if missing > 0:  # the cell's process died before answering everything (e.g. killed for memory)
                reason = getattr(peak, "error", None) or "the cell ended before answering these questions"
                for task, depth in _expected_keys(cell_settings)[per_cell - missing:]:
                    emit(_error_row(task, method, length, depth, reason))
            if on_cell is not None:
                on_cell(list(rows))
    return rows


def settings_record(settings: BenchSettings) -> dict[str, Any]:
    """What must match for rows of two runs to sit in one table (threads change times, not answers: left out).

    The dtype is recorded as resolved on this machine: "auto" is bfloat16 on one CPU and float32 on another, and a
    table resumed on the other machine would otherwise mix two experiments under one name."""
    from emllm.models import resolve_dtype

    dtype = str(resolve_dtype(settings.dtype)).removeprefix("torch.")
    return {"model": settings.model, "dtype": dtype, "seed": settings.seed,
            "max_new_tokens": settings.max_new_tokens, "engine_fields": dict(settings.engine_fields),
            "multidoc_tokens_per_doc": settings.multidoc_tokens_per_doc}


def load_done(out_dir: str | os.PathLike, settings: dict[str, Any]) -> list[dict[str, Any]]:
    """The rows an earlier run wrote to ``out_dir``, refused (naming the difference) when that run's settings
    (its bench-settings.json) differ from ``settings`` (a ``settings_record``): mixing them would make one table
    of two experiments. No earlier run there: no rows."""
    out = pathlib.Path(out_dir)
    rows_path, settings_path = out / "bench.json", out / SETTINGS_FILE
    if not rows_path.exists():
        return []
    if not settings_path.exists():
        raise ValueError(f"{rows_path} has no {SETTINGS_FILE} beside it, so its settings are unknown: resume into a "
                         "folder an `emllm bench` run of this version wrote, or choose a new --out.")
    try:
        earlier = json.loads(settings_path.read_text(encoding="utf-8"))
        rows = json.loads(rows_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise ValueError(f"Cannot resume from {out}: {error}. Choose a new --out or repair the file.") from None
    differing = {k: (earlier.get(k), v) for k, v in settings.items() if earlier.get(k) != v}
    if differing:
        named = "; ".join(f"{k}: earlier {a!r}, now {b!r}" for k, (a, b) in differing.items())
        raise ValueError(f"Cannot resume into {out}: its rows were measured with other settings ({named}). Use the "
                         "same settings, or a new --out for a new experiment.")
    if not isinstance(rows, list) or any(not isinstance(r, dict) or set(ROW_FIELDS) - set(r) for r in rows):
        raise ValueError(f"{rows_path} does not hold bench rows: choose a new --out.")
    return rows


def _finished_tasks(done: Sequence[dict[str, Any]], depths: Sequence[float]) -> set[tuple[str, str, int]]:
    """(task, method, length) of earlier rows that answered every requested depth without error."""
    answered: dict[tuple[str, str, int], set[float]] = {}
    failed: set[tuple[str, str, int]] = set()
    for row in done:
        key = (row["task"], row["method"], row["length"])
        if row["error"]:
            failed.add(key)
        else:
            answered.setdefault(key, set()).add(round(float(row["depth"]), 6))
    wanted = {round(float(d), 6) for d in depths}
    return {key for key, got in answered.items() if key not in failed and wanted <= got}


def write_report(rows: Sequence[dict[str, Any]], out_dir: str | os.PathLike,
                 settings: dict[str, Any] | None = None) -> dict[str, pathlib.Path]:
    """Write bench.json (the rows), bench.md (an accuracy summary per task x method x length, then every row) and
    PNG figures into ``out_dir``; returns {name: path}. Figures: accuracy by length per method (one panel per
    task), a depth x length accuracy heatmap per method for the needle task, and prefill time, time per query,
    decode ms/token, peak RSS and mean event size by length per method (those with no values are not drawn)."""
    rows = [dict(r) for r in rows]
    if not rows:
        raise ValueError("There are no rows to report: run_bench returned nothing (every cell skipped?).")
    for i, row in enumerate(rows):
        absent = [k for k in ROW_FIELDS if k not in row]
        if absent:
            raise ValueError(f"Row {i} lacks {absent}: pass the rows run_bench returned.")
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "bench.json", "markdown": out / "bench.md"}
    if settings is not None:  # what a later `--resume` into this folder must match
        paths["settings"] = out / SETTINGS_FILE
        _write_atomically(paths["settings"], json.dumps(settings, indent=1) + "\n")
    _write_atomically(paths["json"], json.dumps(rows, indent=1) + "\n")
    _write_atomically(paths["markdown"], markdown(rows) + "\n")
    paths.update(_plots(rows, out))
    return paths


def _write_atomically(path: pathlib.Path, text: str) -> None:
    """The report is rewritten after every cell: a run stopped mid-write must leave the previous file whole."""
    partial = path.with_name(path.name + ".partial")
    partial.write_text(text, encoding="utf-8")
    os.replace(partial, path)


def summary(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Accuracy and mean measurements per (task, method, length), in the order the rows came."""
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault((row["task"], row["method"], row["length"]), []).append(row)
    out = []
    for (task, method, length), group in groups.items():
        entry = {"task": task, "method": method, "length": length, "questions": len(group),
                 "accuracy": sum(bool(r["correct"]) for r in group) / len(group),
                 "errors": sum(bool(r["error"]) for r in group)}
        for key in ("tokens", "prefill_seconds", "query_seconds", "decode_ms_per_token", "peak_rss_mb",
                    "mean_event_size"):
            entry[key] = _mean(r[key] for r in group)
        out.append(entry)
    return out


def accuracy_grid(rows: Sequence[dict[str, Any]]) -> str:
    """Accuracy at a glance: one line per method, one column per (task, length), as "correct/asked"; a cell with
    failed questions is marked "!" (see the rows' ``error``)."""
    tasks = list(dict.fromkeys(r["task"] for r in rows))
    columns = sorted({(r["task"], r["length"]) for r in rows}, key=lambda c: (tasks.index(c[0]), c[1]))
    cells: dict[tuple[str, str, int], list[dict[str, Any]]] = {}
    for row in rows:
        cells.setdefault((row["method"], row["task"], row["length"]), []).append(row)
    header = ["method", *(f"{task} {_short(length)}" for task, length in columns)]
    body = []
    for method in dict.fromkeys(r["method"] for r in rows):
        entries = []
        for task, length in columns:
            group = cells.get((method, task, length), [])
            mark = "!" if any(r["error"] for r in group) else ""
            entries.append(f"{sum(bool(r['correct']) for r in group)}/{len(group)}{mark}" if group else "–")
        body.append([method, *entries])
    return markdown_table(header, "l" + "r" * len(columns), body)


def markdown(rows: Sequence[dict[str, Any]]) -> str:
    """Accuracy at a glance, the accuracy summary with the measurements, then one line per question."""
    summary_table = markdown_table(
        ["task", "method", "length", "tokens", "accuracy", "questions", "prefill s", "s / query", "decode ms/token",
         "peak RSS MB", "mean event"], "llrrrrrrrrr",
        ([s["task"], s["method"], f"{s['length']:,}", _num(s["tokens"], ",.0f"), f"{s['accuracy']:.0%}",
          f"{s['questions']}" + (f" ({s['errors']} failed)" if s["errors"] else ""),
          _num(s["prefill_seconds"], ".2f"), _num(s["query_seconds"], ".2f"), _num(s["decode_ms_per_token"], ".1f"),
          _num(s["peak_rss_mb"], ",.0f"), _num(s["mean_event_size"], ".1f")] for s in summary(rows)))
    question_table = markdown_table(
        ["task", "method", "tokens", "depth", "expected", "output", "correct", "prefill s", "s / query",
         "decode ms/token", "peak RSS MB", "mean event"], "llrrlllrrrrr",
        ([r["task"], r["method"], _num(r["tokens"] or r["length"], ","), f"{r['depth']:.2f}", _preview(r["expected"]),
          _preview(f"error: {r['error']}" if r["error"] else r["output"]), "yes" if r["correct"] else "no",
          _num(r["prefill_seconds"], ".2f"), _num(r["query_seconds"], ".2f"), _num(r["decode_ms_per_token"], ".1f"),
          _num(r["peak_rss_mb"], ",.0f"), _num(r["mean_event_size"], ".1f")] for r in rows))
    return "\n".join(["## Accuracy at a glance (correct / asked)", "", accuracy_grid(rows), "",
                      "## Accuracy by task, method and length", "", summary_table, "",
                      "## Every question", "", question_table])


def check_requirements(tasks: Iterable[str], methods: Iterable[str]) -> None:
    """Refuse, naming the install command, a run whose tasks or methods need something that is not installed. Only
    looks packages up (no heavy imports) except to check that a requested embedding model is there."""
    needed = {"matplotlib": "matplotlib"}
    methods = list(methods)
    if any(m in RAG_METHODS for m in methods):
        needed.update({"sentence_transformers": "sentence-transformers", "faiss": "faiss-cpu",
                       "langchain_core": "langchain-core", "llama_index.core": "llama-index-core",
                       "llama_index.vector_stores.faiss": "llama-index-vector-stores-faiss"})
    absent = [pip for module, pip in needed.items() if not _installed(module)]
    if absent:
        raise BenchRequirementError(f"emllm bench needs {', '.join(absent)} for these tasks and methods, which "
                                    f"{'is' if len(absent) == 1 else 'are'} not installed: {EXTRAS}")
    if {"needle", "multidoc"} & set(tasks):
        from emllm.tasks import HaystackNotAvailableError, essays_dir

        try:
            essays_dir()
        except HaystackNotAvailableError as error:
            raise BenchRequirementError(str(error)) from None
    for method in methods:
        if method in RAG_METHODS:
            from .rag import EmbeddingNotAvailableError, resolve_embedding

            try:
                resolve_embedding(RAG_METHODS[method])
            except EmbeddingNotAvailableError as error:
                raise BenchRequirementError(f"{method}: {error}") from None


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
        fields = {} if method == "full" else settings.engine_fields
        engine = EMEngine.from_pretrained(settings.model, preset=method, dtype=settings.dtype, progress=False,
                                          **fields)
    engine.generate("Warm up: the first forward pass of a process is slower.", max_new_tokens=2)  # not timed
    rag_warm = False
    for task in settings.tasks:
        try:
            items = _items(task, length, settings, engine.count_tokens)
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
                answered.append(row)
                emit(row)

            try:
                if not rag_warm:
                    _warm_rag(RAG_METHODS[method], engine, settings)
                    rag_warm = True
                _answer_rag(item, method, length, engine, settings, emit_answer)
            except Exception as error:  # one failed document must not end the whole run
                _emit_unanswered(item, len(answered), _describe(error), method, length, emit)
    return peak_rss_mb()


def _answer_engine(items: Sequence[_Item], method: str, length: int, engine: Any, settings: BenchSettings,
                   emit: Callable[[dict[str, Any]], None]) -> None:
    """Answer every item's questions, each document read once (engine.read_each shares the reading of documents
    that begin alike, as one haystack with needles at several depths does, and times each as if read alone)."""
    contexts = [engine.tokenize(format_context(list(item.documents))) for item in items]
    reads = engine.read_each(contexts)
    for index, (item, context_ids) in enumerate(zip(items, contexts)):
        answered = 0
        try:
            memory, prefill = next(reads)
            try:
                event_size = memory.stats()["mean_event_size"] if method != "full" else None
                for question, expected, depth, lead in item.questions:
                    # Each question continues from the memory that read the context: a fork when more questions
                    # follow (the answer's tokens would otherwise be read into it and the next prompt would not
                    # extend it).
                    asking = memory.fork() if len(item.questions) > 1 else memory
                    try:
                        ids = context_ids + engine.tokenize(probe_suffix(question, lead))
                        result = engine.generate(ids, memory=asking,
                                                 max_new_tokens=_max_new(settings, engine, expected))
                    finally:
                        if asking is not memory:
                            asking.close()
                    emit(_row(item.task, method, length, len(ids), depth, question, expected, result.text,
                              prefill, result.prefill_seconds, result.decode_seconds, result.output_tokens,
                              result.new_input_tokens, event_size))
                    answered += 1
            finally:
                memory.close()
        except Exception as error:  # one failed document (say, a disk budget) must not end the whole run
            _emit_unanswered(item, answered, _describe(error), method, length, emit)
            reads.close()
            reads = engine.read_each(contexts[index + 1:])  # the shared reading broke off: start afresh


def _emit_unanswered(item: _Item, answered: int, reason: str, method: str, length: int,
                     emit: Callable[[dict[str, Any]], None]) -> None:
    for question, answer, depth, _ in item.questions[answered:]:
        emit(_error_row(item.task, method, length, depth, reason or "not answered", question, answer))


def _warm_rag(embedding: str, engine: Any, settings: BenchSettings) -> None:
    from .rag import RAGBaseline, encode

    rag = RAGBaseline(embedding, llm_model=settings.model, engine=engine, dtype=settings.dtype)  # loads the model
    encode(rag.model, ["Warm up: the first embedding of a process is slower."])


def _answer_rag(item: _Item, method: str, length: int, engine: Any, settings: BenchSettings,
                emit: Callable[[dict[str, Any]], None]) -> int:
    from .rag import RAGBaseline

    # A fresh index per document set (the embedding model itself is loaded once per process and shared).
    rag = RAGBaseline(RAG_METHODS[method], llm_model=settings.model, engine=engine, dtype=settings.dtype)
    started = time.perf_counter()
    rag.add_documents(list(item.documents))
    prefill = time.perf_counter() - started
    tokens = len(engine.tokenize(format_context(list(item.documents))))
    answered = 0
    for question, expected, depth, lead in item.questions:
        suffix = probe_suffix(question, lead)
        answer = rag.answer(question, _max_new(settings, engine, expected), suffix=suffix)
        emit(_row(item.task, method, length, tokens + len(engine.tokenize(suffix)), depth, question,
                  expected, answer.text, prefill, answer.retrieve_seconds + answer.prefill_seconds,
                  answer.decode_seconds, answer.output_tokens, answer.input_tokens, None))
        answered += 1
    return answered


def _items(task: str, length: int, settings: BenchSettings, count_tokens: Callable[[str], int]) -> list[_Item]:
    """The documents of a task at one length, the same for every method (seeded by task, length and depth)."""
    from emllm import tasks as builders

    if task == "multidoc":
        qa = builders.multidoc_documents(length, list(settings.depths), count_tokens,
                                         seed=_seed(settings.seed, task, length, -1.0),
                                         doc_tokens=min(settings.multidoc_tokens_per_doc, length))
        return [_Item(task, qa.documents, tuple((q.question, q.answer, q.depth, q.answer_lead)
                                                for q in qa.questions))]
    if task == "kv":  # one JSON object per length, a question per depth (a pair further in): read once
        first = builders.kv_document(length, settings.depths[0], count_tokens,
                                     seed=_seed(settings.seed, task, length, -1.0))
        docs = [first.asking_at(depth) for depth in settings.depths]
        return [_Item(task, (docs[0].context,), tuple((d.question, d.answer, d.depth, d.answer_lead) for d in docs))]
    build = {"passkey": builders.passkey_document, "needle": builders.needle_document}[task]
    items = []
    for depth in settings.depths:  # one haystack, a needle (with its own answer) per depth: see engine.read_each
        doc = build(length, depth, count_tokens, seed=_seed(settings.seed, task, length, depth))
        items.append(_Item(task, (doc.context,), ((doc.question, doc.answer, depth, doc.answer_lead),)))
    return items


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

    roots = [str(pathlib.Path(emllm.__file__).resolve().parents[1]), str(pathlib.Path(__file__).resolve().parents[1])]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(roots + [p for p in env.get("PYTHONPATH", "").split(os.pathsep)
                                                              if p]))
    env.setdefault("HF_HUB_OFFLINE", "1")  # never reach for a model hub from a benchmark
    return env


def _child_main() -> int:
    spec = json.loads(sys.stdin.read())
    settings = BenchSettings(**{**spec["settings"], "tasks": tuple(spec["settings"]["tasks"]),
                                "depths": tuple(spec["settings"]["depths"])})

    def emit(row: dict[str, Any]) -> None:
        print(_MESSAGE + json.dumps({"row": row}), flush=True)

    peak = run_cell(spec["method"], spec["length"], settings, emit)
    print(_MESSAGE + json.dumps({"peak_rss_mb": peak}), flush=True)
    return 0


# ---------------------------------------------------------------------------------------------- rows and checks
def _row(task: str, method: str, length: int, tokens: int, depth: float, question: str, expected: str, output: str,
         prefill: float, query: float, decode: float, output_tokens: int, tokens_read: int,
         event_size: float | None) -> dict[str, Any]:
    return {"task": task, "method": method, "length": length, "tokens": tokens, "depth": depth,
            "question": question, "expected": expected, "output": output.strip(), "correct": expected in output,
            "prefill_seconds": prefill, "query_seconds": query,
            "decode_ms_per_token": 1000 * decode / max(output_tokens, 1), "output_tokens": output_tokens,
            "tokens_read": tokens_read, "peak_rss_mb": peak_rss_mb(),
            "mean_event_size": None if event_size is None or math.isnan(event_size) else event_size, "error": None}


def _error_row(task: str, method: str, length: int, depth: float, error: str, question: str = "",
               expected: str = "") -> dict[str, Any]:
    row = dict.fromkeys(ROW_FIELDS)
    row.update(task=task, method=method, length=length, depth=depth, question=question, expected=expected,
               output="", correct=False, error=error or "unknown error")
    return row


def _expected_keys(settings: BenchSettings) -> list[tuple[str, float]]:
    return [(task, depth) for task in settings.tasks for depth in settings.depths]


def _max_new(settings: BenchSettings, engine: Any, expected: str) -> int:
    return settings.max_new_tokens or engine.count_tokens(expected) + 16


def _seed(seed: int, task: str, length: int, depth: float) -> int:
    """A seed per document that every method shares (a stable hash: Python's hash() of a str varies per process)."""
    return zlib.crc32(f"{seed}:{task}:{length}:{depth:.6f}".encode())


def _describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def _check_names(kind: str, names: Any, allowed: Sequence[str]) -> list[str]:
    if isinstance(names, str) or not isinstance(names, Iterable):
        raise TypeError(f"Pass a list of {kind}s, e.g. [{allowed[0]!r}], got {names!r}.")
    names = list(names)
    if not names:
        raise ValueError(f"The {kind} list is empty: choose from {', '.join(allowed)}.")
    unknown = [n for n in names if n not in allowed]
    if unknown:
        raise ValueError(f"Unknown {kind} {unknown[0]!r}: choose from {', '.join(allowed)}.")
    return list(dict.fromkeys(names))


def _check_methods(methods: Any) -> list[str]:
    from emllm import PRESETS

    return _check_names("method", methods, [*PRESETS, *RAG_METHODS])


def _check_lengths(lengths: Any) -> list[int]:
    if isinstance(lengths, (str, int)) or not isinstance(lengths, Iterable):
        raise TypeError(f"Pass a list of lengths in tokens, e.g. [4096, 32768], got {lengths!r}.")
    lengths = list(lengths)
    if not lengths:
        raise ValueError("The length list is empty: give at least one length in tokens, e.g. 4096.")
    for n in lengths:
        if isinstance(n, bool) or not isinstance(n, int) or n < 256:
            raise ValueError(f"Each length is a whole number of tokens, at least 256 (room for the tasks' "
                             f"instructions and a few documents), got {n!r}.")
    return list(dict.fromkeys(lengths))


def _check_depths(depths: Any) -> list[float]:
    if isinstance(depths, (str, int, float)) or not isinstance(depths, Iterable):
        raise TypeError(f"Pass a list of depths in [0, 1], e.g. [0.1, 0.5, 0.9], got {depths!r}.")
    depths = list(depths)
    if not depths:
        raise ValueError("The depth list is empty: give at least one depth in [0, 1], e.g. 0.5.")
    for d in depths:
        if isinstance(d, bool) or not isinstance(d, (int, float)) or not 0.0 <= d <= 1.0:
            raise ValueError(f"Each depth is a fraction of the document in [0, 1] (0 = start), got {d!r}.")
    return [float(d) for d in dict.fromkeys(depths)]


# ---------------------------------------------------------------------------------------------- report helpers
def _mean(values: Iterable[Any]) -> float | None:
    kept = [float(v) for v in values if v is not None]
    return sum(kept) / len(kept) if kept else None


def _num(value: Any, spec: str) -> str:
    return "–" if value is None else format(value, spec)


def _preview(text: Any, chars: int = 80) -> str:
    """The start of a long answer for a table cell (the whole text is in bench.json)."""
    return " ".join(str(text).split())[:chars]


METRICS = (("prefill_seconds", "prefill time (s): reading the document(s) once"),
           ("query_seconds", "time per query (s): the question until its first token"),
           ("decode_ms_per_token", "decode ms / token"),
           ("peak_rss_mb", "peak RSS (MB) of the cell's process"),
           ("mean_event_size", "mean event size (tokens)"))


MARKERS = "osD^vP*Xh<>"
ACCURACY_DODGE = 0.05
"""Sideways offset between methods in the accuracy figure, in octaves of length (lengths are on a log-2 axis)."""


def _plots(rows: list[dict[str, Any]], out: pathlib.Path) -> dict[str, pathlib.Path]:
    import matplotlib
    import numpy as np

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = list(dict.fromkeys(r["method"] for r in rows))
    tasks = list(dict.fromkeys(r["task"] for r in rows))
    lengths = sorted({r["length"] for r in rows})
    paths: dict[str, pathlib.Path] = {}

    def by_length(selected: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
        xs, ys = [], []
        for length in lengths:
            value = _mean((float(r[key]) if r[key] is not None else None) for r in selected if r["length"] == length)
            if value is not None:
                xs.append(length)
                ys.append(value)
        return xs, ys

    def finish(fig: Any, axes: Sequence[Any], name: str) -> None:
        for ax in axes:
            if len(lengths) > 1:
                ax.set_xscale("log", base=2)
            ax.set_xticks(lengths, [_short(n) for n in lengths])
            ax.set_xlabel("length (tokens)")
            ax.grid(alpha=0.3)
        fig.tight_layout()
        paths[name] = out / f"{name}.png"
        fig.savefig(paths[name], dpi=110)
        plt.close(fig)

    fig, axes = plt.subplots(1, len(tasks), figsize=(4.5 * len(tasks), 3.8), squeeze=False)
    for ax, task in zip(axes[0], tasks):
        for i, method in enumerate(methods):
            selected = [dict(r, correct=float(bool(r["correct"]))) for r in rows
                        if r["task"] == task and r["method"] == method]
            xs, ys = by_length(selected, "correct")
            # Methods often tie (0/3, 3/3): each is nudged sideways and drawn with its own marker, so none hides.
            nudge = 2 ** (ACCURACY_DODGE * (i - (len(methods) - 1) / 2))
            ax.plot([x * nudge for x in xs], ys, marker=MARKERS[i % len(MARKERS)], label=method)
        ax.set_title(f"{task}: accuracy")
        ax.set_ylim(-0.05, 1.05)
    axes[0][-1].legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.02, 1))  # outside: points sit at 0 and 1
    finish(fig, axes[0], "accuracy")

    needle = [r for r in rows if r["task"] == "needle"]
    if needle:
        needle_methods = list(dict.fromkeys(r["method"] for r in needle))
        depths = sorted({r["depth"] for r in needle})
        fig, axes = plt.subplots(1, len(needle_methods), figsize=(3.2 * len(needle_methods) + 1.5, 3.6),
                                 squeeze=False, layout="constrained")
        for i, (ax, method) in enumerate(zip(axes[0], needle_methods)):
            grid = [[_mean(float(bool(r["correct"])) for r in needle
                           if r["method"] == method and r["depth"] == d and r["length"] == n) for n in lengths]
                    for d in depths]
            values = [[math.nan if v is None else v for v in line] for line in grid]
            image = ax.imshow(values, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto", origin="upper")
            ax.set_xticks(range(len(lengths)), [_short(n) for n in lengths])
            ax.set_yticks(range(len(depths)), [f"{d:.0%}" for d in depths])
            for (y, x), value in np.ndenumerate(np.asarray(values, dtype=float)):
                if not math.isnan(value):
                    ax.text(x, y, f"{value:.0%}", ha="center", va="center", fontsize=8)
            ax.set_xlabel("length (tokens)")
            if i == 0:
                ax.set_ylabel("needle depth")
            ax.set_title(f"needle: {method}")
        fig.colorbar(image, ax=list(axes[0]), label="accuracy")
        paths["needle_heatmap"] = out / "needle_heatmap.png"
        fig.savefig(paths["needle_heatmap"], dpi=110)
        plt.close(fig)

    for key, title in METRICS:
        lines = {m: by_length([r for r in rows if r["method"] == m], key) for m in methods}
        lines = {m: xy for m, xy in lines.items() if xy[0]}
        if not lines:
            continue
        fig, ax = plt.subplots(figsize=(6, 4))
        for method, (xs, ys) in lines.items():
            ax.plot(xs, ys, marker="o", label=method)
        ax.set_title(title)
        ax.legend(fontsize=8)
        finish(fig, [ax], key)
    return paths


def _short(n: int) -> str:
    for unit, size in (("M", 2**20), ("K", 2**10)):
        if n >= size and n % size == 0:
            return f"{n // size}{unit}"
    return f"{n:,}"


if __name__ == "__main__":
    if sys.argv[1:] == ["--child"]:
        sys.exit(_child_main())
    print("Run the benchmark with `emllm bench` or emllm_integrations.bench.run_bench(...).", file=sys.stderr)
    sys.exit(2)
