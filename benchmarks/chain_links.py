"""Can a chain be told from its look-alikes by the name its two facts share? Retrieval only, no answers generated.

Shown a two-hop chain alone the 0.5B answers 15 of 20; with the answer fact's two look-alikes beside it, 8
(chain_oracle.py). The look-alikes rank as high as the answer by the question; what sets the answer fact apart is
the name it shares with the bridge fact, which the question does not contain. This script tries the obvious ways to
use that, on the events the default reads (preset E's segmentation, EG's ranking), and counts per question whether
every evidence event is loaded (as event_ranking.py: similarity budget, then three neighbours each) and how many
loaded events name a look-alike person:

- ``EG``: the default (the question's cosine, only the events within 0.1 of the best);
- ``pair_embedded``: among the question's 16 best events, pairs that share a rare token (in at most 4 events, not
  in the question; each event seen with its two neighbours, since a sentence is often cut in two) are embedded as
  one text; when the best pair answers the question better than any one event by 0.05 cosine, only the pair (and a
  third linked event that raises it by as much) is loaded, else EG's choice;
- ``pair_linked``: the linked pair (tokens in at most 2 events) with the highest summed cosine, loaded alone when
  there is one, else EG's choice;
- ``EG_less_twins``: EG's choice less the candidates sharing with that pair a token that three or more of the
  candidates hold (a template's words, told of several people), the pair added.

    HF_HUB_OFFLINE=1 python benchmarks/chain_links.py --length 16K --seed 1 \
        --out benchmarks/results/chain_links/dev16k
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path

import torch
from event_ranking import event_of_token, evidence_sentences, evidence_tokens, selected, token_offsets
from tqdm.auto import tqdm

from emllm import EMConfig, EMEngine
from emllm_integrations.bench.harness import context_ids
from emllm_integrations.bench.items import task_items
from emllm_integrations.bench.measure import read_each
from emllm_integrations.bench.ruler import LOOKALIKE_NAMES
from emllm_integrations.bench.settings import DEFAULT_DEPTHS, DEFAULT_QUESTIONS, BenchSettings
from emllm_integrations.cli import parse_length
from emllm_integrations.markdown import table as markdown_table
from emllm_integrations.prompts import chat_frame

RESULTS = Path(__file__).resolve().parent / "results" / "chain_links"
TASKS = ("two_hop", "three_hop", "fact_qa", "niah_single", "handwritten", "chronicle")
METHODS = ("EG", "pair_embedded", "pair_linked", "EG_less_twins")
CANDIDATES = 16


class DocumentTokens:
    """Each event's tokens seen with its two neighbours (a sentence is often cut in two) and how many events hold
    each token: computed once per document, shared by every question's Links."""

    def __init__(self, event_ids: Sequence[Sequence[int]]):
        count = len(event_ids)
        self.frequency: dict[int, int] = {}
        for ids in event_ids:
            for token in set(ids):
                self.frequency[token] = self.frequency.get(token, 0) + 1
        self.windows = [[t for e in range(max(0, i - 1), min(count, i + 2)) for t in event_ids[e]]
                        for i in range(count)]


class Links:
    """For one question: each event's rare tokens (held by at most ``rare`` events) that the question lacks."""

    def __init__(self, document: DocumentTokens, question_ids: Sequence[int], rare: int):
        asked = set(question_ids)
        self.windows = document.windows
        self.rare = [{t for t in w if document.frequency[t] <= rare and t not in asked} for w in self.windows]

    def linked(self, a: int, b: int) -> bool:
        """Whether events a and b share a rare token and are not one sentence cut in two (neighbours' windows)."""
        return abs(a - b) > 2 and bool(self.rare[a] & self.rare[b])

    def text(self, events: Sequence[int]) -> list[int]:
        return [t for e in sorted(events) for t in self.windows[e]]


def pair_embedded(candidates: list[int], question: torch.Tensor, links: Links, embed, gain: float = 0.05) -> list[int]:
    """The linked pair (or triple) whose text answers the question better than any one candidate by ``gain``."""
    pairs = [[a, b] for i, a in enumerate(candidates) for b in candidates[i + 1:] if links.linked(a, b)]
    if not pairs:
        return []
    cosines = embed([links.text([c]) for c in candidates] + [links.text(p) for p in pairs]) @ question
    at = int(torch.argmax(cosines[len(candidates):]))
    chain, score = pairs[at], float(cosines[len(candidates) + at])
    if score < float(cosines[:len(candidates)].max()) + gain:
        return []
    third = [c for c in candidates if c not in chain and any(links.linked(c, x) for x in chain)]
    if third:
        scores = embed([links.text([*chain, c]) for c in third]) @ question
        if float(scores.max()) >= score + gain:
            chain = [*chain, third[int(torch.argmax(scores))]]
    return chain


def pair_linked(candidates: list[int], dense: torch.Tensor, links: Links) -> tuple[list[int], set[int]]:
    """(the linked pair of candidates with the highest summed cosine, the template tokens: held by three or more
    candidates, apart from neighbours holding the same token)."""
    holders: dict[int, list[int]] = {}
    for c in sorted(candidates):
        for t in links.rare[c]:
            spans = holders.setdefault(t, [])
            if not spans or c - spans[-1] > 2:
                spans.append(c)
    template = {t for t, spans in holders.items() if len(spans) >= 3}
    pairs = [(float(dense[a] + dense[b]), [a, b]) for i, a in enumerate(candidates) for b in candidates[i + 1:]
             if links.linked(a, b) and not (links.rare[a] & links.rare[b]) <= template]
    return (max(pairs)[1] if pairs else []), template


def only(events: list[int], count: int) -> torch.Tensor:
    scores = torch.full((count,), float("-inf"))
    scores[events] = 1.0
    return scores


def run(length: int, seed: int, out: Path, questions: int) -> None:
    engine = EMEngine.from_pretrained(preset="E", progress=False)
    eg = EMConfig.from_preset("EG")
    settings = BenchSettings(tasks=TASKS, depths=tuple(DEFAULT_DEPTHS), questions=questions, seed=seed)
    rows = []
    for task in TASKS:
        item = task_items(task, length, settings, engine.count_tokens)[0]
        memory, _ = next(read_each(engine, [context_ids(engine, item)]))
        memory.embed_events()
        starts, sizes = memory.event_boundaries().tolist(), memory.event_sizes
        ends = [s + int(n) for s, n in zip(starts, sizes.tolist())]
        event_ids = [memory.token_ids[s:t] for s, t in zip(starts, ends)]
        texts = [engine.tokenizer.decode(ids, skip_special_tokens=True) for ids in event_ids]
        twin = {e for e, t in enumerate(texts) if any(name in t for name in LOOKALIKE_NAMES)}
        owner = event_of_token(memory)
        document = DocumentTokens(event_ids)
        text, offsets = token_offsets(engine.tokenizer, memory.token_ids)
        needed_by_question = evidence_sentences(task, length, settings, engine)
        for (question, expected, _, _), needed in tqdm(zip(item.questions, needed_by_question), desc=task,
                                                      total=len(item.questions)):
            answers = needed or ((expected,) if isinstance(expected, str) else tuple(expected))
            evidence = {int(owner[t]) for tokens in evidence_tokens(text, offsets, answers) for t in tokens
                        if t < len(owner) and owner[t] >= 0}
            question_ids = chat_frame(engine, question)[1]
            q = memory.texts.embedder([question_ids])[0]
            dense = memory.texts.embeddings @ q
            count = len(dense)
            candidates = torch.topk(dense, CANDIDATES).indices.tolist()
            embedded = pair_embedded(candidates, q, Links(document, question_ids, rare=4), memory.texts.embedder)
            links = Links(document, question_ids, rare=2)
            linked, template = pair_linked(candidates, dense, links)
            filtered = eg.scorer.answering.keep_within(dense)
            chosen = {"EG": selected(filtered, sizes, eg)}
            chosen["pair_embedded"] = selected(only(embedded, count), sizes, eg) if embedded else chosen["EG"]
            chosen["pair_linked"] = selected(only(linked, count), sizes, eg) if linked else chosen["EG"]
            twins = {c for c in candidates
                     if c not in linked and any(links.rare[c] & links.rare[x] & template for x in linked)}
            kept = [e for e in torch.nonzero(torch.isfinite(filtered)).flatten().tolist() if e not in twins]
            chosen["EG_less_twins"] = selected(only(sorted({*kept, *linked}), count), sizes, eg)
            row = {"task": task, "question": question, "triggered": {
                "pair_embedded": bool(embedded), "pair_linked": bool(linked), "EG_less_twins": bool(linked)}}
            for name, events_loaded in chosen.items():
                row[name] = {"evidence": evidence <= events_loaded, "twins": len(events_loaded & twin)}
            rows.append(row)
        memory.close()
    out.mkdir(parents=True, exist_ok=True)
    (out / "chain_links.json").write_text(json.dumps(rows, indent=1))
    md = summary(rows)
    (out / "chain_links.md").write_text(md)
    print(md)


def summary(rows: list[dict]) -> str:
    """Per task and method: questions whose evidence was all loaded / look-alike events loaded (chains chosen)."""
    table = []
    for task in TASKS:
        group = [r for r in rows if r["task"] == task]
        line = [task, len(group)]
        for name in METHODS:
            fired = sum(r["triggered"].get(name, True) for r in group)
            line.append(f"{sum(r[name]['evidence'] for r in group)} / {sum(r[name]['twins'] for r in group)}"
                        + ("" if name == "EG" else f" ({fired})"))
        table.append(line)
    return ("Each cell: questions whose evidence was all loaded / look-alike events loaded over all questions "
            "(questions where the method chose a chain).\n\n"
            + markdown_table(["task", "questions", *METHODS], "lr" + "r" * len(METHODS), table) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=parse_length, default=16384)
    parser.add_argument("--seed", type=int, default=1, help="the bench's documents: 1 development (default), 0 test")
    parser.add_argument("--questions", type=int, default=DEFAULT_QUESTIONS)
    parser.add_argument("--out", type=Path, default=RESULTS / "dev16k")
    args = parser.parse_args()
    run(args.length, args.seed, args.out, args.questions)


if __name__ == "__main__":
    main()
