"""What running a job's vertices needs of the job attempt that runs them: the interface
:class:`spark_ckpt.batch.runner.JobRunner` offers the vertex runner and its parts (frames,
lineage, arrangement, unit writer, file watcher, adoption), none of which import the runner."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

    from spark_ckpt.batch.unit_records import UnitRecord
    from spark_ckpt.clock import Clock
    from spark_ckpt.eventlog.replay import FinishedPartition
    from spark_ckpt.execution.attempts import ExecutionRegistry
    from spark_ckpt.execution.job_graph import JobGraph
    from spark_ckpt.execution.result_partition import PartitionResult
    from spark_ckpt.options import Settings
    from spark_ckpt.sources.file_identity import FileIdentity
    from spark_ckpt.storage import Storage

__all__ = ["Attempt"]


class Attempt(Protocol):
    """What running vertices needs of the job attempt that runs them (the job runner)."""

    run_id: str
    attempt: int
    @property
    def owner_tag(self) -> str:
        """Tags every Spark operation of the attempt (Spark Connect)."""
    graph: JobGraph
    spark: SparkSession
    settings: Settings
    storage: Storage
    paths: dict[str, str]
    registry: ExecutionRegistry
    finished: dict[tuple[str, int], FinishedPartition]
    clock: Clock  # the partitions' start and finish times
    explaining: bool  # BatchJob.explain: nothing may be written in the job's directory
    # what identified each file of each file source (size, time, object version), by path
    input_files: dict[str, dict[str, FileIdentity]]

    def partition_finished(self, result: PartitionResult) -> bool:
        """Record a finished partition once; False for duplicates and stale attempts."""

    # Spark Connect: the run units earlier attempts left running (batch.adoption), and the
    # last attempt that logged each partition finished: never taken from a unit of that
    # attempt or an earlier one (its file was logged once, and may be gone since)
    left_running: list[UnitRecord]
    once_finished: dict[tuple[str, int], int]

    def release_earlier(self, attempts: set[int]) -> None:
        """Interrupt what earlier ``attempts`` still run on the server."""
