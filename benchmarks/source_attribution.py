"""Does EMLLMQueryEngine credit the right document? Corpora of essays (needle-haystack prose), each essay holding
one fact; every fact is asked on its own, and the top source is checked against the essay that holds it, for the
attention-weighted shares (``source_nodes``) and for the older shares of retrieved events alone.

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/source_attribution.py --corpora 5 --documents 4 --tokens 1000

Prints one line per question and a table with 95% Wilson intervals.
"""

from __future__ import annotations

import argparse
import math
import random

import torch
from llama_index.core import Document

from emllm_integrations.bench.tasks import essay_document
from emllm_integrations.llama_index import EMLLMQueryEngine

FACTS = [("The lighthouse keeper's cat is named {x}.", "What is the lighthouse keeper's cat called?",
          ["Biscuit", "Pepper", "Marlow", "Tansy", "Juniper"]),
         ("The ferry to the island leaves at {x} each morning.", "When does the ferry to the island leave?",
          ["7:40", "6:15", "8:05", "5:50", "9:20"]),
         ("The bakery's secret ingredient is {x}.", "What is the bakery's secret ingredient?",
          ["cardamom", "rosewater", "malt", "saffron", "anise"]),
         ("The museum's oldest map was drawn in {x}.", "In which year was the museum's oldest map drawn?",
          ["1612", "1588", "1703", "1655", "1721"])]


def wilson(k: int, n: int) -> tuple[float, float]:
    if n == 0:
        return 0.0, 1.0
    z, p = 1.96, k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--corpora", type=int, default=5)
    parser.add_argument("--documents", type=int, default=4, help="essays per corpus (at most 4)")
    parser.add_argument("--tokens", type=int, default=1000, help="about this many tokens per essay")
    parser.add_argument("--preset", default="E")
    args = parser.parse_args()
    torch.set_num_threads(2)
    hits = {"attention": 0, "retrieved": 0}
    asked = 0
    for c in range(args.corpora):
        rng = random.Random(c)
        facts = FACTS[:args.documents]
        values = [rng.choice(options) for _, _, options in facts]
        texts = [essay_document(args.tokens, [fact.format(x=x)], seed=100 * c + d, depths=[rng.uniform(0.1, 0.9)])
                 for d, ((fact, _, _), x) in enumerate(zip(facts, values))]
        engine = EMLLMQueryEngine.from_documents([Document(text=t, metadata={"doc": d}) for d, t in enumerate(texts)],
                                                 preset=args.preset, max_tokens=24)
        try:
            for d, (_, question, _) in enumerate(facts):
                response = engine.query(question)
                top = response.source_nodes[0].node.metadata["doc"] if response.source_nodes else None
                retrieved = response.metadata["retrieved_shares"]
                by_id = {node.node_id: node.metadata["doc"] for node in engine.nodes}
                top_retrieved = by_id[max(retrieved, key=retrieved.get)] if retrieved else None
                hits["attention"] += top == d
                hits["retrieved"] += top_retrieved == d
                asked += 1
                print(f"corpus {c} doc {d}: answer {str(response)[:40]!r} right={values[d].lower() in str(response).lower()} "
                      f"top source {top} (attention) {top_retrieved} (retrieved events)", flush=True)
        finally:
            engine.close()
    print(f"\n| shares from | top source right | 95% interval |\n|---|---:|---|")
    for name, k in hits.items():
        low, high = wilson(k, asked)
        print(f"| {name} | {k}/{asked} | {low:.2f}-{high:.2f} |")


if __name__ == "__main__":
    main()
