"""Injectable time: the system clock, and a manual clock that tests advance step by step.

Every place of the library that reads the time or waits (outside the Spark executor tasks and
the fault-injection hooks, whose module docstrings say why) does it through a :class:`Clock`:

* :meth:`Clock.now_ms`: wall time, milliseconds since the epoch (what records and events carry);
* :meth:`Clock.monotonic_s`: seconds on a clock that never goes back, from an arbitrary origin
  (durations, deadlines, rates);
* :meth:`Clock.sleep`: wait that many seconds of this clock;
* :meth:`Clock.wait_until`: wait until the wall time reads a deadline, or until cancelled;
* :meth:`Clock.on_advance`: be told when a manual clock jumps.

:class:`ManualClock` moves only when a test calls :meth:`ManualClock.advance`; both its wall
and its monotonic time move together. Its :meth:`~ManualClock.sleep` *waits for an advance*
(the test owns time: a thread that sleeps stays asleep until the test has advanced the clock by
at least that much), unless the clock was built with ``sleep_advances=True``, when a sleep
advances the clock itself (for code under test that sleeps on the test's own thread).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

__all__ = ["Clock", "ManualClock", "SystemClock"]


class Clock:
    """Where the library reads the time and waits; see the module docstring."""

    def now_ms(self) -> int:
        """Wall time in milliseconds since the epoch."""
        raise NotImplementedError

    def monotonic_s(self) -> float:
        """Seconds on a clock that never goes back (arbitrary origin): durations, deadlines."""
        raise NotImplementedError

    def sleep(self, seconds: float) -> None:
        """Wait ``seconds`` of this clock (nothing for zero or less)."""
        raise NotImplementedError

    def on_advance(self, fn: Callable[[], None]) -> None:
        """Call ``fn`` whenever time jumps (manual clocks); the system clock never calls it."""

    def wait_until(self, deadline_ms: int, cancel: threading.Event) -> bool:
        """Block until the clock reads ``deadline_ms``; True if ``cancel`` was set first."""
        raise NotImplementedError


class SystemClock(Clock):
    """The machine's time: ``time.time`` for wall time, ``time.perf_counter`` (monotonic, the
    finest resolution) for durations and deadlines, ``time.sleep`` to wait."""

    def now_ms(self) -> int:
        return int(time.time() * 1000)

    def monotonic_s(self) -> float:
        return time.perf_counter()

    def sleep(self, seconds: float) -> None:
        if seconds > 0:
            time.sleep(seconds)

    def wait_until(self, deadline_ms: int, cancel: threading.Event) -> bool:
        while not cancel.is_set():
            delay = (deadline_ms - self.now_ms()) / 1000
            if delay <= 0:
                return False
            cancel.wait(delay)
        return True


class ManualClock(Clock):
    """Time that moves only when a test says so; waiters are woken on every advance.

    ``sleep`` waits until the test has advanced the clock far enough, or, with
    ``sleep_advances=True``, advances the clock itself by the time slept.
    """

    def __init__(self, start_ms: int = 1_000_000, *, sleep_advances: bool = False) -> None:
        self._now = start_ms
        self._sleep_advances = sleep_advances
        self._lock = threading.Lock()
        self._advanced = threading.Condition(self._lock)
        self._callbacks: list[Callable[[], None]] = []

    def now_ms(self) -> int:
        with self._lock:
            return self._now

    def monotonic_s(self) -> float:
        with self._lock:
            return self._now / 1000

    def advance(self, ms: int) -> None:
        with self._lock:
            self._now += ms
            callbacks = list(self._callbacks)
            self._advanced.notify_all()
        for fn in callbacks:
            fn()

    def sleep(self, seconds: float) -> None:
        ms = max(0, round(seconds * 1000))
        if ms == 0:
            return
        if self._sleep_advances:
            self.advance(ms)
            return
        with self._lock:
            deadline = self._now + ms
            while self._now < deadline:
                self._advanced.wait()

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
