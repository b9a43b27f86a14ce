"""Records of run units: what a Spark Connect driver writes before a run unit's writes start.

A classic driver's Spark jobs end with its JVM. A Spark Connect client's do not: the server
runs a killed client's operation on to its end (operations are reattachable), and its tasks
keep committing files into the directories that client chose. So before a driver on Spark
Connect submits a run unit's writes, it records the unit (:class:`UnitRecord`): the vertex,
its partitions, the tag that names its write directories, the ids its write operations will
have, and the lineage of what it reads. The next attempt reads the records of the attempts
it would otherwise interrupt (:func:`load_units`) and takes over what their operations
finish (:mod:`spark_ckpt.batch.adoption`).

A record names directories by tag only (the next attempt derives them as the writer did),
never by path: nothing in it points outside the job's result and staging directories.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from posixpath import join

from spark_ckpt.errors import RecordError
from spark_ckpt.formats import dump_record, load_record
from spark_ckpt.storage import Storage

__all__ = ["UNIT_KIND", "UnitRecord", "load_units", "units_dir", "write_unit"]

log = logging.getLogger(__name__)

UNIT_KIND = "batch-unit"
_TAG = re.compile(r"a\d+-u\d+-[0-9a-f]{8}")
_NAME = re.compile(r"(\d{5})-u(\d+)-(.+)\.json")


@dataclasses.dataclass(frozen=True)
class UnitRecord:
    """A run unit as its driver submitted it (see the module's docstring)."""

    attempt: int
    vertex: str
    number: int
    tag: str  # of the unit's write directories (``UnitWriter.writes``)
    parts: tuple[int, ...]
    operations: tuple[str, ...]  # one per write Spark runs (not mirrors), in order
    lineage: str  # ``Lineages.of``: what the unit read, as recovery tells it apart
    schema: str  # the output's schema (JSON)
    session: str  # the Spark Connect session the operations run in, and its user
    user: str
    per_task: bool  # a task's file is whole once in place (sparkapi.committers.commits_per_task)
    # Spark partition i of its writes holds partition parts[i] (planning.writes_positionally); in
    # version 1 records (before it existed) always False: Spark partition j is partition j
    positional: bool = False

    def body(self) -> dict[str, object]:
        return {"attempt": self.attempt, "vertex": self.vertex, "number": self.number,
                "tag": self.tag, "parts": list(self.parts),
                "operations": list(self.operations), "lineage": self.lineage,
                "schema": self.schema, "connect_session": self.session,
                "connect_user": self.user, "per_task": self.per_task,
                "positional": self.positional}


def units_dir(job_dir: str) -> str:
    return join(job_dir, "units")


def _path(job_dir: str, record: UnitRecord) -> str:
    return join(units_dir(job_dir), f"{record.attempt:05d}-u{record.number}-{record.vertex}.json")


def write_unit(storage: Storage, job_dir: str, record: UnitRecord) -> None:
    """Write ``record`` whole (before its operations start: a record whose operations never
    ran names operations the server does not have, which the next attempt reads as gone)."""
    storage.write_atomic(_path(job_dir, record), dump_record(UNIT_KIND, 2, record.body()))


def load_units(storage: Storage, job_dir: str, attempts: set[int]) -> list[UnitRecord]:
    """The records of ``attempts``' units. One that cannot be read is skipped with a warning:
    its partitions run again, as without records."""
    directory = units_dir(job_dir)
    if not attempts or not storage.exists(directory):
        return []
    out = []
    for info in storage.list_files(directory, recursive=False):
        name = _NAME.fullmatch(info.base_name)
        if not name or int(name.group(1)) not in attempts:
            continue
        try:
            body = load_record(storage.read_bytes(info.path), UNIT_KIND, (1, 2),
                               where=info.path)
            record = UnitRecord(
                attempt=body["attempt"], vertex=body["vertex"], number=body["number"],
                tag=body["tag"], parts=tuple(body["parts"]),
                operations=tuple(body["operations"]), lineage=body["lineage"],
                schema=body["schema"], session=body["connect_session"],
                user=body["connect_user"], per_task=body["per_task"],
                positional=body.get("positional", False))
            if not _TAG.fullmatch(record.tag):
                raise RecordError(f"field tag: expected a tag like a1-u0-0123abcd, found "
                                  f"{record.tag!r}")
        except Exception as exc:  # noqa: BLE001 - a record is a speed-up, never a must
            log.warning("Unreadable record of a run unit %s: %s; its partitions run again",
                        info.path, exc)
            continue
        out.append(record)
    return sorted(out, key=lambda r: (r.attempt, r.vertex, r.number))
