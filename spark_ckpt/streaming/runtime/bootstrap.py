"""Starting a pipeline from state written by a batch job (``ctx.bootstrap_state``), and the state
files both it and the offline rewrite (:mod:`spark_ckpt.ops.state_processor`) write: one run
claimed in the pipeline's directory, the frame checked against the operator's layout, files
written per key group."""

from __future__ import annotations

import json
import logging
import uuid
from typing import TYPE_CHECKING, Any

from spark_ckpt.clock import Clock
from spark_ckpt.errors import CheckpointError, InternalError, JobDefinitionError
from spark_ckpt.state.schema import EXPIRES_COLUMN as EXPIRES
from spark_ckpt.state.schema import TIMERS_COLUMN as TIMERS
from spark_ckpt.storage import Storage, join

if TYPE_CHECKING:
    from collections.abc import Callable

    from pyspark.sql import DataFrame, SparkSession

    from spark_ckpt.streaming.template.definition import PipelineDefinition


__all__ = ["bootstrap_state", "check_state_frame", "claim_run", "file_schema", "spark_schema",
           "write_state_files"]

log = logging.getLogger(__name__)


def spark_schema(raw: str) -> Any:
    from pyspark.sql.types import StructType

    return StructType.fromJson(json.loads(raw))


def file_schema(entry: dict[str, Any]) -> tuple[Any, bytes]:
    """The Spark schema of an operator's state files (``_kg``, keys, state columns) and the
    format tag they carry, from its checkpoint entry."""
    from pyspark.sql.types import IntegerType, StructField, StructType

    from spark_ckpt.arrowtypes import to_spark
    from spark_ckpt.state.schema import EXPIRES_TYPE, STATE_FORMAT_TYPED, TIMER_TYPE
    from spark_ckpt.state.task import STATE_FORMAT

    if entry.get("kind") == "agg":
        if "file_schema" not in entry:
            raise CheckpointError("the aggregation has run no batch: no state layout recorded")
        return spark_schema(entry["file_schema"]), STATE_FORMAT
    if "state_schema" not in entry:
        raise CheckpointError("the processor holds no typed state (written before typed state, "
                              "or it has run no batch)")
    import pyarrow as pa

    keys = spark_schema(entry["key_schema"])
    internal = to_spark(pa.schema([(TIMERS, TIMER_TYPE), (EXPIRES, EXPIRES_TYPE)]))
    fields = [StructField("_kg", IntegerType()), *keys.fields,
              *spark_schema(entry["state_schema"]).fields, *internal.fields]
    return StructType(fields), STATE_FORMAT_TYPED


def claim_run(storage: Storage, root: str, pipeline: str, what: str, now_ms: int,
           clock: Clock) -> int:
    """A run marker and a fence claim, as a driver's start makes: the next run number."""
    from spark_ckpt.formats import dump_record
    from spark_ckpt.storage.fencing import Fence
    from spark_ckpt.streaming.runtime.runs import run_numbers

    storage.makedirs(join(root, "runs"))
    while True:
        number = max(run_numbers(storage, root), default=0) + 1
        body = {"pipeline": pipeline, "started_ms": now_ms, "purpose": what}
        if storage.create_exclusive(join(root, "runs", f"{number:08d}.json"),
                                    dump_record("pipeline-run", 1, body)):
            Fence(storage, root, f"pipeline {pipeline}", clock=clock).claim(
                f"run {number} ({what})")
            return number


def write_state_files(spark: SparkSession, df: DataFrame, *, state_dir: str, keys: list[str],
                      file_schema: Any, fmt: bytes, parallelism: int, max_parallelism: int,
                      batch: int, operator: str) -> dict[str, dict[str, Any]]:
    """Write ``df`` (keys + state columns) as one snapshot per key-group range of
    ``parallelism`` tasks; the handles by task index (checkpoint metadata form). The caller
    checked ``df`` (:func:`check_state_frame`)."""
    from spark_ckpt.arrowtypes import to_arrow
    from spark_ckpt.state.chain import StateHandle
    from spark_ckpt.state.keygroups import (
        KG_COLUMN,
        PID_COLUMN,
        key_group_column,
        partition_column,
        ranges,
    )
    from spark_ckpt.state.task import meta_schema

    layout = ranges(parallelism, max_parallelism)
    arrow = to_arrow(file_schema)
    routed = df.withColumn(KG_COLUMN, key_group_column(keys, max_parallelism)) \
        .withColumn(PID_COLUMN, partition_column(max_parallelism, parallelism)) \
        .repartitionById(parallelism, PID_COLUMN)
    plans = {i: {"range": r.label, "dir": f"{state_dir.rstrip('/')}/{r.label}"}
             for i, r in enumerate(layout)}
    rows = routed.mapInArrow(_writer(plans, arrow.serialize().to_pybytes().hex(), fmt, batch,
                                     operator), meta_schema()).collect()
    handles = {str(i): StateHandle.empty(r).to_json() for i, r in enumerate(layout)}
    for row in rows:
        handles[str(int(row.pid))] = json.loads(row.meta)
    return handles


def check_state_frame(df: DataFrame, *, keys: list[str], file_schema: Any,
                      operator: str) -> None:
    """``df`` can be an operator's state: known columns, the keys with the state's types (a
    key's type decides its key group), one row per key."""
    wanted = [f.name for f in file_schema.fields if f.name != "_kg"]
    unknown = [c for c in df.columns if c not in wanted]
    missing = [k for k in keys if k not in df.columns]
    if unknown or missing:
        raise JobDefinitionError(
            f"operator {operator}: expected the columns {wanted} (keys {keys} required), "
            f"found {df.columns}" + (f"; unknown: {unknown}" if unknown else "")
            + (f"; missing keys: {missing}" if missing else ""))
    types = {f.name: f.dataType for f in file_schema.fields}
    changed = [(k, df.schema[k].dataType.simpleString(), types[k].simpleString())
               for k in keys if df.schema[k].dataType != types[k]]
    if changed:  # a key's type decides its key group: it must be the pipeline's
        raise JobDefinitionError(
            f"operator {operator}: expected the key columns with the state's types, found "
            + ", ".join(f"{k} {got} (the state's: {want})" for k, got, want in changed)
            + "; cast them back")
    twice = df.groupBy(*keys).count().where("count > 1").limit(1).collect()
    if twice:
        raise JobDefinitionError(
            f"operator {operator}: expected one row per key, found key "
            f"{ {k: twice[0][k] for k in keys} } {twice[0]['count']} times")


def _writer(plans: dict[int, dict[str, Any]], schema_hex: str, fmt: bytes, batch: int,
            operator: str) -> Any:
    def run(batches: Any) -> Any:
        import pyarrow as pa
        from pyspark import TaskContext

        from spark_ckpt.state.chain import StateFile, StateHandle
        from spark_ckpt.state.evolution import evolve_table
        from spark_ckpt.state.keygroups import KeyGroupRange
        from spark_ckpt.state.task import _write

        schema = pa.ipc.read_schema(pa.py_buffer(bytes.fromhex(schema_hex)))
        task = TaskContext.get()
        assert task is not None  # runs in a Spark task
        pid = task.partitionId()
        plan = plans[pid]
        parts = list(batches)
        table = pa.Table.from_batches(parts) if parts else None
        files: tuple[StateFile, ...] = ()
        count = 0
        if table is not None and table.num_rows:
            rng = KeyGroupRange.parse(plan["range"])
            kg = table.column("_kg").to_numpy()
            if kg.min() < rng.start or kg.max() >= rng.end:
                raise InternalError(f"operator {operator} task {pid}: rows of key groups "
                                    f"{kg.min()}..{kg.max()} routed to range {plan['range']}")
            table = evolve_table(table, schema, {}, f"operator {operator} range {plan['range']}")
            token = uuid.uuid4().hex
            uri, size = _write(table, plan["dir"], f"b{batch:012d}-snapshot-{token}.parquet",
                               fmt=fmt)
            files = (StateFile(uri, "snapshot", batch, table.num_rows, size, plan["range"]),)
            count = table.num_rows
        handle = StateHandle(plan["range"], uuid.uuid4().hex if files else None, files, count)
        yield pa.RecordBatch.from_pydict({"pid": pa.array([pid], pa.int32()),
                                          "meta": pa.array([json.dumps(handle.to_json())])})
    return run


def bootstrap_state(pipeline: PipelineDefinition, frames: dict[str, DataFrame], *,
                    write_metadata: Callable[[], None]) -> int:
    """Write ``frames`` (operator name -> its state, raw layout) as the first checkpoint of
    ``pipeline``, which has not run yet; return its id. ``start()`` restores it.
    ``write_metadata`` checks and writes its ``metadata.json`` (the run's claim)."""
    from pyspark.sql.types import DoubleType, StructField, StructType

    from spark_ckpt.arrowtypes import to_arrow, to_spark
    from spark_ckpt.checkpoint.checkpoint_storage import CheckpointStorage
    from spark_ckpt.sparkapi import spark_api
    from spark_ckpt.state.aggregates import AggSpec
    from spark_ckpt.streaming.runtime.stop_control import StopControl
    from spark_ckpt.streaming.template.keyed import agg_file_schema

    ops = {op.operator: op for op in pipeline.graph.stateful}
    unknown = sorted(set(frames) - set(ops))
    if unknown:
        raise JobDefinitionError(f"bootstrap_state: no stateful operator {unknown}; the "
                                 f"pipeline has {sorted(ops)}")
    pipeline.graph.validate()
    pipeline.storage.makedirs(pipeline.root)
    write_metadata()
    s = pipeline.settings
    uri = s.checkpoint_dir or pipeline.storage.spark_path(join(pipeline.root, "checkpoints"))
    store = CheckpointStorage(uri)
    from spark_ckpt.streaming.runtime.runs import run_numbers

    allocations = join(pipeline.root, "allocations")
    ran = pipeline.storage.exists(allocations) and any(
        True for _ in pipeline.storage.list_files(allocations, recursive=False))
    del run_numbers
    if store.highest_id() > 0 or ran:
        raise CheckpointError(
            f"pipeline {pipeline.name}: bootstrap_state writes a pipeline's first checkpoint, "
            f"before it ever runs; {pipeline.storage.uri} has run before (use rewrite_state on a "
            "completed checkpoint, or a new checkpoint directory)")
    now_ms = pipeline.clock.now_ms()
    planned = []
    for name, df in frames.items():
        op = ops[name]
        keys = list(op.keys)
        parallelism = op.requested_parallelism or s.state_parallelism or \
            spark_api(pipeline.spark).default_parallelism()
        max_parallelism = op.requested_max or s.state_max_parallelism
        types = {f.name: f.dataType for f in df.schema.fields}
        if op.kind == "agg":
            inputs = [StructField(k, types[k]) for k in keys if k in types]
            for out, agg in op.aggs.items():
                value = types.get(out) or types.get(f"{out}__sum") or DoubleType()
                if agg.column and agg.column not in {f.name for f in inputs}:
                    inputs.append(StructField(agg.column, value))
                ts = types.get(f"{out}__ts")
                if agg.time_column and ts is not None and \
                        agg.time_column not in {f.name for f in inputs}:
                    inputs.append(StructField(agg.time_column, ts))
            spec = AggSpec(keys, op.aggs, StructType(inputs))
            schema = agg_file_schema(spec)
            describe = {"file_schema": schema.json(), "aggs": spec.describe()["aggs"]}
            from spark_ckpt.state.task import STATE_FORMAT as fmt
        else:
            from spark_ckpt.state.schema import STATE_FORMAT_TYPED as fmt

            state = op.parse_state_schema()
            missing = [k for k in keys if k not in types]
            if missing:
                raise JobDefinitionError(f"bootstrap_state: operator {name}: expected the key "
                                         f"columns {keys}, found {df.columns}")
            key_schema = to_arrow(StructType([StructField(k, types[k]) for k in keys]))
            describe = {"state_schema": state.to_json(), "key_schema":
                        to_spark(key_schema).json(), "state_format": 2}
            schema, _ = file_schema({"kind": "process", **describe})
        check_state_frame(df, keys=keys, file_schema=schema, operator=name)
        planned.append((name, op, df, keys, schema, fmt, parallelism, max_parallelism,
                        describe))
    run = claim_run(pipeline.storage, pipeline.root, pipeline.name, "state bootstrap", now_ms,
                    pipeline.clock)
    operators: dict[str, Any] = {}
    for name, op, df, keys, schema, fmt, parallelism, max_parallelism, describe in planned:
        handles = write_state_files(
            pipeline.spark, df, state_dir=op.state_dir(), keys=keys, file_schema=schema, fmt=fmt,
            parallelism=parallelism, max_parallelism=max_parallelism, batch=0, operator=name)
        operators[name] = {"handles": handles, "kind": op.kind, "parallelism": parallelism,
                           "max_parallelism": max_parallelism, "keys": keys, "extra": {},
                           **describe}
    checkpoint_id = store.highest_id() + 1
    store.write_metadata(checkpoint_id, {
        "checkpoint_id": checkpoint_id, "pipeline": pipeline.name,
        "pipeline_id": pipeline.pipeline_id,
        "barrier_batch": -1, "trigger_ms": now_ms, "completed_ms": pipeline.clock.now_ms(),
        "mode": s.checkpoint_mode, "sources": {}, "operators": operators, "sinks": {},
        "bootstrapped": True})
    StopControl(pipeline.storage, pipeline.root, pipeline.name, run).record_end(
        "stopped", f"state bootstrap of {sorted(frames)} into checkpoint {checkpoint_id}",
        checkpoint_id, -1, pipeline.clock.now_ms())
    log.info("Pipeline %s: bootstrapped the state of %s into checkpoint %d", pipeline.name,
             sorted(frames), checkpoint_id)
    return checkpoint_id
