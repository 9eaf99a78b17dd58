"""Does retrieval bring the needle into attention? Essay needles read with each retrieval scoring, per layer.

    python benchmarks/retrieval_scoring.py                        # 16K tokens, depths 0.1/0.5/0.9, preset S
    python benchmarks/retrieval_scoring.py --tokens 32768 --depths 0.5

For every depth and variant ("representatives": the paper's k-NN over one vector per event; "attention": events
ranked by the attention the queries give their stored tokens; "attention, keys from pages": the same ranking with a
RAM budget too large to matter, which turns off the float32 copy of the stored keys so every retrieval reads them
from the store's pages, as before the copy existed), the needle document (Paul Graham essays, a 7-digit number) is
read, then the question with the start of its answer. The table gives how many of the model's layers hold the
needle's event in attention when the answer starts, the answer, and the seconds: reading (the question included),
answering, and decoding per token (a retrieval per token per layer). The haystack is read once per variant and
forked per depth (EMEngine.read_each). Writes benchmarks/results/retrieval_scoring.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from tqdm.auto import tqdm

from emllm_integrations.markdown import table as markdown_table

RESULTS = Path(__file__).resolve().parent / "results"
VARIANTS = {  # name -> EMConfig fields
    "representatives": {"retrieval_scoring": "representatives"},
    "attention": {"retrieval_scoring": "attention"},
    "attention, keys from pages": {"retrieval_scoring": "attention", "ram_budget_mb": 1e6},
}


def run(tokens: int, depths: list[float], preset: str) -> list[dict]:
    from emllm import EMEngine
    from emllm.tasks import needle_document
    from emllm_integrations.prompts import probe_suffix

    engine = EMEngine.from_pretrained(preset=preset)
    docs = [needle_document(tokens, depth, engine.count_tokens, seed=7) for depth in depths]
    prompts = [engine.tokenize(doc.context + probe_suffix(doc.question, doc.answer_lead)) for doc in docs]
    # The needle's token span: tokens before it, and through its end (a boundary token may straddle; spans overlap).
    spans = [(engine.count_tokens(doc.context[:doc.needle_offset]),
              engine.count_tokens(doc.context[:doc.needle_offset + len(doc.needle)])) for doc in docs]
    rows = []
    with tqdm(total=len(VARIANTS) * len(docs), desc="retrieval scoring", unit="doc") as bar:
        for variant, fields in VARIANTS.items():
            config = engine.config.replace(**fields)
            for (memory, read_seconds), doc, ids, (first, last) in zip(engine.read_each(prompts, config=config),
                                                                       docs, prompts, spans):
                layers = sum(event.layers for event in memory.retrieved_events()
                             if event.start < last and event.end > first)
                num_layers = len(memory.layers)
                started = time.perf_counter()
                answer = engine.generate(ids, memory=memory, max_new_tokens=10)
                answer_seconds = time.perf_counter() - started
                memory.close()
                rows.append({"variant": variant, "tokens": len(ids), "depth": doc.depth, "expected": doc.answer,
                             "needle_layers": layers, "num_layers": num_layers,
                             "output": answer.text.strip(), "correct": doc.answer in answer.text,
                             "read_seconds": read_seconds, "answer_seconds": answer_seconds,
                             "decode_ms_per_token": 1000 * answer.decode_seconds / max(1, len(answer.token_ids))})
                bar.update()
                tqdm.write(f"{variant:>26} depth {doc.depth:.2f}: needle in {layers}/{num_layers} layers, "
                           f"{'correct' if rows[-1]['correct'] else 'wrong'} ({rows[-1]['output']!r})")
    return rows


def table(rows: list[dict]) -> str:
    return markdown_table(
        ["retrieval", "tokens", "depth", "layers holding the needle", "expected", "output", "correct", "read s",
         "answer s", "decode ms/token"], "lrrrlllrrr",
        ([r["variant"], f"{r['tokens']:,}", f"{r['depth']:.2f}", f"{r['needle_layers']}/{r['num_layers']}",
          r["expected"], repr(r["output"]), "yes" if r["correct"] else "no", f"{r['read_seconds']:.0f}",
          f"{r['answer_seconds']:.1f}", f"{r['decode_ms_per_token']:.0f}"] for r in rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=16_384)
    parser.add_argument("--depths", nargs="+", type=float, default=[0.1, 0.5, 0.9])
    parser.add_argument("--preset", default="S")
    args = parser.parse_args()
    rows = run(args.tokens, args.depths, args.preset)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "retrieval_scoring.json").write_text(json.dumps(rows, indent=1))
    (RESULTS / "retrieval_scoring.md").write_text(table(rows) + "\n")
    print(table(rows))


if __name__ == "__main__":
    main()
