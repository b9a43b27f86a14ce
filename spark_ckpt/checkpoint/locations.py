"""Where a checkpoint's files are: recorded relative to the checkpoint directory.

A checkpoint's metadata names the state files it needs (snapshots and changelogs, shared with
other checkpoints). A file inside the *checkpoint directory* is recorded by its path relative to
that directory, so a copy of the directory at another path, in another bucket or under another
URI scheme restores as it is (Flink's relocatable savepoints); a file elsewhere keeps its
absolute path or URI. In memory (tasks, the coordinator, the shared-file registry, clean-up)
every path is absolute: relative paths exist only in the stored record, made by
:func:`relativized` when it is written and undone by :func:`resolve_files` when it is read.

The checkpoint directory of a checkpoint storage is the directory that holds it: the
pipeline's checkpoint directory with the default storage (``<checkpoint directory>/
checkpoints``). Storage put elsewhere with ``spark.ckpt.checkpoint.dir`` keeps the pipeline's
state files absolute, unless they are under the same parent.

Records from before (checkpoint metadata format 1) name every file by its absolute path. They
are read as they are where they were written; after the directory was moved or copied, a path
into another directory's ``state/<operator>/`` is read from this directory when this
directory holds the file (see :func:`moved_roots`).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

from spark_ckpt.storage import join, stat_any

__all__ = ["inside", "is_relative", "moved_roots", "rebase", "relative_to", "relativized",
           "resolve", "resolve_files", "state_file_entries"]

_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")  # s3:, s3a:, abfss:, file:, gs:, C:


def is_relative(path: str) -> bool:
    """Whether ``path`` is relative (to a checkpoint directory): neither absolute nor a URI."""
    return not path.startswith(("/", "\\")) and _SCHEME.match(path) is None


def _plain(path: str) -> str:
    """A local ``file:`` URI as the path it names; anything else unchanged."""
    if path.startswith("file://"):
        return path[len("file://"):]
    if path.startswith("file:"):
        return path[len("file:"):]
    return path


def inside(path: str, base: str) -> bool:
    """Whether the absolute ``path`` names something under the directory ``base``."""
    root = _plain(base).rstrip("/")
    return bool(root) and _plain(path).startswith(root + "/")


def relative_to(path: str, base: str) -> str:
    """``path`` relative to ``base`` when it is inside it, else ``path`` unchanged."""
    if is_relative(path) or not inside(path, base):
        return path
    return _plain(path)[len(_plain(base).rstrip("/")) + 1:]


def resolve(path: str, base: str) -> str:
    """A recorded path as an absolute one: a relative path is under ``base``."""
    return join(base, path) if is_relative(path) else path


def rebase(path: str, old: str, new: str) -> str:
    """``path`` under ``new`` where it is under ``old`` (a moved directory), else unchanged."""
    if not inside(path, old):
        return path
    return join(new, relative_to(path, old))


def state_file_entries(record: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    """``(operator, file entry)`` for every state file a checkpoint record names."""
    for operator, entry in (record.get("operators") or {}).items():
        for handle in (entry.get("handles") or {}).values():
            for f in handle.get("files") or ():
                yield operator, f


def relativized(record: dict[str, Any], base: str) -> dict[str, Any]:
    """A copy of ``record`` with its state files under ``base`` relative to it; only the
    operators' handles and file entries are copied (the rest is shared: the caller
    serializes the copy at once), not the whole record, which at 1,000 tasks holds 2,000
    handles beside every operator's entry."""
    operators = record.get("operators")
    if not operators:
        return dict(record)
    copied = {}
    for name, entry in operators.items():
        handles = entry.get("handles") or {}
        copied[name] = {**entry, "handles": {
            pid: {**handle, "files": [{**f, "path": relative_to(f["path"], base)}
                                      for f in handle.get("files") or ()]}
            if handle.get("files") else dict(handle)
            for pid, handle in handles.items()}}
    return {**record, "operators": copied}


def resolve_files(record: dict[str, Any], base: str, moved: dict[str, str] | None = None) -> None:
    """Make every state file path of a read record absolute (in place): relative ones under
    ``base``; absolute ones under an old root of ``moved`` (old root -> new) under its new one."""
    for _op, f in state_file_entries(record):
        path = resolve(f["path"], base)
        for old, new in (moved or {}).items():
            if inside(path, old):
                path = rebase(path, old, new)
                break
        f["path"] = path


def moved_roots(record: dict[str, Any], base: str) -> dict[str, str]:
    """For a record of absolute paths (format 1): the directories it was written in that this
    checkpoint directory ``base`` is a copy of, each mapped to ``base``.

    A state file is written to ``<checkpoint directory>/state/<operator>/<range>/``, so a path
    outside ``base`` that goes through ``/state/<operator>/`` names the directory it was written
    in. That directory counts as moved here when ``base`` holds the same file (one look per old
    directory): a file name holds a random token, so only a copy has it. A path the storage
    of ``spark.ckpt.checkpoint.dir`` put elsewhere on purpose stays as it is.
    """
    examples: dict[str, str] = {}  # old directory -> one of its files
    for operator, f in state_file_entries(record):
        path = f["path"]
        if is_relative(path) or inside(path, base):
            continue
        at = _plain(path).rfind(f"/state/{operator}/")
        if at > 0:
            examples.setdefault(_plain(path)[:at], path)
    moved = {}
    for old, path in examples.items():
        if stat_any([rebase(path, old, base)])[0] is not None:
            moved[old] = base
    return moved
