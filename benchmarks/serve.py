"""`emllm serve` measured: a returning conversation's first token (warm, restored, cold), the store's bytes per
token, and many sessions decoding at once through HTTP.

    HF_HUB_OFFLINE=1 python benchmarks/serve.py --lengths 8K 32K --stores local s3 --concurrent 8 \
        --out benchmarks/results/serve

For each length a document of real prose (the bench's fact QA family) is asked about in two turns, streamed:
  warm      the session's second turn on the server that answered its first (its memory resident)
  restored  the same second turn of another session that had the same first turn, on a new server started on the
            same store after kill -9 of the first (its answer must be the warm one); per store: a local folder, and
            an S3 bucket on a loopback S3 server (moto) through s3fs, as a user's bucket would be reached
  cold      the same conversation (first turn, answer, second question) sent as a new session: all re-read
Bytes per token: the local save's files over its tokens, beside the bf16 K and V a plain cache keeps per token.

``--concurrent N``: N sessions, each its own ~2,600-token document read in a first turn, then their second turns
answered one after another and then all at once (threads; the server decodes them together, emllm.batching).
Decode rate, as the in-process benchmark (batched_decoding.py) counts it: tokens after the first over the time from
the first streamed token to the last (one at a time: summed over turns; at once: from the first turn's first token
to the last turn's last). The first window holds the other turns' question reads; the in-process benchmark times
only decoding, so a second row counts the content deltas streamed once every turn streams (from the last turn's
first delta), against one turn's deltas alone. Beside them, whole turns: completion tokens over the turns' wall time,
each turn's question read and its save (made before the response ends) included.

Each figure is one request on this machine (printed with its CPU) and noisy; the table gives ratios measured in one
run. The issue's goals: restored <= 0.1x cold and warm <= 0.02x cold at 32K; N=8 at once >= 4x one at a time.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import logging
import os
import platform
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
from openai import OpenAI

from emllm_integrations.bench.ruler import family_document
from emllm_integrations.cli import parse_length

BUCKET = "emllm-serve-bench"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class Server:
    """`emllm serve` on a free loopback port over a store, its log in ``logs``."""

    def __init__(self, store: str, logs: Path, model: str | None, preset: str, env: dict[str, str] | None = None):
        port = free_port()
        command = [sys.executable, "-m", "emllm_integrations.cli", "serve", "--preset", preset, "--port", str(port),
                   "--host", "127.0.0.1", "--sessions", store, *(["--model", model] if model else [])]
        self._log = open(logs / f"server-{port}.log", "w")  # noqa: SIM115  (the server's whole life)
        self.process = subprocess.Popen(command, env=dict(os.environ, HF_HUB_OFFLINE="1", **(env or {})),
                                        stdout=self._log, stderr=self._log)
        self.url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(1)
        self.kill()
        raise RuntimeError("the server did not start within 600 s")

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait()
        self._log.close()


def turn(url: str, model: str, messages: list[dict], session: str, max_tokens: int = 24) -> dict:
    """One streamed turn: seconds to the first content delta and to the end, the answer, its token counts."""
    client = OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=3600, max_retries=0)
    started, arrivals, text, usage = time.perf_counter(), [], [], None
    for chunk in client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens, temperature=0,
                                                stream=True, stream_options={"include_usage": True},
                                                extra_headers={"X-Session-Id": session}):
        if chunk.choices and chunk.choices[0].delta.content:
            arrivals.append(time.perf_counter())
            text.append(chunk.choices[0].delta.content)
        if chunk.usage is not None:
            usage = chunk.usage
    ended = time.perf_counter()
    first, last = (arrivals[0], arrivals[-1]) if arrivals else (ended, ended)
    return {"first_s": first - started, "total_s": ended - started, "text": "".join(text),
            "cached": usage.prompt_tokens_details.cached_tokens, "completion_tokens": usage.completion_tokens,
            "started_at": started, "first_at": first, "last_at": last, "arrivals": arrivals}


def conversation(length: int, count: object, seed: int = 0) -> tuple[list[dict], str]:
    """(a first turn: a document and a question, the second question)."""
    doc = family_document("fact_qa", length, count, questions=2, seed=seed)
    return [{"role": "user", "content": f"{doc.context}\n\n{doc.questions[0].question}"}], doc.questions[1].question


def second_turn(first: list[dict], answer: str, question: str) -> list[dict]:
    return [*first, {"role": "assistant", "content": answer}, {"role": "user", "content": question}]


@contextmanager
def s3_store() -> Iterator[tuple[str, dict[str, str]]]:
    """A bucket on moto's S3 server on 127.0.0.1: (its URL, the environment that points s3fs at it)."""
    import s3fs
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # moto's server logs every request otherwise
    port = free_port()
    moto = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    moto.start()
    env = {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_ACCESS_KEY_ID": "bench",
           "AWS_SECRET_ACCESS_KEY": "bench", "AWS_DEFAULT_REGION": "us-east-1"}
    try:
        s3fs.S3FileSystem(endpoint_url=env["AWS_ENDPOINT_URL"], key="bench", secret="bench").mkdir(BUCKET)
        yield f"s3://{BUCKET}/sessions", env
    finally:
        moto.stop()


def first_turns(args: argparse.Namespace, model: str, count: object, logs: Path, local: str
                ) -> tuple[list[dict], dict[int, dict]]:
    """Warm, cold and restored-from-a-local-folder turns, per length; (rows, each length's turns for the S3 run)."""
    rows, turns = [], {}
    server = Server(local, logs, args.model, args.preset)
    try:
        for length in args.lengths:
            one, question = conversation(length, count)
            first = turn(server.url, model, one, f"warm-{length}")
            turn(server.url, model, one, f"restore-{length}")  # its second turn comes after the restart
            two = second_turn(one, first["text"], question)
            warm = turn(server.url, model, two, f"warm-{length}")
            cold = turn(server.url, model, two, f"cold-{length}")
            turns[length] = {"one": one, "two": two, "warm": warm, "cold": cold}
            print(f"{length}: warm {warm['first_s']:.2f} s, cold {cold['first_s']:.2f} s", flush=True)
    finally:
        server.kill()
    server = Server(local, logs, args.model, args.preset)
    try:
        for length, done in turns.items():
            restored = turn(server.url, model, done["two"], f"restore-{length}")
            rows.append({"tokens": length, "store": "local", "warm_s": done["warm"]["first_s"],
                         "restored_s": restored["first_s"], "cold_s": done["cold"]["first_s"],
                         "cached_restored": restored["cached"], "restored_answers_as_warm":
                         restored["text"] == done["warm"]["text"], **stored_bytes(Path(local), length)})
            print(rows[-1], flush=True)
    finally:
        server.kill()
    return rows, turns


def s3_restores(args: argparse.Namespace, model: str, turns: dict[int, dict], logs: Path) -> list[dict]:
    """The restored turn again, from an S3 bucket: first turns on one server, their second turns after kill -9."""
    rows = []
    with s3_store() as (url, env):
        server = Server(url, logs, args.model, args.preset, env)
        try:
            for length, done in turns.items():
                turn(server.url, model, done["one"], f"s3-{length}")
        finally:
            server.kill()
        server = Server(url, logs, args.model, args.preset, env)
        try:
            for length, done in turns.items():
                restored = turn(server.url, model, done["two"], f"s3-{length}")
                rows.append({"tokens": length, "store": "s3", "warm_s": done["warm"]["first_s"],
                             "restored_s": restored["first_s"], "cold_s": done["cold"]["first_s"],
                             "cached_restored": restored["cached"],
                             "restored_answers_as_warm": restored["text"] == done["warm"]["text"]})
                print(rows[-1], flush=True)
        finally:
            server.kill()
    return rows


def stored_bytes(store: Path, length: int) -> dict:
    """The local save of the length's restored session: bytes over tokens, beside a plain bf16 KV cache's."""
    from emllm import shared_engine
    from emllm.persistence import read_metadata

    (folder,) = store.glob(f"*/restore-{length}")
    tokens = read_metadata(folder)["tokens"]
    shape = shared_engine(None, progress=False).shape
    plain = 2 * shape.num_layers * shape.num_kv_heads * shape.head_dim * 2  # K and V, bf16
    sizes = {path.name: path.stat().st_size for path in folder.rglob("*") if path.is_file()}
    return {"saved_tokens": tokens, "bytes_per_token": sum(sizes.values()) / tokens,
            "plain_bf16_bytes_per_token": plain, "files_bytes": sizes}


DESCRIBE = "Describe in detail everything the text says about the people in it."
"""batched_decoding.py's question: every answer runs to its token limit, so the turns decode for as long as the
in-process benchmark's (a fact question is answered in 13-20 tokens, and then the questions' reads and the saves
are most of a turn)."""


def concurrency(args: argparse.Namespace, model: str, count: object, logs: Path, store: str) -> dict:
    """N sessions' second turns, one after another and then all at once (different sessions, the same turns)."""
    server = Server(store, logs, args.model, args.preset)
    try:
        sessions: dict[str, list[list[dict]]] = {"alone": [], "together": []}
        for i in range(args.concurrent):
            one, question = conversation(2600, count, seed=100 + i)
            question = DESCRIBE if args.second_question == "describe" else question
            for mode, seconds in sessions.items():  # two sessions that read the same first turn
                seconds.append(second_turn(one, turn(server.url, model, one, f"{mode}-{i}")["text"], question))
            print(f"session {i}: its document read", flush=True)
        alone = [turn(server.url, model, two, f"alone-{i}", args.new_tokens)
                 for i, two in enumerate(sessions["alone"])]
        started = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(args.concurrent) as pool:
            together = list(pool.map(lambda item: turn(server.url, model, item[1], f"together-{item[0]}",
                                                       args.new_tokens), enumerate(sessions["together"])))
        wall = time.perf_counter() - started
    finally:
        server.kill()
    decoded = [sum(t["completion_tokens"] - 1 for t in turns) for turns in (alone, together)]
    alone_decode = decoded[0] / sum(t["last_at"] - t["first_at"] for t in alone)
    together_decode = decoded[1] / (max(t["last_at"] for t in together) - min(t["first_at"] for t in together))
    # Once every turn streams: content deltas after the last turn's first one, over the time to the last delta, as
    # batched_decoding.py times its conversations from their last prompt token (reads and forks left out); alone:
    # each turn's deltas after its first over its own span (deltas, not tokens, in both, so the ratio is like for like)
    all_streaming = max(t["first_at"] for t in together)
    streamed = sum(1 for t in together for at in t["arrivals"] if at > all_streaming)
    together_streaming = streamed / (max(t["last_at"] for t in together) - all_streaming)
    alone_streaming = sum(len(t["arrivals"]) - 1 for t in alone) / sum(t["last_at"] - t["first_at"] for t in alone)
    alone_rate = sum(t["completion_tokens"] for t in alone) / sum(t["total_s"] for t in alone)
    together_rate = sum(t["completion_tokens"] for t in together) / wall
    return {"sessions": args.concurrent, "alone_decode_tokens_per_s": alone_decode,
            "together_decode_tokens_per_s": together_decode, "decode_speedup": together_decode / alone_decode,
            "alone_tokens_per_s": alone_rate, "together_tokens_per_s": together_rate,
            "speedup": together_rate / alone_rate,
            "alone_deltas_per_s": alone_streaming, "all_streaming_deltas_per_s": together_streaming,
            "all_streaming_speedup": together_streaming / alone_streaming,
            "same_answers": sum(a["text"] == t["text"] for a, t in zip(alone, together, strict=True)),
            "second_question": args.second_question, "completion_tokens": [t["completion_tokens"] for t in together],
            "together_first_last_s": [(round(t["first_at"] - started, 2), round(t["last_at"] - started, 2))
                                      for t in together]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", nargs="*", type=parse_length, default=[8192, 32768],
                        help="returning-session lengths (none: only --concurrent)")
    parser.add_argument("--stores", nargs="+", choices=("local", "s3"), default=["local", "s3"])
    parser.add_argument("--concurrent", type=int, default=8, help="sessions at once (0: skip)")
    parser.add_argument("--new-tokens", type=int, default=32, help="tokens each concurrent second turn may write")
    parser.add_argument("--second-question", choices=("describe", "fact"), default="describe",
                        help="the concurrent second turns ask batched_decoding.py's question (answers run to "
                             "--new-tokens) or their document's second fact question (short answers)")
    parser.add_argument("--model", default=None)
    parser.add_argument("--preset", default="E")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/serve"))
    args = parser.parse_args()
    if "s3" in args.stores:
        try:
            import moto.server  # noqa: F401
            import s3fs  # noqa: F401
        except ImportError as error:
            parser.error(f"--stores s3 needs moto[server] and s3fs ({error}): pip install 'emllm-integrations[s3]' "
                         "'moto[server]', or pass --stores local")

    from emllm import shared_engine

    count = shared_engine(args.model, progress=False).count_tokens
    with tempfile.TemporaryDirectory(dir=os.environ.get("SERVE_STORE")) as scratch:
        logs = Path(scratch)
        rows, turns, concurrent_row = [], {}, None
        if args.lengths:
            rows, turns = first_turns(args, _model_name(args), count, logs, str(logs / "local"))
            if "s3" in args.stores:
                rows += s3_restores(args, _model_name(args), turns, logs)
        if args.concurrent:
            concurrent_row = concurrency(args, _model_name(args), count, logs, str(logs / "concurrent"))
            print(concurrent_row, flush=True)
    write_tables(args, rows, concurrent_row)


def _model_name(args: argparse.Namespace) -> str:
    from emllm import shared_engine

    return shared_engine(args.model, progress=False).model_name


def write_tables(args: argparse.Namespace, rows: list[dict], concurrent_row: dict | None) -> None:
    cpu = platform.processor() or platform.machine()
    lines = [f"`emllm serve` ({args.preset}; {cpu}, {os.cpu_count()} cores; one request each)", "",
             "| tokens | store | warm s | restored s | cold s | warm / cold | restored / cold | restored = warm |",
             "|---:|---|---:|---:|---:|---:|---:|---|"]
    for row in rows:
        lines.append(f"| {row['tokens']:,} | {row['store']} | {row['warm_s']:.2f} | {row['restored_s']:.2f} | "
                     f"{row['cold_s']:.2f} | {row['warm_s'] / row['cold_s']:.3f} | "
                     f"{row['restored_s'] / row['cold_s']:.3f} | {row['restored_answers_as_warm']} |")
    saved = [row for row in rows if "bytes_per_token" in row]
    if saved:
        lines += ["", "| tokens saved | bytes per token stored | plain bf16 KV per token | ratio |",
                  "|---:|---:|---:|---:|"]
        for row in saved:
            plain = row["plain_bf16_bytes_per_token"]
            lines.append(f"| {row['saved_tokens']:,} | {row['bytes_per_token']:,.0f} | {plain:,} | "
                         f"{row['bytes_per_token'] / plain:.2f} |")
    if concurrent_row:
        c = concurrent_row
        lines += ["", f"Second turns: the {c['second_question']} question, answers of "
                  f"{min(c['completion_tokens'])}-{max(c['completion_tokens'])} tokens.",
                  "", "| sessions | measured | one at a time, tokens/s | all at once, tokens/s | speedup | same |",
                  "|---:|---|---:|---:|---:|---:|",
                  f"| {c['sessions']} | decoding (first to last token streamed) | "
                  f"{c['alone_decode_tokens_per_s']:.2f} | {c['together_decode_tokens_per_s']:.2f} | "
                  f"{c['decode_speedup']:.2f}x | {c['same_answers']}/{c['sessions']} |",
                  f"| {c['sessions']} | decoding once all stream (deltas/s, from the last first delta) | "
                  f"{c['alone_deltas_per_s']:.2f} | {c['all_streaming_deltas_per_s']:.2f} | "
                  f"{c['all_streaming_speedup']:.2f}x | {c['same_answers']}/{c['sessions']} |",
                  f"| {c['sessions']} | whole turns (question read, saves included) | {c['alone_tokens_per_s']:.2f} | "
                  f"{c['together_tokens_per_s']:.2f} | {c['speedup']:.2f}x | {c['same_answers']}/{c['sessions']} |"]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "serve.json").write_text(json.dumps({"restores": rows, "concurrent": concurrent_row}, indent=1))
    (args.out / "serve.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
