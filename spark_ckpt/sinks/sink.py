"""A sink: where a vertex's (or a stream's) output becomes visible, once per version."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from spark_ckpt.execution.job_graph import SinkSpec
from spark_ckpt.execution.result_partition import OutputFile
from spark_ckpt.storage import join

if TYPE_CHECKING:
    from pyspark.sql.types import StructType

    from spark_ckpt.storage import Storage

__all__ = ["Sink"]


class Sink:
    """Stages files invisibly, then commits one version of them (idempotently)."""

    #: the target's storage and its staging directory (set by each kind of sink)
    store: Storage
    staging: str

    def __init__(self, spec: SinkSpec, job_id: str) -> None:
        self.spec = spec
        self.job_id = job_id
        self.app_id = f"spark_ckpt/{job_id}/{spec.name}"

    def prepare(self, schema: StructType) -> None:
        """Check or create the target before files are staged for it."""
        raise NotImplementedError

    def staging_dir(self, vertex_id: str, tag: str) -> str:
        """A directory (Spark URI) only one write uses, under this sink's staging area."""
        return self.store.spark_path(join(self.staging, vertex_id, tag))

    def locate(self, paths: list[str]) -> list[str]:
        """Where staged files are now (a Parquet commit moves them)."""
        return paths

    def next_version(self) -> int:
        raise NotImplementedError

    def is_committed(self, version: int) -> bool:
        raise NotImplementedError

    def commit(self, files: list[OutputFile], version: int) -> dict[str, Any]:
        raise NotImplementedError
