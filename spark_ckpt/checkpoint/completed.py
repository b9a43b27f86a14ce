"""Completed checkpoints, the store that retains the newest N, and the shared-file registry.

A completed checkpoint references files (state snapshots and changelogs, staged sink output)
that consecutive checkpoints share. The :class:`SharedStateRegistry` counts, per file, the
retained checkpoints that reference it; when the store subsumes a checkpoint, files no retained
checkpoint and no running task still references are deleted (Flink's SharedStateRegistry).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterable
from typing import Any

__all__ = ["CompletedCheckpoint", "CompletedCheckpointStore", "SharedStateRegistry"]

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class CompletedCheckpoint:
    checkpoint_id: int
    barrier_batch: int
    metadata: dict[str, Any]

    def state_files(self) -> list[str]:
        """Every state file this checkpoint references, by absolute path (as read)."""
        files: list[str] = []
        for op in self.metadata.get("operators", {}).values():
            for handle in op.get("handles", {}).values():
                files.extend(f["path"] for f in handle.get("files", []))
        return files


class SharedStateRegistry:
    """Reference counts of state files across retained checkpoints. One owner: the
    coordinator's thread."""

    def __init__(self) -> None:
        self.refs: dict[str, int] = {}

    def register(self, files: Iterable[str]) -> None:
        for f in set(files):
            self.refs[f] = self.refs.get(f, 0) + 1

    def release(self, files: Iterable[str]) -> list[str]:
        """Drop one reference to each file; return the files no checkpoint references now."""
        gone = []
        for f in set(files):
            n = self.refs.get(f, 0) - 1
            if n <= 0:
                self.refs.pop(f, None)
                gone.append(f)
            else:
                self.refs[f] = n
        return gone

    def referenced(self, path: str) -> bool:
        return path in self.refs


class CompletedCheckpointStore:
    """The retained completed checkpoints, oldest first (Flink's CompletedCheckpointStore)."""

    def __init__(self, retain: int, registry: SharedStateRegistry,
                 discard: Callable[[CompletedCheckpoint, list[str]], None]) -> None:
        self.retain = retain
        self.registry = registry
        self.discard = discard
        self.checkpoints: list[CompletedCheckpoint] = []

    def add(self, checkpoint: CompletedCheckpoint) -> list[CompletedCheckpoint]:
        """Add; subsume (and discard) the oldest beyond ``retain``; return the subsumed."""
        self.registry.register(checkpoint.state_files())
        self.checkpoints.append(checkpoint)
        subsumed = []
        while len(self.checkpoints) > self.retain:
            old = self.checkpoints.pop(0)
            unreferenced = self.registry.release(old.state_files())
            subsumed.append(old)
            try:
                self.discard(old, unreferenced)
            except Exception as exc:  # noqa: BLE001 - a failed cleanup never fails the pipeline
                log.warning("Discarding checkpoint %d failed: %s", old.checkpoint_id, exc)
        return subsumed

    @property
    def latest(self) -> CompletedCheckpoint | None:
        return self.checkpoints[-1] if self.checkpoints else None

    def get(self, checkpoint_id: int) -> CompletedCheckpoint | None:
        return next((c for c in self.checkpoints if c.checkpoint_id == checkpoint_id), None)
