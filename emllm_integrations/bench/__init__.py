"""`emllm bench`: long-context tasks x methods x lengths x depths on one model in one run.

    rows = run_bench(["passkey", "needle"], ["S", "SM", "full", "rag-minilm"], [4096, 32768], [0.1, 0.5, 0.9])
    paths = write_report(rows, "bench-results")   # bench.json, bench.md, PNG figures

Tasks (``tasks``): ``passkey`` (infinity-Bench Retrieve.PassKey), ``needle`` (needle in a haystack of Paul Graham
essays; a depth x length heatmap), ``kv`` (infinity-Bench Retrieve.KV), ``multidoc`` (many documents, each question
answered by one of them). Methods: any EM-LLM preset (``S``, ``SM``, ``S+C``, ``SM+C``, ``F`` (InfLLM), ...),
``full`` (plain full attention) and the RAG baseline with MiniLM or mpnet embeddings (``rag-minilm``, ``rag-mpnet``:
the paper's protocol) or tuned (``rag-tuned``: hybrid search, rag.RECIPES["tuned"]).

One prompt for every method: the task's context, then ``tasks.probe_suffix(question, answer_lead)`` (the question
and the start of its answer, as infinity-Bench's prompts end) tokenised apart, as in compare.py. EM-LLM and ``full``
read the context once into a fresh memory (the prefill), then read only the question (the query); when one
document set has several questions (kv: one JSON object, a key per depth; multidoc: one document set, a document per
depth), each question forks the memory that read it, so the prompt extends what the memory has read and the context
is never read twice. The passkey and needle documents of one length are one haystack with a needle per depth:
``read_each`` reads the haystack before each needle once and forks there, at a chunk boundary, so each memory is
the one a separate read gives and each prefill time is what a separate read costs. RAG chunks, embeds and indexes
the context once (its prefill), then per question retrieves the top 5 chunks and has the same LLM read them under
full attention (its query).

Peak RSS is a per-process number, so by default every (method, length) cell runs in its own subprocess: the
``peak_rss_mb`` of a row is the peak resident memory of the process that ran its cell (model weights, embedding
model, memories and all). With ``isolate=False`` the cells run in this process and ``peak_rss_mb`` is this process's
peak so far, which only grows: comparable between cells only in the order they ran.

Modules: ``settings`` (names, defaults, argument checks, resuming), ``items`` (a task's documents and questions),
``measure`` (read_each, peak_rss_mb), ``harness`` (running cells), ``report`` (JSON, markdown, figures), ``probes``
(the questions as token ids with their answer located, for the diagnostic scripts in benchmarks/), ``suite`` (the
quality suite read across runs, for benchmarks/suite_plot.py and suite_compare.py) and ``tasks`` (the task
builders). Everything here is benchmark-only: the engine (``emllm``) imports none of it.
"""

from .harness import run_bench, run_cell
from .items import TaskItem, document_seed, task_items
from .measure import peak_rss_mb, read_each
from .probes import Probe, Probes, multidoc_probes, needle_probes
from .report import accuracy_grid, markdown, summary, wilson_interval, write_report
from .settings import (DEFAULT_DEPTHS, DEFAULT_LENGTHS, DEFAULT_METHODS, DEFAULT_QUESTIONS, FULL_MAX_TOKENS,
                       PROBE_TASKS, RAG_METHODS, REREAD_METHODS, ROW_FIELDS, RULER_TASKS, SETTINGS_FILE, TASKS,
                       BenchRequirementError, BenchSettings, check_out_dir, check_requirements, config_overrides,
                       finished_tasks, load_done, settings_record)

__all__ = ["run_bench", "run_cell", "TaskItem", "document_seed", "task_items", "peak_rss_mb", "read_each", "Probe",
           "Probes", "multidoc_probes", "needle_probes", "accuracy_grid", "markdown", "summary", "wilson_interval",
           "write_report",
           "DEFAULT_DEPTHS", "DEFAULT_LENGTHS", "DEFAULT_METHODS", "DEFAULT_QUESTIONS", "PROBE_TASKS", "RULER_TASKS",
           "FULL_MAX_TOKENS", "RAG_METHODS", "REREAD_METHODS", "ROW_FIELDS",
           "SETTINGS_FILE", "TASKS", "BenchRequirementError", "BenchSettings", "check_out_dir", "check_requirements",
           "config_overrides", "finished_tasks", "load_done", "settings_record"]
