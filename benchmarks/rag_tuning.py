"""Choose the tuned RAG's chunk size and ranking on a development split: the bench's generators with another seed.

    HF_HUB_OFFLINE=1 python benchmarks/rag_tuning.py --length 16K --seed 1 \
        --out benchmarks/results/rag_tuning

The test split of every table is `emllm bench`'s seed 0; this script reads only documents of ``--seed`` (1 by
default), so the choice it makes is never made on a document it is then scored on. For every family named, every
chunk size and both rankings (dense MiniLM; hybrid: MiniLM and BM25, rank-fused), it retrieves for each question
the chunks that fit the prompt budget (``--context-tokens``, the default preset's n_local + n_mem) and counts the
questions whose evidence (every sentence the question needs: a fact, or a chain's facts) lies wholly inside the
retrieved chunks. A 16K document of each family takes seconds per recipe.

Recall is not the whole story: many short fragments may hold the evidence and still read badly. ``--answers`` also
has the LLM answer every question from each recipe's chunks (the bench's chat turn, greedy) and counts the right
answers; it takes about 5 s a question on 2 cores, so name a few recipes (``--chunk-words``, ``--retrievals``).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from emllm import EMConfig, EMEngine
from emllm_integrations.bench.documents import Question, score
from emllm_integrations.bench.harness import max_new_tokens_for
from emllm_integrations.bench.items import document_seed
from emllm_integrations.bench.settings import BenchSettings
from emllm_integrations.bench.ruler import family_document
from emllm_integrations.cli import parse_length
from emllm_integrations.markdown import table as markdown_table
from emllm_integrations.rag import RETRIEVALS, Chunk, RAGBaseline

FAMILIES = ("fact_qa", "niah_single", "niah_multikey", "two_hop", "three_hop")
CHUNK_SIZES = (32, 64, 128, 200, 300)


def covered(chunks: list[Chunk], context: str, evidence: tuple[str, ...]) -> bool:
    """Whether every evidence sentence lies wholly inside the retrieved chunks' character spans (a sentence cut by a
    chunk boundary counts when both chunks are retrieved)."""
    spans = sorted((c.start_char, c.end_char) for c in chunks)
    for sentence in evidence:
        start = context.find(sentence)
        end = start + len(sentence)
        reach = start
        for low, high in spans:
            if (low <= reach or not context[reach:low].strip()) and reach < high:  # whitespace between chunks
                reach = high
        if start < 0 or reach < end:
            return False
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--length", type=parse_length, default=16_384)
    parser.add_argument("--seed", type=int, default=1, help="the development split's seed (the bench tests seed 0)")
    parser.add_argument("--families", nargs="+", default=list(FAMILIES))
    parser.add_argument("--chunk-words", type=int, nargs="+", default=list(CHUNK_SIZES))
    default = EMConfig.from_preset("E")
    parser.add_argument("--context-tokens", type=int, nargs="+", default=[default.n_local + default.n_mem])
    parser.add_argument("--retrievals", nargs="+", choices=RETRIEVALS, default=list(RETRIEVALS))
    parser.add_argument("--questions", type=int, default=20)
    parser.add_argument("--answers", action="store_true",
                        help="also answer every question with the LLM and count the right answers (slow)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/rag_tuning"))
    args = parser.parse_args()
    if args.seed == 0:
        parser.error("seed 0 is the bench's test split: tune on another seed")

    engine = EMEngine.from_pretrained(preset="full", progress=False)  # its tokenizer sizes documents and budgets
    settings = BenchSettings(tasks=tuple(args.families), depths=())
    rows = []
    for family in args.families:
        doc = family_document(family, args.length, engine.count_tokens, questions=args.questions,
                              seed=document_seed(args.seed, family, args.length, -1.0))
        for words in args.chunk_words:
            for budget in args.context_tokens:
                for retrieval in args.retrievals:
                    rag = RAGBaseline("minilm", words, top_k=256, engine=engine, retrieval=retrieval,
                                      context_tokens=budget)
                    rag.add_documents([doc.context])
                    found = [covered(rag.retrieve(q.question), doc.context, q.evidence) for q in doc.questions]
                    row = {"family": family, "chunk_words": words, "context_tokens": budget,
                           "retrieval": retrieval, "found": sum(found), "questions": len(found)}
                    if args.answers:
                        row["answered"] = sum(
                            score(rag.answer(q.question, max_new_tokens_for(settings, engine, _expected(q)),
                                             chat=True).text, q.answers) == 1.0 for q in doc.questions)
                    rows.append(row)
                    answered = f", {row['answered']}/{len(found)} answered" if args.answers else ""
                    print(f"{family} {words} words {budget} tokens {retrieval}: {sum(found)}/{len(found)} retrieved"
                          f"{answered}", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    name = "rag_tuning_answers" if args.answers else "rag_tuning"
    (args.out / f"{name}.json").write_text(json.dumps(rows, indent=1))
    recipes = sorted({(r["chunk_words"], r["context_tokens"], r["retrieval"]) for r in rows})
    counts = ("found", "answered") if args.answers else ("found",)
    table = markdown_table(
        ["chunk words", "budget", "ranking", "count", *args.families, "all"], "rrll" + "r" * (len(args.families) + 1),
        ([w, b, m, c, *(_cell(rows, f, w, b, m, c) for f in args.families), _total(rows, w, b, m, c)]
         for w, b, m in recipes for c in counts))
    (args.out / f"{name}.md").write_text(
        f"Development split: seed {args.seed}, {args.length:,} tokens, {args.questions} questions a family; found: "
        "evidence wholly retrieved; answered: the LLM's answer right.\n\n" + table + "\n")
    print(table)


def _expected(question: Question) -> str | tuple[str, ...]:
    """What the bench passes as a question's expected answer: one string, or the list."""
    return question.answers[0] if len(question.answers) == 1 else question.answers


def _cell(rows: list[dict], family: str, words: int, budget: int, retrieval: str, count: str) -> str:
    row = next(r for r in rows if (r["family"], r["chunk_words"], r["context_tokens"], r["retrieval"])
               == (family, words, budget, retrieval))
    return f"{row[count]}/{row['questions']}"


def _total(rows: list[dict], words: int, budget: int, retrieval: str, count: str) -> str:
    mine = [r for r in rows if (r["chunk_words"], r["context_tokens"], r["retrieval"]) == (words, budget, retrieval)]
    return f"{sum(r[count] for r in mine)}/{sum(r['questions'] for r in mine)}"


if __name__ == "__main__":
    main()
