"""Injectable time: the system clock, and a manual clock that tests advance step by step."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

__all__ = ["Clock", "ManualClock", "SystemClock"]


class Clock:
    def now_ms(self) -> int:
        raise NotImplementedError

    def on_advance(self, fn: Callable[[], None]) -> None:
        """Call ``fn`` whenever time jumps (manual clocks); the system clock never calls it."""


class SystemClock(Clock):
    def now_ms(self) -> int:
        return int(time.time() * 1000)


class ManualClock(Clock):
    """Time that moves only when a test says so; waiters are woken on every advance."""

    def __init__(self, start_ms: int = 1_000_000) -> None:
        self._now = start_ms
        self._lock = threading.Lock()
        self._callbacks: list[Callable[[], None]] = []

    def now_ms(self) -> int:
        with self._lock:
            return self._now

    def advance(self, ms: int) -> None:
        with self._lock:
            self._now += ms
            callbacks = list(self._callbacks)
        for fn in callbacks:
            fn()

    def on_advance(self, fn: Callable[[], None]) -> None:
        with self._lock:
            self._callbacks.append(fn)
