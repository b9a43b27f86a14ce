"""A bounded, thread-safe record of recent events (batch progress, checkpoint statistics).

Thread ownership: the scheduler appends progress and the coordinator appends checkpoint
statistics while a user's thread reads; ``_lock`` guards the deque, and readers get copies.
"""

from __future__ import annotations

import collections
import threading
from typing import Any

__all__ = ["RecentHistory"]


class RecentHistory:
    def __init__(self, keep: int = 100) -> None:
        self._lock = threading.Lock()
        self._items: collections.deque[dict[str, Any]] = collections.deque(maxlen=keep)

    def append(self, item: dict[str, Any]) -> None:
        with self._lock:
            self._items.append(item)

    def snapshot(self) -> list[dict[str, Any]]:
        with self._lock:
            return list(self._items)

    def last(self) -> dict[str, Any] | None:
        with self._lock:
            return self._items[-1] if self._items else None
