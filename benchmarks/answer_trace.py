"""What the memory holds at each token of an answer: the bench's needle (or kv) documents, traced token by token.

    python benchmarks/answer_trace.py                         # 128K tokens, depths 0.5 and 0.9, the needle recipe
    python benchmarks/answer_trace.py --tokens 8192 --depths 0.5 --preset S
    python benchmarks/answer_trace.py --task kv --model qwen --tokens 32768 --depths 0.1 0.5 0.9 --max-new-tokens 30

Reads `emllm bench`'s needle documents (same seed, prompts and layout options as `emllm bench --tasks needle`), or
with ``--task kv`` its key-value object (read once, asked at every depth from a fork), shows the stored events that
hold the needle sentence or the asked value (where event boundaries cut it), then asks the question and, for every
generated token, prints how many of the model's layers hold each of those events in attention when the token is
chosen, and the model's most likely next tokens. A needle answered by its first digits and a stop shows up here as
the event holding the number's end missing from most layers. (``--hold``, a second answer from a fork keeping the
question's retrieval for the whole answer, went with EMConfig.decode_retrieve_every: the engine now retrieves at
every generated token.)
Writes benchmarks/results/answer_trace[_kv][_<model>]_<tokens>_<preset>.md."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def trace(tokens: int, depths: list[float], preset: str, max_new_tokens: int, task: str = "needle",
          model: str | None = None, **fields) -> list[str]:
    from emllm import EMEngine
    from emllm_integrations.bench import config_overrides, read_each

    engine = EMEngine.from_pretrained(model, preset=preset, **config_overrides(fields))
    documents = _documents(task, tokens, depths, engine.count_tokens)
    contexts = [engine.tokenize(text) for text, _ in documents]
    lines = []
    for (memory, read_seconds), (text, questions), context in zip(read_each(engine, contexts), documents, contexts):
        for question in questions:
            lines += _trace_question(engine, memory, text, context, read_seconds, question, max_new_tokens)
            print("\n".join(lines[-12:]), flush=True)
        memory.close()
    return lines


def _trace_question(engine, memory, text: str, context: list[int], read_seconds: float, question: tuple,
                    max_new_tokens: int) -> list[str]:
    """One question asked from a fork of a read memory: the needle's events, then a row per generated token."""
    from emllm_integrations.bench.tasks import probe_suffix

    depth, needle, asked, lead, expected = question
    start = text.index(needle)
    first, last = engine.count_tokens(text[:start]), engine.count_tokens(text[:start + len(needle)])
    events = memory.events_overlapping(first, last)
    starts = memory.event_boundaries()
    lines = [f"## depth {depth}: needle tokens {first}-{last} of {len(context):,}, answer {expected}, "
             f"read {read_seconds:.0f} s", ""]
    for event in events:
        begin, end = int(starts[event]), int(starts[event] + memory.event_sizes[event])
        lines.append(f"- event {event}, tokens {begin}-{end}: {engine.tokenizer.decode(context[begin:end])!r}")
    prompt = context + engine.tokenize(probe_suffix(asked, lead))
    asking = memory.fork()
    lines += ["", "retrieval at every token:", "",
              "| answer so far | layers holding each needle event | most likely next tokens |", "|---|---|---|"]
    answer, started = "", time.perf_counter()
    for delta in engine.stream(prompt, memory=asking, max_new_tokens=max_new_tokens):
        holding = [sum(1 for layer in asking.layers if event in layer.retrieved_ids) for event in events]
        lines.append(f"| {answer!r} | {holding} | {_top(engine, asking.last_logits)} |")
        answer += delta
    lines += ["", f"answer {answer.strip()!r} ({'right' if expected in answer else 'wrong'}), "
                  f"{time.perf_counter() - started:.1f} s"]
    asking.close()
    return lines + [""]


def _documents(task: str, tokens: int, depths: list[float], count_tokens) -> list[tuple[str, list[tuple]]]:
    """The bench's documents for the task, each as (context text, [(depth, needle text, question, answer lead,
    answer)]): a needle haystack per depth, or kv's one JSON object asked at every depth (the needle is the value)."""
    from emllm_integrations.bench import BenchSettings, document_seed, task_items
    from emllm_integrations.bench.tasks import needle_document
    from emllm_integrations.prompts import format_context

    if task == "kv":
        (item,) = task_items("kv", tokens, BenchSettings(("kv",), tuple(depths)), count_tokens)
        return [(format_context(list(item.documents)),
                 [(depth, answer, question, lead, answer) for question, answer, depth, lead in item.questions])]
    docs = [needle_document(tokens, depth, count_tokens, seed=document_seed(0, "needle", tokens, depth)) for depth in depths]
    return [(format_context([doc.context]), [(doc.depth, doc.needle, doc.question, doc.answer_lead, doc.answer)])
            for doc in docs]


def _top(engine, logits, k: int = 4) -> str:
    import torch

    probabilities = torch.softmax(logits.float().flatten(), dim=-1)
    values, ids = probabilities.topk(k)
    return ", ".join(f"{engine.tokenizer.decode([int(i)])!r} {float(p):.2f}" for p, i in zip(values, ids))


def main() -> None:
    from emllm.scoring import POOLINGS, SCORINGS

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", choices=["needle", "kv"], default="needle")
    parser.add_argument("--model", default=None, help="embedded model name or local HF model dir (default: SmolLM2)")
    parser.add_argument("--tokens", type=int, default=131_072)
    parser.add_argument("--depths", nargs="+", type=float, default=[0.5, 0.9])
    parser.add_argument("--preset", default="S+C")
    parser.add_argument("--n-local", type=int, default=512)
    parser.add_argument("--retrieval-scoring", default="attention_for_questions", choices=SCORINGS)
    parser.add_argument("--retrieval-pooling", default="cumulative", choices=POOLINGS)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--max-new-tokens", type=int, default=10)
    args = parser.parse_args()
    lines = trace(args.tokens, args.depths, args.preset, args.max_new_tokens, args.task, args.model,
                  n_local=args.n_local, retrieval_scoring=args.retrieval_scoring,
                  retrieval_pooling=args.retrieval_pooling, dtype=args.dtype)
    RESULTS.mkdir(exist_ok=True)
    task = "" if args.task == "needle" else f"_{args.task}"
    model = f"_{args.model}" if args.model else ""
    name = f"answer_trace{task}{model}_{args.tokens}_{args.preset.replace('+', '')}.md"
    command = " ".join(["python benchmarks/answer_trace.py", *sys.argv[1:]])
    header = f"`{command}` ({args.dtype}, {time.strftime('%Y-%m-%d')})"
    (RESULTS / name).write_text(header + "\n\n" + "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
