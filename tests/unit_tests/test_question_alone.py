"""A prompt's last paragraph (its question) is read in forwards of its own, so the retrieval
that serves the answer is driven by the question's queries, not by a chunk that is mostly document.

A tiny random Llama runs the real engine; the chat-template cases use the real SmolLM2 tokenizer (smol_engine)."""

from __future__ import annotations

import pytest
import torch

from emllm import EMEngine, MemoryPool
from emllm.scoring import AttentionMass, ForQuestions, Pooled
from emllm.codec import Rendered

from .tiny import Recording, tiny_engine, token_ids

CHUNK = 16  # tiny.TINY's chunk_size


def words(n: int, seed: int) -> str:
    """n tiny-vocabulary words, each one token (t30..t95: t1 and t2 are special and would split 't1x' words)."""
    return " ".join(f"t{30 + i % 66}" for i in token_ids(n, seed=seed))


DOCUMENT, QUESTION = words(100, 0), words(10, 5)


def forward_sizes(monkeypatch, engine: EMEngine, flags: list[bool] | None = None) -> list[int]:
    """Records the length of every forward the engine makes (prompt chunks, then one token per generated token)
    and, into ``flags``, whether each was an answering forward (the question's or a generated token's)."""
    sizes: list[int] = []
    real = EMEngine.forward_rows

    def spy(self, memories, ids, plans, keep, **kwargs):
        sizes.append(ids.shape[1])
        if flags is not None:
            flags.append(plans[0].answering)
        return real(self, memories, ids, plans, keep, **kwargs)

    monkeypatch.setattr(EMEngine, "forward_rows", spy)
    return sizes


def test_a_texts_question_starts_after_its_last_blank_line():
    engine = tiny_engine("S")
    prompt = engine.encode_prompt(f"{words(20, 1)}\n\n{DOCUMENT}\n\n{QUESTION}\n\n ")  # trailing space ignored
    assert prompt.question_start == 120 and prompt.ids[120:] == engine.tokenize(QUESTION)
    assert engine.encode_prompt(DOCUMENT + " " + QUESTION).question_start is None  # one paragraph: nothing to split
    assert engine.encode_prompt(engine.tokenize(DOCUMENT)).question_start is None  # token ids carry no paragraphs


def test_a_tail_longer_than_the_tokens_given_is_compared_from_their_start():
    # token_at compares the tail's tokens with the prompt's last ones. Given fewer tokens than the tail has (a
    # tokenizer that splits the tail finer than the whole), the comparison must start at the first token, not
    # wrap around to the end: here every token given is the tail's, so there is nothing before it to split off.
    engine = tiny_engine("S")
    text = f"{DOCUMENT}\n\n{QUESTION}"
    tail = engine.tokenize(QUESTION)
    assert len(tail) == 10 and engine.codec.token_at(Rendered.user_text(text), tail[-6:], len(DOCUMENT) + 2) is None
    assert engine.codec.token_at(Rendered.user_text(text), engine.tokenize(text), len(DOCUMENT) + 2) == 100


def test_an_encoded_prompt_is_taken_as_it_is_and_answers_as_its_text_does(monkeypatch):
    """A document tokenised once (encode_prompt) is not tokenised again when it is asked: at a million tokens the
    tokenizer's transient (~420 MB) would be the run's peak."""
    engine = tiny_engine("S")
    text = f"{DOCUMENT}\n\n{QUESTION}"
    encoded = engine.encode_prompt(text)
    assert engine.encode_prompt(encoded) is encoded
    sizes = forward_sizes(monkeypatch, engine)
    from_text = engine.generate(text, max_new_tokens=4)
    text_sizes = list(sizes)
    sizes.clear()
    monkeypatch.setattr(type(engine.tokenizer), "__call__", lambda *a, **k: pytest.fail("tokenised again"))
    monkeypatch.setattr(type(engine.tokenizer), "encode", lambda *a, **k: pytest.fail("tokenised again"))
    from_ids = engine.generate(encoded, max_new_tokens=4)
    assert from_ids.token_ids == from_text.token_ids and from_ids.input_tokens == len(encoded.ids)
    assert sizes == text_sizes and 10 in sizes  # the same forwards: the question (10 tokens) read on its own


def test_a_malformed_encoded_prompt_is_refused_with_the_fix():
    from emllm.codec import EncodedPrompt

    engine = tiny_engine("S")
    with pytest.raises(ValueError, match="question_start .* must fall inside its 3 ids"):
        engine.generate(EncodedPrompt([40, 41, 42], 3), max_new_tokens=1)
    with pytest.raises(TypeError, match="non-empty list of token ids"):
        engine.generate(EncodedPrompt([], None), max_new_tokens=1)
    tools = [{"type": "function", "function": {"name": "f"}}]
    with pytest.raises(ValueError, match="lists no tools: encode the messages with the same tools"):
        engine.encode_prompt(EncodedPrompt([40, 41], None), tools=tools)
    listed = engine.encode_prompt([{"role": "user", "content": "call f"}], tools)
    assert engine.encode_prompt(listed, tools) == listed  # a prompt encoded with its tools is taken as it is


def test_a_chats_question_is_its_last_paragraph_or_its_last_message():
    engine = tiny_engine("S")  # no chat template: "role: content" lines
    one_message = engine.encode_prompt([{"role": "user", "content": f"{DOCUMENT}\n\n{QUESTION}"}])
    assert one_message.ids[one_message.question_start:] == engine.tokenize(f"{QUESTION}\nassistant: ")
    turns = [{"role": "user", "content": f"{words(20, 1)}\n\n{DOCUMENT}"}, {"role": "assistant", "content": "t30"},
             {"role": "user", "content": QUESTION}]
    last_turn = engine.encode_prompt(iter(turns))  # any iterable of messages, walked once
    assert last_turn.ids[last_turn.question_start:] == engine.tokenize(f"user: {QUESTION}\nassistant: ")


def test_with_the_real_chat_template_the_question_starts_at_its_turn(smol_engine):
    doc = "The letter was sent from Lisbon in May.\n\nIt was long."
    system = [{"role": "system", "content": doc}, {"role": "user", "content": "Who sent it?"}]
    prompt = smol_engine.encode_prompt(system)
    assert smol_engine.tokenizer.decode(prompt.ids[prompt.question_start:]) == \
        "<|im_start|>user\nWho sent it?<|im_end|>\n<|im_start|>assistant\n"
    inline = smol_engine.encode_prompt([{"role": "user", "content": doc + "\n\nWho sent it?"}])
    assert smol_engine.tokenizer.decode(inline.ids[inline.question_start:]) == \
        "Who sent it?<|im_end|>\n<|im_start|>assistant\n"


def test_the_question_gets_forwards_of_its_own(monkeypatch):
    forwards = [CHUNK] * 6 + [4, 10]
    engine = tiny_engine("S")
    sizes = forward_sizes(monkeypatch, engine)
    result = engine.generate(f"{DOCUMENT}\n\n{QUESTION}", max_new_tokens=3)
    assert sizes[:len(forwards)] == forwards and sizes[len(forwards):] == [1] * (result.output_tokens - 1)


def test_one_call_equals_reading_the_document_first_then_asking():
    """The split is exactly the README's two-step recipe: same forwards, so the same retrieval and answer."""
    engine = tiny_engine("S", scorer=Pooled(AttentionMass()))
    text = f"{DOCUMENT}\n\n{QUESTION}"
    encoded = engine.encode_prompt(text)
    ids, question_start = encoded.ids, encoded.question_start
    one_call = engine.new_memory()
    first = engine.generate(text, memory=one_call, max_new_tokens=4)
    two_steps = engine.new_memory()
    engine.read(two_steps, ids[:question_start])
    second = engine.generate(ids, memory=two_steps, max_new_tokens=4)
    assert first.token_ids == second.token_ids and first.retrieved_events == second.retrieved_events
    assert one_call.token_ids == two_steps.token_ids and torch.equal(one_call.event_sizes, two_steps.event_sizes)
    for a, b in zip(one_call.layers, two_steps.layers):
        assert a.retrieved_ids == b.retrieved_ids
    one_call.close()
    two_steps.close()


def test_a_memory_pool_reads_the_question_alone_too(monkeypatch):
    engine = tiny_engine("S")
    sizes = forward_sizes(monkeypatch, engine)
    pool = MemoryPool(engine, engine.config)
    pooled = pool.generate(f"{DOCUMENT}\n\n{QUESTION}", max_new_tokens=2)
    assert sizes[:8] == [CHUNK] * 6 + [4, 10]
    assert pooled.token_ids == engine.generate(f"{DOCUMENT}\n\n{QUESTION}", max_new_tokens=2).token_ids
    pool.close()


def test_a_question_start_already_read_changes_nothing(monkeypatch):
    engine = tiny_engine("S")
    sizes = forward_sizes(monkeypatch, engine)
    memory = engine.new_memory()
    engine.read(memory, token_ids(40, seed=1))
    engine.read(memory, token_ids(40, seed=2), question_start=10)  # before this read: plain chunks
    engine.read(memory, token_ids(40, seed=3), question_start=80 + 40)  # at its end: plain chunks
    engine.read(memory, token_ids(40, seed=4), question_start=120 + 5)
    assert sizes == [16, 16, 8] * 3 + [5, 16, 16, 3]
    memory.close()


def test_attention_for_questions_scores_by_attention_only_the_answering_forwards(monkeypatch):
    scored_in: list[int] = []  # the forward each attention-scoring call came from
    flags: list[bool] = []

    class Spy(AttentionMass):
        def score(self, step):
            scored_in.append(len(flags) - 1)
            return super().score(step)

    engine = tiny_engine("S", scorer=ForQuestions(answering=Spy()))
    forward_sizes(monkeypatch, engine, flags)
    result = engine.generate(f"{DOCUMENT}\n\n{QUESTION}", max_new_tokens=3)
    assert flags == [False] * 7 + [True] * result.output_tokens  # the question, then each generated token's
    assert set(scored_in) == {i for i, answering in enumerate(flags) if answering}  # those, by attention; no other
    flags.clear()
    engine.generate(engine.tokenize(f"{DOCUMENT} {QUESTION}"), max_new_tokens=1)  # token ids: the last chunk
    assert flags == [False] * 6 + [True]


def test_a_memory_pool_asks_a_token_id_question_in_answering_forwards(monkeypatch):
    engine = tiny_engine("S", scorer=ForQuestions())
    flags: list[bool] = []
    forward_sizes(monkeypatch, engine, flags)
    pool = MemoryPool(engine, engine.config)
    document = engine.tokenize(DOCUMENT)
    pool.read(document)
    assert not any(flags)
    flags.clear()
    pool.generate(document + engine.tokenize(QUESTION), max_new_tokens=1)
    assert flags == [True]
    pool.close()


def test_attention_for_questions_keeps_the_key_copy_current_while_reading():
    """So the first question pays only for its own scoring, not for copying every stored key at once."""
    engine = tiny_engine("S", scorer=ForQuestions())
    memory = engine.new_memory()
    engine.read(memory, token_ids(300, seed=4))
    assert memory.store.num_tokens > 0
    for layer in memory.layers:  # filled up to the last retrieval, which ran before that forward's eviction
        assert 0 < layer.key_copy_length <= memory.store.num_tokens
        torch.testing.assert_close(layer.key_copy[:, :layer.key_copy_length],
                                   memory.store.layer_keys(layer.layer_index, layer.device)[:, :layer.key_copy_length]
                                   .float())
    memory.close()


def layer0_scoring(scorer) -> tuple[object, Recording, Recording]:
    """A scorer recording layer 0's own attention mass at each attention-scored forward (``own``), and, around
    ``scorer(own)``, what the composition ranked by (``ranked``)."""
    own = Recording(AttentionMass())
    ranked = Recording(scorer(own))
    return ranked, own, ranked  # the scorer to configure is the outer recording itself


def padded_sum(masses: list[torch.Tensor]) -> torch.Tensor:
    total = torch.zeros(len(masses[-1]))
    for mass in masses:  # events stored later have nothing from earlier forwards
        total[:len(mass)] += mass
    return total


def test_attention_for_questions_ranks_by_all_of_the_answers_queries_so_far(monkeypatch):
    """A generated token's query alone is a noisy guide to what the answer needs; each answering forward ranks by
    the attention of the question's queries and of every answer token so far. A new prompt starts afresh."""
    scorer, own_calls, ranked_calls = layer0_scoring(lambda own: ForQuestions(answering=own))
    engine = tiny_engine("S", scorer=scorer)
    memory = engine.new_memory()
    first = engine.generate(f"{DOCUMENT}\n\n{QUESTION}", memory=memory, max_new_tokens=4)
    own = own_calls.layer_scores(0)
    ranked_by = [scores for (scores, answering), layer in zip(ranked_calls.calls, ranked_calls.layers)
                 if answering and layer == 0]
    assert len(own) == len(ranked_by) == first.output_tokens == 4  # the question's forward, then 3 tokens' (the
    for step in range(len(own)):                                    # last token is sampled, never read)
        torch.testing.assert_close(ranked_by[step], padded_sum(own[:step + 1]))
    assert ranked_by[-1][:len(own[0])].sum() > own[0].sum()  # the question's mass is still in the last ranking
    own_calls.calls.clear(), own_calls.layers.clear(), ranked_calls.calls.clear(), ranked_calls.layers.clear()
    follow_up = engine.tokenize(f"{DOCUMENT}\n\n{QUESTION}") + first.token_ids[:-1] + engine.tokenize(" t40 t41")
    engine.generate(follow_up, memory=memory, max_new_tokens=2)  # all of it answering: token ids, one chunk
    own = own_calls.layer_scores(0)
    ranked_by = [scores for (scores, answering), layer in zip(ranked_calls.calls, ranked_calls.layers)
                 if answering and layer == 0]
    torch.testing.assert_close(ranked_by[0], own[0])  # the new prompt's question ranks afresh
    memory.close()


def test_attention_scoring_everywhere_ranks_each_forward_by_its_own_queries():
    own = Recording(AttentionMass())
    engine = tiny_engine("S", scorer=own)
    memory = engine.new_memory()
    engine.generate(f"{DOCUMENT}\n\n{QUESTION}", memory=memory, max_new_tokens=3)
    assert len(own.layer_scores(0)) > 3 and all(layer.answer_mass is None for layer in memory.layers)  # none summed
    memory.close()


def test_a_pool_reads_a_document_once_for_every_question_asked_after_it():
    """An LCEL template puts {document} then {question} in one message: each call's prompt differs only in its last
    paragraph, so the pool keeps the memory that read up to the question and the next question reads only itself;
    the answer is the one a fresh read gives (one read in two calls chunks as one call does)."""
    from emllm import MemoryPool

    from .tiny import tiny_engine, token_ids

    engine = tiny_engine("S")
    document = " ".join(f"t{i}" for i in token_ids(300, seed=5))
    pool = MemoryPool(engine)
    first = pool.generate(document + "\n\nt5 t6 t7", max_new_tokens=4)
    second = pool.generate(document + "\n\nt8 t9", max_new_tokens=4)
    asked = engine.encode_prompt(document + "\n\nt8 t9")
    assert first.new_input_tokens == first.input_tokens  # nothing was read before
    assert second.new_input_tokens == len(asked.ids) - asked.question_start < 10  # only the question
    fresh = engine.generate(document + "\n\nt8 t9", max_new_tokens=4)
    assert second.token_ids == fresh.token_ids
    pool.close()
