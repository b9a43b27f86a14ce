"""spark_ckpt: Flink-grade fault tolerance for PySpark.

Batch jobs record every finished partition in a Delta event log and, when submitted again
after a driver crash, run only the partitions whose output is missing. Streaming pipelines
(a DStream-like template over DataFrames) record each batch's input before it runs and commit
each batch's Delta/Parquet output exactly once; keyed state (aggregations and a KeyedProcessor
API) is checkpointed with barriers by a CheckpointCoordinator, and two-phase-commit sinks make
output visible exactly once when a checkpoint completes.
"""

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from spark_ckpt.batch import BatchJob, Input, JobResult, VertexRef, VertexSummary
    from spark_ckpt.checkpoint import CheckpointListener
    from spark_ckpt.errors import (
        CheckpointError,
        CommitError,
        ConfigurationError,
        DirectoryError,
        EventLogError,
        FormatVersionError,
        IllegalStateTransition,
        InputChangedError,
        JobDefinitionError,
        JobFencedError,
        PipelineFailedError,
        SinkAheadError,
        SourceError,
        SparkCkptError,
        StateSchemaError,
        StateTooLargeError,
        TaskExecutionError,
        UserFunctionError,
    )
    from spark_ckpt.ops.state_processor import raw_state, read_state, rewrite_state
    from spark_ckpt.options import Settings
    from spark_ckpt.session import get_or_create_session
    from spark_ckpt.state import KeyedBatch, KeyedProcessor, Result, VectorizedProcessor
    from spark_ckpt.streaming import (
        Stream,
        StreamingContext,
        StreamingListener,
        TwoPhaseCommitSink,
    )

# Each name is imported on first use (PEP 562): a Python worker that runs a stateful task
# imports ``spark_ckpt.state.process_task`` and would otherwise pay for the whole package
# (the streaming template, the batch runner, pandas) on every new worker.
_EXPORTS = {
    "spark_ckpt.batch": ("BatchJob", "Input", "JobResult", "VertexRef", "VertexSummary"),
    "spark_ckpt.checkpoint": ("CheckpointListener",),
    "spark_ckpt.errors": (
        "CheckpointError", "CommitError", "ConfigurationError", "DirectoryError",
        "EventLogError", "FormatVersionError", "IllegalStateTransition", "InputChangedError",
        "JobDefinitionError", "JobFencedError", "PipelineFailedError", "SinkAheadError",
        "SourceError", "SparkCkptError", "StateSchemaError", "StateTooLargeError",
        "TaskExecutionError", "UserFunctionError"),
    "spark_ckpt.ops.state_processor": ("raw_state", "read_state", "rewrite_state"),
    "spark_ckpt.options": ("Settings",),
    "spark_ckpt.session": ("get_or_create_session",),
    "spark_ckpt.state": ("KeyedBatch", "KeyedProcessor", "Result", "VectorizedProcessor"),
    "spark_ckpt.streaming": ("Stream", "StreamingContext", "StreamingListener",
                             "TwoPhaseCommitSink"),
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}

__version__ = "0.1.0"

__all__ = [
    "BatchJob",
    "CheckpointError",
    "CheckpointListener",
    "CommitError",
    "ConfigurationError",
    "DirectoryError",
    "EventLogError",
    "FormatVersionError",
    "IllegalStateTransition",
    "Input",
    "InputChangedError",
    "JobDefinitionError",
    "JobFencedError",
    "JobResult",
    "KeyedBatch",
    "KeyedProcessor",
    "PipelineFailedError",
    "Result",
    "Settings",
    "SinkAheadError",
    "SourceError",
    "SparkCkptError",
    "StateSchemaError",
    "StateTooLargeError",
    "Stream",
    "StreamingContext",
    "StreamingListener",
    "TaskExecutionError",
    "TwoPhaseCommitSink",
    "UserFunctionError",
    "VectorizedProcessor",
    "VertexRef",
    "VertexSummary",
    "get_or_create_session",
    "raw_state",
    "read_state",
    "rewrite_state",
]


if not TYPE_CHECKING:  # (mypy sees the imports above: a misspelt name is still an error)
    def __getattr__(name: str) -> Any:
        return _resolve(name)


def _resolve(name: str) -> Any:
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module 'spark_ckpt' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
