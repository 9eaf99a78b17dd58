"""Perfect retrieval on the chain families: what the reader answers when it is shown only a chain's facts.

The suite's two- and three-hop answers are low for every method, full attention included, so the question is
whose the loss is. This script takes each question's chain from the bench's own document (the role fact naming
the question's place, then every fact naming a person found so far) and asks the reader in the bench's chat turn
(greedy, up to 48 new tokens, where the bench gives a short answer its own tokens + 16) with three contexts, each
in document order:

- ``chain``: the chain's facts alone (a retriever that loads the chain and nothing else);
- ``chain+twins``: the chain and the asked fact's look-alikes (the same template about people no chain reaches,
  which a ranking by the question's words scores as high as the answer fact);
- ``twins+answer``: the look-alikes and the answer fact without the role fact (the bridge missing).

No engine is involved besides the reader's full attention over a few sentences, so the gap between the columns is
the look-alikes' (or the bridge's) doing, not retrieval's or the memory's.

    HF_HUB_OFFLINE=1 python benchmarks/chain_oracle.py --task two_hop --length 8K
"""

from __future__ import annotations

import argparse
import json
import pathlib
import re

from emllm import EMConfig, EMEngine
from emllm_integrations.bench import ruler
from emllm_integrations.bench.documents import score
from emllm_integrations.bench.items import task_items
from emllm_integrations.bench.settings import BenchSettings
from emllm_integrations.bench.tasks import SENTENCE_END
from emllm_integrations.cli import parse_length
from emllm_integrations.prompts import chat_context, chat_frame

CONTEXTS = ("chain", "chain+twins", "twins+answer")
PERSON = re.compile(r"\b([A-Z][a-z]+ [A-Z][a-z]+)\b")


def sentences_of(text: str) -> list[str]:
    return [s for s in SENTENCE_END.split(text) if s]


def chain_of(question: str, sentences: list[str], hops: int) -> list[str]:
    """The question's chain: the one sentence naming its place (each place is told once, in its role fact), then
    ``hops - 1`` rounds of every sentence naming a person already reached."""
    places = [w for w in re.findall(r"\b[A-Z][a-z]+\b", question)[1:] if sum(w in s for s in sentences) == 1]
    if len(places) != 1:
        raise ValueError(f"Expected one place told once in the document for {question!r}, found {places}.")
    chain = [next(s for s in sentences if places[0] in s)]
    frontier = list(chain)
    for _ in range(hops - 1):
        names = {name for s in frontier for name in PERSON.findall(s)}
        frontier = [s for s in sentences if s not in chain and any(name in s for name in names)]
        chain += frontier
    return chain


def twins_of(answer_fact: str, sentences: list[str]) -> list[str]:
    """The asked fact's look-alikes: the sentences about look-alike people closest to it in words."""
    def words(s: str) -> set[str]:
        return set(re.findall(r"[a-z]+", s.lower()))

    about_twins = [s for s in sentences if any(re.search(rf"\b{n}\b", s) for n in ruler.LOOKALIKE_NAMES)]
    return sorted(about_twins, key=lambda s: -len(words(s) & words(answer_fact)) / len(words(s) | words(answer_fact))
                  )[:ruler.LOOKALIKES]


def ask(engine: EMEngine, question: str, facts: list[str], document: str, max_new_tokens: int) -> str:
    """The bench's chat turn (instruction, text, blank line, question) over ``facts`` in document order."""
    head, tail = chat_frame(engine, question)
    text = ruler.HOP_INSTRUCTION + " ".join(sorted(set(facts), key=document.index))
    memory = engine.new_memory(EMConfig.from_preset("full"))
    try:
        return engine.generate(head + engine.tokenize(chat_context([text])) + tail, memory=memory,
                               max_new_tokens=max_new_tokens).text
    finally:
        memory.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--task", choices=("two_hop", "three_hop"), default="two_hop")
    parser.add_argument("--length", type=parse_length, default=8192, help="the bench document's length (8K, 32K)")
    parser.add_argument("--model", default=None, help="the reader (default: the embedded default model)")
    parser.add_argument("--seed", type=int, default=0, help="the bench's seed: 0 is the test split")
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path(__file__).parent / "results" / "chain_oracle")
    args = parser.parse_args()
    engine = EMEngine.from_pretrained(args.model, preset="full", progress=False)
    settings = BenchSettings(tasks=(args.task,), depths=(0.5,), model=args.model, seed=args.seed)
    item = task_items(args.task, args.length, settings, engine.count_tokens)[0]
    document = item.documents[0]
    sentences = sentences_of(document)
    hops = 3 if args.task == "three_hop" else 2
    rows = []
    for number, (question, expected, _, _) in enumerate(item.questions, 1):
        chain = chain_of(question, sentences, hops)
        answer_fact = next(s for s in chain if any(a.lower() in s.lower() for a in expected))
        twins = twins_of(answer_fact, sentences)
        shown = {"chain": chain, "chain+twins": chain + twins, "twins+answer": twins + [answer_fact]}
        row = {"question": question, "expected": list(expected), "chain": chain, "twins": twins}
        for name in CONTEXTS:
            output = ask(engine, question, shown[name], document, max_new_tokens=48)
            row[name] = {"right": score(output, expected) == 1.0, "output": output}
        rows.append(row)
        print(f"{number:2d}/{len(item.questions)} " + " ".join(str(int(row[n]["right"])) for n in CONTEXTS)
              + f"  {expected[0]!r}", flush=True)
    totals = {name: sum(row[name]["right"] for row in rows) for name in CONTEXTS}
    line = ", ".join(f"{name} {count} of {len(rows)}" for name, count in totals.items())
    print(f"{args.task} {args.length // 1024}K ({args.model or 'default model'}): {line}")
    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"{args.task}_{args.length // 1024}k_{(args.model or 'default').replace('/', '_')}"
    (args.out / f"{stem}.json").write_text(json.dumps({"totals": totals, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
