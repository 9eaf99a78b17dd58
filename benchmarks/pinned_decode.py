"""Decode ms/token of the default engine with 0, 1, 2 and 4 pinned spans (a tool listing is one), in one run.

    python benchmarks/pinned_decode.py                        # 12K-token document, 48 tokens per answer
    python benchmarks/pinned_decode.py --tokens 32768 --repeats 3
    python benchmarks/pinned_decode.py --tiny                 # a random 24-layer model (the default's tokenizer and
                                                              # layer count, tiny widths): the per-token bookkeeping
                                                              # shows where the model's arithmetic would hide it

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


def tiny_engine():
    """The default model's tokenizer and 24 layers, random weights of width 64: a decoding step costs little, so what
    a step does besides the model's arithmetic is what the table shows."""
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    from emllm import EMEngine
    from emllm.models import resolve_model_dir

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_dir(None, progress=False))
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=24,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32768,
                         eos_token_id=tokenizer.eos_token_id)
    engine = EMEngine(Qwen2ForCausalLM(config).eval(), tokenizer, model_name="random-qwen2-24x64")
    engine.eos_ids = set()  # random weights: answer for exactly --new-tokens tokens
    return engine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=12288, help="document length in tokens")
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--pins", type=int, nargs="+", default=[0, 1, 2, 4])
    parser.add_argument("--repeats", type=int, default=2, help="answers per row (the median is reported)")
    parser.add_argument("--tiny", action="store_true", help="a randomly initialised model of the default's tokenizer "
                        "and layer count with tiny widths, instead of the default model")
    parser.add_argument("--out", type=Path, default=RESULTS / "pinned_decode")
    args = parser.parse_args()

    from emllm import DEFAULT_PRESET, EMEngine

    engine = tiny_engine() if args.tiny else EMEngine.from_pretrained(progress=False)
    text = SENTENCE * (args.tokens // len(engine.tokenize(SENTENCE)) + 1)
    prompt = engine.encode_prompt([{"role": "user", "content": text + QUESTION}])  # a chat, as users send it
    if prompt.question_start is None:
        raise SystemExit("the prompt has no question to split off: check QUESTION")
    memory = engine.new_memory()
    engine.read(memory, prompt.ids[:prompt.question_start], progress=True)  # the document, read once
    rows = []
    for pins in args.pins:
        times = []
        for _ in range(args.repeats):
            fork = memory.fork()
            for k in range(pins):  # spread through the document, all evicted by now
                start = engine.config.n_init + (k + 1) * ((prompt.question_start - 4096) // (pins + 1))
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
    print(f"\n{engine.model_name}, preset {DEFAULT_PRESET}, {prompt.question_start} tokens read, {cpu}\n")
    print("| pinned spans | decode ms/token (median) | runs |\n|---:|---:|---|")
    for row in rows:
        print(f"| {row['pinned_spans']} | {row['decode_ms_token']:.1f} | "
              f"{', '.join(f'{t:.1f}' for t in row['runs'])} |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps({"cpu": cpu, "tokens": args.tokens, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
