"""Documents the integration tests read: essay prose (the needle-haystack essays) with facts placed at chosen
depths."""

from __future__ import annotations

import random

from emllm_integrations.bench.tasks import essay_sentences


def essay_document(tokens_hint: int, inserts: list[str], seed: int = 0, depths: list[float] | None = None) -> str:
    """Essay prose of about ``tokens_hint`` tokens (~0.75 words per token) with ``inserts`` at ``depths`` (fractions
    of the document; spread evenly by default)."""
    rng = random.Random(seed)
    sentences = list(essay_sentences())
    paragraphs, words = [], 0
    while words < tokens_hint * 0.75:
        paragraph = " ".join(rng.choice(sentences) for _ in range(6))
        paragraphs.append(paragraph)
        words += len(paragraph.split())
    depths = depths or [(k + 1) / (len(inserts) + 1) for k in range(len(inserts))]
    for k, (insert, depth) in enumerate(zip(inserts, depths)):
        paragraphs.insert(int(len(paragraphs) * depth) + k, insert)
    return "\n\n".join(paragraphs)
