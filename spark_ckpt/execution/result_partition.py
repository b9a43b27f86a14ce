"""Durable result partitions: the files one finished partition left behind, and how to read them.

A finished partition writes, per consumer edge, one Parquet file whose row groups each hold one
sub-partition (the consumer partition it is for), and, per sink, staged data files. Then it
writes a *manifest* listing every file with its size and row counts. The manifest is written
last and atomically, so a partition is finished exactly when its manifest exists; the driver
turns manifests into ``ExecutionVertexFinished`` events.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from spark_ckpt.formats import dump_record, load_record
from spark_ckpt.storage import join

__all__ = [
    "MANIFEST_VERSION",
    "OutputFile",
    "PartitionManifest",
    "SUB_COLUMN",
    "manifest_dir",
    "result_dir",
]

MANIFEST_VERSION = 1
SUB_COLUMN = "__ckpt_sub"  # consumer sub-partition of a row in a result file
PART_COLUMN = "__ckpt_p"  # position of a row's partition in the running set (shuffling vertices)


def result_dir(job_dir: str, vertex_id: str) -> str:
    return join(job_dir, "results", vertex_id)


def manifest_dir(job_dir: str, vertex_id: str) -> str:
    return join(result_dir(job_dir, vertex_id), "_manifests")


@dataclasses.dataclass(frozen=True)
class OutputFile:
    """One file of a finished partition.

    ``kind`` is ``result`` (for consumer ``target``) or ``sink`` (staged for sink ``target``).
    ``groups`` maps a sub-partition to ``[first row group, row group count, rows]``.
    """

    kind: str
    target: str
    path: str
    size: int
    rows: int
    groups: dict[int, list[int]] = dataclasses.field(default_factory=dict)
    partition_values: dict[str, str | None] = dataclasses.field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["groups"] = {str(k): v for k, v in self.groups.items()}
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> OutputFile:
        return cls(
            kind=data["kind"],
            target=data["target"],
            path=data["path"],
            size=int(data["size"]),
            rows=int(data["rows"]),
            groups={int(k): list(v) for k, v in (data.get("groups") or {}).items()},
            partition_values=dict(data.get("partition_values") or {}),
        )


@dataclasses.dataclass(frozen=True)
class PartitionManifest:
    job_id: str
    vertex_id: str
    partition: int
    attempt_id: str
    spark_task_attempt_id: int
    spark_attempt_number: int
    started_ms: int
    finished_ms: int
    rows: int
    outputs: tuple[OutputFile, ...]
    schema: str = ""  # Spark StructType JSON of the vertex output

    @property
    def bytes(self) -> int:
        return sum(o.size for o in self.outputs)

    def body(self) -> dict[str, Any]:
        body = dataclasses.asdict(self)
        body["outputs"] = [o.to_json() for o in self.outputs]
        return body

    def dumps(self) -> bytes:
        return dump_record("partition-manifest", MANIFEST_VERSION, self.body())

    @classmethod
    def from_body(cls, data: dict[str, Any]) -> PartitionManifest:
        return cls(
            job_id=data["job_id"],
            vertex_id=data["vertex_id"],
            partition=int(data["partition"]),
            attempt_id=data["attempt_id"],
            spark_task_attempt_id=int(data["spark_task_attempt_id"]),
            spark_attempt_number=int(data["spark_attempt_number"]),
            started_ms=int(data["started_ms"]),
            finished_ms=int(data["finished_ms"]),
            rows=int(data["rows"]),
            outputs=tuple(OutputFile.from_json(o) for o in data["outputs"]),
            schema=data.get("schema", ""),
        )

    @classmethod
    def loads(cls, data: bytes | str) -> PartitionManifest:
        return cls.from_body(load_record(data, "partition-manifest", (MANIFEST_VERSION,)))
