"""What a job's vertices read, as digests: a vertex's lineage (recovery tells inputs apart by
it, and a Spark Connect driver adopts only the writes of a killed client that read the same)
and the job's inputs tag (put in a plan a Spark Connect server keeps, so a frame computed from
files since rewritten never matches).

:class:`Lineages` caches each digest once computed: the job's thread and its wave threads may
both ask, and what a vertex reads is finished before it runs and stays so while it runs, so
two threads computing one digest at once compute the same value.
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING, Any

from spark_ckpt.sources.job_inputs import FileSource

if TYPE_CHECKING:
    from spark_ckpt.batch.job_attempt import Attempt
    from spark_ckpt.execution.job_graph import JobVertex

__all__ = ["Lineages"]


class Lineages:
    """The lineages of one attempt's vertices and its inputs tag, each computed once."""

    def __init__(self, job: Attempt, splits: dict[str, list[Any]]) -> None:
        self.job = job
        self.graph = job.graph
        self.splits = splits
        self._tag: str | None = None  # inputs_tag(), once known ("" for none)
        self._lineages: dict[str, str | None] = {}  # of() per vertex, once known

    def of(self, vertex: JobVertex) -> str | None:
        """What ``vertex`` reads, as recovery tells inputs apart: its definition, and for each
        input the finished partitions it reads (by attempt id: a partition run again is
        another input), a source's files and their identities (size, modification time,
        object version), or an inline vertex's own lineage. Equal lineages read the same rows.
        None when a source is not files. Computed once per vertex (what it reads is finished
        before it runs, and stays so while it runs)."""
        if vertex.id not in self._lineages:
            digest = hashlib.sha256()
            self._lineages[vertex.id] = digest.hexdigest()[:32] \
                if self._lineage_into(digest, vertex) else None
        return self._lineages[vertex.id]

    def _lineage_into(self, digest: Any, vertex: JobVertex) -> bool:
        digest.update(f"{vertex.id}\0{vertex.fingerprint()}\0{vertex.parallelism}\0"
                      f"{list(vertex.key)}\n".encode())
        if vertex.is_source:
            if not isinstance(vertex.source, FileSource):
                return False
            files = self.job.input_files.get(vertex.id, {})
            for j, split in enumerate(self.splits.get(vertex.id, [])):
                for path, size in split:
                    known = files.get(path)
                    digest.update(f"{j}\0{path}\0{size}\0{known and known.token()}\n".encode())
            return True
        for edge in vertex.inputs:
            upstream = self.graph.vertices[edge.upstream]
            digest.update(f"{edge.upstream}\0{edge.kind}\0{list(edge.columns)}\n".encode())
            done = [self.job.finished.get((upstream.id, p)) for p in range(upstream.parallelism)]
            if upstream.durable and not upstream.is_source and all(done):
                for f in done:
                    assert f is not None
                    digest.update(f"{f.partition}\0{f.attempt_id}\n".encode())
            elif not self._lineage_into(digest, upstream):
                return False
        return True

    def inputs_tag(self) -> str | None:
        """What this job reads, as it reads it: every file source's files and their
        identities (size, modification time, object version, as recovery compares them),
        with the job's id. Spark finds a persisted frame by its plan, and a plan names files
        by path only: the tag, put in the plan, keeps a frame computed from files since
        rewritten from matching. None when a source is not files."""
        if self._tag is None:
            digest = hashlib.sha256(self.job.run_id.encode())
            for vertex in sorted(self.graph.vertices.values(), key=lambda v: v.id):
                if not vertex.is_source:
                    continue
                if not isinstance(vertex.source, FileSource):
                    self._tag = ""
                    break
                files = self.job.input_files.get(vertex.id, {})
                for j, split in enumerate(self.splits.get(vertex.id, [])):
                    for path, size in split:
                        known = files.get(path)
                        digest.update(f"{vertex.id}\0{j}\0{path}\0{size}\0"
                                      f"{known and known.token()}\n".encode())
            else:
                self._tag = digest.hexdigest()[:32]
        return self._tag or None
