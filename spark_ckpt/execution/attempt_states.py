"""The lifecycle of one task attempt, as a checked state machine (seed 004).

CREATED -> DEPLOYING -> RUNNING -> FINISHED, FAILED from any live state, and
CANCELING -> CANCELED. Transitions are compare-and-set under a lock, and each final state is
reached once: a second report of a final state returns False instead of raising.
"""

from __future__ import annotations

import enum
import threading

from spark_ckpt.errors import IllegalStateTransition

__all__ = ["ExecutionState", "StateMachine"]


class ExecutionState(enum.Enum):
    CREATED = "CREATED"
    DEPLOYING = "DEPLOYING"
    RUNNING = "RUNNING"
    FINISHED = "FINISHED"
    CANCELING = "CANCELING"
    CANCELED = "CANCELED"
    FAILED = "FAILED"

    @property
    def is_final(self) -> bool:
        return self in _FINAL

    def __str__(self) -> str:
        return self.value


S = ExecutionState
_FINAL = frozenset({S.FINISHED, S.CANCELED, S.FAILED})

# The whole lifecycle in one table: state -> states it may move to.
TRANSITIONS: dict[ExecutionState, frozenset[ExecutionState]] = {
    S.CREATED: frozenset({S.DEPLOYING, S.CANCELING, S.CANCELED, S.FAILED}),
    S.DEPLOYING: frozenset({S.RUNNING, S.FINISHED, S.CANCELING, S.FAILED}),
    S.RUNNING: frozenset({S.FINISHED, S.CANCELING, S.FAILED}),
    S.CANCELING: frozenset({S.CANCELED, S.FAILED}),
    S.FINISHED: frozenset(),
    S.CANCELED: frozenset(),
    S.FAILED: frozenset(),
}


class StateMachine:
    """Holds one attempt's state. Thread-safe: any thread may transition it."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._state = S.CREATED
        self._lock = threading.Lock()

    @property
    def state(self) -> ExecutionState:
        return self._state

    def transition(self, expected: ExecutionState, target: ExecutionState) -> bool:
        """Move from ``expected`` to ``target`` if the state is still ``expected``.

        Returns False when another thread moved the state first (compare-and-set lost).
        Raises IllegalStateTransition when the table forbids ``expected -> target``.
        """
        if target not in TRANSITIONS[expected]:
            raise IllegalStateTransition(self._name, expected, target)
        with self._lock:
            if self._state is not expected:
                return False
            self._state = target
            return True

    def move_to(self, target: ExecutionState) -> bool:
        """Move from whatever the state is now to ``target``.

        A final state is reported exactly once: moving a final state anywhere returns False
        (the later report lost the race). Any other forbidden move raises.
        """
        with self._lock:
            current = self._state
            if current.is_final:
                return False
            if target not in TRANSITIONS[current]:
                raise IllegalStateTransition(self._name, current, target)
            self._state = target
            return True
