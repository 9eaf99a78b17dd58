"""Fuzzed bad input and input limits: every case ends in a correct result or a clear exception, never a hang, a
crash of the process or a wrong memory.

No model weights: a tiny random Llama runs the real engine (chunked reading, surprise, refinement, eviction, pages,
retrieval, decoding). Text goes through the REAL SmolLM2 tokenizer (only its files, from the embedded model's
cache) into a tiny model with the same vocabulary, so tokenisation, the chat template and generation run end to end.

The properties, drawn by hypothesis:
- valid configs read any input into a memory whose token ids are the input, whose events tile the evicted tokens
  with sizes in [min_block_size, max_block_size]; invalid configs raise ConfigError naming the field;
- token ids: in-vocabulary ids are read exactly; out-of-vocabulary, negative, float, bool, None or bytes are refused
  before any work with TypeError/ValueError;
- text and message lists: a GenerationResult, or ValueError/TypeError with a message (no other exception type);
- never a wrong memory: after a call that raised, the memory passed in has exactly the tokens it had, or is
  closed and says why; a later valid call still works.
Limits: max_input_tokens and disk_budget_mb are refused before work where the need is known, and a disk budget
that a read still overruns (pages are only known once events are cut) closes the memory rather than leaving it
half-updated.
"""

from __future__ import annotations

import math
import os
from collections import Counter

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from emllm import ConfigError, EMConfig, EMEngine, GenerationResult, StorageFullError
from emllm.storage import PageStore
from emllm.scoring import AttentionMass, ForQuestions, Pooled, Representatives, with_parameters

from .tiny import TINY, VOCAB, tiny_engine, token_ids

pytestmark = pytest.mark.timeout(300)  # a hang fails the test instead of stalling the run

CASES: Counter = Counter()  # examples run per property, printed at the end (pytest -s) for the record


def fuzz(max_examples: int) -> settings:
    """No deadline (a shared 2-core machine), no example database in the repo, fixtures reused across examples."""
    return settings(max_examples=max_examples, deadline=None, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module", autouse=True)
def report_cases():
    """Print CASES once the module's properties have run. Public: test_fuzz_api imports it with CASES, so that its
    properties are counted and reported the same way."""
    yield
    print("\nfuzz cases run: " + ", ".join(f"{name}={n}" for name, n in sorted(CASES.items())))


@pytest.fixture(scope="module")
def engine() -> EMEngine:
    return tiny_engine()


# ============================================================================ configs
@st.composite
def valid_configs(draw) -> dict:
    """Every field in a range the tiny model (512 positions, 2 layers) can hold, in any combination."""
    max_block = draw(st.integers(1, 24))
    n_mem = max_block + draw(st.integers(0, 40))
    contiguity = draw(st.sampled_from([0.0, 0.0, 0.1, 0.3, 0.6]))
    assume(n_mem - int(round(n_mem * contiguity)) >= max_block)
    return dict(
        n_init=draw(st.integers(0, 16)), n_local=draw(st.integers(1, 64)), n_mem=n_mem,
        chunk_size=draw(st.integers(1, 48)), segmentation=draw(st.sampled_from(["surprise", "fixed"])),
        refinement=draw(st.sampled_from(["none", "modularity", "conductance"])),
        gamma=draw(st.floats(-3, 3, allow_nan=False)), surprise_window=draw(st.integers(1, 128)),
        min_block_size=draw(st.integers(1, (max_block + 1) // 2)), max_block_size=max_block,
        repr_topk=draw(st.integers(1, 6)),
        contiguity=contiguity, contiguity_neighbours=draw(st.integers(1, 3)),
        scorer=with_parameters(
            draw(st.sampled_from([Representatives(), AttentionMass(), ForQuestions(), Pooled(ForQuestions())])),
            Representatives, backend=draw(st.sampled_from(["auto", "torch", "faiss"])),
            faiss_min_events=draw(st.sampled_from([1, 20_000]))),
        memory_positions=draw(st.sampled_from(["fixed", "ordered"])),
        attention=draw(st.sampled_from(["episodic"] * 5 + ["full"])), page_tokens=draw(st.integers(1, 32)),
        ram_budget_mb=draw(st.sampled_from([None, 0, 0.01])))


def token_inputs() -> st.SearchStrategy[list[int]]:
    """Structured ids (repeated phrases), one token repeated, or uniform ids; lengths 1 .. 3000."""
    length = st.one_of(st.integers(1, 40), st.integers(40, 400), st.integers(400, 2500))
    structured = st.builds(lambda n, seed: token_ids(n, seed), length, st.integers(0, 10_000))
    run = st.builds(lambda n, t: [t] * n, length, st.integers(0, VOCAB - 1))
    uniform = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=300)
    return st.one_of(structured, run, uniform)


def check_memory(memory, ids: list[int]) -> None:
    """The memory holds exactly the input, and its events tile what was evicted within the size limits."""
    config = memory.config
    assert memory.token_ids == ids
    assert memory.surprise.shape[0] == memory.boundary_flags.shape[0] == len(ids)
    sizes, starts = memory.event_sizes, memory.event_starts
    if config.attention == "full":
        assert memory.num_events == 0 and memory.layers[0].length == len(ids)
        return
    assert int(sizes.sum()) == memory.store.num_tokens
    if memory.num_events:
        assert int(sizes.min()) >= config.min_block_size and int(sizes.max()) <= config.max_block_size, sizes
        assert starts[0] == 0 and torch.equal(starts[1:], starts[:-1] + sizes[:-1])  # contiguous, in order
    sinks = memory.layers[0].sink_keys.shape[1]
    assert sinks + memory.store.num_tokens + memory.layers[0].length == len(ids)  # no token lost or doubled
    assert memory.local_start == sinks + memory.store.num_tokens
    assert memory.layers[0].length <= config.max_position()


@fuzz(30)
@given(fields=valid_configs(), ids=token_inputs(), preset=st.sampled_from(["S", "SM", "F", "SM+C", "FC"]))
def test_valid_configs_read_any_input_exactly(engine, fields, ids, preset, tmp_path):
    CASES["valid configs"] += 1
    config = EMConfig.from_preset(preset, **fields, offload_dir=str(tmp_path))
    memory = engine.new_memory(config)
    try:
        assert engine.read(memory, ids) == len(ids)
        check_memory(memory, ids)
        result = engine.generate(ids + [5], memory=memory, max_new_tokens=3, temperature=0.8, seed=1)
        assert result.new_input_tokens == 1 and 1 <= result.output_tokens <= 3
        assert memory.token_ids[:len(ids) + 1] == ids + [5]
        for event in result.retrieved_events:
            assert 0 <= event.start < event.end <= len(ids) + 1 and 1 <= event.layers <= 2
    finally:
        memory.close()


BAD_VALUES = {
    # field: values it must refuse
    **{name: [0, -1, 1.5, True, "8", None] for name in (
        "n_local", "n_mem", "chunk_size", "min_block_size", "max_block_size", "repr_topk", "surprise_window",
        "contiguity_neighbours", "page_tokens")},
    "n_init": [-1, 2.5, False, "4", None],
    "segmentation": ["Surprise", "", None, 1],
    "refinement": ["modular", None, 0],
    "attention": ["sparse", None],
    "scorer": ["attention", None, 3],
    "contiguity": [1.0, -0.1, math.nan, math.inf, "0.3", True],
    "gamma": [math.nan, math.inf, -math.inf, "1", None, True],
    "ram_budget_mb": [-1, math.nan, "10", True],
    "device_budget_mb": [-0.5, math.nan, "1"],
    "disk_budget_mb": [-1, math.nan, "5", False],
    "max_input_tokens": [0, -3, 1.5, "100", True],
    "offload_dir": [3, 1.5, ["x"]],
}


@fuzz(150)
@given(fields=valid_configs(), field=st.sampled_from(sorted(BAD_VALUES)), data=st.data())
def test_invalid_configs_raise_config_error_naming_the_field(fields, field, data):
    CASES["invalid configs"] += 1
    value = data.draw(st.sampled_from(BAD_VALUES[field]))
    with pytest.raises(ConfigError) as error:
        EMConfig.from_preset("SM", **{**fields, field: value})
    assert field in str(error.value), str(error.value)


@fuzz(60)
@given(min_size=st.integers(1, 64), max_size=st.integers(1, 128))
def test_block_sizes_are_valid_exactly_when_every_event_can_be_cut(engine, min_size, max_size):
    """Cutting an event a little longer than max_size needs max_size >= 2 * min_size - 1 (segmentation)."""
    CASES["block size pairs"] += 1
    fields = dict(TINY, min_block_size=min_size, max_block_size=max_size, n_mem=max(max_size, 32), n_init=0,
                  n_local=8, chunk_size=8)
    if max_size >= 2 * min_size - 1:
        memory = engine.new_memory(EMConfig.from_preset("F", **fields))
        ids = token_ids(3 * max_size + 40)
        engine.read(memory, ids)
        check_memory(memory, ids)
        memory.close()
    else:
        with pytest.raises(ConfigError, match="max_block_size") as error:
            EMConfig.from_preset("F", **fields)
        assert "min_block_size" in str(error.value)


@fuzz(40)
@given(fields=valid_configs(), unknown=st.text(st.characters(min_codepoint=97, max_codepoint=122), min_size=3))
def test_unknown_fields_and_impossible_layouts_are_config_errors(engine, fields, unknown):
    CASES["unknown/impossible configs"] += 1
    assume(unknown not in EMConfig.__dataclass_fields__)
    with pytest.raises(ConfigError, match="Unknown config field"):
        EMConfig.from_preset("SM", **fields, **{unknown: 1})
    if fields["attention"] == "full":
        return
    too_wide = EMConfig.from_preset("SM", **{**fields, "n_local": 600})  # valid alone, beyond the model's 512
    with pytest.raises(ConfigError, match="n_local"):
        engine.new_memory(too_wide)


# ============================================================================ token ids
def refused_or_exact(engine, memory, call) -> str:
    """Run ``call``; if it raises it must be TypeError/ValueError with a message and leave the memory as it was
    (or closed, saying why). Returns "ok" or "refused"."""
    before = list(memory.token_ids)
    try:
        call()
        return "ok"
    except (TypeError, ValueError) as error:
        assert str(error), "an error without a message"
        assert memory.closed or memory.token_ids == before, "a refused call changed the memory"
        if memory.closed:
            assert memory.closed_reason
        return "refused"


BAD_TOKEN = st.one_of(st.integers(max_value=-1), st.integers(min_value=VOCAB), st.floats(allow_nan=True),
                      st.booleans(), st.none(), st.text(max_size=3), st.binary(max_size=2))


@fuzz(80)
@given(prefix=st.integers(0, 60), good=st.lists(st.integers(0, VOCAB - 1), max_size=60),
       bad=st.lists(st.tuples(st.integers(0, 60), BAD_TOKEN), max_size=3), how=st.sampled_from(["read", "generate"]))
def test_token_ids_are_read_exactly_or_refused_before_work(engine, prefix, good, bad, how):
    CASES["token id lists"] += 1
    memory = engine.new_memory()
    try:
        start = token_ids(prefix, seed=prefix)
        if start:
            engine.read(memory, start)
        ids = list(good)
        for position, token in bad:
            ids.insert(min(position, len(ids)), token)
        if how == "read":
            outcome = refused_or_exact(engine, memory, lambda: engine.read(memory, ids))
        else:
            outcome = refused_or_exact(engine, memory,
                                       lambda: engine.generate(start + ids, memory=memory, max_new_tokens=2))
        CASES[f"token id lists {outcome}"] += 1
        assert outcome == ("refused" if bad or (how == "generate" and not start + ids) else "ok")
        if outcome == "ok":
            assert memory.token_ids[:len(start) + len(ids)] == start + ids
        else:
            assert memory.token_ids == start
            # a later valid call still works on the same memory
            result = engine.generate(start + [7, 8], memory=memory, max_new_tokens=2)
            assert result.new_input_tokens == 2 and memory.token_ids[:len(start) + 2] == start + [7, 8]
    finally:
        memory.close()


@pytest.mark.parametrize("prompt, error, words", [
    (None, TypeError, "got NoneType"), (7, TypeError, "got int"), (2.5, TypeError, "got float"),
    (b"t3 t4", TypeError, "decode"), (bytearray(b"\xff\xfe"), TypeError, "decode"),
    ({"role": "user", "content": "t3"}, TypeError, "got dict"), ([], ValueError, "empty"),
    ([3, 4.0], TypeError, "list of"), ([3, None], TypeError, "list of"), ([torch.tensor(3)], TypeError, "list of"),
    ([3, VOCAB], ValueError, "vocabulary"), ([-1], ValueError, "vocabulary"), ([2**70], ValueError, "vocabulary"),
])
def test_prompts_that_are_not_text_messages_or_ids(engine, prompt, error, words):
    with pytest.raises(error, match=words):
        engine.generate(prompt, max_new_tokens=1)
    memory = engine.new_memory()
    if not isinstance(prompt, (list, str)):
        with pytest.raises(TypeError):
            engine.read(memory, prompt)
    assert memory.token_ids == []
    memory.close()


# ============================================================================ text through the real tokenizer
WEIRD = ["\x00", "\x01\x02\x1b[31m\x7f", "\ufeff", "\u200b", "\u202e", "\uffff", "\U0010ffff", "\r\n", "\t",
         "é", "世界", "🙂", "👩‍👩‍👧", "مرحبا", "שלום", "Ꭰ", "<|im_start|>", "<|im_end|>", "<|endoftext|>", "\ud800",
         "\udfff", " "]
SHORT_TEXT = st.one_of(
    st.text(st.characters(blacklist_categories=()), max_size=200),  # any code point, lone surrogates included
    st.lists(st.sampled_from(WEIRD + ["a", "word ", "\n"]), max_size=60).map("".join))
TEXT = st.one_of(SHORT_TEXT, st.builds(lambda c, n: c * n, st.sampled_from(WEIRD + ["a", "-", "0"]),
                                       st.integers(1, 1500)))  # longer runs: see the max_input_tokens test


def _unrepresentable_bytes() -> frozenset[int]:
    """Bytes the SmolLM2 byte-level vocabulary has no token for (GPT-2's byte-to-character table)."""
    try:
        from emllm.models import resolve_model_dir
        from transformers import AutoTokenizer
        from transformers.convert_slow_tokenizer import bytes_to_unicode

        vocab = AutoTokenizer.from_pretrained(resolve_model_dir("smollm2", progress=False)).get_vocab()
    except Exception:  # no tokenizer here: the tests that need it skip with the reason
        return frozenset()
    return frozenset(b for b, c in bytes_to_unicode().items() if c not in vocab)


UNREPRESENTABLE = _unrepresentable_bytes()


def expected_text_error(text: str) -> str | None:
    """What the engine must refuse a text for, or None if it must answer."""
    if not text.strip():
        return "empty"
    if any("\ud800" <= c <= "\udfff" for c in text):
        return "surrogate"
    data = text.encode()
    if all(b in UNREPRESENTABLE for b in data):
        return "gives no tokens"
    if any(b in UNREPRESENTABLE for b in data):
        return "has no token for"
    return None


@fuzz(50)
@given(text=TEXT)
def test_any_text_is_answered_from_exactly_its_tokens_or_refused(smol_engine, text):
    CASES["texts"] += 1
    reason = expected_text_error(text)
    memory = smol_engine.new_memory()
    try:
        if reason is not None:
            with pytest.raises(ValueError, match=reason):
                smol_engine.generate(text, memory=memory, max_new_tokens=2)
            assert memory.token_ids == [] and not memory.closed
            CASES["texts refused"] += 1
            return
        ids = smol_engine.prompt_ids(text)
        assert smol_engine.tokenizer.decode(ids) == text  # the memory holds this text, not another
        result = smol_engine.generate(text, memory=memory, max_new_tokens=2)
        assert isinstance(result, GenerationResult) and result.input_tokens == len(ids)
        assert memory.token_ids[:len(ids)] == ids
    finally:
        memory.close()


def test_characters_the_tokenizer_cannot_represent_are_refused_not_dropped(smol_engine):
    """Before: "a\x04b" was read as "ab" (SmolLM2 has no token for 0x04), so the memory held another text."""
    for text, bad in [("a\x04b", "\x04"), ("key \U00040000 here", "\U00040000"), ("ok\x1d", "\x1d")]:
        with pytest.raises(ValueError, match="has no token for") as error:
            smol_engine.prompt_ids(text)
        assert repr(bad) in str(error.value) and f"U+{ord(bad):04X}" in str(error.value), str(error.value)
    with pytest.raises(ValueError, match="has no token for"):  # in a conversation too
        smol_engine.chat([{"role": "user", "content": "the key is \x04 7"}], max_new_tokens=1)
    assert smol_engine.tokenizer.decode(smol_engine.prompt_ids("café é 中文 🙂")) == "café é 中文 🙂"


def test_text_the_tokenizer_drops_entirely_is_refused(smol_engine):
    """Before: "\x04" tokenized to [] and generate raised MemoryMismatchError "0 tokens does not extend 0"."""
    assert 0x04 in UNREPRESENTABLE
    with pytest.raises(ValueError, match="gives no tokens"):
        smol_engine.generate("\x04\x04", max_new_tokens=1)


def test_huge_single_character_runs_are_refused_by_the_limit_before_reading(smol_engine):
    config = smol_engine.config.replace(max_input_tokens=2000)
    for text in ["a" * 200_000, "\x00" * 100_000, "🙂" * 50_000, "a " * 100_000]:
        memory = smol_engine.new_memory(config)
        with pytest.raises(ValueError, match="max_input_tokens=2000"):
            smol_engine.read(memory, text)
        assert memory.token_ids == [] and memory.store.num_tokens == 0 and memory.layers[0].length == 0
        memory.close()


@pytest.mark.parametrize("value", [None, 3, b"hello", bytearray(b"\xc3\x28"), ["hello"]])
def test_non_text_is_a_clear_type_error(smol_engine, value):
    with pytest.raises(TypeError, match="decode|Expected text"):
        smol_engine.tokenize(value)


# ============================================================================ message lists
ROLE = st.one_of(st.sampled_from(["system", "user", "assistant", "tool"] * 3),
                 st.sampled_from(["function", "User", "", "bot"]),
                 st.none(), st.integers(0, 2))
CONTENT = st.one_of(SHORT_TEXT, SHORT_TEXT, st.none(), st.integers(), st.lists(st.text(max_size=3), max_size=2))
VALID_MESSAGE = st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant"]),
                                       "content": SHORT_TEXT})
MESSAGE = st.one_of(
    st.fixed_dictionaries({"role": ROLE, "content": CONTENT}),
    st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant"]), "content": SHORT_TEXT}),
    st.fixed_dictionaries({"role": ROLE}),  # content missing
    st.fixed_dictionaries({"content": CONTENT}),  # role missing
    st.fixed_dictionaries({"role": st.just("user"), "content": SHORT_TEXT, "name": st.text(max_size=5)}),
    st.text(max_size=5), st.integers(), st.none(), st.tuples(st.just("user"), st.text(max_size=5)))


def message_list_is_valid(messages: list, vocab: int) -> bool:
    if not messages:
        return False
    if all(isinstance(m, int) for m in messages):  # then it is a prompt of token ids
        return all(0 <= m < vocab for m in messages)
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("content"), str) or "role" not in m:
            return False
        if m["role"] not in ("system", "user", "assistant", "tool") or expected_text_error(m["content"]) == "surrogate":
            return False
        if any(b in UNREPRESENTABLE for b in m["content"].encode()):  # the rendered conversation would lose it
            return False
    return any(m["content"].strip() for m in messages)


@fuzz(80)
@given(messages=st.one_of(st.lists(VALID_MESSAGE, min_size=1, max_size=6), st.lists(MESSAGE, max_size=6)))
def test_any_message_list_is_answered_or_refused_with_a_clear_error(smol_engine, messages):
    CASES["message lists"] += 1
    memory = smol_engine.new_memory()
    try:
        if message_list_is_valid(messages, smol_engine.model.get_input_embeddings().num_embeddings):
            ids = smol_engine.prompt_ids(messages)
            result = smol_engine.chat(messages, memory=memory, max_new_tokens=2)
            assert result.input_tokens == len(ids) and memory.token_ids[:len(ids)] == ids
            CASES["message lists answered"] += 1
        else:
            with pytest.raises((TypeError, ValueError)) as error:
                smol_engine.chat(messages, memory=memory, max_new_tokens=2)
            assert str(error.value) and memory.token_ids == [] and not memory.closed
            CASES["message lists refused"] += 1
        # a later valid call still works on the same memory
        smol_engine.generate(memory.token_ids + smol_engine.tokenize(" Hello"), memory=memory, max_new_tokens=1)
    finally:
        memory.close()


def test_message_list_edge_cases(smol_engine):
    user = lambda c: {"role": "user", "content": c}  # noqa: E731
    answered = [[{"role": "system", "content": "Be brief."}], [user("a"), user("b")],
                [{"role": "assistant", "content": "Hi"}, user("x")], [user(""), user("x")],
                [user("a"), {"role": "system", "content": "s"}, user("b")]]
    for messages in answered:
        assert smol_engine.chat(messages, max_new_tokens=1).input_tokens == len(smol_engine.prompt_ids(messages))
    refused = {"empty": [], "whitespace": [user("  ")], "role": [{"role": "function", "content": "x"}],
               "'role' and 'content'": [{"role": "user"}], "must be text": [user(None)],
               "surrogate": [user("ok \ud800")]}
    for words, messages in refused.items():
        with pytest.raises((TypeError, ValueError), match=words):
            smol_engine.chat(messages, max_new_tokens=1)


# ============================================================================ limits
def test_max_input_tokens_counts_what_the_memory_already_read(engine):
    memory = engine.new_memory(engine.config.replace(max_input_tokens=100))
    engine.read(memory, token_ids(60))
    with pytest.raises(ValueError, match="bring this memory to 101 tokens, over max_input_tokens=100"):
        engine.generate(token_ids(60) + token_ids(41, seed=1), memory=memory, max_new_tokens=1)
    assert memory.token_ids == token_ids(60)
    result = engine.generate(token_ids(60) + [3] * 40, memory=memory, max_new_tokens=1)
    assert result.input_tokens == 100


def disk_files(folder) -> list[str]:
    return [f for _, _, files in os.walk(folder) for f in files]


def test_a_read_that_cannot_fit_ram_and_disk_is_refused_before_it_starts(engine, tmp_path):
    page_mb = 2 * 2 * TINY["page_tokens"] * 2 * 8 * 4 / 2**20  # layers, k/v, tokens, kv heads, head dim, fp32
    config = engine.config.replace(ram_budget_mb=2 * page_mb, disk_budget_mb=3 * page_mb, offload_dir=str(tmp_path))
    memory = engine.new_memory(config)
    ids = token_ids(400)  # >= (400 - 72) // 8 = 41 sealed pages; RAM holds 2, disk 3
    with pytest.raises(StorageFullError, match="disk_budget_mb") as error:
        engine.read(memory, ids)
    assert error.value.errno == 122  # EDQUOT: a budget, not a full disk
    assert memory.token_ids == [] and not memory.closed and disk_files(tmp_path) == []
    engine.read(memory, ids[:60])  # what fits still reads
    assert memory.token_ids == ids[:60]


def test_a_disk_budget_overrun_mid_read_leaves_the_memory_as_it_was(engine, tmp_path):
    """The need is only a lower bound before reading (events are cut as it goes): the store refuses the page that
    would cross the budget before writing it, and the memory is left exactly as before the call (issue 57, item 6:
    it was closed, with everything read before), its trial's files removed."""
    page_mb = 2 * 2 * TINY["page_tokens"] * 2 * 8 * 4 / 2**20
    ids = token_ids(300)  # lower bound (300 - 72) // 8 = 28 sealed pages, all on disk with no RAM
    config = engine.config.replace(ram_budget_mb=0, disk_budget_mb=28 * page_mb, offload_dir=str(tmp_path))
    memory = engine.new_memory(config)
    engine.read(memory, ids[:150])
    files_before = sorted(disk_files(tmp_path))
    untouched = memory.fork()
    with pytest.raises(StorageFullError, match="disk_budget_mb"):
        engine.read(memory, ids[150:])
    assert not memory.closed and memory.token_ids == ids[:150]
    check_memory(memory, ids[:150])
    assert sorted(disk_files(tmp_path)) == files_before  # what the trial wrote went with it
    question = token_ids(20, seed=3)
    assert (engine.generate(ids[:150] + question, memory=memory, max_new_tokens=8).token_ids
            == engine.generate(ids[:150] + question, memory=untouched, max_new_tokens=8).token_ids)
    fresh = engine.new_memory(config.replace(disk_budget_mb=64 * page_mb))
    engine.read(fresh, ids)  # a later valid call works
    check_memory(fresh, ids)
    assert fresh.store.tier_tokens()["disk"] > 16 * TINY["page_tokens"]


def test_the_read_budget_check_counts_the_event_index_it_will_grow(engine, tmp_path):
    """Issue 57, item 6: the index (representatives, event-text embeddings) takes RAM from the pages as a read cuts
    events. A read whose pages alone fit RAM and disk, but not beside the index it grows, is refused before it
    starts."""
    config = engine.config.replace(offload_dir=str(tmp_path))
    probe = engine.new_memory(config)
    page_bytes = probe.store.page_bytes
    ids = token_ids(400)
    evicted = len(ids) - config.max_position()
    sealed, events = evicted // config.page_tokens, evicted // config.max_block_size
    index = probe.index_bytes(adding=events)[torch.device("cpu")]
    assert index >= 2 * page_bytes  # the index of this read is worth at least two pages
    tight = config.replace(ram_budget_mb=(index + 2 * page_bytes) / 2**20,
                           disk_budget_mb=(sealed - 2) * page_bytes / 2**20)  # pages alone: 2 in RAM, the rest on disk
    memory = engine.new_memory(tight)
    with pytest.raises(StorageFullError, match="disk_budget_mb"):
        engine.read(memory, ids)
    assert memory.token_ids == [] and not memory.closed and disk_files(tmp_path) == []


def test_a_read_that_may_spill_to_disk_reads_as_one_that_cannot(engine, tmp_path):
    """Reads that can fail storing go into a trial fork and are adopted: the memory then holds what an unbudgeted
    read gives, and answers the same."""
    ids, question = token_ids(300), token_ids(20, seed=4)
    spilled = engine.new_memory(engine.config.replace(ram_budget_mb=0.001, offload_dir=str(tmp_path)))
    plain = engine.new_memory(engine.config)
    for part in (ids[:100], ids[100:]):
        engine.read(spilled, part)
        engine.read(plain, part)
    check_memory(spilled, ids)
    assert spilled.store.tier_tokens()["disk"] > 0 and disk_files(tmp_path)
    assert torch.equal(spilled.event_sizes, plain.event_sizes)
    assert (engine.generate(ids + question, memory=spilled, max_new_tokens=8).token_ids
            == engine.generate(ids + question, memory=plain, max_new_tokens=8).token_ids)
    assert len(engine.open_memories()) >= 2 and all(m.layers for m in engine.open_memories())


def test_page_store_refuses_a_page_over_the_disk_budget_before_writing(tmp_path):
    store = PageStore(2, 2, 8, torch.float32, page_tokens=4, ram_budget_mb=0, offload_dir=str(tmp_path),
                      disk_budget_mb=2 * 2 * 2 * 4 * 2 * 8 * 4 / 2**20)  # exactly two pages
    kv = torch.randn(2, 2, 8, 2, 8)
    store.append(kv)  # two pages: both on disk
    assert store.tier_tokens()["disk"] == 8 and len(disk_files(tmp_path)) == 2
    with pytest.raises(StorageFullError, match="3 KV pages"):
        store.append(kv[:, :, :4])
    assert len(disk_files(tmp_path)) == 2
    keys, values = store.gather(0, torch.arange(8), torch.device("cpu"))  # what was stored is intact
    assert torch.equal(keys, kv[0, 0].transpose(0, 1)) and torch.equal(values, kv[0, 1].transpose(0, 1))
    store.close()
