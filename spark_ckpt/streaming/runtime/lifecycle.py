"""The lifecycle of a running pipeline, as a checked state machine.

CREATED -> STARTING -> RUNNING -> STOPPING -> STOPPED, with STARTING -> FAILED when ``start()``
fails (everything it started is stopped again) and CREATED -> STOPPED for a pipeline stopped
before it started. Every transition is compare-and-set under one lock, so a batch failure, a
checkpoint failure and a user's ``stop()`` racing each other finish the pipeline exactly once:
the first to move RUNNING -> STOPPING wins and its error is the one ``await_termination``
raises.

Thread ownership: any thread may call every method; ``_lock`` guards ``_state``, ``_error``
and ``_stop_requested``. Once RUNNING, the pipeline loop's thread decides the outcome
(``finish``) and the termination; the user's thread only reads, asks to stop and waits.
``terminated`` is set once, after the pipeline's threads have ended (STOPPED) or ``start()``
gave up (FAILED).
"""

from __future__ import annotations

import enum
import threading

from spark_ckpt.errors import IllegalStateTransition

__all__ = ["Lifecycle", "PipelineState"]


class PipelineState(enum.Enum):
    CREATED = "CREATED"
    STARTING = "STARTING"
    RUNNING = "RUNNING"
    STOPPING = "STOPPING"
    STOPPED = "STOPPED"
    FAILED = "FAILED"  # start() failed; this context cannot start again

    def __str__(self) -> str:
        return self.value


P = PipelineState

# The whole lifecycle in one table: state -> states it may move to.
TRANSITIONS: dict[PipelineState, frozenset[PipelineState]] = {
    P.CREATED: frozenset({P.STARTING, P.STOPPED}),
    P.STARTING: frozenset({P.RUNNING, P.FAILED}),
    P.RUNNING: frozenset({P.STOPPING}),
    P.STOPPING: frozenset({P.STOPPED}),
    P.STOPPED: frozenset(),
    P.FAILED: frozenset(),
}


class Lifecycle:
    """One pipeline's state, its terminal error and its termination event."""

    def __init__(self, pipeline: str) -> None:
        self._pipeline = pipeline
        self._lock = threading.Lock()
        self._state = P.CREATED
        self._error: BaseException | None = None
        self._stop_requested = False
        self.terminated = threading.Event()

    @property
    def state(self) -> PipelineState:
        with self._lock:
            return self._state

    @property
    def error(self) -> BaseException | None:
        with self._lock:
            return self._error

    def _set(self, target: PipelineState) -> None:
        """Move to ``target`` (``_lock`` held); a move the table forbids is a bug here."""
        if target not in TRANSITIONS[self._state]:
            raise IllegalStateTransition(f"pipeline {self._pipeline}", self._state, target)
        self._state = target

    def begin_start(self) -> None:
        """CREATED -> STARTING, or a clear error saying why this context cannot start."""
        with self._lock:
            state, error = self._state, self._error
            if state is P.CREATED:
                self._set(P.STARTING)
                return
        from spark_ckpt.errors import JobDefinitionError

        if state is P.FAILED:
            raise JobDefinitionError(
                f"pipeline {self._pipeline}: an earlier start() failed ({error}); expected a "
                "new StreamingContext for another attempt"
            ) from error
        raise JobDefinitionError(
            f"pipeline {self._pipeline}: start() called on a pipeline that is {state}; "
            "expected a new StreamingContext (a context starts once)"
        )

    def start_failed(self, error: BaseException) -> None:
        """STARTING -> FAILED: ``start()`` raised ``error`` and stopped what it had started."""
        with self._lock:
            if self._state is P.STARTING:
                self._set(P.FAILED)
                self._error = error
        self.terminated.set()

    def started(self) -> bool:
        """STARTING -> RUNNING; returns whether a ``stop()`` arrived while starting."""
        with self._lock:
            if self._state is P.STARTING:
                self._set(P.RUNNING)
            return self._stop_requested

    def request_stop(self) -> PipelineState:
        """Note a user's stop; return the state it found (CREATED becomes STOPPED)."""
        with self._lock:
            self._stop_requested = True
            state = self._state
            if state is P.CREATED:
                self._set(P.STOPPED)
                self.terminated.set()
            return state

    def finish(self, error: BaseException | None) -> bool:
        """RUNNING -> STOPPING with ``error`` as the outcome; False if already finishing."""
        with self._lock:
            if self._state is not P.RUNNING:
                return False
            self._set(P.STOPPING)
            self._error = error
            return True

    def terminate(self) -> None:
        """STOPPING -> STOPPED, once the pipeline's threads have ended."""
        with self._lock:
            if self._state is P.STOPPING:
                self._set(P.STOPPED)
        self.terminated.set()
