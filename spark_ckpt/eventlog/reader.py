"""Read the Delta event log back, tolerating a damaged tail and nothing else.

A driver killed mid-commit can leave a truncated last commit file or a data file that never
finished. Reading loads the newest table version that loads and skips data files that cannot be
read: losing a finished-partition event only makes that partition run again, because recovery
validates outputs against storage and never trusts the log alone.

What counts as damage is narrow, so that a passing storage error never throws history away:

* a commit file is damaged only when its JSON does not parse (a torn write); only commits
  *newer* than the last one that parses are set aside, and only by the driver that is about to
  append (``repair=True``: the next append reuses their version numbers). Readers such as the
  CLI never move a file.
* a log whose commits all parse but that does not load (a newer protocol, a storage error)
  stops the read with :class:`EventLogError`, changing nothing;
* a data file is skipped only when it is corrupt (Arrow cannot decode it), missing, or of an
  unknown event format version; any other error (permission, connection, timeout) propagates.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re

import pyarrow as pa
import pyarrow.parquet as pq
from deltalake import DeltaTable

from spark_ckpt.clock import Clock, SystemClock
from spark_ckpt.errors import EventLogError, EventLogUnreadable, FormatVersionError
from spark_ckpt.eventlog.events import EVENT_SCHEMA, READABLE_FORMAT_VERSIONS, Event
from spark_ckpt.storage import Storage, delta_table, join

__all__ = ["EventLogUnreadable", "LogReadResult", "read_events", "read_table"]

log = logging.getLogger(__name__)

_COMMIT = re.compile(r"^(\d{20})\.json$")
_MAX_VERSIONS_BACK = 50


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


def _torn(storage: Storage, path: str, version: int) -> bool:
    """Whether commit ``version`` is a torn write (its JSON does not parse). A storage error
    reading it propagates: it says nothing about the commit."""
    data = storage.read_bytes(join(path, "_delta_log", f"{version:020d}.json"))
    try:
        for line in data.decode("utf-8").splitlines():
            if line.strip():
                json.loads(line)
    except (UnicodeDecodeError, ValueError):
        return True
    return False


def _load_newest(storage: Storage, path: str, problems: list[str], repair: bool,
                 clock: Clock) -> DeltaTable:
    uri = storage.spark_path(path)
    try:
        return delta_table(uri)
    except Exception as exc:  # noqa: BLE001 - delta-rs raises several types; which one says little
        first_error = exc
    versions = _commit_versions(storage, path)
    torn = []
    for version in reversed(versions[-_MAX_VERSIONS_BACK:]):
        if not _torn(storage, path, version):
            break
        torn.append(version)
    if not torn:
        raise EventLogError(
            f"event log at {uri} cannot be loaded although none of its newest commits is torn "
            f"(a storage error, or a log written by a newer Delta protocol): "
            f"{_brief(first_error)}. "
            "Nothing was changed; fix the storage or upgrade spark_ckpt, then submit again"
        ) from first_error
    if len(torn) == len(versions):
        raise EventLogUnreadable(
            f"event log at {uri} cannot be loaded: every commit is torn "
            f"({_brief(first_error)})"
        ) from first_error
    good = min(torn) - 1
    try:
        table = delta_table(uri, version=good)
    except Exception as exc:
        raise EventLogError(
            f"event log at {uri}: commits {sorted(torn)} are torn and version {good} before "
            f"them does not load either: {_brief(exc)}"
        ) from exc
    for bad in sorted(torn):
        src = join(path, "_delta_log", f"{bad:020d}.json")
        if repair:
            dst = f"{src}.unreadable-{clock.now_ms() // 1000}"
            storage.move(src, dst)
            problems.append(f"commit {bad} of the event log was torn; moved to {dst}")
        else:
            problems.append(f"commit {bad} of the event log is torn and was not read")
    log.warning("Event log %s: loaded version %d after %s", uri, good, _brief(first_error))
    return table


def _brief(exc: BaseException) -> str:
    """delta-rs's message without the backtrace it may carry (RUST_BACKTRACE)."""
    return str(exc).split("\n   0: ", 1)[0].rstrip()


def _damaged(exc: BaseException) -> bool:
    """A data file error that means the file itself is bad, not the storage."""
    if isinstance(exc, pa.ArrowInvalid | FileNotFoundError | FormatVersionError):
        return True
    # pyarrow reports a corrupt footer as an OSError from its Thrift decoder
    return isinstance(exc, OSError) and any(
        word in str(exc) for word in ("thrift", "Thrift", "Parquet", "magic bytes"))


def read_table(storage: Storage, path: str, *, repair: bool = False, clock: Clock | None = None,
               ) -> tuple[pa.Table, int | None, list[str]]:
    """Every readable event row as one Arrow table (unsorted), the version, and problems.

    ``repair``: set torn tail commits aside (only the driver that appends next does that),
    under a name stamped by ``clock`` (the system clock by default)."""
    if not storage.exists(join(path, "_delta_log")):
        return EVENT_SCHEMA.empty_table(), None, []
    problems: list[str] = []
    table = _load_newest(storage, path, problems, repair, clock or SystemClock())
    pieces: list[pa.Table] = []
    for uri in table.file_uris():
        try:
            # through the storage's file system: pyarrow alone knows no s3a:// and none of
            # the endpoint and credentials of spark.hadoop.fs.s3a.* (storage/s3.py)
            piece = (pq.read_table(_local(uri)) if storage.local else
                     pq.read_table(storage.fs_path(uri), filesystem=storage.fs))
            versions = set(piece.column("format_version").unique().to_pylist())
            if versions - set(READABLE_FORMAT_VERSIONS):
                raise FormatVersionError(
                    f"event format_version {sorted(versions)} is not supported (this release "
                    f"reads {', '.join(map(str, READABLE_FORMAT_VERSIONS))})")
            pieces.append(piece.select(EVENT_SCHEMA.names).cast(EVENT_SCHEMA))
        except Exception as exc:
            if not _damaged(exc):
                raise
            problems.append(f"event file {uri} is unreadable and was skipped: {exc}")
    for problem in problems:
        log.warning("Event log %s: %s", path, problem)
    events = pa.concat_tables(pieces) if pieces else EVENT_SCHEMA.empty_table()
    return _one_per_event(events), table.version(), problems


def _one_per_event(events: pa.Table) -> pa.Table:
    """One row per event: (``job_attempt``, ``seq``) identifies it, and two compactions of the
    log that overlapped (writer.py) can each have added a copy of the same rows."""
    if events.num_rows < 2:
        return events
    pairs = events.select(["job_attempt", "seq"]).group_by(["job_attempt", "seq"]) \
        .aggregate([])
    if pairs.num_rows == events.num_rows:
        return events
    first = events.append_column("__row", pa.array(range(events.num_rows), pa.int64())) \
        .group_by(["job_attempt", "seq"]).aggregate([("__row", "min")])
    log.warning("Event log: %d duplicate rows (overlapping compactions) kept once",
                events.num_rows - first.num_rows)
    return events.take(first.column("__row_min"))  # readers order events themselves


def read_events(storage: Storage, path: str, *, repair: bool = False) -> LogReadResult:
    """All readable events as Event objects, in (job_attempt, seq) order."""
    table, version, problems = read_table(storage, path, repair=repair)
    table = table.sort_by([("job_attempt", "ascending"), ("seq", "ascending")])
    return LogReadResult([Event.from_row(r) for r in table.to_pylist()], version, problems)


def _local(uri: str) -> str:
    return uri[len("file://"):] if uri.startswith("file://") else uri
