"""The notebook and pyspark-shell view of spark_ckpt (``from spark_ckpt import shell as ck``):
jobs, events, attempts, a pipeline's progress, checkpoints, runs and state as DataFrames.

This module is the public name; the functions live in :mod:`spark_ckpt.ops.shell` beside the
other tools."""

from spark_ckpt.ops.shell import (
    attempts,
    checkpoints,
    events,
    jobs,
    pipeline,
    progress,
    runs,
    state,
)

__all__ = ["attempts", "checkpoints", "events", "jobs", "pipeline", "progress", "runs", "state"]
