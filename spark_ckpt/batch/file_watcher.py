"""Turning the files of one run unit's writes into finished partitions, as they appear.

Hash mode: partition *j* is finished once each write has its file ``part-0000j-*`` (the v2
committer moves a task's file into place when the task commits), or once the write ended
without one (an empty partition); written positionally, partition ``parts[i]``'s file is
``part-0000i-*`` (:func:`spark_ckpt.batch.planning.writes_positionally`). Partitioned sink
writes, whose tasks move several files, count only when their Spark job ended. Split mode:
every partition of the wave, when the last write ended; but a wave of map-side partial
aggregates, each of whose tasks reads files of one split (``task_parts``: several tasks a
split where the function aggregates its input several ways, or a split has several files),
records a split once every task of it has its file. Each write a unit makes is a
:class:`UnitWrite`: the directory only it writes, watched here.

Thread ownership: a :class:`FileWatcher` belongs to the thread writing its unit; with per-task
commits its :meth:`~FileWatcher.poll` runs in a poller thread of its own while the writes run,
and :meth:`~FileWatcher.finish` runs after that thread was joined, so never both at once.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from typing import TYPE_CHECKING, Any

from spark_ckpt.batch.planning import hash_mode
from spark_ckpt.errors import TaskExecutionError
from spark_ckpt.execution.result_partition import OutputFile, PartitionResult
from spark_ckpt.faults import fault_point
from spark_ckpt.sinks import partition_values, written_files
from spark_ckpt.sparkapi.committers import commits_per_task, task_partition
from spark_ckpt.storage import Storage

if TYPE_CHECKING:
    from spark_ckpt.batch.job_attempt import Attempt
    from spark_ckpt.batch.job_progress import JobProgress
    from spark_ckpt.execution.job_graph import JobVertex

__all__ = ["FileWatcher", "UnitWrite"]

log = logging.getLogger(__name__)


@dataclasses.dataclass
class UnitWrite:
    """One Spark write of a run unit: the result files, or one sink's staged files.

    ``done`` is set by the thread writing the unit when Spark's write ended (read by the
    poller thread, which takes one snapshot of it per poll)."""

    kind: str  # "result" or "sink"
    target: str  # vertex id or sink name
    directory: str  # Spark URI of a directory only this write uses
    partition_by: tuple[str, ...] = ()
    done: bool = False
    # Written bucketed by these columns into ``buckets`` buckets (batch.cuts' exchange cuts):
    # file .../<wave>-b<buckets>/spark_ckpt_bucket=<j>/part-..._<j>.c000.parquet holds the
    # wave's rows of bucket j, which a bucketed table over the waves reads as bucket j.
    bucket_by: tuple[str, ...] = ()
    buckets: int = 0
    # Another write of the same rows with the same layout: this one's files are that one's,
    # linked (or copied) into this directory, so Spark writes the rows once.
    mirror_of: UnitWrite | None = None


class FileWatcher:
    """Records the partitions of one run unit whose files are in place (see the module's
    docstring)."""

    def __init__(self, job: Attempt, schemas: dict[str, str], progress: JobProgress,
                 vertex: JobVertex, parts: list[int], writes: list[UnitWrite],
                 executions: dict[int, Any], started_ms: int,
                 positional: bool = False, task_parts: list[int] | None = None) -> None:
        self.job = job
        self.schemas = schemas  # the output schema (JSON) of each vertex
        self.progress = progress
        self.positional = positional
        self.vertex = vertex
        self.parts = parts
        self.writes = writes
        self.executions = executions
        self.started_ms = started_ms
        self.recorded: set[int] = set()
        self.hash = hash_mode(vertex)
        # each task's file holds one partition: the partition's own (not a wave's, shared);
        # map-side partials: task i computes partition task_parts[i] (-1: none, it reads no
        # file), a partition as many tasks as read its files
        self.task_parts = task_parts
        self.tasks_of = {p: 0 for p in parts}
        for p in task_parts or ():
            if p in self.tasks_of:
                self.tasks_of[p] += 1
        self.own_files = self.hash or task_parts is not None
        self.per_task = self.own_files and commits_per_task(job.spark)
        self._footers: dict[str, tuple[int, int]] = {}
        self._linked: set[str] = set()  # mirror files in place (a wave's, once for the wave)

    def _partition_of(self, index: int | None) -> int | None:
        """The partition Spark partition ``index`` of a write holds (None: not a task's file;
        -1: none, a Spark partition past the positional layout's, which never has rows)."""
        if index is not None and self.task_parts is not None:
            return self.task_parts[index] if index < len(self.task_parts) else -1
        if index is None or not self.positional:
            return index
        return self.parts[index] if index < len(self.parts) else -1

    def _listing(self) -> list[list[tuple[str, int | None]]]:
        """Every write's files from one listing of each directory Spark writes; a mirror's
        are where its source's files go (linked when their partition is recorded)."""
        out: dict[int, list[tuple[str, int | None]]] = {}
        for i, w in enumerate(self.writes):
            if w.mirror_of is None:
                out[i] = self._files(w)
        for i, w in enumerate(self.writes):
            if w.mirror_of is not None:
                source = out[self.writes.index(w.mirror_of)]
                out[i] = [(self._mirror_path(w, path), index) for path, index in source]
        return [out[i] for i in range(len(self.writes))]

    def _files(self, write: UnitWrite) -> list[tuple[str, int | None]]:
        """(path, Spark partition) of each data file the write has made visible."""
        assert write.mirror_of is None
        store = Storage(write.directory)
        out = []
        for info, _relative in written_files(store, store.root):
            out.append((store.spark_path(info.path), task_partition(info.base_name)))
        return out

    @staticmethod
    def _mirror_path(write: UnitWrite, source_path: str) -> str:
        assert write.mirror_of is not None
        relative = source_path[len(write.mirror_of.directory.rstrip("/")) + 1:]
        return f"{write.directory.rstrip('/')}/{relative}"

    def _link(self, write: UnitWrite, path: str) -> None:
        """Put a mirror's file in place (idempotent): the source's bytes under its name."""
        assert write.mirror_of is not None
        if path in self._linked:
            return
        source = f"{write.mirror_of.directory.rstrip('/')}/" \
                 f"{path[len(write.directory.rstrip('/')) + 1:]}"
        store = Storage(write.directory)
        store.link_or_copy(store.fs_path(source), store.fs_path(path))
        self._linked.add(path)
        if source in self._footers:
            self._footers[path] = self._footers[source]

    def _footer(self, path: str) -> tuple[int, int]:
        import pyarrow.parquet as pq

        if path not in self._footers:
            store = Storage(path)
            size = store.fs.get_file_info(store.root).size
            rows = pq.read_metadata(store.root, filesystem=store.fs).num_rows
            self._footers[path] = (size, rows)
        return self._footers[path]

    def _output(self, write: UnitWrite, path: str) -> OutputFile:
        size, rows = self._footer(path)
        relative = path[len(write.directory.rstrip("/")) + 1:]
        values = partition_values(relative) if write.partition_by else {}
        return OutputFile(write.kind, write.target, path, size, rows, {}, values)

    def poll(self, stop: threading.Event) -> None:
        """Record what is visible every poll interval until ``stop`` is set (a poller
        thread's loop)."""
        interval = self.job.settings.batch_poll_interval_ms / 1000.0
        while not stop.wait(interval):
            try:
                self.record_visible()
            except Exception as exc:  # noqa: BLE001 - e.g. fenced: the write thread reports it too
                log.error("Job %s: recording finished partitions of %s failed: %s",
                          self.job.run_id, self.vertex.id, exc)
                return

    def record_visible(self) -> None:
        """Record every partition whose files are all in place (or whose writes ended)."""
        # One snapshot of which writes ended, taken before listing: a write that ends while
        # this poll lists must not make a partition whose file the listing missed look empty.
        done = [w.done for w in self.writes]
        listing = self._listing()
        by_write: list[dict[int, list[str]]] = []
        tasks: list[dict[int, set[int | None]]] = []  # the tasks whose files are in place
        for w, ended, listed in zip(self.writes, done, listing, strict=True):
            files: dict[int, list[str]] = {}
            seen: dict[int, set[int | None]] = {}
            if ended or (self.per_task and not w.partition_by):
                for path, index in listed:
                    p = self._partition_of(index)
                    if p is not None:
                        files.setdefault(p, []).append(path)
                        seen.setdefault(p, set()).add(index)
            by_write.append(files)
            tasks.append(seen)
        for p in self.parts:
            if p in self.recorded:
                continue
            # (a task that wrote no rows has no file: its partition waits for the write's end;
            # every task of it must have its file, so tasks are counted; a task writes one
            # file (PER_TASK_WRITE_OPTIONS), and where one wrote several, moved into place one
            # by one, its partition waits for the write's end too)
            ready = all(ended or (len(seen.get(p, ())) >= max(1, self.tasks_of[p]) and
                                  len(files.get(p, ())) == len(seen.get(p, ())))
                        for ended, seen, files in zip(done, tasks, by_write, strict=True))
            if ready:
                self._record(p, [(w, path) for w, files in zip(self.writes, by_write,
                                                                 strict=True)
                                 for path in files.get(p, [])])

    def finish(self) -> None:
        """Record the unit's partitions once every write ended."""
        if self.own_files:
            if self.hash or self.task_parts is not None:
                self.check_attribution()
            self.record_visible()  # every write has ended: the rest, empty ones included
            return
        files = [(w, path) for w, listed in zip(self.writes, self._listing(), strict=True)
                 for path, _ in listed]
        for p in self.parts:
            self._record(p, files)

    def check_attribution(self) -> None:
        """Fail when a file holds rows of a partition not running (the function changed its
        key columns)."""
        running = set(self.parts)
        for w in self.writes:
            if w.mirror_of is not None:
                continue
            for path, index in self._files(w):
                p = self._partition_of(index)
                if p is not None and p not in running and self._footer(path)[1]:
                    which = f"partition {p}" if p >= 0 else "a partition"
                    if self.task_parts is not None:  # spark_ckpt's own mapping is wrong
                        raise TaskExecutionError(
                            f"vertex {self.vertex.id}: map task {index} of partitions "
                            f"{self.parts[0]}..{self.parts[-1]} wrote rows of {which}, which "
                            "it reads no file of (a scheduling bug; nothing was recorded "
                            "for it)")
                    raise TaskExecutionError(
                        f"vertex {self.vertex.id}: rows of {which}, which is not "
                        f"running, came out of partitions {self.parts[0]}..{self.parts[-1]}; the "
                        f"function must keep its key columns {list(self.vertex.key)} unchanged, "
                        "so each output row stays in the partition of its input"
                    )

    def _record(self, partition: int, files: list[tuple[UnitWrite, str]]) -> None:
        for w, path in files:
            if w.mirror_of is not None:
                self._link(w, path)  # in place before the event that names it is logged
        outputs = tuple(self._output(w, path) for w, path in files)
        fault_point("partition.written")
        first = self.writes[0] if self.writes else None
        rows = sum(o.rows for o in outputs if first is not None and o.target == first.target)
        result = PartitionResult(
            vertex_id=self.vertex.id, partition=partition,
            attempt_id=self.executions[partition].attempt_id,
            started_ms=self.started_ms, finished_ms=self.job.clock.now_ms(), rows=rows,
            outputs=outputs, schema=self.schemas[self.vertex.id],
            shared=() if self.own_files else tuple(self.parts),
        )
        if self.job.partition_finished(result):
            self.recorded.add(partition)
            self.progress.advance(self.vertex.id)
        elif (self.vertex.id, partition) in self.job.finished:
            self.recorded.add(partition)
