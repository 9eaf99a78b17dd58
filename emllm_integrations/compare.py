"""EM-LLM against the RAG baseline in one call, on the same LLM and the same prompt template.

    result = compare(documents, ["Who wrote the letter?", "Where was it sent from?"], preset="S")
    print(result.to_markdown())

EM-LLM reads every document once into a MemoryPool (one pinned checkpoint) and answers each question as the chat
turn's header, the documents' tokens, then the question's tail (``prompts.chat_frame``; ``template="text"``:
``context_ids + tokenize(qa_suffix(question))``): the documents' tokens are a prefix of every prompt, so each
question reads only its own few tokens. RAG chunks and indexes the documents once and, per question, puts what it
retrieves into the same template for the same LLM under plain full attention: ``rag="paper"`` (the default) is the
paper's protocol (300-word chunks, the top 5 by MiniLM similarity); ``rag="tuned"`` is the RAG a practitioner builds
(hybrid dense + BM25 search, 128-word chunks, the prompt filled to the default preset's attention span; see
``rag.RECIPES``). What each method looked at is kept:
the retrieved chunks for RAG, and for EM-LLM the document spans its episodic retrieval held in attention when the
answer began (``GenerationResult.retrieved_events``, mapped from token positions back to the documents by
``emllm_integrations.sources``, as the LlamaIndex query engine maps them).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from emllm import DEFAULT_PRESET, RetrievedEvent
from tqdm.auto import tqdm

from .checks import check_documents, check_order, check_positive, check_question
from .markdown import table as markdown_table
from .prompts import chat_frame, chat_header, check_template, qa_suffix
from .rag import CHUNK_WORDS, TOP_K, RAGBaseline, RAGRecipe, resolve_recipe
from .sources import context_tokens, event_spans

METHODS = ("em-llm", "rag")


@dataclass
class ComparisonRow:
    question: str
    method: str                 # "em-llm" or "rag"
    answer: str
    context: list[str]          # RAG: retrieved chunk texts; EM-LLM: retrieved document spans (prompt order)
    sources: list[dict[str, Any]]  # per context item: doc_id and chunk_id/score (RAG) or span/layers (EM-LLM)
    prefill_seconds: float      # one-time cost for the documents, shared by every question of this method:
                                # EM-LLM reading them into memory, RAG chunking + embedding + indexing
    query_seconds: float        # this question before its first token: EM-LLM reading the question tokens,
                                # RAG retrieval + the LLM reading the whole prompt
    decode_seconds: float
    tokens_read: int            # LLM tokens read for this question (EM-LLM: the question's; RAG: the prompt's)
    output_tokens: int
    finish_reason: str


@dataclass
class ComparisonResult:
    rows: list[ComparisonRow]
    preset: str
    embedding: str
    model: str
    document_tokens: int        # LLM tokens of all documents (what EM-LLM read once)
    rag_chunks: int             # chunks RAG indexed
    top_k: int = TOP_K
    chunk_words: int = CHUNK_WORDS
    context_order: str = "document"
    retrieval: str = "dense"
    context_tokens: int | None = None
    config: dict[str, Any] = field(default_factory=dict)

    def rows_for(self, method: str) -> list[ComparisonRow]:
        if method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {method!r}.")
        return [r for r in self.rows if r.method == method]

    def answers(self, method: str) -> list[str]:
        return [r.answer for r in self.rows_for(method)]

    def to_markdown(self, preview_chars: int = 80, preview_items: int = 3) -> str:
        """A table, one row per question and method. Cells preview the retrieved context (the full texts are in
        ``rows``); a shortened cell says so with an ellipsis and the item count."""
        em, rag = self.rows_for("em-llm"), self.rows_for("rag")
        lines = [f"Model: {self.model}.",
                 f"EM-LLM ({self.preset}): read {self.document_tokens:,} document tokens once"
                 + (f" in {em[0].prefill_seconds:.1f} s" if em else "") + ".",
                 f"RAG ({self.embedding}{', hybrid with BM25' if self.retrieval == 'hybrid' else ''}, "
                 f"{self.chunk_words}-word chunks, "
                 + (f"up to {self.context_tokens:,} tokens of them" if self.context_tokens else f"top {self.top_k}")
                 + f", {self.context_order} order, full attention): {self.rag_chunks} chunks indexed"
                 + (f" in {rag[0].prefill_seconds:.1f} s" if rag else "") + ".",
                 "",
                 markdown_table(["question", "method", "answer", "retrieved context", "query s", "decode s",
                                 "tokens read"], "llllrrr",
                                ([r.question, f"EM-LLM {self.preset}" if r.method == "em-llm" else "RAG", r.answer,
                                  _preview(r, preview_chars, preview_items), f"{r.query_seconds:.2f}",
                                  f"{r.decode_seconds:.2f}", f"{r.tokens_read:,}"] for r in self.rows))]
        return "\n".join(lines)


def _preview(row: ComparisonRow, chars: int, items: int) -> str:
    if not row.context:
        return "(none)"
    parts = []
    for text, source in list(zip(row.context, row.sources))[:items]:
        label = (f"doc {source['doc_id']} #{source['chunk_id']} ({source['score']:.2f})" if row.method == "rag"
                 else f"doc {source['doc_id']} ({source['layers']} layers)")
        flat = " ".join(text.split())
        parts.append(f"{label}: {flat[:chars]}{'…' if len(flat) > chars else ''}")
    more = len(row.context) - items
    return "; ".join(parts) + (f"; … {more} more" if more > 0 else "")


# ---------------------------------------------------------------------- the comparison
def compare(documents: Sequence[str], questions: Sequence[str], *, preset: str = DEFAULT_PRESET,
            embedding: Any = "minilm", rag: str | RAGRecipe = "paper",
            max_new_tokens: int = 64, top_k: int | None = None, chunk_words: int | None = None,
            context_order: str = "document", llm_model: str | None = None, dtype: str = "auto",
            template: str = "chat", progress: bool = False, **engine_fields: Any) -> ComparisonResult:
    """Answer every question with EM-LLM (``preset`` plus any EMConfig field, e.g. n_local=1024) and with the RAG
    baseline built to the recipe ``rag`` ("paper" or "tuned", rag.RECIPES; ``top_k`` and ``chunk_words`` override
    it), on the same LLM, greedily. ``template``: "chat" puts the documents (RAG: its chunks) and then the
    question in one user turn of the model's chat template, as people ask a chat model; "text" uses the raw
    ``prompts.qa_suffix`` frame. Inputs and settings are checked before the LLM is loaded (the embedding name is
    checked as the small embedding model loads, also first)."""
    from emllm import EMConfig
    from emllm.sessions import MemoryPool

    documents = check_documents(documents)
    questions = _check_questions(questions)
    check_positive("max_new_tokens", max_new_tokens)
    recipe = resolve_recipe(rag, chunk_words=chunk_words, top_k=top_k)
    top_k, chunk_words = recipe.top_k, recipe.chunk_words
    check_positive("top_k", top_k)
    check_positive("chunk_words", chunk_words)
    check_order(context_order)
    check_template(template)
    config = EMConfig.from_preset(preset, **engine_fields)

    baseline = RAGBaseline(embedding, chunk_words, top_k, llm_model, context_order=context_order, dtype=dtype,
                           retrieval=recipe.retrieval, context_tokens=recipe.context_tokens)
    engine = baseline.engine  # the shared engine for (llm_model, dtype): both methods run on the same weights
    started = time.perf_counter()
    rag_chunks = baseline.add_documents(documents)
    rag_setup = time.perf_counter() - started

    chat = template == "chat"
    document_ids, offsets, doc_starts = context_tokens(engine, documents, chat=chat)
    header = chat_header(engine, template)
    context_ids = header + document_ids
    pool = MemoryPool(engine, config, max_memories=1)  # the pinned documents are what is reused
    rows: list[ComparisonRow] = []
    try:
        started = time.perf_counter()
        pool.read(context_ids, progress=progress)
        em_setup = time.perf_counter() - started
        for question in tqdm(questions, desc="answering with EM-LLM and RAG", unit="question", disable=not progress,
                             dynamic_ncols=True):
            tail = chat_frame(engine, question)[1] if chat else engine.tokenize(qa_suffix(question))
            result = pool.generate(context_ids + tail, max_new_tokens=max_new_tokens)
            events = [RetrievedEvent(e.start - len(header), e.end - len(header), e.layers)
                      for e in result.retrieved_events]  # as positions in the documents' tokens
            spans = event_spans(events, offsets, doc_starts, documents)
            rows.append(ComparisonRow(
                question, "em-llm", result.text, [s.text for s in spans],
                [{"doc_id": s.doc_id, "start_char": s.start_char, "end_char": s.end_char, "layers": s.layers}
                 for s in spans],
                prefill_seconds=em_setup, query_seconds=result.prefill_seconds,
                decode_seconds=result.decode_seconds, tokens_read=result.new_input_tokens,
                output_tokens=result.output_tokens, finish_reason=result.finish_reason))
            answer = baseline.answer(question, max_new_tokens, chat=chat)
            rows.append(ComparisonRow(
                question, "rag", answer.text, [c.text for c in answer.chunks],
                [{"doc_id": c.doc_id, "chunk_id": c.chunk_id, "score": c.score} for c in answer.chunks],
                prefill_seconds=rag_setup, query_seconds=answer.retrieve_seconds + answer.prefill_seconds,
                decode_seconds=answer.decode_seconds, tokens_read=answer.input_tokens,
                output_tokens=answer.output_tokens, finish_reason=answer.finish_reason))
    finally:
        pool.close()
    return ComparisonResult(rows=rows, preset=preset, embedding=str(baseline.embedding_name),
                            model=engine.model_name, document_tokens=len(document_ids), rag_chunks=rag_chunks,
                            top_k=top_k, chunk_words=chunk_words, context_order=context_order,
                            retrieval=recipe.retrieval, context_tokens=recipe.context_tokens,
                            config={k: getattr(config, k) for k in ("n_init", "n_local", "n_mem", "chunk_size",
                                                                     "segmentation", "refinement", "contiguity",
                                                                     "attention")})


def _check_questions(questions: Any) -> list[str]:
    if isinstance(questions, str):
        raise TypeError("Pass a list of questions, not a single string: compare(documents, [question]).")
    questions = list(questions)
    if not questions:
        raise ValueError("The question list is empty: give at least one question.")
    for i, q in enumerate(questions):
        try:
            check_question(q)
        except (TypeError, ValueError) as error:
            raise type(error)(f"Question {i}: {error}") from None
    return questions
