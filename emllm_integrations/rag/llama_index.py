"""The RAG baseline in LlamaIndex: the same embedding, 300-word chunking, faiss index, context order and QA
template as ``RAGBaseline``, as stock LlamaIndex pieces (an embedding, a node parser, a ``VectorStoreIndex`` over
a ``FaissVectorStore``, a node postprocessor and a ``RetrieverQueryEngine``). The tuned recipe (hybrid ranking, a
token budget) retrieves through ``RAGBaseline`` itself (``BaselineRetriever``): LlamaIndex has no stock retriever
that fills a prompt to a token budget, and its BM25 retriever is another package with another tokenizer, so the
recipe would no longer be the one compare() and `emllm bench` measure. Of the two frameworks it imports only
LlamaIndex; see ``emllm_integrations.rag``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import faiss
from llama_index.core import Document as LlamaDocument
from llama_index.core import StorageContext, VectorStoreIndex
from llama_index.core.base.embeddings.base import BaseEmbedding
from llama_index.core.base.base_retriever import BaseRetriever
from llama_index.core.bridge.pydantic import Field, PrivateAttr
from llama_index.core.node_parser.interface import TextSplitter
from llama_index.core.postprocessor.types import BaseNodePostprocessor
from llama_index.core.prompts import PromptTemplate
from llama_index.core.query_engine import RetrieverQueryEngine
from llama_index.core.response_synthesizers import ResponseMode
from llama_index.core.schema import NodeRelationship, NodeWithScore, QueryBundle, RelatedNodeInfo, TextNode
from llama_index.vector_stores.faiss import FaissVectorStore

from emllm.embeddings import encode, load_embedding_model

from ..checks import check_order, check_positive
from ..prompts import QA_SUFFIX
from . import CHUNK_WORDS, RAGBaseline, RAGRecipe, resolve_recipe, split_words


class SentenceTransformerEmbedding(BaseEmbedding):
    """A local sentence-transformers model as a LlamaIndex embedding (normalised vectors; never downloads)."""

    model_name: str = Field(default="minilm", description="A known embedding name or a local model directory.")
    device: str | None = Field(default=None, description="torch device; None = CPU.")
    _model: Any = PrivateAttr()

    def __init__(self, model_name: str = "minilm", device: str | None = None, **kwargs: Any):
        # pydantic takes this class's fields here; mypy checks them against BaseEmbedding's
        super().__init__(model_name=str(model_name), device=device, **kwargs)  # type: ignore[call-arg]
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
    """Puts retrieved nodes in document order (source document, then position in it): see ``emllm_integrations.rag``.
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
                return self.doc_rank[n.node.ref_doc_id], getattr(n.node, "start_char_idx", None) or 0
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
    check_positive("chunk_words", chunk_words)
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


class BaselineRetriever(BaseRetriever):
    """A RAGBaseline as a LlamaIndex retriever: exactly what compare() and `emllm bench` retrieve for its recipe, as
    nodes best first. A node holds its chunk's text; its metadata (its document's, plus ``doc_id`` and ``chunk_id``)
    stays out of the LLM's prompt, and its source is its document (``ref_doc_id``: the ``doc_id``), so
    DocumentOrder puts nodes in document order."""

    def __init__(self, baseline: RAGBaseline, top_k: int | None = None, **kwargs: Any):
        super().__init__(**kwargs)
        self.baseline, self.top_k = baseline, top_k

    def _retrieve(self, query_bundle: QueryBundle) -> list[NodeWithScore]:
        nodes = []
        for chunk in self.baseline.retrieve(query_bundle.query_str, self.top_k):
            metadata = {**chunk.metadata, "doc_id": chunk.doc_id, "chunk_id": chunk.chunk_id}
            node = TextNode(text=chunk.text, id_=f"chunk-{chunk.doc_id}-{chunk.chunk_id}", metadata=metadata,
                            excluded_llm_metadata_keys=list(metadata), excluded_embed_metadata_keys=list(metadata),
                            start_char_idx=chunk.start_char, end_char_idx=chunk.end_char,
                            relationships={NodeRelationship.SOURCE: RelatedNodeInfo(node_id=str(chunk.doc_id))})
            nodes.append(NodeWithScore(node=node, score=chunk.score))
        return nodes


def rag_query_engine(documents: Sequence[Any] | VectorStoreIndex, llm: Any, *, embedding: Any = "minilm",
                     recipe: str | RAGRecipe = "paper", chunk_words: int | None = None, top_k: int | None = None,
                     response_mode: str = "compact", context_order: str = "document",
                     llm_model: str | None = None) -> RetrieverQueryEngine:
    """A RetrieverQueryEngine answering with the shared QA template over chunks retrieved to ``recipe`` ("paper":
    300-word chunks, top 5, dense; "tuned": 128-word chunks, dense + BM25 rank-fused, as many as fill 4,096 tokens
    of ``llm_model``'s tokenizer; or a RAGRecipe; ``chunk_words`` and ``top_k`` override it, as in compare()),
    optionally put in document order. A dense recipe without a budget is stock LlamaIndex (a faiss-backed
    VectorStoreIndex, which may also be passed instead of documents); the others retrieve through RAGBaseline
    (BaselineRetriever). ``compact`` packs the chunks joined by blank lines into one prompt when the LLM's context
    window holds them (so the prompt equals prompts.qa_prompt)."""
    recipe = resolve_recipe(recipe, chunk_words=chunk_words, top_k=top_k)
    check_positive("chunk_words", recipe.chunk_words)
    check_positive("top_k", recipe.top_k)
    check_order(context_order)
    if response_mode not in ("compact", "simple_summarize"):
        raise ValueError(f"response_mode must be 'compact' or 'simple_summarize', got {response_mode!r}. (LlamaIndex's "
                         "simple_summarize joins chunks with one newline, compact with a blank line as ours does.)")
    stock = recipe.retrieval == "dense" and recipe.context_tokens is None
    retriever: BaseRetriever
    if isinstance(documents, VectorStoreIndex):
        if not stock:
            raise ValueError(f"A {recipe.retrieval} recipe with a token budget indexes the documents itself: pass "
                             "the documents, not a VectorStoreIndex.")
        index = documents
        ranks = {ref: i for i, ref in enumerate(index.ref_doc_info)}
        retriever = index.as_retriever(similarity_top_k=recipe.top_k)
    else:
        docs = to_llama_documents(documents)
        if stock:
            ranks = {d.doc_id: i for i, d in enumerate(docs)}
            retriever = rag_index(docs, embedding=embedding, chunk_words=recipe.chunk_words).as_retriever(
                similarity_top_k=recipe.top_k)
        else:
            baseline = RAGBaseline.from_recipe(recipe, embedding, llm_model=llm_model)
            baseline.add_documents([d.text for d in docs], [dict(d.metadata) for d in docs])
            ranks = {str(i): i for i in range(len(docs))}
            retriever = BaselineRetriever(baseline)
    postprocessors: list[BaseNodePostprocessor] = [DocumentOrder(doc_rank=ranks)] if context_order == "document" \
        else []
    return RetrieverQueryEngine.from_args(retriever, llm=llm, node_postprocessors=postprocessors,
                                          response_mode=ResponseMode(response_mode), text_qa_template=qa_template())
