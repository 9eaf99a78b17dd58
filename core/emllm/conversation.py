"""One turn of a conversation, the one routine every caller runs: pin, read the new tokens, checkpoint, read the
prompt, decode (from what the memory retrieved re-read as text, with ``reread=True``: emllm.reread).

    request = engine.request(messages, tools=tools, max_new_tokens=64)    # checked and encoded once
    stream = converse(engine, request, OwnMemory(engine, memory))          # EMEngine.stream
    stream = converse(engine, request, pool_policy)                        # MemoryPool.stream

Where the memory comes from and what is kept is the caller's policy (a small object): EMEngine generates in the memory
it is given (or a throwaway one); MemoryPool forks the longest checkpoint the prompt extends and keeps forks at the
question, after the prompt and after the answer, so the next turn reads only its own tokens. The steps themselves
exist only here.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, NamedTuple, Protocol

import torch

from .codec import EncodedPrompt, common_prefix
from .decoding import Decoding, GenerationResult, TextStream, decode
from .memory import EpisodicMemory
from .reread import attention_in_prompt, read_attended

if TYPE_CHECKING:
    from .engine import EMEngine


class MemoryMismatchError(ValueError):
    """The prompt does not extend what the memory has read; continuing would mix two conversations."""


class Request(NamedTuple):
    """One call, checked and encoded before anything is read (EMEngine.request)."""
    prompt: EncodedPrompt
    decoding: Decoding
    progress: bool = False


class MemoryPolicy(Protocol):
    """Where a turn's memory comes from and which of its states are kept."""

    checkpoints_question: bool
    """Read the document up to the question first and offer that state to ``checkpoint`` (another question about
    the same document extends it)."""

    def acquire(self, ids: list[int]) -> EpisodicMemory:
        """The memory to generate in: it must have read a prefix of ``ids``."""
        ...

    def checkpoint(self, memory: EpisodicMemory) -> None:
        """The memory has read up to the question, or the whole prompt: keep what is worth keeping (a fork)."""
        ...

    def release(self, memory: EpisodicMemory, answered: bool) -> None:
        """The turn is over (answered, or failed or abandoned): keep or close the memory."""
        ...


class OwnMemory:
    """EMEngine's policy: the caller's memory (left open, whatever happens) or a throwaway one; nothing is kept."""

    checkpoints_question = False

    def __init__(self, engine: EMEngine, memory: EpisodicMemory | None):
        self.engine, self.memory = engine, memory

    def acquire(self, ids: list[int]) -> EpisodicMemory:
        return self.memory if self.memory is not None else self.engine.new_memory()

    def checkpoint(self, memory: EpisodicMemory) -> None:
        pass

    def release(self, memory: EpisodicMemory, answered: bool) -> None:
        if self.memory is None:
            memory.close()


def converse(engine: EMEngine, request: Request, policy: MemoryPolicy) -> TextStream:
    """Answer a checked request in a memory the policy supplies; a TextStream of the answer's text deltas."""
    holder: dict = {}
    return TextStream(_turn(engine, request, policy, holder), holder)


def _turn(engine: EMEngine, request: Request, policy: MemoryPolicy, holder: dict) -> Iterator[str]:
    prompt, settings, progress = request
    ids, question_start = prompt.ids, prompt.question_start
    memory = policy.acquire(ids)
    answering, answered = memory, False
    try:
        seen = memory.total_tokens
        if memory.token_ids != ids[:seen] or (seen == len(ids) and memory.last_logits is None):
            raise MemoryMismatchError(
                f"The prompt ({len(ids)} tokens) does not extend the {seen} tokens this memory has read "
                f"(they first differ at token {common_prefix(memory.token_ids, ids)}). Use a new memory "
                "for a different conversation.")
        started = time.perf_counter()
        for start, end in prompt.pinned:
            engine.pin(memory, ids, start, end)
        read = memory.total_tokens
        if policy.checkpoints_question and question_start is not None and \
                question_start - read >= memory.config.chunk_size:
            # Reading in two calls is the same chunking as one: read() restarts its chunks at the question anyway.
            engine.read(memory, ids[read:question_start], progress=progress)
            policy.checkpoint(memory)
        engine.read_prompt(memory, ids, question_start, progress=progress)
        prefill = time.perf_counter() - started
        policy.checkpoint(memory)
        retrieved = memory.retrieved_events()
        answering, kept = memory, None
        if settings.reread and memory.stats()["tokens_evicted"]:  # nothing evicted: it attends to every token
            started = time.perf_counter()
            answering, kept = read_attended(engine, memory, ids, progress=progress)
            prefill += time.perf_counter() - started
        if settings.attribute:
            answering.attribution = torch.zeros(answering.total_tokens + settings.max_new_tokens)
        constraint = engine.grammars.constraint(settings.grammar) if settings.grammar is not None else None
        started = time.perf_counter()
        with engine.batcher.decoding() as generation:  # concurrent generations' steps wait briefly for this one's
            answer = yield from engine.batcher.relay(generation, decode(
                answering, settings, tokenizer=engine.tokenizer, eos_ids=engine.eos_ids, constraint=constraint,
                step=engine.batcher.step))
        attention = answering.attribution
        if kept is not None:  # the answer was written in the re-reading memory: the conversation's reads it too
            attention = attention_in_prompt(attention, kept, len(ids)) if attention is not None else None
            if len(answer.token_ids) > 1:  # a decode feeds back every token but its last
                engine.read(memory, answer.token_ids[:-1])
        holder["result"] = GenerationResult(
            text=answer.text, finish_reason=answer.finish_reason, input_tokens=len(ids),
            output_tokens=len(answer.token_ids), new_input_tokens=len(ids) - seen, prefill_seconds=prefill,
            decode_seconds=time.perf_counter() - started, token_ids=answer.token_ids, retrieved_events=retrieved,
            attention=attention)
        answered = True
    finally:
        if answering is not memory:
            answering.close()
        if not memory.closed:
            memory.attribution = None
        policy.release(memory, answered)
