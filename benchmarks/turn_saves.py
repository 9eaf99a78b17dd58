"""What saving a conversation costs per turn: a save over the last save (it links the KV pages that save holds and
writes the rest) against a whole save of the same memory into an empty folder.

    HF_HUB_OFFLINE=1 python benchmarks/turn_saves.py --lengths 8K 32K --turns 4 --out benchmarks/results/turn_saves

For each length a fact QA document is read as a first turn's prompt and saved. Each later turn reads a question
(and, as a chat would, the answer before it: ~60 tokens) and is saved twice: over the conversation's save, as
`emllm serve`'s local store saves, and whole into a new folder, as before saves linked pages. Per turn: seconds and
bytes written (files new to the folder: a linked file keeps its inode). Both saves load to the same memory.
``--s3`` saves each turn to a bucket too (moto's S3 server on 127.0.0.1, through s3fs, as `emllm serve --sessions
s3://...` does): over the session's last generation (its unchanged KV files copied within the bucket) and whole
under a new session; bytes uploaded and seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from emllm import shared_engine
from emllm_integrations.bench.ruler import family_document
from emllm_integrations.cli import parse_length


def inodes(folder: Path) -> dict[int, int]:
    """{inode: bytes} of the files in a save folder."""
    return {entry.stat().st_ino: entry.stat().st_size for entry in folder.iterdir()}


def timed_save(engine, memory, folder: Path) -> tuple[float, int]:
    """Seconds the save took and the bytes it wrote (files that were not in the folder before)."""
    before = inodes(folder) if folder.exists() else {}
    started = time.perf_counter()
    engine.save_memory(memory, folder)
    seconds = time.perf_counter() - started
    return seconds, sum(size for inode, size in inodes(folder).items() if inode not in before)


def timed_upload(engine, memory, store, key: str) -> tuple[float, int]:
    """Seconds a bucket save took and the bytes it uploaded."""
    before, started = store.uploaded_bytes, time.perf_counter()
    store.save(engine, memory, key)
    return time.perf_counter() - started, store.uploaded_bytes - before


def one_length(engine, length: int, turns: int, scratch: Path, bucket=None) -> list[dict]:
    doc = family_document("fact_qa", length, engine.count_tokens, questions=turns + 1, seed=0)
    memory = engine.new_memory()
    started = time.perf_counter()
    engine.read(memory, engine.chat_ids([{"role": "user", "content": f"{doc.context}\n\n{doc.questions[0].question}"}]))
    print(f"{length}: read {memory.total_tokens} tokens in {time.perf_counter() - started:.0f} s", flush=True)
    conversation = scratch / f"conversation-{length}"
    rows = [{"tokens": length, "turn": 1, "read_tokens": memory.total_tokens,
             **dict(zip(("over_s", "over_bytes"), timed_save(engine, memory, conversation)))}]
    if bucket is not None:
        rows[0].update(zip(("s3_over_s", "s3_over_bytes"), timed_upload(engine, memory, bucket, f"b/{length}")))
    for turn in range(2, turns + 2):
        question = doc.questions[turn - 1].question
        ids = engine.chat_ids([{"role": "assistant", "content": "The answer is in the text above."},
                               {"role": "user", "content": question}])
        engine.read(memory, ids)
        over_s, over_bytes = timed_save(engine, memory, conversation)
        whole = scratch / f"whole-{length}-{turn}"
        whole_s, whole_bytes = timed_save(engine, memory, whole)
        loaded = [engine.load_memory(conversation), engine.load_memory(whole)]  # each verified as it loads
        same = all(copy.token_ids == memory.token_ids for copy in loaded)
        for copy in loaded:
            copy.close()
        shutil.rmtree(whole)
        rows.append({"tokens": length, "turn": turn, "read_tokens": memory.total_tokens, "over_s": over_s,
                     "over_bytes": over_bytes, "whole_s": whole_s, "whole_bytes": whole_bytes, "same": same})
        if bucket is not None:
            rows[-1].update(zip(("s3_over_s", "s3_over_bytes"), timed_upload(engine, memory, bucket, f"b/{length}")))
            rows[-1].update(zip(("s3_whole_s", "s3_whole_bytes"),
                                timed_upload(engine, memory, bucket, f"b/{length}-whole-{turn}")))
        print(rows[-1], flush=True)
    return rows


@contextmanager
def bucket_store(wanted: bool) -> Iterator[Any]:
    """A RemoteStore on a bucket of moto's S3 server on 127.0.0.1 (None unless wanted)."""
    if not wanted:
        yield None
        return
    from serve import s3_store

    from emllm_integrations.serve.sessions import RemoteStore

    with s3_store() as (url, env):
        os.environ.update(env)  # s3fs reads the endpoint and keys as a user's environment gives them
        yield RemoteStore(url)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", nargs="+", type=parse_length, default=[8192, 32768])
    parser.add_argument("--turns", type=int, default=4, help="turns after the first, each saved both ways")
    parser.add_argument("--s3", action="store_true", help="also save each turn to a bucket (moto, s3fs)")
    parser.add_argument("--model", default=None)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/turn_saves"))
    args = parser.parse_args()
    engine = shared_engine(args.model)
    rows = []
    with tempfile.TemporaryDirectory(dir=os.environ.get("SERVE_STORE")) as scratch, bucket_store(args.s3) as bucket:
        for length in args.lengths:
            rows += one_length(engine, length, args.turns, Path(scratch), bucket)
    lines = [f"Saving a turn ({engine.model_name}, {platform.processor() or platform.machine()}, {os.cpu_count()} "
             "cores): over the conversation's save, and whole into a new folder", "",
             "| tokens | turn | tokens read | over the last save: s | MB written | whole save: s | MB written | "
             "same memory |", "|---:|---:|---:|---:|---:|---:|---:|---|"]
    for row in rows:
        whole = (f"{row['whole_s']:.2f} | {row['whole_bytes'] / 2**20:.1f} | {row['same']}" if "whole_s" in row
                 else "– | – | –")
        lines.append(f"| {row['tokens']:,} | {row['turn']} | {row['read_tokens']:,} | {row['over_s']:.2f} | "
                     f"{row['over_bytes'] / 2**20:.1f} | {whole} |")
    if args.s3:
        lines += ["", "| tokens | turn | S3, over the last generation: s | MB uploaded | S3, whole: s | MB uploaded |",
                  "|---:|---:|---:|---:|---:|---:|"]
        for row in rows:
            whole = (f"{row['s3_whole_s']:.2f} | {row['s3_whole_bytes'] / 2**20:.1f}" if "s3_whole_s" in row
                     else "– | –")
            lines.append(f"| {row['tokens']:,} | {row['turn']} | {row['s3_over_s']:.2f} | "
                         f"{row['s3_over_bytes'] / 2**20:.1f} | {whole} |")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "turn_saves.json").write_text(json.dumps(rows, indent=1))
    (args.out / "turn_saves.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
