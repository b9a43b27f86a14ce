"""spark_ckpt: Flink-grade fault tolerance for PySpark.

Batch jobs record every finished partition in a Delta event log and, when submitted again
after a driver crash, run only the partitions whose output is missing. Streaming pipelines
(a DStream-like template over DataFrames) record each batch's input before it runs and commit
each batch's Delta/Parquet output exactly once.
"""

from spark_ckpt.batch import BatchJob, Input, JobResult, VertexRef, VertexSummary
from spark_ckpt.errors import (
    CommitError,
    ConfigurationError,
    EventLogError,
    FormatVersionError,
    IllegalStateTransition,
    InputChangedError,
    JobDefinitionError,
    JobFencedError,
    PipelineFailedError,
    SourceError,
    SparkCkptError,
    TaskExecutionError,
)
from spark_ckpt.options import Settings
from spark_ckpt.session import get_or_create_session
from spark_ckpt.streaming import Stream, StreamingContext, StreamingListener

__version__ = "0.1.0"

__all__ = [
    "BatchJob",
    "CommitError",
    "ConfigurationError",
    "EventLogError",
    "FormatVersionError",
    "IllegalStateTransition",
    "Input",
    "InputChangedError",
    "JobDefinitionError",
    "JobFencedError",
    "JobResult",
    "PipelineFailedError",
    "Settings",
    "SourceError",
    "SparkCkptError",
    "Stream",
    "StreamingContext",
    "StreamingListener",
    "TaskExecutionError",
    "VertexRef",
    "VertexSummary",
    "get_or_create_session",
]
