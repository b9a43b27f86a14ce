"""Versioned JSON records: everything spark_ckpt persists carries ``format_version``.

One reader per version; an unknown version is rejected with a message naming both. Pickle is
never read back from storage.

Records a restart acts on are also checked field by field when they are loaded, against the
declarative specs in :data:`RECORDS` (one per kind and version): a missing field, a wrong type,
an impossible number (a negative batch id) or a path with a ``..`` segment raises
:class:`RecordError` naming the file, the field, what was expected and what was found, before
anything runs from the record. Unknown extra fields are allowed (they are never read).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from spark_ckpt.errors import FormatVersionError, InternalError, RecordError

__all__ = ["ANY", "PATH", "RECORDS", "STR", "At", "Check", "Each", "ListOf", "MapOf", "Opt",
           "Row", "dump_record", "integer", "load_record", "validate"]


# -- the spec language -------------------------------------------------------------------------
# A spec is a Check (a leaf), Opt/ListOf/MapOf/Row/At/Each, or a dict {field: spec} for a JSON
# object whose fields ending in "?" may be absent.
class Check:
    def __init__(self, expected: str, ok: Callable[[Any], bool]) -> None:
        self.expected = expected
        self.ok = ok


class Opt:
    """``spec`` or null."""

    def __init__(self, spec: Any) -> None:
        self.spec = spec


class ListOf:
    def __init__(self, spec: Any) -> None:
        self.spec = spec


class MapOf:
    """A JSON object with any keys, every value matching ``spec``."""

    def __init__(self, spec: Any) -> None:
        self.spec = spec


class Row:
    """A fixed-length JSON array: one spec per position."""

    def __init__(self, *specs: Any) -> None:
        self.specs = specs


class At:
    """Any JSON value; where it is an object holding one of the string ``positions`` or an array
    holding one of the integer ones, the value there must match. For records whose layout is
    a writer's own (a source's piece, a sink's transaction): only the positions the built-in
    writers fill with file paths are checked, never user data beside them."""

    def __init__(self, positions: dict[str | int, Any]) -> None:
        self.positions = positions


class Each:
    """Any JSON value; where it is an array, every item must match ``spec``."""

    def __init__(self, spec: Any) -> None:
        self.spec = spec


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def integer(low: int = 0, high: int | None = None) -> Check:
    what = f"an integer >= {low}" + (f" and <= {high}" if high is not None else "")
    return Check(what, lambda v: _is_int(v) and v >= low and (high is None or v <= high))


def _safe_path(value: Any) -> bool:
    if not isinstance(value, str) or not value or "\x00" in value:
        return False
    return ".." not in value.replace("\\", "/").split("/")


ANY = Check("any value", lambda v: True)
STR = Check("a string", lambda v: isinstance(v, str))
BOOL = Check("true or false", lambda v: isinstance(v, bool))
OBJECT = Check("a JSON object", lambda v: isinstance(v, dict))
PATH = Check("a path without '..' segments", _safe_path)
BATCH_ID = integer(0, 10**12 - 1)  # batch ids name files with 12 digits
BOUNDARY = integer(-1, 10**12 - 1)  # the cut after a batch; -1: before the first one
MILLIS = integer(0)
NUMBER = Check("a number >= 0", lambda v: isinstance(v, int | float) and not isinstance(v, bool)
               and v >= 0)


def validate(value: Any, spec: Any, field: str = "") -> None:
    """Raise RecordError(field, expected, found) where ``value`` does not match ``spec``."""
    def fail(expected: str, found: Any) -> None:
        text = repr(found)
        raise RecordError(f"field {field or '(the record)'}: expected {expected}, found "
                          f"{text if len(text) <= 80 else text[:77] + '...'}")

    def at(key: Any) -> str:
        return f"{field}[{key}]" if isinstance(key, int) else (f"{field}.{key}" if field else key)

    if isinstance(spec, Check):
        if not spec.ok(value):
            fail(spec.expected, value)
    elif isinstance(spec, Opt):
        if value is not None:
            validate(value, spec.spec, field)
    elif isinstance(spec, ListOf | Row):
        if not isinstance(value, list):
            fail("a JSON array", value)
        if isinstance(spec, Row) and len(value) != len(spec.specs):
            fail(f"an array of {len(spec.specs)} items", value)
        for i, item in enumerate(value):
            validate(item, spec.spec if isinstance(spec, ListOf) else spec.specs[i], at(i))
    elif isinstance(spec, MapOf):
        if not isinstance(value, dict):
            fail("a JSON object", value)
        for key, item in value.items():
            validate(item, spec.spec, at(key))
    elif isinstance(spec, At):
        for key, sub in spec.positions.items():
            if isinstance(key, str) and isinstance(value, dict) and key in value:
                validate(value[key], sub, at(key))
            elif isinstance(key, int) and isinstance(value, list) and key < len(value):
                validate(value[key], sub, at(key))
    elif isinstance(spec, Each):
        for i, item in enumerate(value if isinstance(value, list) else []):
            validate(item, spec.spec, at(i))
    elif isinstance(spec, dict):
        if not isinstance(value, dict):
            fail("a JSON object", value)
        for name, sub in spec.items():
            key = name.rstrip("?")
            if key in value:
                validate(value[key], sub, at(key))
            elif not name.endswith("?"):
                raise RecordError(f"field {at(key)}: expected a value, found the field missing")
    else:  # pragma: no cover - a bad spec is a bug here
        raise InternalError(f"not a record spec: {spec!r}")


# -- the records a restart acts on -------------------------------------------------------------
# Source pieces inside allocations are checked by their sources (Source.PIECE), which know
# their own layout and directories.
# The file paths spark_ckpt itself writes into them, and nothing else (partition-value maps,
# a user's own source pieces and sink transactions hold any data): a file source's files
# [path, size, mtime], a Delta source's [path, size, rows, partition values], a receiver's
# blocks [seq, path, size] (sources/file_stream.py, sources/receivers.py); a file two-phase sink's
# pieces {dir, files: [{path, ...}]} (Delta) or moves [[from, to]] and dirs (Parquet)
# (sinks/two_phase.py).
_SOURCE_PIECE = At({"files": Each(At({0: PATH})), "blocks": Each(At({1: PATH}))})
_SINK_TXN = At({"pieces": Each(At({"dir": PATH, "files": Each(At({"path": PATH}))})),
                "moves": Each(At({0: PATH, 1: PATH})), "dirs": Each(PATH)})
RECORDS: dict[tuple[str, int], Any] = {
    ("allocation", 1): {"batch_id": BATCH_ID, "batch_time_ms": MILLIS,
                        "pieces": MapOf(OBJECT), "allocated_ms?": MILLIS},
    ("batch-commit", 1): {"batch_id": BATCH_ID, "outputs": MapOf(OBJECT),
                          "finished_ms?": MILLIS, "two_phase?": BOOL},
    # streaming/runtime/run_claim.py writes it at every start; the start reads name, sources,
    # schemas and pipeline_id, the tools (spark-ckpt, shell) the rest
    ("pipeline-metadata", 1): {"name": STR, "sources": MapOf(OBJECT),
                               "schemas?": MapOf(STR), "pipeline_id?": STR,
                               "outputs?": MapOf(ANY),  # a sink's describe(), any JSON
                               "operators?": MapOf({"kind": STR, "keys": ListOf(STR)}),
                               "batch_interval_s?": NUMBER, "checkpoints?": STR},
    # runs/<n>.json: a driver's claim of the directory (streaming/runtime/run_claim.py, and
    # streaming/runtime/bootstrap.py's offline runs, which name their purpose)
    ("pipeline-run", 1): {"pipeline": STR, "started_ms": MILLIS, "purpose?": STR,
                          "connect_session?": STR, "connect_user?": STR, "connect_tag?": STR},
    ("checkpoint-metadata", 1): {
        "checkpoint_id": integer(0), "pipeline?": STR, "pipeline_id?": STR,
        "barrier_batch": integer(-1, 10**12 - 1), "trigger_ms?": MILLIS,
        "completed_ms?": MILLIS,
        "sources?": MapOf({"batch": BOUNDARY, "piece": _SOURCE_PIECE}),
        "operators?": MapOf({"handles": MapOf({  # StateHandle, StateFile (state/chain.py)
            "files?": ListOf({"path": PATH, "kind": STR, "batch": BATCH_ID,
                              "rows": integer(0), "bytes": integer(0), "range": STR}),
            "rows?": integer(0), "range": STR, "token?": Opt(STR)})}),
        "sinks?": MapOf({"pending": ListOf(Row(integer(0), _SINK_TXN))}),
    },
    # streaming/runtime/stop_control.py: spark-ckpt stop's request and the driver's answer
    ("stop-request", 1): {"request_id": STR, "run": integer(1), "requested_ms": MILLIS},
    ("stop-answer", 1): {"request_id": STR, "run": integer(1), "status": STR,
                         "checkpoint_id": Opt(integer(0)), "barrier_batch": Opt(BATCH_ID),
                         "message": STR, "answered_ms": MILLIS},
    ("pipeline-run-end", 1): {"run": integer(1), "status": STR, "message": STR,
                              "final_checkpoint": Opt(integer(0)),
                              "final_barrier": Opt(BATCH_ID), "ended_ms": MILLIS},
    # ops/pipeline_ops.py: spark-ckpt restore's request, taken by the next start
    ("restore-request", 1): {"checkpoint_id": integer(0), "requested_ms": MILLIS},
    # batch/unit_records.py: a run unit a Spark Connect driver submitted (paths derived, not kept)
    ("batch-unit", 1): {"attempt": integer(1), "vertex": STR, "number": integer(0),
                        "tag": STR, "parts": ListOf(integer(0)), "operations": ListOf(STR),
                        "lineage": STR, "schema": STR, "connect_session": STR,
                        "connect_user": STR, "per_task": BOOL},
}
# version 2: state file paths inside the checkpoint directory are relative to it, and "root"
# names that directory as written (checkpoint/locations.py)
RECORDS[("checkpoint-metadata", 2)] = {**RECORDS[("checkpoint-metadata", 1)], "root?": STR}
# version 2 adds "positional" (Spark partition i of the unit's writes holds parts[i])
RECORDS[("batch-unit", 2)] = {**RECORDS[("batch-unit", 1)], "positional": BOOL}


def dump_record(kind: str, version: int, body: dict[str, Any]) -> bytes:
    """Serialize ``body`` as a ``kind`` record of format ``version``."""
    record = {"kind": kind, "format_version": version, **body}
    return json.dumps(record, sort_keys=True, separators=(",", ":")).encode()


def load_record(data: bytes | str, kind: str, supported: tuple[int, ...], *,
                where: str | None = None) -> dict[str, Any]:
    """Parse a record, checking its kind, that its version is one of ``supported`` and, for
    kinds in :data:`RECORDS`, its fields. ``where`` (the file) prefixes a field error."""
    try:
        record = json.loads(data)
    except (ValueError, UnicodeDecodeError) as exc:
        raise FormatVersionError(f"expected a JSON {kind} record, found unparseable data") from exc
    if not isinstance(record, dict) or record.get("kind") != kind:
        found = record.get("kind") if isinstance(record, dict) else type(record).__name__
        raise FormatVersionError(f"expected a {kind} record, found {found!r}")
    version = record.get("format_version")
    if version not in supported:
        raise FormatVersionError(
            f"{kind} record has format_version {version!r}; this release reads "
            f"{', '.join(map(str, supported))}. Upgrade spark_ckpt to read it."
        )
    spec = RECORDS.get((kind, version))
    if spec is not None:
        try:
            validate(record, spec)
        except RecordError as exc:
            prefix = f"{where}: " if where else ""
            raise RecordError(f"{prefix}{kind} record {exc}; correct the field or restore "
                              "the file (nothing was run from it)") from None
    return record
