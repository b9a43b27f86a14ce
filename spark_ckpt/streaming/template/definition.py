"""A pipeline's definition: what its streams, operators, sources and sinks know of it.

The StreamingContext is the user's façade; the template's nodes never hold it. They hold this
instead: the pipeline's name, session, settings, checkpoint directory, clock and graph, and
the facts ``start()`` fixes before any thread runs (the pipeline id and its lineage, the
recorded source schemas, where completed checkpoints are). It has no runtime state: the
operators' snapshots are on its :class:`SnapshotBoard`, which their owner publishes to.

Threads and owners: the user's thread writes it while defining the pipeline and in
``start()`` (before any of the pipeline's threads starts); from then on it is read-only, and
any thread may read it. The board is the one part that changes while batches run (its one
writer is the JobScheduler's thread; readers get immutable snapshots).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from spark_ckpt.errors import CheckpointError
from spark_ckpt.streaming.template.keyed import KeyedStream
from spark_ckpt.streaming.template.operator_state import SnapshotBoard
from spark_ckpt.streaming.template.stream_graph import StreamGraph

if TYPE_CHECKING:
    from pyspark.sql import SparkSession
    from pyspark.sql.types import StructType

    from spark_ckpt.clock import Clock
    from spark_ckpt.options import Settings
    from spark_ckpt.storage import Storage
    from spark_ckpt.streaming.template.stream import Stream

__all__ = ["PipelineDefinition"]


class PipelineDefinition:
    """The pipeline as its template, sources and sinks see it (a ``Template``, ``StateScope``,
    ``PipelineScope`` and ``SourceScope``)."""

    def __init__(self, spark: SparkSession, name: str, settings: Settings, storage: Storage,
                 clock: Clock) -> None:
        self.spark = spark
        self.name = name
        self.settings = settings
        self.storage = storage
        self.root = storage.root
        self.clock = clock
        self.graph = StreamGraph()
        # lineage: "<name>-<pipeline id>" keys every sink transaction; a checkpoint directory
        # made before pipeline ids existed keeps its old ids ("<name>"). Fixed by start().
        self.pipeline_id = ""
        self.lineage = name
        self.schemas: dict[str, str] = {}  # source -> its recorded schema (JSON), by start()
        self.checkpoints: Any = None  # CheckpointStorage, set by start() when it checkpoints
        self.snapshots = SnapshotBoard()

    def keyed(self, parent: Stream, keys: Sequence[str], *, parallelism: int | None,
              max_parallelism: int | None) -> KeyedStream:
        """The keyed stream ``parent.key_by(*keys)`` makes."""
        return KeyedStream(self, (parent,), keys, parallelism=parallelism,
                           max_parallelism=max_parallelism)

    def windowed(self, keyed: KeyedStream, spec: Any, output_mode: str) -> Any:
        """The windowed keyed stream ``keyed.window(spec)`` makes (template.windows, a layer
        above the keyed streams)."""
        from spark_ckpt.streaming.template.windows import WindowedKeyedStream

        return WindowedKeyedStream(keyed, spec, output_mode)

    def row_operator(self, kind: str, keyed: KeyedStream, name: str, **options: Any) -> Any:
        """Deduplication (``kind="dedup"``) or Top-N (``"top_n"``) of ``keyed``
        (template.row_operators, a layer above the keyed streams)."""
        from spark_ckpt.streaming.template.row_operators import DeduplicatedStream, TopNStream

        if kind == "dedup":
            return DeduplicatedStream(keyed, name, **options)
        return TopNStream(keyed, name, **options)

    def stream_join(self, left: Stream, right: Stream, on: Any, how: str, between: Any,
                    ttl: Any, name: str) -> Any:
        """A stream-stream join (template.joins, a layer above the keyed streams)."""
        from spark_ckpt.streaming.template.joins import StreamJoin

        return StreamJoin(left, right, on, how, between, ttl, name)

    def temporal_join(self, left: Stream, table: Stream, on: Any, time_column: str, how: str,
                      name: str) -> Any:
        """A temporal join with a Delta table (template.temporal)."""
        from spark_ckpt.streaming.template.temporal import TemporalJoin

        return TemporalJoin(left, table, on, time_column, how, name)

    def recorded_schema(self, source: str) -> StructType | None:
        from pyspark.sql.types import StructType

        raw = self.schemas.get(source)
        return StructType.fromJson(json.loads(raw)) if raw else None

    def checkpoint_handles(self, operator: str, checkpoint_id: int) -> list[Any]:
        """The state handles of ``operator`` in completed checkpoint ``checkpoint_id``."""
        from spark_ckpt.state.chain import StateHandle

        if self.checkpoints is None:
            raise CheckpointError(f"pipeline {self.name}: not started with checkpointing")
        meta = self.checkpoints.read_metadata(checkpoint_id)
        handles = meta.get("operators", {}).get(operator, {}).get("handles", {})
        return [StateHandle.from_json(h) for _p, h in
                sorted(handles.items(), key=lambda kv: int(kv[0]))]
