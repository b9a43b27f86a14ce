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

import pyarrow.parquet as pq
from deltalake import DeltaTable

from spark_ckpt.eventlog.events import Event
from spark_ckpt.storage import Storage, join

__all__ = ["EventLogUnreadable", "LogReadResult", "read_events"]

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


def read_events(storage: Storage, path: str) -> LogReadResult:
    """All readable events, in (job_attempt, seq) order. Empty when the log does not exist."""
    if not storage.exists(join(path, "_delta_log")):
        return LogReadResult([], None, [])
    problems: list[str] = []
    table = _load_newest(storage, path, problems)
    events: list[Event] = []
    for uri in table.file_uris():
        try:
            rows = pq.read_table(storage.fs.normalize_path(_local(uri)) if storage.local
                                 else uri).to_pylist()
        except Exception as exc:
            problems.append(f"event file {uri} is unreadable and was skipped: {exc}")
            continue
        for row in rows:
            try:
                events.append(Event.from_row(row))
            except (ValueError, KeyError) as exc:
                problems.append(f"event row in {uri} skipped: {exc}")
    events.sort(key=lambda e: (e.job_attempt, e.seq))
    for problem in problems:
        log.warning("Event log %s: %s", path, problem)
    return LogReadResult(events, table.version(), problems)


def _local(uri: str) -> str:
    return uri[len("file://"):] if uri.startswith("file://") else uri
