"""What tells one content of a batch job's input file from another, between attempts.

An attempt records, for every file a source reads, what storage says of it before Spark reads
it: its size, its modification time as the listing gives it and, on object stores, the
object's version as pyarrow reports it (GCS: ``generation``; S3: ``VersionId`` in a versioned
bucket, else ``ETag``; ADLS: ``ETag``). A later attempt lists the files again the same way: a
file that differs in any of these was rewritten since, and what read it must run again.

Times are compared exactly as the listing gives them (nanoseconds on local disks, milliseconds
on HDFS and object stores) and are always taken from the same call (a directory's listing, or
one file's status), so an untouched file compares equal in any process. Content rewritten
with the same size *and* the same time (``rsync -t``, ``touch -r``, ``cp -p`` over the old
file) cannot be told apart on a file system: there is no checksum (docs/recovery.md).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import datetime as dt
import logging
from collections.abc import Sequence
from typing import Any

import pyarrow.fs as pafs

__all__ = ["FileIdentity", "identify"]

log = logging.getLogger(__name__)

# pyarrow's file systems whose input files carry the store's version of the object, and the
# metadata keys that hold it, the most specific first (pyarrow's s3fs.cc, gcsfs_internal.cc
# and azurefs.cc): GCS's generation changes with every write of the object; S3's version id
# exists only in versioned buckets, its ETag always (an MD5 of the content for single-part
# uploads, of the parts for multipart ones); ADLS gives an ETag
_VERSIONED = {"s3", "gcs", "abfs"}
_VERSION_KEYS = ("generation", "VersionId", "ETag", "etag")
_LOOKUPS = 16  # concurrent metadata requests (each one a HEAD or a metadata GET)


@dataclasses.dataclass(frozen=True)
class FileIdentity:
    """A file's size, modification time (ns since the epoch, at the listing's precision) and
    object version (``"<key>=<value>"``); None where storage gives none or a record (written
    before event format 2) has none."""

    size: int
    mtime_ns: int | None = None
    version: str | None = None

    def changes(self, found: FileIdentity) -> list[str]:
        """How ``found`` differs from this record, for each field both sides know."""
        out = []
        if found.size != self.size:
            out.append("size")
        if None not in (self.mtime_ns, found.mtime_ns) and found.mtime_ns != self.mtime_ns:
            out.append("modification time")
        if None not in (self.version, found.version) and found.version != self.version:
            out.append("object version")
        return out

    def completed(self, found: FileIdentity) -> FileIdentity:
        """This record with the fields it lacks taken from ``found`` (an unchanged file)."""
        return FileIdentity(self.size,
                            self.mtime_ns if self.mtime_ns is not None else found.mtime_ns,
                            self.version if self.version is not None else found.version)

    def describe(self) -> str:
        """``1,234 bytes, modified 2026-01-02T03:04:05.123456789Z, ETag="ab12"``."""
        parts = [f"{self.size:,} bytes"]
        parts.append("modified " + (_time(self.mtime_ns) if self.mtime_ns is not None
                                    else "at an unrecorded time"))
        if self.version is not None:
            parts.append(self.version)
        return ", ".join(parts)

    def token(self) -> str:
        """One stable string of every field, for digests of what a vertex read."""
        return f"{self.size}\0{self.mtime_ns}\0{self.version}"


def _time(ns: int) -> str:
    seconds, fraction = divmod(ns, 1_000_000_000)
    moment = dt.datetime.fromtimestamp(seconds, dt.UTC)
    return f"{moment:%Y-%m-%dT%H:%M:%S}.{fraction:09d}Z"


def identify(fs: pafs.FileSystem, infos: Sequence[pafs.FileInfo], *,
             versions: bool = True) -> list[FileIdentity]:
    """The identity of each listed file: its size and time from the listing, and on object
    stores (with ``versions``) the object's version, asked of the store for each file (one
    metadata request each, a few at a time)."""
    found: list[str | None] = [None] * len(infos)
    if versions and fs.type_name in _VERSIONED and infos:
        with concurrent.futures.ThreadPoolExecutor(min(_LOOKUPS, len(infos))) as pool:
            found = list(pool.map(lambda i: _object_version(fs, i.path), infos))
    return [FileIdentity(i.size, i.mtime_ns, v) for i, v in zip(infos, found, strict=True)]


def _object_version(fs: pafs.FileSystem, path: str) -> str | None:
    """The version pyarrow reports in an object's metadata, or None (none given, or the
    request failed: the time and size still tell a rewritten file)."""
    try:
        with fs.open_input_file(path) as f:
            metadata: Any = f.metadata()
    except OSError as exc:
        log.warning("Input file %s: cannot read its object version (%s); its size and "
                    "modification time identify it", path, exc)
        return None
    keys = {(k.decode() if isinstance(k, bytes) else k): v for k, v in metadata.items()}
    for key in _VERSION_KEYS:
        value = keys.get(key)
        if value:
            return f"{key}={value.decode() if isinstance(value, bytes) else value}"
    return None
