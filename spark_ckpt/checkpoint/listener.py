"""CheckpointListener: told when a checkpoint completes or is aborted (Flink's contract).

Notifications are best effort: one can be lost (a crash right after completion) and a later
one *subsumes* it, so an implementation commits everything up to the notified checkpoint and
every commit must be idempotent.
"""

from __future__ import annotations

__all__ = ["CheckpointListener"]


class CheckpointListener:
    """Told when a checkpoint completes or is aborted (Flink's CheckpointListener); both
    methods do nothing by default."""

    def notify_checkpoint_complete(self, checkpoint_id: int) -> None:
        """Checkpoint ``checkpoint_id`` (and so every earlier one) is complete."""

    def notify_checkpoint_aborted(self, checkpoint_id: int) -> None:
        """Checkpoint ``checkpoint_id`` will never complete."""
