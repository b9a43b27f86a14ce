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

from spark_ckpt.errors import FormatVersionError

__all__ = ["EVENT_FORMAT_VERSION", "EVENT_SCHEMA", "READABLE_FORMAT_VERSIONS", "Event",
           "EventType"]

# 2: a file source's recorded splits name each file as [path, size, mtime_ns, version]
# (format 1: [path, size]); rows of format 1 are upgraded as they are read (_UPGRADES)
EVENT_FORMAT_VERSION = 2
READABLE_FORMAT_VERSIONS = (1, 2)


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
        """Inverse of :meth:`row`, for rows of any readable format version (an older row's
        payload is upgraded to the current format); raises FormatVersionError for an unknown
        version (as the reader does for a whole file) and ValueError for an unknown type."""
        version = row["format_version"]
        if version not in READABLE_FORMAT_VERSIONS:
            raise FormatVersionError(
                f"event format_version {version} is not supported (this release reads "
                f"{', '.join(map(str, READABLE_FORMAT_VERSIONS))})"
            )
        event_type = EventType(row["event_type"])
        payload = json.loads(row["payload"])
        for older in range(version, EVENT_FORMAT_VERSION):
            payload = _UPGRADES[older](event_type, payload)
        return cls(
            type=event_type,
            payload=payload,
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


def _upgrade_1(event_type: EventType, payload: dict[str, Any]) -> dict[str, Any]:
    """Format 1 to 2: a file source's splits recorded [path, size] for each file; format 2
    adds its modification time and object version, unknown for a format 1 record (None)."""
    state = payload.get("coordinator_state")
    if event_type is EventType.JOB_VERTEX_INITIALIZED and isinstance(state, dict) \
            and "splits" in state:
        splits = [[[*entry[:2], None, None] for entry in split] for split in state["splits"]]
        payload = {**payload, "coordinator_state": {**state, "splits": splits}}
    return payload


# How a payload of each older format becomes one of the next format.
_UPGRADES = {1: _upgrade_1}

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
