"""LangChain's standard integration suite (``langchain_tests.integration_tests.ChatModelIntegrationTests``) against
ChatEMLLM on the real embedded Qwen2.5-Coder-0.5B-Instruct, the library default, whose chat template carries tools.

Capabilities are declared as they are: tool calling with tool_choice, structured output and JSON mode (all decoded
under a grammar, emllm.grammar); no image, audio or PDF input (the suite's flags default to False, so it skips those
tests, as it skips VCR). Usage metadata is returned, including ``cache_read`` input tokens: what a call reused from
an earlier call's memory. The model override switches to SmolLM2-135M's local model directory.
"""

from __future__ import annotations

from langchain_core.messages import AIMessage, HumanMessage
from langchain_tests.integration_tests import ChatModelIntegrationTests

from emllm.models import resolve_model_dir
from emllm_integrations.langchain import ChatEMLLM

from .conftest import SMOL

SMALL = dict(n_init=64, n_local=512, n_mem=512, chunk_size=256, max_block_size=64)



class TestChatEMLLMStandard(ChatModelIntegrationTests):
    @property
    def chat_model_class(self) -> type[ChatEMLLM]:
        return ChatEMLLM

    @property
    def chat_model_params(self) -> dict:
        # 64 tokens: a JSON joke or a tool call fits; the grammar refuses an answer cut before it is complete.
        return {**SMALL, "max_tokens": 64}

    @property
    def model_override_value(self) -> str:
        """A per-call ``model=`` switches to another model's shared engine: SmolLM2-135M by its local directory."""
        return str(resolve_model_dir(SMOL, progress=False))

    @property
    def has_tool_calling(self) -> bool:
        return True

    @property
    def has_tool_choice(self) -> bool:
        return True

    @property
    def has_structured_output(self) -> bool:
        return True

    @property
    def supports_json_mode(self) -> bool:
        return True

    @property
    def supports_anthropic_inputs(self) -> bool:
        """Anthropic-format histories: text blocks, tool_use blocks beside tool_calls, thinking blocks (dropped
        from earlier answers, as reasoning models' templates do); its image part runs only with image input."""
        return True

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
