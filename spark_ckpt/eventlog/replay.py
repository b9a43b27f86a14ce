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
import math
from collections.abc import Iterable
from typing import Any

import orjson
import pyarrow as pa

from spark_ckpt.eventlog.events import Event, EventType
from spark_ckpt.execution.result_partition import OutputFile

__all__ = ["FinishedPartition", "JobHistory", "replay", "replay_table"]


class FinishedPartition:
    """A finished partition. Its file list is parsed from the event payload on first use, so
    replaying a long log does not decode every payload (recovery reads them when validating).
    """

    __slots__ = ("vertex_id", "partition", "attempt_id", "job_attempt", "rows", "duration_ms",
                 "_outputs", "_schema", "_shared", "_payload")

    def __init__(self, vertex_id: str, partition: int, attempt_id: str, job_attempt: int,
                 rows: int, duration_ms: int, *, outputs: tuple[OutputFile, ...] | None = None,
                 schema: str = "", payload_json: str | None = None,
                 shared: tuple[int, ...] = ()) -> None:
        self.vertex_id = vertex_id
        self.partition = partition
        self.attempt_id = attempt_id
        self.job_attempt = job_attempt
        self.rows = rows
        self.duration_ms = duration_ms
        self._outputs = outputs
        self._schema = schema
        self._shared = shared
        self._payload = payload_json

    def _parse(self) -> None:
        payload = orjson.loads(self._payload or "{}")  # a recovery parses one per partition
        self._outputs = tuple([OutputFile.from_json(o) for o in payload.get("outputs", ())])
        self._schema = payload.get("schema", "")
        shared = payload.get("shared")
        self._shared = tuple(shared) if shared else ()
        self._payload = None

    @property
    def shared(self) -> tuple[int, ...]:
        """The partitions of the split-mode wave whose files this partition shares."""
        if self._outputs is None:
            self._parse()
        return self._shared

    @property
    def outputs(self) -> tuple[OutputFile, ...]:
        if self._outputs is None:
            self._parse()
        return self._outputs  # type: ignore[return-value]

    @property
    def schema(self) -> str:
        if self._outputs is None:
            self._parse()
        return self._schema

    def __repr__(self) -> str:
        return (f"FinishedPartition({self.vertex_id}/{self.partition}, attempt "
                f"{self.attempt_id}, {self.rows} rows)")


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
    adopted: int = 0  # from a killed Spark Connect client's writes
    reused_in_waves: int = 0  # reused partitions of vertices run in waves
    durable_share: float | None = None  # of the job's work, when the attempt started


@dataclasses.dataclass
class JobHistory:
    job_id: str | None = None
    attempts: dict[int, AttemptSummary] = dataclasses.field(default_factory=dict)
    vertices: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    finished: dict[tuple[str, int], FinishedPartition] = dataclasses.field(default_factory=dict)
    finished_per_attempt: dict[int, int] = dataclasses.field(default_factory=dict)
    resets: int = 0
    # every partition a finished event ever named, reset since or not: the last job attempt
    # that logged it finished
    ever_finished: dict[tuple[str, int], int] = dataclasses.field(default_factory=dict)
    sink_started: dict[str, int] = dataclasses.field(default_factory=dict)
    sink_committed: dict[str, int] = dataclasses.field(default_factory=dict)
    completed: bool = False
    events: int = 0

    @property
    def last_attempt(self) -> int:
        return max(self.attempts, default=0)


def replay(events: Iterable[Event]) -> JobHistory:
    """Fold events (in (job_attempt, seq) order) into a JobHistory."""
    history = JobHistory()
    for event in events:
        _apply(history, event)
    return history


def replay_table(table: pa.Table) -> JobHistory:
    """Replay an event table read from the log: finished events are folded column-wise.

    Equivalent to ``replay`` over the table's rows, but a log of 100,000 finished partitions
    is replayed without building an Event per row or decoding any payload.
    """
    table = table.sort_by([("job_attempt", "ascending"), ("seq", "ascending")])
    frame = table.select(["job_attempt", "event_type", "vertex_id", "partition",
                          "attempt_id", "rows", "duration_ms", "payload"]).to_pandas()
    is_finished = frame["event_type"] == EventType.EXECUTION_VERTEX_FINISHED.value
    history = JobHistory()
    # Non-finished events are few: fold them one by one, remembering where resets stand.
    reset_at: dict[tuple[str, int | None], int] = {}
    rest = frame.index[~is_finished].to_numpy()
    for position, row in zip(rest, table.take(rest).to_pylist(), strict=True):
        event = Event.from_row(row)
        if event.type is EventType.EXECUTION_VERTEX_RESET:
            reset_at[(event.vertex_id or "", event.partition)] = int(position)
            history.resets += 1
        else:
            _apply(history, event)
    finished = frame[is_finished]
    history.events = len(frame)
    if len(finished):
        history.job_id = history.job_id or str(table.column("job_id")[0])
        counts = finished["job_attempt"].value_counts()
        history.finished_per_attempt = {int(k): int(v) for k, v in counts.items()}
        latest = finished.groupby(["vertex_id", "partition"])["job_attempt"].max()
        history.ever_finished = {(str(v), int(p)): int(a) for (v, p), a in latest.items()}
        last = finished.drop_duplicates(["vertex_id", "partition"], keep="last")
        for position, row in zip(last.index, last.itertuples(index=False), strict=True):
            vertex, partition = row.vertex_id, int(row.partition)
            if reset_at.get((vertex, partition), -1) > position or \
                    reset_at.get((vertex, None), -1) > position:
                continue
            history.finished[(vertex, partition)] = FinishedPartition(
                vertex, partition, row.attempt_id, int(row.job_attempt),
                0 if _isnull(row.rows) else int(row.rows),
                0 if _isnull(row.duration_ms) else int(row.duration_ms),
                payload_json=row.payload,
            )
    return history


def _isnull(value: Any) -> bool:
    return value is None or (isinstance(value, float) and math.isnan(value))


def _apply(history: JobHistory, event: Event) -> None:
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
            event.rows or 0, event.duration_ms or 0, outputs=outputs,
            schema=event.payload.get("schema", ""),
            shared=tuple(int(p) for p in event.payload.get("shared", ())),
        )
        history.finished_per_attempt[event.job_attempt] = (
            history.finished_per_attempt.get(event.job_attempt, 0) + 1
        )
        key = (event.vertex_id, event.partition)
        history.ever_finished[key] = max(history.ever_finished.get(key, 0), event.job_attempt)
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
        summary.adopted = int(event.payload.get("adopted", 0))
        summary.reused_in_waves = int(event.payload.get("reused_in_waves", 0))
        share = event.payload.get("durable_share")
        summary.durable_share = None if share is None else float(share)
        summary.error = event.payload.get("error")
        if summary.status == "succeeded":
            history.completed = True
