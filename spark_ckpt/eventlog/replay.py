"""Fold replayed events into what recovery needs to know (FLIP-383 replay rules).

* the last ``ExecutionVertexFinished`` of a partition wins;
* an ``ExecutionVertexReset`` after it makes the partition unfinished again;
* ``JobVertexInitialized`` records each vertex's decided parallelism, descriptor and
  coordinator state (for sources: the split assignment);
* ``SinkCommitStarted``/``SinkCommitted`` record per sink the version a commit used;
* a ``JobAttemptFinished`` with status ``succeeded`` marks the whole job complete.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

from spark_ckpt.eventlog.events import Event, EventType
from spark_ckpt.execution.result_partition import OutputFile

__all__ = ["FinishedPartition", "JobHistory", "replay"]


@dataclasses.dataclass(frozen=True)
class FinishedPartition:
    vertex_id: str
    partition: int
    attempt_id: str
    job_attempt: int
    outputs: tuple[OutputFile, ...]
    rows: int
    duration_ms: int
    schema: str = ""


@dataclasses.dataclass
class AttemptSummary:
    attempt: int
    started_us: int
    finished_us: int | None = None
    status: str = "unknown (driver died)"
    mode: str = ""
    ran: int = 0
    reused: int = 0
    error: str | None = None


@dataclasses.dataclass
class JobHistory:
    job_id: str | None = None
    attempts: dict[int, AttemptSummary] = dataclasses.field(default_factory=dict)
    vertices: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    finished: dict[tuple[str, int], FinishedPartition] = dataclasses.field(default_factory=dict)
    finished_per_attempt: dict[int, int] = dataclasses.field(default_factory=dict)
    resets: int = 0
    sink_started: dict[str, int] = dataclasses.field(default_factory=dict)
    sink_committed: dict[str, int] = dataclasses.field(default_factory=dict)
    completed: bool = False
    events: int = 0

    @property
    def last_attempt(self) -> int:
        return max(self.attempts, default=0)


def replay(events: Iterable[Event]) -> JobHistory:
    history = JobHistory()
    for event in events:
        history.events += 1
        history.job_id = history.job_id or event.job_id
        t = event.type
        if t is EventType.JOB_ATTEMPT_STARTED:
            history.attempts[event.job_attempt] = AttemptSummary(
                event.job_attempt, event.time_us, mode=event.payload.get("mode", "")
            )
        elif t is EventType.JOB_VERTEX_INITIALIZED:
            history.vertices[event.vertex_id or ""] = event.payload
        elif t is EventType.EXECUTION_VERTEX_FINISHED:
            assert event.vertex_id is not None and event.partition is not None
            outputs = tuple(OutputFile.from_json(o) for o in event.payload.get("outputs", []))
            history.finished[(event.vertex_id, event.partition)] = FinishedPartition(
                event.vertex_id, event.partition, event.attempt_id or "", event.job_attempt,
                outputs, event.rows or 0, event.duration_ms or 0, event.payload.get("schema", ""),
            )
            history.finished_per_attempt[event.job_attempt] = (
                history.finished_per_attempt.get(event.job_attempt, 0) + 1
            )
        elif t is EventType.EXECUTION_VERTEX_RESET:
            history.resets += 1
            if event.partition is None:  # the whole vertex
                for key in [k for k in history.finished if k[0] == event.vertex_id]:
                    del history.finished[key]
            else:
                history.finished.pop((event.vertex_id or "", event.partition), None)
        elif t is EventType.SINK_COMMIT_STARTED:
            history.sink_started[event.payload["sink"]] = int(event.payload["version"])
        elif t is EventType.SINK_COMMITTED:
            history.sink_committed[event.payload["sink"]] = int(event.payload["version"])
        elif t is EventType.JOB_ATTEMPT_FINISHED:
            summary = history.attempts.setdefault(
                event.job_attempt, AttemptSummary(event.job_attempt, event.time_us)
            )
            summary.finished_us = event.time_us
            summary.status = event.payload.get("status", "?")
            summary.ran = int(event.payload.get("ran", 0))
            summary.reused = int(event.payload.get("reused", 0))
            summary.error = event.payload.get("error")
            if summary.status == "succeeded":
                history.completed = True
    return history
