"""The RAG baseline in LangChain: a retriever over ``RAGBaseline`` and an LCEL chain that sends the shared QA
prompt to any chat model or runnable. Of the two frameworks it imports only LangChain (langchain_core); see
``emllm_integrations.rag``."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from langchain_core.callbacks import CallbackManagerForRetrieverRun
from langchain_core.documents import Document
from langchain_core.output_parsers import StrOutputParser
from langchain_core.prompt_values import StringPromptValue
from langchain_core.retrievers import BaseRetriever
from langchain_core.runnables import Runnable, RunnableLambda, RunnableParallel, RunnablePassthrough

from ..checks import check_order
from ..prompts import format_context, qa_prompt
from . import RAGBaseline, RAGRecipe, resolve_recipe


class RAGRetriever(BaseRetriever):
    """The baseline as a LangChain retriever: top-k chunks as ``Document``s, best first, with ``doc_id``,
    ``chunk_id``, ``score`` and the character span in their metadata (plus the document's own metadata)."""

    baseline: Any
    top_k: int | None = None

    @classmethod
    def from_texts(cls, texts: Sequence[str], metadatas: Sequence[Mapping[str, Any]] | None = None, *,
                   embedding: Any = "minilm", recipe: str | RAGRecipe = "paper", chunk_words: int | None = None,
                   top_k: int | None = None, **kwargs: Any) -> RAGRetriever:
        """A retriever over ``texts`` built to ``recipe``: "paper" (300-word chunks, top 5, dense) or "tuned" (what
        a practitioner builds: 128-word chunks, dense + BM25 rank-fused, as many as fill 4,096 LLM tokens; counting
        them loads the LLM's tokenizer with the shared engine), or a RAGRecipe; ``chunk_words`` and ``top_k``
        override it, as in compare(). Other keyword arguments as for RAGBaseline."""
        baseline = RAGBaseline.from_recipe(resolve_recipe(recipe, chunk_words=chunk_words, top_k=top_k), embedding,
                                           **kwargs)
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
    check_order(context_order)
    docs = list(documents)
    if context_order == "document" and all({"doc_id", "chunk_id"} <= d.metadata.keys() for d in docs):
        docs.sort(key=lambda d: (d.metadata["doc_id"], d.metadata["chunk_id"]))
    return format_context([d.page_content for d in docs])


def rag_chain(retriever: BaseRetriever, llm: Runnable, *, context_order: str = "document") -> Runnable:
    """An LCEL RAG chain: question -> retriever | format | prompt | llm | StrOutputParser -> answer text.

    The prompt is the shared raw-text QA template (prompts.qa_prompt) as a StringPromptValue: a chat model sees
    it as one user message, a plain LLM or runnable as text."""
    check_order(context_order)
    fmt: Runnable[Sequence[Document], str] = RunnableLambda(lambda docs: format_documents(docs, context_order))
    prompt: Runnable[dict[str, Any], StringPromptValue] = RunnableLambda(
        lambda x: StringPromptValue(text=qa_prompt(x["context"], x["question"])))
    return (RunnableParallel(context=retriever | fmt.with_config(run_name="format_context"),
                             question=RunnablePassthrough())
            | prompt.with_config(run_name="qa_prompt") | llm | StrOutputParser())
