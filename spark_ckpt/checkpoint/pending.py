"""A checkpoint that was triggered and is collecting acknowledgements (Flink's
PendingCheckpoint). Owned by the coordinator's thread; nothing here locks."""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

__all__ = ["AckResult", "Boundary", "CheckpointFailureReason", "PendingCheckpoint", "TaskAck"]


class AckResult(enum.Enum):
    """What became of an acknowledgement: races are outcomes, never exceptions."""

    SUCCESS = "success"
    DUPLICATE = "duplicate"  # this task already acknowledged this checkpoint
    UNKNOWN = "unknown"  # the task is not one this checkpoint waits for
    DISCARDED = "discarded"  # the checkpoint was already completed or aborted


class CheckpointFailureReason(enum.Enum):
    """Why a checkpoint was aborted; each carries its message."""

    TIMEOUT = "the checkpoint expired before every task acknowledged"
    DECLINED = "a task declined the checkpoint"
    STORAGE = "writing the checkpoint metadata failed"
    PIPELINE_STOPPED = "the pipeline stopped before the checkpoint completed"


@dataclasses.dataclass(frozen=True)
class TaskAck:
    """One task's acknowledgement: its state (handles or positions) and measurements."""

    task: str
    state: dict[str, Any]
    metrics: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Boundary:
    """The end of a finished batch: a consistent cut a barrier can be placed at without waiting
    for the batch that runs now (which is replayed from the sources after a restore, like the
    in-flight data an unaligned Flink barrier overtakes).

    ``acks`` were fixed when the batch ended: each source's position and each stateful task's
    state handle (durable files, immutable). ``sinks`` name the two-phase sinks, which
    pre-commit at the barrier itself every piece they staged up to ``batch``.
    """

    batch: int
    acks: tuple[TaskAck, ...]
    sinks: tuple[str, ...] = ()

    def tasks(self) -> set[str]:
        return {a.task for a in self.acks} | {f"sink:{name}" for name in self.sinks}

    def state_files(self) -> set[str]:
        return {f["path"] for a in self.acks for f in a.state.get("handle", {}).get("files", [])}


class PendingCheckpoint:
    def __init__(self, checkpoint_id: int, trigger_ms: int, *, timeout_ms: int) -> None:
        self.checkpoint_id = checkpoint_id
        self.trigger_ms = trigger_ms
        self.deadline_ms = trigger_ms + timeout_ms
        self.barrier_batch: int | None = None  # set when a batch takes the barrier
        self.barrier_ms: int | None = None
        self.waiting: set[str] | None = None  # known once the barrier reaches a batch
        self.acks: dict[str, TaskAck] = {}
        self.discarded = False
        self.forced = False  # a final checkpoint: waited for, not expired once acknowledged

    def place_barrier(self, batch_id: int, now_ms: int, tasks: set[str]) -> None:
        self.barrier_batch = batch_id
        self.barrier_ms = now_ms
        self.waiting = set(tasks)

    def acknowledge(self, ack: TaskAck) -> AckResult:
        if self.discarded:
            return AckResult.DISCARDED
        if ack.task in self.acks:
            return AckResult.DUPLICATE
        if self.waiting is None or ack.task not in self.waiting:
            return AckResult.UNKNOWN
        self.waiting.discard(ack.task)
        self.acks[ack.task] = ack
        return AckResult.SUCCESS

    @property
    def fully_acknowledged(self) -> bool:
        return self.waiting is not None and not self.waiting and not self.discarded

    def discard(self) -> None:
        self.discarded = True
