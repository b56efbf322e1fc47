"""``RequestHandle``: the caller's side of one submitted request.

The scheduler thread publishes StreamEvents into the handle; the caller iterates them (blocking),
``aiter()``s them from asyncio (the event loop is woken with ``call_soon_threadsafe``, never
blocked), cancels, or waits for the RequestResult. Events are kept, so ``result()`` works after
iterating and a late iterator still sees the whole stream.
"""
from __future__ import annotations

import asyncio
import logging
import threading
from typing import AsyncIterator, Callable, Iterator

from ftjax.engine.api import RequestResult, StreamEvent

log = logging.getLogger(__name__)


class RequestHandle:
    def __init__(self, request_id: str, prompt_tokens: int, on_cancel: Callable[["RequestHandle"], None]):
        self.request_id = request_id
        self.prompt_tokens = prompt_tokens
        self._on_cancel = on_cancel
        self._cond = threading.Condition()
        self._events: list[StreamEvent] = []
        self._result: RequestResult | None = None
        self._async_waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = []

    # ---- scheduler side ----
    def _publish(self, event: StreamEvent, result: RequestResult | None = None) -> None:
        with self._cond:
            self._events.append(event)
            if result is not None:
                self._result = result
            waiters, self._async_waiters = self._async_waiters, []
            self._cond.notify_all()
        for loop, ev in waiters:
            try:
                loop.call_soon_threadsafe(ev.set)
            except RuntimeError:  # the loop was closed: nobody is listening any more
                pass

    # ---- caller side ----
    @property
    def done(self) -> bool:
        return self._result is not None

    def cancel(self) -> None:
        """Ask the engine to stop this request; its slot is freed at the next scheduler iteration and
        the stream ends with finish_reason "cancelled". A no-op once finished."""
        if not self.done:
            self._on_cancel(self)

    def __iter__(self) -> Iterator[StreamEvent]:
        i = 0
        while True:
            with self._cond:
                while i >= len(self._events):
                    self._cond.wait()
                batch = self._events[i:]
            i += len(batch)
            yield from batch
            if batch[-1].finished:
                return

    async def aiter(self) -> AsyncIterator[StreamEvent]:
        """The events, for ``async for``; waiting never blocks the event loop."""
        loop = asyncio.get_running_loop()
        i = 0
        while True:
            with self._cond:
                batch = self._events[i:]
                if not batch:
                    wake = asyncio.Event()
                    self._async_waiters.append((loop, wake))
            if not batch:
                await wake.wait()
                continue
            i += len(batch)
            for ev in batch:
                yield ev
            if batch[-1].finished:
                return

    def result(self, timeout: float | None = None) -> RequestResult:
        """Wait for the request to finish; TimeoutError after ``timeout`` seconds."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._result is not None, timeout):
                raise TimeoutError(f"request {self.request_id} did not finish within {timeout}s")
            return self._result
