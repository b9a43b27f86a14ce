"""Checkpointing: the coordinator, pending and completed checkpoints, storage, listeners."""

from spark_ckpt.checkpoint.checkpoint_storage import CheckpointStorage
from spark_ckpt.checkpoint.completed import (
    CompletedCheckpoint,
    CompletedCheckpointStore,
    SharedStateRegistry,
)
from spark_ckpt.checkpoint.coordinator import CheckpointConfig, CheckpointCoordinator
from spark_ckpt.checkpoint.listener import CheckpointListener
from spark_ckpt.checkpoint.pending import (
    AckResult,
    Boundary,
    CheckpointFailureReason,
    PendingCheckpoint,
    TaskAck,
)

__all__ = [
    "AckResult",
    "Boundary",
    "CheckpointConfig",
    "CheckpointCoordinator",
    "CheckpointFailureReason",
    "CheckpointListener",
    "CheckpointStorage",
    "CompletedCheckpoint",
    "CompletedCheckpointStore",
    "PendingCheckpoint",
    "SharedStateRegistry",
    "TaskAck",
]
