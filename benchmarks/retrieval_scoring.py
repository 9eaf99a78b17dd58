"""Does retrieval bring the needle into attention? Essay needles read with each retrieval scoring, per layer.

    python benchmarks/retrieval_scoring.py                        # 16K tokens, depths 0.1/0.5/0.9, preset S
    python benchmarks/retrieval_scoring.py --tokens 32768 --depths 0.5

For every depth and variant ("representatives": the paper's k-NN over one vector per event; "attention": events
ranked by the attention the queries give their stored tokens; "attention, keys from pages": the same ranking with a
RAM budget too large to matter, which turns off the float32 copy of the stored keys so every retrieval reads them
from the store's pages, as before the copy existed; "ordered" and "attention, ordered": the same rankings with
memory_positions="ordered", retrieved events at their input order's positions instead of all at one; "pooled" and
"attention, pooled": pooled scores (emllm.scoring.Pooled), each layer ranking by its and the earlier layers' scores;
"attention for questions, pooled": the representatives while reading, pooled attention scoring for the question and
the answer's tokens; each variant's scorer is built by emllm.scoring.scorer_from_names from the names of `emllm
bench`'s --retrieval-scoring and --retrieval-pooling), the needle document (Paul Graham essays, a 7-digit number) is
read, then the question with the start of its answer in a forward of its own, as `emllm bench` asks and as the
engine reads a one-call prompt (before 2026-11-25 this script read each prompt in plain chunks, so the question's
retrieval was the last chunk's: context tail and question together; ``--question-in-last-chunk`` reads so again).
The table gives how many of the model's layers hold the needle's event in attention when the answer starts ("local
window" when the needle was never evicted, so every layer sees it), the answer, and the seconds: reading (the
question included), answering, and decoding per token (a retrieval per token per layer). The haystack is read once
per variant and forked per depth (emllm_integrations.bench.read_each). Writes
benchmarks/results/retrieval_scoring.{json,md} (other lengths or models:
retrieval_scoring_needle_<model>_<tokens>.{json,md}).

    python benchmarks/retrieval_scoring.py --task multidoc --model qwen --tokens 32768 \
        --variants representatives attention

does the same for the bench's multi-document QA (`emllm bench --tasks multidoc`: the same documents, seed and
prompts): the document set is read once per variant, then each question from a fork of that memory, as the bench
asks; "layers holding the needle" counts the layers holding the event of the fact sentence that answers the
question. Writes benchmarks/results/retrieval_scoring_multidoc_<model>_<tokens>.{json,md}.

    python benchmarks/retrieval_scoring.py --tokens 32768 --pin-answer --variants representatives ordered

reads each context, pins the answering sentence (EpisodicMemory.pin: every layer holds it at every later
retrieval), then reads the question: a miss is then the model's reading, not retrieval's. ``--n-local`` and
``--n-mem`` change the layout; each such option, and a preset other than S, adds to the output file's name
(``_sc``, ``_nlocal512``, ``_pinned``, ``_question_in_last_chunk``).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Iterator
from pathlib import Path

from tqdm.auto import tqdm

from emllm_integrations.bench import Probe, Probes, config_overrides, multidoc_probes, needle_probes, read_each
from emllm_integrations.markdown import table as markdown_table

RESULTS = Path(__file__).resolve().parent / "results"
VARIANTS = {  # name -> engine fields, the retrieval ones by the bench's flag names (bench.config_overrides)
    "representatives": {"retrieval_scoring": "representatives"},
    "attention": {"retrieval_scoring": "attention"},
    "attention, keys from pages": {"retrieval_scoring": "attention", "ram_budget_mb": 1e6},
    "ordered": {"retrieval_scoring": "representatives", "memory_positions": "ordered"},
    "attention, ordered": {"retrieval_scoring": "attention", "memory_positions": "ordered"},
    "pooled": {"retrieval_scoring": "representatives", "retrieval_pooling": "cumulative"},
    "attention, pooled": {"retrieval_scoring": "attention", "retrieval_pooling": "cumulative"},
    "attention for questions, pooled": {"retrieval_scoring": "attention_for_questions",
                                        "retrieval_pooling": "cumulative"},
}


def run(tokens: int, depths: list[float], preset: str, task: str = "needle", model: str | None = None,
        variants: list[str] | None = None, pin_answer: bool = False, question_in_last_chunk: bool = False,
        **engine_fields) -> list[dict]:
    from emllm import EMEngine

    engine = EMEngine.from_pretrained(model, preset=preset, **engine_fields)
    probes = (needle_probes if task == "needle" else multidoc_probes)(engine, tokens, depths)
    chosen = {name: VARIANTS[name] for name in (variants or VARIANTS)}
    rows = []
    with tqdm(total=len(chosen) * len(probes.questions), desc="retrieval scoring", unit="question") as bar:
        for variant, fields in chosen.items():
            config = engine.config.replace(**config_overrides(fields))
            for memory, read_seconds, question in probe_memories(probes, engine, config, pin_answer,
                                                                 question_in_last_chunk):
                first, last = question.span
                stats = memory.stats()
                # in the local window (or the sinks) every layer attends to the needle without retrieving it
                in_window = first >= stats["tokens_sinks"] + stats["tokens_evicted"] or last <= stats["tokens_sinks"]
                layers = memory.layers_holding(first, last)
                num_layers = len(memory.layers)
                started = time.perf_counter()
                answer = engine.generate(question.ids, memory=memory, max_new_tokens=10)
                answer_seconds = time.perf_counter() - started
                memory.close()
                suffix = ", answer pinned" * pin_answer + ", question in the last chunk" * question_in_last_chunk
                rows.append({"task": task, "variant": variant + suffix,
                             "tokens": len(question.ids), "depth": question.depth,
                             "expected": question.answer, "needle_layers": layers, "num_layers": num_layers,
                             "needle_in_window": in_window,
                             "output": answer.text.strip(), "correct": question.answer in answer.text,
                             "read_seconds": read_seconds, "answer_seconds": answer_seconds,
                             "decode_ms_per_token": 1000 * answer.decode_seconds / max(1, len(answer.token_ids))})
                bar.update()
                tqdm.write(f"{variant:>26} depth {question.depth:.2f}: needle held by {_layers_text(rows[-1])}, "
                           f"{'correct' if rows[-1]['correct'] else 'wrong'} ({rows[-1]['output']!r})")
    return rows


def probe_memories(probes: Probes, engine, config, pin_answer: bool = False,
                   question_in_last_chunk: bool = False) -> Iterator[tuple[object, float, Probe]]:
    """A memory that has read each question's whole prompt, and the seconds reading it alone costs. The context is
    read first, then the question in a forward of its own, as `emllm bench` and the adapters' follow-up questions
    do (the question's retrieval is then its own, not a chunk's of context and question). With ``pin_answer`` the
    answering sentence is pinned between the two (EpisodicMemory.pin: every layer holds it at every later
    retrieval): what the model does when retrieval cannot miss. With ``question_in_last_chunk`` (needle only) each
    whole prompt is read in plain chunks, so the question shares the last chunk's retrieval with the context's
    tail: what a one-call prompt got before the engine read questions alone."""
    chunk = config.chunk_size
    if probes.shared_context is None:  # one haystack per depth, alike up to the needle: read_each shares it
        # The question starts at the context's end, or (old reading) at the plain chunk boundary before it.
        starts = [q.context_tokens // chunk * chunk if question_in_last_chunk else q.context_tokens
                  for q in probes.questions]
        reads = read_each(engine, [q.ids[:start] for q, start in zip(probes.questions, starts)], config=config)
        for (memory, seconds), question, start in zip(reads, probes.questions, starts):
            if pin_answer:
                memory.pin(*question.span)
            started = time.perf_counter()
            engine.read_prompt(memory, question.ids, start)  # in answering forwards, as generate reads it
            yield memory, seconds + time.perf_counter() - started, question
        return
    context = engine.new_memory(config)
    started = time.perf_counter()
    engine.read(context, probes.shared_context)
    context_seconds = time.perf_counter() - started
    try:
        for question in probes.questions:
            memory = context.fork()
            if pin_answer:
                memory.pin(*question.span)
            started = time.perf_counter()
            engine.read_prompt(memory, question.ids, len(probes.shared_context))  # what generate reads first
            yield memory, context_seconds + time.perf_counter() - started, question
    finally:
        context.close()


def _layers_text(row: dict) -> str:
    return "local window" if row.get("needle_in_window") else f"{row['needle_layers']}/{row['num_layers']}"


def table(rows: list[dict]) -> str:
    return markdown_table(
        ["retrieval", "tokens", "depth", "layers holding the needle", "expected", "output", "correct", "read s",
         "answer s", "decode ms/token"], "lrrrlllrrr",
        ([r["variant"], f"{r['tokens']:,}", f"{r['depth']:.2f}", _layers_text(r),
          r["expected"], repr(r["output"]), "yes" if r["correct"] else "no", f"{r['read_seconds']:.0f}",
          f"{r['answer_seconds']:.1f}", f"{r['decode_ms_per_token']:.0f}"] for r in rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", choices=["needle", "multidoc"], default="needle")
    parser.add_argument("--model", default=None, help="embedded model name or local HF model dir (default: SmolLM2)")
    parser.add_argument("--tokens", type=int, default=16_384)
    parser.add_argument("--depths", nargs="+", type=float, default=[0.1, 0.5, 0.9])
    parser.add_argument("--preset", default="S")
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    parser.add_argument("--n-mem", dest="n_mem", type=int, help="retrieved-event token budget (default: EMConfig's)")
    parser.add_argument("--n-local", dest="n_local", type=int, help="local window tokens (default: EMConfig's)")
    parser.add_argument("--pin-answer", action="store_true",
                        help="pin the answering sentence after the context is read (EpisodicMemory.pin): every layer "
                             "holds it, so a miss is the model's reading, not retrieval's")
    parser.add_argument("--question-in-last-chunk", action="store_true",
                        help="needle only: read each whole prompt in plain chunks (the question in the last one, "
                             "with the context's tail), as a one-call prompt was read before the engine read questions "
                             "alone")
    args = parser.parse_args()
    if args.question_in_last_chunk and (args.task != "needle" or args.pin_answer):
        parser.error("--question-in-last-chunk is for the needle task without --pin-answer")
    fields = {key: value for key, value in (("n_mem", args.n_mem), ("n_local", args.n_local)) if value is not None}
    rows = run(args.tokens, args.depths, args.preset, args.task, args.model, args.variants, args.pin_answer,
               args.question_in_last_chunk, **fields)
    if args.task == "needle":  # the 16K default run keeps its original file name
        name = "retrieval_scoring" + ("" if args.tokens == 16_384 and not args.model else
                                      f"_needle_{args.model or 'smollm2'}_{args.tokens}")
    else:
        name = f"retrieval_scoring_multidoc_{args.model or 'smollm2'}_{args.tokens}"
    name += "" if args.preset == "S" else f"_{args.preset.replace('+', '').lower()}"
    name += "".join(f"_{key.replace('_', '')}{value}" for key, value in fields.items())
    name += "_pinned" if args.pin_answer else ""
    name += "_question_in_last_chunk" if args.question_in_last_chunk else ""
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps(rows, indent=1))
    (RESULTS / f"{name}.md").write_text(table(rows) + "\n")
    print(table(rows))


if __name__ == "__main__":
    main()
