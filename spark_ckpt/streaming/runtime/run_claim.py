"""A driver's claim of a pipeline's checkpoint directory: the pipeline's metadata, the run
marker and the fence.

A start writes ``metadata.json`` (refusing a directory of another pipeline, changed sources or
a changed source schema, and fixing the pipeline id, its lineage and the recorded schemas on
the :class:`PipelineDefinition`), then numbers its run (``runs/<n>.json``, create-if-absent)
and claims the directory with a fence commit, which decides ownership even where
create-if-absent is not atomic (object stores). The newest run owns the directory: an older
driver's :meth:`RunClaim.check_fenced` raises :class:`JobFencedError`.

Threads and owners: the user's thread writes the metadata and claims the run in ``start()``,
before any of the pipeline's threads runs; from then on ``run``, ``claimed_at`` and
``owner_tag`` are read-only, and any thread (the loop, the JobScheduler, the coordinator, the
generator, housekeeping) may call :meth:`RunClaim.check_fenced`.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from spark_ckpt.errors import JobDefinitionError, JobFencedError
from spark_ckpt.formats import dump_record
from spark_ckpt.storage import join
from spark_ckpt.storage.fencing import Fence, client_session, interrupt_earlier_clients
from spark_ckpt.streaming.runtime.pipeline_dir import METADATA_VERSION, read_pipeline_metadata
from spark_ckpt.streaming.runtime.runs import run_numbers

if TYPE_CHECKING:
    from spark_ckpt.sources.source import Source
    from spark_ckpt.streaming.template.definition import PipelineDefinition

__all__ = ["RunClaim", "absolute_path"]


def absolute_path(path: str) -> str:
    """A local path made absolute (a relative spark.ckpt.checkpoint.dir means the driver's
    working directory, which the tools do not know); URIs as they are."""
    if not path or "://" in path or path.startswith("file:"):
        return path
    return os.path.abspath(path)


class RunClaim:
    """The metadata, the run marker and the fence of one driver on a pipeline's directory.
    ``sources`` is the pipeline's list of sources (the user's thread adds to it until
    ``start()``)."""

    def __init__(self, definition: PipelineDefinition, sources: Sequence[Source],
                 batch_interval: float) -> None:
        self._definition = definition
        self._sources = sources
        self._batch_interval = batch_interval
        self._fence = Fence(definition.storage, definition.root,
                            f"pipeline {definition.name}", clock=definition.clock)
        self.run: int | None = None  # this driver's run number, once claimed
        self.claimed_at: Any = None  # when this run claimed the directory (storage clock)
        self.owner_tag = ""  # tags every Spark operation of this run (Spark Connect)

    def write_metadata(self) -> None:
        """Check the directory's ``metadata.json`` against the template and write it anew."""
        d = self._definition
        path = join(d.root, "metadata.json")
        sources = {s.name: s.describe() for s in self._sources}
        record = read_pipeline_metadata(d.storage, d.root)  # as the tools read it
        if record is not None:
            if record["name"] != d.name:
                raise JobDefinitionError(
                    f"checkpoint directory {d.storage.uri} belongs to pipeline "
                    f"{record['name']!r}, not {d.name!r}"
                )
            if sorted(record["sources"]) != sorted(sources):
                raise JobDefinitionError(
                    f"pipeline {d.name}: the checkpoint records sources "
                    f"{sorted(record['sources'])}, the template declares {sorted(sources)}; "
                    "sources cannot change under a checkpoint (use a new checkpoint directory)"
                )
            d.schemas = dict(record.get("schemas", {}))
            d.pipeline_id = str(record.get("pipeline_id", ""))
        elif not d.pipeline_id:
            d.pipeline_id = uuid.uuid4().hex[:16]
        if d.pipeline_id:
            d.lineage = f"{d.name}-{d.pipeline_id}"
        schemas = {s.name: s.schema().json() for s in self._sources}
        for name, schema in schemas.items():
            old = d.schemas.get(name)
            if old and old != schema:
                raise JobDefinitionError(
                    f"pipeline {d.name}: source {name} was recorded with schema "
                    f"{old}, the template now gives {schema}"
                )
        body = {"name": d.name, "pipeline_id": d.pipeline_id, "sources": sources,
                "schemas": schemas,
                "outputs": {o.name: (o.sink or o.two_phase).describe()
                            for o in d.graph.outputs},
                "operators": {op.operator: {"kind": op.kind, "keys": list(op.keys)}
                              for op in d.graph.stateful},
                "batch_interval_s": self._batch_interval,
                # where its checkpoints are (spark.ckpt.checkpoint.dir may put them elsewhere):
                # spark-ckpt status, cleanup and report find them without being told
                # relative when inside this directory: a copy's tools find its own
                "checkpoints": absolute_path(d.settings.checkpoint_dir) or "checkpoints"}
        d.schemas = schemas
        d.storage.write_atomic(path, dump_record("pipeline-metadata", METADATA_VERSION, body))

    def claim(self) -> int:
        """Number this driver's run (``runs/<n>.json``) and claim the checkpoint directory
        with a fence commit; the run, when it was claimed and the owner tag are kept."""
        d = self._definition
        runs = join(d.root, "runs")
        d.storage.makedirs(runs)
        while True:
            number = max(self.runs(), default=0) + 1
            tag = f"spark_ckpt-{d.lineage}-r{number}"
            body = {"pipeline": d.name, "started_ms": d.clock.now_ms(),
                    **client_session(d.spark, tag)}
            if d.storage.create_exclusive(join(runs, f"{number:08d}.json"),
                                          dump_record("pipeline-run", 1, body)):
                self._fence.claim(f"run {number}")
                self.owner_tag = tag
                interrupt_earlier_clients(
                    d.spark, d.storage,
                    [join(runs, f"{n:08d}.json") for n in range(max(1, number - 3), number)],
                    "pipeline-run", f"Pipeline {d.name} run {number}")
                self.run = number
                self.claimed_at = self._claimed_at()
                return number

    def runs(self) -> list[int]:
        """The runs claimed in the directory, oldest first."""
        return run_numbers(self._definition.storage, self._definition.root)

    def _claimed_at(self) -> Any:
        """When this driver claimed the checkpoint directory, by the storage's own clock (the
        modification time of its run marker): a file modified since then is not a crashed
        run's leftover but a newer driver's work (found racing two real drivers: the loser's
        start-up deleted the owner's fresh state file between its fence check and the
        deletion)."""
        if self.run is None:
            return None
        d = self._definition
        return d.storage.fs.get_file_info(join(d.root, "runs", f"{self.run:08d}.json")).mtime

    def check_fenced(self) -> None:
        """Raise if a newer driver claimed this checkpoint directory (any thread). The fence
        alone decides: two drivers started at once can commit their fence claims in the
        other order than they numbered their runs, and a second rule (a newer run marker
        exists) then fenced both, so that neither ran (found by the two-drivers test)."""
        if self.run is None:
            return
        d = self._definition
        if self._fence.is_fenced():
            raise JobFencedError(
                f"pipeline {d.name}: a newer driver started on this checkpoint directory; "
                f"this driver (run {self.run}) stops without committing"
            )
