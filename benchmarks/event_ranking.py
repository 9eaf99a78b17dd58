"""Which ranking of event text brings a question's evidence into attention? Dense, lexical (BM25) and fused.

    HF_HUB_OFFLINE=1 python benchmarks/event_ranking.py --tasks fact_qa niah_single --length 64K \
        --out benchmarks/results/event_ranking/64k

Each task's bench document (`emllm bench`'s, same seed) is read once with preset E; then, for every question, each
ranking orders the stored events, the similarity budget takes the best and the contiguity buffer adds their
neighbours exactly as a layer's first answering retrieval does (retrieval.fill_budget, ContiguityBuffer). A
question's evidence is every event holding part of an expected string (each answer occurs once in its document);
evidence still in the local window is seen anyway and counts as found. The table gives, per task and ranking, the
questions whose evidence was all retrieved and, in brackets, the mean share retrieved: retrieval's part of a miss,
apart from the model's reading. No answers are generated, so a cell of 20 questions takes seconds after the read.

Rankings: "dense" (preset E's EventText: the question's MiniLM embedding against each event's), "EG" (the
default: dense, only the events within its margin of the best, three neighbours each), "EGT" (EG whose filter stands
aside when three events tie near the best), "EG_hop" (EG's filter on the hop ranking), "contextual" (each
event embedded together with its two neighbours' text: 3x the embedding work), "neighbourhood" (the normalised sum
of an event's and its neighbours' embeddings: no extra work), "smoothed" (an event's cosine plus its neighbours'),
"bm25" (bm25s over the events' words, English stop words removed; bm25s is in the dev extra), "fused" (dense and
bm25 standardised and summed, as scoring.Fused does), "fused_contextual" and "neighbourhood_fused" likewise, and
"hop" (the question embedded again with each of its 3 best events' text; an event keeps its best score: a second
look that can follow a bridge). For variable tracking, "stepwise_*" asks whether each link is loaded when the answer
needs it (link k once the answer has listed the chain's first k names, teacher-forced), by the question alone ("dense")
or by retrieval that follows the answer (following_scores, scoring.AnswerText's ways). Families that record a
question's evidence sentences (the multi-hop chains, fact QA, chronicle, handwritten) count those events, every
fact of a chain; the others count the events holding the answers. The JSON's rows add, per question, each ranking's
events loaded ("{name}_loaded"), the dense ranking's 12 best cosines ("dense_top": how flat the top is) and the dense
rank of each expected string's last evidence event ("evidence_dense_rank"; -1: in the local window)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from tqdm.auto import tqdm

from emllm import EMConfig, EMEngine
from emllm.retrieval import ContiguityBuffer, fill_budget, token_index_of_events
from emllm.scoring import standardise
from emllm_integrations.bench.harness import context_ids
from emllm_integrations.bench.items import task_items
from emllm_integrations.bench.measure import read_each
from emllm_integrations.bench.settings import DEFAULT_DEPTHS, DEFAULT_QUESTIONS, BenchSettings
from emllm_integrations.cli import parse_length
from emllm_integrations.markdown import table as markdown_table
from emllm_integrations.prompts import chat_frame

RESULTS = Path(__file__).resolve().parent / "results"


def token_offsets(tokenizer, ids: list[int]) -> tuple[str, list[int]]:
    """The text of ids decoded token by token and each token's start offset in it."""
    pieces = [tokenizer.decode([t]) for t in ids]
    starts, at = [], 0
    for piece in pieces:
        starts.append(at)
        at += len(piece)
    return "".join(pieces), starts


def evidence_tokens(text: str, starts: list[int], answers: tuple[str, ...]) -> list[list[int]]:
    """Per expected string, the token positions its occurrences cover (empty: not found)."""
    import bisect

    out = []
    for answer in answers:
        tokens: set[int] = set()
        low, needle = text.lower(), answer.lower()
        at = low.find(needle)
        while at >= 0:
            first = bisect.bisect_right(starts, at) - 1
            last = bisect.bisect_right(starts, at + len(needle) - 1) - 1
            tokens.update(range(first, last + 1))
            at = low.find(needle, at + 1)
        out.append(sorted(tokens))
    return out


def event_of_token(memory) -> torch.Tensor:
    """[tokens] the stored event holding each token of the memory; -1 for the sinks and the local window."""
    events, sizes = torch.arange(memory.num_events), memory.event_sizes
    owner = torch.full((memory.total_tokens,), -1, dtype=torch.long)
    owner[token_index_of_events(events, memory.event_boundaries(), sizes)] = torch.repeat_interleave(events, sizes)
    return owner


def bm25_index(texts: list[str]):
    """A BM25 index of the events' texts, built once per document and asked by every question."""
    import bm25s

    retriever = bm25s.BM25()
    retriever.index(bm25s.tokenize(texts, stopwords="en", show_progress=False), show_progress=False)
    return retriever


def bm25_scores(retriever, query: str) -> torch.Tensor:
    import bm25s

    query_tokens = bm25s.tokenize([query], stopwords="en", show_progress=False, return_ids=False)[0]
    return torch.from_numpy(retriever.get_scores(query_tokens)).float()


def with_neighbours(per_event: torch.Tensor) -> torch.Tensor:
    """[e, ...] each event's row plus its two neighbours' rows (scores or embeddings)."""
    out = per_event.clone()
    out[1:] += per_event[:-1]
    out[:-1] += per_event[1:]
    return out


def selected(scores: torch.Tensor, sizes: torch.Tensor, config) -> set[int]:
    """The events a layer's first answering retrieval loads for these scores."""
    ranked = torch.argsort(scores, descending=True)
    ranked = ranked[torch.isfinite(scores[ranked])]  # a filter's -inf events are never loaded
    similar = fill_budget(ranked, sizes, config.similarity_tokens).tolist()
    buffer = ContiguityBuffer(config.contiguity_tokens, config.contiguity_neighbours)
    return set(similar) | set(buffer.update(similar, sizes, len(sizes)))


HOP_EVENTS = 3


def hop_scores(memory, dense: torch.Tensor, question_ids: list[int], starts: list[int], ends: list[int],
               hops: int) -> torch.Tensor:
    """A second look: the question embedded together with each of the ``hops`` best events' text, each such query
    scoring every event; an event keeps the best of its scores. The best event of a two-hop question names the
    bridge (the person at the place), and the question with that event's text then finds the person's own fact."""
    top = torch.topk(dense, min(hops, len(dense))).indices.tolist()
    queries = memory.texts.embedder([memory.token_ids[starts[e]:ends[e]] + question_ids for e in top])
    return torch.maximum(dense, (memory.texts.embeddings @ queries.T).max(dim=1).values)


FOLLOWING = ("follow", "follow_max", "follow_answer")


def following_scores(memory, engine, dense: torch.Tensor, question_ids: list[int], written: list[str]) -> dict:
    """Retrieval that follows the answer, teacher-forced: the rankings a decoding step would use once the answer so
    far is ``written`` (the chain's first names, as the model would list them). "follow": the question and the answer
    so far embedded together; "follow_max": an event keeps the better of that and the question's cosine;
    "follow_answer": the question's and the answer's own cosines standardised and summed (scoring.Fused's way)."""
    if not written:
        return dict.fromkeys(FOLLOWING, dense)
    answer_ids = engine.tokenize(", ".join(written))
    together, alone = memory.texts.embedder([question_ids + answer_ids, answer_ids])
    follow = memory.texts.embeddings @ together
    return {"follow": follow, "follow_max": torch.maximum(dense, follow),
            "follow_answer": standardise(dense) + standardise(memory.texts.embeddings @ alone)}


def evidence_sentences(task: str, length: int, settings: BenchSettings, engine) -> list[tuple[str, ...]]:
    """Per question, the sentences it needs (a multi-hop chain's every fact), for families that record them; empty
    tuples (count the answers' events) for the others."""
    from emllm_integrations.bench.items import document_seed
    from emllm_integrations.bench.ruler import FAMILIES, family_document

    if task not in FAMILIES:
        return [()] * len(settings.depths)
    doc = family_document(task, length, engine.count_tokens, questions=settings.questions,
                          seed=document_seed(settings.seed, task, length, -1.0))
    return [q.evidence for q in doc.questions]


def run(tasks: list[str], length: int, out: Path, questions: int = DEFAULT_QUESTIONS, seed: int = 0) -> list[dict]:
    engine = EMEngine.from_pretrained(preset="E", progress=False)
    config = engine.config
    eg = EMConfig.from_preset("EG")  # the default: E's events, its ranking filtered, three neighbours each
    egt = EMConfig.from_preset("EGT")  # EG whose filter stands aside when three events tie near the best
    settings = BenchSettings(tasks=tuple(tasks), depths=tuple(DEFAULT_DEPTHS), questions=questions, seed=seed)
    rows = []
    for task in tasks:
        item = task_items(task, length, settings, engine.count_tokens)[0]
        context = context_ids(engine, item)
        memory, _ = next(read_each(engine, [context]))
        memory.embed_events()
        starts = memory.event_boundaries().tolist()
        sizes = memory.event_sizes
        ends = [s + int(n) for s, n in zip(starts, sizes.tolist())]
        owner = event_of_token(memory)
        texts = [engine.tokenizer.decode(memory.token_ids[s:t], skip_special_tokens=True) for s, t in zip(starts, ends)]
        wide = [" ".join(texts[max(0, e - 1):e + 2]) for e in range(len(texts))]
        wide_embeddings = memory.texts.embedder([engine.tokenize(t) for t in wide])
        neighbourhood = torch.nn.functional.normalize(with_neighbours(memory.texts.embeddings), dim=-1)
        text, offsets = token_offsets(engine.tokenizer, memory.token_ids)
        lexicon = bm25_index(texts)
        evidence = evidence_sentences(task, length, settings, engine)
        for (question, expected, depth, _), needed in tqdm(zip(item.questions, evidence), desc=task,
                                                          total=len(item.questions)):
            answers = needed or ((expected,) if isinstance(expected, str) else tuple(expected))
            per_answer = [sorted({int(owner[t]) for t in tokens if t < len(owner)})
                          for tokens in evidence_tokens(text, offsets, answers)]
            missing = [a for a, tokens in zip(answers, per_answer) if not tokens]
            in_memory = [[e for e in events if e >= 0] for events in per_answer]
            question_ids = chat_frame(engine, question)[1]
            q_embedding = memory.texts.embedder([question_ids])[0]
            dense = memory.texts.embeddings @ q_embedding
            lexical = bm25_scores(lexicon, question)
            rankings = {"dense": dense, "hop": hop_scores(memory, dense, question_ids, starts, ends, HOP_EVENTS),
                        "bm25": lexical, "fused": standardise(dense) + standardise(lexical),
                        "fused_contextual": standardise(wide_embeddings @ q_embedding) + standardise(lexical),
                        "contextual": wide_embeddings @ q_embedding,
                        "neighbourhood": neighbourhood @ q_embedding,
                        "smoothed": with_neighbours(dense),
                        "neighbourhood_fused": standardise(neighbourhood @ q_embedding) + standardise(lexical)}
            row = {"task": task, "depth": depth, "question": question, "answers": answers, "missing": missing,
                   "in_window": sum(1 for events in in_memory if not events)}
            rankings["EG"] = eg.scorer.answering.keep_within(dense)
            rankings["EGT"] = egt.scorer.answering.keep_within(dense)
            rankings["EG_hop"] = eg.scorer.answering.keep_within(rankings["hop"])
            for name, scores in rankings.items():
                chosen = selected(scores, sizes, eg if name.startswith("EG") else config)
                found = [all(e in chosen for e in events) for events in in_memory]
                row[name] = sum(found) / len(found)
                row[f"{name}_loaded"] = len(chosen)  # events in attention: the asked ones and their look-alikes
            order = torch.argsort(dense, descending=True).tolist()
            rank = {e: i for i, e in enumerate(order)}
            row["dense_top"] = [round(float(v), 3) for v in dense[order[:12]]]
            row["evidence_dense_rank"] = [max(rank[e] for e in events) if events else -1 for events in in_memory]
            if task == "variable_tracking":  # the link assigning name k is needed once the answer lists k names
                steps = [{"dense": dense} | following_scores(memory, engine, dense, question_ids, list(expected[:k]))
                         for k in range(len(in_memory))]
                for name in ("dense", *FOLLOWING):
                    found = [all(e in selected(step[name], sizes, config) for e in events)
                             for step, events in zip(steps, in_memory)]
                    row[f"stepwise_{name}"] = sum(found) / len(found)
            rows.append(row)
        memory.close()
    names = ["dense", "EG", "EGT", "EG_hop", "hop", "contextual", "neighbourhood", "smoothed", "bm25", "fused",
             "fused_contextual", "neighbourhood_fused"]
    table = []
    for task in tasks:
        group = [r for r in rows if r["task"] == task]
        table.append([task, len(group)] + [f"{sum(r[n] == 1 for r in group)} "
                                            f"({sum(r[n] for r in group) / len(group):.2f})" for n in names])
    stepwise = [f"stepwise_{n}" for n in ("dense", *FOLLOWING)]
    chains = [r for r in rows if stepwise[0] in r]
    if chains:
        names += stepwise
        for line in table:
            group = [r for r in chains if r["task"] == line[0]]
            line += [f"{sum(r[n] == 1 for r in group)} ({sum(r[n] for r in group) / len(group):.2f})" if group
                     else "–" for n in stepwise]
    md = markdown_table(["task", "questions", *names], "lr" + "r" * len(names), table)
    out.mkdir(parents=True, exist_ok=True)
    (out / "event_ranking.json").write_text(json.dumps(rows, indent=1))
    (out / "event_ranking.md").write_text(md + "\n")
    print(md)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", nargs="+", default=["fact_qa", "niah_single", "niah_multikey", "niah_multivalue",
                                                       "niah_multiquery", "variable_tracking"])
    parser.add_argument("--length", default="16K")
    parser.add_argument("--questions", type=int, default=DEFAULT_QUESTIONS,
                        help="questions per document, as emllm bench's --questions (the same documents)")
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--seed", type=int, default=0, help="the bench's documents: 0 the test split, 1 development")
    parser.add_argument("--out", type=Path, default=RESULTS / "event_ranking")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    run(args.tasks, parse_length(args.length), args.out, args.questions, args.seed)


if __name__ == "__main__":
    main()
