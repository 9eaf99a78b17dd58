"""Facts written by hand, held out from every choice made on the suite: ``handwritten``.

Every other family fills templates, so a setting can fit the templates' wording without anyone meaning it to. Here
nothing is generated: each fact, its question and its look-alike were written one at a time, in the kinds of
sentence a real document holds (a passive, a subordinate clause, a quotation, a parenthesis), about things as
often as people. The questions use other words than their facts, and some name their subject only by a
description ("the observatory that shut down on Garrow Hill", "the clinic next to the canal lock"). Each fact has a
look-alike, also written by hand: the same kind of fact about something else, with another value, placed at a
random depth (the mistake the default was seen to make on unseen prose is to answer from such a neighbour).

The haystack is the essays, as the suite's other fact families use, from a sentence the seed chooses. The seed
also chooses which facts are asked, in what order, and where they lie. There are 24 (`--questions 24` asks all).
Nothing was tuned on this family: it was written after the default preset and the tuned RAG were chosen.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from .documents import Question, TaskDocument, check_family_args, fit_length, too_small
from .tasks import essay_prose, essay_text

INSTRUCTION = ("Below is a long text. Read it carefully: you will be asked questions about it afterwards.\n\n")
FACT_SHARE = 0.5         # facts may take at most this share of the document


@dataclass(frozen=True)
class _Written:
    fact: str                  # the sentence inserted
    question: str              # asked in other words
    answers: tuple[str, ...]   # every string a right answer holds
    look_alike: str            # the same kind of fact about something else, never asked


FACTS = (
    _Written("The Saint Aldric choir rehearses every Thursday evening in the long room above Penhallow's pharmacy.",
             "Above whose shop does the choir of Saint Aldric practise each week?", ("Penhallow",),
             "The Tuesday chess circle meets in the back room of Quenby's bakery."),
    _Written("When the old observatory on Garrow Hill closed in 1987, its brass telescope was given to a primary "
             "school in Lowestoft.",
             "Which town's school received the telescope from the observatory that shut down on Garrow Hill?",
             ("Lowestoft",),
             "The museum's bronze sundial was later lent to a library in Harrogate."),
    _Written("Nobody in the family could remember who had named the grey cat Admiral Fitzroy, but the name stuck.",
             "What is the family's grey cat called?", ("Fitzroy",),
             "The neighbours' ginger dog answered only to the name Colonel Pettigrew."),
    _Written("My aunt Rosalind kept her savings, about four thousand pounds, in a biscuit tin hidden under the "
             "stairs.",
             "In what container did Aunt Rosalind keep her money?", ("biscuit tin",),
             "Uncle Bertram kept his war medals in a cigar box on top of the wardrobe."),
    _Written("The ferry to Inchcolm leaves from the Hawes pier at twenty past nine, and not a minute later.",
             "From which pier does the boat for Inchcolm depart?", ("Hawes",),
             "The pleasure cruiser to the seal colony sails from Carlingnose jetty after lunch."),
    _Written("The bridge over the Tarrow was designed by an engineer named Ifeoma Adeyemi, who had never built "
             "anything longer than a footpath before.",
             "Who was the designer of the bridge across the Tarrow?", ("Adeyemi",),
             "The viaduct at Hollins Cross was the work of a surveyor called Piers Loveday."),
    _Written("According to the minutes, the allotment society voted to spend its surplus on a new greenhouse heater "
             "rather than a second rotavator.",
             "What did the allotment society decide to buy with its leftover money?", ("greenhouse heater",),
             "The rowing club spent its own surplus on a second-hand outboard motor."),
    _Written("Marguerite's favourite dessert, she told everyone who would listen, was a quince tart with clotted "
             "cream.",
             "Which pudding did Marguerite say she loved most?", ("quince",),
             "Her brother Anselm preferred a damson crumble to anything else."),
    _Written("The lighthouse at Skerrimore has been painted in red and white bands since 1921, when the ochre paint "
             "ran out.",
             "Which colour of paint had run out when the Skerrimore lighthouse got its stripes?", ("ochre",),
             "The signal tower at Dunmore Point is painted a pale green that the keepers call celadon."),
    _Written("The mill's water wheel, thirty-one feet across, was carved from the timber of a single oak felled at "
             "Brackenfield.",
             "Where was the tree cut down whose wood made the mill's water wheel?", ("Brackenfield",),
             "The church's roof beams came from elms cut in Sallowby Wood."),
    _Written("Dr. Oyelaran's clinic, the one beside the canal lock, opens only on Wednesday mornings.",
             "On which day of the week can patients visit the clinic next to the canal lock?", ("Wednesday",),
             "The dentist on Cobb Street sees patients on Mondays and Fridays."),
    _Written("The password to the village hall's wifi, written on a card by the kettle, is heronsgate47.",
             "What is the wireless network code for the village hall?", ("heronsgate47",),
             "The cricket pavilion's wifi password is longstop19."),
    _Written("Tobias learned to sail on Llangorse Lake, in a dinghy borrowed from his grandfather's neighbour.",
             "On which lake did Tobias first learn sailing?", ("Llangorse",),
             "His cousin Wilhelmina learned to row on Ullswater."),
    _Written("The Hartigan family's mulled wine recipe, handed down for four generations, calls for a strip of "
             "bergamot peel.",
             "What kind of peel do the Hartigans put in their spiced Christmas wine?", ("bergamot",),
             "The Okafors' Christmas punch is sharpened with a spoonful of tamarind."),
    _Written("It was in a second-hand bookshop in Ludlow that Clemency first found the atlas her father had lost in "
             "the war.",
             "In which town did Clemency come across her father's lost atlas?", ("Ludlow",),
             "Her sister found their grandmother's sewing box at an auction in Bridport."),
    _Written("The last tram in Carrick Vale ran on a wet March night in 1956, driven by a conductor's widow, "
             "Euphemia Strachan.",
             "Who drove the final tram in Carrick Vale?", ("Strachan",),
             "The first bus on the new route was driven by a retired signalman, Hamish Doig."),
    _Written("The committee agreed to name the new footbridge after Nell Gwilliam, who had swum the river every New "
             "Year's Day for sixty years.",
             "After whom is the new footbridge named?", ("Gwilliam",),
             "The new playground was named after a former headmistress, Agnes Threlfall."),
    _Written("Before he became a potter, Casimir spent eleven years as a lock-keeper on the Kennet and Avon canal.",
             "On which canal did Casimir work before he took up pottery?", ("Kennet",),
             "Before opening her café, Ludmila drove a delivery van for a laundry in Swindon."),
    _Written("The orchard's oldest tree, a Bramley planted by the first tenant, still gives about forty pounds of "
             "apples a year.",
             "What variety is the oldest tree in the orchard?", ("Bramley",),
             "The walled garden's oldest pear is a Conference that the head gardener grafted himself."),
    _Written("Ines keeps the spare key to the boathouse on a nail behind the loose brick by the gate.",
             "Where is the boathouse's spare key hidden?", ("loose brick",),
             "The key to the tool shed hangs under the third flowerpot by the back door."),
    _Written("The expedition's cook, a cheerful Norwegian called Sigrun Aas, was the only one of the nine to reach "
             "the summit.",
             "Which member of the expedition made it to the top of the mountain?", ("Sigrun",),
             "The expedition's doctor, Rupert Vane, turned back at the second camp with frostbite."),
    _Written("Our neighbour's parrot, a grey called Mister Bumble, can whistle the opening bars of the "
             "Marseillaise.",
             "Which tune can the neighbour's parrot whistle?", ("Marseillaise",),
             "The pub's mynah bird can only manage the first line of Greensleeves."),
    _Written("The school's annual prize for handwriting, a silver pen, is called the Threadgold Cup even though it "
             "is not a cup.",
             "What is the name of the handwriting award at the school?", ("Threadgold",),
             "The prize for the best vegetable marrow at the show is called the Pennington Shield."),
    _Written("Halfway through the storm the power failed, and the hotel's guests played charades by candlelight "
             "until two in the morning.",
             "What game did the hotel guests play during the blackout?", ("charades",),
             "At the lodge the stranded walkers passed the evening with a game of whist."),
)


def _with_facts(prose: list[str], placed: list[tuple[float, str]]) -> str:
    """The prose's sentences with each fact put after the sentence nearest its depth (a fraction of the sentences)."""
    at: dict[int, list[str]] = {}
    for depth, fact in sorted(placed):
        at.setdefault(round(depth * len(prose)), []).append(fact)
    out = list(at.get(0, []))
    for index, sentence in enumerate(prose, start=1):
        out.append(sentence)
        out.extend(at.get(index, []))
    return " ".join(out)


def handwritten(num_tokens: int, count_tokens: Callable[[str], int], *, questions: int = 20,
                seed: int = 0) -> TaskDocument:
    """Hand-written facts, asked in other words, each with a hand-written look-alike, in the essays. See the module
    docstring."""
    num_tokens, count_tokens, questions, rng = check_family_args("handwritten", num_tokens, count_tokens, questions,
                                                                 seed, cap=len(FACTS))
    chosen = rng.sample(FACTS, questions)
    depths = [(q + rng.random()) / questions for q in range(questions)]
    placed = [(d, w.fact) for d, w in zip(depths, chosen)] + [(rng.random(), w.look_alike) for w in chosen]
    fixed = count_tokens(INSTRUCTION + " ".join(text for _, text in placed))
    if fixed > num_tokens * FACT_SHARE:
        raise too_small("handwritten", num_tokens, questions, math.ceil(fixed / FACT_SHARE),
                        f"its facts alone take {fixed} tokens, and at least {1 - FACT_SHARE:.0%} of the document "
                        "must be prose")
    start = rng.randrange(1 << 30)  # essay_prose wraps it round the essays
    sample = essay_text()[:20_000]
    per_char = count_tokens(sample) / len(sample)

    def build(chars: int) -> str:
        return INSTRUCTION + _with_facts(essay_prose(start, chars)[0], placed)

    context = fit_length(num_tokens, count_tokens, build, fixed, per_char)
    low = context.lower()
    out = []
    for written in chosen:
        for answer in written.answers:
            if low.count(answer.lower()) != 1:  # the essays could hold a word an answer is
                raise RuntimeError(f"handwritten: the answer {answer!r} occurs {low.count(answer.lower())} times")
        out.append(Question(written.question, written.answers, context.index(written.fact) / len(context),
                            (written.fact,)))
    return TaskDocument("handwritten", context, tuple(out))
