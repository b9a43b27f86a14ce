"""Helpers for the pyspark shell and notebooks: jobs, pipelines, history, checkpoints and
state as DataFrames, to filter, join and ``display()`` like any other.

    >>> from spark_ckpt import shell as ck
    >>> ck.jobs(spark, "/data/ckpt").show()                       # every batch job
    >>> ck.events(spark, "orders-daily", "/data/ckpt").groupBy("event_type").count().show()
    >>> ck.attempts(spark, "orders-daily", "/data/ckpt").show()   # ran / reused per attempt
    >>> ck.pipeline(spark, "/data/ckpt/clicks").show(vertical=True)   # status, last batch
    >>> ck.progress(spark, "/data/ckpt/clicks").select("batch_id", "num_input_rows").show()
    >>> ck.checkpoints(spark, "/data/ckpt/clicks").show()          # duration, sizes, status
    >>> ck.state(spark, "/data/ckpt/clicks", "per_user").where("n > 100").show()

Everything is read from storage as the CLI reads it (no running driver needed), on a classic
or a Spark Connect session alike: the rows are built in the driver and handed to Spark as
Arrow, so no Python worker starts. Nested records (a batch's durations, a checkpoint's tasks)
are JSON strings: ``F.from_json`` or ``F.get_json_object`` them. A directory that is not what
a helper reads (missing, a pipeline's directory where a work directory is expected or the
other way round, a record that does not read as a start reads it) raises
:class:`~spark_ckpt.errors.DirectoryError`, as the CLI refuses it.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from spark_ckpt.clock import Clock, SystemClock

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

__all__ = ["attempts", "checkpoints", "events", "jobs", "pipeline", "progress", "runs",
           "state"]


_ARROW = {"STRING": "string", "INT": "int32", "BIGINT": "int64", "DOUBLE": "float64",
          "BOOLEAN": "bool"}


def _frame(spark: SparkSession, rows: list[dict[str, Any]], columns: dict[str, str]) -> DataFrame:
    """``rows`` as a DataFrame with ``columns`` (name -> Spark type), nested values as JSON
    strings; handed to Spark as one Arrow table (no Python worker, classic or Connect)."""
    import pyarrow as pa

    schema = pa.schema([(c, pa.type_for_alias(_ARROW[t])) for c, t in columns.items()])
    data = {c: [_cast(_flat(r.get(c)), t) for r in rows] for c, t in columns.items()}
    return spark.createDataFrame(pa.table(data, schema=schema))


def _cast(value: Any, ddl: str) -> Any:
    if value is None:
        return None
    if ddl in ("INT", "BIGINT"):
        return int(value)
    if ddl == "DOUBLE":
        return float(value)
    if ddl == "BOOLEAN":
        return bool(value)
    return str(value)


def _flat(value: Any) -> Any:
    return json.dumps(value, sort_keys=True, default=str) if isinstance(value, dict | list) \
        else value


def _work(work_dir: str | None) -> str:
    if work_dir:
        return work_dir
    from spark_ckpt.ops.cli import _default_work_dir

    return _default_work_dir()


# -- batch jobs ---------------------------------------------------------------------------------
def jobs(spark: SparkSession, work_dir: str | None = None) -> DataFrame:
    """One row per job under ``work_dir``: attempts, status, last event, finished partitions."""
    from spark_ckpt.batch.runner import job_summaries
    from spark_ckpt.batch.workdir import open_work_dir

    rows = job_summaries(open_work_dir(_work(work_dir)))
    return _frame(spark, rows, {"job_id": "STRING", "attempts": "INT", "status": "STRING",
                                "last_event_us": "BIGINT", "finished_partitions": "INT",
                                "events": "INT"}) \
        .selectExpr("job_id", "attempts", "status",
                    "timestamp_micros(last_event_us) AS last_event", "finished_partitions",
                    "events")


def _read(job_id: str, work_dir: str | None) -> Any:
    from spark_ckpt.batch.workdir import open_job

    return open_job(_work(work_dir), job_id)


def events(spark: SparkSession, job_id: str, work_dir: str | None = None) -> DataFrame:
    """Every event of ``job_id``'s log, oldest first, as recovery reads it (committed
    versions only): the columns of docs/event-log.md, ``payload`` a JSON string."""
    read = _read(job_id, work_dir)
    rows = []
    for e in read.events:
        row = e.row()
        row["event_time_us"] = e.time_us
        rows.append(row)
    return _frame(spark, rows, {
        "job_id": "STRING", "job_attempt": "INT", "seq": "BIGINT", "event_time_us": "BIGINT",
        "event_type": "STRING", "vertex_id": "STRING", "partition": "INT",
        "attempt_id": "STRING", "rows": "BIGINT", "bytes": "BIGINT", "duration_ms": "BIGINT",
        "payload": "STRING"}) \
        .selectExpr("job_id", "job_attempt", "seq", "timestamp_micros(event_time_us) AS "
                    "event_time", "event_type", "vertex_id", "partition", "attempt_id", "rows",
                    "bytes", "duration_ms", "payload")


def attempts(spark: SparkSession, job_id: str, work_dir: str | None = None) -> DataFrame:
    """One row per attempt of ``job_id``: mode (fresh, recovery), status, duration, partitions
    it ran and reused, its error."""
    from spark_ckpt.eventlog.events import EventType
    from spark_ckpt.eventlog.replay import replay

    read = _read(job_id, work_dir)
    h = replay(read.events)
    ran: dict[int, int] = {}
    for e in read.events:
        if e.type is EventType.EXECUTION_VERTEX_FINISHED:
            ran[e.job_attempt] = ran.get(e.job_attempt, 0) + 1
    rows = [{"attempt": a.attempt, "mode": a.mode, "status": a.status,
             "started_us": a.started_us, "finished_us": a.finished_us,
             "seconds": None if a.finished_us is None else (a.finished_us - a.started_us) / 1e6,
             "ran": ran.get(a.attempt, 0), "reused": a.reused, "error": a.error}
            for a in sorted(h.attempts.values(), key=lambda a: a.attempt)]
    return _frame(spark, rows, {"attempt": "INT", "mode": "STRING", "status": "STRING",
                                "started_us": "BIGINT", "finished_us": "BIGINT",
                                "seconds": "DOUBLE", "ran": "INT", "reused": "INT",
                                "error": "STRING"}) \
        .selectExpr("attempt", "mode", "status", "timestamp_micros(started_us) AS started",
                    "timestamp_micros(finished_us) AS finished", "seconds", "ran", "reused",
                    "error")


# -- streaming pipelines ------------------------------------------------------------------------
def pipeline(spark: SparkSession, checkpoint_dir: str, *, clock: Clock | None = None,
             ) -> DataFrame:
    """One row: what ``spark-ckpt status`` says of the pipeline on ``checkpoint_dir`` (now by
    ``clock``, the system clock by default)."""
    from spark_ckpt.ops.pipeline_ops import pipeline_status

    found = pipeline_status(checkpoint_dir, now_ms=(clock or SystemClock()).now_ms())
    batch = found["last_batch"] or {}
    latest = found["latest_checkpoint"] or {}
    row = {"pipeline": found["pipeline"], "pipeline_id": found["pipeline_id"],
           "state": found["state"], "run": found["run"], "run_started": found["run_started"],
           "ended": found["ended"], "last_batch_id": batch.get("batch_id"),
           "last_batch_at": batch.get("at"), "latest_checkpoint": latest.get("checkpoint_id"),
           "latest_checkpoint_barrier": latest.get("barrier_batch"),
           "restore_requested": found["restore_requested"],
           "stop_requests_waiting": len(found["stop_requests_waiting"]),
           "operators": found["operators"], "sources": found["sources"],
           "outputs": found["outputs"]}
    return _frame(spark, [row], {
        "pipeline": "STRING", "pipeline_id": "STRING", "state": "STRING", "run": "INT",
        "run_started": "STRING", "ended": "STRING", "last_batch_id": "BIGINT",
        "last_batch_at": "STRING", "latest_checkpoint": "BIGINT",
        "latest_checkpoint_barrier": "BIGINT", "restore_requested": "BIGINT",
        "stop_requests_waiting": "INT", "operators": "STRING", "sources": "STRING",
        "outputs": "STRING"})


def progress(spark: SparkSession, checkpoint_dir: str) -> DataFrame:
    """One row per batch the progress log keeps (the newest run of a batch): ids, time,
    input rows, rates, durations and per-operator state figures (JSON)."""
    from spark_ckpt.ops.pipeline_ops import progress_records
    from spark_ckpt.streaming.runtime.pipeline_dir import open_pipeline_dir

    pipeline = open_pipeline_dir(checkpoint_dir)
    rows = progress_records(pipeline.storage, pipeline.root)
    return _frame(spark, rows, {
        "batch_id": "BIGINT", "batch_time_ms": "BIGINT", "timestamp": "STRING",
        "recovered": "BOOLEAN", "num_input_rows": "BIGINT", "input_rows_per_second": "DOUBLE",
        "processed_rows_per_second": "DOUBLE", "durations_ms": "STRING", "sources": "STRING",
        "outputs": "STRING", "state": "STRING", "checkpoint": "STRING"})


def checkpoints(spark: SparkSession, checkpoint_dir: str,
                checkpoint_storage: str | None = None) -> DataFrame:
    """One row per checkpoint in the history: status (completed, aborted, abandoned), barrier
    batch, duration, sizes, the slowest task's sync, async and alignment times, whether it is
    retained (restorable)."""
    from spark_ckpt.checkpoint.checkpoint_storage import CheckpointStorage
    from spark_ckpt.ops.validate import checkpoint_dirs
    from spark_ckpt.streaming.runtime.pipeline_dir import open_pipeline_dir

    store = CheckpointStorage(open_pipeline_dir(checkpoint_dir,
                                                checkpoint_storage).checkpoints_uri)
    dirs = checkpoint_dirs(store.uri)
    history = {int(s["checkpoint_id"]): s for s in store.history()}
    rows = []
    for cid in sorted(set(history) | set(dirs)):
        st = dict(history.get(cid) or {"checkpoint_id": cid})
        st["restorable"] = dirs.get(cid) == "completed"
        if dirs.get(cid) == "abandoned":
            st["status"] = "abandoned"
        rows.append(st)
    return _frame(spark, rows, {
        "checkpoint_id": "BIGINT", "status": "STRING", "restorable": "BOOLEAN",
        "barrier_batch": "BIGINT", "trigger_ms": "BIGINT", "duration_ms": "BIGINT",
        "full_bytes": "BIGINT", "incremental_bytes": "BIGINT", "sync_ms": "BIGINT",
        "async_ms": "BIGINT", "alignment_ms": "BIGINT", "reason": "STRING",
        "operators": "STRING", "tasks": "STRING"})


def runs(spark: SparkSession, checkpoint_dir: str) -> DataFrame:
    """One row per driver run of the pipeline: started, how it ended (none recorded: running,
    or killed), final checkpoint, message."""
    from spark_ckpt.streaming.runtime.pipeline_dir import open_pipeline_dir

    pipeline = open_pipeline_dir(checkpoint_dir)
    rows = []
    for run in pipeline.runs():
        record = pipeline.run_record(run)
        end = pipeline.run_end(run) or {}
        rows.append({"run": run, "started_ms": record.get("started_ms"),
                     "status": end.get("status", "no end recorded"),
                     "ended_ms": end.get("ended_ms"),
                     "final_checkpoint": end.get("final_checkpoint"),
                     "message": end.get("message")})
    return _frame(spark, rows, {"run": "INT", "started_ms": "BIGINT", "status": "STRING",
                                "ended_ms": "BIGINT", "final_checkpoint": "BIGINT",
                                "message": "STRING"}) \
        .selectExpr("run", "timestamp_millis(started_ms) AS started", "status",
                    "timestamp_millis(ended_ms) AS ended", "final_checkpoint", "message")


def state(spark: SparkSession, checkpoint_dir: str, operator: str,
          checkpoint_id: int | None = None) -> DataFrame:
    """An operator's state at a retained checkpoint (the latest by default): one row per key
    (``read_state``; its layout per operator in docs/checkpointing.md)."""
    from spark_ckpt.ops.state_processor import read_state

    return read_state(spark, checkpoint_dir, operator, checkpoint_id)
