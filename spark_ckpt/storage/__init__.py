"""File-system access for everything spark_ckpt persists, on any URI pyarrow understands.

Local paths, ``file:`` URIs, ``s3://``, ``abfss://`` and ``/Volumes/...`` all resolve through
``pyarrow.fs``; S3 (``s3://``, ``s3a://``) with the settings of Spark's S3A connector
(:mod:`spark_ckpt.storage.s3`). *Create-if-absent* is atomic on local storage (``link``) and
on S3 (a conditional PUT, ``If-None-Match: *``); on the other object stores, and on an S3
server without conditional writes, it is check-then-write, with a warning naming the
guarantee lost (the Delta fence still decides who commits). *Rename* is a copy then a delete
on object stores.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterable
from typing import Any

import pyarrow.fs as pafs

from spark_ckpt.storage import faulty as faultfs
from spark_ckpt.storage import s3

__all__ = ["Storage", "delta_options", "delta_table", "human_size", "is_delta_table", "join",
           "resolve", "stat_any"]

# Spark's names of schemes pyarrow knows by another: Hadoop's S3A (and the older S3N) are S3
_PYARROW_SCHEMES = {"s3a": "s3", "s3n": "s3"}
# object stores whose pyarrow paths start with the bucket (or ADLS container) where Spark's URI
# has its authority; on the others (HDFS, ...) pyarrow's path is the URI's absolute path
_BUCKET_SCHEMES = {"s3", "s3a", "s3n", "gs", "gcs", "abfs", "abfss", "az", "wasb", "wasbs"}


def _from_uri(uri: str) -> tuple[pafs.FileSystem, str]:
    return pafs.FileSystem.from_uri(uri)


def resolve(uri: str) -> tuple[pafs.FileSystem, str]:
    """pyarrow's file system and path for a URI Spark takes (``s3a://`` is pyarrow's S3)."""
    if "://" in uri:
        scheme, rest = uri.split("://", 1)
        if scheme.lower() in s3.S3_SCHEMES:
            fs = s3.filesystem()  # configured from spark.hadoop.fs.s3a.*
            if fs is not None:
                return fs, rest.split("?", 1)[0].rstrip("/")
        uri = f"{_PYARROW_SCHEMES.get(scheme.lower(), scheme)}://{rest}"
    return _from_uri(uri)


def delta_options(uri: str) -> dict[str, str] | None:
    """delta-rs's ``storage_options`` for a table at ``uri`` (S3: the endpoint, credentials
    and conditional commits of :mod:`spark_ckpt.storage.s3`; None elsewhere)."""
    return s3.delta_options(uri)


def delta_table(uri: str, version: int | None = None) -> Any:
    """delta-rs's ``DeltaTable`` at ``uri`` (and ``version``) with :func:`delta_options`."""
    from deltalake import DeltaTable

    return DeltaTable(uri, version=version, storage_options=delta_options(uri))


def is_delta_table(uri: str) -> bool:
    """Whether a Delta table is at ``uri`` (:func:`delta_options` for its store)."""
    from deltalake import DeltaTable

    return bool(DeltaTable.is_deltatable(uri, storage_options=delta_options(uri)))


def join(base: str, *parts: str) -> str:
    """Join path segments with ``/`` whatever the scheme."""
    out = base.rstrip("/")
    for part in parts:
        out = out + "/" + part.strip("/")
    return out


class Storage:
    """A resolved file system plus the URI prefix its paths are relative to."""

    def __init__(self, uri: str) -> None:
        if "://" not in uri and not uri.startswith("file:"):
            uri = os.path.abspath(uri)
        self._fs, root = resolve(uri)
        self.local = isinstance(self._fs, pafs.LocalFileSystem)
        # Spark's scheme and authority, and the first segment of pyarrow's paths they stand
        # for: the bucket on S3 and GCS, the container on ADLS, whose Spark authority is
        # ``container@account.dfs.core.windows.net``
        self._scheme, _, rest = uri.partition("://")
        self._authority = rest.split("/", 1)[0].split("?", 1)[0]
        self._bucketed = self._scheme.lower() in _BUCKET_SCHEMES
        self._first = root.lstrip("/").split("/", 1)[0] if self._bucketed else ""
        # Callers' direct ``fs`` calls meet the fault rules of the tests (faultfs); this
        # class's own operations check them once, on the unwrapped file system.
        self.fs = faultfs.wrap(self._fs)
        self.root = root.rstrip("/") or "/"
        self.uri = uri

    # Paths handed to Spark and delta-rs must be URIs or absolute local paths.
    def spark_path(self, path: str) -> str:
        """The URI Spark and delta-rs take for a path of this file system; a URI is returned
        as it is (the conversion is idempotent)."""
        if self.local or "://" in path or path.startswith("file:"):
            return path
        if not self._bucketed:  # hdfs://namenode:8020 + pyarrow's absolute path
            return f"{self._scheme}://{self._authority}/{path.lstrip('/')}"
        first, _, rest = path.lstrip("/").partition("/")
        authority = self._authority if first == self._first else first
        return f"{self._scheme}://{authority}/{rest}" if rest else \
            f"{self._scheme}://{authority}"

    def fs_path(self, path_or_uri: str) -> str:
        """The path this file system takes for a path or URI it handed out (idempotent)."""
        if self.local:
            if path_or_uri.startswith("file://"):
                return path_or_uri[len("file://"):]
            return path_or_uri.removeprefix("file:")
        if "://" not in path_or_uri:
            return path_or_uri
        authority, _, rest = path_or_uri.split("://", 1)[1].partition("/")
        if not self._bucketed:
            return "/" + rest
        first = self._first if authority == self._authority else authority
        return f"{first}/{rest}" if rest else first

    def path(self, *parts: str) -> str:
        return join(self.root, *parts)

    def makedirs(self, path: str) -> None:
        self._fs.create_dir(path, recursive=True)

    def exists(self, path: str) -> bool:
        return self._fs.get_file_info(path).type != pafs.FileType.NotFound

    def list_files(self, path: str, *, recursive: bool = True) -> list[pafs.FileInfo]:
        if faultfs.active("list", path):
            raise faultfs.enospc("list", path)
        selector = pafs.FileSelector(path, allow_not_found=True, recursive=recursive)
        return [i for i in self._fs.get_file_info(selector) if i.type == pafs.FileType.File]

    def read_bytes(self, path: str) -> bytes:
        rule = faultfs.active("read", path)
        with self._fs.open_input_stream(path) as stream:
            data = stream.read()
        if rule is not None:
            if rule.action == "torn":
                return rule.tear(data)
            raise faultfs.enospc("read", path)
        return data

    def _local_temp(self, path: str, data: bytes, rule: faultfs.Rule | None = None) -> str:
        """Write ``data`` durably to a temporary file beside ``path``; return its name."""
        self.makedirs(path.rsplit("/", 1)[0])
        tmp = f"{path}.tmp-{uuid.uuid4().hex}"
        with open(tmp, "wb") as f:
            if rule is not None and rule.action == "enospc":  # a full disk: part, then error
                f.write(data[: len(data) // 2])
                os.unlink(tmp)
                raise faultfs.enospc("write", path)
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        return tmp

    def _torn(self, path: str, data: bytes, rule: faultfs.Rule | None) -> None:
        """A crash mid-write on a store that publishes bytes as they come (faultfs ``torn``)."""
        if rule is not None and rule.action == "torn":
            with self._fs.open_output_stream(path) as out:
                out.write(rule.tear(data))
            faultfs.crash()

    def write_atomic(self, path: str, data: bytes) -> None:
        """Write ``data`` so that readers see either nothing or all of it."""
        rule = faultfs.active("write", path)
        self._torn(path, data, rule)
        if self.local:
            os.replace(self._local_temp(path, data, rule), path)
            return
        if rule is not None:
            raise faultfs.enospc("write", path)
        self.makedirs(path.rsplit("/", 1)[0])
        with self._fs.open_output_stream(path) as out:  # object stores publish a PUT whole
            out.write(data)

    def create_exclusive(self, path: str, data: bytes) -> bool:
        """Create ``path`` holding ``data`` only if it does not exist; True if this call made it."""
        rule = faultfs.active("create", path)
        if self.local:
            tmp = self._local_temp(path, data, rule)
            if rule is not None and not os.path.exists(path):
                os.unlink(tmp)
                self._torn(path, data, rule)
            try:
                os.link(tmp, path)  # atomic, fails if path exists
            except FileExistsError:
                return False
            finally:
                os.unlink(tmp)
            return True
        where = f"{self._scheme}://{self._authority}"
        if isinstance(self._fs, pafs.S3FileSystem):
            if rule is None:  # (an injected fault takes the check-then-write path below)
                created = s3.put_if_absent(path, data)  # If-None-Match: *
                if created is not None:
                    return created
                s3.warn_check_then_write(where, "no conditional PUT: botocore is not "
                                         "installed or the server does not implement "
                                         "If-None-Match")
        else:
            s3.warn_check_then_write(where, f"pyarrow's {type(self._fs).__name__} has no "
                                     "conditional write")
        if self.exists(path):
            return False
        self._torn(path, data, rule)
        if rule is not None:
            raise faultfs.enospc("create", path)
        self.makedirs(path.rsplit("/", 1)[0])
        with self._fs.open_output_stream(path) as out:
            out.write(data)
        return True

    def move(self, src: str, dst: str) -> None:
        if faultfs.active("rename", src):
            raise faultfs.enospc("rename", src)
        self.makedirs(dst.rsplit("/", 1)[0])
        self._fs.move(src, dst)

    def link_or_copy(self, src: str, dst: str) -> None:
        """Make ``dst`` hold ``src``'s bytes: a hard link on a local disk (no copy; both names
        stay valid when either is deleted), else the store's copy (server-side on S3/GCS).
        An existing ``dst`` is replaced."""
        self.makedirs(dst.rsplit("/", 1)[0])
        if self.local:
            head, _, name = dst.rpartition("/")
            tmp = f"{head}/.{name}.link-{uuid.uuid4().hex}"  # hidden from the directory's readers
            try:
                os.link(src, tmp)
            except OSError:  # another device, or links not supported: copy
                self._fs.copy_file(src, tmp)
            os.replace(tmp, dst)
            return
        self._fs.copy_file(src, dst)

    def delete_file(self, path: str) -> None:
        """Remove ``path``; no error if it is already gone."""
        if faultfs.active("delete", path):
            raise faultfs.enospc("delete", path)
        try:
            self._fs.delete_file(path)
        except FileNotFoundError:
            pass

    def delete_dir(self, path: str) -> None:
        if faultfs.active("delete", path):
            raise faultfs.enospc("delete", path)
        if self.exists(path):
            self._fs.delete_dir(path)


def stat_any(paths: Iterable[str]) -> list[int | None]:
    """Sizes (None if missing) of absolute local paths or URIs, one listing call per file system."""
    paths = list(paths)
    groups: dict[str, list[int]] = {}
    for i, p in enumerate(paths):
        prefix = p.split("://", 1)[0] + "://" + p.split("://", 1)[1].split("/", 1)[0] \
            if "://" in p and not p.startswith("file://") else ""
        groups.setdefault(prefix, []).append(i)
    sizes: list[int | None] = [None] * len(paths)
    for prefix, indexes in groups.items():
        if not prefix:  # os.stat: about ten times faster than a pyarrow call per file
            for i in indexes:
                try:
                    sizes[i] = os.stat(paths[i].removeprefix("file://")).st_size
                except (FileNotFoundError, NotADirectoryError):
                    sizes[i] = None
            continue
        store = Storage(prefix)
        names = [store.fs_path(paths[i]) for i in indexes]
        for i, info in zip(indexes, store.fs.get_file_info(names), strict=True):
            sizes[i] = None if info.type == pafs.FileType.NotFound else info.size
    return sizes


def human_size(n: float | None) -> str:
    """``1.5 MiB`` for 1572864; ``-`` for None."""
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)
