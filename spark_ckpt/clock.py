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

    def wait_until(self, deadline_ms: int, cancel: threading.Event) -> bool:
        """Block until the clock reads ``deadline_ms``; True if ``cancel`` was set first."""
        raise NotImplementedError


class SystemClock(Clock):
    def now_ms(self) -> int:
        return int(time.time() * 1000)

    def wait_until(self, deadline_ms: int, cancel: threading.Event) -> bool:
        while not cancel.is_set():
            delay = (deadline_ms - self.now_ms()) / 1000
            if delay <= 0:
                return False
            cancel.wait(delay)
        return True


class ManualClock(Clock):
    """Time that moves only when a test says so; waiters are woken on every advance."""

    def __init__(self, start_ms: int = 1_000_000) -> None:
        self._now = start_ms
        self._lock = threading.Lock()
        self._advanced = threading.Condition(self._lock)
        self._callbacks: list[Callable[[], None]] = []

    def now_ms(self) -> int:
        with self._lock:
            return self._now

    def advance(self, ms: int) -> None:
        with self._lock:
            self._now += ms
            callbacks = list(self._callbacks)
            self._advanced.notify_all()
        for fn in callbacks:
            fn()

    def on_advance(self, fn: Callable[[], None]) -> None:
        with self._lock:
            self._callbacks.append(fn)

    def wait_until(self, deadline_ms: int, cancel: threading.Event) -> bool:
        with self._lock:
            while self._now < deadline_ms:
                if cancel.is_set():
                    return True
                self._advanced.wait(0.05)  # woken by advance(); the bound lets a cancel through
        return cancel.is_set()
