"""Progress of a running job: partitions done / total per vertex, and how many were reused."""

from __future__ import annotations

import sys
import threading
from typing import Any

__all__ = ["JobProgress"]


class JobProgress:
    """A rich progress display when enabled; otherwise it only counts.

    Thread ownership: ``advance`` is called by the manifest poller and wave threads; rich's
    Progress is thread-safe, the counters are guarded by ``_lock``.
    """

    def __init__(self, job_id: str, mode: str) -> None:
        self.job_id = job_id
        enabled = mode == "always" or (mode == "auto" and sys.stderr.isatty())
        self._lock = threading.Lock()
        self._tasks: dict[str, Any] = {}
        self.done: dict[str, int] = {}
        self._progress: Any = None
        if enabled:
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeElapsedColumn,
            )

            self._progress = Progress(
                TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                TextColumn("{task.fields[note]}"), TimeElapsedColumn(),
                console=Console(stderr=True),
            )
            self._progress.start()

    def vertex(self, vertex_id: str, total: int, reused: int) -> None:
        with self._lock:
            self.done[vertex_id] = reused
        if self._progress is not None:
            self._tasks[vertex_id] = self._progress.add_task(
                f"{self.job_id}/{vertex_id}", total=total, completed=reused,
                note=f"reused {reused}" if reused else "",
            )

    def advance(self, vertex_id: str) -> None:
        with self._lock:
            self.done[vertex_id] = self.done.get(vertex_id, 0) + 1
        if self._progress is not None and vertex_id in self._tasks:
            self._progress.advance(self._tasks[vertex_id])

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
