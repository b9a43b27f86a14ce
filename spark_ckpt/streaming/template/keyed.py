"""Keyed streams and their stateful operators, on the driver.

``stream.key_by("user")`` gives a :class:`KeyedStream`; ``.agg(...)`` and ``.process(...)`` give
stateful streams whose batches are the *update stream* (the keys that changed, with their new
aggregates; or the processor's output rows). Each batch a stateful operator runs one Spark job:

    input -> (_kg, _pid) -> repartitionById(P, _pid) [-> groupBy partials] -> mapInArrow(task)

Task ``i`` owns key-group range ``i`` (keygroups.py), works on its state (state/task.py) and
returns its new state handle; the job's result is only those handles and measurements (a few
hundred bytes a task), never state. The update stream is read back from the changelog or output
files the tasks wrote, so every sink sees exactly what the state saw, computed once.

Threads: ``live``, ``metrics`` and ``restore_from`` belong to the JobScheduler's thread (and to
``StreamingContext.start`` before the threads run). The checkpoint coordinator reads only
``live_files``, an immutable set replaced in one assignment after each batch.
"""

from __future__ import annotations

import copy
import json
import logging
import uuid
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

from spark_ckpt.errors import CheckpointError, InternalError, JobDefinitionError
from spark_ckpt.sinks.per_batch import _FileSink
from spark_ckpt.sparkapi import frame_api, spark_api, union_by_name
from spark_ckpt.state.aggregates import Agg, AggSpec
from spark_ckpt.state.chain import StateHandle, restore_plan
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
from spark_ckpt.storage import join
from spark_ckpt.streaming.template.stream import Stream, Template

if TYPE_CHECKING:
    from pyspark.sql import DataFrame
    from pyspark.sql.types import StructType

    from spark_ckpt.options import Settings
    from spark_ckpt.streaming.template.batch_run import BatchRun

__all__ = ["AggregatedStream", "FullState", "KeyedStream", "ProcessedStream", "StateScope",
           "StatefulStream"]

log = logging.getLogger(__name__)


class StateScope(Template, Protocol):
    """What a stateful operator needs of its pipeline (the StreamingContext), all set up by
    ``start()`` before any batch runs: the session and settings, the two-phase outputs its
    tasks may write directly (operator chaining) and those a restore already shows, and the
    checkpoint side (released state files, the handles of a completed checkpoint)."""

    spark: Any
    settings: Settings
    transactions: dict[str, Any]  # output name -> SinkTransactions
    skip_output_through: dict[str, int]
    coordinator: Any  # CheckpointCoordinator | None

    def checkpoint_handles(self, operator: str, checkpoint_id: int) -> list[Any]:
        """The state handles of ``operator`` in completed checkpoint ``checkpoint_id``."""


class KeyedStream:
    """A stream partitioned by key, ready for a stateful operator. Not a stream itself."""

    def __init__(self, ctx: StateScope, inputs: Sequence[Stream], keys: Sequence[str], *,
                 parallelism: int | None = None, max_parallelism: int | None = None) -> None:
        if not keys:
            raise JobDefinitionError("key_by(): expected at least one key column, found none")
        self.ctx = ctx
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
        return KeyedStream(self.ctx, [*self.inputs, *[i for o in others for i in o.inputs]],
                           self.keys, parallelism=self.parallelism,
                           max_parallelism=self.max_parallelism)

    def agg(self, name: str | None = None, *, state_renames: dict[str, str] | None = None,
            **aggs: Agg) -> AggregatedStream:
        """Running aggregates per key: ``agg(n=count(), total=sum_("amount"))``. Its batches
        are the changed keys with their new values; ``state_view()`` is the whole state.
        ``state_renames={"old": "new"}`` renames outputs whose state a checkpoint holds (see
        docs/operations.md, evolving state)."""
        return AggregatedStream(self, name or "agg", aggs, state_renames=state_renames)

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
    restarts (pass ``name=``)."""

    kind = "stateful"

    def __init__(self, keyed: KeyedStream, name: str) -> None:
        super().__init__(keyed.ctx, keyed.inputs, name)
        self.operator = self.name
        from spark_ckpt.names import check_name

        check_name("stateful operator name (pass name=)", self.operator)
        self.keys = keyed.keys
        self.requested_parallelism = keyed.parallelism
        self.requested_max = keyed.max_parallelism
        self.parallelism = 0
        self.max_parallelism = 0
        self.live: dict[int, StateHandle] = {}
        self.metrics: dict[int, dict[str, Any]] = {}
        self.restore_from: list[StateHandle] | None = None
        self.live_files: frozenset[str] = frozenset()
        self.state_renames: dict[str, str] = {}
        # set at a restore whose stored state differs from the declared one: where declared
        # columns come from, and whether the next job must rewrite every restored range
        self.evolution: Any = None  # state.evolution.Evolution | None
        self._rewrite = False
        self.extra: dict[str, Any] = {}
        self.restored_describe: dict[str, Any] = {}
        self._routing: dict[str, Any] | None = None  # _kg and _pid columns
        keyed.ctx.graph.add_stateful(self)

    # -- lifecycle (StreamingContext.start, before any thread runs) -------------------------
    def configure(self, restored: dict[str, Any] | None) -> None:
        settings = self.ctx.settings
        default_p = settings.state_parallelism or spark_api(self.ctx.spark).default_parallelism()
        self.parallelism = self.requested_parallelism or default_p
        self.max_parallelism = self.requested_max or settings.state_max_parallelism
        self._routing = None
        layout = ranges(self.parallelism, self.max_parallelism)
        self.live = {i: StateHandle.empty(r) for i, r in enumerate(layout)}
        self.restore_from = None
        self.evolution = None
        self._rewrite = False
        if restored is None:
            self._publish()
            return
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
            self.max_parallelism = old_max
            layout = ranges(self.parallelism, old_max)
            self.live = {i: StateHandle.empty(r) for i, r in enumerate(layout)}
        elif old_max != self.max_parallelism:
            from spark_ckpt.errors import StateSchemaError

            raise StateSchemaError(
                f"operator {self.operator}: the checkpoint has max parallelism {old_max}, the "
                f"pipeline asks for {self.max_parallelism}; key groups cannot change under a "
                "checkpoint (keep the old value or start a new checkpoint directory)"
            )
        handles = [StateHandle.from_json(h) for _pid, h in
                   sorted(restored["handles"].items(), key=lambda kv: int(kv[0]))]
        self.extra = dict(restored.get("extra", {}))
        self.restored_describe = {k: restored[k] for k in (
            "file_schema", "aggs", "state_schema", "key_schema", "state_format")
            if k in restored}
        if [h.range for h in handles] == [self.live[i].range for i in sorted(self.live)]:
            self.live = dict(enumerate(handles))
        else:
            log.info("Operator %s: rescaling state from %d to %d tasks (%d key groups)",
                     self.operator, len(handles), self.parallelism, self.max_parallelism)
            self.restore_from = handles
            for i, r in enumerate(layout):
                files = tuple(restore_plan(r, handles))
                self.live[i] = StateHandle(r.label, None, files, 0)
        self._publish()
        self._check_evolution()

    def _check_evolution(self) -> None:
        """At a restore, before any batch: refuse declared state the checkpoint's cannot
        become (StateSchemaError); else note how it evolves (subclasses)."""

    def _evolved(self, evolution: Any) -> None:
        """Keep a checked evolution; log what it changes."""
        self.evolution = evolution
        self._rewrite = evolution.changed
        if evolution.changed:
            log.info("Operator %s: state schema evolves at this restore: added %s, removed %s "
                     "(values dropped), renamed %s, widened %s; the first batch rewrites every "
                     "restored range", self.operator, list(evolution.added),
                     list(evolution.removed),
                     {old: new for new, old in evolution.sources.items()},
                     list(evolution.widened))

    def _publish(self) -> None:
        before = self.live_files
        self.live_files = frozenset(f.path for h in self.live.values() for f in h.files)
        dropped = before - self.live_files
        if dropped and self.ctx.coordinator is not None:  # deleted once no checkpoint needs them
            self.ctx.coordinator.release_files(dropped)

    def ack_state(self, pid: int) -> dict[str, Any]:
        return {"handle": self.live[pid].to_json(),
                "operator": {"kind": self.kind, "parallelism": self.parallelism,
                             "max_parallelism": self.max_parallelism, "keys": list(self.keys),
                             "extra": copy.deepcopy(self.extra), **self.describe_state()}}

    def describe_state(self) -> dict[str, Any]:
        """What a reader needs to decode the state files (see state/frames.py)."""
        return dict(self.restored_describe)

    def state_dir(self) -> str:
        store = self.ctx.storage
        return store.spark_path(join(self.ctx.root, "state", self.operator))

    # -- per batch ---------------------------------------------------------------------------
    def _inputs(self, run: BatchRun) -> DataFrame | None:
        """The batch's input with its routing columns (key group, task)."""
        df = self._unrouted(run)
        return None if df is None else df.withColumns(self._route())

    def _route(self) -> dict[str, Any]:
        if self._routing is None:  # the same expressions every batch: built once
            self._routing = {
                KG_COLUMN: key_group_column(self.keys, self.max_parallelism),
                PID_COLUMN: partition_column(self.max_parallelism, self.parallelism)}
        return self._routing

    def _unrouted(self, run: BatchRun) -> DataFrame | None:
        if run.batch_id != run.stats.batch_id:
            raise JobDefinitionError(
                f"operator {self.operator}: a window over a stateful stream would apply "
                "earlier batches to the state again; window the input instead"
            )
        from pyspark.sql import functions as F

        frames = [run.get_or_compute(p) for p in self.parents]
        if any(f is None for f in frames):
            return None
        if len(frames) > 1:
            frames = [f.withColumn(CHANNEL_COLUMN, F.lit(i)) for i, f in enumerate(frames)]
        df = union_by_name(frames)
        missing = [k for k in self.keys if k not in df.columns]
        if missing:
            raise JobDefinitionError(
                f"operator {self.operator}: key columns {missing} are not in its input; "
                f"columns: {df.columns}"
            )
        return df

    def _read_back_needed(self, run: BatchRun) -> bool:
        """Whether any stream or output reads this batch's update stream from the files the
        tasks wrote; not when every reader is a sink the tasks wrote themselves (chained)."""
        for stream in self.ctx.graph.reachable():
            if any(p is self for p in stream.parents) and \
                    getattr(stream, "output_name", None) not in run.chained:
                return True
        return False

    def _params(self, run: BatchRun) -> dict[str, Any]:
        s = self.ctx.settings
        return {"pipeline_id": self.ctx.lineage, "operator": self.operator,
                "batch": run.batch_id, "state_dir": self.state_dir(), "backend": s.state_backend,
                "memory_max_rows": s.state_memory_max_rows, "local_dir": s.state_local_dir,
                "materialize_every": s.state_materialize_every, "keys": list(self.keys),
                "local_spill": s.state_local_spill,
                "state_sources": dict(self.evolution.sources) if self.evolution else {},
                "rewrite": self._rewrite}

    def _plans(self) -> dict[int, dict[str, Any]]:
        return {pid: {"range": h.range, "token": h.token,
                      "files": [f.to_json() for f in h.files]} for pid, h in self.live.items()}

    def _run_job(self, run: BatchRun, df: DataFrame, fn: Any, *,
                 partitioned: bool = False) -> list[dict[str, Any]]:
        spark_api(self.ctx.spark).describe(
            f"spark_ckpt pipeline {self.ctx.name} batch {run.batch_id} operator {self.operator}")
        if not partitioned:
            df = df.repartitionById(self.parallelism, PID_COLUMN)
        try:
            rows = df.mapInArrow(fn, meta_schema()).collect()
        except Exception as exc:
            from spark_ckpt.errors import UserFunctionError

            user = UserFunctionError.from_task_failure(exc)
            if user is None:
                raise
            raise user from None  # the JVM's stack and task retries say nothing more
        metas = []
        for row in rows:
            meta = json.loads(row.meta)
            meta["pid"] = int(row.pid)
            handle = StateHandle.from_json(meta["handle"])
            self.live[meta["pid"]] = handle
            self.metrics[meta["pid"]] = {k: meta.get(k) for k in (
                "sync_ms", "async_ms", "alignment_ms", "channels", "apply_ms", "restore_ms",
                "restored",
                "input_rows", "changed", "written_bytes", "total_ms", "executor", "worker",
                "cache")}
            self.metrics[meta["pid"]]["batch"] = run.batch_id
            metas.append(meta)
        self._publish()
        if self._rewrite:
            missing = sorted(set(self.live) - {m["pid"] for m in metas})
            if missing:  # not expected: every range's task runs (markers, or empty partitions)
                log.warning("Operator %s batch %d: ranges %s did not run; their state is "
                            "rewritten at the next batch", self.operator, run.batch_id, missing)
            else:
                self._rewrite = False
                log.info("Operator %s batch %d: every range rewritten with the declared state "
                         "schema", self.operator, run.batch_id)
        run.stats.state[self.operator] = {
            "tasks_run": len(metas), "input_rows": sum(m["input_rows"] for m in metas),
            "changed_keys": sum(m["changed"] for m in metas),
            "state_rows": sum(h.rows for h in self.live.values()),
            "restored_tasks": sum(1 for m in metas if m.get("restored")),
            "written_bytes": sum(m["written_bytes"] for m in metas),
            "max_task_ms": max((m["total_ms"] for m in metas), default=0),
            "alignment_ms": max((m["alignment_ms"] for m in metas), default=0),
            "tasks": {str(m["pid"]): {"executor": m["executor"], "worker": m["worker"],
                                      "restored": m["restored"], "cache": m.get("cache"),
                                      "ms": m["total_ms"], "restore_ms": m.get("restore_ms"),
                                      "rows": m["handle"].get("rows")} for m in metas},
        }
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
        return (union_by_name(frames) if len(frames) > 1 else frames[0]).schema

    def _empty(self, stream: Any) -> DataFrame:
        from spark_ckpt.sparkapi import empty_frame
        from spark_ckpt.streaming.template.stream import InputStream, Output, Transformed, Windowed

        if isinstance(stream, InputStream):
            return stream.source.empty(self.spark)
        if isinstance(stream, Transformed):
            return stream.fn(*[self.get_or_compute(p) for p in stream.parents])
        if isinstance(stream, Windowed | Output):
            return self.get_or_compute(stream.parents[0])
        if isinstance(stream, AggregatedStream):
            spec = AggSpec(stream.keys, stream.aggs, self.input_schema(stream))
            stream_spec, stream.spec = stream.spec, spec
            try:
                return spec.view(empty_frame(self.spark, stream.file_schema()))
            finally:
                stream.spec = stream_spec
        if isinstance(stream, ProcessedStream):
            from pyspark.sql.types import StructType

            schema = stream.output_schema or StructType.fromDDL(stream._declared)
            return empty_frame(self.spark, schema)
        raise InternalError(f"stream {stream.name}: expected a stream kind the schema dry run "
                            f"knows, found a {type(stream).__name__}")


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


class AggregatedStream(StatefulStream):
    kind = "agg"

    def __init__(self, keyed: KeyedStream, name: str, aggs: dict[str, Agg], *,
                 state_renames: dict[str, str] | None = None) -> None:
        super().__init__(keyed, name)
        self.aggs = dict(aggs)
        self.state_renames = dict(state_renames or {})
        self._renamed: dict[str, str] = {}  # output renames that apply: new -> old
        self._types_checked = False  # the restored state's types, against the input's
        self.spec: AggSpec | None = None
        self._empty: DataFrame | None = None  # the update stream's view with no rows
        self._chain_schemas: dict[tuple[str, str], str] = {}  # (output, view schema) -> Arrow
        self._partials: list[Any] | None = None  # the partial aggregate columns

    def _empty_view(self) -> DataFrame:
        if self._empty is None:
            assert self.spec is not None
            self._empty = self.spec.view(self.ctx.spark.createDataFrame([], self.file_schema()))
        return self._empty

    def _spec(self, df: DataFrame) -> AggSpec:
        if self.spec is None:
            spec = AggSpec(self.keys, self.aggs, df.schema)
            if "file_schema" in self.restored_describe and not self._types_checked:
                self._check_state_types(spec)
            self.spec = spec
        return self.spec

    def _check_evolution(self) -> None:
        """What can be checked before the input's types are known: renames, and that no kept
        output changed its function (the state of a count is not that of a max)."""
        from spark_ckpt.errors import StateSchemaError
        from spark_ckpt.state.evolution import check_renames

        self._types_checked = False
        stored = self.restored_describe.get("aggs")
        if stored is None:
            return
        what = f"operator {self.operator}"
        self._renamed = check_renames(self.state_renames, list(stored), list(self.aggs), what)
        changed = []
        for name, agg in self.aggs.items():
            source = self._renamed.get(name, name)
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
        if "file_schema" in self.restored_describe:
            self._check_types_at_start()

    def _check_types_at_start(self) -> None:
        """The state types an aggregation's input gives it, learnt at start from the template
        over no rows (Spark analyses, nothing runs); a pipeline whose template cannot be
        followed so (a stream kind this does not know, a transform that fails on no rows)
        is checked at its first batch instead."""
        try:
            schema = _SchemaRun(self.ctx.spark).input_schema(self)
            spec = AggSpec(self.keys, self.aggs, schema)
        except Exception as exc:  # noqa: BLE001 - the first batch checks it instead
            log.info("Operator %s: state types checked at the first batch (the template's "
                     "schema at start: %s)", self.operator, exc)
            return
        self._check_state_types(spec)
        self._types_checked = True

    def _check_state_types(self, spec: AggSpec) -> None:
        """At the first batch after a restore, before its job: the stored state columns
        widen to the declared ones (the input's types decide them), keyed the same way."""
        from pyspark.sql.types import StructType

        from spark_ckpt.arrowtypes import to_arrow
        from spark_ckpt.errors import StateSchemaError
        from spark_ckpt.state.evolution import plan_evolution

        what = f"operator {self.operator}"
        stored = to_arrow(StructType.fromJson(json.loads(self.restored_describe["file_schema"])))
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
        for new, old in self._renamed.items():  # an output's columns: name, name__sum, ...
            for column in columns:
                if column == new or column.startswith(new + "__"):
                    sources[column] = old + column[len(new):]
        evolution = plan_evolution(what, pa_schema(kept), declared,
                                   {old: new for new, old in sources.items()},
                                   noun="aggregation state column",
                                   when="the first batch after the restore stopped before this "
                                        "operator's job (its input's types decide its state "
                                        "types); its state and the outputs were not changed")
        self._evolved(evolution)

    def describe_state(self) -> dict[str, Any]:
        if self.spec is None or self._rewrite:
            # no batch yet since the restore (or the restored files not yet rewritten): what
            # the checkpoint said, which is what its files hold
            return dict(self.restored_describe)
        return {"file_schema": self.file_schema().json(), "aggs": self.spec.describe()["aggs"]}

    def file_schema(self) -> StructType:
        from pyspark.sql.types import IntegerType, StructField, StructType

        assert self.spec is not None
        return StructType([StructField(KG_COLUMN, IntegerType()),
                           *[StructField(k, t) for k, t in self.spec.key_types.items()],
                           *[StructField(n, t) for n, _k, t in self.spec.state_columns()]])

    def compute(self, run: BatchRun) -> DataFrame | None:
        from pyspark.sql import functions as F

        from spark_ckpt.arrowtypes import to_arrow

        df = self._unrouted(run)  # routed below: one analysis of the plan fewer per batch
        if df is None:
            return None
        spec = self._spec(df)
        spark = self.ctx.spark
        schema = self.file_schema()
        if _FileSink.provably_empty(df) and not self._rewrite:
            # (while restored ranges wait to be rewritten in the declared schema, the job runs
            # even on no input: every range's task rewrites its files)
            run.stats.state[self.operator] = {"tasks_run": 0, "input_rows": 0,
                                              "changed_keys": 0}
            return self._empty_view()
        route = self._route()
        others = [*self.keys, *([CHANNEL_COLUMN] if CHANNEL_COLUMN in df.columns else [])]
        single = self._small(df)
        if self._partials is None:
            self._partials = spec.partial_columns()
        if single:  # one stage, one task updating every range in turn
            kg = route[KG_COLUMN]
            pid = partition_column(self.max_parallelism, self.parallelism, key_group=kg)
            partials = df.coalesce(1).groupBy(kg.alias(KG_COLUMN), *others).agg(
                pid.alias(PID_COLUMN), *self._partials)
        else:  # one task per range
            partials = df.withColumns(route).repartitionById(self.parallelism, PID_COLUMN) \
                .groupBy(PID_COLUMN, KG_COLUMN, *others).agg(*self._partials)
        chained = self._chain(run, self._empty_view())
        params = self._params(run) | {
            "file_schema": to_arrow(schema).serialize().to_pybytes().hex(),
            "columns": [[n, k] for n, k, _t in spec.state_columns()],
            "view": [[o.name, o.agg.func] for o in spec.outputs],
            "sinks": [{"name": n, "dir": d, "schema": h} for n, (d, h) in chained.items()],
            "single_task": single,
            "schema_id": schema_id(to_arrow(schema), params_sources(self.evolution)),
        }
        metas = self._run_job(run, partials, agg_task(params, self._plans()), partitioned=True)
        run.stats.state[self.operator]["single_task"] = single
        for name, (directory, _h) in chained.items():
            files = [f for m in metas for f in (m.get("sinks") or {}).get(name, [])]
            sink = self.ctx.transactions[name].sink
            run.chained[name] = sink.chained_piece(run.batch_id, directory, files)
        files = [m["changelog"]["path"] for m in metas if m.get("changelog")]
        if not files or not self._read_back_needed(run):
            return self._empty_view()  # no changes, or only chained sinks read them
        return spec.view(spark.read.schema(schema).parquet(*files).select(
            *[F.col(f.name) for f in schema.fields]))

    def _small(self, df: DataFrame) -> bool:
        """A batch small enough for one task: Spark's size estimate of the input (as for a
        broadcast join) and the state both small, and more than one range to save a shuffle
        for."""
        s = self.ctx.settings
        if s.state_small_batch_bytes <= 0 or self.parallelism < 2 or \
                sum(h.rows for h in self.live.values()) > s.state_small_batch_max_state_rows:
            return False
        if any(h.token is None and h.files for h in self.live.values()):
            return False  # rescaled: ranges rebuilt from old chains, their size unknown
        size = frame_api(df).size_estimate(df)
        return size is not None and size <= s.state_small_batch_bytes

    def _chain(self, run: BatchRun, view: DataFrame) -> dict[str, tuple[str, str]]:
        """Two-phase outputs reading this stream directly, whose files the tasks can write:
        output name -> (staging directory, Arrow schema of its files)."""
        from spark_ckpt.sinks import arrow_schema_for

        chained: dict[str, tuple[str, str]] = {}
        for output in self.ctx.graph.outputs:
            name = output.output_name
            txns = self.ctx.transactions.get(name)
            if output.parents[0] is not self or txns is None or \
                    run.batch_id <= self.ctx.skip_output_through.get(name, -1):
                continue
            directory = txns.sink.chain_target(run.batch_id)
            if directory is None:
                continue
            key = (name, view.schema.json())
            if key not in self._chain_schemas:  # checked once per schema, as a batch would be
                txns.sink.prepare(view)
                self._chain_schemas[key] = \
                    arrow_schema_for(view.schema).serialize().to_pybytes().hex()
            schema = self._chain_schemas[key]
            chained[name] = (txns.sink.store.spark_path(directory), schema)  # type: ignore[attr-defined]
        return chained

    def full_state(self, name: str | None = None) -> Stream:
        """A stream whose every batch is the whole state after that batch (Structured
        Streaming's complete mode): one row per key, for sinks that want a full picture."""
        return FullState(self, name or f"{self.operator}.full_state")

    def state_view(self, checkpoint_id: int | None = None) -> DataFrame:
        """The whole state now (or of a retained checkpoint): one row per key."""
        from spark_ckpt.state.frames import read_handles

        handles = list(self.live.values()) if checkpoint_id is None else \
            self.ctx.checkpoint_handles(self.operator, checkpoint_id)
        if self.spec is None:
            raise JobDefinitionError(f"operator {self.operator}: no batch has run yet")
        return self.spec.view(read_handles(self.ctx.spark, handles, self.file_schema(),
                                           list(self.keys)))


class ProcessedStream(StatefulStream):
    kind = "process"

    def __init__(self, keyed: KeyedStream, name: str,
                 processor: KeyedProcessor | VectorizedProcessor,
                 output_schema: StructType | str, *, event_time: str | None,
                 watermark_delay_ms: int, ttl_ms: int | None, state_schema: Any = None,
                 state_renames: dict[str, str] | None = None) -> None:
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
        self.state_schema: Any = None  # parsed at a restore or the first batch (Spark's parser)
        self.key_schema: Any = None
        self._declared = output_schema
        self.output_schema: StructType | None = output_schema \
            if isinstance(output_schema, StructType) else None
        self.event_time = event_time
        self.delay_ms = int(watermark_delay_ms)
        if ttl_ms is not None and ttl_ms <= 0:
            raise JobDefinitionError(f"process(): expected ttl_ms > 0 or None, found {ttl_ms}")
        self.ttl_ms = ttl_ms

    @property
    def watermark_ms(self) -> int | None:
        top = self.extra.get("max_event_ms")
        return None if top is None else int(top) - self.delay_ms

    def compute(self, run: BatchRun) -> DataFrame | None:
        from pyspark.sql import functions as F
        from pyspark.sql.types import StructType

        from spark_ckpt.arrowtypes import to_arrow

        df = self._inputs(run)
        if df is None:
            return None
        spark = self.ctx.spark
        if self.output_schema is None:
            self.output_schema = StructType.fromDDL(self._declared)  # type: ignore[arg-type]
        self._parse_state_schema()
        key_schema = to_arrow(StructType([df.schema[k] for k in self.keys]))
        if self.key_schema is None:
            self._check_restored_schema(key_schema)
        self.key_schema = key_schema
        if self.event_time is not None and self.event_time not in df.columns:
            raise JobDefinitionError(
                f"operator {self.operator}: event_time column {self.event_time!r} is not in its "
                f"input; columns: {df.columns}"
            )
        data = df.withColumn(MARKER_COLUMN, F.lit(False))
        markers = spark.range(self.parallelism).select(
            *[F.lit(None).cast(f.dataType).alias(f.name) for f in data.schema.fields
              if f.name not in (PID_COLUMN, MARKER_COLUMN, KG_COLUMN)],
            F.lit(-1).alias(KG_COLUMN), F.col("id").cast("int").alias(PID_COLUMN),
            F.lit(True).alias(MARKER_COLUMN))
        params = self._params(run) | {
            "output_schema": to_arrow(self.output_schema).serialize().to_pybytes().hex(),
            # one directory per run of a batch: a fenced driver still running the same batch
            # must not delete the owner's output when it cleans up its own (found racing two
            # real drivers)
            "output_dir": join(self.state_dir(), "output",
                               f"b{run.batch_id:012d}-{uuid.uuid4().hex[:12]}"),
            "processing_time_ms": run.allocation.batch_time_ms,
            "watermark_ms": self.watermark_ms, "ttl_ms": self.ttl_ms,
            "event_time": self.event_time,
            "state_schema": self.state_schema.serialize(),
            "key_schema": key_schema.serialize().to_pybytes().hex(),
        }
        metas = self._run_job(run, data.unionByName(markers),
                              processor_task(params, self._plans(), self.processor))
        tops = [m["max_event_ms"] for m in metas if m.get("max_event_ms") is not None]
        if tops:
            self.extra["max_event_ms"] = max([*tops, self.extra.get("max_event_ms", tops[0])])
        run.stats.state[self.operator]["timers_fired"] = sum(m.get("timers_fired", 0)
                                                              for m in metas)
        run.stats.state[self.operator]["watermark_ms"] = self.watermark_ms
        files = [m["output"]["path"] for m in metas if m.get("output")]
        out_dir = params["output_dir"]
        run.on_cleanup(lambda: self.ctx.storage.delete_dir(self.ctx.storage.fs_path(out_dir)))
        if not files:
            return spark.createDataFrame([], self.output_schema)
        return spark.read.schema(self.output_schema).parquet(*files)

    def _parse_state_schema(self) -> Any:
        if self.state_schema is None:
            from spark_ckpt.state.schema import parse_state_schema

            self.state_schema = parse_state_schema(
                self._declared_state, spark=self.ctx.spark,
                where=f"operator {self.operator}: state_schema")
        return self.state_schema

    def _check_evolution(self) -> None:
        """The declared state variables against the checkpoint's, at start."""
        from spark_ckpt.state.evolution import plan_evolution
        from spark_ckpt.state.schema import StateSchema

        raw = self.restored_describe.get("state_schema")
        if raw is None:  # an earlier format: refused at the first batch
            return
        stored = StateSchema.from_spark_json(raw)
        declared = self._parse_state_schema()
        self._evolved(plan_evolution(
            f"operator {self.operator}", stored.arrow(), declared.arrow(), self.state_renames,
            stored_json=stored.json_flags, declared_json=declared.json_flags))

    def describe_state(self) -> dict[str, Any]:
        if self.state_schema is None or self.key_schema is None or self._rewrite:
            return dict(self.restored_describe)
        from spark_ckpt.arrowtypes import to_spark

        return {"state_schema": self.state_schema.to_json(),
                "key_schema": to_spark(self.key_schema).json(), "state_format": 2}

    def _check_restored_schema(self, key_schema: Any) -> None:
        """A checkpoint of an earlier format (JSON documents per key) cannot be read as typed
        state: say so before anything runs."""
        if self.restored_describe.get("state_format", 2) != 2 or (
                self.restored_describe == {} and any(h.files for h in self.live.values())):
            raise CheckpointError(
                f"operator {self.operator}: the checkpoint holds this processor's state as JSON "
                "documents (spark_ckpt before typed state); expected typed state. Start the "
                "pipeline in a new checkpoint directory"
            )
        restored_keys = self.restored_describe.get("key_schema")
        if restored_keys is not None:
            import json

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
        per declared state variable (``json`` variables as JSON strings)."""
        from spark_ckpt.state.frames import read_processor_state

        handles = list(self.live.values()) if checkpoint_id is None else \
            self.ctx.checkpoint_handles(self.operator, checkpoint_id)
        describe = self.describe_state()
        if "state_schema" not in describe:
            raise JobDefinitionError(f"operator {self.operator}: no batch has run yet")
        return read_processor_state(self.ctx.spark, handles, describe, list(self.keys))


class FullState(Stream):
    """The whole state of a stateful stream after each batch."""

    def __init__(self, parent: StatefulStream, name: str) -> None:
        super().__init__(parent.ctx, (parent,), name)
        self.stateful = parent

    def compute(self, run: BatchRun) -> DataFrame | None:
        if run.get_or_compute(self.stateful) is None:
            return None
        return self.stateful.state_view()  # type: ignore[attr-defined]
