"""The engine on a CUDA device: exactness against eager attention, then reading and decoding speed against plain
transformers (SDPA, a KV cache), on randomly initialised models built from configs (weights cannot travel to a lent
GPU; speed and exactness do not need trained ones).

    PYTHONPATH=core:. python benchmarks/cuda_check.py --out results/cuda_check.json [--budget 100]

1. Exactness: a SmolLM2-135M-shaped Llama in float32; an input inside the local window leaves nothing to retrieve,
   so the engine's last-token logits must equal the eager model's (max |difference| reported).
2. Speed: a Llama-3.1-8B-shaped model in bfloat16 at 32K and 128K tokens: EM-LLM presets S and F read the input in
   their chunks (retrieval per chunk and layer, eviction into pages on the device), plain transformers forwards
   512-token chunks over its cache (SDPA); then 16 tokens are decoded. Each run stops after ``--budget`` seconds of
   reading and reports how far it got, so the whole check fits a 10-minute lease.
Event-text scoring (presets E, ER) needs the MiniLM weights, which do not travel: it is measured on CPU.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
import traceback

import torch

SMOL = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
            num_key_value_heads=3, max_position_embeddings=8192, rope_theta=100000.0, tie_word_embeddings=True)
LLAMA_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072, rope_theta=500000.0)


def build(shape: dict, dtype: torch.dtype, device: str, attn: str, seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(**shape, initializer_range=0.02, attn_implementation=attn)
    with torch.device(device):
        model = LlamaForCausalLM(config)
    return model.to(dtype).eval()


def word_tokenizer(vocab: int):
    """A word-level tokenizer over the model's vocabulary ("t0" ... ): the engine reads token ids here, and only
    looks the tokenizer up for end-of-turn ids."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t2"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="t1", unk_token="t2")


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def exactness(device: str) -> dict:
    from emllm import EMConfig, EMEngine

    ids = torch.randint(0, SMOL["vocab_size"], (1, 1500), generator=torch.Generator().manual_seed(1))
    vanilla = build(SMOL, torch.float32, device, "eager")
    with torch.inference_mode():
        reference = vanilla(input_ids=ids.to(device)).logits[0, -1].float()
    del vanilla
    engine = EMEngine(build(SMOL, torch.float32, device, "eager"), word_tokenizer(SMOL["vocab_size"]),
                      EMConfig.from_preset("S"))
    memory = engine.new_memory()
    engine.read(memory, ids[0].tolist())
    diff = (memory.last_logits.float() - reference).abs().max().item()
    memory.close()
    return {"tokens": ids.shape[1], "max_abs_logit_diff": diff, "exact": diff < 1e-3}


def em_speed(model, preset: str, tokens: int, budget: float, device: str) -> dict:
    from emllm import EMConfig, EMEngine

    engine = EMEngine(model, word_tokenizer(LLAMA_8B["vocab_size"]), EMConfig.from_preset(preset))
    memory = engine.new_memory()
    ids = torch.randint(0, LLAMA_8B["vocab_size"], (tokens,), generator=torch.Generator().manual_seed(2))
    chunk = engine.config.chunk_size
    read, started = 0, time.perf_counter()
    while read < tokens and time.perf_counter() - started < budget:
        engine._forward(memory, ids[read:read + chunk], retrieve=True)
        read += chunk
    sync(device)
    seconds = time.perf_counter() - started
    decode = []
    for token in torch.randint(2, LLAMA_8B["vocab_size"], (16,)).tolist():
        t = time.perf_counter()
        engine._forward(memory, torch.tensor([token]), retrieve=True, answering=True)
        sync(device)
        decode.append(time.perf_counter() - t)
    out = {"method": preset, "tokens_asked": tokens, "tokens_read": read, "read_seconds": seconds,
           "read_tokens_per_s": read / seconds, "decode_ms_per_token": 1000 * sorted(decode)[len(decode) // 2],
           "events": memory.num_events, "gpu_peak_gb": torch.cuda.max_memory_allocated() / 2**30
           if device.startswith("cuda") else None}
    memory.close()
    return out


def sdpa_speed(model, tokens: int, budget: float, device: str) -> dict:
    from transformers import DynamicCache

    cache = DynamicCache()
    ids = torch.randint(0, LLAMA_8B["vocab_size"], (1, tokens), generator=torch.Generator().manual_seed(2))
    read, started = 0, time.perf_counter()
    with torch.inference_mode():
        while read < tokens and time.perf_counter() - started < budget:
            piece = ids[:, read:read + 512].to(device)
            model(input_ids=piece, past_key_values=cache, use_cache=True, logits_to_keep=1)
            read += piece.shape[1]
        sync(device)
        seconds = time.perf_counter() - started
        decode = []
        for token in torch.randint(2, LLAMA_8B["vocab_size"], (16,)).tolist():
            t = time.perf_counter()
            model(input_ids=torch.tensor([[token]], device=device), past_key_values=cache, use_cache=True,
                  logits_to_keep=1)
            sync(device)
            decode.append(time.perf_counter() - t)
    return {"method": "sdpa full", "tokens_asked": tokens, "tokens_read": read, "read_seconds": seconds,
            "read_tokens_per_s": read / seconds, "decode_ms_per_token": 1000 * sorted(decode)[len(decode) // 2],
            "gpu_peak_gb": torch.cuda.max_memory_allocated() / 2**30 if device.startswith("cuda") else None}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--budget", type=float, default=100.0, help="seconds of reading per (method, length)")
    parser.add_argument("--lengths", type=int, nargs="+", default=[32768, 131072])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--small", action="store_true", help="a tiny shape, to check the script on a CPU")
    args = parser.parse_args()
    if args.small:
        LLAMA_8B.update(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, vocab_size=512)
        SMOL.update(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, vocab_size=512)
    report: dict = {"device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
                    "torch": torch.__version__, "runs": []}
    try:
        report["exactness"] = exactness(args.device)
    except Exception:
        report["exactness"] = {"error": traceback.format_exc(limit=6)}
    print(json.dumps(report["exactness"]), flush=True)
    for attn, methods in (("sdpa", ["sdpa full"]), ("eager", ["S", "F"])):
        model = build(LLAMA_8B, torch.bfloat16, args.device, attn)
        for length in args.lengths:
            for method in methods:
                if args.device.startswith("cuda"):
                    torch.cuda.reset_peak_memory_stats()
                try:
                    run = (sdpa_speed(model, length, args.budget, args.device) if method == "sdpa full"
                           else em_speed(model, method, length, args.budget, args.device))
                except Exception:
                    run = {"method": method, "tokens_asked": length, "error": traceback.format_exc(limit=6)}
                report["runs"].append(run)
                print(json.dumps(run), flush=True)
                if args.device.startswith("cuda"):
                    torch.cuda.empty_cache()
        del model
    with open(args.out, "w") as handle:
        json.dump(report, handle, indent=1, default=lambda x: None if isinstance(x, float) and math.isnan(x) else x)
    return 0


if __name__ == "__main__":
    sys.exit(main())
