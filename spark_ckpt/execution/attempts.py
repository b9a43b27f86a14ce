"""Task attempts (executions): one attempt at one partition of one vertex.

Every attempt has a unique attempt id; registering a second live attempt with an id already
present is refused, as Flink's TaskManager refuses a duplicate ExecutionAttemptID.

Thread ownership: the registry is shared by the scheduler thread (creates and deploys), the
wave threads (fail or cancel on job end) and the manifest poller (finishes); ``_lock`` guards
the dicts, each attempt's StateMachine guards its own state.
"""

from __future__ import annotations

import dataclasses
import threading
import uuid

from spark_ckpt.errors import InternalError
from spark_ckpt.execution.attempt_states import ExecutionState, StateMachine

__all__ = ["Execution", "ExecutionRegistry", "new_attempt_id"]


def new_attempt_id(job_attempt: int, vertex_id: str, partition: int) -> str:
    """Unique and readable: which driver attempt, vertex and partition made it."""
    return f"a{job_attempt}-{vertex_id}-{partition}-{uuid.uuid4().hex[:8]}"


@dataclasses.dataclass(eq=False)
class Execution:
    attempt_id: str
    vertex_id: str
    partition: int
    attempt_number: int
    machine: StateMachine

    @property
    def state(self) -> ExecutionState:
        return self.machine.state


class ExecutionRegistry:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_id: dict[str, Execution] = {}
        self._attempts: dict[tuple[str, int], int] = {}

    def create(self, job_attempt: int, vertex_id: str, partition: int,
               attempt_id: str | None = None) -> Execution:
        attempt_id = attempt_id or new_attempt_id(job_attempt, vertex_id, partition)
        with self._lock:
            if attempt_id in self._by_id:
                raise InternalError(f"an attempt with id {attempt_id} is already registered")
            number = self._attempts.get((vertex_id, partition), 0)
            self._attempts[(vertex_id, partition)] = number + 1
            execution = Execution(
                attempt_id, vertex_id, partition, number, StateMachine(f"attempt {attempt_id}")
            )
            self._by_id[attempt_id] = execution
            return execution

    def get(self, attempt_id: str) -> Execution | None:
        with self._lock:
            return self._by_id.get(attempt_id)
