"""Input checks shared by the RAG baseline (both frameworks' parts) and ``compare``: bad input fails at once, with
a message naming what is wrong, before any model loads or any document is read."""

from __future__ import annotations

from typing import Any

CONTEXT_ORDERS = ("document", "score")
"""How retrieved chunks may be ordered in the prompt (see ``emllm_integrations.rag``)."""


def check_documents(texts: Any) -> list[str]:
    """A non-empty list of non-empty strings, or an error naming the offending document."""
    if isinstance(texts, str):
        raise TypeError("Pass a list of documents, not a single string: add_documents([text]).")
    try:
        texts = list(texts)
    except TypeError:
        raise TypeError(f"Documents must be a list of strings, got {type(texts).__name__}.") from None
    if not texts:
        raise ValueError("The document list is empty: give at least one document to index.")
    for i, text in enumerate(texts):
        if not isinstance(text, str):
            raise TypeError(f"Document {i} is a {type(text).__name__}, not text: pass each document as a str.")
        if not text.strip():
            raise ValueError(f"Document {i} is empty or only whitespace: remove it or give it text.")
    return texts


def check_question(question: Any) -> None:
    """A question must be non-empty text: an empty one would retrieve arbitrary chunks and answer nothing."""
    if not isinstance(question, str):
        raise TypeError(f"The question must be text (str), got {type(question).__name__}.")
    if not question.strip():
        raise ValueError("The question is empty or only whitespace: ask something.")


def check_positive(name: str, value: Any) -> None:
    """Counts (top_k, chunk_words, max_new_tokens) must be positive integers; bools are refused though ints."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}.")


def check_order(order: str) -> None:
    """A context order must be one of CONTEXT_ORDERS."""
    if order not in CONTEXT_ORDERS:
        raise ValueError(f"context_order must be one of {CONTEXT_ORDERS}, got {order!r}.")
