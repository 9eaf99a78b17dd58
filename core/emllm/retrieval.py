"""Per-layer k-NN over event representatives, and the two buffers that decide which events enter attention.

Each event is represented, per layer, by one vector: for every KV head the mean key of the ``repr_topk`` tokens
that received the most attention while in the local window, heads concatenated ([num_kv_heads * head_dim]).
A chunk's query is the mean of its queries over positions and over the query heads that share a KV head, so
score(event) = dot(query, representative) is the head-summed attention logit of an average query on an average
important key: the k-NN approximation of softmax attention the paper argues for (appendix E).

Other ways to rank events (attention mass, question-only, pooling, pins) are scorers in scoring.py, built from the
parts here; forward.retrieve composes them into the events a layer attends to.

Similarity buffer: the best-scoring events, in score order, until its token budget is used.
Contiguity buffer: a queue of the +-n neighbours of retrieved events; newest in, oldest out once its token budget
is exceeded, a retrieval's best-ranked events' neighbours entering last. Events are returned in input order so
retrieved text keeps its original sequence.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from .layer_memory import LayerMemory
    from .memory import EpisodicMemory


class RepresentativeIndex:
    """The representative vectors of one layer, searchable exactly in torch or with faiss."""

    def __init__(self, dim: int, device: torch.device, backend: str = "auto", faiss_min_events: int = 20_000):
        self.dim = dim
        self.device = device
        self.backend = backend
        self.faiss_min_events = faiss_min_events
        self._vectors = torch.empty(0, dim, dtype=torch.float32, device=device)  # [capacity, dim]
        self.size = 0

    @property
    def nbytes(self) -> int:
        """Bytes of the buffer, spare capacity included: a buffer under glibc's mmap threshold (32 MB, a layer's
        index up to ~700K tokens of SmolLM2) comes from heap memory freed earlier and already resident, so its
        unwritten quarter is held too. Counting only the rows written was the likely cause of RSS climbing 0.3 GB
        between 460K and 1M tokens under a 2 GB budget."""
        return self._vectors.numel() * self._vectors.element_size()

    @property
    def vectors(self) -> torch.Tensor:
        """[size, dim] float32."""
        return self._vectors[: self.size]

    def nbytes_after(self, n: int) -> int:
        """nbytes once n more vectors are added: a budget makes room before the buffer grows, not after."""
        return self._capacity_for(self.size + n) * self.dim * self._vectors.element_size()

    def _capacity_for(self, needed: int) -> int:
        """Rows the buffer has once it holds ``needed``: it grows by a quarter (amortised O(n), no per-event
        allocation); at a million tokens the vectors are about a gigabyte (SmolLM2), and doubling would leave up
        to as much again unused."""
        capacity = self._vectors.shape[0]
        return capacity if needed <= capacity else max(capacity * 5 // 4, needed, 64)

    def add(self, vectors: torch.Tensor) -> None:
        """vectors: [n, dim], appended (see _capacity_for)."""
        n = vectors.shape[0]
        if self.size + n > self._vectors.shape[0]:
            grown = torch.empty(self._capacity_for(self.size + n), self.dim, dtype=torch.float32, device=self.device)
            grown[: self.size] = self._vectors[: self.size]
            self._vectors = grown
        self._vectors[self.size: self.size + n] = vectors.to(self.device, torch.float32)
        self.size += n

    def uses_faiss(self) -> bool:
        return self.backend == "faiss" or (self.backend == "auto" and self.size >= self.faiss_min_events)

    def search(self, query: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k events for query [dim]: (scores [k], ids [k]) best first, on the index's device."""
        k = min(k, self.size)
        if k == 0:
            empty = torch.empty(0, device=self.device)
            return empty, empty.long()
        if self.uses_faiss():
            return self._search_faiss(query, k)
        return torch.topk(self.scores(query), k)

    def scores(self, query: torch.Tensor) -> torch.Tensor:
        """[size] every event's score for query [dim] (exact, in torch: pooling needs them all, not a top-k)."""
        return self.vectors @ query.to(self.device, torch.float32)

    def _search_faiss(self, query: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """faiss's brute-force k-NN over this index's own buffer (a numpy view, no copy). An IndexFlatIP would search
        the same way from a second copy of every vector; on a device the vectors stay there and torch searches."""
        if self.device.type != "cpu":
            return torch.topk(self.scores(query), k)
        import faiss  # imported here: small stores never need it

        q = np.ascontiguousarray(query.detach().to("cpu", torch.float32).numpy()[None, :])
        scores, ids = faiss.knn(q, self.vectors.numpy(), k, metric=faiss.METRIC_INNER_PRODUCT)
        return torch.from_numpy(scores[0]), torch.from_numpy(ids[0]).long()


ATTENTION_SCORING_ROWS = 256
"""Query rows (positions x query heads) per KV head that rank events under scoring.AttentionMass: a strided
sample of a reading chunk's rows; a question or a decoded token has fewer and uses them all."""


def attention_mass_per_event(queries: torch.Tensor, keys: torch.Tensor, sizes: torch.Tensor, scaling: float,
                             max_elements: int = 1 << 25) -> torch.Tensor:
    """Per event, the attention probability the queries would give its tokens under softmax over all of them.

    queries [kv, rows, d] (already rotated for the memory part); keys [kv, n, d]: every event's tokens, events in
    order, sizes [e] summing to n. Probabilities are averaged over rows and summed over KV heads: [e] float32.
    Rows are taken in blocks so that at most ``max_elements`` logits exist at once, whatever the memory's size.
    """
    kv, rows, _ = queries.shape
    n = keys.shape[1]
    keys = keys.float()
    per_token = torch.zeros(n, dtype=torch.float32, device=keys.device)                 # [n]
    block = max(1, max_elements // max(1, kv * n))
    for first in range(0, rows, block):
        logits = torch.matmul(queries[:, first:first + block].float(), keys.transpose(1, 2)) * scaling  # [kv, b, n]
        per_token += torch.softmax(logits, dim=-1).sum(dim=(0, 1))
    owner = torch.repeat_interleave(torch.arange(len(sizes), device=keys.device), sizes.to(keys.device))  # [n]
    return torch.zeros(len(sizes), dtype=torch.float32, device=keys.device).index_add_(0, owner, per_token) / rows


def fill_budget(ids_best_first: torch.Tensor, sizes: torch.Tensor, budget: int) -> torch.Tensor:
    """The longest best-first prefix of events whose sizes fit in the token budget."""
    if ids_best_first.numel() == 0:
        return ids_best_first
    used = torch.cumsum(sizes[ids_best_first], dim=0)
    return ids_best_first[used <= budget]


class ContiguityBuffer:
    """A queue of event ids (oldest first) holding at most ``budget`` tokens of neighbours of retrieved events."""

    def __init__(self, budget: int, neighbours: int = 1):
        self.budget = budget
        self.neighbours = neighbours
        self._queue: OrderedDict[int, int] = OrderedDict()  # event id -> size

    def entries(self) -> list[tuple[int, int]]:
        """(event id, size) oldest first: the queue's whole state, for saving and forking."""
        return list(self._queue.items())

    def load(self, entries: list[tuple[int, int]]) -> None:
        """Replace the queue with entries() of another buffer."""
        self._queue = OrderedDict((int(event), int(size)) for event, size in entries)

    def clear(self) -> None:
        """Empty the queue: a new question's memory part holds its own retrieval's neighbours, not the ones left by
        the text read before it (values of other needles, say, without the keys that name them)."""
        self._queue.clear()

    def update(self, retrieved: list[int], sizes: list[int] | torch.Tensor, num_events: int) -> list[int]:
        """Enqueue the neighbours of this step's retrieved events (best first); return the queue minus those
        events. The worst-ranked go in first, so that over budget the neighbours of the best-ranked events stay: a
        sentence cut by an event boundary (a number split in two) is continued where the question's best match is,
        not where its hundredth is. Across steps the oldest step's neighbours leave first."""
        if self.budget <= 0:
            return []
        chosen = set(retrieved)
        neighbours = [neighbour for event in reversed(retrieved) for offset in range(1, self.neighbours + 1)
                      for neighbour in (event - offset, event + offset)
                      if 0 <= neighbour < num_events and neighbour not in chosen]
        # The sizes in one read: an element read from a tensor costs a dispatch, and reading each neighbour's made
        # this loop a fifth of a reading chunk's time on a GPU (preset S+C against S).
        neighbour_sizes = (sizes[torch.tensor(neighbours, dtype=torch.long)].tolist()
                           if isinstance(sizes, torch.Tensor) and neighbours else [sizes[n] for n in neighbours])
        for neighbour, size in zip(neighbours, neighbour_sizes):
            self._queue.pop(neighbour, None)
            self._queue[neighbour] = int(size)
        held = sum(self._queue.values())
        while self._queue and held > self.budget:
            held -= self._queue.popitem(last=False)[1]
        return [e for e in self._queue if e not in chosen]


def gather_events(memory: EpisodicMemory, layer: LayerMemory,
                  event_ids: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """The stored keys and values [kv, n, d] of these events for one layer, events in the order given."""
    ids = torch.tensor(event_ids, dtype=torch.long)
    tokens = token_index_of_events(ids, memory.event_starts, memory.event_sizes)
    return memory.store.gather(layer.layer_index, tokens, layer.device)


def token_index_of_events(event_ids: torch.Tensor, starts: torch.Tensor, sizes: torch.Tensor) -> torch.Tensor:
    """All token positions covered by the given events, concatenated in the order of event_ids.

    Vectorised: for each event, start + arange(size), without a Python loop over events or tokens.
    """
    lengths = sizes[event_ids]
    total = int(lengths.sum())
    if total == 0:
        return torch.empty(0, dtype=torch.long, device=starts.device)
    event_start_in_output = torch.cumsum(lengths, 0) - lengths  # [k]
    owner = torch.repeat_interleave(torch.arange(len(event_ids), device=starts.device), lengths)  # [total]
    within = torch.arange(total, device=starts.device) - event_start_in_output[owner]
    return starts[event_ids][owner] + within
