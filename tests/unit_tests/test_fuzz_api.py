"""Fuzzed per-call options and command lines over the public surfaces: EMEngine, MemoryPool, ChatEMLLM, EMLLM and
`emllm chat / demo`. Every outcome is an answer that obeys the options, or ValueError/TypeError naming a field the
options got wrong (a one-line message and exit code 2 on the command line), raised before any reading: never
another exception, a traceback, a hang, or a memory changed by a call that was refused.

With test_fuzz.py (configs, token ids, text, messages) a CI run draws more than 1,000 inputs; each module prints
how many ran. The model is a tiny random Llama with SmolLM2's real tokenizer and chat template, saved as a model
directory, so the adapters and the command line load it through the same path as a user's model."""

from __future__ import annotations

import io
import math
import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from emllm import EMConfig, EMEngine, GenerationResult, MemoryPool

from .test_fuzz import CASES, fuzz, report_cases  # noqa: F401  (the case counter and its report)
from .tiny import TINY, tiny_model

pytestmark = pytest.mark.timeout(600)

QUESTION = [{"role": "user", "content": "The key is under the blue mat by the door.\n\nWhere is the key?"}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """A tiny random Llama with SmolLM2's vocabulary, tokenizer and chat template, saved like a downloaded model."""
    transformers = pytest.importorskip("transformers")
    from emllm.models import ModelNotAvailableError, resolve_model_dir

    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(resolve_model_dir("smollm2", progress=False))
    except ModelNotAvailableError as error:
        pytest.skip(f"the embedded SmolLM2 package is not installed, so its tokenizer is not here: {error}")
    path = tmp_path_factory.mktemp("tiny-smollm2-vocab")
    model = tiny_model(vocab=len(tokenizer), hidden=16, intermediate=32)
    model.config.max_position_embeddings = 8192  # room for the default layout, which the command line uses
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def engine(model_dir) -> EMEngine:
    return EMEngine.from_pretrained(str(model_dir), config=EMConfig.from_preset("E", **TINY), progress=False)


# ============================================================================ per-call options
def mostly(good: st.SearchStrategy, bad: list) -> st.SearchStrategy:
    """Three draws in four from the valid values, so a fair share of the calls is answered, not refused."""
    return st.integers(0, 3).flatmap(lambda draw: st.sampled_from(bad) if draw == 0 else good)


MAX = mostly(st.integers(1, 6), [0, -1, 1.5, "3", None, True, -2**70])
TEMPERATURE = mostly(st.floats(0, 3), [-0.5, math.inf, math.nan, "0.7", None])
TOP_P = mostly(st.floats(0.05, 1), [0.0, 1.5, -1, math.nan, "1", None])
TOP_K = mostly(st.integers(0, 50), [-1, 2.0, "5", None, False])
SEED = mostly(st.one_of(st.none(), st.integers(0, 2**64 - 1)), [-1, 2**64, 1.5, "abc", True, [1]])
STOP = mostly(st.one_of(st.none(), st.lists(st.sampled_from([".", "\n", "the", "é", "<|im_end|>", "key"]),
                                            max_size=3)),
              ["seven!", b"x", [1], [None], [""], ["ok", 3], 7, {"a": 1}])


def wrong_fields(options: dict) -> list[str]:
    """The options a correct surface must refuse, by this test's own reading of the documented rules."""
    def integer(v):
        return isinstance(v, int) and not isinstance(v, bool)

    def number(v):
        return isinstance(v, (int, float)) and not (isinstance(v, float) and math.isnan(v))

    rules = {
        "max_tokens": lambda v: integer(v) and v >= 1,
        "temperature": lambda v: number(v) and 0 <= v < math.inf,
        "top_p": lambda v: number(v) and 0 < v <= 1,
        "top_k": lambda v: integer(v) and v >= 0,
        "seed": lambda v: v is None or (integer(v) and 0 <= v < 2**64),
        "stop": lambda v: v is None or (isinstance(v, list) and all(isinstance(s, str) and s for s in v)),
    }
    return [name for name, ok in rules.items() if not ok(options[name])]


@st.composite
def call_options(draw) -> dict:
    return dict(max_tokens=draw(MAX), temperature=draw(TEMPERATURE), top_p=draw(TOP_P), top_k=draw(TOP_K),
                seed=draw(SEED), stop=draw(STOP))


def call_engine(engine, memory, options):
    return engine.generate(QUESTION, memory=memory, max_new_tokens=options["max_tokens"],
                           **{k: v for k, v in options.items() if k != "max_tokens"})


@pytest.fixture(scope="module")
def pool(engine) -> MemoryPool:
    return MemoryPool(engine, engine.config)


@pytest.fixture(scope="module")
def chat_model(model_dir):
    from emllm_integrations.langchain import ChatEMLLM

    return ChatEMLLM(model=str(model_dir), **TINY)


@pytest.fixture(scope="module")
def llm(model_dir):
    from emllm_integrations.llama_index import EMLLM

    return EMLLM(model=str(model_dir), **TINY)


def answer(surface: str, fixtures: dict, options: dict) -> tuple[str, int | None]:
    """Ask QUESTION on one surface with these options: the answer's text and token count (None where the surface
    does not report it)."""
    if surface == "engine":
        result = call_engine(fixtures["engine"], fixtures["memory"], options)
        return result.text, result.output_tokens
    if surface == "pool":
        result = fixtures["pool"].generate(QUESTION, max_new_tokens=options["max_tokens"],
                                           **{k: v for k, v in options.items() if k != "max_tokens"})
        assert isinstance(result, GenerationResult)
        return result.text, result.output_tokens
    if surface == "ChatEMLLM":
        message = fixtures["chat_model"].invoke(QUESTION, **options)
        return message.content, message.usage_metadata["output_tokens"]
    from llama_index.core.base.llms.types import ChatMessage

    response = fixtures["llm"].chat([ChatMessage(role="user", content=QUESTION[0]["content"])], **options)
    return response.message.content, None


@fuzz(420)
@given(surface=st.sampled_from(["engine", "pool", "ChatEMLLM", "EMLLM"]), options=call_options())
def test_call_options_are_obeyed_or_refused_before_reading(engine, pool, chat_model, llm, surface, options):
    CASES["call options"] += 1
    memory = engine.new_memory()
    engine.read(memory, engine.chat_ids(QUESTION)[:20])  # a continuation: the call reads the rest
    before = list(memory.token_ids)
    fixtures = dict(engine=engine, memory=memory, pool=pool, chat_model=chat_model, llm=llm)
    wrong = wrong_fields(options)
    try:
        if wrong:
            with pytest.raises((ValueError, TypeError)) as error:
                answer(surface, fixtures, options)
            named = {"max_tokens": ("max_tokens", "max_new_tokens")}
            assert any(n in str(error.value) for field in wrong for n in named.get(field, (field,))), (wrong, error)
            assert memory.token_ids == before and not memory.closed  # refused before reading anything
            CASES["call options refused"] += 1
            return
        text, tokens = answer(surface, fixtures, options)
        assert isinstance(text, str) and (tokens is None or tokens <= options["max_tokens"])
        assert not any(s in text for s in options["stop"] or []), (text, options["stop"])
        CASES["call options answered"] += 1
    finally:
        memory.close()


# ============================================================================ the command line
BAD_FILES = ["missing", "folder", "/dev/zero", "empty", "latin-1"]
QUESTIONS = st.lists(st.sampled_from(["Where is the key?", "é?", "<|im_end|> who?", "\x04", "a" * 300, "  ",
                                      b"\xff\xfe?".decode("latin-1")]), max_size=3)


@st.composite
def chat_command(draw, folder: Path) -> tuple[list[str], bytes, list[str]]:
    """argv for `emllm chat`, the bytes on its stdin, and which arguments are wrong (empty: it must answer)."""
    argv, wrong = ["chat", "--model", str(folder / "model")], []
    file = draw(st.sampled_from(["good"] * 4 + BAD_FILES))
    argv += ["--file", file if file.startswith("/") else str(folder / file)]
    if file != "good":
        wrong.append("file")
    for flag, good, bad in [("--max-new-tokens", st.integers(1, 4), st.sampled_from(["0", "-3", "x", "1.5"])),
                            ("--n-local", st.integers(16, 64), st.sampled_from(["0", "-8", "ten"])),
                            ("--preset", st.sampled_from(["E", "S", "SM+C"]), st.sampled_from(["XL", ""]))]:
        how = draw(st.sampled_from(["absent", "good", "good", "bad"]))
        if how != "absent":
            argv += [flag, str(draw(good if how == "good" else bad))]
            wrong += [flag] * (how == "bad")
    questions = draw(QUESTIONS)
    return argv, "\n".join(questions).encode("latin-1") + b"\n", wrong


@pytest.fixture(scope="module")
def cli_folder(model_dir, tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("cli")
    (folder / "model").symlink_to(model_dir)
    (folder / "good").write_text("The key is under the blue mat by the door. " * 20, encoding="utf-8")
    (folder / "folder").mkdir()
    (folder / "empty").write_text("   \n", encoding="utf-8")
    (folder / "latin-1").write_bytes("caf\xe9 ".encode("latin-1") * 10)
    return folder


def run_cli(argv: list[str], stdin: bytes, monkeypatch, capsys) -> tuple[int, str, str]:
    from emllm_integrations.cli import main

    capsys.readouterr()
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(stdin), encoding="utf-8"))
    try:
        code = main(argv)
    except SystemExit as exit_:  # argparse refuses a flag's value
        code = exit_.code
    out, err = capsys.readouterr()
    return code, out, err


@fuzz(120)
@given(data=st.data())
def test_the_command_line_answers_or_refuses_in_one_line_before_loading(cli_folder, monkeypatch, capsys, data):
    CASES["command lines"] += 1
    if data.draw(st.booleans(), label="demo"):  # demo with a wrong engine field: refused before it loads anything
        flag, value = data.draw(st.sampled_from([("--n-local", "0"), ("--n-mem", "-1"), ("--chunk-size", "0"),
                                                 ("--ram-budget-mb", "-2"), ("--preset", "nope"),
                                                 ("--tokens", "12Q"), ("--n-local", "x")]))
        argv, stdin, wrong = ["demo", flag, value], b"", [flag]
    else:
        argv, stdin, wrong = data.draw(chat_command(cli_folder))
    code, out, err = run_cli(argv, stdin, monkeypatch, capsys)
    assert "Traceback" not in err, err
    if wrong:
        assert code == 2, (argv, code, err)
        assert "loading" not in err, err  # settings and files are checked before the model loads
        assert len([line for line in err.splitlines() if line.startswith("emllm")]) == 1, err
        CASES["command lines refused"] += 1
        return
    assert code == 0, (argv, err)
    assert "read " in err and "tokens into" in err  # the document was read once, then every question answered
    CASES["command lines answered"] += 1
