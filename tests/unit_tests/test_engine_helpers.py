"""Unit tests for the model-free helpers of emllm.engine: sampling, chat message normalisation,
stop strings while streaming, and the checks of sampling arguments."""

import math
from collections import Counter

import pytest
import torch
from hypothesis import given, settings, strategies as st

from emllm.codec import normalize_messages
from emllm.decoding import check_sampling, find_stop, safe_length, sample_token


def seeded(seed):
    return torch.Generator(device="cpu").manual_seed(seed)


def random_logits(n=50, seed=0):
    return torch.randn(n, generator=seeded(seed)) * 2


# ----------------------------------------------------------------------------- sample_token
def test_temperature_zero_is_argmax():
    for seed in range(5):
        logits = random_logits(seed=seed)
        assert sample_token(logits, 0.0, 0.5, 3, seeded(seed)) == int(logits.argmax())
        assert sample_token(logits.bfloat16(), 0.0, 1.0, 0, None) == int(logits.bfloat16().argmax())


def test_top_k_one_is_argmax_even_when_hot():
    logits = random_logits()
    best = int(logits.argmax())
    generator = seeded(1)
    assert {sample_token(logits, 50.0, 1.0, 1, generator) for _ in range(200)} == {best}


@pytest.mark.parametrize("temperature", [6.4e-195, 5e-324, 1e-30])
def test_a_temperature_near_zero_samples_the_best_token_instead_of_failing(temperature):
    """Found by the call-option fuzz: float32 logits / 6.4e-195 overflowed to inf, and softmax gave nan."""
    logits = random_logits(seed=4)
    assert sample_token(logits, temperature, 0.9, 5, seeded(4)) == int(logits.argmax())
    assert sample_token(logits.bfloat16(), temperature, 1.0, 0, seeded(4)) == int(logits.bfloat16().argmax())


def test_tiny_top_p_is_argmax():
    logits = random_logits(seed=2)
    best = int(logits.argmax())
    generator = seeded(2)
    assert {sample_token(logits, 5.0, 1e-6, 0, generator) for _ in range(200)} == {best}


def test_seeded_generator_is_reproducible():
    logits = random_logits(seed=3)
    draw = lambda seed: [sample_token(logits, 3.0, 0.95, 0, g) for g in [seeded(seed)] for _ in range(30)]  # noqa: E731
    assert draw(7) == draw(7)
    assert draw(7) != draw(8)  # 30 draws over ~50 plausible ids: equal sequences would mean the seed is ignored


def test_high_temperature_without_limits_samples_broadly():
    logits = random_logits(n=20, seed=4)
    generator = seeded(4)
    seen = {sample_token(logits, 100.0, 1.0, 0, generator) for _ in range(600)}
    assert len(seen) >= 18  # near-uniform: almost every id shows up


def test_top_k_restricts_the_support():
    logits = random_logits(n=40, seed=5)
    allowed = set(torch.topk(logits, 5).indices.tolist())
    generator = seeded(5)
    counts = Counter(sample_token(logits, 20.0, 1.0, 5, generator) for _ in range(1500))
    assert set(counts) == allowed  # only the top 5, and (hot) all of them


def test_top_k_larger_than_vocab_is_no_limit():
    logits = torch.zeros(4)
    generator = seeded(6)
    assert {sample_token(logits, 1.0, 1.0, 10, generator) for _ in range(300)} == {0, 1, 2, 3}


def test_top_p_keeps_the_smallest_set_reaching_p_and_renormalises():
    probs = torch.tensor([0.05, 0.5, 0.15, 0.3])  # best first: id 1 (0.5), 3 (0.3), 2 (0.15), 0 (0.05)
    logits = probs.log()
    generator = seeded(9)

    def frequencies(top_p, n=3000):
        counts = Counter(sample_token(logits, 1.0, top_p, 0, generator) for _ in range(n))
        return {i: c / n for i, c in counts.items()}

    assert set(frequencies(0.4, 300)) == {1}
    assert set(frequencies(0.6, 300)) == {1, 3}
    freq = frequencies(0.9)
    assert set(freq) == {1, 3, 2}
    kept = 0.5 + 0.3 + 0.15
    for i in (1, 3, 2):
        assert freq[i] == pytest.approx(float(probs[i]) / kept, abs=0.04)


def test_sampling_follows_the_softmax():
    logits = torch.tensor([0.0, math.log(3.0)])  # p = 1/4, 3/4 at temperature 1
    generator = seeded(10)
    n = 4000
    ones = sum(sample_token(logits, 1.0, 1.0, 0, generator) for _ in range(n))
    assert ones / n == pytest.approx(0.75, abs=0.03)
    ones_hot = sum(sample_token(logits, 1000.0, 1.0, 0, generator) for _ in range(n))
    assert ones_hot / n == pytest.approx(0.5, abs=0.03)  # temperature flattens


# ----------------------------------------------------------------------------- normalize_messages
def test_consecutive_same_role_messages_are_merged():
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Part one."},
                {"role": "user", "content": "Part two."},
                {"role": "assistant", "content": "OK."},
                {"role": "user", "content": "Again?"},
                {"role": "user", "content": ""},
                {"role": "user", "content": "Yes."}]
    original = [dict(m) for m in messages]
    assert normalize_messages(messages) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Part one.\n\nPart two."},
        {"role": "assistant", "content": "OK."},
        {"role": "user", "content": "Again?\n\n\n\nYes."},
    ]
    assert messages == original  # the caller's dicts are not modified


def test_extra_keys_are_dropped():
    assert normalize_messages([{"role": "user", "content": "hi", "name": "bob"}]) == [
        {"role": "user", "content": "hi"}]


def test_empty_conversation_is_refused():
    with pytest.raises(ValueError, match="empty"):
        normalize_messages([])


@pytest.mark.parametrize("message", ["hello", ("user", "hello"), None, {"role": "user"}, {"content": "hi"}])
def test_malformed_messages_are_refused(message):
    with pytest.raises(TypeError, match="'role' and 'content'"):
        normalize_messages([{"role": "user", "content": "ok"}, message])


@pytest.mark.parametrize("content", [None, 3, ["text"], {"type": "text"}, b"bytes"])
def test_non_text_content_is_refused(content):
    with pytest.raises(TypeError) as info:
        normalize_messages([{"role": "assistant", "content": content}])
    message = str(info.value)
    assert type(content).__name__ in message and "'assistant'" in message


@pytest.mark.parametrize("role", ["function", "User", "", "bot"])
def test_unknown_roles_are_refused(role):
    with pytest.raises(ValueError) as info:
        normalize_messages([{"role": role, "content": "hi"}])
    message = str(info.value)
    assert repr(role) in message and "'user'" in message and "'assistant'" in message


def test_all_whitespace_is_refused_but_one_real_message_is_enough():
    with pytest.raises(ValueError, match="whitespace"):
        normalize_messages([{"role": "system", "content": "  "}, {"role": "user", "content": "\n\t"}])
    assert len(normalize_messages([{"role": "system", "content": "  "}, {"role": "user", "content": "q"}])) == 2


# ----------------------------------------------------------------------------- stop strings
def test_find_stop_hand_cases():
    assert find_stop("hello STOP there", ["STOP"], 0) == 6
    assert find_stop("hello STOP there", ["STOP", "ello"], 0) == 1  # the earliest of several
    assert find_stop("hello there", ["STOP"], 0) is None
    assert find_stop("abcSTOP", ["STOP"], 3) == 3      # found right after what was emitted
    assert find_stop("abcSTOP", ["STOP"], 5) == 3      # spans the emitted border (emitted held nothing of it)
    assert find_stop("STOPxSTOP", ["STOP"], 6) == 5    # an old occurrence inside emitted text is ignored
    assert find_stop("anything", [], 0) is None


def test_safe_length_holds_back_a_partial_stop():
    assert safe_length("hello ST", ["STOP"]) == 6
    assert safe_length("hello S", ["STOP"]) == 6
    assert safe_length("hello", ["STOP"]) == 5
    assert safe_length("hello STO", ["STOP"]) == 6
    assert safe_length("STO", ["STOP"]) == 0
    assert safe_length("hello", []) == 5


def test_safe_length_holds_back_a_trailing_replacement_character():
    assert safe_length("abc\ufffd", []) == 3
    assert safe_length("abc\ufffd\ufffd", []) == 3
    assert safe_length("\ufffd", []) == 0
    assert safe_length("a\ufffdb", []) == 3  # a replacement character inside the text is final
    assert safe_length("abST\ufffd", ["STOP"]) == 2  # both at once


@pytest.mark.parametrize("stops", [["ABC", "BX"], ["BX", "ABC"]])
def test_safe_length_holds_back_the_longest_partial_match(stops):
    assert safe_length("xxAB", stops) == 2


@pytest.mark.parametrize("stops", [["ABCD", "CDE"], ["CDE", "ABCD"], ["ABCD", "CX", "BCY"]])
def test_safe_length_longest_of_overlapping_prefixes(stops):
    assert safe_length("zzABC", stops) == 2


def stream_with_stops(pieces, stops):
    """The engine's emission rule, token by token: find a stop, else emit what is safe; flush at the end."""
    text, emitted, deltas = "", "", []
    for piece in pieces:
        text += piece
        cut = find_stop(text, stops, len(emitted))
        if cut is not None:
            if cut > len(emitted):
                deltas.append(text[len(emitted):cut])
            return deltas, text[:cut], True
        safe = safe_length(text, stops)
        assert safe >= len(emitted), "emitted text can never be taken back"
        if safe > len(emitted):
            deltas.append(text[len(emitted):safe])
            emitted = text[:safe]
    deltas.append(text[len(emitted):])
    return deltas, text, False


def test_stop_string_split_across_tokens_is_never_emitted():
    deltas, final, stopped = stream_with_stops(["Hel", "lo <", "|en", "d|>", " more"], ["<|end|>"])
    assert stopped and final == "Hello "
    assert "".join(deltas) == "Hello "
    assert all("<" not in d for d in deltas)


@settings(max_examples=150, deadline=None)
@given(text=st.text(alphabet="abc", max_size=30),
       stops=st.lists(st.text(alphabet="abc", min_size=1, max_size=4), min_size=1, max_size=3),
       cuts=st.lists(st.integers(0, 30), max_size=10))
def test_streaming_emits_exactly_the_text_before_the_first_stop(text, stops, cuts):
    edges = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    pieces = [text[a:b] for a, b in zip(edges, edges[1:])]
    hits = [i for s in stops if (i := text.find(s)) != -1]
    # the earliest stop that is complete when it appears (the stream stops at the first token completing one)
    ends = [(text.find(s) + len(s), s) for s in stops if s in text]
    deltas, final, stopped = stream_with_stops(pieces, stops)
    assert stopped == bool(hits)
    if not stopped:
        assert final == text
    else:
        first_end = min(end for end, _ in ends)
        # stopping happens at the first piece boundary at or after the earliest completed stop
        seen = text[:min(e for e in edges if e >= first_end)]
        cut = min(i for s in stops if (i := seen.find(s)) != -1)
        assert final == text[:cut]
        assert all(s not in final for s in stops)
    assert "".join(deltas) == final


# ----------------------------------------------------------------------------- check_sampling
def test_valid_sampling_arguments():
    check_sampling(1, 0.0, 1.0, 0)
    check_sampling(512, 0.7, 0.9, 40)
    check_sampling(3, 2.0, 1e-9, 1)


@pytest.mark.parametrize("args, field", [
    ((0, 0.0, 1.0, 0), "max_new_tokens"),
    ((-4, 0.0, 1.0, 0), "max_new_tokens"),
    ((2.5, 0.0, 1.0, 0), "max_new_tokens"),
    (("8", 0.0, 1.0, 0), "max_new_tokens"),
    ((8, -0.1, 1.0, 0), "temperature"),
    ((8, 0.7, 0.0, 0), "top_p"),
    ((8, 0.7, 1.01, 0), "top_p"),
    ((8, 0.7, -0.5, 0), "top_p"),
    ((8, 0.7, math.nan, 0), "top_p"),
    ((8, 0.7, 0.9, -1), "top_k"),
])
def test_invalid_sampling_arguments_name_the_field(args, field):
    with pytest.raises(ValueError, match=field):
        check_sampling(*args)


@pytest.mark.parametrize("args, field", [((8, math.nan, 1.0, 0), "temperature"), ((8, 0.7, 1.0, 2.5), "top_k")])
def test_nan_temperature_and_float_top_k_are_refused(args, field):
    with pytest.raises(ValueError, match=field):
        check_sampling(*args)


def test_fold_system_moves_system_text_into_the_next_user_turn():
    from emllm.codec import fold_system

    folded = fold_system([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                          {"role": "assistant", "content": "Hello"}, {"role": "system", "content": "Late rule."}])
    assert folded == [{"role": "user", "content": "Be brief.\n\nHi"}, {"role": "assistant", "content": "Hello"},
                      {"role": "user", "content": "Late rule."}]


def test_normalize_messages_without_merge_keeps_turns():
    from emllm.codec import normalize_messages

    turns = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    assert normalize_messages(turns, merge=False) == turns
    assert normalize_messages(turns) == [{"role": "user", "content": "a\n\nb"}]




def test_inspection_lists_every_event_start_including_the_one_at_the_window():
    """inspect() must report each stored event and the window's first event as separate events: a missing start
    where the last stored event ends merged two events in the cookbook's event-size histogram."""
    from .tiny import tiny_engine, token_ids

    engine = tiny_engine("S")
    text = " ".join(f"t{i}" for i in token_ids(200, seed=6))
    inspection = engine.inspect(text)
    memory = engine.new_memory()
    engine.read(memory, text)
    assert memory.num_events > 0 and memory.layers[0].length > 0
    expected = set(memory.event_boundaries().tolist()) | {memory.local_start}
    starts = inspection.event_starts.tolist()
    assert expected <= set(starts)
    assert starts == sorted(set(starts))  # strictly increasing, no duplicate
    sizes = torch.diff(torch.tensor(starts + [len(inspection.tokens)]))
    assert int(sizes[:-1].max()) <= engine.config.max_block_size  # closed events keep the size limit


def test_layers_holding_counts_each_layer_once_for_a_span_across_events():
    """The per-layer diagnostics count the layers attending to a fact sentence; when the sentence straddles two
    events that one layer both retrieved, that layer is one layer, not two (the benchmark once reported 25 of 24)."""
    from .tiny import tiny_engine, token_ids

    engine = tiny_engine("S")
    memory = engine.new_memory()
    engine.read(memory, token_ids(300, seed=3))
    assert memory.num_events >= 4
    starts = memory.event_boundaries().tolist()
    ends = (memory.event_boundaries() + memory.event_sizes).tolist()
    first_layer, second_layer = memory.layers
    first_layer.retrieved_ids, second_layer.retrieved_ids = (1, 2), (2,)  # as a retrieval leaves them
    across = (ends[1] - 1, starts[2] + 1)  # the last token of event 1 and the first of event 2
    per_event = sum(e.layers for e in memory.retrieved_events() if e.start < across[1] and e.end > across[0])
    assert per_event == 3 and memory.layers_holding(*across) == 2
    assert memory.layers_holding(starts[1], ends[1]) == 1
    assert memory.layers_holding(starts[2], ends[2]) == 2
    assert memory.layers_holding(starts[3], ends[3]) == 0
    assert memory.layers_holding(starts[1], ends[3]) == 2
    # The events behind those counts: a span inside one event, one straddling a boundary, and whole events.
    assert memory.events_overlapping(starts[1], starts[1] + 1) == [1]
    assert memory.events_overlapping(*across) == [1, 2]
    assert memory.events_overlapping(starts[1], ends[3]) == [1, 2, 3]
    assert memory.events_overlapping(ends[-1], ends[-1] + 5) == []  # past the stored tokens: nothing


@pytest.mark.parametrize("options, error, words", [
    (dict(stop="seven!"), TypeError, "stop=['seven!']"),      # a lone string would stop at any of its characters
    (dict(stop=[1]), TypeError, "non-empty strings only"),
    (dict(stop=[None]), TypeError, "non-empty strings only"),  # not dropped silently
    (dict(stop=["ok", ""]), TypeError, "non-empty strings only"),
    (dict(stop=3), TypeError, "list of strings"),
    (dict(stop={"a": 1}), TypeError, "list of strings"),    # a dict would stop at its keys (found by the fuzz)
    (dict(stop=iter(["x"])), TypeError, "list of strings"),  # a one-pass iterator: the check would use it up
    (dict(seed="abc"), ValueError, "seed must be None or an integer"),
    (dict(seed=1.5), ValueError, "seed must be None or an integer"),
    (dict(seed=2 ** 80), ValueError, "seed must be None or an integer"),
    (dict(seed=-1), ValueError, "seed must be None or an integer"),
    (dict(seed=True), ValueError, "seed must be None or an integer"),
])
def test_bad_stop_and_seed_are_refused_with_the_fix(options, error, words):
    with pytest.raises(error) as raised:
        check_sampling(8, 0.0, 1.0, 0, **options)
    assert words in str(raised.value)


def test_good_stop_and_seed_pass():
    check_sampling(8, 0.0, 1.0, 0, seed=2 ** 64 - 1, stop=["\n\n", "Q:"])
    check_sampling(8, 0.0, 1.0, 0, seed=0, stop=("x",))
    check_sampling(8, 0.0, 1.0, 0, seed=None, stop=[])


@pytest.mark.parametrize("options", [dict(stop="seven!"), dict(seed="abc"), dict(stop=[None])])
def test_the_engine_and_a_pool_refuse_bad_options_before_reading(options):
    from emllm import MemoryPool

    from .tiny import tiny_engine, token_ids

    engine = tiny_engine("S")
    memory = engine.new_memory()
    with pytest.raises((TypeError, ValueError)):
        engine.generate(token_ids(300), memory=memory, max_new_tokens=4, **options)
    assert memory.total_tokens == 0
    pool = MemoryPool(engine, engine.config)
    with pytest.raises((TypeError, ValueError)):
        pool.generate(token_ids(300), max_new_tokens=4, **options)
    assert pool.num_checkpoints == 0
    pool.close()
    memory.close()


def test_a_memory_that_is_not_one_is_refused_with_the_fix():
    from .tiny import tiny_engine

    with pytest.raises(TypeError, match=r"memory must be an EpisodicMemory \(engine.new_memory\(\)\)"):
        tiny_engine("S").generate([5, 6, 7], memory="x")


# ----------------------------------------------------------------------------- the engine's default config
def test_a_default_layout_the_model_cannot_hold_is_refused_when_used_not_when_loading():
    """A shared engine (ChatEMLLM, EMLLM) is loaded with the default config, which its pools never use: they bring
    their own. A small model (512 positions here, 4,352 needed by the default) must load; a memory that would use
    the default is refused then, naming the field, and a config given explicitly is checked at once."""
    from emllm import ConfigError, EMConfig, EMEngine

    from .tiny import TINY, tiny_model, tiny_tokenizer

    engine = EMEngine(tiny_model(), tiny_tokenizer())
    with pytest.raises(ConfigError, match="n_local"):
        engine.new_memory()
    engine.new_memory(EMConfig.from_preset("E", **TINY)).close()
    with pytest.raises(ConfigError, match="n_local"):
        EMEngine(tiny_model(), tiny_tokenizer(), EMConfig.from_preset("E"))


def test_allow_empty_false_keeps_the_end_away_until_something_visible_is_written():
    from .tiny import tiny_engine

    engine = tiny_engine("S")
    prompt = " ".join(f"t{i % 90 + 3}" for i in range(40))
    first = engine.generate(prompt, max_new_tokens=4).token_ids[0]
    engine.eos_ids = {first}  # the greedy first token now ends the turn
    assert engine.generate(prompt, max_new_tokens=4).text == ""
    kept = engine.generate(prompt, max_new_tokens=4, allow_empty=False)
    assert kept.text.strip() and kept.token_ids[0] != first


def test_a_pool_of_four_keeps_three_conversations_on_one_document():
    """Issue 58, item 3: each call keeps up to three checkpoints (the document before its question, the prompt, the
    answer). Counting checkpoints, MemoryPool(max_memories=4) kept about one conversation: of three sessions on one
    document, two re-read everything at their second turn. Counting conversations, every second turn reads only
    its own new tokens; a fifth conversation then pushes out the least recently used."""
    from emllm import MemoryPool

    from .tiny import tiny_engine, token_ids

    engine = tiny_engine("S")
    pool = MemoryPool(engine, engine.config, max_memories=4)
    document = token_ids(300)
    firsts = []
    for session in range(3):
        prompt = document + token_ids(12, seed=100 + session)
        firsts.append(prompt + pool.generate(prompt, max_new_tokens=4).token_ids)
    for session, history in enumerate(firsts):
        follow_up = token_ids(9, seed=200 + session)
        read = pool.generate(history + follow_up, max_new_tokens=4).new_input_tokens
        assert read == len(follow_up) + 1, session  # and the answer's last token, which no forward had read
    for session in range(3, 5):  # two more conversations: the least recently used (session 0) is the one dropped
        pool.generate(document + token_ids(12, seed=100 + session), max_new_tokens=4)
    resumed = [pool.acquire(history) for history in firsts]  # the longest kept prefix of each session
    assert resumed[0].total_tokens < len(firsts[0]) and resumed[2].total_tokens == len(firsts[2]) - 1
    for memory in resumed:
        memory.close()
    assert pool.num_checkpoints <= 3 * 4
    pool.close()


def test_a_held_checkpoint_is_the_kept_memory_itself_and_cannot_be_evicted_meanwhile():
    """A server saves a session's checkpoint after every turn: held() gives the checkpoint itself (no fork copying
    its window and index), the longest kept prefix of the ids, and the pool's other calls wait until it is let go."""
    import threading

    from emllm import MemoryPool

    from .tiny import tiny_engine, token_ids

    engine = tiny_engine("S")
    pool = MemoryPool(engine, engine.config, max_memories=1)
    prompt = token_ids(200)
    answered = prompt + pool.generate(prompt, max_new_tokens=4).token_ids
    open_before, kept = len(engine.open_memories()), pool.num_checkpoints
    with pool.held(answered + token_ids(5, seed=9)) as memory:
        assert memory is not None and memory.total_tokens == len(answered) - 1  # the last answer token is unread
        assert len(engine.open_memories()) == open_before  # not a fork
        other = threading.Thread(target=pool.generate, args=(token_ids(150, seed=3),), kwargs={"max_new_tokens": 2})
        other.start()
        other.join(timeout=2)
        assert other.is_alive() and not memory.closed  # the other conversation waits to keep (and evict) anything
        assert pool.num_checkpoints == kept and len(engine.open_memories()) == open_before  # it has not begun
    other.join(timeout=120)
    assert not other.is_alive()
    with pool.held(token_ids(7, seed=42)) as nothing:
        assert nothing is None
    pool.close()
