"""Grammar-constrained decoding libraries on this CPU: setup time, schema compile time, mask time per token and
which JSON-schema keywords each enforces, on the default model's tokenizer (Qwen2.5, 151,936 logits).

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/constrained_decoding.py

The candidates not among our dependencies (xgrammar, outlines-core, lm-format-enforcer) are measured when
installed (``pip install xgrammar==0.2.8 outlines-core==0.2.14 lm-format-enforcer``) and reported otherwise.
A keyword counts as enforced when a value breaking it is refused token by token; "accepted silently" means the
library compiled the schema and let the breaking value through.
"""

from __future__ import annotations

import json
import time

import torch
from transformers import AutoTokenizer

from emllm.models import resolve_model_dir

VOCAB = 151936
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                           "tags": {"type": "array", "items": {"enum": ["a", "b"]}}},
          "required": ["name", "age", "tags"], "additionalProperties": False}
VALID = '{"name": "Ada", "age": 36, "tags": ["a", "b"]}'
# keyword -> (schema, a value that breaks it)
KEYWORDS = {"not": ({"not": {"type": "string"}}, '"x"'),
            "pattern": ({"type": "string", "pattern": "^[0-9]+$"}, '"x"'),
            "minimum": ({"type": "integer", "minimum": 5}, "3"),
            "maxLength": ({"type": "string", "maxLength": 2}, '"xyz"'),
            "anyOf": ({"anyOf": [{"type": "integer"}, {"type": "boolean"}]}, '"x"'),
            "const": ({"const": "yes"}, '"no"')}


def llguidance_case(tokenizer) -> dict:
    import llguidance.hf
    import llguidance.torch as lt
    from llguidance import LLMatcher

    started = time.perf_counter()
    ll = llguidance.hf.from_tokenizer(tokenizer, n_vocab=VOCAB)
    setup = time.perf_counter() - started
    started = time.perf_counter()
    matcher = LLMatcher(ll, LLMatcher.grammar_from_json_schema(SCHEMA))
    compile_s = time.perf_counter() - started
    mask = lt.allocate_token_bitmask(1, VOCAB)
    ids = tokenizer(VALID, add_special_tokens=False)["input_ids"]
    started = time.perf_counter()
    for token in ids:
        lt.fill_next_token_bitmask(matcher, mask, 0)
        matcher.consume_token(token)
    per_token = (time.perf_counter() - started) / len(ids)
    keywords = {}
    for name, (schema, bad) in KEYWORDS.items():
        grammar = LLMatcher.grammar_from_json_schema(schema)
        error = LLMatcher.validate_grammar(grammar, ll)
        if error:
            keywords[name] = "refused: " + error.strip().splitlines()[0][:60]
            continue
        m = LLMatcher(ll, grammar)
        ok = m.consume_tokens(tokenizer(bad, add_special_tokens=False)["input_ids"]) and m.is_accepting()
        keywords[name] = "accepted silently" if ok else "enforced"
    return {"setup_s": setup, "compile_ms": 1000 * compile_s, "mask_ms_per_token": 1000 * per_token,
            "keywords": keywords}


def xgrammar_case(tokenizer) -> dict:
    import xgrammar as xgr

    started = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=VOCAB)
    compiler = xgr.GrammarCompiler(info)
    setup = time.perf_counter() - started
    started = time.perf_counter()
    compiled = compiler.compile_json_schema(json.dumps(SCHEMA))
    compile_s = time.perf_counter() - started
    matcher = xgr.GrammarMatcher(compiled)
    mask = xgr.allocate_token_bitmask(1, VOCAB)
    ids = tokenizer(VALID, add_special_tokens=False)["input_ids"]
    started = time.perf_counter()
    for token in ids:
        matcher.fill_next_token_bitmask(mask)
        matcher.accept_token(token)
    per_token = (time.perf_counter() - started) / len(ids)
    keywords = {}
    for name, (schema, bad) in KEYWORDS.items():
        try:
            m = xgr.GrammarMatcher(compiler.compile_json_schema(json.dumps(schema)))
        except Exception as error:  # noqa: BLE001 - a refusal is the result
            keywords[name] = "refused: " + str(error).splitlines()[0][:60]
            continue
        ok = all(m.accept_token(t) for t in tokenizer(bad, add_special_tokens=False)["input_ids"])
        keywords[name] = "accepted silently" if ok else "enforced"
    return {"setup_s": setup, "compile_ms": 1000 * compile_s, "mask_ms_per_token": 1000 * per_token,
            "keywords": keywords}


def import_only(module: str, note: str) -> dict:
    __import__(module)
    return {"note": note}


def main() -> None:
    torch.set_num_threads(2)
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_dir(None, progress=False))
    cases = {"llguidance": lambda: llguidance_case(tokenizer), "xgrammar": lambda: xgrammar_case(tokenizer),
             "outlines-core": lambda: import_only("outlines_core", "imports; its Vocabulary needs each token's decoded "
                                                   "bytes mapped by hand (no tokenizer integration): not measured"),
             "lm-format-enforcer": lambda: import_only("lmformatenforcer.integrations.transformers", "")}
    for name, case in cases.items():
        try:
            result = case()
        except Exception as error:  # noqa: BLE001 - a library that fails to import or run is a finding
            result = {"error": f"{type(error).__name__}: {str(error).splitlines()[0][:100]}"}
        print(json.dumps({"library": name, **result}))


if __name__ == "__main__":
    main()
