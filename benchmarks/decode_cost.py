"""Decoding cost of presets answering the same questions over the same document, measured in one process.

A preset's decode ms/token from separate `emllm bench` runs mixes in each run's machine load (these machines are
noisy) and its own answers' lengths. Here every preset reads the same document into its own memory (a memory takes
its preset's config, so one engine serves them all), then the presets take turns: each round asks every question of
every preset, the order of presets reversed every other round so neither always runs first. Each question is a chat
turn from a fork of the preset's memory with the same decoding budget; the figure is decode seconds over tokens
decoded, summed over a preset's questions and rounds, and the ratio to the first preset is taken within the run.

    HF_HUB_OFFLINE=1 python benchmarks/decode_cost.py --presets E EG --length 16K --questions 4 --rounds 2 \
        --json benchmarks/results/decode_cost/e_eg_16k.json
"""

from __future__ import annotations

import argparse
import json
import pathlib
import time

from tqdm.auto import tqdm

from emllm import EMConfig, shared_engine
from emllm_integrations.bench.measure import common_prefix, peak_rss_mb
from emllm_integrations.bench.ruler import family_document
from emllm_integrations.cli import parse_length
from emllm_integrations.markdown import table as markdown_table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--presets", nargs="+", default=["E", "EG"],
                        help="the first is the one ratios are taken to; NAME:field=N,... changes a preset's fields")
    parser.add_argument("--task", default="fact_qa", help="the document family (emllm bench's task names)")
    parser.add_argument("--length", type=parse_length, default=16384, help="document tokens, e.g. 16K")
    parser.add_argument("--questions", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--new", type=int, default=32, help="tokens each answer may decode")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=pathlib.Path, default=None, help="write the figures here too")
    args = parser.parse_args()

    engine = shared_engine()
    engine.generate("Warm up: the first forward pass of a process is slower.", max_new_tokens=2)
    doc = family_document(args.task, args.length, engine.count_tokens, questions=args.questions, seed=args.seed)
    prompts = [engine.chat_ids([{"role": "user", "content": f"{doc.context}\n\n{q.question}"}])
               for q in doc.questions]
    shared = min(common_prefix(prompts[0], ids) for ids in prompts[1:]) if len(prompts) > 1 else len(prompts[0]) - 1
    memories, read_seconds = {}, {}
    for preset in tqdm(args.presets, desc="reading the document"):
        memories[preset] = engine.new_memory(preset_config(preset))
        started = time.perf_counter()
        engine.read(memories[preset], prompts[0][:shared])
        read_seconds[preset] = time.perf_counter() - started
    spent = {preset: [0.0, 0] for preset in args.presets}
    with tqdm(total=args.rounds * len(args.presets) * len(prompts), desc="answering") as bar:
        for round_ in range(args.rounds):
            for preset in args.presets[::-1] if round_ % 2 else args.presets:
                for ids in prompts:
                    fork = memories[preset].fork()
                    try:
                        result = engine.generate(ids, memory=fork, max_new_tokens=args.new)
                    finally:
                        fork.close()
                    spent[preset][0] += result.decode_seconds
                    spent[preset][1] += result.output_tokens
                    bar.update()
    for memory in memories.values():
        memory.close()
    first = spent[args.presets[0]][0] / spent[args.presets[0]][1]
    rows = [{"preset": preset, "tokens": len(prompts[0]), "read_s": read_seconds[preset], "decoded": count,
             "decode_ms_token": 1000 * seconds / count, "ratio": seconds / count / first}
            for preset, (seconds, count) in spent.items()]
    print(markdown_table(["preset", "document tokens", "read s", "tokens decoded", "decode ms/token",
                          f"/ {args.presets[0]}"], "lrrrrr",
                         ([r["preset"], f"{r['tokens']:,}", f"{r['read_s']:.1f}", f"{r['decoded']:,}",
                           f"{r['decode_ms_token']:.1f}", f"{r['ratio']:.2f}x"] for r in rows)))
    print(f"peak RSS {peak_rss_mb():,.0f} MB")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"settings": {k: str(v) for k, v in vars(args).items()}, "rows": rows},
                                        indent=1))


def preset_config(spec: str) -> EMConfig:
    """A preset by name, with integer fields changed after a colon: "EG:full_until=0" is EG read without full
    attention, so a preset's costs can be set against its own variants in one run."""
    name, _, changes = spec.partition(":")
    fields = dict(change.split("=", 1) for change in changes.split(",") if change)
    return EMConfig.from_preset(name, **{field: int(value) for field, value in fields.items()})


if __name__ == "__main__":
    main()
