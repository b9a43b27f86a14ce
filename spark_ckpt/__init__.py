"""spark_ckpt: Flink-grade fault tolerance for PySpark.

Batch jobs record every finished partition in a Delta event log and, when submitted again
after a driver crash, run only the partitions whose output is missing.
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
    SparkCkptError,
    TaskExecutionError,
)
from spark_ckpt.options import Settings
from spark_ckpt.session import get_or_create_session

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
    "Settings",
    "SparkCkptError",
    "TaskExecutionError",
    "VertexRef",
    "VertexSummary",
    "get_or_create_session",
]
