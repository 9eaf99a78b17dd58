"""Passkey retrieval (infinity-Bench Retrieve.PassKey format) by method, length and depth, in one run.

    python benchmarks/passkey.py                                  # full, S, SM at 32K, depths 0.1/0.5/0.9
    python benchmarks/passkey.py --lengths 8192 32768 --methods S SM F full --depths 0.25 0.75

Prints a markdown table and writes benchmarks/results/passkey.{json,md}. One engine per method; each
document is read into a fresh memory.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from tqdm.auto import tqdm

from emllm_integrations.markdown import table as markdown_table

RESULTS = Path(__file__).resolve().parent / "results"


def run(methods: list[str], lengths: list[int], depths: list[float], overrides: dict) -> list[dict]:
    from emllm import EMEngine
    from emllm_integrations.bench import config_overrides
    from emllm_integrations.bench.tasks import passkey_document

    rows = []
    grid = [(m, n, d) for m in methods for n in lengths for d in depths]
    engines: dict[str, EMEngine] = {}
    for method, length, depth in tqdm(grid, desc="passkey", unit="doc"):
        if method not in engines:
            engines[method] = EMEngine.from_pretrained(preset=method, progress=False,
                                                       **({} if method == "full" else config_overrides(overrides)))
        engine = engines[method]
        doc = passkey_document(length, depth, engine.count_tokens, seed=int(depth * 1000) + length)
        started = time.perf_counter()
        result = engine.generate(doc.prompt, max_new_tokens=8)
        rows.append({"method": method, "tokens": result.input_tokens, "depth": depth, "answer": doc.answer,
                     "output": result.text.strip(), "correct": doc.answer in result.text,
                     "seconds": time.perf_counter() - started})
        tqdm.write(f"{method:>5} {result.input_tokens:>7,} tokens depth {depth:.2f}: "
                   f"{'correct' if rows[-1]['correct'] else 'wrong'} ({rows[-1]['output']!r})")
    return rows


def table(rows: list[dict]) -> str:
    return markdown_table(
        ["method", "tokens", "depth", "expected", "output", "correct", "seconds"], "lrrlllr",
        ([r["method"], f"{r['tokens']:,}", f"{r['depth']:.2f}", r["answer"], repr(r["output"]),
          "yes" if r["correct"] else "no", f"{r['seconds']:.0f}"] for r in rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--methods", nargs="+", default=["full", "S", "SM"])
    parser.add_argument("--lengths", nargs="+", type=int, default=[32768])
    parser.add_argument("--depths", nargs="+", type=float, default=[0.1, 0.5, 0.9])
    parser.add_argument("--set", nargs="*", default=[], metavar="FIELD=VALUE",
                        help="engine fields for the EM-LLM methods, e.g. n_local=1024 n_mem=1024 "
                             "retrieval_scoring=attention (as emllm bench's flags)")
    args = parser.parse_args()
    overrides = {k: int(v) if v.isdigit() else v for k, v in (item.split("=", 1) for item in args.set)}
    rows = run(args.methods, args.lengths, args.depths, overrides)
    RESULTS.mkdir(exist_ok=True)
    report = table(rows) + f"\n\ncommand: python benchmarks/passkey.py {' '.join(sys.argv[1:])}\n"
    print(report)
    (RESULTS / "passkey.json").write_text(json.dumps(rows, indent=2))
    (RESULTS / "passkey.md").write_text(report)


if __name__ == "__main__":
    main()
