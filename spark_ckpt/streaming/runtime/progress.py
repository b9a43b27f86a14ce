"""Batch progress, modelled on Structured Streaming's: listeners and a JSON-lines log."""

from __future__ import annotations

import json
import logging
from typing import Any

from spark_ckpt.storage import Storage, join

__all__ = ["ProgressLog", "StreamingListener"]

log = logging.getLogger(__name__)


class StreamingListener:
    """Subclass and pass to ``StreamingContext.add_listener``. Called on the driver, in order,
    from the pipeline loop's thread (a slow listener delays the next batch's allocation, not the
    running batch); an exception here is logged and ignored. ``stop()`` from a listener asks
    and returns; ``await_termination()`` from one is refused (it would wait for itself)."""

    def on_batch_started(self, info: dict[str, Any]) -> None:
        """``info``: pipeline, batch_id, batch_time_ms, recovered, input rows per source."""

    def on_batch_completed(self, progress: dict[str, Any]) -> None:
        """``progress``: see docs/streaming.md (batch id, rows, rows/s, durations in ms)."""

    def on_checkpoint(self, stats: dict[str, Any]) -> None:
        """A checkpoint completed or was aborted; ``stats``: see docs/checkpointing.md (id,
        status, barrier batch, duration, full and incremental bytes, per-task sync, async and
        alignment times)."""

    def on_pipeline_terminated(self, error: BaseException | None) -> None:
        """The pipeline stopped; ``error`` is the batch failure, if that is why."""


class ProgressLog:
    """``<checkpoint>/progress/progress.jsonl``, one JSON object a batch, bounded.

    The file is rotated at ``max_bytes`` (``progress.jsonl.1`` is the previous one, and so on)
    keeping ``keep`` files in all. Object stores cannot append: there each batch is its own
    ``progress-<batch>.json`` and only the newest ``keep_files`` of them are kept.

    Thread ownership: the pipeline loop's thread only.
    """

    def __init__(self, storage: Storage, root: str, *, max_bytes: int = 10 << 20,
                 keep: int = 3, keep_files: int = 1000) -> None:
        self.storage = storage
        self.directory = join(root, "progress")
        self.path = join(self.directory, "progress.jsonl")
        self.max_bytes = max_bytes
        self.keep = keep
        self.keep_files = keep_files
        self._per_batch = 0
        storage.makedirs(self.directory)

    def append(self, progress: dict[str, Any]) -> None:
        line = (json.dumps(progress, sort_keys=True, default=str) + "\n").encode()
        try:
            self._rotate_if_full(len(line))
            with self.storage.fs.open_append_stream(self.path) as out:
                out.write(line)
        except Exception:  # noqa: BLE001 - object stores cannot append: one file per batch instead
            name = f"progress-{progress['batch_id']:012d}.json"
            self.storage.write_atomic(join(self.directory, name), line)
            self._per_batch += 1
            if self._per_batch % 100 == 0:
                self._prune_per_batch()

    def _rotate_if_full(self, adding: int) -> None:
        info = self.storage.fs.get_file_info(self.path)
        if info.size is None or info.size + adding <= self.max_bytes:
            return
        for n in range(self.keep - 1, 0, -1):
            older = f"{self.path}.{n}"
            if n == self.keep - 1 and self.storage.exists(older):
                self.storage.fs.delete_file(older)
            newer = f"{self.path}.{n - 1}" if n > 1 else self.path
            if self.storage.exists(newer):
                self.storage.fs.move(newer, older)

    def _prune_per_batch(self) -> None:
        files = sorted(i.path for i in self.storage.list_files(self.directory, recursive=False)
                       if i.base_name.startswith("progress-"))
        for path in files[:-self.keep_files]:
            self.storage.fs.delete_file(path)


def notify(listeners: list[StreamingListener], method: str, *args: Any) -> None:
    for listener in listeners:
        try:
            getattr(listener, method)(*args)
        except Exception as exc:  # noqa: BLE001 - a listener's failure must not stop the pipeline
            log.warning("Streaming listener %s.%s failed: %s", type(listener).__name__,
                        method, exc)
