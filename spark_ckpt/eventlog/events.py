"""Job events and their row schema in the Delta event log (documented in docs/event-log.md).

Each event is one row: common typed columns that users filter on, plus ``payload``, a JSON
object whose fields depend on ``event_type``. ``format_version`` is per row.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import enum
import json
from typing import Any

import pyarrow as pa

__all__ = ["EVENT_FORMAT_VERSION", "EVENT_SCHEMA", "Event", "EventType"]

EVENT_FORMAT_VERSION = 1


class EventType(enum.StrEnum):
    JOB_ATTEMPT_STARTED = "JobAttemptStarted"
    JOB_VERTEX_INITIALIZED = "JobVertexInitialized"
    EXECUTION_VERTEX_FINISHED = "ExecutionVertexFinished"
    EXECUTION_VERTEX_RESET = "ExecutionVertexReset"
    SINK_COMMIT_STARTED = "SinkCommitStarted"
    SINK_COMMITTED = "SinkCommitted"
    JOB_ATTEMPT_FINISHED = "JobAttemptFinished"


EVENT_SCHEMA = pa.schema(
    [
        pa.field("format_version", pa.int32(), nullable=False),
        pa.field("job_id", pa.string(), nullable=False),
        pa.field("job_attempt", pa.int32(), nullable=False),
        pa.field("seq", pa.int64(), nullable=False),
        pa.field("event_time", pa.timestamp("us", tz="UTC"), nullable=False),
        pa.field("event_type", pa.string(), nullable=False),
        pa.field("vertex_id", pa.string()),
        pa.field("partition", pa.int32()),
        pa.field("attempt_id", pa.string()),
        pa.field("rows", pa.int64()),
        pa.field("bytes", pa.int64()),
        pa.field("duration_ms", pa.int64()),
        pa.field("payload", pa.string(), nullable=False),
    ]
)


@dataclasses.dataclass(frozen=True)
class Event:
    """One job event. ``job_attempt``, ``seq`` and ``time_us`` are set by the writer."""

    type: EventType
    payload: dict[str, Any] = dataclasses.field(default_factory=dict)
    vertex_id: str | None = None
    partition: int | None = None
    attempt_id: str | None = None
    rows: int | None = None
    bytes: int | None = None
    duration_ms: int | None = None
    job_id: str = ""
    job_attempt: int = 0
    seq: int = 0
    time_us: int = 0

    def row(self) -> dict[str, Any]:
        return {
            "format_version": EVENT_FORMAT_VERSION,
            "job_id": self.job_id,
            "job_attempt": self.job_attempt,
            "seq": self.seq,
            "event_time": self.time_us,
            "event_type": self.type.value,
            "vertex_id": self.vertex_id,
            "partition": self.partition,
            "attempt_id": self.attempt_id,
            "rows": self.rows,
            "bytes": self.bytes,
            "duration_ms": self.duration_ms,
            "payload": json.dumps(self.payload, sort_keys=True, separators=(",", ":")),
        }

    @classmethod
    def from_row(cls, row: dict[str, Any]) -> Event:
        """Inverse of :meth:`row`; raises ValueError for an unknown type or version."""
        if row["format_version"] != EVENT_FORMAT_VERSION:
            raise ValueError(
                f"event format_version {row['format_version']} is not supported "
                f"(this release reads {EVENT_FORMAT_VERSION})"
            )
        return cls(
            type=EventType(row["event_type"]),
            payload=json.loads(row["payload"]),
            vertex_id=row["vertex_id"],
            partition=row["partition"],
            attempt_id=row["attempt_id"],
            rows=row["rows"],
            bytes=row["bytes"],
            duration_ms=row["duration_ms"],
            job_id=row["job_id"],
            job_attempt=row["job_attempt"],
            seq=row["seq"],
            time_us=_micros(row["event_time"]),
        )


_EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)


def _micros(value: Any) -> int:
    if isinstance(value, dt.datetime):
        if value.tzinfo is None:
            value = value.replace(tzinfo=dt.UTC)
        return (value - _EPOCH) // dt.timedelta(microseconds=1)
    return int(value)


def events_to_table(events: list[Event]) -> pa.Table:
    rows = [e.row() for e in events]
    return pa.Table.from_pylist(rows, schema=EVENT_SCHEMA)
