"""The hand-over of batches from the JobGenerator (and a restart) to the JobScheduler.

It also bounds how far the generator runs ahead: ``spark.ckpt.stream.maxBatchesInFlight``
batches may be allocated and not yet finished. A slot is taken by the generator before it
allocates a batch and travels with the batch; the scheduler gives it back when the batch is
done. Batches a restart found allocated but unfinished are queued without a slot: they were not
the generator's to bound, and holding slots for them before the scheduler runs would deadlock a
restart with more such batches than slots.

Thread ownership: any thread may call any method; one condition variable guards the queue, the
free-slot count and the closed flag.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
from typing import Any

from spark_ckpt.streaming.batch import BatchAllocation

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
    def __init__(self, max_in_flight: int) -> None:
        self._cond = threading.Condition()
        self._items: collections.deque[Any] = collections.deque()
        self._free = max_in_flight
        self._closed = False

    # -- the generator's side ----------------------------------------------------------------
    def reserve(self, cancelled: threading.Event, poll_s: float = 0.1) -> bool:
        """Wait for a free slot and take it; False (no slot taken) once ``cancelled`` is set
        or the queue is closed."""
        with self._cond:
            while self._free <= 0 and not self._closed and not cancelled.is_set():
                self._cond.wait(poll_s)  # the bound only lets a cancel through
            if self._closed or cancelled.is_set():
                return False
            self._free -= 1
            return True

    def release(self) -> None:
        """Give back a slot whose batch was never queued (nothing to allocate) or is done."""
        with self._cond:
            self._free += 1
            self._cond.notify_all()

    def put(self, batch: QueuedBatch) -> None:
        with self._cond:
            self._items.append(batch)
            self._cond.notify_all()

    def put_control(self, control: str) -> None:
        """Queue ``STOP`` or ``FINISH`` behind the batches already queued."""
        with self._cond:
            self._items.append(control)
            self._cond.notify_all()

    # -- the scheduler's side ----------------------------------------------------------------
    def take(self) -> QueuedBatch | str:
        with self._cond:
            while not self._items:
                self._cond.wait()
            return self._items.popleft()

    def done(self, batch: QueuedBatch) -> None:
        if batch.holds_slot:
            self.release()

    def close(self) -> None:
        """No more slots are handed out (the pipeline is stopping)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def pending(self) -> int:
        with self._cond:
            return sum(isinstance(i, QueuedBatch) for i in self._items)
