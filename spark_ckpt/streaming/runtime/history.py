"""A bounded record of recent events (batch progress, checkpoint statistics), published as
immutable snapshots.

Threads and owners: each history has **one writer**. The progress history's is the pipeline
loop's thread (it appends a batch's progress when it handles ``BatchCompleted``); the
checkpoint history's is the checkpoint coordinator's thread (it appends a checkpoint's
statistics before anyone waiting on that checkpoint is told). The writer builds a new tuple and
publishes it by one reference assignment; readers on any thread (``recent_progress``,
``last_progress``, ``recent_checkpoints``, the scheduler's progress record) take the current
tuple without a lock, and what they took never changes under them. Entries are never changed
once appended (readers that hand them on, hand on copies).
"""

from __future__ import annotations

import copy
from typing import Any

__all__ = ["RecentHistory"]


class RecentHistory:
    def __init__(self, keep: int = 100) -> None:
        self._keep = keep
        self._items: tuple[dict[str, Any], ...] = ()

    def append(self, item: dict[str, Any]) -> None:
        """Add ``item`` (the history's one writer only)."""
        self._items = (*self._items[len(self._items) + 1 - self._keep:], item) \
            if self._keep > 0 else ()

    def items(self) -> tuple[dict[str, Any], ...]:
        """The current snapshot, oldest first: an immutable tuple (any thread)."""
        return self._items

    def snapshot(self) -> list[dict[str, Any]]:
        """A copy of the current snapshot, oldest first (any thread; the caller may change it)."""
        return copy.deepcopy(list(self._items))

    def last(self) -> dict[str, Any] | None:
        items = self._items
        return items[-1] if items else None
