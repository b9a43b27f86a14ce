"""Writing keyed state offline (Flink's State Processor API, write side).

* :func:`bootstrap_state` (``StreamingContext.bootstrap_state``): build operators' state from
  DataFrames (a batch table) into the first checkpoint of a pipeline that has not run yet; its
  ``start()`` restores it, and its sources start from their beginning.
* :func:`rewrite_state`: transform one operator's state in a completed checkpoint (drop keys,
  fix values) into a new completed checkpoint, the other operators, the sources' positions and
  the sinks' transactions as they were. The new checkpoint has the highest id, so the next
  start restores it (checkpoints newer than the one rewritten are abandoned, as a restore by id
  abandons them).

The DataFrames are in the layout the state files store, :func:`raw_state`: the key columns,
then for an aggregation its state columns (``count``, ``sum``, ``min``, ``max`` as the output
column; ``mean`` as ``<name>__sum`` and ``<name>__count``; ``first``/``last`` as ``<name>``
and ``<name>__ts``), for a processor its declared variables and, optionally, ``_timers``
(``ARRAY<STRUCT<ms: BIGINT, kind: STRING>>``) and ``_expires`` (``MAP<STRING, BIGINT>``).

Files are written by Spark tasks, one snapshot per key-group range, in the format the stateful
tasks write; a restore then rescales and evolves them as any checkpoint (the parallelism of the
written layout is the operator's, and the types are checked against the declared ones when the
pipeline starts). Writing takes ownership of the checkpoint directory as a driver's start does
(a run marker and a fence claim): a driver still running there is fenced before it commits.
"""

from __future__ import annotations

import copy
import json
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from spark_ckpt.clock import Clock, SystemClock
from spark_ckpt.errors import CheckpointError
from spark_ckpt.state.chain import StateHandle
from spark_ckpt.state.frames import read_handles, read_processor_state
from spark_ckpt.state.schema import TIMERS_COLUMN as TIMERS
from spark_ckpt.storage import Storage, join
from spark_ckpt.streaming.runtime.bootstrap import (
    check_state_frame,
    claim_run,
    file_schema,
    spark_schema,
    write_state_files,
)

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

__all__ = ["raw_state", "read_state", "rewrite_state"]


log = logging.getLogger(__name__)


def raw_state(spark: SparkSession, checkpoint_dir: str, operator: str,
              checkpoint_id: int | None = None) -> DataFrame:
    """An operator's state in a completed checkpoint (the latest by default) in the layout
    its files store (see the module), one row per key."""
    from spark_ckpt.checkpoint.checkpoint_storage import CheckpointStorage
    from spark_ckpt.streaming.runtime.pipeline_dir import checkpoints_uri

    store = CheckpointStorage(checkpoints_uri(checkpoint_dir))
    cid, meta = _checkpoint(store, checkpoint_id)
    entry = _entry(meta, operator, cid)
    schema, _fmt = file_schema(entry)
    handles = [StateHandle.from_json(h) for _p, h in
               sorted(entry["handles"].items(), key=lambda kv: int(kv[0]))]
    keys = list(entry["keys"])
    rows = read_handles(spark, handles, schema, keys).drop("_kg")
    if entry.get("kind") == "agg":
        return rows
    # a processor's deleted key is a row with no variable and no timer in its newest file
    from pyspark.sql import functions as F

    present = F.size(F.coalesce(F.col(TIMERS), F.array())) > 0
    for field in spark_schema(entry["state_schema"]).fields:
        col = F.col(f"`{field.name}`")
        kind = type(field.dataType).__name__
        present = present | ((col.isNotNull() & (F.size(col) > 0))
                             if kind in ("ArrayType", "MapType") else col.isNotNull())
    return rows.where(present)


def _checkpoint(store: Any, checkpoint_id: int | None) -> tuple[int, dict[str, Any]]:
    ids = store.completed_ids()
    if not ids:
        raise CheckpointError(f"expected completed checkpoints in {store.uri}, found none")
    cid = ids[-1] if checkpoint_id is None else checkpoint_id
    if cid not in ids:
        raise CheckpointError(f"expected checkpoint {cid} in {store.uri}, found completed "
                              f"checkpoints {ids}")
    return cid, store.read_metadata(cid)


def _entry(meta: dict[str, Any], operator: str, cid: int) -> dict[str, Any]:
    ops = meta.get("operators", {})
    if operator not in ops:
        raise CheckpointError(f"checkpoint {cid} has no operator {operator!r}; it has "
                              f"{sorted(ops)}")
    return ops[operator]


def rewrite_state(spark: SparkSession, checkpoint_dir: str, operator: str,
                  transform: Callable[[DataFrame], DataFrame], *,
                  checkpoint_id: int | None = None, parallelism: int | None = None,
                  now_ms: int | None = None, clock: Clock | None = None) -> int:
    """Transform ``operator``'s state at ``checkpoint_id`` (the latest by default) into a new
    completed checkpoint; return its id (see the module). ``transform`` gets and returns the
    :func:`raw_state` layout; a key it drops is gone, a row it changes is the key's state.
    ``clock`` (the system clock by default) stamps the records; ``now_ms`` is its time when
    not given."""
    from spark_ckpt.checkpoint.checkpoint_storage import CheckpointStorage
    from spark_ckpt.ops.pipeline_ops import pipeline_status
    from spark_ckpt.streaming.runtime.pipeline_dir import checkpoints_uri
    from spark_ckpt.streaming.runtime.stop_control import StopControl

    clock = clock or SystemClock()
    now_ms = now_ms if now_ms is not None else clock.now_ms()
    status = pipeline_status(checkpoint_dir, now_ms=now_ms)
    if status["state"] == "running":
        raise CheckpointError(
            f"the pipeline on {checkpoint_dir} is running (its last batch {status['last_batch']}"
            "): stop it first (spark-ckpt stop), then rewrite its state")
    storage = Storage(checkpoint_dir)
    from spark_ckpt.streaming.runtime.restore_requests import read_restore_request
    from spark_ckpt.streaming.runtime.runs import run_numbers

    pending = read_restore_request(storage, storage.root)
    if pending is not None:
        raise CheckpointError(
            f"`spark-ckpt restore` asked the next start to restore checkpoint {pending}; "
            "rewriting now would be undone by it: cancel it (spark-ckpt restore CKPT_DIR "
            "--cancel) or let a start take it first")
    store = CheckpointStorage(checkpoints_uri(checkpoint_dir))
    cid, meta = _checkpoint(store, checkpoint_id)
    entry = _entry(meta, operator, cid)
    schema, fmt = file_schema(entry)
    keys = list(entry["keys"])
    df = transform(raw_state(spark, checkpoint_dir, operator, cid))
    check_state_frame(df, keys=keys, file_schema=schema, operator=operator)
    run = claim_run(storage, storage.root, str(meta.get("pipeline") or status["pipeline"]),
                 f"state rewrite of {operator} at checkpoint {cid}", now_ms, clock)
    try:
        p = int(parallelism or entry.get("parallelism") or len(entry["handles"]))
        handles = write_state_files(
            spark, df, state_dir=storage.spark_path(join(storage.root, "state", operator)),
            keys=keys, file_schema=schema, fmt=fmt, parallelism=p,
            max_parallelism=int(entry["max_parallelism"]), batch=max(int(meta["barrier_batch"]),
                                                                     0), operator=operator)
        new_id = store.highest_id() + 1
        if max(run_numbers(storage, storage.root)) != run:
            raise CheckpointError(
                f"a driver started on {checkpoint_dir} while the state was being rewritten "
                "(a newer run than this rewrite's); nothing was written")
        # the checkpoints after the one rewritten first: a kill between the two steps then
        # leaves the rewritten one as it was, never a newer barrier that undoes the rewrite
        for other in store.completed_ids():
            if other > cid:
                store.abandon(other)
        body = copy.deepcopy(meta)
        body.pop("kind", None)
        body.pop("format_version", None)
        body["checkpoint_id"] = new_id
        body["completed_ms"] = clock.now_ms()
        body["rewritten_from"] = cid
        body["operators"][operator] = {**copy.deepcopy(entry), "handles": handles,
                                       "parallelism": p}
        store.write_metadata(new_id, body)
        rows = sum(int(h.get("rows", 0)) for h in handles.values())
        size = sum(int(f["bytes"]) for h in handles.values() for f in h.get("files", ()))
        store.write_stats(new_id, {
            "checkpoint_id": new_id, "pipeline": body.get("pipeline"), "status": "completed",
            "barrier_batch": body["barrier_batch"], "trigger_ms": now_ms,
            "end_ms": body["completed_ms"], "duration_ms": body["completed_ms"] - now_ms,
            "full_bytes": size, "incremental_bytes": size, "reason":
                f"state of {operator} rewritten from checkpoint {cid} ({rows} keys)"})
    except BaseException as exc:
        StopControl(storage, storage.root, str(meta.get("pipeline")), run).record_end(
            "failed", f"state rewrite failed: {type(exc).__name__}: {exc}", None, None,
            clock.now_ms())
        raise
    StopControl(storage, storage.root, str(meta.get("pipeline")), run).record_end(
        "stopped", f"state of {operator} rewritten from checkpoint {cid} into {new_id}",
        new_id, int(body["barrier_batch"]), clock.now_ms())
    log.info("Pipeline %s: state of %s at checkpoint %d rewritten into checkpoint %d (%d keys)",
             meta.get("pipeline"), operator, cid, new_id, rows)
    return new_id


def read_state(spark: SparkSession, checkpoint_dir: str, operator: str,
               checkpoint_id: int | None = None) -> DataFrame:
    """The state of ``operator`` in a completed checkpoint (the latest by default), one row per
    key: aggregations as their key and output columns, processors as their key columns and one
    column per declared state variable, with its declared type (``json`` variables as JSON
    strings). The event-time operators (windowed aggregations, Top-N, deduplication, the last
    row, stream-stream joins) as their user sees them, from the definition their checkpoint
    records: one row per open window, kept row or remembered key (docs/operations.md); a
    checkpoint written before that record reads as their raw state.

    ``checkpoint_dir`` is the pipeline's checkpoint directory (or, when the pipeline sets
    ``spark.ckpt.checkpoint.dir``, pass that directory's parent with ``checkpoints`` in it).
    A path where nothing is, a directory that is neither, and a pipeline's directory whose
    metadata.json does not read as a start reads it raise
    :class:`~spark_ckpt.errors.DirectoryError`.
    """

    from pyspark.sql.types import StructField, StructType

    from spark_ckpt.checkpoint.checkpoint_storage import CheckpointStorage
    from spark_ckpt.errors import CheckpointError
    from spark_ckpt.state.aggregates import Agg, AggSpec
    from spark_ckpt.streaming.runtime.pipeline_dir import open_pipeline_dir

    storage = CheckpointStorage(open_pipeline_dir(checkpoint_dir,
                                                  bare_checkpoints=True).checkpoints_uri)
    ids = storage.completed_ids()
    if not ids:
        raise CheckpointError(f"expected completed checkpoints in {storage.uri}, found none")
    cid = ids[-1] if checkpoint_id is None else checkpoint_id
    meta = storage.read_metadata(cid)
    ops = meta.get("operators", {})
    if operator not in ops:
        raise CheckpointError(
            f"checkpoint {cid} has no operator {operator!r}; it has {sorted(ops)}"
        )
    op = ops[operator]
    handles = [StateHandle.from_json(h) for _p, h in
               sorted(op["handles"].items(), key=lambda kv: int(kv[0]))]
    keys = list(op["keys"])
    if op.get("kind") == "agg":
        if "file_schema" not in op:
            return spark.createDataFrame([], ", ".join(f"`{k}` STRING" for k in keys))
        schema = StructType.fromJson(json.loads(op["file_schema"]))
        types = {f.name: f.dataType for f in schema.fields}
        inputs = [StructField(k, types[k]) for k in keys]
        aggs: dict[str, Agg] = {}
        for name, (func, column, time_column) in op["aggs"].items():
            value = types.get(name) or types[f"{name}__sum"]
            if column is not None and column not in {f.name for f in inputs}:
                inputs.append(StructField(column, value))
            if time_column is not None and time_column not in {f.name for f in inputs}:
                inputs.append(StructField(time_column, types[f"{name}__ts"]))
            aggs[name] = Agg(func, column, time_column)
        spec = AggSpec(keys, aggs, StructType(inputs))
        return spec.view(read_handles(spark, handles, schema, keys))
    if "state_schema" not in op:
        raise CheckpointError(
            f"checkpoint {cid}: operator {operator!r} holds its state as JSON documents (written "
            "before typed state) or has run no batch; expected a state_schema in its metadata"
        )
    derived = op.get("derived")
    # a window's key lives while its timer does, even with every aggregate still null
    windows = isinstance(derived, dict) and derived.get("operator") == "window_agg"
    state = read_processor_state(spark, handles, op, keys, timer_only=windows)
    return _derived_view(state, derived, operator, cid)


def _derived_view(state: DataFrame, derived: Any, operator: str, cid: int) -> DataFrame:
    """An event-time operator's state as its user sees it, from the definition its checkpoint
    entry records (``derived``, see template/derived.py); the raw layout without one (a plain
    processor, a checkpoint written before the record) or with a version this does not know."""
    from spark_ckpt.streaming.template.derived import DEFINITION_VERSION
    from spark_ckpt.streaming.template.joins import join_state
    from spark_ckpt.streaming.template.row_operators import dedup_state, top_n_state
    from spark_ckpt.streaming.template.windows import window_agg_state, window_top_n_state

    if not isinstance(derived, dict):
        return state
    views: dict[str, Callable[[DataFrame, dict[str, Any]], DataFrame]] = {
        "window_agg": window_agg_state, "window_top_n": window_top_n_state,
        "drop_duplicates": dedup_state, "top_n": top_n_state, "stream_join": join_state}
    view = views.get(str(derived.get("operator")))
    if view is None or int(derived.get("version", 0)) > DEFINITION_VERSION:
        log.warning("checkpoint %d: operator %s records a definition read_state does not know "
                    "(%s version %s); returning its raw state", cid, operator,
                    derived.get("operator"), derived.get("version"))
        return state
    return view(state, derived)
