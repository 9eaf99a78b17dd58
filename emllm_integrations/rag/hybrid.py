"""Lexical retrieval and rank fusion: what a practitioner adds to dense retrieval ("hybrid search").

BM25 (bm25s, English stop words removed) finds the chunk that repeats a question's rare words (a name, a code, a
place), which a small sentence embedder blurs; the embedder finds the chunk that says the same thing in other words,
which BM25 cannot. Reciprocal-rank fusion (Cormack et al., 2009) combines the two rankings without calibrating their
scores against each other: each chunk scores the sum of 1 / (k + rank) over the rankings it appears in, k = 60 as in
the paper and in the hybrid retrievers of LangChain (EnsembleRetriever) and LlamaIndex (QueryFusionRetriever).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

RRF_K = 60


class BM25Index:
    """A BM25 index over texts, rebuilt when texts are added (bm25s indexes are built whole; indexing 1,000 chunks
    takes milliseconds, far less than embedding them)."""

    def __init__(self) -> None:
        self._texts: list[str] = []
        self._index: Any = None  # a bm25s.BM25, built on the first search after texts were added

    def add(self, texts: Sequence[str]) -> None:
        self._texts.extend(texts)
        self._index = None

    def __len__(self) -> int:
        return len(self._texts)

    def search(self, query: str, top_k: int) -> list[tuple[int, float]]:
        """(text index, BM25 score) of the ``top_k`` best texts with a positive score, best first. A query whose
        words are all stop words (or absent from every text) ranks nothing: BM25 has no opinion then."""
        import bm25s

        if self._index is None:
            self._index = bm25s.BM25()
            self._index.index(bm25s.tokenize(self._texts, stopwords="en", show_progress=False), show_progress=False)
        words = bm25s.tokenize([query], stopwords="en", show_progress=False, return_ids=False)[0]
        if not words:
            return []
        scores = self._index.get_scores(words)
        top = np.argsort(-scores, kind="stable")[:top_k]
        return [(int(i), float(scores[i])) for i in top if scores[i] > 0]


def reciprocal_rank_fusion(rankings: Sequence[Sequence[int]], k: int = RRF_K) -> list[tuple[int, float]]:
    """(item, fused score) best first: each item scores sum(1 / (k + rank)) over the rankings holding it (rank 1 =
    best). Ties keep the order of first appearance, earlier rankings first."""
    scores: dict[int, float] = {}
    for ranking in rankings:
        for rank, item in enumerate(ranking, 1):
            scores[item] = scores.get(item, 0.0) + 1.0 / (k + rank)
    return sorted(scores.items(), key=lambda pair: -pair[1])
