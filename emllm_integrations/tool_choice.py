"""``tool_choice`` as LangChain and LlamaIndex users write it, turned into what the engine lists and enforces.

    auto (or None)         tools listed; the reply is text, calls, or both (calls valid for their tools)
    none                   tools not listed; a plain answer (earlier calls and results still render)
    any / required / True  at least one call, of any listed tool
    "name" / {"type": "function", "function": {"name": ...}} / {"name": ...}   a call of that tool
"""

from __future__ import annotations

from typing import Any

from emllm import EMEngine

_ANY = ("any", "required")


def chosen_tools(tools: list[dict[str, Any]], tool_choice: Any) -> tuple[list[dict[str, Any]], str]:
    """(tools the reply may call, mode): mode is "auto", "none" or "required". Checked when tools are bound,
    so a wrong name fails there rather than in the first call."""
    names = [tool["function"]["name"] for tool in tools]
    if tool_choice is None or tool_choice == "auto" or tool_choice is False:
        return tools, "auto"
    if tool_choice == "none":
        return [], "none"
    if tool_choice is True or tool_choice in _ANY:
        return tools, "required"
    name = tool_choice
    if isinstance(tool_choice, dict):
        name = (tool_choice.get("function") or {}).get("name") or tool_choice.get("name")
    if not isinstance(name, str):
        raise ValueError(f"tool_choice must be 'auto', 'none', 'any', 'required', a tool name or "
                         f"{{'type': 'function', 'function': {{'name': ...}}}}, got {tool_choice!r}.")
    if name not in names:
        raise ValueError(f"tool_choice names {name!r}, which is not among the bound tools {names}.")
    return [tools[names.index(name)]], "required"


def tool_decoding(engine: EMEngine, tools: list[dict[str, Any]], tool_choice: Any) -> dict[str, Any]:
    """Keyword arguments for MemoryPool.stream: the tools to list, the grammar the reply must follow, and no empty
    reply (measured: after two tool results Qwen2.5-Coder-1.5B ended its turn at once, leaving a LangGraph agent
    with an empty answer; a reply with tools is text or calls)."""
    callable_tools, mode = chosen_tools(tools, tool_choice)
    if mode == "none":
        return {"tools": None, "grammar": None}
    return {"tools": tools, "grammar": engine.tool_grammar(callable_tools, required=mode == "required"),
            "allow_empty": False}
