"""`emllm serve --ray` measured: a returning session's first token with affinity against without.

    HF_HUB_OFFLINE=1 python benchmarks/serve_ray.py --lengths 8K 32K --out benchmarks/results/serve_ray

`emllm serve --ray --replicas 2` runs as a real process (its own local Ray cluster on 127.0.0.1), its sessions in a
bucket on moto's S3 server on 127.0.0.1 through s3fs. Per length, a document of real prose (the bench's fact QA
family) is read in a first turn, then:
  affinity   the session's second turn, routed by its session id to the replica that holds it (X-Replica-Id)
  without    the same second turn under another session id whose store entry is a copy of the first's: no
             replica holds it, so one restores it from the bucket, as every turn would that a router without
             affinity sent to another replica

Each figure is one streamed request on this machine (printed with its CPU); the table gives their ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from openai import OpenAI
from serve import conversation, free_port, s3_store, second_turn

from emllm_integrations.cli import parse_length


def start(url: str, env: dict[str, str], port: int, args: argparse.Namespace, log: Path) -> subprocess.Popen:
    command = [sys.executable, "-m", "emllm_integrations.cli", "serve", "--ray", "--replicas", str(args.replicas),
               "--preset", args.preset, "--host", "127.0.0.1", "--port", str(port), "--sessions", url,
               *(["--model", args.model] if args.model else [])]
    process = subprocess.Popen(command, env=dict(os.environ, HF_HUB_OFFLINE="1", **env),
                               stdout=log.open("w"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"emllm serve --ray exited: {log.read_text()[-3000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=2).status_code == 200:
                return process
        except httpx.HTTPError:
            pass
        time.sleep(2)
    process.terminate()
    raise RuntimeError("emllm serve --ray did not answer within 900 s")


def turn(base: str, model: str, messages: list[dict], session: str, max_tokens: int = 24) -> dict:
    """One streamed turn: seconds to the first content delta, the answer, the replica that served it."""
    client = OpenAI(base_url=f"{base}/v1", api_key="unused", timeout=3600, max_retries=0)
    started, first, text = time.perf_counter(), None, []
    with client.chat.completions.with_streaming_response.create(
            model=model, messages=messages, max_tokens=max_tokens, temperature=0, stream=True,
            extra_headers={"X-Session-Id": session}) as response:
        replica = response.headers.get("x-replica-id")
        for chunk in response.parse():
            if chunk.choices and chunk.choices[0].delta.content:
                first = first or time.perf_counter() - started
                text.append(chunk.choices[0].delta.content)
    return {"first_s": first or time.perf_counter() - started, "text": "".join(text), "replica": replica}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", nargs="+", type=parse_length, default=[8192, 32768])
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--model", default=None)
    parser.add_argument("--preset", default="E")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/serve_ray"))
    args = parser.parse_args()

    import s3fs

    from emllm import shared_engine

    engine = shared_engine(args.model, progress=False)
    count, model = engine.count_tokens, engine.model_name
    rows = []
    with s3_store() as (url, env), tempfile.TemporaryDirectory() as scratch:
        port = free_port()
        server = start(url, env, port, args, Path(scratch) / "server.log")
        base = f"http://127.0.0.1:{port}"
        bucket = s3fs.S3FileSystem(endpoint_url=env["AWS_ENDPOINT_URL"], key="bench", secret="bench")
        root = url.removeprefix("s3://")
        try:
            for length in args.lengths:
                one, question = conversation(length, count)
                first = turn(base, model, one, f"kept-{length}")
                two = second_turn(one, first["text"], question)
                bucket.copy(f"{root}/public/kept-{length}", f"{root}/public/copy-{length}", recursive=True)
                affinity = turn(base, model, two, f"kept-{length}")
                without = turn(base, model, two, f"copy-{length}")
                rows.append({"tokens": length, "first_replica": first["replica"],
                             "affinity_replica": affinity["replica"], "without_replica": without["replica"],
                             "affinity_s": affinity["first_s"], "without_s": without["first_s"],
                             "same_answer": affinity["text"] == without["text"]})
                print(rows[-1], flush=True)
        finally:
            server.terminate()
            server.wait(timeout=120)
    write(args, rows)


def write(args: argparse.Namespace, rows: list[dict]) -> None:
    cpu = platform.processor() or platform.machine()
    lines = [f"`emllm serve --ray --replicas {args.replicas}` ({args.preset}; {cpu}, {os.cpu_count()} cores; "
             "S3 on moto; one request each)", "",
             "| tokens | with affinity s | without (restored) s | with / without | routed to its replica | same |",
             "|---:|---:|---:|---:|---|---|"]
    for row in rows:
        lines.append(f"| {row['tokens']:,} | {row['affinity_s']:.2f} | {row['without_s']:.2f} | "
                     f"{row['affinity_s'] / row['without_s']:.3f} | "
                     f"{row['affinity_replica'] == row['first_replica']} | {row['same_answer']} |")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "serve_ray.json").write_text(json.dumps(rows, indent=1))
    (args.out / "serve_ray.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
