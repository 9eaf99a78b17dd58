"""The question-answering prompts both sides of a comparison use (the paper's RAG protocol, appendix A.2: same
LLM, same template; only where the context comes from differs).

EM-LLM puts the whole document set in the context; the RAG baseline puts its top-k retrieved chunks there. Two
frames: ``chat_frame`` (the documents, a blank line and the question in one user turn of the model's chat template:
what people write to a chat model, and the default of compare and the query engine) and the raw-text ``qa_suffix``
(for models without a usable chat template: on SmolLM2-135M-Instruct, long-document answers were far more reliable
from raw text).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

DOCUMENT_SEPARATOR = "\n\n"
QA_SUFFIX = "\n\nAnswer the question using the text above.\nQuestion: {question}\nAnswer:"
TEMPLATES = ("chat", "text")  # chat_frame, qa_suffix


def check_template(template: Any) -> None:
    if template not in TEMPLATES:
        raise ValueError(f"template must be one of {TEMPLATES} (\"chat\": the model's chat template, \"text\": the "
                         f"raw qa_suffix frame), got {template!r}.")


def format_context(texts: Sequence[str]) -> str:
    """Documents (or retrieved chunks) joined in order, as they appear in the prompt."""
    return DOCUMENT_SEPARATOR.join(texts)


def chat_context(texts: Sequence[str]) -> str:
    """The documents as the chat frame puts them before the question: joined, then the blank line that ends them.
    The blank line is tokenised with the documents' last characters, as the tokenizer does when a user sends the
    whole turn as one text (Qwen2.5's ".\n\n" is one token): every surface then reads the tokens a chat message of
    the same text gives (ChatEMLLM reads that message whole), and the question starts where the prompt codec puts
    it, after the blank line."""
    return format_context(texts) + DOCUMENT_SEPARATOR


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


def chat_frame(engine: Any, question: str, *, separator_in_context: bool = True) -> tuple[list[int], list[int]]:
    """The model's chat template around one user turn holding documents, a blank line and the question (what
    people write to a chat model), as the ids before the documents and the ids after them (the question, the end of
    the turn, the assistant's header). The documents' ids go between, tokenised with the blank line that ends them
    (``engine.tokenize(chat_context(texts))``): the part up to the question does not depend on it, so a memory that
    has read it answers every question by reading only the tail. Both sides of a comparison (EM-LLM, RAG with its
    chunks as the documents) and the query engine use this. ``separator_in_context=False``: the frame of saves made
    before the blank line went with the documents (it then starts the tail)."""
    if not isinstance(question, str) or not question.strip():
        raise ValueError(f"The question must be non-empty text, got {question!r}.")
    content = _DOCUMENT_SLOT + DOCUMENT_SEPARATOR + question.strip()
    text = engine.tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                                add_generation_prompt=True)
    head, after = text.split(_DOCUMENT_SLOT, 1)
    asked = DOCUMENT_SEPARATOR + question.strip()  # the user's text: its control-token strings stay text
    if not after.startswith(asked):
        raise ValueError("This model's chat template changes the text of a message, so a question cannot be put "
                         "after a document in one turn: use template='text'.")
    question_text = asked if not separator_in_context else question.strip()
    return engine.template_ids(head), engine.tokenize(question_text) + engine.template_ids(after[len(asked):])


def chat_header(engine: Any, template: str) -> list[int]:
    """The ids before the documents in a prompt of this frame (the chat turn's header; nothing for "text"): the
    same for every question, so the documents' memory is read once with it."""
    check_template(template)
    return chat_frame(engine, "?")[0] if template == "chat" else []


_DOCUMENT_SLOT = "<<document>>"  # where the document goes in the rendered template
