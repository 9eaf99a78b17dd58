"""The one question-answering prompt both sides of a comparison use (the paper's RAG protocol, appendix A.2:
same LLM, same template; only where the context comes from differs).

EM-LLM puts the whole document set in ``context``; the RAG baseline puts its top-k retrieved chunks there. The
prompt is raw text rather than a chat template: measured on SmolLM2-135M-Instruct, long-document answers are far
more reliable from raw text (the chat template made even full attention miss a passkey it finds as raw text).
"""

from __future__ import annotations

from collections.abc import Sequence

DOCUMENT_SEPARATOR = "\n\n"
QA_SUFFIX = "\n\nAnswer the question using the text above.\nQuestion: {question}\nAnswer:"


def format_context(texts: Sequence[str]) -> str:
    """Documents (or retrieved chunks) joined in order, as they appear in the prompt."""
    return DOCUMENT_SEPARATOR.join(texts)


def document_starts(texts: Sequence[str]) -> list[int]:
    """Where each document begins, in characters, in format_context(texts): maps token offsets to documents."""
    starts, position = [], 0
    for text in texts:
        starts.append(position)
        position += len(text) + len(DOCUMENT_SEPARATOR)
    return starts


def qa_suffix(question: str) -> str:
    """What follows the context. Tokenise it separately and append its ids to the context's ids: the context's
    tokens then stay a prefix of every question's prompt, so a memory that has read them is reused."""
    if not isinstance(question, str) or not question.strip():
        raise ValueError(f"The question must be non-empty text, got {question!r}.")
    return QA_SUFFIX.format(question=question.strip())


def qa_prompt(context: str, question: str) -> str:
    """The full prompt as text (context first, then the question)."""
    return context + qa_suffix(question)
