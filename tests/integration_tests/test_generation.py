"""Generation on the real model: greedy/sampling, stop strings, streaming, token counts, continuation."""

from __future__ import annotations

import pytest
import torch

from emllm import MemoryMismatchError
from emllm_integrations.bench.tasks import passkey_document

from .conftest import make_engine

QUESTION = [{"role": "user", "content": "List three colours of the rainbow."}]


@pytest.fixture(scope="module")
def engine(smol_fast):
    return make_engine(smol_fast, "SM")


def test_stream_deltas_join_to_the_result(engine):
    stream = engine.stream(QUESTION, max_new_tokens=24)
    deltas = list(stream)
    assert len(deltas) > 1
    assert "".join(deltas) == stream.result.text
    assert stream.result.output_tokens == 24 and stream.result.finish_reason == "length"
    assert stream.result.input_tokens == len(engine.chat_ids(QUESTION))


def test_greedy_is_deterministic_and_sampling_follows_the_seed(engine):
    greedy = [engine.chat(QUESTION, max_new_tokens=12).text for _ in range(2)]
    assert greedy[0] == greedy[1]
    sampled = [engine.chat(QUESTION, max_new_tokens=12, temperature=1.5, top_p=0.95, seed=s).text
               for s in (1, 1, 2, 3)]
    assert sampled[0] == sampled[1]
    assert len(set(sampled[1:])) > 1  # different seeds explore


def test_multi_token_stop_string_is_honoured(engine):
    full = engine.chat(QUESTION, max_new_tokens=40).text
    words = full.split()
    assert len(words) > 4
    stop = " ".join(words[2:4])  # spans several tokens, in the middle of the answer
    assert len(engine.tokenize(stop)) > 1
    stream = engine.stream(QUESTION, max_new_tokens=40, stop=[stop])
    streamed = "".join(stream)
    assert streamed == stream.result.text == full[: full.index(stop)]
    assert stream.result.finish_reason == "stop"


def test_end_of_turn_stops_generation(engine):
    result = engine.chat([{"role": "user", "content": "Say only the word: yes"}], max_new_tokens=60)
    assert result.finish_reason == "stop" and result.output_tokens < 60


def test_continuation_reads_only_new_tokens(engine):
    doc = passkey_document(3000, 0.3, engine.count_tokens, seed=5)
    first = [{"role": "user", "content": doc.prompt.rsplit("\n\n", 1)[0]}]
    memory = engine.new_memory()
    r1 = engine.chat(first, memory=memory, max_new_tokens=8)
    assert r1.new_input_tokens == r1.input_tokens
    seen = memory.total_tokens
    follow = first + [{"role": "assistant", "content": r1.text},
                      {"role": "user", "content": "What is the pass key? Answer with the number."}]
    ids = engine.chat_ids(follow)
    # Greedy on a fixed model: this answer re-tokenises to the tokens generated (measured), so the follow-up
    # extends the memory; were it not, continuation would be refused, and this test must say so.
    assert ids[:seen] == memory.token_ids, "the answer re-tokenised differently from the tokens generated"
    r2 = engine.chat(follow, memory=memory, max_new_tokens=12)
    assert r2.new_input_tokens == len(ids) - seen < 40
    assert r2.input_tokens == len(ids)


def test_a_different_conversation_is_refused_not_mixed(engine):
    memory = engine.new_memory()
    engine.chat(QUESTION, memory=memory, max_new_tokens=4)
    with pytest.raises(MemoryMismatchError, match="does not extend"):
        engine.chat([{"role": "user", "content": "Something else entirely."}], memory=memory, max_new_tokens=4)


def test_inspection_reports_surprise_and_events(engine):
    text = passkey_document(2500, 0.5, engine.count_tokens).prompt
    report = engine.inspect(text)
    n = engine.count_tokens(text)
    assert len(report.tokens) == n and report.surprise.shape == (n,)
    assert torch.isnan(report.surprise[0]) and torch.isfinite(report.surprise[1:]).all()
    starts = report.event_starts
    assert (starts[1:] > starts[:-1]).all() and starts.numel() >= n // engine.config.max_block_size
    sizes = torch.diff(starts)
    assert int(sizes.max()) <= engine.config.max_block_size
    # the needle is surprising: some event starts within its few tokens
    assert report.stats["events"] > 0 and report.stats["tokens_read"] == n


def test_consecutive_user_turns_continue_the_memory(engine):
    """Document and question as two user turns (as `emllm chat` sends them): the question extends the memory."""
    document = [{"role": "system", "content": "Answer from the document."},
                {"role": "user", "content": "Marie Curie was born in Warsaw in 1867."}]
    memory = engine.new_memory()
    engine.read(memory, engine.chat_ids(document, add_generation_prompt=False))
    read = memory.total_tokens
    result = engine.chat(document + [{"role": "user", "content": "Where was she born?"}], memory=memory,
                         max_new_tokens=12)
    assert result.new_input_tokens == result.input_tokens - read > 0
    assert "Warsaw" in result.text
