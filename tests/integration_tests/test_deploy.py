"""Deployments on the real SmolLM2-135M-Instruct: conversations decoding together through LangChain's batch get
the answers they get one at a time (their steps share forwards, emllm.batching), and a model named by its hub id
loads offline from a Hugging Face cache holding it (laid out from the embedded weights, tests/hub_cache.py)."""

from __future__ import annotations

import pytest
from langchain_core.messages import HumanMessage

from emllm import shared_engine
from emllm.models import resolve_model_dir
from emllm_integrations.bench.tasks import PASSKEY_QUESTION, passkey_document
from emllm_integrations.langchain import ChatEMLLM
from tests.hub_cache import add_snapshot

from .conftest import SMALL, SMOL

HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"  # SmolLM2's id on the hub (also an embedded alias)


def _conversations(engine, lengths):
    """A pass-key document per length (past the 512-token window, so each answer retrieves from its memory)."""
    out = []
    for i, tokens in enumerate(lengths):
        doc = passkey_document(tokens, 0.3, engine.count_tokens, seed=500 + i)
        out.append(([HumanMessage(doc.prompt[: -len(PASSKEY_QUESTION)] + "\n\nWhat is the pass key?")], doc.answer))
    return out


@pytest.mark.slow(seconds=60)
def test_langchain_batch_decodes_conversations_together_with_the_answers_they_get_alone():
    # Checkpoints for every conversation (3 each: before the question, after the prompt, after the answer), so the
    # batch starts decoding together instead of reading its prompts at different speeds first.
    llm = ChatEMLLM(model=SMOL, max_tokens=12, max_memories=9, **SMALL)
    engine = llm.engine()
    conversations = _conversations(engine, (900, 1400, 2100))  # three memories of different lengths
    alone = [llm.invoke(messages).content for messages, _ in conversations]
    engine.batcher.batch_sizes = []
    together = [m.content for m in llm.batch([messages for messages, _ in conversations])]
    assert together == alone
    assert sum(key in answer for (_, key), answer in zip(conversations, together)) >= 2, together
    if engine.row_block is None:
        pytest.skip("this CPU's matmul kernels give no batch-invariant row count, or padding to it costs several one-row "
                    "forwards (emllm.batching.padding_is_cheap), so each conversation decoded in "
                    "its own forward (the answers above still had to match)")
    assert max(engine.batcher.batch_sizes) > 1  # the conversations' steps shared forwards


@pytest.mark.slow(seconds=30)
def test_a_hub_id_loads_offline_from_the_hugging_face_cache(tmp_path, monkeypatch):
    from huggingface_hub import constants

    converted = resolve_model_dir(SMOL)  # the embedded weights, as a Hugging Face folder
    commit = add_snapshot(tmp_path, HUB_ID, converted, link_only=True)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    snapshot = tmp_path / "models--HuggingFaceTB--SmolLM2-135M-Instruct" / "snapshots" / commit
    assert resolve_model_dir(HUB_ID) == snapshot  # the hub's copy, not the embedded one, now that it is cached

    hub_llm = ChatEMLLM(model=HUB_ID, revision="main", max_tokens=8, **SMALL)
    hub_engine = hub_llm.engine()
    assert hub_engine is shared_engine(HUB_ID) and hub_engine.model.name_or_path == str(snapshot)
    question = [HumanMessage("What is the capital of France? Answer in one word.")]
    assert hub_llm.invoke(question).content == ChatEMLLM(model=SMOL, max_tokens=8, **SMALL).invoke(question).content

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "empty"))
    with pytest.warns(UserWarning, match="not in the Hugging Face cache .* using the embedded SmolLM2"):
        assert resolve_model_dir(HUB_ID) == converted
