"""Which look-alike facts the memory holds when a multi-document answer starts, and whether the model would answer
from their plain text: the bench's multidoc questions, traced one by one.

    python benchmarks/multidoc_trace.py                       # Qwen, 32K tokens, depths 0.1/0.5/0.9, the recipe
    python benchmarks/multidoc_trace.py --n-mem 1024          # a smaller retrieval budget

Reads `emllm bench`'s multidoc item (its documents, seed and prompts: every document states "The registration
number of the <organisation> is <6 digits>."), then for each question, from a fork of that memory as the bench
asks: the facts whose number the layers hold in attention when the answer starts (how many layers, the asked one
marked), the engine's answer, and a control. The control reads, with plain full attention, the sinks, the events
held by at least k layers (in input order), the local window and the question: the same text the memory offers,
laid out as ordinary context. When the control answers and the engine does not, the miss is the memory's layout
(which layer holds what, at which positions); when the control misses too, the retrieved text itself misleads the
model (too many look-alike facts). Writes benchmarks/results/multidoc_trace_<model>_<tokens>[_nmem<n>].md.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from pathlib import Path

from emllm_integrations.bench import config_overrides, multidoc_probes
from emllm_integrations.bench.tasks import MULTIDOC_FACT

RESULTS = Path(__file__).resolve().parent / "results"
# tasks.MULTIDOC_FACT with its organisation and 6-digit number captured
FACT = re.compile(re.escape(MULTIDOC_FACT).replace(r"\{entity\}", "(.+?)").replace(r"\{answer\}", r"(\d{6})"))


def trace(model: str, tokens: int, depths: list[float], preset: str, consensus: list[int],
          **fields) -> list[str]:
    from emllm import EMEngine

    engine = EMEngine.from_pretrained(model, preset=preset, **config_overrides(fields))
    probes = multidoc_probes(engine, tokens, depths)
    context_ids = probes.shared_context
    numbers = _number_spans(engine, engine.tokenizer.decode(context_ids))
    memory = engine.new_memory()
    started = time.perf_counter()
    engine.read(memory, context_ids)
    stats = memory.stats()
    sinks, window_start = stats["tokens_sinks"], stats["tokens_sinks"] + stats["tokens_evicted"]
    lines = [f"{len(numbers)} documents, {len(context_ids):,} tokens, {stats['events']:,} events, read "
             f"{time.perf_counter() - started:.0f} s; local window from token {window_start:,}", ""]
    full = engine.config.replace(attention="full")
    for question in probes.questions:
        asking = memory.fork()
        engine.read_prompt(asking, question.ids, len(context_ids))
        retrieved = asking.retrieved_events()  # spans in input order, with the layers holding each
        held = sorted(((-1 if span[0] >= window_start else asking.layers_holding(*span), document, entity, number)
                       for document, (entity, number, span) in enumerate(numbers)), reverse=True)
        answer = engine.generate(question.ids, memory=asking, max_new_tokens=8).text.strip()
        asking.close()
        half = len(memory.layers) // 2
        lines += [f"## depth {question.depth}: asked {_fact_name(numbers, question.answer)}", "",
                  f"engine: {answer!r}, {_verdict(numbers, question.answer, answer)}; facts whose number "
                  f"{half}+ of {len(memory.layers)} layers hold: {sum(h[0] >= half for h in held)}", "",
                  "| layers holding the number | document | organisation | number |", "|---:|---:|---|---|"]
        lines += [f"| {layers if layers >= 0 else 'local window'} | {document} | {entity} | {number}"
                  f"{' (asked)' * (number == question.answer)} |"
                  for layers, document, entity, number in held if layers >= half or layers < 0]
        lines += ["", "| control: full attention over events held by | events | tokens | facts in it | answer |",
                  "|---|---:|---:|---:|---|"]
        for k in consensus:
            # the context's events (the question's reading evicted a few more: they are in the window part below)
            events = [e for e in retrieved if e.layers >= k and e.start < window_start]
            ids = list(context_ids[:sinks])
            for event in events:
                ids += context_ids[event.start:event.end]
            ids += question.ids[window_start:]  # the local window, then the question and its answer lead-in
            control = engine.new_memory(full)
            text = engine.generate(ids, memory=control, max_new_tokens=8).text.strip()
            control.close()
            facts = len(FACT.findall(engine.tokenizer.decode(ids[:len(ids) - len(question.ids) + len(context_ids)])))
            lines.append(f"| >= {k} layers | {len(events)} | {len(ids):,} | {facts} | {text!r}, "
                         f"{_verdict(numbers, question.answer, text)} |")
        lines.append("")
        print("\n".join(lines[-8:]), flush=True)
    memory.close()
    return lines


def _number_spans(engine, context: str) -> list[tuple[str, str, tuple[int, int]]]:
    """(organisation, number, the number's token span) per document, in document order."""
    return [(m.group(1), m.group(2), (engine.count_tokens(context[:m.start(2)]),
                                      engine.count_tokens(context[:m.end(2)])))
            for m in FACT.finditer(context)]


def _fact_name(numbers, number: str) -> str:
    for document, (entity, stated, _) in enumerate(numbers):
        if stated == number:
            return f"document {document}, {entity}, {number}"
    return f"{number} (in no document)"


def _verdict(numbers, expected: str, answer: str) -> str:
    if expected in answer:
        return "right"
    found = re.search(r"\d{6}", answer)
    return f"wrong: {_fact_name(numbers, found.group())}" if found else "wrong"


def main() -> None:
    from emllm.scoring import POOLINGS, SCORINGS

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen")
    parser.add_argument("--tokens", type=int, default=32_768)
    parser.add_argument("--depths", nargs="+", type=float, default=[0.1, 0.5, 0.9])
    parser.add_argument("--preset", default="S+C")
    parser.add_argument("--n-local", type=int, default=512)
    parser.add_argument("--n-mem", type=int, default=None, help="retrieval budget in tokens (default: EMConfig's)")
    parser.add_argument("--retrieval-scoring", default="attention_for_questions", choices=SCORINGS)
    parser.add_argument("--retrieval-pooling", default="cumulative", choices=POOLINGS)
    parser.add_argument("--memory-positions", default="fixed")
    parser.add_argument("--consensus", nargs="+", type=int, default=[12, 18, 22],
                        help="the controls: events held by at least this many layers")
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()
    fields = {"n_mem": args.n_mem} if args.n_mem else {}
    lines = trace(args.model, args.tokens, args.depths, args.preset, args.consensus, n_local=args.n_local,
                  retrieval_scoring=args.retrieval_scoring, retrieval_pooling=args.retrieval_pooling,
                  memory_positions=args.memory_positions, dtype=args.dtype, **fields)
    RESULTS.mkdir(exist_ok=True)
    name = f"multidoc_trace_{args.model}_{args.tokens}" + (f"_nmem{args.n_mem}" if args.n_mem else "") \
        + ("" if args.memory_positions == "fixed" else f"_{args.memory_positions}")
    command = " ".join(["python benchmarks/multidoc_trace.py", *sys.argv[1:]])
    (RESULTS / f"{name}.md").write_text(f"`{command}` ({args.dtype}, {time.strftime('%Y-%m-%d')})\n\n"
                                        + "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
