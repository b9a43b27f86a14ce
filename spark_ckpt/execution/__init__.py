"""The execution model both capabilities share: job graph, task attempts, result partitions."""

from spark_ckpt.execution.attempt_states import ExecutionState, StateMachine
from spark_ckpt.execution.attempts import Execution, ExecutionRegistry
from spark_ckpt.execution.job_graph import Edge, JobGraph, JobVertex, SinkSpec
from spark_ckpt.execution.result_partition import OutputFile, PartitionResult

__all__ = [
    "Edge",
    "Execution",
    "ExecutionRegistry",
    "ExecutionState",
    "JobGraph",
    "JobVertex",
    "OutputFile",
    "PartitionResult",
    "SinkSpec",
    "StateMachine",
]
