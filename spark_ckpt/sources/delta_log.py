"""A Delta table's commit log, one version at a time: what each commit did to the table's data.

A streaming read of a Delta table follows the table's commits (``_delta_log/<version:020d>.json``,
one JSON action per line: ``add``, ``remove``, ``metaData``, ``protocol``, ``commitInfo``,
``cdc``, ...), not the difference between two snapshots: a compaction removes files and adds
the same rows again in new ones, which a snapshot diff cannot tell from new data. Each commit is
classified, as Delta Lake's own streaming source classifies it, by its ``add`` and ``remove``
actions whose ``dataChange`` is true (see :class:`CommitKind`).

delta-rs (``deltalake`` 1.x) exposes snapshots, history (``commitInfo`` only) and the change
data feed, not a commit's actions, so the JSON commit files are read with pyarrow's file system.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from enum import Enum
from typing import Any
from urllib.parse import unquote

from spark_ckpt.errors import SourceError
from spark_ckpt.storage import Storage, join

__all__ = ["AddedFile", "CommitKind", "DeltaCommit", "commit_path", "decode_path",
           "earliest_commit", "is_absolute", "parse_commit", "read_commit"]

LOG_DIR = "_delta_log"
# RFC 3986's scheme: a letter, then letters, digits, "+", "-" or "."; a relative path's first
# segment cannot hold a ":" (Delta writers escape it), so such a prefix names a scheme
_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*:")


class CommitKind(Enum):
    """What a commit did to the table's rows (only ``dataChange=true`` actions count)."""

    APPEND = "append"  # files added, none removed: WRITE (append), MERGE that only inserts
    NO_DATA_CHANGE = "no data change"  # OPTIMIZE, Z-order, VACUUM, properties, CREATE empty
    DELETE = "delete"  # files removed, none added: DELETE of whole files or partitions
    CHANGE = "change"  # files removed and added: UPDATE, MERGE, DELETE in files, overwrite


@dataclass(frozen=True)
class AddedFile:
    """A data file an ``add`` action put in the table.

    Attributes:
        path: relative to the table's root, or an absolute URI (any scheme: :func:`is_absolute`),
            decoded (:func:`decode_path`: the log holds it URI-encoded, the file on disk has
            the decoded name).
        size: bytes.
        rows: ``numRecords`` of the action's ``stats``; None when the writer wrote no stats.
        partition_values: the action's ``partitionValues``, as the log serializes them (strings
            or null).
        deletion_vector: the action carries a deletion vector (rows of the file to skip).
    """

    path: str
    size: int
    rows: int | None
    partition_values: dict[str, str | None]
    deletion_vector: bool = False


@dataclass(frozen=True)
class DeltaCommit:
    """One version's commit, reduced to what a streaming reader acts on.

    Attributes:
        version: the table version the commit made.
        operation: ``commitInfo.operation`` (``WRITE``, ``OPTIMIZE``, ``DELETE``, ``MERGE``, ...);
            ``UNKNOWN`` when the writer wrote no ``commitInfo``.
        kind: what it did to the rows (:class:`CommitKind`).
        added: the files added with ``dataChange=true``, in log order.
        removed: the paths removed with ``dataChange=true``, in log order.
        schema_string: ``metaData.schemaString`` when the commit changed the metadata.
        configuration: ``metaData.configuration`` when the commit changed the metadata.
    """

    version: int
    operation: str
    kind: CommitKind
    added: tuple[AddedFile, ...] = ()
    removed: tuple[str, ...] = ()
    schema_string: str | None = None
    configuration: dict[str, str] | None = None

    @property
    def column_mapping(self) -> str | None:
        """The column mapping mode the commit set (``name``, ``id``), None if none or unset."""
        mode = (self.configuration or {}).get("delta.columnMapping.mode", "none")
        return None if mode in (None, "none") else str(mode)


def commit_path(version: int) -> str:
    """The commit file of ``version``, relative to the table's root."""
    return f"{LOG_DIR}/{version:020d}.json"


def _rows(stats: Any) -> int | None:
    if not isinstance(stats, str):
        return None
    try:
        rows = json.loads(stats).get("numRecords")
    except (ValueError, AttributeError):
        return None
    return rows if isinstance(rows, int) and rows >= 0 else None


def is_absolute(path: str) -> bool:
    """An add action's path (as the log gives it, or decoded) names its file on its own: a URI
    with any scheme (``s3://b/k``, ``file:/abs/x`` and ``file:///abs/x`` as shallow clones
    write them) or an absolute path; anything else is relative to the table's root."""
    return path.startswith("/") or _SCHEME.match(path) is not None


def decode_path(raw: str) -> str:
    """An add or remove action's path as a path or URI naming the file on its file system.

    Delta writes paths as URIs: a relative one is percent-encoded once more than the file's
    (Hive-escaped) name on disk, e.g. ``p=a%252Fb/x.parquet`` for the directory ``p=a%2Fb``;
    an absolute URI's path is encoded the same way, its scheme and authority are kept as
    they are. A local ``file:`` URI (``file:/abs``, ``file:///abs``, ``file://localhost/abs``)
    comes out as ``file:///abs``, the form Spark and this package's local checks both take.
    """
    scheme = _SCHEME.match(raw)
    if scheme is None:
        return unquote(raw)
    prefix, rest = scheme.group(0), raw[scheme.end():]
    authority = None
    if rest.startswith("//"):
        authority, slash, rest = rest[2:].partition("/")
        rest = slash + rest
    path = unquote(rest)
    if prefix.lower() == "file:" and authority in (None, "", "localhost"):
        return "file://" + ("/" + path.lstrip("/") if path else "/")
    return prefix + path if authority is None else f"{prefix}//{authority}{path}"


def parse_commit(version: int, data: bytes | str, where: str = "") -> DeltaCommit:
    """Classify the commit file ``data`` of ``version``; SourceError naming ``where`` (the
    file) when a line is not a JSON action."""
    operation = "UNKNOWN"
    added: list[AddedFile] = []
    removed: list[str] = []
    schema_string: str | None = None
    configuration: dict[str, str] | None = None
    text = data.decode() if isinstance(data, bytes) else data
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            action = json.loads(line)
            (name, body), = action.items()
        except (ValueError, AttributeError) as exc:
            raise SourceError(
                f"expected a Delta commit (one JSON action per line) in {where or version}, "
                f"found line {number} unreadable: {line[:80]!r}"
            ) from exc
        if not isinstance(body, dict):
            continue
        if name == "commitInfo":
            operation = str(body.get("operation") or operation)
        elif name == "add" and body.get("dataChange", True):
            added.append(AddedFile(
                decode_path(body["path"]), int(body.get("size") or 0), _rows(body.get("stats")),
                dict(body.get("partitionValues") or {}),
                deletion_vector=body.get("deletionVector") is not None))
        elif name == "remove" and body.get("dataChange", True):
            removed.append(decode_path(body["path"]))
        elif name == "metaData":
            schema_string = body.get("schemaString")
            configuration = dict(body.get("configuration") or {})
    if removed:
        kind = CommitKind.CHANGE if added else CommitKind.DELETE
    else:
        kind = CommitKind.APPEND if added else CommitKind.NO_DATA_CHANGE
    return DeltaCommit(version, operation, kind, tuple(added), tuple(removed), schema_string,
                       configuration)


def read_commit(store: Storage, version: int) -> DeltaCommit | None:
    """The commit of ``version`` of the table at ``store.root``; None when its file is not there
    (never written yet, or removed by the table's log cleanup)."""
    path = join(store.root, commit_path(version))
    try:
        data = store.read_bytes(path)
    except FileNotFoundError:
        return None
    except OSError:
        if not store.exists(path):
            return None
        raise
    return parse_commit(version, data, store.spark_path(path))


def earliest_commit(store: Storage) -> int | None:
    """The oldest version whose commit file is still in the log (None: none is)."""
    versions = []
    for info in store.list_files(join(store.root, LOG_DIR), recursive=False):
        stem, _, ext = info.base_name.partition(".")
        if ext == "json" and stem.isdigit() and len(stem) == 20:
            versions.append(int(stem))
    return min(versions, default=None)
