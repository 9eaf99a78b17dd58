"""Conversation reuse through ChatEMLLM: a first question about a long document, then a follow-up.

LangChain passes the whole conversation on every call. The first call reads the document; the follow-up
([document + question 1, answer 1, question 2]) extends the first call's prompt, so the shared MemoryPool continues
from the first call's memory and reads only the new turn. The table shows tokens read, seconds and the ratio of the
follow-up to the first call.

    python benchmarks/langchain_reuse.py                                  # 32K tokens, preset S, n_local=n_mem=1024
    python benchmarks/langchain_reuse.py --tokens 8192 --preset SM --set n_local=2048 n_mem=2048 --threads 2
"""

from __future__ import annotations

import argparse
import time

from emllm_integrations.markdown import table as markdown_table


def run(tokens: int, depth: float, preset: str, fields: dict, max_tokens: int) -> list[dict]:
    from langchain_core.messages import AIMessage, HumanMessage

    from emllm_integrations.bench.tasks import PASSKEY_QUESTION, passkey_document
    from emllm_integrations.langchain import ChatEMLLM

    llm = ChatEMLLM(preset=preset, max_tokens=max_tokens, **fields)
    doc = passkey_document(tokens, depth, llm.engine().count_tokens, seed=tokens + int(depth * 1000))
    question = "What is the pass key?"  # before and after the document: see the ChatEMLLM module docstring
    first = [HumanMessage(f"Answer the question about the text below.\nQuestion: {question}\n\n"
                          f"{doc.prompt[: -len(PASSKEY_QUESTION)]}\n\nQuestion: {question}")]
    rows = []
    for name, messages in (("first question", first), ("follow-up", None)):
        if messages is None:
            messages = [*first, AIMessage(rows[0]["answer"]), HumanMessage("Repeat the pass key, digits only.")]
        started = time.perf_counter()
        result = llm.invoke(messages)
        rows.append({"call": name, "input_tokens": result.usage_metadata["input_tokens"],
                     "read": result.response_metadata["new_input_tokens"],
                     "seconds": time.perf_counter() - started, "answer": result.content,
                     "correct": doc.answer in result.content})
    return rows


def table(rows: list[dict]) -> str:
    base = rows[0]
    return markdown_table(
        ["call", "prompt tokens", "tokens read", "seconds", "read ratio", "time ratio", "key found"], "lrrrrrl",
        ([r["call"], f"{r['input_tokens']:,}", f"{r['read']:,}", f"{r['seconds']:.1f}",
          f"{r['read'] / base['read']:.3%}", f"{r['seconds'] / base['seconds']:.3%}",
          f"{'yes' if r['correct'] else 'no'} ({r['answer'].strip()!r})"]
         for r in rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--depth", type=float, default=0.5)
    parser.add_argument("--preset", default="S")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--set", nargs="*", default=["n_local=1024", "n_mem=1024"], metavar="FIELD=VALUE",
                        help="engine fields, e.g. n_local=1024 n_mem=1024")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch intra-op threads (1 is much faster on a CPU shared with other jobs)")
    args = parser.parse_args()
    if args.threads:
        import torch
        torch.set_num_threads(args.threads)
    fields = {k: int(v) if v.isdigit() else v for k, v in (item.split("=", 1) for item in args.set)}
    print(table(run(args.tokens, args.depth, args.preset, fields, args.max_tokens)))


if __name__ == "__main__":
    main()
