"""Time to first token of a returning conversation through `emllm serve`: warm, restored from the store, and cold.

    HF_HUB_OFFLINE=1 python benchmarks/serve.py --lengths 8K 32K --out benchmarks/results/serve

For each length a document of real prose (the bench's fact QA family) is asked about in two turns, streamed:
  warm      the session's second turn on the server that answered its first (its memory resident)
  restored  the same second turn of another session that had the same first turn, on a new server started on the
            same store after kill -9 of the first (its answer must be the warm one)
  cold      the same conversation (first turn, answer, second question) sent as a new session: all re-read
Each is one request; the figures are of this machine (printed with its CPU) and noisy, so the table gives ratios
measured in one run. The issue's goals: restored <= 0.1x cold and warm <= 0.02x cold at 32K.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from openai import OpenAI

from emllm_integrations.bench.ruler import family_document
from emllm_integrations.cli import parse_length


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def start(store: str, model: str | None, preset: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    command = [sys.executable, "-m", "emllm_integrations.cli", "serve", "--preset", preset, "--port", str(port),
               "--host", "127.0.0.1", "--sessions", store, *(["--model", model] if model else [])]
    log = open(Path(store) / f"server-{port}.log", "w")  # noqa: SIM115  (the server's whole life)
    process = subprocess.Popen(command, env=dict(os.environ, HF_HUB_OFFLINE="1"), stdout=log, stderr=log)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return process, url
        except httpx.HTTPError:
            time.sleep(1)
    process.kill()
    raise RuntimeError("the server did not start within 600 s")


def first_token(url: str, model: str, messages: list[dict], session: str) -> tuple[float, str, int]:
    """(seconds to the first content delta, the whole answer, the prompt tokens served from memory)."""
    client = OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=3600, max_retries=0)
    started, first, text, cached = time.perf_counter(), None, [], 0
    for chunk in client.chat.completions.create(model=model, messages=messages, max_tokens=24, temperature=0,
                                                stream=True, stream_options={"include_usage": True},
                                                extra_headers={"X-Session-Id": session}):
        if chunk.choices and chunk.choices[0].delta.content:
            first = first or time.perf_counter() - started
            text.append(chunk.choices[0].delta.content)
        if chunk.usage is not None:
            cached = chunk.usage.prompt_tokens_details.cached_tokens
    return first or time.perf_counter() - started, "".join(text), cached


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", nargs="+", type=parse_length, default=[8192, 32768])
    parser.add_argument("--model", default=None)
    parser.add_argument("--preset", default="E")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/serve"))
    args = parser.parse_args()

    rows = []
    with tempfile.TemporaryDirectory(dir=os.environ.get("SERVE_STORE")) as store:
        first, url = start(store, args.model, args.preset)
        model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
        from emllm import shared_engine

        count = shared_engine(args.model, progress=False).count_tokens
        second = None
        try:
            turns = {}
            for length in args.lengths:
                doc = family_document("fact_qa", length, count, questions=2, seed=0)
                one = [{"role": "user", "content": f"{doc.context}\n\n{doc.questions[0].question}"}]
                _, answer, _ = first_token(url, model, one, f"warm-{length}")
                first_token(url, model, one, f"restore-{length}")  # its second turn comes after the restart
                two = [*one, {"role": "assistant", "content": answer},
                       {"role": "user", "content": doc.questions[1].question}]
                warm = first_token(url, model, two, f"warm-{length}")
                cold = first_token(url, model, two, f"cold-{length}")
                turns[length] = (two, warm, cold)
                print(f"{length}: warm {warm[0]:.2f} s, cold {cold[0]:.2f} s", flush=True)
            first.send_signal(signal.SIGKILL)
            first.wait()
            second, url = start(store, args.model, args.preset)
            for length, (two, warm, cold) in turns.items():
                restored = first_token(url, model, two, f"restore-{length}")
                rows.append({"tokens": length, "warm_s": warm[0], "restored_s": restored[0], "cold_s": cold[0],
                             "cached_warm": warm[2], "cached_restored": restored[2], "cached_cold": cold[2],
                             "restored_answers_as_warm": warm[1] == restored[1]})
                print(rows[-1], flush=True)
        finally:
            for process in (first, second):
                if process is not None and process.poll() is None:
                    process.kill()
    cpu = platform.processor() or platform.machine()
    lines = [f"Time to first token of a second turn through `emllm serve` ({args.preset}, "
             f"{model}; {cpu}, {os.cpu_count()} cores; one request each)", "",
             "| tokens | warm s | restored s | cold s | warm / cold | restored / cold | restored = warm |",
             "|---:|---:|---:|---:|---:|---:|---|"]
    for row in rows:
        lines.append(f"| {row['tokens']:,} | {row['warm_s']:.2f} | {row['restored_s']:.2f} | {row['cold_s']:.2f} | "
                     f"{row['warm_s'] / row['cold_s']:.3f} | {row['restored_s'] / row['cold_s']:.3f} | "
                     f"{row['restored_answers_as_warm']} |")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "serve.json").write_text(json.dumps(rows, indent=1))
    (args.out / "serve.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
