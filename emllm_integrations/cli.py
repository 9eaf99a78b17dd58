"""`emllm demo` (a needle in 32K+ tokens), `emllm chat --file PATH` (ask questions about a text file) and
`emllm bench` (tasks x methods x lengths, with tables and figures; its RAG methods and figures need the extras).

The command line lives beside the adapters, not in the engine: it uses the bench's task builders and harness
(emllm_integrations.bench), and the engine (``emllm``) imports nothing from here."""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import get_args

from emllm.config import DEFAULT_PRESET, PRESETS, MemoryPositions
from emllm.scoring import POOLINGS, SCORINGS

from .bench import (DEFAULT_DEPTHS, DEFAULT_LENGTHS, DEFAULT_METHODS, FULL_MAX_TOKENS, TASKS, BenchRequirementError,
                    BenchSettings, config_overrides, load_done, markdown, peak_rss_mb, run_bench, settings_record,
                    summary, write_report)
from .bench.tasks import passkey_document

ENGINE_OVERRIDES = ("n_local", "n_mem", "chunk_size", "ram_budget_mb", "retrieval_scoring", "retrieval_pooling",
                    "memory_positions")
"""Engine fields the command line can override (flags of the same name; bench.config_overrides turns the retrieval
ones into EMConfig's scorer); one list for demo, chat and bench."""


def _engine_fields(args: argparse.Namespace, *extra: str) -> dict:
    """The engine fields given on the command line (ENGINE_OVERRIDES, then ``extra``), by flag name."""
    return {name: getattr(args, name) for name in (*ENGINE_OVERRIDES, *extra) if getattr(args, name, None) is not None}


def _engine(args: argparse.Namespace):
    from emllm import EMEngine

    print(f"loading {args.model or 'the embedded default model'} (preset {args.preset}) ...", file=sys.stderr)
    return EMEngine.from_pretrained(args.model, preset=args.preset, **config_overrides(_engine_fields(args)))


def demo(args: argparse.Namespace) -> int:
    engine = _engine(args)
    doc = passkey_document(args.tokens, args.depth, engine.count_tokens, seed=args.seed)
    n = engine.count_tokens(doc.prompt)
    trained = engine.shape.max_positions
    print(f"document: {n:,} tokens ({n / trained:.1f}x the model's trained context of {trained:,}); "
          f"a 5-digit pass key is hidden at {doc.depth:.0%} depth.")
    memory = engine.new_memory()
    started = time.perf_counter()
    result = engine.generate(doc.prompt, memory=memory, max_new_tokens=12, progress=True)
    elapsed = time.perf_counter() - started
    stats = memory.stats()
    ok = doc.answer in result.text
    print(f"answer: {result.text.strip()!r}  (expected {doc.answer}: {'correct' if ok else 'WRONG'})")
    print(f"time: {elapsed:.1f} s ({result.prefill_seconds:.1f} s reading at "
          f"{result.new_input_tokens / max(result.prefill_seconds, 1e-9):,.0f} tok/s, "
          f"{result.decode_seconds:.1f} s answering)")
    print(f"events: {stats['events']:,} (mean size {stats['mean_event_size']:.1f} tokens); "
          f"attention spans at most {engine.config.n_init + engine.config.n_mem + engine.config.n_local:,} "
          "+ chunk tokens")
    kv_mb = sum(stats["kv_bytes_resident"].values()) / 2**20
    print(f"memory: {kv_mb:,.0f} MB of evicted KV resident ({stats['tokens_per_tier']}), "
          f"peak RSS {peak_rss_mb():,.0f} MB")
    memory.close()
    return 0 if ok else 1


def chat(args: argparse.Namespace) -> int:
    path = args.file
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
        if not question:
            break
        messages.append({"role": "user", "content": question})
        stream = engine.stream(messages, memory=memory, max_new_tokens=args.max_new_tokens)
        for delta in stream:
            print(delta, end="", flush=True)
        print()
        messages.append({"role": "assistant", "content": stream.result.text})
        if memory.token_ids != engine.chat_ids(messages, add_generation_prompt=False)[: memory.total_tokens]:
            # The answer re-tokenised differently: keep going, with the memory's own history as the record.
            messages[-1]["content"] = engine.tokenizer.decode(stream.result.token_ids, skip_special_tokens=True)
    memory.close()
    return 0


def bench(args: argparse.Namespace) -> int:
    # The extras the requested tasks and methods need are looked for by run_bench before any model loads.
    fields = _engine_fields(args, "offload_dir")
    record = settings_record(BenchSettings(tuple(args.tasks), tuple(args.depths), args.model, args.dtype,
                                           seed=args.seed, max_new_tokens=args.max_new_tokens, engine_fields=fields))
    try:
        if args.resume:
            done = load_done(args.out, record)
        elif os.path.exists(os.path.join(args.out, "bench.json")):
            raise ValueError(f"{args.out} already holds a bench.json: pass --resume to add this run's cells to it "
                             "(cells already measured are skipped), or give another --out.")
        else:
            done = []
        rows = run_bench(args.tasks, args.methods, args.lengths, args.depths, model=args.model, dtype=args.dtype,
                         seed=args.seed, max_new_tokens=args.max_new_tokens, engine_fields=fields,
                         full_max_tokens=args.full_max_tokens, isolate=not args.in_process, threads=args.threads,
                         done=done, on_cell=lambda so_far: write_report(so_far, args.out, record))
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


def _length(text: str) -> int:
    """A length in tokens: 4096, 4K (= 4096) or 1M (= 1,048,576)."""
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
        p.add_argument("--model", default=None, help="embedded model name or local HF model dir (default: SmolLM2)")
        p.add_argument("--preset", default=DEFAULT_PRESET, choices=list(PRESETS),
                       help=f"method preset (default {DEFAULT_PRESET})")
        p.add_argument("--n-local", dest="n_local", type=int, help="local window tokens")
        p.add_argument("--n-mem", dest="n_mem", type=int, help="retrieved-event token budget")
        p.add_argument("--chunk-size", dest="chunk_size", type=int, help="tokens per forward while reading")
        p.add_argument("--ram-budget-mb", dest="ram_budget_mb", type=float, help="RAM for evicted KV; rest on disk")
        p.add_argument("--retrieval-scoring", dest="retrieval_scoring", choices=SCORINGS,
                       help="how events are ranked for retrieval (default representatives; see emllm.scoring)")
        p.add_argument("--retrieval-pooling", dest="retrieval_pooling", choices=POOLINGS,
                       help="whose scores rank events for a layer (default none: its own, as in the paper)")
        p.add_argument("--memory-positions", dest="memory_positions", choices=get_args(MemoryPositions),
                       help="where retrieved events sit for RoPE (default fixed, as in the paper; see EMConfig)")

    p_demo = sub.add_parser("demo", help="find a pass key hidden in a 32K+ token document")
    common(p_demo)
    # S: on this periodic haystack, modularity refinement (SM) does not find the key with SmolLM2-135M yet.
    p_demo.set_defaults(preset="S")
    p_demo.add_argument("--tokens", type=int, default=32_768, help="document length in tokens (default 32768)")
    p_demo.add_argument("--depth", type=float, default=0.5, help="needle depth in [0, 1] (default 0.5)")
    p_demo.add_argument("--seed", type=int, default=0)
    p_demo.set_defaults(run=demo)

    p_chat = sub.add_parser("chat", help="read a text file into memory once, then answer questions")
    common(p_chat)
    p_chat.add_argument("--file", required=True, help="path of a UTF-8 text file")
    p_chat.add_argument("--max-new-tokens", type=int, default=256)
    p_chat.set_defaults(run=chat)

    p_bench = sub.add_parser("bench", help="tasks x methods x lengths x depths on one model: JSON, markdown, PNGs",
                             description="Runs every task x method x length x depth on one model; writes bench.json, "
                             "bench.md and PNG figures to --out. Each (method, length) runs in its own process so "
                             "its peak RSS is its own. Lengths take K/M suffixes (4K = 4096); past RAM, use "
                             "--ram-budget-mb with --offload-dir.")
    p_bench.add_argument("--model", default=None, help="embedded model name or local HF model dir (default: SmolLM2)")
    p_bench.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                         help="weights dtype (default auto: bfloat16 where the CPU or GPU has native bf16, else "
                              "float32); recorded in bench-settings.json as resolved")
    p_bench.add_argument("--tasks", nargs="+", default=list(TASKS), choices=TASKS)
    p_bench.add_argument("--methods", nargs="+", default=list(DEFAULT_METHODS),
                         help="EM-LLM presets (S SM S+C SM+C F ...), full, rag-minilm, rag-mpnet")
    p_bench.add_argument("--lengths", nargs="+", type=_length, default=list(DEFAULT_LENGTHS),
                         help="input lengths in tokens (default 4K 8K 16K 32K 64K 128K)")
    p_bench.add_argument("--depths", nargs="+", type=float, default=list(DEFAULT_DEPTHS),
                         help="answer positions in [0, 1] (default 0.1 0.5 0.9)")
    p_bench.add_argument("--out", default="bench-results", help="output folder (default ./bench-results)")
    p_bench.add_argument("--seed", type=int, default=0)
    p_bench.add_argument("--max-new-tokens", dest="max_new_tokens", type=int,
                         help="tokens to generate per answer (default: the answer's length + 16)")
    p_bench.add_argument("--full-max-tokens", dest="full_max_tokens", type=_length, default=FULL_MAX_TOKENS,
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
    p_bench.add_argument("--ram-budget-mb", dest="ram_budget_mb", type=float,
                         help="EM-LLM: RAM for evicted KV; the rest goes to --offload-dir")
    p_bench.add_argument("--offload-dir", dest="offload_dir", help="EM-LLM: folder for KV pages past the RAM budget")
    p_bench.add_argument("--threads", type=int, help="torch threads per cell (default: torch's own)")
    p_bench.add_argument("--resume", action="store_true",
                         help="add to the results already in --out (same settings): measured cells are skipped; the "
                              "report is rewritten after every cell either way")
    p_bench.add_argument("--in-process", dest="in_process", action="store_true",
                         help="run every cell in this process (faster to start; peak RSS then only grows)")
    p_bench.set_defaults(run=bench)

    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
