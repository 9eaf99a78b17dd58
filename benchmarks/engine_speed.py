"""Prefill tokens/s, decode ms/token and peak RSS of the engine by preset and input length, in one run.

    python benchmarks/engine_speed.py                       # S, SM, SM+C, F at 8K/32K/128K; full up to 32K
    python benchmarks/engine_speed.py --lengths 8192 32768 --presets S F
    python benchmarks/engine_speed.py --dtype float32 --out benchmarks/results/engine_speed_float32

Each (preset, length) runs in its own process so peak RSS is its own. Prints a markdown table, writes
<out>.{json,md,png} (default benchmarks/results/engine_speed). --dtype is the model's (default: its checkpoint's,
bfloat16 for SmolLM2); the full table (`emllm bench`) runs in float32 on CPUs without bf16 arithmetic, so its times
compare with a float32 run of this script. A benchmark, not a test: numbers vary with machine load, so compare ratios
taken within one run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from emllm_integrations.bench import peak_rss_mb
from emllm_integrations.markdown import table as markdown_table

RESULTS = Path(__file__).resolve().parent / "results"
HAYSTACK = ("The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
            "Episodic memory cuts a long text into events where the model is surprised. ")


def measure(preset: str, length: int, decode_tokens: int, dtype: str) -> dict:
    """Runs inside the child process."""
    from emllm import EMEngine

    engine = EMEngine.from_pretrained(preset=preset, dtype=dtype, progress=False)
    unit = engine.tokenize(HAYSTACK)
    ids = (unit * (length // len(unit) + 1))[:length]
    memory = engine.new_memory()
    engine.read(memory, ids[:engine.config.chunk_size])  # warm-up chunk, not timed
    started = time.perf_counter()
    engine.read(memory, ids[engine.config.chunk_size:], progress=True)
    prefill = time.perf_counter() - started
    result = engine.generate(ids, memory=memory, max_new_tokens=decode_tokens)
    stats = memory.stats()
    return {
        "preset": preset, "tokens": length, "dtype": str(engine.model.dtype).removeprefix("torch."),
        "prefill_tok_s": (length - engine.config.chunk_size) / prefill,
        "prefill_s": prefill,
        "decode_ms_token": 1000 * result.decode_seconds / max(result.output_tokens, 1),
        "peak_rss_mb": peak_rss_mb(),
        "events": stats["events"], "mean_event_size": stats["mean_event_size"],
    }


def run_child(preset: str, length: int, decode_tokens: int, dtype: str) -> dict:
    command = [sys.executable, __file__, "--child", preset, str(length), str(decode_tokens), dtype]
    done = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    if done.returncode != 0:
        return {"preset": preset, "tokens": length, "error": done.stderr.strip().splitlines()[-1:]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def table(rows: list[dict]) -> str:
    return markdown_table(
        ["preset", "tokens", "prefill tok/s", "decode ms/token", "peak RSS MB", "events", "mean event"], "lrrrrrr",
        ([r["preset"], f"{r['tokens']:,}", f"failed: {r['error']}", "", "", "", ""] if "error" in r else
         [r["preset"], f"{r['tokens']:,}", f"{r['prefill_tok_s']:,.0f}", f"{r['decode_ms_token']:.1f}",
          f"{r['peak_rss_mb']:,.0f}", f"{r['events']:,}", f"{r['mean_event_size']:.1f}"] for r in rows))


def goals(rows: list[dict]) -> str:
    by = {(r["preset"], r["tokens"]): r for r in rows if "error" not in r}
    lengths = sorted({r["tokens"] for r in rows})
    lo, hi = lengths[0], lengths[-1]
    out = []

    def ratio(a, b, key):
        return by[a][key] / by[b][key] if a in by and b in by else float("nan")

    out.append(f"- S prefill throughput at {hi:,} / at {lo:,}: {ratio(('S', hi), ('S', lo), 'prefill_tok_s'):.2f}x "
               "(goal >= 0.8)")
    # (label, slower preset, faster preset, goal): time ratios, listed only where this run has both presets.
    comparisons = (("time SM / S", "SM", "S", 1.15), ("S / F", "S", "F", 1.05))
    for length in lengths:
        texts = [f"{label} = {ratio((fast, length), (slow, length), 'prefill_tok_s'):.2f}x (goal <= {goal})"
                 for label, slow, fast, goal in comparisons if (slow, length) in by and (fast, length) in by]
        if texts:
            out.append(f"- at {length:,}: " + ", ".join(texts))
    out.append(f"- S decode ms/token at {hi:,} / at {lo:,}: "
               f"{ratio(('S', hi), ('S', lo), 'decode_ms_token'):.2f}x (goal <= 1.5)")
    return "\n".join(out)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for preset in dict.fromkeys(r["preset"] for r in rows):
        mine = [r for r in rows if r["preset"] == preset and "error" not in r]
        x = [r["tokens"] for r in mine]
        for ax, key in zip(axes, ("prefill_tok_s", "decode_ms_token", "peak_rss_mb")):
            ax.plot(x, [r[key] for r in mine], marker="o", label=preset)
    for ax, title in zip(axes, ("prefill tokens/s", "decode ms/token", "peak RSS (MB)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("input tokens")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        print(json.dumps(measure(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5])))
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--presets", nargs="+", default=["S", "SM", "SM+C", "F", "full"])
    parser.add_argument("--lengths", nargs="+", type=int, default=[8192, 32768, 131072])
    parser.add_argument("--full-max", type=int, default=32768, help="longest input for plain full attention")
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                        help="model dtype (auto: the checkpoint's)")
    parser.add_argument("--out", type=Path, default=RESULTS / "engine_speed",
                        help="path prefix of the .json, .md and .png written")
    args = parser.parse_args()
    rows = []
    for length in args.lengths:
        for preset in args.presets:
            if preset == "full" and length > args.full_max:
                continue
            print(f"{preset} at {length:,} tokens ...", file=sys.stderr, flush=True)
            rows.append(run_child(preset, length, args.decode_tokens, args.dtype))
            print(table(rows[-1:]).splitlines()[-1], file=sys.stderr, flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    report = table(rows) + "\n\n" + goals(rows)
    print(report)
    args.out.with_suffix(".json").write_text(json.dumps(rows, indent=2))
    args.out.with_suffix(".md").write_text(report + "\n")
    plot(rows, args.out.with_suffix(".png"))


if __name__ == "__main__":
    main()
