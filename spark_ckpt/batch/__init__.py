"""Batch jobs that recover: declare vertices, run, resubmit after a crash to run only the rest."""

from spark_ckpt.batch.job import BatchJob, Input, VertexRef
from spark_ckpt.batch.runner import JobResult, VertexSummary

__all__ = ["BatchJob", "Input", "JobResult", "VertexRef", "VertexSummary"]
