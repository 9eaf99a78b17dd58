"""reread=True (emllm.reread) on the tiny model: the answer is written from exactly the tokens the memory attends to,
re-read under full attention; the conversation's memory then holds the answer as a normal one does; every surface
that takes decoding options takes it, and a bad value is refused before anything is read."""

from __future__ import annotations

import threading

import pytest
import torch

from emllm import EMConfig, MemoryPool
from emllm.reread import attended_positions

from .tiny import tiny_engine, token_ids

PAST_THE_WINDOW = 300  # the tiny layout's window is 32 tokens: most of the prompt is evicted into events


@pytest.fixture(scope="module")
def engine():
    return tiny_engine("S")


def test_the_answer_is_full_attention_over_what_the_memory_attends_to(engine):
    ids = token_ids(PAST_THE_WINDOW)
    memory = engine.new_memory()
    reread = engine.generate(ids, memory=memory, max_new_tokens=6, reread=True)
    ranked = engine.new_memory()
    engine.read_prompt(ranked, ids, None)
    kept = attended_positions(ranked)
    assert kept.numel() < len(ids)  # something was left out: the re-read is not the whole prompt
    by_hand = engine.generate(torch.tensor(ids)[kept].tolist(), memory=engine.new_memory(EMConfig.from_preset("full")),
                              max_new_tokens=6)
    assert reread.token_ids == by_hand.token_ids
    assert reread.retrieved_events and reread.input_tokens == len(ids) == reread.new_input_tokens


def test_the_conversation_memory_holds_the_answer_as_after_a_normal_answer(engine):
    """The next turn extends prompt + answer, so the memory must have read the answer's tokens (all but the last,
    as decode leaves them) whichever way the answer was read."""
    ids = token_ids(PAST_THE_WINDOW, seed=1)
    plain, reread = engine.new_memory(), engine.new_memory()
    normal = engine.generate(ids, memory=plain, max_new_tokens=5)
    answer = engine.generate(ids, memory=reread, max_new_tokens=5, reread=True)
    assert plain.token_ids == ids + normal.token_ids[:-1]
    assert reread.token_ids == ids + answer.token_ids[:-1]
    follow_up = reread.token_ids + [answer.token_ids[-1], *token_ids(20, seed=2)]
    second = engine.generate(follow_up, memory=reread, max_new_tokens=3, reread=True)
    assert second.new_input_tokens == 21 and len(second.token_ids) == 3


def test_no_re_read_is_left_open(engine):
    before = len(engine.open_memories())
    memory = engine.new_memory()
    engine.generate(token_ids(PAST_THE_WINDOW, seed=3), memory=memory, max_new_tokens=2, reread=True)
    assert len(engine.open_memories()) == before + 1
    memory.close()


def test_a_prompt_inside_the_window_is_answered_as_without_reread(engine):
    ids = token_ids(24, seed=4)
    assert engine.generate(ids, max_new_tokens=5, reread=True).token_ids == \
        engine.generate(ids, max_new_tokens=5).token_ids


def test_attention_is_credited_to_the_prompt_positions_it_re_read(engine):
    ids = token_ids(PAST_THE_WINDOW, seed=5)
    memory = engine.new_memory()
    result = engine.generate(ids, memory=memory, max_new_tokens=4, reread=True, attribute=True)
    ranked = engine.new_memory()
    engine.read_prompt(ranked, ids, None)
    kept = attended_positions(ranked)
    attention = result.attention
    assert attention is not None and attention.shape[0] == len(ids) + 4
    left_out = torch.ones(len(ids), dtype=torch.bool)
    left_out[kept] = False
    assert float(attention[:len(ids)][left_out].abs().sum()) == 0.0
    events = kept[(kept >= ranked.stats()["tokens_sinks"]) & (kept < len(ids) - ranked.stats()["tokens_local"])]
    assert events.numel() and float(attention[events].sum()) > 0  # the retrieved events were read and attended


def test_a_bad_reread_is_refused_before_reading(engine):
    memory = engine.new_memory()
    with pytest.raises(TypeError, match="reread must be True or False"):
        engine.generate(token_ids(50), memory=memory, reread="yes")
    assert memory.total_tokens == 0


def test_the_pool_re_reads_and_resumes_the_next_turn(engine):
    pool = MemoryPool(engine, engine.config)
    ids = token_ids(PAST_THE_WINDOW, seed=6)
    first = pool.generate(ids, max_new_tokens=4, reread=True)
    assert first.token_ids == engine.generate(ids, max_new_tokens=4, reread=True).token_ids
    follow_up = ids + first.token_ids + token_ids(10, seed=7)
    second = pool.generate(follow_up, max_new_tokens=2, reread=True)
    assert second.new_input_tokens == 11  # the answer's last token and the follow-up: the rest was kept
    pool.close()


def test_concurrent_re_reads_answer_as_alone(engine):
    prompts = [token_ids(PAST_THE_WINDOW, seed=10 + i) for i in range(3)]
    alone = [engine.generate(ids, max_new_tokens=4, reread=True).token_ids for ids in prompts]
    together: list = [None] * 3

    def answer(i: int) -> None:
        together[i] = engine.generate(prompts[i], max_new_tokens=4, reread=True).token_ids

    threads = [threading.Thread(target=answer, args=(i,)) for i in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert together == alone
