"""Read the Delta event log back, tolerating a damaged tail.

A driver killed mid-commit can leave a truncated last commit file or a data file that never
finished. Reading loads the newest table version that loads, moves the unreadable newer commit
files aside (so the next append reuses their version numbers), and skips data files that cannot
be read: losing a finished-partition event only makes that partition run again, because
recovery validates outputs against storage and never trusts the log alone.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import time

import pyarrow as pa
import pyarrow.parquet as pq
from deltalake import DeltaTable

from spark_ckpt.eventlog.events import EVENT_FORMAT_VERSION, EVENT_SCHEMA, Event
from spark_ckpt.storage import Storage, join

__all__ = ["EventLogUnreadable", "LogReadResult", "read_events", "read_table"]

log = logging.getLogger(__name__)

_COMMIT = re.compile(r"^(\d{20})\.json$")
_MAX_VERSIONS_BACK = 50


class EventLogUnreadable(Exception):
    """No version of the event log could be loaded."""


@dataclasses.dataclass
class LogReadResult:
    events: list[Event]
    version: int | None
    problems: list[str]


def _commit_versions(storage: Storage, path: str) -> list[int]:
    versions = []
    for info in storage.list_files(join(path, "_delta_log"), recursive=False):
        match = _COMMIT.match(info.base_name)
        if match:
            versions.append(int(match.group(1)))
    return sorted(versions)


def _load_newest(storage: Storage, path: str, problems: list[str]) -> DeltaTable:
    uri = storage.spark_path(path)
    try:
        return DeltaTable(uri)
    except Exception as exc:  # delta-rs raises several types for damaged logs
        first_error = exc
    versions = _commit_versions(storage, path)
    for version in reversed(versions[-_MAX_VERSIONS_BACK:]):
        try:
            table = DeltaTable(uri, version=version)
        except Exception:
            continue
        for bad in (v for v in versions if v > version):
            src = join(path, "_delta_log", f"{bad:020d}.json")
            dst = f"{src}.unreadable-{int(time.time())}"
            storage.move(src, dst)
            problems.append(f"commit {bad} of the event log was unreadable; moved to {dst}")
        log.warning("Event log %s: loaded version %d after %s", uri, version, first_error)
        return table
    raise EventLogUnreadable(f"event log at {uri} cannot be loaded: {first_error}") from first_error


def read_table(storage: Storage, path: str) -> tuple[pa.Table, int | None, list[str]]:
    """Every readable event row as one Arrow table (unsorted), the version, and problems."""
    if not storage.exists(join(path, "_delta_log")):
        return EVENT_SCHEMA.empty_table(), None, []
    problems: list[str] = []
    table = _load_newest(storage, path, problems)
    pieces: list[pa.Table] = []
    for uri in table.file_uris():
        try:
            piece = pq.read_table(_local(uri) if storage.local else uri)
            versions = set(piece.column("format_version").unique().to_pylist())
            if versions - {EVENT_FORMAT_VERSION}:
                raise ValueError(f"event format_version {sorted(versions)} is not supported "
                                 f"(this release reads {EVENT_FORMAT_VERSION})")
            pieces.append(piece.select(EVENT_SCHEMA.names).cast(EVENT_SCHEMA))
        except Exception as exc:
            problems.append(f"event file {uri} is unreadable and was skipped: {exc}")
    for problem in problems:
        log.warning("Event log %s: %s", path, problem)
    events = pa.concat_tables(pieces) if pieces else EVENT_SCHEMA.empty_table()
    return events, table.version(), problems


def read_events(storage: Storage, path: str) -> LogReadResult:
    """All readable events as Event objects, in (job_attempt, seq) order."""
    table, version, problems = read_table(storage, path)
    table = table.sort_by([("job_attempt", "ascending"), ("seq", "ascending")])
    return LogReadResult([Event.from_row(r) for r in table.to_pylist()], version, problems)


def _local(uri: str) -> str:
    return uri[len("file://"):] if uri.startswith("file://") else uri
