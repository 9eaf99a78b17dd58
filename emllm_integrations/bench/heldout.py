"""A family built another way, held out from every choice made on the suite: ``chronicle``.

The suite's fact families insert a sentence about a person named nowhere else into essays that never mention people:
the name alone finds the fact. Real documents are not like that, and a setting chosen on those families may not
hold on them. So this generator shares nothing with ruler.py but the document format:
- **Its own haystack**: a town's chronicle written from a grammar of everyday events in which the town's people
  recur, so a person's name is in many places and finds nothing by itself.
- **Look-alike facts**: every asked fact has a twin of the same kind about someone else ("Edda Lunde keeps her
  rowing boat at mooring 4417" and, elsewhere, "the rowing boat at mooring 2290 belongs to Jorun Vik"), so the
  right fact must be told from its neighbours, the mistake the default was seen to make on unseen prose.
- **Varied wording**: each kind of fact is written three ways, and asked in a fourth that shares at most the person
  (or the role) with any of them.
- **Single facts and two hops**: one question in three names a person by the office they hold ("the harbour
  master"), told in a sentence of its own, far from the fact asked.

Nothing was tuned on it: benchmarks/rag_tuning.py leaves it out, and the bench's default seed is its test split.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass

from .documents import Question, TaskDocument, check_family_args, fit_length, too_small

INSTRUCTION = ("Below is a year of a small harbour town's chronicle. Read it carefully: you will be asked about the "
               "people in it afterwards.\n\n")
TWO_HOP_EVERY = 3        # every third question goes through an office
FACT_SHARE = 0.5         # facts may take at most this share of the document


@dataclass(frozen=True)
class _Kind:
    """A kind of fact: three ways of writing it, one of asking it ({person} or an office's description)."""
    writings: tuple[str, str, str]  # with {person} and {value}
    question: str                   # with {person}
    values: Callable[[random.Random], str]


def _number(low: int, high: int) -> Callable[[random.Random], str]:
    return lambda rng: str(rng.randint(low, high))


def _pick(*options: str) -> Callable[[random.Random], str]:
    return lambda rng: rng.choice(options)


_KINDS = (
    _Kind(("{person} keeps a rowing boat at mooring {value}.",
           "The rowing boat tied up at mooring {value} belongs to {person}.",
           "{person} pays the harbour fee for mooring {value}, where a small rowing boat waits."),
          "At which mooring is the little boat of {person} tied?", _number(1000, 9999)),
    _Kind(("{person} still owes the miller {value} crowns.",
           "The miller says {person} owes him {value} crowns.",
           "By the miller's book, {person} is {value} crowns in debt."),
          "How much money does {person} have to pay back to the man who grinds the flour?", _number(110, 990)),
    _Kind(("{person} rides a mare called {value}.",
           "The mare that {person} rides to market answers to {value}.",
           "{person} bought a grey mare and named her {value}."),
          "What is the name of the horse of {person}?",
          _pick("Clover", "Juniper", "Saffron", "Bramble", "Thistle", "Marigold", "Nutmeg", "Sorrel", "Hazel",
                "Willowby", "Tansy", "Cobweb", "Rowanberry", "Damson", "Mistle", "Quince")),
    _Kind(("The secret of {person}'s plum cake is a pinch of {value}.",
           "{person} puts a pinch of {value} into every plum cake.",
           "Nobody guessed that {person} bakes plum cake with {value}."),
          "Which hidden ingredient goes into the fruit cake that {person} makes?",
          _pick("cardamom", "black pepper", "star anise", "lavender", "smoked salt", "rosewater", "fennel seed",
                "grated ginger", "orange peel", "juniper berries", "allspice", "bay leaf")),
    _Kind(("Before settling here, {person} worked as a {value}.",
           "{person} used to earn a living as a {value}.",
           "In younger years {person} was a {value} by trade."),
          "What was the former occupation of {person}?",
          _pick("ship's carpenter", "salt merchant", "glassblower", "river pilot", "tin miner", "sailmaker",
                "lock keeper", "clockmaker", "cooper", "wheelwright", "bookbinder", "stonemason", "chandler",
                "lighthouse cook", "dyer", "saddler")),
    _Kind(("{person} tends allotment {value} on the hill.",
           "Allotment {value} on the hill is worked by {person}.",
           "On the hill, {person} grows beans on allotment {value}."),
          "Which numbered garden plot above the town does {person} look after?", _number(100, 999)),
    _Kind(("{person}'s sister lives in {value}.",
           "The sister of {person} moved away to {value}.",
           "{person} writes every month to a sister in {value}."),
          "In which city does the sibling of {person} reside?",
          _pick("Lisbon", "Gdansk", "Bergen", "Trieste", "Riga", "Antwerp", "Galway", "Tallinn", "Porto", "Hamburg",
                "Marseille", "Cork", "Naples", "Rotterdam", "Aarhus", "Bilbao")),
)

_OFFICES = (  # how the chronicle tells who holds it (with {person}), and how a question names the holder
    ("The council named {person} harbour master in the spring.", "the official in charge of the harbour"),
    ("{person} took over the apothecary's shop on Mill Lane.", "the town's chemist"),
    ("{person} now keeps the keys of the seed store.", "the keeper of the seed store"),
    ("The school's new teacher is {person}.", "the person who teaches the town's children"),
    ("{person} was chosen to ring the chapel bell.", "the bellringer of the chapel"),
    ("{person} runs the ferry across the estuary.", "the ferryman of the estuary"),
    ("{person} became the town's midwife after the winter.", "the woman who helps the town's mothers give birth"),
    ("{person} was elected warden of the fish market.", "the overseer of the fish market"),
)

_FIRST = ("Edda", "Jorun", "Solveig", "Halvard", "Ingrid", "Torben", "Maren", "Aksel", "Sigrun", "Eskil", "Liv",
          "Brage", "Ragna", "Ottar", "Hedda", "Finnur", "Gudrun", "Leif", "Signe", "Vidar", "Tove", "Arvid", "Ylva",
          "Kjell", "Astrid", "Bjarne", "Runa", "Steinar", "Greta", "Haakon", "Idun", "Magne", "Oda", "Peder",
          "Randi", "Sindre", "Thyra", "Ulv", "Vigdis", "Yngve", "Borghild", "Dagfinn", "Frode", "Gunhild", "Hallgeir",
          "Ivar", "Jofrid", "Ketil", "Lodin", "Nanna")
_LAST = ("Lunde", "Vik", "Strand", "Haugen", "Berg", "Dahl", "Moen", "Aas", "Brekke", "Foss", "Holm", "Lie",
         "Nygaard", "Rud", "Sand", "Tangen", "Bakke", "Eide", "Hagen", "Kvam", "Myhre", "Ness", "Ruud", "Solberg")

_STREETS = ("Mill Lane", "Rope Walk", "Chapel Row", "the quay", "Tanner's Yard", "the market square", "Gull Street",
            "the north road", "Well Close", "Bakehouse Steps")
_GOODS = ("herring", "rye bread", "tallow", "wool", "cabbages", "lamp oil", "salt cod", "apples", "tar", "barley",
          "eggs", "peat", "honey", "nails", "rope")
_WEATHER = ("A gale blew from the north", "Fog sat on the harbour", "Rain fell without stopping",
            "A hard frost whitened the roofs", "The sun shone warm", "Sleet came in from the sea")
_MONTHS = ("January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
           "November", "December")
_EVENTS = (
    "{a} and {b} argued about the price of {good} at the market.",
    "{weather} for {n} days, and the boats stayed in.",
    "{a} mended the fence along {street}.",
    "The bakery on {street} ran out of {good} before noon.",
    "{a} was seen carrying a basket of {good} down {street}.",
    "{a} lent {b} a ladder to clear the gutters.",
    "A travelling tinker stayed {n} nights at the inn and sharpened every knife in town.",
    "The council met in the long hall and talked about the state of {street}.",
    "{a} sold {n} sacks of {good} to a trader from up the coast.",
    "{weather}, so {a} stayed home and mended nets.",
    "{a} and {b} walked to the chapel together on Sunday.",
    "Children skated on the pond behind {street} until it cracked.",
    "{a} complained to {b} that the {good} had gone up again.",
    "Somebody left a cart of {good} blocking {street} all morning.",
    "{a} played the fiddle at the inn until late.",
    "A ship came in with {good} and left with {good2}.",
    "{a} fell on the ice on {street} and limped for a week.",
    "{b} helped {a} paint the shutters.",
    "The lamplighter forgot {street}, and {a} walked home in the dark.",
    "{a} traded {good} for {good2} with {b}.",
)


_CHRONICLE_WORDS = _EVENTS + _GOODS + _STREETS + _WEATHER + _MONTHS + (INSTRUCTION,)


def _event(rng: random.Random, people: list[str]) -> str:
    a, b = rng.sample(people, 2)
    good, good2 = rng.sample(_GOODS, 2)
    return rng.choice(_EVENTS).format(a=a, b=b, good=good, good2=good2, street=rng.choice(_STREETS),
                                      weather=rng.choice(_WEATHER), n=rng.randint(2, 9))


def _chronicle(rng: random.Random, people: list[str], sentences: int, facts: list[tuple[float, str]]) -> str:
    """``sentences`` events in month paragraphs with each fact at its depth (a fraction of the events)."""
    at: dict[int, list[str]] = {}
    for depth, fact in facts:
        at.setdefault(min(sentences - 1, int(depth * sentences)), []).append(fact)
    per_month = max(1, math.ceil(sentences / len(_MONTHS)))
    paragraphs: list[str] = []
    current: list[str] = []
    for i in range(sentences):
        current.append(_event(rng, people))
        current.extend(at.get(i, []))
        if len(current) >= per_month or i == sentences - 1:
            month = _MONTHS[min(len(paragraphs), len(_MONTHS) - 1)]
            paragraphs.append(f"{month}. " + " ".join(current) if len(paragraphs) < len(_MONTHS)
                              else " ".join(current))
            current = []
    return "\n\n".join(paragraphs)


def chronicle(num_tokens: int, count_tokens: Callable[[str], int], *, questions: int = 20,
              seed: int = 0) -> TaskDocument:
    """A town chronicle with a fact per question and a look-alike twin of it, asked in other words; every third
    question names its person by an office told elsewhere (two hops). See the module docstring."""
    cap = min(len(_FIRST) // 2, len(_OFFICES) * TWO_HOP_EVERY)
    num_tokens, count_tokens, questions, rng = check_family_args("chronicle", num_tokens, count_tokens, questions,
                                                                 seed, cap=cap)
    offices = math.ceil(questions / TWO_HOP_EVERY)
    firsts = rng.sample(_FIRST, 2 * questions)  # an asked person and a twin's person per question
    people = [f"{first} {rng.choice(_LAST)}" for first in firsts]
    asked_people, twin_people = people[:questions], people[questions:]
    chosen_offices = rng.sample(_OFFICES, offices)
    taken: set[str] = set()
    facts: list[tuple[float, str]] = []
    asked = []
    for q in range(questions):
        kind = _KINDS[q % len(_KINDS)]
        value, twin_value = (_fresh(rng, kind, taken) for _ in range(2))
        writing, twin_writing = rng.sample(kind.writings, 2)
        person = asked_people[q]
        fact = writing.format(person=person, value=value)
        depth = (q + rng.random()) / questions
        evidence = [fact]
        facts.append((depth, fact))
        facts.append((rng.random(), twin_writing.format(person=twin_people[q], value=twin_value)))
        named = person
        if q % TWO_HOP_EVERY == TWO_HOP_EVERY - 1:
            told, named = chosen_offices[q // TWO_HOP_EVERY]
            office = told.format(person=person)
            facts.append(((depth + 0.3 + 0.4 * rng.random()) % 1.0, office))  # 30-70% of the document away
            evidence.append(office)
        question = kind.question.format(person=named)
        asked.append((question[0].upper() + question[1:], value, tuple(evidence)))
    fixed = count_tokens(INSTRUCTION + " ".join(f for _, f in facts))
    if fixed > num_tokens * FACT_SHARE:
        raise too_small("chronicle", num_tokens, questions, math.ceil(fixed / FACT_SHARE),
                        f"its facts alone take {fixed} tokens, and at least {1 - FACT_SHARE:.0%} of the document "
                        "must be chronicle")
    sample = " ".join(_event(random.Random(0), people) for _ in range(200))
    per_sentence = count_tokens(sample) / 200
    state = rng.getstate()

    def build(sentences: int) -> str:
        rng.setstate(state)  # the same events for every size tried
        return INSTRUCTION + _chronicle(rng, people, sentences, facts)

    context = fit_length(num_tokens, count_tokens, build, fixed, per_sentence)
    low = context.lower()
    out = []
    for question, value, needed in asked:
        if low.count(value.lower()) != 1:  # drawn fresh, so only a value inside an event's words could repeat
            raise RuntimeError(f"chronicle: the answer {value!r} occurs {low.count(value.lower())} times")
        depths = [context.index(e) / len(context) for e in needed]
        out.append(Question(question, (value,), sum(depths) / len(depths), needed))
    return TaskDocument("chronicle", context, tuple(out))


def _fresh(rng: random.Random, kind: _Kind, taken: set[str]) -> str:
    """A value of ``kind`` not drawn before in this document, none inside another (a number inside a longer one)."""
    for _ in range(1000):
        value = kind.values(rng)
        low = value.lower()
        if not any(low in t or t in low for t in taken) and not any(low in e.lower() for e in _CHRONICLE_WORDS):
            taken.add(low)
            return value
    raise ValueError("chronicle ran out of distinct answers: ask fewer questions.")
