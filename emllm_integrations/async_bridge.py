"""The one bridge from the synchronous engine to asyncio, shared by the LangChain and LlamaIndex adapters.

The engine reads and generates as blocking CPU work. Awaiting it directly would freeze the event loop for the
whole answer, so async calls run the engine's iterator in a worker thread and receive its items through an
``asyncio.Queue``; the loop keeps serving other tasks between items.
"""

from __future__ import annotations

import asyncio
import contextvars
import threading
from collections.abc import AsyncGenerator, Callable, Iterator
from typing import Any, TypeVar

T = TypeVar("T")

_ITEM, _DONE, _ERROR = "item", "done", "error"


async def iterate_in_thread(make: Callable[[], Iterator[T]], *, name: str = "emllm-stream") -> AsyncGenerator[T, None]:
    """Yield the items of ``make()`` as a blocking iterator runs in its own thread (named ``name``).

    ``make`` is called in that thread too, because even starting may be slow (the first call loads the weights).
    The thread runs in a copy of the caller's context, so instrumentation spans and callbacks see the caller's
    context variables. An error in the thread is raised here, in the consumer. If the consumer stops early (it
    is cancelled, closes the generator, or the loop closes), the thread stops after the item it is on, without
    computing another, and closes the iterator there, which releases its memory."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
    abandoned = threading.Event()

    def put(kind: str, value: Any) -> None:
        try:
            loop.call_soon_threadsafe(queue.put_nowait, (kind, value))
        except RuntimeError:  # the loop has closed: nobody is listening any more
            abandoned.set()

    def work() -> None:
        iterator = None
        try:
            iterator = iter(make())
            for item in iterator:
                if abandoned.is_set():
                    break
                put(_ITEM, item)
                if abandoned.is_set():
                    break
            put(_DONE, None)
        except BaseException as error:  # handed to the consumer, which raises it
            put(_ERROR, error)
        finally:
            close = getattr(iterator, "close", None)
            if close is not None:
                close()

    context = contextvars.copy_context()
    threading.Thread(target=context.run, args=(work,), name=name, daemon=True).start()
    try:
        while True:
            kind, value = await queue.get()
            if kind == _DONE:
                return
            if kind == _ERROR:
                raise value
            yield value
    finally:
        abandoned.set()  # the worker stops at its next item if we were cancelled or closed early
