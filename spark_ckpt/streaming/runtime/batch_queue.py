"""The hand-over of batches from the JobGenerator (and a restart) to the JobScheduler.

The generator (on the pipeline loop's thread) and ``start()`` put batches; the scheduler's
thread takes them in order and runs them one at a time. Control items queue behind the
batches: ``STOP`` (leave after the running batch) and ``FINISH`` (a final checkpoint after
every batch queued so far, then the available-now end). How far the generator runs ahead
(``spark.ckpt.stream.maxBatchesInFlight``) is the pipeline loop's to bound, not this queue's:
a queued batch says whether it holds one of the loop's in-flight slots (batches a restart found
allocated hold none).

Thread ownership: any thread may call any method; one condition variable guards the queue.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
from typing import Any

from spark_ckpt.streaming.template.batch_run import BatchAllocation

__all__ = ["BatchQueue", "QueuedBatch"]


@dataclasses.dataclass(frozen=True)
class QueuedBatch:
    allocation: BatchAllocation
    recovered: bool = False
    holds_slot: bool = False
    allocation_ms: int = 0


STOP = "stop"  # leave after the running batch
FINISH = "finish"  # take a final checkpoint after every batch queued so far, then stop


class BatchQueue:
    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._items: collections.deque[Any] = collections.deque()

    def put(self, batch: QueuedBatch) -> None:
        with self._cond:
            self._items.append(batch)
            self._cond.notify_all()

    def put_control(self, control: str) -> None:
        """Queue ``STOP`` or ``FINISH`` behind the batches already queued."""
        with self._cond:
            self._items.append(control)
            self._cond.notify_all()

    def take(self) -> QueuedBatch | str:
        with self._cond:
            while not self._items:
                self._cond.wait()
            item: QueuedBatch | str = self._items.popleft()
            return item
