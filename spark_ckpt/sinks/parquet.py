"""A Parquet directory: the commit checks every staged file, creates the marker
``_spark_ckpt_commits/<job>-v<version>.json`` create-if-absent (only one driver can), moves the
files into place and marks the marker committed. A crash in between is finished by the next
attempt from the marker's file list, as MapReduce's committer recovers; a new version is never
begun while an earlier one of the same job is half done."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from spark_ckpt.errors import CommitError, FormatVersionError, JobDefinitionError, RecordError
from spark_ckpt.execution.job_graph import SinkSpec
from spark_ckpt.execution.result_partition import OutputFile
from spark_ckpt.faults import fault_point
from spark_ckpt.formats import dump_record, load_record
from spark_ckpt.sinks.files import check_files
from spark_ckpt.sinks.sink import Sink
from spark_ckpt.storage import Storage, join

if TYPE_CHECKING:
    from pyspark.sql.types import StructType

__all__ = ["ParquetSink"]

log = logging.getLogger(__name__)


class ParquetSink(Sink):
    def __init__(self, spec: SinkSpec, job_id: str) -> None:
        super().__init__(spec, job_id)
        if spec.mode != "append":
            raise JobDefinitionError(
                f"Parquet sink {spec.name}: expected mode 'append', found {spec.mode!r}; a "
                "Parquet directory cannot be replaced atomically (use a Delta sink)"
            )
        self.store = Storage(spec.path)
        self.staging = join(self.store.root, "_spark_ckpt_staging", job_id)
        self.commits = join(self.store.root, "_spark_ckpt_commits")

    def prepare(self, schema: StructType) -> None:
        self.store.makedirs(self.staging)
        self._finish_half_done()

    def _finish_half_done(self) -> None:
        """Complete any commit of this job that a crash left half done, before a new one."""
        for version in self.versions():
            marker = self.read_marker(version)
            if marker is not None and marker["status"] == "committing":
                log.warning("Parquet sink %s: finishing commit v%d of job %s, begun before",
                            self.spec.name, version, self.job_id)
                self._move(version, marker)

    def locate(self, paths: list[str]) -> list[str]:
        moved: dict[str, str] | None = None
        out = []
        for path in paths:
            if self.store.exists(self.store.fs_path(path)):
                out.append(path)
                continue
            if moved is None:
                moved = {}
                for version in self.versions():
                    marker = self.read_marker(version)
                    if marker is not None:
                        moved.update({src: dst for src, dst, _ in marker["moves"]})
            dst = moved.get(self.store.fs_path(path))
            out.append(self.store.spark_path(dst) if dst else path)
        return out

    def _marker(self, version: int) -> str:
        return join(self.commits, f"{self.job_id}-v{version:05d}.json")

    def versions(self) -> list[int]:
        prefix = f"{self.job_id}-v"
        return sorted(int(i.base_name[len(prefix):-5]) for i in
                      self.store.list_files(self.commits, recursive=False)
                      if i.base_name.startswith(prefix) and i.base_name.endswith(".json")
                      and i.base_name[len(prefix):-5].isdigit())

    def next_version(self) -> int:
        return max(self.versions(), default=0) + 1

    def purge_markers(self, below: int) -> int:
        """Delete the commit markers of versions ``< below`` (a streaming sink's batches
        whose records are purged: they never run again); return how many went."""
        gone = 0
        for version in self.versions():
            if version >= below:
                break
            self.store.fs.delete_file(self._marker(version))
            gone += 1
        return gone

    def read_marker(self, version: int) -> dict[str, Any] | None:
        """The commit marker of ``version`` (None when there is none); a torn one stops
        the commit with a RecordError naming the file."""
        path = self._marker(version)
        if not self.store.exists(path):
            return None
        try:
            return load_record(self.store.read_bytes(path), "parquet-sink-commit", (1,),
                               where=self.store.spark_path(path))
        except RecordError:
            raise
        except FormatVersionError as exc:
            # A torn marker (a crash mid-write on a store without atomic publish) could be a
            # "committing" one (nothing moved) or a "committed" one (every file moved): no
            # guess is safe, so the commit stops here and names the file.
            raise RecordError(
                f"Parquet sink {self.spec.name}: commit marker {self.store.spark_path(path)}: "
                f"{exc}; its files may or may not have been moved, so it is neither redone "
                "nor skipped: compare its staged and committed files and restore the marker"
            ) from exc

    def is_committed(self, version: int) -> bool:
        marker = self.read_marker(version)
        return marker is not None and marker["status"] == "committed"

    def commit(self, files: list[OutputFile], version: int) -> dict[str, Any]:
        existing = self.read_marker(version)
        if existing is None:
            check_files(self.spec.name, files)  # before the marker: a refused commit leaves none
            moves = []
            depth = len(self.spec.partition_by) + 1  # <p1=..>/.../<file> under its write dir
            for f in files:
                relative = "/".join(self.store.fs_path(f.path).split("/")[-depth:])
                moves.append([self.store.fs_path(f.path), join(self.store.root, relative),
                              f.size])
            body = {"job_id": self.job_id, "version": version, "status": "committing",
                    "moves": moves}
            if self.store.create_exclusive(self._marker(version),
                                           dump_record("parquet-sink-commit", 1, body)):
                return self._move(version, body)
            existing = self.read_marker(version)
            if existing is None:
                raise CommitError(
                    f"Parquet sink {self.spec.name}: commit marker v{version} existed when "
                    f"this driver tried to create it, then was gone ({self._marker(version)})"
                )
        if existing["status"] == "committed":
            return {"skipped": True}
        log.warning("Parquet sink %s: finishing commit v%d begun by an earlier attempt of "
                    "job %s", self.spec.name, version, self.job_id)
        return self._move(version, existing)

    def _move(self, version: int, body: dict[str, Any]) -> dict[str, Any]:
        moves = body["moves"]
        for i, (src, dst, _size) in enumerate(moves):
            src_exists, dst_exists = self.store.exists(src), self.store.exists(dst)
            if src_exists:
                self.store.move(src, dst)
            elif not dst_exists:
                raise CommitError(
                    f"Parquet sink {self.spec.name}: commit v{version} lost {src}; it is "
                    f"neither staged nor at {dst}"
                )
            if i == 0:
                fault_point("sink.commit.files")
        self.store.write_atomic(
            self._marker(version),
            dump_record("parquet-sink-commit", 1, body | {"status": "committed"}))
        self.store.delete_dir(self.staging)  # what is left: files of no committed partition
        return {"files": len(moves)}
