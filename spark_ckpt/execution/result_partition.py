"""Durable result partitions: the files one finished partition left behind.

Spark's own Parquet writer writes them (batch.unit_writer): the vertex's result files, read
by its consumers, and per sink the staged data files the sink's commit publishes. The driver
lists what each write made visible, reads the Parquet footers for row counts, and logs the
partition's files in ``ExecutionVertexFinished``; recovery checks each still exists with its
recorded size.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from spark_ckpt.storage import join

__all__ = ["OutputFile", "PartitionResult", "result_dir"]


def result_dir(job_dir: str, vertex_id: str) -> str:
    return join(job_dir, "results", vertex_id)


@dataclasses.dataclass(slots=True)  # not frozen: built once per file a recovery replays
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
        # Called once per file of every finished partition a recovery replays: kept lean.
        groups = data.get("groups")
        values = data.get("partition_values")
        return cls(data["kind"], data["target"], data["path"], int(data["size"]),
                   int(data["rows"]),
                   {int(k): list(v) for k, v in groups.items()} if groups else {},
                   dict(values) if values else {})


@dataclasses.dataclass(frozen=True)
class PartitionResult:
    """What a finished partition left behind, as the driver found it; logged as the payload
    of ``ExecutionVertexFinished``. ``shared``: the partitions of a split-mode wave, which
    share these files (losing one loses them all)."""

    vertex_id: str
    partition: int
    attempt_id: str
    started_ms: int
    finished_ms: int
    rows: int
    outputs: tuple[OutputFile, ...]
    schema: str = ""  # Spark StructType JSON of the vertex output
    shared: tuple[int, ...] = ()

    @property
    def bytes(self) -> int:
        return sum(o.size for o in self.outputs)

    def body(self) -> dict[str, Any]:
        body = dataclasses.asdict(self)
        body["outputs"] = [o.to_json() for o in self.outputs]
        body["shared"] = list(self.shared)
        return body
