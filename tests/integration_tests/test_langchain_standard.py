"""LangChain's standard integration suite (``langchain_tests.integration_tests.ChatModelIntegrationTests``) against
ChatEMLLM on the real embedded SmolLM2-135M-Instruct (named in ``chat_model_params``: the library default is the
larger Qwen2.5-Coder-0.5B-Instruct).

Capabilities are declared honestly: no tool calling, structured output, JSON mode or image/audio/PDF input (the
suite reads these from ChatEMLLM itself and from the flags below and skips those tests on its own). Usage metadata
is returned, including ``cache_read`` input tokens: what a call reused from an earlier call's memory.
"""

from __future__ import annotations

import pytest
import torch
from langchain_core.messages import AIMessage, HumanMessage
from langchain_tests.integration_tests import ChatModelIntegrationTests

from emllm.models import is_embedded_available
from emllm_integrations.langchain import ChatEMLLM

from .conftest import SMOL

SMALL = dict(n_init=64, n_local=512, n_mem=512, chunk_size=256, max_block_size=64)
OTHER_MODEL = "qwen2.5-coder-0.5b-instruct"


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread():
    """The suite's calls are short prompts and ~20 decoded tokens, i.e. tiny matrix-vector products. Measured on
    this shared 2-core machine under load (load average 7): one answer took 42 s with 2 intra-op threads and 3.7 s
    with 1, as threads spin waiting for each other. One thread keeps the suite to minutes; answers are unchanged."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


class TestChatEMLLMStandard(ChatModelIntegrationTests):
    @property
    def chat_model_class(self) -> type[ChatEMLLM]:
        return ChatEMLLM

    @property
    def chat_model_params(self) -> dict:
        return {"model": SMOL, **SMALL, "max_tokens": 24}

    @property
    def model_override_value(self) -> str | None:
        """A per-call ``model=`` switches to another model's shared engine: Qwen2.5-Coder-0.5B-Instruct (the library
        default, not the SmolLM2 of ``chat_model_params``), when its packages are installed (otherwise the suite
        skips the override tests, saying why)."""
        return OTHER_MODEL if is_embedded_available(OTHER_MODEL) else None

    @property
    def has_tool_calling(self) -> bool:
        return False  # bind_tools is overridden only to say so plainly

    @property
    def has_structured_output(self) -> bool:
        return False

    @property
    def supported_usage_metadata_details(self) -> dict:
        return {"invoke": ["cache_read_input"], "stream": ["cache_read_input"]}

    def invoke_with_cache_read_input(self, *, stream: bool = False) -> AIMessage:
        """A follow-up turn: its prompt extends the first call's prompt, so the first call's tokens are reused."""
        llm = ChatEMLLM(**self.chat_model_params)
        first = [HumanMessage("Name a colour of the sky.")]
        answer = llm.invoke(first)
        follow_up = [*first, AIMessage(answer.text), HumanMessage("And of grass?")]
        if not stream:
            return llm.invoke(follow_up)
        full = None
        for chunk in llm.stream(follow_up):
            full = chunk if full is None else full + chunk
        return full
