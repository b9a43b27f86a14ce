"""The stateful operators' runtime state in a running pipeline, and its one owner.

``start()`` configures every operator (restoring its checkpointed handles) on the user's thread
before any thread runs; from then on the :class:`OperatorStates` belong to the **JobScheduler's
thread**: only it runs the operators' jobs, changes their state and acknowledges it at a
barrier. Other threads read what it publishes:

* ``state_view()`` (any thread): the operator's frozen
  :class:`~spark_ckpt.streaming.template.operator_state.OperatorSnapshot` on the definition's
  board, replaced by one reference assignment after each job;
* the checkpoint coordinator's sweep (its thread): :meth:`OperatorStates.live_files`, built
  from those snapshots' immutable sets. Files an operator stops holding are handed to the
  coordinator (``release_files`` posts an event to its loop), which deletes them once no
  retained checkpoint needs them.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from spark_ckpt.checkpoint.pending import TaskAck
from spark_ckpt.errors import InternalError

if TYPE_CHECKING:
    from spark_ckpt.streaming.template.keyed import StatefulStream
    from spark_ckpt.streaming.template.operator_state import OperatorState, SnapshotBoard

__all__ = ["OperatorStates"]


class OperatorStates:
    """Every stateful operator's :class:`OperatorState` (an ``OperatorRuntime`` for the batch
    runs). Owner: the JobScheduler's thread."""

    def __init__(self, board: SnapshotBoard, *, transactions: Mapping[str, Any],
                 skip_output_through: Mapping[str, int]) -> None:
        self._board = board
        self._transactions = transactions
        self._skip = skip_output_through
        self._operators: dict[str, StatefulStream] = {}
        self._states: dict[str, OperatorState] = {}
        self._release: Callable[[frozenset[str]], None] | None = None
        self._owner: threading.Thread | None = None  # None: start(), before any thread

    # -- start(), on the user's thread -----------------------------------------------------------
    def add(self, operator: StatefulStream, state: OperatorState) -> None:
        self._operators[operator.operator] = operator
        self._states[operator.operator] = state
        self._board.publish(operator.snapshot_of(state))

    def release_to(self, release: Callable[[frozenset[str]], None]) -> None:
        """Where dropped state files go (the coordinator's ``release_files``)."""
        self._release = release

    def hand_over(self, owner: threading.Thread) -> None:
        """From now on only ``owner`` (the JobScheduler's thread) touches the states."""
        self._owner = owner

    # -- the owner's thread ------------------------------------------------------------------
    @property
    def transactions(self) -> Mapping[str, Any]:
        return self._transactions

    @property
    def skip_output_through(self) -> Mapping[str, int]:
        return self._skip

    def state(self, operator: str) -> OperatorState:
        self._check_owner(operator)
        try:
            return self._states[operator]
        except KeyError:
            raise InternalError(f"operator {operator}: not configured at start") from None

    def publish(self, operator: str) -> None:
        """Publish ``operator``'s new snapshot; release the files it no longer holds."""
        state = self.state(operator)
        before = self._board.get(operator)
        snapshot = self._operators[operator].snapshot_of(state)
        self._board.publish(snapshot)
        dropped = (before.live_files if before is not None else frozenset()) - \
            snapshot.live_files
        if dropped and self._release is not None:  # deleted once no checkpoint needs them
            self._release(dropped)

    def acks(self, batch_id: int) -> list[TaskAck]:
        """Every operator task's acknowledgement of the cut after ``batch_id``."""
        acks = []
        for name, op in self._operators.items():
            state = self.state(name)
            entry = op.ack_entry(state)  # once per operator: its tasks' acks share it
            for pid in sorted(state.live):
                metrics = state.metrics.get(pid, {})
                if metrics.get("batch") != batch_id:  # no input this batch: state unchanged
                    metrics = {"sync_ms": 0, "async_ms": 0, "alignment_ms": 0, "ran": False}
                acks.append(TaskAck(f"op:{name}:{pid}", op.ack_state(state, pid, entry),
                                    metrics))
        return acks

    # -- any thread --------------------------------------------------------------------------
    def live_files(self) -> set[str]:
        """The state files the operators hold now (from their published snapshots)."""
        files: set[str] = set()
        for snapshot in self._board.all().values():
            files |= snapshot.live_files
        return files

    def _check_owner(self, operator: str) -> None:
        owner = self._owner
        if owner is not None and owner is not threading.current_thread() and owner.is_alive():
            raise InternalError(
                f"operator {operator}: its runtime state belongs to {owner.name}, touched from "
                f"{threading.current_thread().name}")
