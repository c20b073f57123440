"""Requests' deadlines, watched by one thread: a request past its deadline fails at once, wherever it waits
(for a request thread, in its preparation, in the queue for a row or in its row), not when its own thread
next looks."""

from __future__ import annotations

import heapq
import threading
import time
from collections.abc import Callable


class Deadlines:
    """Calls `expire(key)` once each key's deadline (`time.monotonic()` seconds) has passed, unless it was
    forgotten first; one daemon thread, ended by `close`."""

    def __init__(self, expire: Callable[[int], None]) -> None:
        self._expire = expire
        self._heap: list[tuple[float, int]] = []
        self._forgotten: set[int] = set()
        self._wake = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._watch, name="cachelife-engine-deadlines", daemon=True)
        self._thread.start()

    def watch(self, key: int, deadline: float) -> None:
        with self._wake:
            heapq.heappush(self._heap, (deadline, key))
            self._wake.notify()

    def forget(self, key: int) -> None:
        with self._wake:
            if any(entry == key for _, entry in self._heap):
                self._forgotten.add(key)

    def close(self, *, wait: bool = True) -> None:
        with self._wake:
            self._closed = True
            self._wake.notify()
        if wait:
            self._thread.join()

    def _watch(self) -> None:
        while True:
            with self._wake:
                while not self._closed and (not self._heap or self._heap[0][0] > time.monotonic()):
                    self._wake.wait(None if not self._heap else self._heap[0][0] - time.monotonic())
                if self._closed:
                    return
                _, key = heapq.heappop(self._heap)
                if key in self._forgotten:
                    self._forgotten.discard(key)
                    continue
            self._expire(key)
