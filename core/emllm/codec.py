"""Prompts to token ids: one render of a conversation gives its ids, its question's start and its pinned spans.

    codec = PromptCodec(tokenizer)
    prompt = codec.encode(messages, tools)     # EncodedPrompt(ids, question_start, pinned)

Text is text: a control-token string inside a document, a question or a message ("<|im_end|>", "<|im_start|>system")
is read as those characters, never as the control token, so no input can forge a chat turn. Control tokens come only
from the chat template, where it puts them, or from token ids the caller passes.

Why one render: the engine needs three facts of a conversation (its ids, where its question begins, where its tool
listing ends), and each used to be a render of its own (the whole conversation, all turns but the last, the system
turn with the tools), each regex-scanning every message. Here every message's content is wrapped in a marker
character the contents do not hold, the template is rendered once, and the markers' places give where each message
lies; removing them gives exactly the text the template writes. A template that changes message text (the markers then
do not come back around the contents) is rendered once more without them, and only its control-string handling and
its turn positions are then unknown.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple, Union

import torch

from .lossless import LosslessCheck
from .tools import plain_tool_messages, template_carries_tools

Message = dict[str, Any]  # {'role', 'content'}, and 'tool_calls' / 'tool_call_id' for tools
Prompt = Union[str, Sequence[Message], Sequence[int], "EncodedPrompt"]  # EncodedPrompt: PromptCodec.encode()'s result
Span = tuple[int, int]

_MESSAGE_KEYS = ("role", "content", "tool_calls", "tool_call_id")  # other keys are not passed to the template
_MARKERS = [chr(c) for c in range(0xE000, 0xE100)]  # private-use characters: one a contents do not hold wraps them


class Rendered(NamedTuple):
    """A prompt as text, tiled by character spans (start, end, is_user_text): user text is tokenised as text,
    the chat template's own spans with its control tokens. ``turns`` holds, per message, the character where its turn
    begins (its role header) and ``contents`` where its content begins, each None where the render does not tell;
    ``roles`` are the messages' roles as rendered (tools listed in a system turn of their own where the template does
    not list them)."""
    text: str
    pieces: tuple[tuple[int, int, bool], ...]
    turns: tuple[int | None, ...] = ()
    contents: tuple[int | None, ...] = ()
    roles: tuple[str, ...] = ()

    @classmethod
    def user_text(cls, text: str) -> Rendered:
        return cls(text, ((0, len(text), True),))


class EncodedPrompt(NamedTuple):
    """A prompt tokenised once (PromptCodec.encode), accepted wherever a prompt is: a document of a million tokens is
    then not tokenised again for its question (the tokenizer's transient there is ~420 MB)."""
    ids: list[int]
    question_start: int | None  # token index where the prompt's last paragraph begins; None: ids, or no paragraphs
    pinned: tuple[Span, ...] = ()  # token spans kept in every layer's attention (the tool listing)

    @property
    def tool_listing_end(self) -> int | None:
        """How many of the first tokens list the tools (the first pinned span's end), or None without tools."""
        return self.pinned[0][1] if self.pinned and self.pinned[0][0] == 0 else None

    def checked(self) -> EncodedPrompt:
        if not isinstance(self.ids, list) or not self.ids or not all(isinstance(i, int) for i in self.ids):
            raise TypeError("An EncodedPrompt's ids are a non-empty list of token ids: make it with "
                            "EMEngine.encode_prompt(prompt).")
        if self.question_start is not None and not 0 < self.question_start < len(self.ids):
            raise ValueError(f"An EncodedPrompt's question_start ({self.question_start}) must fall inside its "
                             f"{len(self.ids)} ids, or be None: make it with EMEngine.encode_prompt(prompt).")
        if any(not 0 <= start < end <= len(self.ids) for start, end in self.pinned):
            raise ValueError(f"An EncodedPrompt's pinned spans {self.pinned} must lie inside its {len(self.ids)} ids: "
                             "make it with EMEngine.encode_prompt(prompt).")
        return self


class PromptCodec:
    """Text, chats and token ids of one tokenizer to token ids; counts its template renders (``renders``)."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.renders = 0  # calls of the chat template, probes included (a test holds a call to one render)
        self._lossless = LosslessCheck(tokenizer)
        self._template: Any = object()             # the chat template what follows was made for (none yet)
        self._controls = re.compile("(?!)")        # finds control strings in a message
        self._unsplit: re.Pattern | None = None    # finds those the tokenizer matches even in text
        self._trims: bool | None = None            # whether the template strips message text (probed once)
        self._headers: dict[str, str | None] = {}  # a turn's text before its content, per role (probed once each)
        self._sync()

    def _sync(self) -> None:
        """Made again whenever the tokenizer's chat template is not the one they were made for (one set after
        loading): the control strings (the template's added tokens among them) and the two probes."""
        template = getattr(self.tokenizer, "chat_template", None)
        if template is self._template:
            return
        self._template, self._trims, self._headers = template, None, {}
        strings = sorted(control_strings(self.tokenizer), key=len, reverse=True)  # the longest match wins
        self._controls = re.compile("|".join(map(re.escape, strings)) or "(?!)")
        # Control strings the tokenizer matches even with split_special_tokens (its non-special added tokens, such as
        # Qwen's <tool_call>): in user text each occurrence is cut before its last character and tokenised in pieces.
        unsplit = sorted(set(strings) - set(special_strings(self.tokenizer)), key=len, reverse=True)
        self._unsplit = re.compile("|".join(map(re.escape, unsplit))) if unsplit else None

    # ------------------------------------------------------------------ text
    def tokenize(self, text: str) -> list[int]:
        check_text(text)
        return self.refuse_lost_text(text, self.text_ids(text))

    def text_ids(self, text: str) -> list[int]:
        """The text's token ids, control-token strings kept as text, without tokenize()'s checks (for counting)."""
        return [i for piece in self._text_pieces(text) for i in self._piece_ids(piece)]

    def tokenize_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """tokenize() plus each token's character span in the text (needs a fast tokenizer), for mapping
        retrieved tokens back to the documents they came from."""
        check_text(text)
        ids: list[int] = []
        offsets: list[tuple[int, int]] = []
        start = 0
        for piece in self._text_pieces(text):
            encoded = self.tokenizer(piece, add_special_tokens=False, split_special_tokens=True,
                                     return_offsets_mapping=True)
            ids.extend(encoded["input_ids"])
            offsets.extend((start + int(lo), start + int(hi)) for lo, hi in encoded["offset_mapping"])
            start += len(piece)
        return self.refuse_lost_text(text, ids), offsets

    def _text_pieces(self, text: str) -> list[str]:
        """The text, cut inside every control string the tokenizer would match even as text (before its last
        character), so no piece holds one; the whole text where it has none (the usual case: one piece)."""
        self._sync()
        if self._unsplit is None:
            return [text]
        cuts = [match.end() - 1 for match in self._unsplit.finditer(text)]
        return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)]) if b > a]

    def _piece_ids(self, piece: str) -> list[int]:
        return list(self.tokenizer(piece, add_special_tokens=False, split_special_tokens=True)["input_ids"])

    def template_ids(self, text: str) -> list[int]:
        """Ids of text a chat template wrote (its control-token strings become control tokens); never user text."""
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def refuse_lost_text(self, text: str, ids: list[int]) -> list[int]:
        """The ids, if they represent the text; else a ValueError naming the characters the tokenizer lacks."""
        if not ids:  # a tokenizer without a token for these characters drops them
            raise ValueError(f"The text {text[:40]!r} gives no tokens: this model's tokenizer cannot represent its "
                             "characters. Remove or replace them.")
        self._lossless.check(text, ids)
        return ids

    # ------------------------------------------------------------------ chats
    def apply_template(self, messages: list[Message], add_generation_prompt: bool,
                       tools: list[dict] | None = None) -> str:
        """The chat template's text for messages as given (counted in ``renders``)."""
        self.renders += 1
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                  tokenize=False, **({"tools": tools} if tools else {}))

    def render(self, messages: list[Message], add_generation_prompt: bool, tools: list[dict] | None = None
               ) -> Rendered:
        """The conversation as text, which of its characters are the messages' (tokenised as text) and which the
        template's (whose control-token strings are control tokens), and where each turn begins: one render."""
        uses_tools = tools or any(m["role"] == "tool" or m.get("tool_calls") for m in messages)
        if uses_tools and not template_carries_tools(self.tokenizer):
            messages, tools = plain_tool_messages(messages, tools), None
        self._sync()
        if self._template is None:
            return plain_render(messages, add_generation_prompt)  # "role: content" lines, no control tokens at all
        # Render the turns as given (so a longer conversation extends a shorter one token for token); only a
        # template that rejects them (consecutive same-role turns, a system turn) gets them merged.
        try:
            return self._render_marked(messages, add_generation_prompt, tools)
        except Exception:  # jinja2 raises TemplateError subclasses via the template's raise_exception
            return self._render_marked(normalize_messages(fold_system(messages)), add_generation_prompt, tools)

    def _render_marked(self, messages: list[Message], add_generation_prompt: bool,
                       tools: list[dict] | None) -> Rendered:
        """One render with every non-empty content wrapped in a marker; see the module's docstring."""
        contents = [m["content"].strip() if self.trims() else m["content"] for m in messages]
        marker = next((c for c in _MARKERS if not any(c in text for text in contents)), None)
        marked = [bool(text) and marker is not None for text in contents]
        wrapped = [{**m, "content": f"{marker}{text}{marker}"} if mark else m
                   for m, text, mark in zip(messages, contents, marked)]
        parts = self.apply_template(wrapped, add_generation_prompt, tools).split(marker) if marker else []
        expected = [text for text, mark in zip(contents, marked) if mark]
        if len(parts) != 2 * len(expected) + 1 or parts[1::2] != expected:  # the template changed message text
            return self._unmarked(messages, add_generation_prompt, tools)
        text = "".join(parts)
        ends = list(itertools.accumulate(len(part) for part in parts))
        content_starts = iter(ends[0::2])
        starts = [next(content_starts) if mark else None for mark in marked]
        forged = any(self._controls.search(text_) for text_ in expected)
        pieces = (tuple((end - len(part), end, bool(k % 2)) for k, (part, end) in enumerate(zip(parts, ends)) if part)
                  if forged else ((0, len(text), False),))  # the usual case: every control string is the template's
        turns = [self._turn_start(text, m["role"], start) if k else None
                 for k, (m, start) in enumerate(zip(messages, starts))]
        return Rendered(text, pieces, tuple(turns), tuple(starts), tuple(m["role"] for m in messages))

    def _unmarked(self, messages: list[Message], add_generation_prompt: bool, tools: list[dict] | None) -> Rendered:
        """A template that changes message text: its text, with turns unknown; a control string in a message can then
        not be told from the template's, so it is refused."""
        forged = next((match.group() for m in messages if (match := self._controls.search(m["content"]))), None)
        if forged is not None:
            raise ValueError(f"A message holds {forged!r}, a control token of this model, and this model's chat "
                             "template changes message text, so it cannot be kept as text: remove it from the message.")
        text = self.apply_template(messages, add_generation_prompt, tools)
        unknown = (None,) * len(messages)
        return Rendered(text, ((0, len(text), False),), unknown, unknown, tuple(m["role"] for m in messages))

    def _turn_start(self, text: str, role: str, content_start: int | None) -> int | None:
        """Where the turn whose content begins at content_start begins: before its role header, if the text there is
        the header this template writes for the role."""
        header = self.turn_header(role)
        if content_start is None or header is None:
            return None
        begin = content_start - len(header)
        return begin if begin >= 0 and text.startswith(header, begin) else None

    def trims(self) -> bool:
        """Whether the template strips the whitespace around message text (probed with one render, once)."""
        if self._trims is None:
            probe = " \ue000 "
            try:
                self._trims = probe not in self.apply_template([{"role": "user", "content": probe}], False)
            except Exception:
                self._trims = False
        return self._trims

    def turn_header(self, role: str) -> str | None:
        """The text this template writes before the content of a ``role`` turn that follows another turn (e.g.
        "<|im_start|>user\\n"), probed once per role; None where the probe's template refuses or merges turns."""
        if role not in self._headers:
            call = {"type": "function", "function": {"name": "f", "arguments": {}}}
            openings: dict[str, list[Message]] = {
                "user": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}],
                "tool": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "", "tool_calls": [call]}],
            }
            before = openings.get(role, [{"role": "user", "content": "a"}])
            marker = "\ue000"
            try:
                first = self.render_plain(before)
                both = self.render_plain([*before, {"role": role, "content": marker}])
                header = both[len(first):both.index(marker)] if both.startswith(first) and marker in both else None
            except Exception:
                header = None
            self._headers[role] = header
        return self._headers[role]

    def render_plain(self, messages: list[Message]) -> str:
        """The template's text for messages, no generation prompt, tool messages as render() gives them."""
        if any(m["role"] == "tool" or m.get("tool_calls") for m in messages) and \
                not template_carries_tools(self.tokenizer):
            messages = plain_tool_messages(messages, None)
        return self.apply_template(messages, False)

    def ids(self, rendered: Rendered, start: int = 0) -> list[int]:
        """Token ids of rendered.text[start:], each span tokenised as what it is (checked to lose nothing)."""
        if start == 0:
            check_text(rendered.text)
        ids = [i for lo, hi, own in rendered.pieces if hi > start
               for i in (self.text_ids if own else self.template_ids)(rendered.text[max(lo, start):hi])]
        return self.refuse_lost_text(rendered.text[start:], ids) if start == 0 else ids

    def chat_ids(self, messages: Sequence[Message], add_generation_prompt: bool = True,
                 tools: list[dict] | None = None) -> list[int]:
        """Token ids of a conversation in the model's chat template, with ``tools`` (OpenAI function dicts) listed as
        the template lists them, or by tools.TOOL_PROMPT."""
        return self.ids(self.render(normalize_messages(messages, merge=False), add_generation_prompt, tools))

    # ------------------------------------------------------------------ prompts
    def prompt_ids(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenize(prompt)
        if isinstance(prompt, EncodedPrompt):
            return list(prompt.checked().ids)
        refuse_bytes(prompt)
        if isinstance(prompt, dict) or not isinstance(prompt, Iterable):
            raise TypeError("A prompt is a string, a list of {'role', 'content'} messages, or a list of token ids; "
                            f"got {type(prompt).__name__}.")
        items: list[Any] = list(prompt)
        if not items:
            raise ValueError("The prompt is empty: pass text, a non-empty list of messages, or token ids.")
        if all(isinstance(p, int) for p in items):
            return items
        if all(isinstance(p, dict) for p in items):
            return self.chat_ids(items)
        raise TypeError("A prompt is a string, a list of {'role', 'content'} messages, or a list of token ids; "
                        f"got a list of {sorted({type(p).__name__ for p in items})}.")

    def encode(self, prompt: Prompt, tools: list[dict] | None = None) -> EncodedPrompt:
        """The prompt's ids, where its question starts and its pinned spans, from one render.

        The question is the prompt's last paragraph: the text after its last blank line, or the last message's turn
        if that starts later; the engine reads it in forwards of its own. Token ids carry no paragraphs: their
        question_start is None. With tools, the tokens that list them are pinned (kept in attention: evicted like
        any text, a long conversation's tool list would be retrieved only when a question resembles it; measured:
        with a 512-token window Qwen2.5-Coder-1.5B answered a tool task in prose, calling nothing). An EncodedPrompt
        is returned as it is (checked); with tools, it must be one encoded with tools (its listing pinned)."""
        if isinstance(prompt, EncodedPrompt):
            if tools and prompt.tool_listing_end is None:
                raise ValueError("This EncodedPrompt lists no tools: encode the messages with the same tools "
                                 "(EMEngine.encode_prompt(messages, tools)), or pass the messages themselves.")
            return prompt.checked()
        if isinstance(prompt, str):
            ids = self.tokenize(prompt)
            return EncodedPrompt(ids, self.token_at(Rendered.user_text(prompt), ids, last_paragraph(prompt, 0)))
        items: Any = prompt
        if isinstance(prompt, Iterable) and not isinstance(prompt, (bytes, bytearray, dict)):
            items = list(prompt)  # a generator is walked once, here
        if not (isinstance(items, list) and items and all(isinstance(p, dict) for p in items)):
            if tools:
                raise ValueError("Tools are listed in a chat: pass the prompt as a list of messages, not text or ids.")
            return EncodedPrompt(self.prompt_ids(items), None)  # token ids, or refused there with the reason
        rendered = self.render(normalize_messages(items, merge=False), True, tools)
        ids = self.ids(rendered)
        last_turn = rendered.turns[-1] if rendered.turns and rendered.turns[-1] is not None else 0
        question_start = self.token_at(rendered, ids, last_paragraph(rendered.text, last_turn))
        listing = self.tool_listing_end(rendered) if tools else None
        return EncodedPrompt(ids, question_start, ((0, listing),) if listing else ())

    def tool_listing_end(self, rendered: Rendered) -> int | None:
        """How many of the first tokens list the tools: those before the first message after the opening system turn
        (less one: the text before a content can share a token with it), or None where the render does not tell."""
        first = 1 if rendered.roles[:1] == ("system",) else 0
        starts = rendered.contents
        if first >= len(starts) or starts[first] is None:
            return None
        return max(len(self.template_ids(rendered.text[:starts[first]])) - 1, 0) or None

    def token_at(self, rendered: Rendered, ids: list[int], char: int) -> int | None:
        """The index of the token where the text from char on begins (None at the very start: nothing to split
        off). Only the tail is tokenised again (a follow-up turn must not pay for re-tokenising a book); where its
        first token differs from the whole text's (a merge across the cut, a leading-space marker) the split moves
        to the first token both share."""
        if char == 0:
            return None
        tail = self.ids(rendered, char)
        start = len(ids) - common_prefix(ids[max(0, len(ids) - len(tail)):][::-1], tail[::-1])
        return start if 0 < start < len(ids) else None


# ---------------------------------------------------------------------- helpers
def control_strings(tokenizer: Any) -> list[str]:
    """The strings the tokenizer turns into control tokens: its special added tokens, and the other added tokens the
    chat template writes (tool-call tags, think tags): a document quoting them must not produce them."""
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    template = getattr(tokenizer, "chat_template", None)
    written = template if isinstance(template, str) else " ".join(map(str, (template or {}).values())) \
        if isinstance(template, dict) else ""
    return [token.content for token in added.values()
            if getattr(token, "special", False) or (token.content and token.content in written)]


def special_strings(tokenizer: Any) -> list[str]:
    """The special added tokens' strings: what split_special_tokens keeps as text by itself."""
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    return [token.content for token in added.values() if getattr(token, "special", False)]


def plain_render(messages: list[Message], add_generation_prompt: bool) -> Rendered:
    """A conversation as "role: content" lines, for a tokenizer without a chat template: all of it is text."""
    lines = [f"{m['role']}: {m['content']}\n" for m in messages]
    text = "".join(lines) + ("assistant: " * add_generation_prompt)
    turns = [0, *itertools.accumulate(len(line) for line in lines)][:len(lines)]
    return Rendered(text, ((0, len(text), True),), tuple(t if k else None for k, t in enumerate(turns)),
                    tuple(t + len(m["role"]) + 2 for t, m in zip(turns, messages)), tuple(m["role"] for m in messages))


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading token ids two sequences share: where they first differ, or the shorter length."""
    n = min(len(a), len(b))
    differs = (torch.tensor(a[:n], dtype=torch.long) != torch.tensor(b[:n], dtype=torch.long)).nonzero()
    return int(differs[0]) if len(differs) else n


def last_paragraph(text: str, last_turn: int) -> int:
    """Where the last paragraph of text begins: after its last blank line (trailing whitespace ignored), or at
    last_turn (the last message's start in a rendered chat) if that is later; 0 when it has neither."""
    blank = text.rstrip().rfind("\n\n")
    return max(blank + 2 if blank >= 0 else 0, last_turn)


def fold_system(messages: list[Message]) -> list[Message]:
    """System turns become part of the next user turn, for templates without a system role."""
    folded: list[Message] = []
    pending: list[str] = []
    for message in messages:
        if message["role"] == "system":
            pending.append(message["content"])
        elif message["role"] == "user" and pending:
            folded.append({"role": "user", "content": "\n\n".join([*pending, message["content"]])})
            pending = []
        else:
            folded.append(message)
    if pending:
        folded.append({"role": "user", "content": "\n\n".join(pending)})
    return folded


def normalize_messages(messages: Sequence[Message], merge: bool = True) -> list[Message]:
    """Validated {'role', 'content'} messages (a tool result is role 'tool'; an assistant turn may carry
    'tool_calls'); with merge, consecutive same-role plain turns become one."""
    merged: list[Message] = []
    for message in messages:
        if not isinstance(message, dict) or "role" not in message or "content" not in message:
            raise TypeError(f"A chat message is a dict with 'role' and 'content', got {message!r}.")
        role, content = message["role"], message["content"]
        if not isinstance(content, str):
            raise TypeError(f"Message content must be text, got {type(content).__name__} for role {role!r}.")
        check_encodable(content)
        if role not in ("system", "user", "assistant", "tool"):
            raise ValueError(f"Unknown message role {role!r}; use 'system', 'user', 'assistant' or 'tool'.")
        if message.get("tool_calls"):
            check_tool_calls(role, message["tool_calls"])
        plain = role != "tool" and not message.get("tool_calls")
        previous = merged[-1] if merged else None
        if merge and plain and previous is not None and previous["role"] == role and not previous.get("tool_calls"):
            merged[-1] = {**previous, "content": previous["content"] + "\n\n" + content}
        else:
            merged.append({key: message[key] for key in _MESSAGE_KEYS if key in message})
    if not merged:
        raise ValueError("The conversation is empty: pass at least one message.")
    if not any(m["content"].strip() or m.get("tool_calls") for m in merged):
        raise ValueError("Every message is empty or whitespace: there is nothing to answer.")
    return merged


def check_tool_calls(role: str, calls: Any) -> None:
    """An assistant's tool calls as chat templates read them: [{"type": "function", "function": {"name": str,
    "arguments": dict}}, ...]."""
    if role != "assistant":
        raise ValueError(f"Only assistant messages carry tool_calls, not a {role!r} message.")
    for call in calls if isinstance(calls, list) else [calls]:
        function = call.get("function") if isinstance(call, dict) else None
        if not (isinstance(function, dict) and isinstance(function.get("name"), str)
                and isinstance(function.get("arguments"), dict)):
            raise TypeError("A tool call is {'type': 'function', 'function': {'name': str, 'arguments': dict}}, got "
                            f"{call!r}.")


def check_text(text: Any) -> None:
    refuse_bytes(text)
    if not isinstance(text, str):
        raise TypeError(f"Expected text (str), got {type(text).__name__}.")
    if not text.strip():
        raise ValueError("The input text is empty or only whitespace: give the model something to read.")
    check_encodable(text)


def check_encodable(text: str) -> None:
    """A lone surrogate (e.g. from decoding with errors='surrogateescape') is not text any tokenizer can encode."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise ValueError(f"The text holds {text[error.start]!r} at index {error.start}, a lone surrogate that is not "
                         "valid Unicode: decode the source bytes with errors='replace' (or remove it).") from None


def refuse_bytes(value: Any) -> None:
    """Bytes iterate as small integers, so they would be read as token ids: refuse them with the fix."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        raise TypeError(f"Got {type(value).__name__}, not text or token ids: decode it first, e.g. "
                        "data.decode('utf-8', errors='replace').")
