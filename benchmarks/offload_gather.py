"""What a retrieval's gather costs when the evicted KV lives in RAM or on disk (EMConfig.ram_budget_mb/offload_dir).

    python benchmarks/offload_gather.py                       # SmolLM2's shape, 64 pages (64K tokens), bf16
    python benchmarks/offload_gather.py --pages 256 --repeats 5

A PageStore with the default model's shape (30 layers, 3 KV heads, head_dim 64; pages of 1,024 tokens for all
layers) holds ``--pages`` sealed pages of random KV, either all in RAM or all on disk (a RAM budget of 0). One
"chunk's retrieval" is what the engine does per reading chunk: every layer gathers its own 2,048 tokens, made of
events of 8-40 tokens at random places (each layer its own set, as each layer retrieves its own). Also timed:
``layer_keys``, every stored key of one layer (attention-scored retrieval reads it). Disk rows are measured twice:
with the pages in the operating system's file cache (just written, or read before) and with the cache dropped first
(posix_fadvise DONTNEED on every page file), as for a memory far larger than the machine's RAM. Prints a markdown
table and writes benchmarks/results/offload_gather.md. A benchmark, not a test: compare rows of one run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from emllm.storage import PageStore
from emllm_integrations.markdown import table as markdown_table

RESULTS = Path(__file__).resolve().parent / "results"
LAYERS, KV_HEADS, HEAD_DIM, PAGE_TOKENS = 30, 3, 64, 1024  # SmolLM2-135M-Instruct
BUDGET_TOKENS = 2048


def retrieval_indices(num_tokens: int, generator: torch.Generator) -> list[torch.Tensor]:
    """Per layer, sorted token positions of random events (8-40 tokens each) filling the retrieval budget."""
    per_layer = []
    for _ in range(LAYERS):
        spans, used = [], 0
        while used < BUDGET_TOKENS:
            size = int(torch.randint(8, 41, (1,), generator=generator))
            start = int(torch.randint(0, num_tokens - size, (1,), generator=generator))
            spans.append(torch.arange(start, start + size))
            used += size
        per_layer.append(torch.unique(torch.cat(spans)))  # sorted, as events are placed in input order
    return per_layer


def drop_file_cache(store: PageStore) -> None:
    """Ask the kernel to forget the cached pages of every page file (they are clean: written and fsynced)."""
    folder = store.disk_dir
    for name in os.listdir(folder) if folder else []:
        fd = os.open(os.path.join(folder, name), os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def measure(pages: int, on_disk: bool, cold: bool, repeats: int, dtype: torch.dtype) -> dict:
    with tempfile.TemporaryDirectory(prefix="offload-gather-") as folder:
        store = PageStore(LAYERS, KV_HEADS, HEAD_DIM, dtype, page_tokens=PAGE_TOKENS,
                          ram_budget_mb=0 if on_disk else None, offload_dir=folder if on_disk else None)
        generator = torch.Generator().manual_seed(0)
        for _ in range(pages):
            store.append(torch.randn(LAYERS, 2, PAGE_TOKENS, KV_HEADS, HEAD_DIM, generator=generator).to(dtype))
        cpu = torch.device("cpu")
        gathers, key_reads = [], []
        for repeat in range(repeats):
            indices = retrieval_indices(store.num_tokens, generator)
            if cold:
                drop_file_cache(store)
            started = time.perf_counter()
            for layer, index in enumerate(indices):
                store.gather(layer, index, cpu)
            gathers.append(time.perf_counter() - started)
            if cold:
                drop_file_cache(store)
            started = time.perf_counter()
            store.layer_keys(repeat % LAYERS, cpu)  # a different layer each time: its own bytes on disk
            key_reads.append(time.perf_counter() - started)
        resident = store.resident_bytes()["ram"]
        store.close()
    return {"pages": pages, "where": ("disk, file cache dropped" if cold else "disk, in the file cache")
            if on_disk else "RAM", "gather_ms": 1000 * statistics.median(gathers),
            "layer_keys_ms": 1000 * statistics.median(key_reads), "ram_mb": resident / 2**20}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pages", type=int, default=64, help="sealed pages of 1,024 tokens (default 64: 64K tokens)")
    parser.add_argument("--repeats", type=int, default=5, help="retrievals timed per row (the median is shown)")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    rows = [measure(args.pages, on_disk, cold, args.repeats, dtype)
            for on_disk, cold in ((False, False), (True, False), (True, True))]
    text = markdown_table(
        ["pages (1,024 tokens)", "KV lives in", "gather, 30 layers x 2,048 tokens (ms)", "layer_keys, one layer (ms)",
         "RAM tier after (MB)"], "rlrrr",
        ([f"{r['pages']:,}", r["where"], f"{r['gather_ms']:.1f}", f"{r['layer_keys_ms']:.1f}", f"{r['ram_mb']:.0f}"]
         for r in rows))
    print(text)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "offload_gather.md").write_text(f"`python benchmarks/offload_gather.py --pages {args.pages} "
                                               f"--repeats {args.repeats} --dtype {args.dtype}` "
                                               f"({time.strftime('%Y-%m-%d')})\n\n{text}\n")


if __name__ == "__main__":
    main()
