"""Decode ms/token of the default engine with 0, 1, 2 and 4 pinned spans (a tool listing is one), in one run.

    python benchmarks/pinned_decode.py                        # 12K-token document, 48 tokens per answer
    python benchmarks/pinned_decode.py --tokens 32768 --repeats 3

A pinned span's events are put first in every retrieving layer. They change only when events are evicted or pins
change, so the engine computes them once per eviction and hands them to every layer in the forward's plan; the cost
of a decoding step should not grow with the number of pins. The document is read once; each answer is generated from
a fork of it with k spans pinned. Prints a markdown table (the CPU named) and writes <out>.json. A benchmark, not a
test: compare the rows of one run.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
SENTENCE = ("The keeper of the western map room kept the ledgers in order, and every visitor signed the book. "
            "Rain fell on the harbour most evenings while the ferries waited. ")
QUESTION = "\n\nCount from 1 to 60, separated by commas."
SPAN = 16  # tokens per pinned span


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=12288, help="document length in tokens")
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--pins", type=int, nargs="+", default=[0, 1, 2, 4])
    parser.add_argument("--repeats", type=int, default=2, help="answers per row (the median is reported)")
    parser.add_argument("--out", type=Path, default=RESULTS / "pinned_decode")
    args = parser.parse_args()

    from emllm import EMEngine

    engine = EMEngine.from_pretrained(progress=False)
    unit = engine.tokenize(SENTENCE)
    document = (unit * (args.tokens // len(unit) + 1))[:args.tokens]
    memory = engine.new_memory()
    engine.read(memory, document, progress=True)
    prompt = document + engine.tokenize(QUESTION)
    rows = []
    for pins in args.pins:
        times = []
        for _ in range(args.repeats):
            fork = memory.fork()
            for k in range(pins):  # spread through the document, all evicted by now
                start = engine.config.n_init + (k + 1) * (args.tokens // (pins + 1))
                fork.pin(start, start + SPAN)
            result = engine.generate(prompt, memory=fork, max_new_tokens=args.new_tokens)
            times.append(1000 * result.decode_seconds / max(result.output_tokens - 1, 1))
            fork.close()
        times.sort()
        rows.append({"pinned_spans": pins, "decode_ms_token": times[len(times) // 2], "runs": times,
                     "output_tokens": result.output_tokens})
        print(f"pins={pins}: {rows[-1]['decode_ms_token']:.1f} ms/token ({result.output_tokens} tokens)", flush=True)
    memory.close()
    cpu = cpu_name()
    print(f"\n{engine.model_name}, preset {engine.config.preset or 'custom'}, {args.tokens} tokens read, {cpu}\n")
    print("| pinned spans | decode ms/token (median) | runs |\n|---:|---:|---|")
    for row in rows:
        print(f"| {row['pinned_spans']} | {row['decode_ms_token']:.1f} | "
              f"{', '.join(f'{t:.1f}' for t in row['runs'])} |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps({"cpu": cpu, "tokens": args.tokens, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
