"""A million tokens with disk offload against plain transformers, in one run (issue 35's goals).

    python benchmarks/million.py                                   # SmolLM2, preset E, 1M tokens, 2 GB RAM budget
    python benchmarks/million.py --tokens 131072 --out /tmp/m128k  # a rehearsal
    python benchmarks/million.py --redo reference short            # rerun parts whose cores were shared

Three parts, each in its own process so its peak RSS is its own, all on one pass-key document (depth 0.5):
1. plain transformers (sdpa), the limit: the document's first --reference tokens forwarded in 512-token chunks over a
   DynamicCache, then 16 single-token steps (median ms/token). A million tokens of SmolLM2's KV is ~23 GB, so the
   limit runs at a length it can hold and its per-token time is the yardstick.
2. the engine (same preset and budget) on a document of --reference tokens: read, answer, decode ms/token.
3. the engine on --tokens: read in --segment pieces (tokens/s, RSS and KV tiers after each, written as it goes to
   <out>/segments.jsonl, so a stopped run still shows where the time went), then the question: answer, decode
   ms/token, peak RSS.
Writes <out>/million.{json,md} and <out>/million.png. SmolLM2 rather than the default Qwen2.5-Coder-0.5B: a million
tokens of the 0.5B would take about three times as long, more than a session of this machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def status_mb(field: str) -> float:
    """A memory figure of this process from /proc/self/status (VmRSS now, VmHWM the peak since the last reset)."""
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith(f"{field}:")) / 1024


def current_rss_mb() -> float:
    return status_mb("VmRSS")


def reset_peak_rss() -> None:
    """Start a new peak (VmHWM) for this process: each read segment and the answer report their own."""
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")


def peak_since_reset_mb() -> float:
    return status_mb("VmHWM")


def document(count_tokens, tokens: int):
    from emllm_integrations.bench.tasks import passkey_document

    return passkey_document(tokens, 0.5, count_tokens, seed=500 + tokens)


def reference(args) -> dict:
    """Plain transformers over the first --reference tokens of the engine's own encoding of the document."""
    import torch
    from transformers import DynamicCache

    from emllm import EMEngine
    from emllm.models import load_model
    from emllm_integrations.bench import peak_rss_mb

    engine = EMEngine.from_pretrained(args.model, preset=args.preset, progress=False)
    ids = engine.encode_prompt(document(engine.count_tokens, args.reference).prompt).ids[:args.reference]
    model = load_model(args.model, progress=False)[0]  # a copy of its own: the engine's routes attention to a memory
    cache, tensor = DynamicCache(), torch.tensor([ids])
    with torch.inference_mode():
        model(input_ids=tensor[:, :512], past_key_values=DynamicCache(), use_cache=True, logits_to_keep=1)  # warm-up
        started = time.perf_counter()
        for start in range(0, len(ids), 512):
            model(input_ids=tensor[:, start:start + 512], past_key_values=cache, use_cache=True, logits_to_keep=1)
        seconds = time.perf_counter() - started
        steps = []
        for token in ids[:16]:
            t = time.perf_counter()
            model(input_ids=torch.tensor([[token]]), past_key_values=cache, use_cache=True, logits_to_keep=1)
            steps.append(time.perf_counter() - t)
    return {"part": "plain transformers (sdpa)", "tokens": len(ids), "read_s": seconds,
            "read_ms_token": 1000 * seconds / len(ids), "decode_ms_token": 1000 * statistics.median(steps),
            "peak_rss_mb": peak_rss_mb()}


def engine_run(args, tokens: int, log: Path | None) -> dict:
    from tqdm.auto import tqdm

    from emllm import EMEngine

    engine = EMEngine.from_pretrained(args.model, preset=args.preset, progress=False,
                                      ram_budget_mb=args.ram_budget_mb, offload_dir=args.offload_dir)
    doc = document(engine.count_tokens, tokens)
    encoded = engine.encode_prompt(doc.prompt)
    body = encoded.ids[:encoded.question_start]
    memory = engine.new_memory()
    read_s, segment = 0.0, args.segment if log is not None else len(body)
    run_peak = 0.0  # each reset of VmHWM (and of getrusage's maxrss with it) ends a peak: the run's is their max
    with tqdm(total=len(body), desc=f"reading {tokens:,}", unit="tok", unit_scale=True) as bar:
        for start in range(0, len(body), segment):
            piece = body[start:start + segment]
            run_peak = max(run_peak, peak_since_reset_mb())
            reset_peak_rss()
            t = time.perf_counter()
            engine.read(memory, piece)
            seconds = time.perf_counter() - t
            read_s += seconds
            bar.update(len(piece))
            if log is not None:
                row = {"read_tokens": start + len(piece), "segment_tok_s": len(piece) / seconds,
                       "rss_mb": current_rss_mb(), "peak_rss_mb": peak_since_reset_mb(), "events": memory.num_events,
                       **memory.store.tier_tokens()}
                with log.open("a") as out:
                    out.write(json.dumps(row) + "\n")
    # Asked with the prompt as encoded above (README: a long document is tokenised once): the text tokenised again
    # was a ~420 MB transient of the tokenizer at 1M tokens, the whole run's peak. answer_peak_rss_mb tells this
    # step's peak from the read's.
    run_peak = max(run_peak, peak_since_reset_mb())
    reset_peak_rss()
    result = engine.generate(encoded, memory=memory, max_new_tokens=16)
    answer_peak = peak_since_reset_mb()
    stats = memory.stats()
    memory.close()
    return {"part": f"engine {args.preset}", "tokens": result.input_tokens, "read_s": read_s + result.prefill_seconds,
            "read_ms_token": 1000 * (read_s + result.prefill_seconds) / result.input_tokens,
            "decode_ms_token": 1000 * result.decode_seconds / max(result.output_tokens, 1),
            "answer": doc.answer, "output": result.text.strip(), "correct": doc.answer in result.text,
            "events": stats["events"], "peak_rss_mb": max(run_peak, answer_peak), "answer_peak_rss_mb": answer_peak}


def child(part: str, args: argparse.Namespace) -> dict:
    command = [sys.executable, __file__, "--part", part, *sys.argv[1:]]
    done = subprocess.run(command, stdout=subprocess.PIPE, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    if done.returncode != 0:
        return {"part": part, "error": f"exit {done.returncode}"}
    return json.loads(done.stdout.strip().splitlines()[-1])


def report(rows: list[dict], args: argparse.Namespace) -> str:
    from emllm_integrations.markdown import table

    lines = [table(["part", "tokens", "read s", "read ms/token", "decode ms/token", "peak RSS MB", "answer"],
                   "lrrrrrl",
                   ([r["part"], f"{r.get('tokens', 0):,}", f"{r.get('read_s', 0):,.0f}",
                     f"{r.get('read_ms_token', 0):.2f}", f"{r.get('decode_ms_token', 0):.1f}",
                     f"{r.get('peak_rss_mb', 0):,.0f}",
                     r.get("error") or (f"{r['output']!r} ({'correct' if r['correct'] else 'wrong'})"
                                        if "output" in r else "")] for r in rows))]
    limit, short, long = rows
    if all("error" not in r for r in rows):
        lines += ["", f"- read per token at {long['tokens']:,} / plain transformers at {limit['tokens']:,}: "
                  f"{long['read_ms_token'] / limit['read_ms_token']:.2f}x (goal <= 1.5)",
                  f"- decode at {long['tokens']:,} / engine at {short['tokens']:,}: "
                  f"{long['decode_ms_token'] / short['decode_ms_token']:.2f}x, / plain transformers at "
                  f"{limit['tokens']:,}: {long['decode_ms_token'] / limit['decode_ms_token']:.2f}x (goal <= 2)",
                  f"- peak RSS at {long['tokens']:,} with a {args.ram_budget_mb:,} MB RAM budget: "
                  f"{long['peak_rss_mb']:,.0f} MB (goal <= 4,096)"]
    return "\n".join(lines) + f"\n\ncommand: python benchmarks/million.py {' '.join(sys.argv[1:])}\n"


def plot(log: Path, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(line) for line in log.read_text().splitlines()]
    x = [r["read_tokens"] for r in rows]
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    axes[0].plot(x, [r["segment_tok_s"] for r in rows], marker=".")
    axes[0].set_title("read tokens/s per segment")
    axes[1].plot(x, [r["rss_mb"] for r in rows], marker=".", label="at the segment's end")
    if all("peak_rss_mb" in r for r in rows):
        axes[1].plot(x, [r["peak_rss_mb"] for r in rows], marker=".", label="peak during the segment")
    axes[1].axhline(4096, color="grey", linestyle="--", linewidth=1, label="goal (4 GB)")
    axes[1].legend(fontsize=8)
    axes[1].set_title("RSS (MB)")
    for ax in axes:
        ax.set_xlabel("tokens read")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=["reference", "short", "long"], help=argparse.SUPPRESS)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--preset", default="E")
    parser.add_argument("--tokens", type=int, default=1_048_576)
    parser.add_argument("--reference", type=int, default=8192, help="length plain transformers and the short run read")
    parser.add_argument("--segment", type=int, default=65_536, help="tokens per timed piece of the long read")
    parser.add_argument("--ram-budget-mb", type=int, default=2048)
    parser.add_argument("--offload-dir", default="/tmp/emllm-1m")
    parser.add_argument("--out", type=Path, default=RESULTS / "million")
    parser.add_argument("--redo", nargs="+", choices=["reference", "short", "long"],
                        help="rerun only these parts (say the cores were shared while they ran), keeping the others' "
                             "rows from --out's million.json")
    args = parser.parse_args()
    if args.redo and args.part is None and not (args.out / "million.json").exists():
        parser.error(f"--redo keeps the other parts' rows from {args.out / 'million.json'}, which does not exist: "
                     "run all three parts first, or point --out at an earlier run.")
    if args.part == "reference":
        print(json.dumps(reference(args)))
        return
    if args.part is not None:
        log = args.out / "segments.jsonl" if args.part == "long" else None
        print(json.dumps(engine_run(args, args.tokens if args.part == "long" else args.reference, log)))
        return
    args.out.mkdir(parents=True, exist_ok=True)
    parts = ("reference", "short", "long")
    if args.redo:  # the other parts' rows are kept from the last run in --out
        rows = json.loads((args.out / "million.json").read_text())
    else:
        rows = [{}] * len(parts)
        (args.out / "segments.jsonl").unlink(missing_ok=True)
    for i, part in enumerate(parts):
        if args.redo and part not in args.redo:
            continue
        rows[i] = child(part, args)
        print(json.dumps(rows[i]), file=sys.stderr, flush=True)
    text = report(rows, args)
    print(text)
    (args.out / "million.json").write_text(json.dumps(rows, indent=2))
    (args.out / "million.md").write_text(text)
    if (args.out / "segments.jsonl").exists():
        plot(args.out / "segments.jsonl", args.out / "million.png")


if __name__ == "__main__":
    main()
