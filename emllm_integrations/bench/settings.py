"""What a bench run is: its names and defaults, its settings, the checks on its arguments and extras (all made
before any model loads), and resuming from an earlier run's rows."""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

RULER_TASKS = ("niah_single", "niah_noise", "niah_multikey", "niah_multivalue", "niah_multiquery",
               "variable_tracking", "common_words", "frequent_words", "fact_qa", "two_hop", "three_hop",
               "chronicle", "handwritten")
"""The suite (bench.ruler): RULER's families and fact QA in other words, each a document with many questions."""
PROBE_TASKS = ("passkey", "needle", "kv", "multidoc")
"""Probes with an answer lead-in and a question per depth (bench.tasks), kept for the diagnostic scripts."""
TASKS = (*RULER_TASKS, *PROBE_TASKS)
RAG_METHODS = {"rag-minilm": ("minilm", "paper"), "rag-mpnet": ("mpnet", "paper"), "rag-tuned": ("minilm", "tuned")}
"""Each RAG method's embedding and recipe (rag.RECIPES): the paper's protocol with either embedder, and the RAG a
practitioner builds (hybrid search, its chunk size chosen on a development split)."""
REREAD_METHODS = {"E-text": "E", "EG-text": "EG"}
"""Methods that rank and retrieve events as a preset does (E-text: E's ranking; EG-text: the default's, look-alikes
filtered out), then read what that preset attends to (its sinks, the retrieved events in document order, the local
window) afresh as text under full attention (reread=True, emllm.reread): KV or text, which reads the same retrieval
better."""
DEFAULT_METHODS = ("EG", "E", "ER", "S", "SM", "S+C", "SM+C", "F", "full", "rag-minilm", "rag-mpnet", "rag-tuned")
DEFAULT_LENGTHS = (8192, 32768, 65536, 131072)
DEFAULT_DEPTHS = (0.1, 0.5, 0.9)
DEFAULT_QUESTIONS = 20
# Plain full attention is quadratic (32K tokens take about 10 minutes on 2 cores) and past the trained context
# it cannot answer anyway: longer cells are skipped unless asked for.
FULL_MAX_TOKENS = 32_768
EXTRAS = "pip install 'emllm-integrations[rag,langchain,llama-index,notebooks]'"
ROW_FIELDS = ("task", "method", "length", "tokens", "depth", "question", "expected", "output", "correct", "score",
              "prefill_seconds", "query_seconds", "decode_ms_per_token", "output_tokens", "tokens_read",
              "peak_rss_mb", "mean_event_size", "error")
SETTINGS_FILE = "bench-settings.json"  # beside bench.json: what a resumed run must match
SCORER_FIELDS = {"retrieval_scoring": "scoring", "retrieval_pooling": "pooling"}
"""Engine fields named as the command line's flags, turned into EMConfig(scorer=scorer_from_names(...)) by
config_overrides: the bench's settings and JSON keep these strings (a scorer object is not JSON)."""


LIST_ANSWER_TOKENS = 128
"""What a list answer (multi-value, multi-query, variable tracking, word extraction) may generate: RULER's budget for
its needle and common-words answers. A chat answer restates the question (about 20 tokens) and numbers its items;
the old budget (the items' tokens + 32) cut 4 of 5 variable-tracking and multi-query answers before their last
item, so those cells measured the budget, not the retrieval."""


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
    max_new_tokens: int | None = None          # None: per question, its tokens + 16 (lists: 128)
    engine_fields: dict[str, Any] = field(default_factory=dict)  # EMConfig fields (see config_overrides)
    multidoc_tokens_per_doc: int = 250
    threads: int | None = None                 # torch threads in each cell (None: torch's default)
    questions: int = DEFAULT_QUESTIONS         # per document of a RULER task
    concurrent: int = 1                        # a document's questions answered at once (emllm.batching)

    def questions_per_cell(self, task: str) -> int:
        """How many rows a task gives in one (method, length) cell: its questions, or one per depth for a probe."""
        return self.questions if task in RULER_TASKS else len(self.depths)


def config_overrides(engine_fields: dict[str, Any]) -> dict[str, Any]:
    """EMConfig keyword arguments from the bench's engine fields: ``retrieval_scoring`` and ``retrieval_pooling``
    (the flags' names and values) become ``scorer=scorer_from_names(...)``; every other field passes as it is."""
    overrides = {k: v for k, v in engine_fields.items() if k not in SCORER_FIELDS}
    names = {SCORER_FIELDS[k]: v for k, v in engine_fields.items() if k in SCORER_FIELDS}
    if names:
        from emllm.scoring import scorer_from_names

        overrides["scorer"] = scorer_from_names(**names)
    return overrides


def settings_record(settings: BenchSettings) -> dict[str, Any]:
    """What must match for rows of two runs to sit in one table (threads and concurrent questions change times, not
    answers: left out).

    The dtype is recorded as resolved on this machine: "auto" is bfloat16 on one CPU and float32 on another, and a
    table resumed on the other machine would otherwise mix two experiments under one name."""
    from emllm.models import resolve_dtype

    dtype = str(resolve_dtype(settings.dtype)).removeprefix("torch.")
    return {"model": settings.model, "dtype": dtype, "seed": settings.seed,
            "max_new_tokens": settings.max_new_tokens, "engine_fields": dict(settings.engine_fields),
            "multidoc_tokens_per_doc": settings.multidoc_tokens_per_doc, "questions": settings.questions,
            "list_answer_tokens": LIST_ANSWER_TOKENS}


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


REPORT_FILES = ("bench.json", "bench.md", SETTINGS_FILE)
"""What a bench run writes to its folder besides figures: a run never replaces these unless it resumes them."""


def check_out_dir(out_dir: str | os.PathLike, resume: bool) -> None:
    """Refuse an output folder whose files this run would replace: a file named as the folder; a bench.json without
    --resume; or, with no bench.json to resume, a bench.md or bench-settings.json (someone's report, or a run that
    never finished a cell: neither is this run's to overwrite)."""
    out = pathlib.Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file, not a folder: give a folder (new or holding a bench.json "
                         "with --resume).")
    if (out / "bench.json").exists():
        if not resume:
            raise ValueError(f"{out} already holds a bench.json: pass --resume to add this run's cells to it "
                             "(cells already measured are skipped), or give another --out.")
        return
    present = [name for name in REPORT_FILES if (out / name).exists()]
    if present:
        raise ValueError(f"{out} holds {', '.join(present)} but no bench.json, so this run would replace "
                         f"{'it' if len(present) == 1 else 'them'} without resuming anything: give another --out, or "
                         "move them away.")


def finished_tasks(done: Sequence[dict[str, Any]], settings: BenchSettings) -> set[tuple[str, str, int]]:
    """(task, method, length) of earlier rows that answered all of the cell's questions (every requested depth of a
    probe) without error."""
    answered: dict[tuple[str, str, int], set[Any]] = {}
    failed: set[tuple[str, str, int]] = set()
    for row in done:
        key = (row["task"], row["method"], row["length"])
        if row["error"]:
            failed.add(key)
        else:
            answered.setdefault(key, set()).add(row["question"] if row["task"] in RULER_TASKS
                                                else round(float(row["depth"]), 6))
    wanted = {round(float(d), 6) for d in settings.depths}
    return {key for key, got in answered.items() if key not in failed and
            (len(got) >= settings.questions if key[0] in RULER_TASKS else wanted <= got)}


def check_requirements(tasks: Iterable[str], methods: Iterable[str]) -> None:
    """Refuse, naming every install command at once, a run whose tasks or methods need something that is not
    installed. Only looks packages up (no heavy imports) except to check that a requested embedding model is there."""
    needed = {"matplotlib": "matplotlib"}
    methods = list(methods)
    if any(m in RAG_METHODS for m in methods):
        needed.update({"sentence_transformers": "sentence-transformers", "faiss": "faiss-cpu",
                       "langchain_core": "langchain-core", "llama_index.core": "llama-index-core",
                       "llama_index.vector_stores.faiss": "llama-index-vector-stores-faiss"})
    problems = []
    absent = [pip for module, pip in needed.items() if not _installed(module)]
    if absent:
        problems.append(f"{', '.join(absent)} {'is' if len(absent) == 1 else 'are'} not installed: {EXTRAS}")
    if {"needle", "multidoc", "niah_single", "niah_multikey", "niah_multivalue", "niah_multiquery",
            "fact_qa", "handwritten"} & set(tasks):
        from .tasks import HaystackNotAvailableError, essays_dir

        try:
            essays_dir()
        except HaystackNotAvailableError as error:
            problems.append(str(error))
    for embedding in dict.fromkeys(RAG_METHODS[m][0] for m in methods if m in RAG_METHODS):
        from ..rag import EmbeddingNotAvailableError, resolve_embedding

        try:
            resolve_embedding(embedding)
        except EmbeddingNotAvailableError as error:
            problems.append(str(error))
    if problems:
        raise BenchRequirementError("These tasks and methods need what is not installed:\n- " + "\n- ".join(problems))


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def check_names(kind: str, names: Any, allowed: Sequence[str]) -> list[str]:
    """The names, each once, refused (naming the choices) when not a non-empty list of allowed names."""
    if isinstance(names, str) or not isinstance(names, Iterable):
        raise TypeError(f"Pass a list of {kind}s, e.g. [{allowed[0]!r}], got {names!r}.")
    names = list(names)
    if not names:
        raise ValueError(f"The {kind} list is empty: choose from {', '.join(allowed)}.")
    unknown = [n for n in names if n not in allowed]
    if unknown:
        raise ValueError(f"Unknown {kind} {unknown[0]!r}: choose from {', '.join(allowed)}.")
    return list(dict.fromkeys(names))


def check_methods(methods: Any) -> list[str]:
    """EM-LLM presets, ``full``, the re-reading and the RAG methods, each once."""
    from emllm import PRESETS

    return check_names("method", methods, [*PRESETS, *REREAD_METHODS, *RAG_METHODS])


def check_lengths(lengths: Any) -> list[int]:
    """Lengths in tokens (at least 256 each), each once."""
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


def check_depths(depths: Any) -> list[float]:
    """Depths in [0, 1] as floats, each once."""
    if isinstance(depths, (str, int, float)) or not isinstance(depths, Iterable):
        raise TypeError(f"Pass a list of depths in [0, 1], e.g. [0.1, 0.5, 0.9], got {depths!r}.")
    depths = list(depths)
    if not depths:
        raise ValueError("The depth list is empty: give at least one depth in [0, 1], e.g. 0.5.")
    for d in depths:
        if isinstance(d, bool) or not isinstance(d, (int, float)) or not 0.0 <= d <= 1.0:
            raise ValueError(f"Each depth is a fraction of the document in [0, 1] (0 = start), got {d!r}.")
    return [float(d) for d in dict.fromkeys(depths)]
