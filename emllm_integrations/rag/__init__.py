"""The RAG baseline of the paper (appendix A.2): documents cut into chunks of 300 words, embedded with a
sentence-transformers model into a faiss inner-product index over normalised vectors (= cosine similarity), the
top 5 chunks for a question put into the same QA prompt EM-LLM uses, answered by the same LLM with plain full
attention (EMConfig preset "full").

    rag = RAGBaseline()                          # all-MiniLM-L6-v2 (embedded package), 300 words, top 5
    rag.add_documents(texts)
    rag.retrieve("Who wrote the letter?")        # -> [Chunk(doc_id, chunk_id, score, text, ...)], best first
    rag.answer("Who wrote the letter?")          # -> RAGAnswer(text, chunks, prompt, timings, token counts)

This package is framework-free: importing it imports neither LangChain nor LlamaIndex, so either framework's
users (and the benchmark harness) need only their own. The same pieces in the two frameworks:
- ``emllm_integrations.rag.langchain`` (imports only langchain_core): ``RAGRetriever`` (a ``BaseRetriever``
  returning ``Document``s) and ``rag_chain(retriever, llm)``, an LCEL chain retriever | format | prompt | llm |
  StrOutputParser for any chat model or runnable.
- ``emllm_integrations.rag.llama_index`` (imports only llama_index): ``SentenceTransformerEmbedding`` (a
  ``BaseEmbedding``), ``WordSplitter`` (300-word chunks), ``rag_index`` (a ``VectorStoreIndex`` over a
  ``FaissVectorStore``) and ``rag_query_engine(documents, llm)``.

Context order. The retrieved chunks enter the prompt in DOCUMENT order (document, then position in it), not score
order, by default: EM-LLM places its retrieved events in input order too, so the two methods then differ only in
WHAT reaches the LLM, not in how it is arranged; and neighbouring chunks read as continuous text, so a fact split
by a chunk boundary stays readable. ``context_order="score"`` gives best-first order instead.

The embedding models (names, local directories, encoding without silent truncation) are in ``emllm.embeddings``
(the engine ranks events with them too).
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import faiss

# The embedding names are re-exported: callers (the bench harness among them) use them as rag.<name>.
from emllm.embeddings import (EMBEDDINGS, MPNET_INSTALL, MPNET_PARTS, EmbeddingNotAvailableError, encode,
                              load_embedding_model, mpnet_dir, resolve_embedding)

from ..checks import CONTEXT_ORDERS, check_documents, check_order, check_positive, check_question
from ..prompts import chat_context, chat_frame, format_context, qa_prompt, qa_suffix
from .hybrid import BM25Index, reciprocal_rank_fusion

__all__ = ["CHUNK_WORDS", "CONTEXT_ORDERS", "EMBEDDINGS", "MPNET_INSTALL", "MPNET_PARTS", "RECIPES", "RETRIEVALS",
           "TOP_K", "Chunk", "EmbeddingNotAvailableError", "RAGAnswer", "RAGBaseline", "RAGRecipe", "WordSpan",
           "check_documents", "encode", "load_embedding_model", "mpnet_dir", "resolve_embedding", "resolve_recipe",
           "split_words"]

CHUNK_WORDS = 300   # the paper's l (appendix A.2, following Li et al. 2024c)
TOP_K = 5           # the paper's k
RETRIEVALS = ("dense", "hybrid")


@dataclass(frozen=True)
class RAGRecipe:
    """How a RAG baseline chunks, ranks and fills its prompt (RAGBaseline's settings besides the models)."""
    chunk_words: int
    top_k: int                          # chunks retrieved (with context_tokens: the most that may enter)
    retrieval: str = "dense"            # "dense" (the embedder) or "hybrid" (embedder + BM25, rank-fused)
    context_tokens: int | None = None   # fill the prompt best first up to this many LLM tokens of chunks


RECIPES = {
    # The paper's protocol (appendix A.2).
    "paper": RAGRecipe(CHUNK_WORDS, TOP_K),
    # What a practitioner builds: hybrid dense + BM25 search, the chunk size chosen by the LLM's answers on a
    # development split of the bench's generators (benchmarks/rag_tuning.py --answers, seed 1; never the test
    # documents: 128 words answered 49/80 of four families, 32 words 44/80 though they retrieved more), and the
    # prompt filled to the default preset's attention span besides its sinks (n_local + n_mem = 4,096 tokens), so
    # that both methods give the LLM the same number of tokens to read the answer from.
    "tuned": RAGRecipe(chunk_words=128, top_k=64, retrieval="hybrid", context_tokens=4096),
}


# ---------------------------------------------------------------------- chunking
_WORD = re.compile(r"\S+")


@dataclass(frozen=True)
class WordSpan:
    text: str           # the document's own text from the first to the last word (whitespace kept)
    start_word: int
    end_word: int       # exclusive
    start_char: int
    end_char: int       # exclusive


def split_words(text: str, chunk_words: int = CHUNK_WORDS) -> list[WordSpan]:
    """Consecutive chunks of ``chunk_words`` words (the last one shorter). Words are maximal runs of non-space;
    each chunk is a slice of the original text, so no word is lost or altered and line breaks survive."""
    check_positive("chunk_words", chunk_words)
    words = [m.span() for m in _WORD.finditer(text)]
    spans = []
    for first in range(0, len(words), chunk_words):
        last = min(first + chunk_words, len(words)) - 1
        start, end = words[first][0], words[last][1]
        spans.append(WordSpan(text[start:end], first, last + 1, start, end))
    return spans


# ---------------------------------------------------------------------- the baseline
@dataclass
class Chunk:
    text: str
    doc_id: int                 # index of the document, in the order documents were added
    chunk_id: int               # index of the chunk within its document
    score: float | None = None  # cosine similarity to the question (set by retrieve)
    start_word: int = 0
    end_word: int = 0
    start_char: int = 0
    end_char: int = 0
    metadata: dict[str, Any] = field(default_factory=dict)


@dataclass
class RAGAnswer:
    text: str
    chunks: list[Chunk]         # in the order they appear in the prompt
    prompt: str                 # the prompt as text (its ids: context and question suffix tokenised apart)
    finish_reason: str
    input_tokens: int           # prompt tokens the LLM read
    output_tokens: int
    retrieve_seconds: float     # embedding the question + faiss search
    prefill_seconds: float      # the LLM reading the prompt
    decode_seconds: float


class RAGBaseline:
    """Chunk, embed and index documents; retrieve the top-k chunks; answer with the LLM under full attention."""

    def __init__(self, embedding: Any = "minilm", chunk_words: int = CHUNK_WORDS, top_k: int = TOP_K,
                 llm_model: str | None = None, *, context_order: str = "document", engine: Any = None,
                 device: str | None = None, dtype: str = "auto", retrieval: str = "dense",
                 context_tokens: int | None = None):
        check_positive("chunk_words", chunk_words)
        check_positive("top_k", top_k)
        check_order(context_order)
        if retrieval not in RETRIEVALS:
            raise ValueError(f"retrieval must be one of {RETRIEVALS} (\"hybrid\": the embedder and BM25, "
                             f"rank-fused), got {retrieval!r}.")
        if context_tokens is not None:
            check_positive("context_tokens", context_tokens)
        self.model = load_embedding_model(embedding, device=device)
        self.embedding_name = embedding if isinstance(embedding, str) else type(embedding).__name__
        self.chunk_words, self.top_k, self.context_order = chunk_words, top_k, context_order
        self.retrieval, self.context_tokens = retrieval, context_tokens
        self.llm_model, self.dtype, self._engine = llm_model, dtype, engine
        self.index = faiss.IndexFlatIP(self.model.get_embedding_dimension())
        self.lexical = BM25Index()
        self.chunk_tokens: list[int] = []  # LLM tokens of each chunk, counted only when a budget needs them
        self.chunks: list[Chunk] = []
        self.num_documents = 0
        self._lock = threading.Lock()

    @classmethod
    def from_recipe(cls, recipe: str | RAGRecipe = "paper", embedding: Any = "minilm", **kwargs: Any
                    ) -> RAGBaseline:
        """A baseline built to a recipe: ``"paper"`` (300 words, top 5, dense) or ``"tuned"`` (RECIPES), or a
        RAGRecipe; other keyword arguments as for RAGBaseline."""
        recipe = resolve_recipe(recipe)
        return cls(embedding, recipe.chunk_words, recipe.top_k, retrieval=recipe.retrieval,
                   context_tokens=recipe.context_tokens, **kwargs)

    @property
    def recipe(self) -> RAGRecipe:
        return RAGRecipe(self.chunk_words, self.top_k, self.retrieval, self.context_tokens)

    @property
    def engine(self) -> Any:
        """The LLM engine, loaded on first use (retrieval alone never loads LLM weights)."""
        if self._engine is None:
            from emllm.sessions import shared_engine

            self._engine = shared_engine(model=self.llm_model, dtype=self.dtype)
        return self._engine

    def add_documents(self, texts: Sequence[str], metadatas: Sequence[Mapping[str, Any]] | None = None) -> int:
        """Chunk, embed and index documents; returns how many chunks were added. Documents keep their order:
        ``doc_id`` counts on across calls."""
        texts = check_documents(texts)
        if metadatas is not None:
            metadatas = list(metadatas)
            if len(metadatas) != len(texts):
                raise ValueError(f"Got {len(metadatas)} metadatas for {len(texts)} documents: give one dict per "
                                 "document, or none.")
            if not all(isinstance(m, Mapping) for m in metadatas):
                raise TypeError("Each metadata must be a dict (mapping).")
        with self._lock:
            new: list[Chunk] = []
            for i, text in enumerate(texts):
                meta = dict(metadatas[i]) if metadatas is not None else {}
                for j, span in enumerate(split_words(text, self.chunk_words)):
                    new.append(Chunk(span.text, self.num_documents + i, j, None, span.start_word, span.end_word,
                                     span.start_char, span.end_char, meta))
            self.index.add(encode(self.model, [c.text for c in new]))
            self.lexical.add([c.text for c in new])
            self.chunks.extend(new)
            self.num_documents += len(texts)
        return len(new)

    def retrieve(self, question: str, top_k: int | None = None) -> list[Chunk]:
        """The ``top_k`` chunks most relevant to the question, best first: by cosine similarity (``score``), or for
        hybrid retrieval by the reciprocal-rank fusion of the similarity and BM25 rankings (``score`` the fused
        score). With ``context_tokens`` the list stops where the chunks' LLM tokens would exceed it (a chunk that
        would overflow is passed over for a shorter one further down)."""
        check_question(question)
        top_k = self.top_k if top_k is None else top_k
        check_positive("top_k", top_k)
        with self._lock:
            if not self.chunks:
                raise RuntimeError("The RAG index is empty: call add_documents(texts) before retrieving.")
            depth = min(top_k, len(self.chunks))
            scores, ids = self.index.search(encode(self.model, [question]), depth)
            ranked = [(int(i), float(s)) for s, i in zip(scores[0], ids[0]) if i >= 0]
            if self.retrieval == "hybrid":
                lexical = [i for i, _ in self.lexical.search(question, depth)]
                ranked = reciprocal_rank_fusion([[i for i, _ in ranked], lexical])[:depth]
            if self.context_tokens is not None:
                ranked = self._within_budget(ranked)
            return [_with_score(self.chunks[i], s) for i, s in ranked]

    def _within_budget(self, ranked: list[tuple[int, float]]) -> list[tuple[int, float]]:
        """The ranked chunks, best first, whose LLM tokens together fit context_tokens."""
        if len(self.chunk_tokens) < len(self.chunks):  # counted once per chunk, with the LLM's own tokenizer
            self.chunk_tokens.extend(self.engine.count_tokens(c.text) for c in self.chunks[len(self.chunk_tokens):])
        kept, used = [], 0
        for i, score in ranked:
            if used + self.chunk_tokens[i] <= self.context_tokens:  # type: ignore[operator]
                kept.append((i, score))
                used += self.chunk_tokens[i]
        return kept

    def order(self, chunks: list[Chunk]) -> list[Chunk]:
        """Chunks in the order they enter the prompt (see the module docstring)."""
        return sorted(chunks, key=lambda c: (c.doc_id, c.chunk_id)) if self.context_order == "document" else chunks

    def prompt_ids(self, chunks: list[Chunk], question: str, suffix: str | None = None,
                   chat: bool = False) -> list[int]:
        """The prompt's token ids: the context and the question suffix tokenised apart, exactly as EM-LLM's side
        of a comparison builds its prompt, so both read the same template the same way (``chat``: the chunks and the
        question in one chat turn, prompts.chat_frame)."""
        engine = self.engine
        texts = [c.text for c in chunks]
        if chat:
            head, tail = chat_frame(engine, question)
            return head + engine.tokenize(chat_context(texts)) + tail
        after = qa_suffix(question) if suffix is None else suffix
        return engine.tokenize(format_context(texts)) + engine.tokenize(after)

    def answer(self, question: str, max_new_tokens: int = 64, *, top_k: int | None = None,
               suffix: str | None = None, chat: bool = False, **sampling: Any) -> RAGAnswer:
        """Retrieve, build the shared QA prompt, and generate with plain full attention (greedy by default).

        ``suffix``: what follows the retrieved context instead of ``qa_suffix(question)`` (the benchmark's probes
        end with the question and an answer lead-in, bench.tasks.probe_suffix); retrieval still uses the question."""
        from emllm import EMConfig

        started = time.perf_counter()
        chunks = self.order(self.retrieve(question, top_k))
        retrieve_seconds = time.perf_counter() - started
        engine = self.engine
        if suffix is not None and (not isinstance(suffix, str) or not suffix.strip()):
            raise ValueError(f"suffix must be non-empty text to follow the context, got {suffix!r}.")
        ids = self.prompt_ids(chunks, question, suffix, chat=chat)
        memory = engine.new_memory(EMConfig.from_preset("full"))
        try:
            result = engine.generate(ids, memory=memory, max_new_tokens=max_new_tokens, **sampling)
        finally:
            memory.close()
        context = format_context([c.text for c in chunks])
        prompt = engine.tokenizer.decode(ids) if chat else qa_prompt(context, question) if suffix is None \
            else context + suffix
        return RAGAnswer(text=result.text, chunks=chunks, prompt=prompt, finish_reason=result.finish_reason,
                         input_tokens=result.input_tokens, output_tokens=result.output_tokens,
                         retrieve_seconds=retrieve_seconds, prefill_seconds=result.prefill_seconds,
                         decode_seconds=result.decode_seconds)


def resolve_recipe(recipe: str | RAGRecipe, *, chunk_words: int | None = None,
                   top_k: int | None = None) -> RAGRecipe:
    """A recipe by name (RECIPES) or as given, refused naming the choices; ``chunk_words`` and ``top_k``, when
    given, override it (how compare(), the LangChain retriever and the LlamaIndex query engine take them)."""
    if not isinstance(recipe, RAGRecipe):
        if recipe not in RECIPES:
            raise ValueError(f"Unknown RAG recipe {recipe!r}: choose one of {', '.join(RECIPES)}, or pass a "
                             "RAGRecipe.")
        recipe = RECIPES[recipe]
    return replace(recipe, chunk_words=recipe.chunk_words if chunk_words is None else chunk_words,
                   top_k=recipe.top_k if top_k is None else top_k)


def _with_score(chunk: Chunk, score: float) -> Chunk:
    return Chunk(chunk.text, chunk.doc_id, chunk.chunk_id, score, chunk.start_word, chunk.end_word,
                 chunk.start_char, chunk.end_char, dict(chunk.metadata))
