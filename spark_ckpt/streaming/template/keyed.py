"""Keyed streams and their stateful operators, on the driver.

``stream.key_by("user")`` gives a :class:`KeyedStream`; ``.agg(...)`` and ``.process(...)`` give
stateful streams whose batches are the *update stream* (the keys that changed, with their new
aggregates; or the processor's output rows). Each batch a stateful operator runs one Spark job:

    input -> (_kg, _pid) -> repartitionById(P, _pid) [-> groupBy partials] -> mapInArrow(task)

Task ``i`` owns key-group range ``i`` (keygroups.py), works on its state (state/task.py) and
returns its new state handle; the job's result is only those handles and measurements (a few
hundred bytes a task), never state. The update stream is read back from the changelog or output
files the tasks wrote, so every sink sees exactly what the state saw, computed once.

Threads and owners: the nodes here are the operators' *definitions*, built on the user's thread
and unchanged once ``start()`` runs; they hold the pipeline's definition (a :class:`StateScope`),
never the StreamingContext. Each operator's runtime state (live handles, task metrics, the
evolution found at a restore, the schemas learnt at the first batch) is an
:class:`~spark_ckpt.streaming.template.operator_state.OperatorState` that ``configure`` makes at
start and that the JobScheduler's thread owns; ``compute(run)`` gets it from the batch's run.
Other threads (``state_view()`` on the user's thread, the coordinator's sweep) read only the
frozen :class:`~spark_ckpt.streaming.template.operator_state.OperatorSnapshot` the owner
publishes after each job.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import types
import uuid
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

from spark_ckpt.errors import CheckpointError, InternalError, JobDefinitionError
from spark_ckpt.sinks.per_batch import _FileSink
from spark_ckpt.sparkapi import frame_api, spark_api, union_by_name
from spark_ckpt.state.aggregates import Agg, AggSpec
from spark_ckpt.state.chain import StateHandle, restore_plans
from spark_ckpt.state.keygroups import (
    KG_COLUMN,
    PID_COLUMN,
    key_group_column,
    partition_column,
    ranges,
)
from spark_ckpt.state.process_task import processor_task, schema_id
from spark_ckpt.state.processor import KeyedProcessor, VectorizedProcessor
from spark_ckpt.state.task import (
    CHANNEL_COLUMN,
    MARKER_COLUMN,
    agg_task,
    meta_schema,
)
from spark_ckpt.storage import join, s3
from spark_ckpt.streaming.template.operator_state import (
    AggState,
    OperatorSnapshot,
    OperatorState,
    ProcessState,
    SnapshotBoard,
)
from spark_ckpt.streaming.template.stream import Stream, Template

if TYPE_CHECKING:
    from pyspark.sql import DataFrame
    from pyspark.sql.types import StructType

    from spark_ckpt.options import Settings
    from spark_ckpt.streaming.template.batch_run import BatchRun

__all__ = ["AggregatedStream", "FullState", "KeyedStream", "ProcessedStream", "StateScope",
           "StatefulStream", "agg_file_schema"]

log = logging.getLogger(__name__)


class StateScope(Template, Protocol):
    """What a stateful operator knows of its pipeline's definition (not the StreamingContext):
    the session and settings, its checkpoint directory, and where the runtime publishes the
    operators' snapshots and reads completed checkpoints. Everything it changes while batches
    run is in its :class:`OperatorState`, which it gets through the batch's run."""

    spark: Any
    settings: Settings
    lineage: str
    snapshots: SnapshotBoard

    def checkpoint_handles(self, operator: str, checkpoint_id: int) -> list[Any]:
        """The state handles of ``operator`` in completed checkpoint ``checkpoint_id``."""

    def windowed(self, keyed: KeyedStream, spec: Any, output_mode: str) -> Any:
        """A windowed keyed stream (template.windows, which imports this module)."""

    def row_operator(self, kind: str, keyed: KeyedStream, name: str, **options: Any) -> Any:
        """Deduplication or Top-N (template.row_operators, which imports this module)."""


class KeyedStream:
    """A stream partitioned by key, ready for a stateful operator. Not a stream itself."""

    def __init__(self, pipeline: StateScope, inputs: Sequence[Stream], keys: Sequence[str], *,
                 parallelism: int | None = None, max_parallelism: int | None = None) -> None:
        if not keys:
            raise JobDefinitionError("key_by(): expected at least one key column, found none")
        self.pipeline = pipeline
        self.inputs = tuple(inputs)
        self.keys = tuple(keys)
        self.parallelism = parallelism
        self.max_parallelism = max_parallelism

    def union(self, *others: KeyedStream) -> KeyedStream:
        """Several keyed inputs into one operator (each an input channel; the operator's
        checkpoint is aligned across them)."""
        for other in others:
            if other.keys != self.keys:
                raise JobDefinitionError(
                    f"union of keyed streams: expected the keys {list(self.keys)} on every "
                    f"input, found {list(other.keys)}"
                )
        return KeyedStream(self.pipeline, [*self.inputs, *[i for o in others for i in o.inputs]],
                           self.keys, parallelism=self.parallelism,
                           max_parallelism=self.max_parallelism)

    def agg(self, name: str | None = None, *, state_renames: dict[str, str] | None = None,
            **aggs: Agg) -> AggregatedStream:
        """Running aggregates per key: ``agg(n=count(), total=sum_("amount"))``. Its batches
        are the changed keys with their new values; ``state_view()`` is the whole state.
        ``state_renames={"old": "new"}`` renames outputs whose state a checkpoint holds (see
        docs/operations.md, evolving state)."""
        return AggregatedStream(self, name or "agg", aggs, state_renames=state_renames)

    def window(self, spec: Any, *, output_mode: str = "append") -> Any:
        """Event-time windows per key: ``key_by("user").window(tumbling("10 seconds"))
        .agg(n=count())`` (streaming/template/windows.py: tumbling, sliding, session,
        cumulate; ``output_mode`` "append" emits each window once when the watermark passes
        its end, "update" emits the windows each batch changed)."""
        return self.pipeline.windowed(self, spec, output_mode)

    def drop_duplicates(self, *, within: Any = None, ttl: Any = None,
                        name: str | None = None) -> Stream:
        """Each key's first row; later rows of the key are dropped until the watermark passes
        the first row's event time plus ``within``, or ``ttl`` of processing time after it
        (template/row_operators.py)."""
        return self.pipeline.row_operator(  # type: ignore[no-any-return]
            "dedup", self, name or "drop_duplicates", within=within, ttl=ttl)

    def top_n(self, n: int, order_by: Any, *, name: str | None = None) -> Stream:
        """Each key's first ``n`` rows by ``order_by`` (``[("price", "desc")]``), as Flink's
        Top-N: every batch emits the changed keys' top rows with their ``rank``."""
        return self.pipeline.row_operator(  # type: ignore[no-any-return]
            "top_n", self, name or "top_n", n=n, order_by=order_by)

    def last_row(self, order_by: str, *, name: str | None = None) -> Stream:
        """Each key's row with the largest ``order_by`` (Flink's deduplication keeping the
        last row): every batch emits the keys whose last row it changed."""
        return self.pipeline.row_operator(  # type: ignore[no-any-return]
            "top_n", self, name or "last_row", n=1, order_by=[(order_by, "desc")],
            with_rank=False)

    def process(self, processor: KeyedProcessor | VectorizedProcessor,
                output_schema: StructType | str, *, name: str | None = None,
                event_time: str | None = None, watermark_delay_ms: int = 0,
                ttl_ms: int | None = None, state_schema: Any = None,
                state_renames: dict[str, str] | None = None) -> ProcessedStream:
        """Run ``processor`` with typed value, list and map state and timers: a
        ``KeyedProcessor`` once per key, a ``VectorizedProcessor`` once per task for all its
        keys. ``state_schema`` overrides the processor's own declaration;
        ``state_renames={"old": "new"}`` renames state variables a checkpoint holds."""
        if not isinstance(processor, KeyedProcessor | VectorizedProcessor):
            raise JobDefinitionError(
                f"process(): expected a KeyedProcessor or VectorizedProcessor instance, found "
                f"{type(processor).__name__}"
            )
        return ProcessedStream(self, name or type(processor).__name__, processor,
                               output_schema, event_time=event_time,
                               watermark_delay_ms=watermark_delay_ms, ttl_ms=ttl_ms,
                               state_schema=state_schema, state_renames=state_renames)


class StatefulStream(Stream):
    """Base of keyed stateful operators. ``operator`` names its state and is stable across
    restarts (pass ``name=``). The node is the operator's definition; its runtime state is an
    :class:`OperatorState` that ``configure`` makes at start and the JobScheduler's thread
    owns."""

    kind = "stateful"
    pipeline: StateScope
    #: inputs of different columns (a stream join): a column an input lacks is null in its rows
    inputs_differ = False

    def __init__(self, keyed: KeyedStream, name: str) -> None:
        super().__init__(keyed.pipeline, keyed.inputs, name)
        self.operator = self.name
        from spark_ckpt.names import check_name

        check_name("stateful operator name (pass name=)", self.operator)
        self.keys = keyed.keys
        self.requested_parallelism = keyed.parallelism
        self.requested_max = keyed.max_parallelism
        self.state_renames: dict[str, str] = {}
        keyed.pipeline.graph.add_stateful(self)

    def new_state(self, parallelism: int, max_parallelism: int,
                  live: dict[int, StateHandle]) -> OperatorState:
        return OperatorState(parallelism, max_parallelism, live)

    # -- lifecycle (start(), on the user's thread, before any thread runs) ---------------------
    def configure(self, restored: dict[str, Any] | None) -> OperatorState:
        """This run's state: empty, or restored from a checkpoint's entry ``restored``."""
        settings = self.pipeline.settings
        default_p = settings.state_parallelism or \
            spark_api(self.pipeline.spark).default_parallelism()
        parallelism = self.requested_parallelism or default_p
        max_parallelism = self.requested_max or settings.state_max_parallelism
        layout = ranges(parallelism, max_parallelism)
        state = self.new_state(parallelism, max_parallelism,
                               {i: StateHandle.empty(r) for i, r in enumerate(layout)})
        if restored is None:
            return state
        stored_keys = restored.get("keys")
        if stored_keys is not None and list(stored_keys) != list(self.keys):
            from spark_ckpt.errors import StateSchemaError

            raise StateSchemaError(
                f"operator {self.operator}: the checkpoint's state is keyed by "
                f"{list(stored_keys)}, the pipeline keys it by {list(self.keys)}; the key of a "
                "stateful operator (its columns and their order, which place each key in its "
                "key group) cannot change under a checkpoint; nothing was run. Keep the old "
                "key_by(...), or start in a new checkpoint directory"
            )
        old_max = int(restored["max_parallelism"])
        if self.requested_max is None:
            state.max_parallelism = old_max
            layout = ranges(parallelism, old_max)
            state.live = {i: StateHandle.empty(r) for i, r in enumerate(layout)}
        elif old_max != state.max_parallelism:
            from spark_ckpt.errors import StateSchemaError

            raise StateSchemaError(
                f"operator {self.operator}: the checkpoint has max parallelism {old_max}, the "
                f"pipeline asks for {state.max_parallelism}; key groups cannot change under a "
                "checkpoint (keep the old value or start a new checkpoint directory)"
            )
        handles = [StateHandle.from_json(h) for _pid, h in
                   sorted(restored["handles"].items(), key=lambda kv: int(kv[0]))]
        state.extra = dict(restored.get("extra", {}))
        state.restored_describe = {k: restored[k] for k in (
            "file_schema", "aggs", "state_schema", "key_schema", "state_format", "derived")
            if k in restored}
        if [h.range for h in handles] == [state.live[i].range for i in sorted(state.live)]:
            state.live = dict(enumerate(handles))
        else:
            log.info("Operator %s: rescaling state from %d to %d tasks (%d key groups)",
                     self.operator, len(handles), state.parallelism, state.max_parallelism)
            state.restore_from = handles
            for i, (r, files) in enumerate(zip(layout, restore_plans(layout, handles),
                                               strict=True)):
                state.live[i] = StateHandle(r.label, None, tuple(files), 0)
        self._check_evolution(state)
        return state

    def _check_evolution(self, state: OperatorState) -> None:
        """At a restore, before any batch: refuse declared state the checkpoint's cannot
        become (StateSchemaError); else note how it evolves (subclasses)."""

    def _evolved(self, state: OperatorState, evolution: Any) -> None:
        """Keep a checked evolution; log what it changes."""
        state.evolution = evolution
        state.rewrite = evolution.changed
        if evolution.changed:
            log.info("Operator %s: state schema evolves at this restore: added %s, removed %s "
                     "(values dropped), renamed %s, widened %s; the first batch rewrites every "
                     "restored range", self.operator, list(evolution.added),
                     list(evolution.removed),
                     {old: new for new, old in evolution.sources.items()},
                     list(evolution.widened))

    def snapshot_of(self, state: OperatorState) -> OperatorSnapshot:
        """An immutable picture of ``state`` for readers on other threads (built by the
        state's owner)."""
        return OperatorSnapshot(
            self.operator, state.batch_id, state.parallelism, state.max_parallelism,
            tuple(state.live[i] for i in sorted(state.live)), state.live_files(),
            types.MappingProxyType(copy.deepcopy(self.describe_state(state))),
            extra=types.MappingProxyType(copy.deepcopy(state.extra)),
            evolution=state.evolution)

    def snapshot(self) -> OperatorSnapshot | None:
        """The newest published snapshot of this operator's state (any thread); None before
        the pipeline started."""
        return self.pipeline.snapshots.get(self.operator)

    @property
    def parallelism(self) -> int:
        """Tasks of this run (0 before ``start()``), from the published snapshot."""
        snapshot = self.snapshot()
        return snapshot.parallelism if snapshot is not None else 0

    @property
    def max_parallelism(self) -> int:
        """Key groups of this run (0 before ``start()``), from the published snapshot."""
        snapshot = self.snapshot()
        return snapshot.max_parallelism if snapshot is not None else 0

    def ack_entry(self, state: OperatorState) -> dict[str, Any]:
        """The operator's own part of its tasks' acknowledgements of one cut (what its
        checkpoint entry records beside the handles): built once per cut and shared by its
        tasks' acknowledgements, a copy of ``state.extra`` that later batches do not change.
        (A copy per task cost 1,000 tasks x 1,000 partitions' watermark entries every batch:
        scripts/sim_scale.py.)"""
        return {"kind": self.kind, "parallelism": state.parallelism,
                "max_parallelism": state.max_parallelism, "keys": list(self.keys),
                "extra": copy.deepcopy(state.extra), **self.describe_state(state)}

    def ack_state(self, state: OperatorState, pid: int,
                  entry: dict[str, Any] | None = None) -> dict[str, Any]:
        """Task ``pid``'s acknowledgement: its handle and ``entry`` (:meth:`ack_entry`)."""
        return {"handle": state.live[pid].to_json(),
                "operator": self.ack_entry(state) if entry is None else entry}

    def describe_state(self, state: OperatorState) -> dict[str, Any]:
        """What a reader needs to decode the state files (see state/frames.py)."""
        return dict(state.restored_describe)

    def state_dir(self) -> str:
        store = self.pipeline.storage
        return store.spark_path(join(self.pipeline.root, "state", self.operator))

    # -- per batch (the JobScheduler's thread) --------------------------------------------------
    def _state(self, run: BatchRun) -> Any:
        """This operator's runtime state (its owner, the scheduler, runs the batch)."""
        if run.operators is None:
            raise InternalError(f"operator {self.operator}: batch {run.batch_id} runs without "
                                "the operators' runtime state")
        return run.operators.state(self.operator)

    def _inputs(self, run: BatchRun, state: OperatorState) -> DataFrame | None:
        """The batch's input with its routing columns (key group, task)."""
        df = self._unrouted(run)
        return None if df is None else df.withColumns(self._route(state))

    def _route(self, state: OperatorState) -> dict[str, Any]:
        if state.routing is None:  # the same expressions every batch: built once
            state.routing = {
                KG_COLUMN: key_group_column(self.keys, state.max_parallelism),
                PID_COLUMN: partition_column(state.max_parallelism, state.parallelism)}
        return state.routing

    def _unrouted(self, run: BatchRun) -> DataFrame | None:
        if run.batch_id != run.stats.batch_id:
            raise JobDefinitionError(
                f"operator {self.operator}: a window over a stateful stream would apply "
                "earlier batches to the state again; window the input instead"
            )
        from pyspark.sql import functions as F

        frames = [run.get_or_compute(p) for p in self.parents]
        present = [f for f in frames if f is not None]
        if len(present) < len(frames):
            return None
        present = [self._with_split(i, f) for i, f in enumerate(present)]
        if len(present) > 1:
            present = [f.withColumn(CHANNEL_COLUMN, F.lit(i)) for i, f in enumerate(present)]
        df = union_by_name(present, allow_missing=self.inputs_differ)
        missing = [k for k in self.input_keys() if k not in df.columns]
        if missing:
            raise JobDefinitionError(
                f"operator {self.operator}: key columns {missing} are not in its input; "
                f"columns: {df.columns}"
            )
        return df

    def _with_split(self, channel: int, frame: DataFrame) -> DataFrame:
        """Input ``channel``'s frame, with the partition its rows were read from where the
        operator keeps watermarks per partition (default: as it is)."""
        return frame

    def input_keys(self) -> tuple[str, ...]:
        """The key columns the operator's input holds (its state's key may add more)."""
        return self.keys

    def _read_back_needed(self, run: BatchRun) -> bool:
        """Whether any stream or output reads this batch's update stream from the files the
        tasks wrote; not when every reader is a sink the tasks wrote themselves (chained)."""
        for stream in self.pipeline.graph.reachable():
            if any(p is self for p in stream.parents) and \
                    getattr(stream, "output_name", None) not in run.chained:
                return True
        return False

    def _params(self, run: BatchRun, state: OperatorState) -> dict[str, Any]:
        s = self.pipeline.settings
        return {"pipeline_id": self.pipeline.lineage, "operator": self.operator,
                "batch": run.batch_id, "state_dir": self.state_dir(), "backend": s.state_backend,
                "memory_max_rows": s.state_memory_max_rows, "local_dir": s.state_local_dir,
                "materialize_every": s.state_materialize_every, "keys": list(self.keys),
                "local_spill": s.state_local_spill,
                "state_sources": dict(state.evolution.sources) if state.evolution else {},
                "rewrite": state.rewrite,
                # the driver's S3 settings (spark.hadoop.fs.s3a.*), installed by the task
                "s3": config.to_json() if (config := s3.current()) is not None else None}

    @staticmethod
    def _plans(state: OperatorState) -> dict[int, dict[str, Any]]:
        return {pid: {"range": h.range, "token": h.token,
                      "files": [f.to_json() for f in h.files]} for pid, h in state.live.items()}

    def _run_job(self, run: BatchRun, state: OperatorState, df: DataFrame, fn: Any, *,
                 partitioned: bool = False, placeable: bool = True) -> list[dict[str, Any]]:
        spark_api(self.pipeline.spark).describe(
            f"spark_ckpt pipeline {self.pipeline.name} batch {run.batch_id} operator "
            f"{self.operator}")
        if not partitioned:
            df = df.repartitionById(state.parallelism, PID_COLUMN)
        if state.locations_parallelism != state.parallelism:  # a rescale: other ranges
            state.locations, state.locations_parallelism = {}, state.parallelism
        placed = frame_api(df).prefer_locations(df, state.parallelism, state.locations) \
            if placeable and self.pipeline.settings.state_prefer_locations else None
        preferred = dict(state.locations) if placed is not None else {}
        if placed is not None:
            df = placed[0]
        try:
            rows = df.mapInArrow(fn, meta_schema()).collect()
        except Exception as exc:
            from spark_ckpt.errors import UserFunctionError

            user = UserFunctionError.from_task_failure(exc)
            if user is None:
                raise
            raise user from None  # the JVM's stack and task retries say nothing more
        metas = take_task_results(state, rows, run.batch_id)
        if placed is not None:
            state.locations.update(placed[1]())
        if state.rewrite:
            missing = sorted(set(state.live) - {m["pid"] for m in metas})
            if missing:  # not expected: every range's task runs (markers, or empty partitions)
                log.warning("Operator %s batch %d: ranges %s did not run; their state is "
                            "rewritten at the next batch", self.operator, run.batch_id, missing)
            else:
                state.rewrite = False
                log.info("Operator %s batch %d: every range rewritten with the declared state "
                         "schema", self.operator, run.batch_id)
        run.stats.state[self.operator] = {
            "tasks_run": len(metas), "input_rows": sum(m["input_rows"] for m in metas),
            "changed_keys": sum(m["changed"] for m in metas),
            "state_rows": sum(h.rows for h in state.live.values()),
            "restored_tasks": sum(1 for m in metas if m.get("restored")),
            "written_bytes": sum(m["written_bytes"] for m in metas),
            "max_task_ms": max((m["total_ms"] for m in metas), default=0),
            "alignment_ms": max((m["alignment_ms"] for m in metas), default=0),
            # tasks that had a preferred executor, and of those the ones that ran there
            "preferred_tasks": len(preferred),
            "placed_tasks": sum(1 for p, at in preferred.items()
                                if state.locations.get(p) == at),
            "tasks": {str(m["pid"]): {"executor": m["executor"], "worker": m["worker"],
                                      "restored": m["restored"], "cache": m.get("cache"),
                                      "ms": m["total_ms"], "restore_ms": m.get("restore_ms"),
                                      "apply_ms": m.get("apply_ms"),
                                      "async_ms": m.get("async_ms"),
                                      "input_rows": m.get("input_rows"),
                                      "materialized": m.get("materialized"),
                                      "rows": m["handle"].get("rows")} for m in metas},
        }
        run.operators.publish(self.operator)  # type: ignore[union-attr]  # _state checked it
        return metas


class _SchemaRun:
    """The template over no rows, to learn at start what schema a stream's batches have: each
    input an empty frame of its source's schema, each transform applied to those (Spark only
    analyses), a stateful operator's output its declared or derived schema."""

    def __init__(self, spark: Any) -> None:
        self.spark = spark
        self.memo: dict[int, DataFrame] = {}

    def get_or_compute(self, stream: Any) -> DataFrame:
        if stream.id not in self.memo:
            self.memo[stream.id] = self._empty(stream)
        return self.memo[stream.id]

    def input_schema(self, op: StatefulStream) -> Any:
        frames = [self.get_or_compute(p) for p in op.parents]
        return (union_by_name(frames, allow_missing=op.inputs_differ) if len(frames) > 1
                else frames[0]).schema

    def _empty(self, stream: Any) -> DataFrame:
        from spark_ckpt.sparkapi import empty_frame
        from spark_ckpt.streaming.template.stream import InputStream, Output, Transformed, Windowed

        if isinstance(stream, InputStream):
            return stream.source.empty(self.spark)
        if isinstance(stream, Transformed):
            return stream.fn(*[self.get_or_compute(p) for p in stream.parents])
        if isinstance(stream, Windowed | Output):
            return self.get_or_compute(stream.parents[0])
        if hasattr(stream, "schema_frame"):  # an operator that derives its output's schema
            derived: DataFrame = stream.schema_frame(self)
            return derived
        if isinstance(stream, AggregatedStream):
            spec = AggSpec(stream.keys, stream.aggs, self.input_schema(stream))
            view: DataFrame = spec.view(empty_frame(self.spark, agg_file_schema(spec)))
            return view
        if isinstance(stream, ProcessedStream):
            from pyspark.sql.types import StructType

            schema = stream.output_schema or StructType.fromDDL(str(stream.declared_schema))
            return empty_frame(self.spark, schema)  # type: ignore[arg-type]  # DDL: a struct
        raise InternalError(f"stream {stream.name}: expected a stream kind the schema dry run "
                            f"knows, found a {type(stream).__name__}")


_TASK_METRICS = ("sync_ms", "async_ms", "alignment_ms", "channels", "apply_ms", "restore_ms",
                 "restored", "input_rows", "changed", "written_bytes", "total_ms", "executor",
                 "worker", "cache", "evicted")


def take_task_results(state: OperatorState, rows: Any, batch_id: int) -> list[dict[str, Any]]:
    """Every task's result row of batch ``batch_id`` (``meta``: its JSON, ``pid``) into
    ``state``: the range's new handle and the task's metrics; the decoded rows."""
    metas = []
    for row in rows:
        meta = json.loads(row.meta)
        pid = meta["pid"] = int(row.pid)
        state.live[pid] = StateHandle.from_json(meta["handle"])
        metrics = state.metrics[pid] = {k: meta.get(k) for k in _TASK_METRICS}
        metrics["batch"] = batch_id
        metas.append(meta)
    state.batch_id = batch_id
    return metas


def params_sources(evolution: Any) -> dict[str, str]:
    return dict(evolution.sources) if evolution is not None else {}


def _describe_aggs(aggs: dict[str, Any]) -> str:
    def call(spec: list[Any]) -> str:
        func, column, time_column = (list(spec) + [None, None])[:3]
        args = ", ".join(a for a in (column, time_column) if a)
        return f"{func}({args})"
    return ", ".join(f"{name}={call(spec)}" for name, spec in aggs.items())


def pa_schema(fields: list[Any]) -> Any:
    import pyarrow as pa

    return pa.schema(fields)


def agg_file_schema(spec: AggSpec) -> StructType:
    """The schema of an aggregation's state files: ``_kg``, the keys, the state columns."""
    from pyspark.sql.types import IntegerType, StructField, StructType

    return StructType([StructField(KG_COLUMN, IntegerType()),
                       *[StructField(k, t) for k, t in spec.key_types.items()],
                       *[StructField(n, t) for n, _k, t in spec.state_columns()]])


class AggregatedStream(StatefulStream):
    kind = "agg"

    def __init__(self, keyed: KeyedStream, name: str, aggs: dict[str, Agg], *,
                 state_renames: dict[str, str] | None = None) -> None:
        super().__init__(keyed, name)
        self.aggs = dict(aggs)
        self.state_renames = dict(state_renames or {})
        from spark_ckpt.streaming.template.event_time import declared_watermark

        try:
            mark = declared_watermark(keyed.inputs, f"operator {self.operator}")
        except JobDefinitionError:
            mark = None
        if mark is not None:  # a Structured Streaming user would expect eviction: say so
            log.warning("Operator %s: key_by().agg() does not use %r: its running aggregates "
                        "are kept for every key, never evicted at the watermark (windowed "
                        "aggregations that evict are not built yet; a processor with event "
                        "timers can)", self.operator, mark)

    def new_state(self, parallelism: int, max_parallelism: int,
                  live: dict[int, StateHandle]) -> AggState:
        return AggState(parallelism, max_parallelism, live)

    def _empty_view(self, state: AggState) -> DataFrame:
        if state.empty_view is None:
            assert state.spec is not None
            state.empty_view = state.spec.view(
                self.pipeline.spark.createDataFrame([], agg_file_schema(state.spec)))
        empty: DataFrame = state.empty_view
        return empty

    def _spec(self, state: AggState, df: DataFrame) -> AggSpec:
        if state.spec is None:
            spec = AggSpec(self.keys, self.aggs, df.schema)
            if "file_schema" in state.restored_describe and not state.types_checked:
                self._check_state_types(state, spec)
            state.spec = spec
        found: AggSpec = state.spec
        return found

    def _check_evolution(self, state: OperatorState) -> None:
        """What can be checked before the input's types are known: renames, and that no kept
        output changed its function (the state of a count is not that of a max)."""
        from spark_ckpt.errors import StateSchemaError
        from spark_ckpt.state.evolution import check_renames

        assert isinstance(state, AggState)
        state.types_checked = False
        stored = state.restored_describe.get("aggs")
        if stored is None:
            return
        what = f"operator {self.operator}"
        state.renamed = check_renames(self.state_renames, list(stored), list(self.aggs), what)
        changed = []
        for name, agg in self.aggs.items():
            source = state.renamed.get(name, name)
            if source in stored and stored[source][0] != agg.func:
                old_func, old_col, _t = stored[source]
                changed.append(f"output {name!r}: {old_func}({old_col or ''}) in the checkpoint, "
                               f"{agg.func}({agg.column or ''}) declared")
        if changed:
            declared = {n: [a.func, a.column, a.time_column] for n, a in self.aggs.items()}
            raise StateSchemaError(
                f"{what}: the checkpoint's aggregations cannot become the declared ones; "
                "nothing was run.\n  - " + "\n  - ".join(changed) +
                f"\n  stored:   {_describe_aggs(stored)}"
                f"\n  declared: {_describe_aggs(declared)}"
                "\n  What to do: keep each output's function, or declare the new aggregation "
                "under a new name (it aggregates from the restore on; drop the old one), or "
                "start in a new checkpoint directory"
            )
        if "file_schema" in state.restored_describe:
            self._check_types_at_start(state)

    def _check_types_at_start(self, state: AggState) -> None:
        """The state types an aggregation's input gives it, learnt at start from the template
        over no rows (Spark analyses, nothing runs); a pipeline whose template cannot be
        followed so (a stream kind this does not know, a transform that fails on no rows)
        is checked at its first batch instead."""
        try:
            schema = _SchemaRun(self.pipeline.spark).input_schema(self)
            spec = AggSpec(self.keys, self.aggs, schema)
        except Exception as exc:  # noqa: BLE001 - the first batch checks it instead
            log.info("Operator %s: state types checked at the first batch (the template's "
                     "schema at start: %s)", self.operator, exc)
            return
        self._check_state_types(state, spec)
        state.types_checked = True

    def _check_state_types(self, state: AggState, spec: AggSpec) -> None:
        """At the first batch after a restore, before its job: the stored state columns
        widen to the declared ones (the input's types decide them), keyed the same way."""
        from pyspark.sql.types import StructType

        from spark_ckpt.arrowtypes import to_arrow
        from spark_ckpt.errors import StateSchemaError
        from spark_ckpt.state.evolution import plan_evolution

        what = f"operator {self.operator}"
        stored = to_arrow(StructType.fromJson(json.loads(state.restored_describe["file_schema"])))
        key_names = list(self.keys)
        stored_keys = [(f.name, f.type) for f in stored if f.name in key_names]
        declared_keys = [(k, to_arrow(StructType().add(k, t)).field(0).type)
                         for k, t in spec.key_types.items()]
        if [(n, str(t)) for n, t in stored_keys] != [(n, str(t)) for n, t in declared_keys]:
            raise StateSchemaError(
                f"{what}: the checkpoint's state is keyed by {stored_keys}, the pipeline keys "
                f"it by {declared_keys}; the key of a stateful operator cannot change under a "
                "checkpoint, its type included (keep the old key, cast it back, or start a "
                "new checkpoint directory)"
            )
        columns = {n: t for n, _k, t in spec.state_columns()}
        declared = to_arrow(StructType([StructType().add(n, t).fields[0]
                                        for n, t in columns.items()]))
        kept = [f for f in stored if f.name != KG_COLUMN and f.name not in key_names]
        sources = {}
        for new, old in state.renamed.items():  # an output's columns: name, name__sum, ...
            for column in columns:
                if column == new or column.startswith(new + "__"):
                    sources[column] = old + column[len(new):]
        evolution = plan_evolution(what, pa_schema(kept), declared,
                                   {old: new for new, old in sources.items()},
                                   noun="aggregation state column",
                                   when="the first batch after the restore stopped before this "
                                        "operator's job (its input's types decide its state "
                                        "types); its state and the outputs were not changed")
        self._evolved(state, evolution)

    def describe_state(self, state: OperatorState) -> dict[str, Any]:
        spec = getattr(state, "spec", None)
        if spec is None or state.rewrite:
            # no batch yet since the restore (or the restored files not yet rewritten): what
            # the checkpoint said, which is what its files hold
            return dict(state.restored_describe)
        return {"file_schema": agg_file_schema(spec).json(), "aggs": spec.describe()["aggs"]}

    def snapshot_of(self, state: OperatorState) -> OperatorSnapshot:
        snapshot = super().snapshot_of(state)
        return dataclasses.replace(snapshot, spec=getattr(state, "spec", None))

    def compute(self, run: BatchRun) -> DataFrame | None:
        from pyspark.sql import functions as F

        from spark_ckpt.arrowtypes import to_arrow

        state: AggState = self._state(run)
        df = self._unrouted(run)  # routed below: one analysis of the plan fewer per batch
        if df is None:
            return None
        spec = self._spec(state, df)
        spark = self.pipeline.spark
        schema = agg_file_schema(spec)
        if _FileSink.provably_empty(df) and not state.rewrite:
            # (while restored ranges wait to be rewritten in the declared schema, the job runs
            # even on no input: every range's task rewrites its files)
            run.stats.state[self.operator] = {"tasks_run": 0, "input_rows": 0,
                                              "changed_keys": 0}
            if run.operators is not None:  # the spec it learnt: state_view() can read
                run.operators.publish(self.operator)
            return self._empty_view(state)
        route = self._route(state)
        others = [*self.keys, *([CHANNEL_COLUMN] if CHANNEL_COLUMN in df.columns else [])]
        single = self._small(state, df)
        if state.partials is None:
            state.partials = spec.partial_columns()
        if single:  # one stage, one task updating every range in turn
            kg = route[KG_COLUMN]
            pid = partition_column(state.max_parallelism, state.parallelism, key_group=kg)
            partials = df.coalesce(1).groupBy(kg.alias(KG_COLUMN), *others).agg(
                pid.alias(PID_COLUMN), *state.partials)
        else:  # one task per range
            partials = df.withColumns(route).repartitionById(state.parallelism, PID_COLUMN) \
                .groupBy(PID_COLUMN, KG_COLUMN, *others).agg(*state.partials)
        operators = run.operators
        assert operators is not None  # _state checked it
        chained = self._chain(run, state, self._empty_view(state))
        params = self._params(run, state) | {
            "file_schema": to_arrow(schema).serialize().to_pybytes().hex(),
            "columns": [[n, k] for n, k, _t in spec.state_columns()],
            "view": [[o.name, o.agg.func] for o in spec.outputs],
            "sinks": [{"name": n, "dir": d, "schema": h} for n, (d, h) in chained.items()],
            "single_task": single,
            "schema_id": schema_id(to_arrow(schema), params_sources(state.evolution)),
        }
        metas = self._run_job(run, state, partials, agg_task(params, self._plans(state)),
                              partitioned=True, placeable=not single)
        run.stats.state[self.operator]["single_task"] = single
        for name, (directory, _h) in chained.items():
            files = [f for m in metas for f in (m.get("sinks") or {}).get(name, [])]
            sink = operators.transactions[name].sink
            run.chained[name] = sink.chained_piece(run.batch_id, directory, files)
        files = [m["changelog"]["path"] for m in metas if m.get("changelog")]
        if not files or not self._read_back_needed(run):
            return self._empty_view(state)  # no changes, or only chained sinks read them
        view: DataFrame = spec.view(spark.read.schema(schema).parquet(*files).select(
            *[F.col(f.name) for f in schema.fields]))
        return view

    def _small(self, state: AggState, df: DataFrame) -> bool:
        """A batch small enough for one task: Spark's size estimate of the input (as for a
        broadcast join) and the state both small, and more than one range to save a shuffle
        for."""
        s = self.pipeline.settings
        if s.state_small_batch_bytes <= 0 or state.parallelism < 2 or \
                sum(h.rows for h in state.live.values()) > s.state_small_batch_max_state_rows:
            return False
        if any(h.token is None and h.files for h in state.live.values()):
            return False  # rescaled: ranges rebuilt from old chains, their size unknown
        size = frame_api(df).size_estimate(df)
        return size is not None and size <= s.state_small_batch_bytes

    def _chain(self, run: BatchRun, state: AggState,
               view: DataFrame) -> dict[str, tuple[str, str]]:
        """Two-phase outputs reading this stream directly, whose files the tasks can write:
        output name -> (staging directory, Arrow schema of its files)."""
        from spark_ckpt.sinks import arrow_schema_for

        operators = run.operators
        assert operators is not None
        chained: dict[str, tuple[str, str]] = {}
        for output in self.pipeline.graph.outputs:
            name = output.output_name
            txns = operators.transactions.get(name)
            if output.parents[0] is not self or txns is None or \
                    run.batch_id <= operators.skip_output_through.get(name, -1):
                continue
            directory = txns.sink.chain_target(run.batch_id)
            if directory is None:
                continue
            key = (name, view.schema.json())
            if key not in state.chain_schemas:  # checked once per schema, as a batch would be
                txns.sink.prepare(view)
                state.chain_schemas[key] = \
                    arrow_schema_for(view.schema).serialize().to_pybytes().hex()
            schema = state.chain_schemas[key]
            chained[name] = (txns.sink.store.spark_path(directory), schema)
        return chained

    def full_state(self, name: str | None = None) -> Stream:
        """A stream whose every batch is the whole state after that batch (Structured
        Streaming's complete mode): one row per key, for sinks that want a full picture."""
        return FullState(self, name or f"{self.operator}.full_state")

    def state_view(self, checkpoint_id: int | None = None) -> DataFrame:
        """The whole state now (or of a retained checkpoint): one row per key. "Now" is the
        snapshot the pipeline published after its last batch (any thread may ask)."""
        from spark_ckpt.state.frames import read_handles

        snapshot = self.snapshot()
        spec = snapshot.spec if snapshot is not None else None
        handles = list(snapshot.handles) if checkpoint_id is None and snapshot is not None \
            else [] if checkpoint_id is None else \
            self.pipeline.checkpoint_handles(self.operator, checkpoint_id)
        if spec is None:
            raise JobDefinitionError(f"operator {self.operator}: no batch has run yet")
        view: DataFrame = spec.view(read_handles(self.pipeline.spark, handles,
                                                 agg_file_schema(spec), list(self.keys)))
        return view


class ProcessedStream(StatefulStream):
    kind = "process"

    def __init__(self, keyed: KeyedStream, name: str,
                 processor: KeyedProcessor | VectorizedProcessor,
                 output_schema: StructType | str, *, event_time: str | None,
                 watermark_delay_ms: int, ttl_ms: int | None, state_schema: Any = None,
                 state_renames: dict[str, str] | None = None,
                 inherit_watermark: bool = True) -> None:
        super().__init__(keyed, name)
        from pyspark.sql.types import StructType

        self.processor = processor
        self.state_renames = dict(state_renames or {})
        self._declared_state = state_schema if state_schema is not None \
            else getattr(processor, "state_schema", None)
        if self._declared_state is None and isinstance(processor, VectorizedProcessor):
            raise JobDefinitionError(
                f"process(): the vectorized processor {type(processor).__name__} declares no "
                "state_schema; expected its state variables with Spark types, for example "
                "state_schema = \"n BIGINT, total DOUBLE\""
            )
        self.declared_schema = output_schema
        # the declared output schema when given as a StructType (a DDL string is parsed by
        # Spark at the first batch, into the operator's state)
        self.output_schema: StructType | None = output_schema \
            if isinstance(output_schema, StructType) else None
        #: the event-time operator upstream whose watermark this one runs with (Structured
        #: Streaming's one watermark through chained operators), when it declares none
        self.clock: ProcessedStream | None = None
        if event_time is None and inherit_watermark:  # the nearest with_watermark upstream
            from spark_ckpt.streaming.template.event_time import (
                declared_watermark,
                upstream_clock,
            )

            mark = declared_watermark(keyed.inputs, f"operator {self.operator}")
            if mark is not None:
                event_time, watermark_delay_ms = mark.column, mark.delay_ms
            else:
                self.clock = upstream_clock(keyed.inputs, f"operator {self.operator}")
        self.event_time = event_time
        self.delay_ms = int(watermark_delay_ms)
        # inputs with watermarks of their own (a stream join): each input's delay, by channel
        self.channel_delays: tuple[int, ...] = ()
        self._split_warned: set[int] = set()
        self._effective_splits: dict[int, list[str]] = {}  # by input: the columns used
        self._marks: list[Any] | None = None  # each input's declared watermark (_input_marks)
        if ttl_ms is not None and ttl_ms <= 0:
            raise JobDefinitionError(f"process(): expected ttl_ms > 0 or None, found {ttl_ms}")
        self.ttl_ms = ttl_ms

    def new_state(self, parallelism: int, max_parallelism: int,
                  live: dict[int, StateHandle]) -> ProcessState:
        return ProcessState(parallelism, max_parallelism, live,
                            output_schema=self.output_schema)

    def _input_marks(self) -> list[Any]:
        """The watermark each input declares (None for an input that declares none): fixed
        once the operator exists (its inputs and theirs are), so found once, not on every
        batch and tick."""
        if self._marks is None:
            from spark_ckpt.streaming.template.event_time import stream_watermark

            self._marks = [stream_watermark(p) for p in self.parents]
        return self._marks

    @property
    def tracks_splits(self) -> bool:
        """Whether the watermark is kept per input partition and input (a partition-naming
        source or an idle timeout declared upstream), not from the largest time alone."""
        if self.event_time is None or self.clock is not None or \
                getattr(self, "processing_time", False):
            return False
        return any(m is not None and (m.split or m.idle_ms is not None)
                   for m in self._input_marks())

    def _with_split(self, channel: int, frame: DataFrame) -> DataFrame:
        from pyspark.sql import functions as F

        from spark_ckpt.state.task import SPLIT_COLUMN

        if not self.tracks_splits:
            return frame
        mark = self._input_marks()[channel]
        split = () if mark is None else mark.split
        missing = [c for c in split if c not in frame.columns]
        if missing and channel not in self._split_warned:
            self._split_warned.add(channel)
            log.warning(
                "operator %s: the watermark of its input %d is kept over the whole input: "
                "its rows no longer carry %s, the partition they were read from (keep "
                "those columns up to the operator for per-partition watermarks)",
                self.operator, channel, missing)
        if not split or missing:  # one partition: the input (a column for every input)
            self._effective_splits[channel] = []
            return frame.withColumn(SPLIT_COLUMN, F.lit(None).cast("string"))
        self._effective_splits[channel] = list(split)
        return frame.withColumn(SPLIT_COLUMN, F.concat_ws(
            ":", *[F.col(c).cast("string") for c in split]))

    def _split_tops(self, extra: Any, now_ms: int | None) -> list[list[tuple[int, bool]]]:
        """Each input's partitions: their largest event time, and whether they are active
        (not idle): one that had rows in the last batch that ran is, whatever the time since
        (a trigger interval or a long batch is no idleness); any other is while it had rows
        within its input's idle timeout of ``now_ms`` (always without one, or at None)."""
        splits = extra.get("event_splits") or {}
        last = extra.get("event_splits_at")
        marks = self._input_marks()  # one per input channel
        out: list[list[tuple[int, bool]]] = [[] for _ in range(max(1, len(marks)))]
        for key, (top, seen) in splits.items():
            channel = int(key.split("|", 1)[0])
            if channel >= len(out):  # an input the pipeline no longer has
                continue
            mark = marks[channel] if channel < len(marks) else None
            idle = None if mark is None else mark.idle_ms
            active = idle is None or now_ms is None or int(seen) == last or \
                now_ms - int(seen) < idle
            out[channel].append((int(top), active))
        return out

    def _split_watermark(self, extra: Any, now_ms: int | None) -> int | None:
        """The smallest watermark over the inputs, each input's the smallest over its active
        partitions (:meth:`_split_tops`); an input whose every partition is idle holds
        nothing back. None until every input has had rows. While every input is idle, the
        watermark without idleness (over every partition: never more than any would allow)."""
        tops = self._split_tops(extra, now_ms)
        delays = self.channel_delays or (self.delay_ms,) * len(tops)
        if any(not entries for entries in tops) or len(delays) != len(tops):
            return None
        found = [min(t for t, active in entries if active) - delay
                 for entries, delay in zip(tops, delays, strict=True)
                 if any(active for _t, active in entries)]
        if found:
            return min(found)
        return min(min(t for t, _a in entries) - delay
                   for entries, delay in zip(tops, delays, strict=True))

    def _track_splits(self, state: OperatorState, run: BatchRun,
                      metas: list[dict[str, Any]]) -> None:
        """Each input partition's largest event time, and when it last had rows. The
        partitions start afresh when the columns naming them changed since the last batch
        (a restart that reads other topics, keeps other columns or drops them): old entries
        would hold the watermark back for ever."""
        now = int(run.allocation.batch_time_ms)
        columns = [self._effective_splits.get(c, []) for c in range(len(self.parents))]
        recorded = state.extra.get("split_columns")
        splits = dict(state.extra.get("event_splits") or {})
        if recorded is not None and recorded != columns:
            log.info("operator %s: its inputs' partitions are now named by %s (were %s): "
                     "their watermarks start afresh", self.operator, columns, recorded)
            splits = {}
        for meta in metas:
            for key, top in (meta.get("max_event_by_split") or {}).items():
                old = splits.get(key)
                splits[key] = [int(top) if old is None else max(int(top), int(old[0])), now]
        state.extra["event_splits"] = splits
        state.extra["event_splits_at"] = now
        state.extra["split_columns"] = columns
        run.stats.state[self.operator]["idle_partitions"] = sum(
            not active for entries in self._split_tops(state.extra, now)
            for _t, active in entries)

    @property
    def watermark_ms(self) -> int | None:
        """The event-time watermark after the last batch (None before any event time)."""
        snapshot = self.snapshot()
        if snapshot is None:
            return None
        applied = snapshot.extra.get("applied_watermark_ms")
        if self.clock is not None:
            return None if applied is None else int(applied)
        mark = self._watermark(snapshot.extra)
        return mark if applied is None else int(applied) if mark is None else \
            max(mark, int(applied))

    def _watermark(self, extra: Any, now_ms: int | None = None) -> int | None:
        """The largest event time seen minus the delay; with inputs of their own watermarks
        (``channel_delays``), the smallest of theirs, as Structured Streaming's and Flink's
        operators take (none until every input has seen event time); kept per partition and
        input (:meth:`_split_watermark`) where :attr:`tracks_splits`, at ``now_ms``."""
        if self.tracks_splits:
            return self._split_watermark(extra, now_ms)
        by_channel = extra.get("max_event_by_channel")
        if self.channel_delays:
            if not by_channel or len(by_channel) < len(self.channel_delays):
                return None
            return min(int(by_channel[str(c)]) - d for c, d in enumerate(self.channel_delays))
        top = extra.get("max_event_ms")
        return None if top is None else int(top) - self.delay_ms

    def watermark_of(self, state: OperatorState, run: BatchRun | None = None) -> int | None:
        """The watermark the next batch runs with; never below the watermark the tasks
        already ran with (a delay raised at a restart does not move it back, as Structured
        Streaming's never does). With a clock upstream: the one it ran with in ``run``."""
        mark: int | None = None
        if self.clock is not None:
            if run is not None and run.operators is not None:
                upstream = run.operators.state(self.clock.operator).extra
                given = upstream.get("applied_watermark_ms")
                mark = None if given is None else int(given)
        else:
            mark = self._watermark(state.extra, None if run is None
                                   else int(run.allocation.batch_time_ms))
        applied = state.extra.get("applied_watermark_ms")
        if mark is None:
            return None if applied is None else int(applied)
        return mark if applied is None else max(mark, int(applied))

    def time_moved(self, batch_time_ms: int | None = None) -> bool:
        """The watermark moved past the one the tasks last ran with, or a batch at
        ``batch_time_ms`` would reach the earliest processing-time timer: a batch, with data
        or not, fires the timers it reached (any thread: the published snapshot)."""
        snapshot = self.snapshot()
        due = None if snapshot is None else snapshot.extra.get("next_processing_ms")
        if batch_time_ms is not None and due is not None and int(due) <= batch_time_ms:
            return True  # a processing-time timer is due (none in an available-now run)
        if snapshot is not None and self.clock is not None:  # the upstream's moved on
            upstream = self.clock.snapshot()
            mark = None if upstream is None else upstream.extra.get("applied_watermark_ms")
        else:
            mark = None if snapshot is None else self._watermark(snapshot.extra, batch_time_ms)
        if mark is None:
            return False
        applied = snapshot.extra.get("applied_watermark_ms")  # type: ignore[union-attr]
        return applied is None or mark > applied

    def compute(self, run: BatchRun) -> DataFrame | None:
        from pyspark.sql import functions as F
        from pyspark.sql.types import StructType

        from spark_ckpt.arrowtypes import to_arrow

        state: ProcessState = self._state(run)
        df = self._inputs(run, state)
        if df is None:
            return None
        spark = self.pipeline.spark
        if state.output_schema is None:
            state.output_schema = StructType.fromDDL(self.declared_schema)  # type: ignore[arg-type]
        output_schema = state.output_schema
        self._parse_state_schema(state)
        key_schema = to_arrow(StructType([df.schema[k] for k in self.keys]))
        if state.key_schema is None:
            self._check_restored_schema(state, key_schema)
        state.key_schema = key_schema
        if self.event_time is not None and self.event_time not in df.columns:
            raise JobDefinitionError(
                f"operator {self.operator}: event_time column {self.event_time!r} is not in its "
                f"input; columns: {df.columns}"
            )
        data = df.withColumn(MARKER_COLUMN, F.lit(False))
        markers = spark.range(state.parallelism).select(
            *[F.lit(None).cast(f.dataType).alias(f.name) for f in data.schema.fields
              if f.name not in (PID_COLUMN, MARKER_COLUMN, KG_COLUMN)],
            F.lit(-1).alias(KG_COLUMN), F.col("id").cast("int").alias(PID_COLUMN),
            F.lit(True).alias(MARKER_COLUMN))
        params = self._params(run, state) | {
            "output_schema": to_arrow(output_schema).serialize().to_pybytes().hex(),
            # one directory per run of a batch: a fenced driver still running the same batch
            # must not delete the owner's output when it cleans up its own (found racing two
            # real drivers)
            "output_dir": join(self.state_dir(), "output",
                               f"b{run.batch_id:012d}-{uuid.uuid4().hex[:12]}"),
            "processing_time_ms": run.allocation.batch_time_ms,
            "watermark_ms": self.watermark_of(state, run), "ttl_ms": self.ttl_ms,
            "late_watermark_ms": state.extra.get("applied_watermark_ms"),
            "event_time": self.event_time, "track_splits": self.tracks_splits,
            "state_schema": state.state_schema.serialize(),
            "key_schema": key_schema.serialize().to_pybytes().hex(),
        }
        metas = self._run_job(run, state, data.unionByName(markers),
                              processor_task(params, self._plans(state), self.processor))
        if params["watermark_ms"] is not None:  # what these tasks fired timers up to
            state.extra["applied_watermark_ms"] = params["watermark_ms"]
        by_channel = dict(state.extra.get("max_event_by_channel") or {})
        for meta in metas:
            for channel, top in (meta.get("max_event_by_channel") or {}).items():
                by_channel[channel] = max(int(top), int(by_channel.get(channel, top)))
        if by_channel:
            state.extra["max_event_by_channel"] = by_channel
        tops = [m["max_event_ms"] for m in metas if m.get("max_event_ms") is not None]
        if tops:
            state.extra["max_event_ms"] = max([*tops, state.extra.get("max_event_ms", tops[0])])
        if self.tracks_splits:
            self._track_splits(state, run, metas)
        # the earliest processing-time timer left: a batch without data runs at that time
        # when empty batches are skipped (time_moved)
        nexts = [int(m["next_processing_ms"]) for m in metas
                 if m.get("next_processing_ms") is not None]
        state.extra["next_processing_ms"] = min(nexts) if nexts else None
        run.stats.state[self.operator]["timers_fired"] = sum(m.get("timers_fired", 0)
                                                              for m in metas)
        run.stats.state[self.operator]["watermark_ms"] = params["watermark_ms"]
        for meta in metas:  # what the processor counted (Result.counters)
            for counter, value in (meta.get("counters") or {}).items():
                stats = run.stats.state[self.operator]
                stats[counter] = stats.get(counter, 0) + int(value)
        if run.operators is not None:  # the watermarks above, for readers on other threads
            run.operators.publish(self.operator)
        files = [m["output"]["path"] for m in metas if m.get("output")]
        out_dir = params["output_dir"]
        store = self.pipeline.storage
        run.on_cleanup(lambda: store.delete_dir(store.fs_path(out_dir)))
        if not files:
            empty: DataFrame = spark.createDataFrame([], output_schema)
            return empty
        out: DataFrame = spark.read.schema(output_schema).parquet(*files)
        return out

    def parse_state_schema(self) -> Any:
        """The declared state variables, parsed by Spark's parser (a StateSchema)."""
        from spark_ckpt.state.schema import parse_state_schema

        return parse_state_schema(self._declared_state, spark=self.pipeline.spark,
                                  where=f"operator {self.operator}: state_schema")

    def _parse_state_schema(self, state: ProcessState) -> Any:
        if state.state_schema is None:
            state.state_schema = self.parse_state_schema()
        return state.state_schema

    def _check_evolution(self, state: OperatorState) -> None:
        """The declared state variables against the checkpoint's, at start."""
        from spark_ckpt.state.evolution import plan_evolution
        from spark_ckpt.state.schema import StateSchema

        assert isinstance(state, ProcessState)
        raw = state.restored_describe.get("state_schema")
        if raw is None:  # an earlier format: refused at the first batch
            return
        stored = StateSchema.from_spark_json(raw)
        declared = self._parse_state_schema(state)
        self._evolved(state, plan_evolution(
            f"operator {self.operator}", stored.arrow(), declared.arrow(), self.state_renames,
            stored_json=stored.json_flags, declared_json=declared.json_flags))

    def describe_state(self, state: OperatorState) -> dict[str, Any]:
        state_schema = getattr(state, "state_schema", None)
        key_schema = getattr(state, "key_schema", None)
        if state_schema is None or key_schema is None or state.rewrite:
            return dict(state.restored_describe)
        from spark_ckpt.arrowtypes import to_spark

        return {"state_schema": state_schema.to_json(),
                "key_schema": to_spark(key_schema).json(), "state_format": 2}

    def _check_restored_schema(self, state: ProcessState, key_schema: Any) -> None:
        """A checkpoint of an earlier format (JSON documents per key) cannot be read as typed
        state: say so before anything runs."""
        restored = state.restored_describe
        if restored.get("state_format", 2) != 2 or (
                restored == {} and any(h.files for h in state.live.values())):
            raise CheckpointError(
                f"operator {self.operator}: the checkpoint holds this processor's state as JSON "
                "documents (spark_ckpt before typed state); expected typed state. Start the "
                "pipeline in a new checkpoint directory"
            )
        restored_keys = restored.get("key_schema")
        if restored_keys is not None:
            from pyspark.sql.types import StructType

            from spark_ckpt.arrowtypes import to_spark

            def fields(schema: Any) -> list[tuple[str, str]]:
                return [(f.name, f.dataType.simpleString()) for f in schema.fields]

            before = fields(StructType.fromJson(json.loads(restored_keys)))
            now = fields(to_spark(key_schema))
            if before != now:
                from spark_ckpt.errors import StateSchemaError

                raise StateSchemaError(
                    f"operator {self.operator}: the checkpoint's state is keyed by {before}, "
                    f"the pipeline keys it by {now}; the key of a stateful operator cannot "
                    "change under a checkpoint (keep the old key or start a new checkpoint "
                    "directory)"
                )

    def state_view(self, checkpoint_id: int | None = None) -> DataFrame:
        """Every key's state now (or at a retained checkpoint): the key columns and one column
        per declared state variable (``json`` variables as JSON strings). "Now" is the
        snapshot the pipeline published after its last batch (any thread may ask)."""
        from spark_ckpt.state.frames import read_processor_state

        snapshot = self.snapshot()
        describe = dict(snapshot.describe) if snapshot is not None else {}
        handles = list(snapshot.handles) if checkpoint_id is None and snapshot is not None \
            else [] if checkpoint_id is None else \
            self.pipeline.checkpoint_handles(self.operator, checkpoint_id)
        if "state_schema" not in describe:
            raise JobDefinitionError(f"operator {self.operator}: no batch has run yet")
        view: DataFrame = read_processor_state(self.pipeline.spark, handles, describe,
                                               list(self.keys))
        return view


class FullState(Stream):
    """The whole state of a stateful stream after each batch."""

    def __init__(self, parent: AggregatedStream, name: str) -> None:
        super().__init__(parent.pipeline, (parent,), name)
        self.stateful = parent

    def compute(self, run: BatchRun) -> DataFrame | None:
        if run.get_or_compute(self.stateful) is None:
            return None
        view: DataFrame = self.stateful.state_view()
        return view
