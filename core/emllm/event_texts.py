"""The text view of a memory's events, for scorers that rank events by what they say (scoring.EventText).

Each event's text is embedded once (a sentence-transformers model the engine supplies): as it leaves the window on the
CPU, at the first question on an accelerator (EMEngine.embeds_on_eviction). The prompt's question is embedded when it
is read; their cosines rank events in the answering forwards. The embeddings are
derived from the tokens: forks share them (they are only ever replaced, never written in place), saves leave the
event embeddings out and a loaded memory rebuilds them on its first question.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

Embedder = Callable[[list[list[int]]], torch.Tensor]  # token id lists -> [n, dim] unit rows
_Cached = tuple[tuple[torch.Tensor, torch.Tensor] | None, torch.Tensor | None]  # ((vector, embeddings), cosines)


class EventTexts:
    """Event-text embeddings, the question's embedding and their cosines (computed once per question and eviction)."""

    def __init__(self, embedder: Embedder | None = None):
        self.embedder = embedder
        self.embeddings = torch.empty(0, 0)              # [events embedded so far, dim] each event's text
        self.question: torch.Tensor | None = None        # [dim] the current prompt's question
        self.answer: torch.Tensor | None = None          # [dim] what the current answer has written (AnswerText)
        self.answer_from: int | None = None              # the absolute token position where the answer starts
        self.answer_tokens = 0                           # tokens the answer had when ``answer`` was embedded
        self._scores: _Cached = (None, None)
        self._answer_scores: _Cached = (None, None)

    def ask(self, question_ids: list[int], answer_from: int | None = None) -> None:
        """Embed the prompt's question (token ids), which the answering forwards compare with every event's text;
        the answer to it starts at token ``answer_from`` (the end of the prompt; None: not followed)."""
        if self.embedder is not None and question_ids:
            self.question = self.embedder([question_ids])[0]
        self.answer_from = answer_from

    def forget_question(self) -> None:
        self.question = self.answer = self.answer_from = None
        self.answer_tokens = 0

    def follow(self, token_ids: Sequence[int], every: int) -> None:
        """Embed the answer written so far (the tokens from ``answer_from``) when it has grown by ``every`` tokens
        since the last time: one short embedding per ``every`` generated tokens (AnswerText)."""
        if self.embedder is None or self.answer_from is None:
            return
        written = len(token_ids) - self.answer_from
        if written < every or written // every == self.answer_tokens // every:
            return
        self.answer = self.embedder([list(token_ids[self.answer_from:])])[0]
        self.answer_tokens = written

    def embed(self, token_ids: Sequence[int], starts: torch.Tensor, sizes: torch.Tensor) -> None:
        """Embed the text of the events (absolute ``starts``, ``sizes``) not embedded yet: on eviction while reading,
        and all of them the first time a loaded memory, or one read under a scorer that needed no text, is asked."""
        done = self.embeddings.shape[0]
        if self.embedder is None or done == starts.shape[0]:
            return
        spans = zip(starts[done:].tolist(), sizes[done:].tolist())
        fresh = self.embedder([list(token_ids[start:start + size]) for start, size in spans])
        self.embeddings = fresh if done == 0 else torch.cat([self.embeddings, fresh])

    def scores(self, num_events: int) -> torch.Tensor | None:
        """[events] cosine of the question with each event's text; None without a question or an embedder. The
        embeddings are new tensors whenever a question is asked or events are embedded, so identity is the cache key:
        an answer's decoding steps reuse one computation."""
        scores, self._scores = self._cosines(self.question, self._scores, num_events)
        return scores

    def answer_scores(self, num_events: int) -> torch.Tensor | None:
        """[events] cosine of the answer written so far with each event's text; None before the answer is embedded.
        Cached as scores() is, so the steps between two refreshes reuse one computation."""
        scores, self._answer_scores = self._cosines(self.answer, self._answer_scores, num_events)
        return scores

    def _cosines(self, vector: torch.Tensor | None, cached: _Cached, num_events: int) -> tuple[torch.Tensor | None,
                                                                                                  _Cached]:
        """(each event's cosine with ``vector``, the cache to keep): the cached cosines while neither the vector nor
        the embeddings were replaced (they are new tensors whenever they change, so identity is the key)."""
        if vector is None or self.embedder is None:
            return None, cached
        made_from, scores = cached
        if made_from is not None and made_from[0] is vector and made_from[1] is self.embeddings:
            return scores, cached
        scores = self.embeddings @ vector if num_events else torch.zeros(0)
        return scores, ((vector, self.embeddings), scores)

    @property
    def nbytes(self) -> int:
        """Bytes the event embeddings hold (counted against the memory's RAM budget)."""
        return self.embeddings.numel() * self.embeddings.element_size()

    def nbytes_after(self, adding: int) -> int:
        """nbytes once ``adding`` more events are embedded: what a read's budget check counts before reading. The
        width is the embeddings' own, or the embedder's (asked with no text) before the first event."""
        if self.embedder is None or not adding:
            return self.nbytes
        width = self.embeddings.shape[1] if self.embeddings.numel() else self.embedder([]).shape[-1]
        return (self.embeddings.shape[0] + adding) * width * torch.finfo(torch.float32).bits // 8
