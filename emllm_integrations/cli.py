"""`emllm demo` (EM-LLM and RAG side by side on a long real-prose document), `emllm chat --file PATH` (ask
questions about a text file) and
`emllm bench` (tasks x methods x lengths, with tables and figures; its RAG methods and figures need the extras).

The command line lives beside the adapters, not in the engine: it uses the bench's task builders and harness
(emllm_integrations.bench), and the engine (``emllm``) imports nothing from here."""

from __future__ import annotations

import argparse
import os
import sys
from typing import get_args

from emllm.config import DEFAULT_PRESET, PRESETS, MemoryPositions
from emllm.scoring import POOLINGS, SCORINGS

from .bench import (DEFAULT_DEPTHS, DEFAULT_LENGTHS, DEFAULT_METHODS, DEFAULT_QUESTIONS, FULL_MAX_TOKENS, RULER_TASKS,
                    TASKS, BenchRequirementError, BenchSettings, check_out_dir, check_requirements, config_overrides,
                    load_done, markdown, peak_rss_mb, run_bench, settings_record, summary, write_report)
from . import parts, serve

ENGINE_OVERRIDES = ("n_local", "n_mem", "chunk_size", "ram_budget_mb", "retrieval_scoring", "retrieval_pooling",
                    "memory_positions", "contiguity_neighbours", "full_until")
"""Engine fields the command line can override (flags of the same name; bench.config_overrides turns the retrieval
ones into EMConfig's scorer); one list for demo, chat and bench."""


def engine_fields(args: argparse.Namespace, *extra: str) -> dict:
    """The engine fields given on the command line (ENGINE_OVERRIDES, then ``extra``), by flag name."""
    return {name: getattr(args, name) for name in (*ENGINE_OVERRIDES, *extra) if getattr(args, name, None) is not None}


def _engine(args: argparse.Namespace):
    from emllm import EMEngine

    print(f"loading {args.model or 'the embedded default model'} (preset {args.preset}) ...", file=sys.stderr)
    return EMEngine.from_pretrained(args.model, preset=args.preset, **config_overrides(engine_fields(args)))


def demo(args: argparse.Namespace) -> int:
    """What the project is for, in one run: a long document of real prose (Paul Graham's essays, with facts placed in
    it at spread depths) read once by EM-LLM, indexed once by RAG, and questions that use other words than the facts
    answered by both, side by side, with times and memory."""
    from emllm import DEFAULT_MODEL, EMConfig, shared_engine

    from .bench.ruler import family_document, score
    from .compare import compare

    EMConfig.from_preset(args.preset, **config_overrides(engine_fields(args)))  # bad settings fail before loading
    try:
        check_requirements(["fact_qa"], [])  # the essays its document is made of
    except BenchRequirementError as error:
        print(f"emllm demo: {error}", file=sys.stderr)
        return 2
    print(f"loading {args.model or 'the embedded default model'} ...", file=sys.stderr)
    engine = shared_engine(args.model)  # compare's RAG side and EM-LLM side share these weights
    trained = engine.shape.max_positions
    tokens = args.tokens or int(trained * 1.05)  # just past the trained context, where full attention cannot go
    print(f"building a {tokens:,}-token document of real prose ({tokens / trained:.2f}x the model's trained context "
          f"of {trained:,}) holding {args.questions} facts ...", file=sys.stderr)
    doc = family_document("fact_qa", tokens, engine.count_tokens, questions=args.questions, seed=args.seed)
    result = compare([doc.context], [q.question for q in doc.questions], preset=args.preset, llm_model=args.model,
                     max_new_tokens=48, progress=True, **config_overrides(engine_fields(args)))
    em, rag = result.rows_for("em-llm"), result.rows_for("rag")
    right = {"em-llm": 0, "rag": 0}
    print(f"\n{result.document_tokens:,} document tokens; model {args.model or DEFAULT_MODEL}; "
          f"EM-LLM preset {result.preset}; "
          f"RAG {result.embedding}, top {result.top_k} of {result.rag_chunks} chunks.\n")
    for asked, e, r in zip(doc.questions, em, rag):
        marks = []
        for row in (e, r):
            ok = score(row.answer, asked.answers) == 1.0
            right[row.method] += ok
            marks.append(f"{'right' if ok else 'WRONG'} in {row.query_seconds + row.decode_seconds:4.1f} s: "
                         f"{' '.join(row.answer.split())[:100]!r}")
        print(f"Q ({asked.depth:.0%} deep): {asked.question}  [expected: {'; '.join(asked.answers)}]")
        print(f"   EM-LLM {marks[0]}\n   RAG    {marks[1]}")
    n = len(doc.questions)
    print(f"\nEM-LLM: {right['em-llm']}/{n} right; read the document once in {em[0].prefill_seconds:.0f} s, then "
          f"{sum(x.query_seconds + x.decode_seconds for x in em) / n:.1f} s per question.")
    print(f"RAG:    {right['rag']}/{n} right; chunked and embedded it in {rag[0].prefill_seconds:.0f} s, then "
          f"{sum(x.query_seconds + x.decode_seconds for x in rag) / n:.1f} s per question.")
    print(f"peak RSS of this process (model, both methods): {peak_rss_mb():,.0f} MB")
    return 0


def chat(args: argparse.Namespace) -> int:
    from emllm import EMConfig
    from emllm.decoding import check_sampling

    check_sampling(args.max_new_tokens, 0.0, 1.0, 0)  # before the model loads and the document is read
    EMConfig.from_preset(args.preset, **config_overrides(engine_fields(args)))
    if sys.stdin is None or sys.stdin.closed:  # questions come from stdin: say so before the model loads
        print("emllm chat: standard input is closed, and the questions are read from it: run it in a terminal, or "
              "pipe the questions in (one per line).", file=sys.stderr)
        return 2
    path = args.file
    if not os.path.isfile(path):  # a device such as /dev/zero would be read without end
        print(f"emllm chat: {path} is not a regular file; give the path of a UTF-8 text file.", file=sys.stderr)
        return 2
    try:
        with open(path, encoding="utf-8") as handle:
            text = handle.read()
    except (OSError, UnicodeDecodeError) as error:
        print(f"emllm chat: cannot read {path}: {error}", file=sys.stderr)
        return 2
    if not text.strip():
        print(f"emllm chat: {path} is empty; give it a text file with content.", file=sys.stderr)
        return 2
    engine = _engine(args)
    memory = engine.new_memory()
    messages = [{"role": "system", "content": "Answer questions about the document the user gave you."},
                {"role": "user", "content": f"Here is a document ({os.path.basename(path)}):\n\n{text}"}]
    # Read the document once; every question then only reads its own tokens.
    engine.read(memory, engine.chat_ids(messages, add_generation_prompt=False), progress=True)
    print(f"read {memory.total_tokens:,} tokens into {memory.num_events:,} events. Ask away (empty line or "
          "Ctrl-D to quit).", file=sys.stderr)
    while True:
        try:
            question = input("> ").strip()
        except EOFError:
            break
        except UnicodeDecodeError as error:  # a question that is not UTF-8: say so, keep the document
            print(f"emllm chat: that question is not UTF-8 text ({error.reason}); ask again.", file=sys.stderr)
            continue
        if not question:
            break
        try:
            stream = engine.stream([*messages, {"role": "user", "content": question}], memory=memory,
                                   max_new_tokens=args.max_new_tokens, reread=args.reread)
            for delta in stream:
                print(delta, end="", flush=True)
        except (ValueError, TypeError) as error:  # e.g. a control character the tokenizer cannot represent
            print(f"\nemllm chat: {error} Ask again.", file=sys.stderr)
            if memory.closed:  # a forward failed part-way: the memory cannot continue
                return 1
            continue
        print()
        messages.append({"role": "user", "content": question})
        messages.append({"role": "assistant", "content": stream.result.text})
        if memory.token_ids != engine.chat_ids(messages, add_generation_prompt=False)[: memory.total_tokens]:
            # The answer re-tokenised differently: keep going, with the memory's own history as the record.
            messages[-1]["content"] = engine.tokenizer.decode(stream.result.token_ids, skip_special_tokens=True)
    memory.close()
    return 0


def bench(args: argparse.Namespace) -> int:
    # The extras the requested tasks and methods need are looked for by run_bench before any model loads.
    fields = engine_fields(args, "offload_dir")
    record = settings_record(BenchSettings(tuple(args.tasks), tuple(args.depths), args.model, args.dtype,
                                           seed=args.seed, max_new_tokens=args.max_new_tokens, engine_fields=fields,
                                           questions=args.questions))
    try:
        check_out_dir(args.out, args.resume)
        done = load_done(args.out, record) if args.resume else []
        rows = run_bench(args.tasks, args.methods, args.lengths, args.depths, model=args.model, dtype=args.dtype,
                         seed=args.seed, max_new_tokens=args.max_new_tokens, engine_fields=fields,
                         full_max_tokens=args.full_max_tokens, isolate=not args.in_process, threads=args.threads,
                         questions=args.questions, concurrent=args.concurrent, done=done,
                         on_cell=lambda so_far: write_report(so_far, args.out, record))
    except BenchRequirementError as error:
        print(f"emllm bench: {error}", file=sys.stderr)
        return 2
    except (ValueError, TypeError) as error:  # bad arguments (ConfigError is a ValueError): named with the fix
        print(f"emllm bench: {error}", file=sys.stderr)
        return 2
    if not rows:
        print("emllm bench: every cell was skipped; nothing to report.", file=sys.stderr)
        return 2
    paths = write_report(rows, args.out, record)
    print(markdown(rows).split("\n\n## Every question")[0])
    print(f"\nwrote {', '.join(str(p) for p in paths.values())}")
    failed = sum(s["errors"] for s in summary(rows))
    if failed:
        print(f"emllm bench: {failed} question(s) failed with an error (see the 'error' field in bench.json).",
              file=sys.stderr)
    return 1 if failed else 0


def parse_length(text: str) -> int:
    """A length in tokens: 4096, 4K (= 4096) or 1M (= 1,048,576). An argparse ``type``; public so that the scripts
    in benchmarks/ take lengths as `emllm bench` does."""
    units = {"K": 2**10, "M": 2**20}
    cleaned = text.strip().upper().replace("_", "").replace(",", "")
    try:
        if cleaned and cleaned[-1] in units:
            return int(cleaned[:-1]) * units[cleaned[-1]]
        return int(cleaned)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a length in tokens: write e.g. 4096, 4K or 1M.") from None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="emllm", description="EM-LLM episodic memory for Hugging Face LMs.")
    sub = parser.add_subparsers(dest="command", required=True)

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("--model", default=None, help="embedded model name or local HF model dir (default: "
                       "Qwen2.5-Coder-0.5B-Instruct)")
        p.add_argument("--preset", default=DEFAULT_PRESET, choices=list(PRESETS),
                       help=f"method preset (default {DEFAULT_PRESET})")
        p.add_argument("--n-local", dest="n_local", type=int, help="local window tokens")
        p.add_argument("--n-mem", dest="n_mem", type=int, help="retrieved-event token budget")
        p.add_argument("--chunk-size", dest="chunk_size", type=int, help="tokens per forward while reading")
        p.add_argument("--ram-budget-mb", dest="ram_budget_mb", type=float,
                       help="RAM for evicted KV and the event index; rest on disk")
        p.add_argument("--retrieval-scoring", dest="retrieval_scoring", choices=SCORINGS,
                       help="how events are ranked for retrieval (default representatives; see emllm.scoring)")
        p.add_argument("--retrieval-pooling", dest="retrieval_pooling", choices=POOLINGS,
                       help="whose scores rank events for a layer (default none: its own, as in the paper)")
        p.add_argument("--memory-positions", dest="memory_positions", choices=get_args(MemoryPositions),
                       help="where retrieved events sit for RoPE (default fixed, as in the paper; see EMConfig)")
        p.add_argument("--contiguity-neighbours", dest="contiguity_neighbours", type=int,
                       help="events on each side of a retrieved one that come along (default: the preset's; EG: 3)")
        p.add_argument("--full-until", dest="full_until", type=parse_length,
                       help="read inputs up to this many tokens in plain full attention (at most half the model's "
                            "trained length; default 0: never)")

    p_demo = sub.add_parser("demo", help="EM-LLM and RAG side by side on a long real-prose document")
    common(p_demo)
    p_demo.add_argument("--tokens", type=parse_length, default=None,
                        help="document length in tokens (default: 1.05x the model's trained context)")
    p_demo.add_argument("--questions", type=int, default=6, help="facts placed and asked (default 6)")
    p_demo.add_argument("--seed", type=int, default=0)
    p_demo.set_defaults(run=demo)

    p_chat = sub.add_parser("chat", help="read a text file into memory once, then answer questions")
    common(p_chat)
    p_chat.add_argument("--file", required=True, help="path of a UTF-8 text file")
    p_chat.add_argument("--max-new-tokens", type=int, default=256)
    p_chat.add_argument("--reread", action="store_true",
                        help="answer from the retrieved passages re-read as text (better on questions asking for "
                        "several items; a few seconds more per question)")
    p_chat.set_defaults(run=chat)

    p_bench = sub.add_parser("bench", help="tasks x methods x lengths x depths on one model: JSON, markdown, PNGs",
                             description="Runs every task x method x length x depth on one model; writes bench.json, "
                             "bench.md and PNG figures to --out. Each (method, length) runs in its own process so "
                             "its peak RSS is its own. Lengths take K/M suffixes (4K = 4096); past RAM, use "
                             "--ram-budget-mb with --offload-dir.")
    p_bench.add_argument("--model", default=None, help="embedded model name or local HF model dir (default: "
                       "Qwen2.5-Coder-0.5B-Instruct)")
    p_bench.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                         help="weights dtype (default auto: bfloat16 where the CPU or GPU has native bf16, else "
                              "float32); recorded in bench-settings.json as resolved")
    p_bench.add_argument("--tasks", nargs="+", default=list(RULER_TASKS), choices=TASKS,
                         help="RULER families, fact QA, two_hop, three_hop, the held-out chronicle and handwritten "
                              "facts (default: all of them), or the probes with answer lead-ins")
    p_bench.add_argument("--questions", type=int, default=DEFAULT_QUESTIONS,
                         help="questions per RULER document, each asked from a fork of one read (default 20)")
    p_bench.add_argument("--methods", nargs="+", default=list(DEFAULT_METHODS),
                         help="EM-LLM presets (S SM S+C SM+C F ...), full, rag-minilm, rag-mpnet, rag-tuned")
    p_bench.add_argument("--lengths", nargs="+", type=parse_length, default=list(DEFAULT_LENGTHS),
                         help="input lengths in tokens (default 4K 8K 16K 32K 64K 128K)")
    p_bench.add_argument("--depths", nargs="+", type=float, default=list(DEFAULT_DEPTHS),
                         help="answer positions in [0, 1] (default 0.1 0.5 0.9)")
    p_bench.add_argument("--out", default="bench-results", help="output folder (default ./bench-results)")
    p_bench.add_argument("--seed", type=int, default=0)
    p_bench.add_argument("--max-new-tokens", dest="max_new_tokens", type=int,
                         help="tokens to generate per answer (default: the answer's length + 16; "
                              "lists 128)")
    p_bench.add_argument("--full-max-tokens", dest="full_max_tokens", type=parse_length, default=FULL_MAX_TOKENS,
                         help="skip plain full attention above this length (quadratic; default 32K)")
    p_bench.add_argument("--n-local", dest="n_local", type=int, help="EM-LLM: local window tokens")
    p_bench.add_argument("--n-mem", dest="n_mem", type=int, help="EM-LLM: retrieved-event token budget")
    p_bench.add_argument("--chunk-size", dest="chunk_size", type=int, help="EM-LLM: tokens per forward while reading")
    p_bench.add_argument("--retrieval-scoring", dest="retrieval_scoring", choices=SCORINGS,
                         help="EM-LLM: how events are ranked for retrieval (default representatives; see "
                              "emllm.scoring)")
    p_bench.add_argument("--retrieval-pooling", dest="retrieval_pooling", choices=POOLINGS,
                         help="EM-LLM: whose scores rank events for a layer (default none: its own, as in the paper; "
                              "see emllm.scoring)")
    p_bench.add_argument("--memory-positions", dest="memory_positions", choices=get_args(MemoryPositions),
                         help="EM-LLM: where retrieved events sit for RoPE (default fixed, as in the paper; see "
                              "EMConfig)")
    p_bench.add_argument("--contiguity-neighbours", dest="contiguity_neighbours", type=int,
                         help="EM-LLM: events on each side of a retrieved one that come along (default: the preset's)")
    p_bench.add_argument("--full-until", dest="full_until", type=parse_length,
                         help="EM-LLM: read inputs up to this many tokens in plain full attention (at most half "
                              "the model's trained length; default 0: never)")
    p_bench.add_argument("--ram-budget-mb", dest="ram_budget_mb", type=float,
                         help="EM-LLM: RAM for evicted KV and the event index; the rest goes to --offload-dir")
    p_bench.add_argument("--offload-dir", dest="offload_dir", help="EM-LLM: folder for KV pages past the RAM budget")
    p_bench.add_argument("--threads", type=int, help="torch threads per cell (default: torch's own)")
    p_bench.add_argument("--concurrent", type=int, default=1,
                         help="a document's questions answered at once, their decoding batched (the same answers, "
                              "several times faster on a CPU; times are shared, so cost tables use 1, the default)")
    p_bench.add_argument("--resume", action="store_true",
                         help="add to the results already in --out (same settings): measured cells are skipped; the "
                              "report is rewritten after every cell either way")
    p_bench.add_argument("--in-process", dest="in_process", action="store_true",
                         help="run every cell in this process (faster to start; peak RSS then only grows)")
    p_bench.set_defaults(run=bench)
    parts.add_parser(sub)
    serve.add_parser(sub, common, engine_fields)

    args = parser.parse_args(argv)
    if args.run is bench:  # bench reports its own errors, cell by cell
        return bench(args)
    try:
        return args.run(args)
    except (ValueError, TypeError) as error:  # bad settings (ConfigError is a ValueError): one line with the fix
        print(f"emllm {args.command}: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
