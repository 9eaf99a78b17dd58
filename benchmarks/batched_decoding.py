"""Many conversations at once: aggregate decoding speed of N conversations decoding together (one forward per step
for all of them, emllm.batching) against the same conversations decoded one at a time, and whether the answers are
the same token for token.

Each conversation is its own document (a different essay-like text past the model's local window, so every step
retrieves from its memory) and its own question; all are read first, then timed from their last prompt token on:

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/batched_decoding.py --conversations 8 --tokens 3000 --new 48

Sequential: each conversation generates alone (tokens / summed decode seconds). Together: one thread per
conversation, all started at once (total tokens / wall seconds); the engine's StepBatcher merges their steps.

``--reference`` also decodes the same prompts with plain transformers (the same weights under SDPA, a KV cache of
the whole prompt, no memory), alone and as one left-padded batch: the ratio batching alone gives on this machine,
which bounds what batched memories can reach.
"""

from __future__ import annotations

import argparse
import json
import threading
import time

import torch
from tqdm.auto import tqdm

from emllm import shared_engine
from emllm.models import resolve_model_dir
from emllm_integrations.bench.ruler import family_document

QUESTION = "Describe in detail everything the text says about the people in it."


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model name, directory or hub id (default: the default model)")
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=3000, help="document tokens per conversation")
    parser.add_argument("--new", type=int, default=48, help="tokens generated per conversation")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--json", default=None, help="write the figures here too")
    parser.add_argument("--reference", action="store_true",
                        help="also time plain transformers on the same prompts, alone and batched")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    engine = shared_engine(args.model, dtype=args.dtype)
    prompts, read = [], []
    for i in tqdm(range(args.conversations), desc="reading the documents"):
        doc = family_document("fact_qa", args.tokens, engine.count_tokens, questions=1, seed=100 + i)
        ids = engine.chat_ids([{"role": "user", "content": f"{doc.context}\n\n{QUESTION}"}])
        memory = engine.new_memory()
        engine.read(memory, ids)
        prompts.append(ids)
        read.append(memory)

    sequential, seconds = [], 0.0
    for ids, memory in tqdm(list(zip(prompts, read)), desc="one at a time"):
        result = engine.generate(ids, memory=memory.fork(), max_new_tokens=args.new)
        sequential.append(result.token_ids)
        seconds += result.decode_seconds
    one_rate = sum(map(len, sequential)) / seconds

    together: list[list[int] | None] = [None] * len(prompts)
    forks = [memory.fork() for memory in read]
    engine.batcher.batch_sizes = []

    def answer(i: int) -> None:
        together[i] = engine.generate(prompts[i], memory=forks[i], max_new_tokens=args.new).token_ids

    threads = [threading.Thread(target=answer, args=(i,)) for i in range(len(prompts))]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - started
    together_rate = sum(map(len, together)) / wall
    sizes = engine.batcher.batch_sizes
    figures = {
        "model": engine.model_name, "dtype": str(engine.shape.dtype), "threads": torch.get_num_threads(),
        "conversations": len(prompts), "document_tokens": args.tokens, "new_tokens": args.new,
        "prompt_tokens": [len(p) for p in prompts],
        "one_at_a_time_tokens_per_s": round(one_rate, 2), "together_tokens_per_s": round(together_rate, 2),
        "ratio": round(together_rate / one_rate, 2),
        "same_tokens": sum(a == b for a, b in zip(sequential, together)),
        "mean_rows_per_forward": round(sum(sizes) / max(1, len(sizes)), 2),
        "generated": [len(t) for t in together],
    }
    print(f"{engine.model_name} ({figures['dtype']}, {figures['threads']} threads), {len(prompts)} conversations "
          f"of ~{args.tokens} tokens, {args.new} new tokens each")
    print("| decoding | tokens/s | ratio |\n|---|---:|---:|")
    print(f"| one at a time | {one_rate:.2f} | 1.00 |")
    print(f"| together ({figures['mean_rows_per_forward']} rows per forward) | {together_rate:.2f} | "
          f"{figures['ratio']:.2f} |")
    print(f"same tokens as one at a time: {figures['same_tokens']}/{len(prompts)} conversations")
    if args.reference:
        alone, batched = plain_transformers_rates(resolve_model_dir(args.model), prompts, args.new, engine.shape.dtype)
        figures["plain_transformers"] = {"alone_tokens_per_s": round(alone, 2),
                                         "batched_tokens_per_s": round(batched, 2),
                                         "ratio": round(batched / alone, 2)}
        print(f"| plain transformers, alone | {alone:.2f} | 1.00 |")
        print(f"| plain transformers, one batch of {len(prompts)} | {batched:.2f} | {batched / alone:.2f} |")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(figures, fh, indent=1)


@torch.inference_mode()
def plain_transformers_rates(model_dir, prompts: list[list[int]], new: int,
                             dtype: torch.dtype) -> tuple[float, float]:
    """Greedy decoding tokens/s of a plain transformers model (SDPA, a KV cache of the whole prompt): each prompt
    alone, then all of them as one left-padded batch. Only decoding steps are timed; every row decodes ``new``."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation="sdpa").eval()

    def decode_seconds(rows: list[list[int]]) -> float:
        width = max(map(len, rows))
        ids = torch.tensor([[0] * (width - len(r)) + r for r in rows])                      # (B, T) left-padded
        mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])         # (B, T)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)                                     # (B, T)
        out = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True)
        cache, token = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)     # (B, 1)
        started = time.perf_counter()
        for _ in range(new - 1):
            mask = torch.cat([mask, mask.new_ones(len(rows), 1)], dim=1)
            positions = positions[:, -1:] + 1
            out = model(input_ids=token, attention_mask=mask, position_ids=positions, past_key_values=cache,
                        use_cache=True)
            cache, token = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
        return time.perf_counter() - started

    steps = new - 1
    alone = len(prompts) * steps / sum(decode_seconds([p]) for p in tqdm(prompts, desc="plain, alone"))
    batched = len(prompts) * steps / decode_seconds(prompts)
    return alone, batched


if __name__ == "__main__":
    main()
