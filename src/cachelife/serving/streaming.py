"""An engine request's new tokens as an asyncio stream.

`tokens_as_they_come` submits one request with a streamer that hands every new token (the prompt, which
transformers' `generate` puts first, is skipped) to the event loop's queue, and yields them as ints. The
stream ends with the request: after its last token, or with its error. Closing the stream before its end
(`aclose()`, as leaving a `contextlib.aclosing` block does; else when the generator is collected) cancels the
request, which frees its row at the next step boundary.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Callable
from concurrent.futures import Future
from typing import Any

import torch
from transformers.generation.streamers import BaseStreamer

# What a stream's queue holds: a token, or None once the request has ended (its tokens all queued first).
Item = int | None


class _ToLoop(BaseStreamer):
    """A streamer, called in the request's thread, that queues each new token on the event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop, queue: asyncio.Queue[Item]) -> None:
        self.loop, self.queue = loop, queue
        self.prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if not self.prompt_seen:
            self.prompt_seen = True
            return
        for token in value.reshape(-1).tolist():
            self.loop.call_soon_threadsafe(self.queue.put_nowait, int(token))

    def end(self) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, None)


async def tokens_as_they_come(submit: Callable[..., Future[Any]], **kwargs: Any) -> AsyncGenerator[int, None]:
    """Each new token of `submit(streamer=..., **kwargs)` as its row produces it (see the module docstring)."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[Item] = asyncio.Queue()
    future = submit(streamer=_ToLoop(loop, queue), **kwargs)
    # A failed or cancelled request never calls end(): its completion ends the stream instead.
    future.add_done_callback(lambda _: loop.call_soon_threadsafe(queue.put_nowait, None))
    try:
        while (token := await queue.get()) is not None:
            yield token
        await asyncio.wrap_future(future)  # raises the request's error, if any
    finally:
        future.cancel()  # no effect on a request that has ended
