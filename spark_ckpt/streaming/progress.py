"""Batch progress, modelled on Structured Streaming's: listeners and a JSON-lines log."""

from __future__ import annotations

import json
import logging
from typing import Any

from spark_ckpt.storage import Storage, join

__all__ = ["ProgressLog", "StreamingListener"]

log = logging.getLogger(__name__)


class StreamingListener:
    """Subclass and pass to ``StreamingContext.add_listener``. Called on the driver, from the
    scheduler thread; an exception here is logged and ignored."""

    def on_batch_started(self, info: dict[str, Any]) -> None:
        """``info``: pipeline, batch_id, batch_time_ms, recovered, input rows per source."""

    def on_batch_completed(self, progress: dict[str, Any]) -> None:
        """``progress``: see docs/streaming.md (batch id, rows, rows/s, durations in ms)."""

    def on_checkpoint(self, stats: dict[str, Any]) -> None:
        """A checkpoint completed or was aborted; ``stats``: see docs/checkpointing.md (id,
        status, barrier batch, duration, full and incremental bytes, per-task sync, async and
        alignment times). Called from the checkpoint coordinator's thread."""

    def on_pipeline_terminated(self, error: BaseException | None) -> None:
        """The pipeline stopped; ``error`` is the batch failure, if that is why."""


class ProgressLog:
    """``<checkpoint>/progress/progress.jsonl``, one JSON object a batch."""

    def __init__(self, storage: Storage, root: str) -> None:
        self.storage = storage
        self.path = join(root, "progress", "progress.jsonl")
        storage.makedirs(join(root, "progress"))

    def append(self, progress: dict[str, Any]) -> None:
        line = (json.dumps(progress, sort_keys=True, default=str) + "\n").encode()
        try:
            with self.storage.fs.open_append_stream(self.path) as out:
                out.write(line)
        except Exception:  # object stores cannot append: one file per batch instead
            name = f"progress-{progress['batch_id']:012d}.json"
            self.storage.write_atomic(join(self.path.rsplit("/", 1)[0], name), line)


def notify(listeners: list[StreamingListener], method: str, *args: Any) -> None:
    for listener in listeners:
        try:
            getattr(listener, method)(*args)
        except Exception as exc:
            log.warning("Streaming listener %s.%s failed: %s", type(listener).__name__,
                        method, exc)
