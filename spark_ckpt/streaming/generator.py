"""The JobGenerator: ticks on the batch interval and runs seed 002's five steps per batch.

1. the ReceiverTracker allocates the input since the previous batch, durably;
2. the template is instantiated from the outputs (lazily, by the scheduler: BFS, each stream
   once per batch);
3. the batch's input metadata (the allocation) travels with it;
4. the batch is handed to the JobScheduler through the :class:`BatchQueue`;
5. the driver's state is checkpointed (``driver/<batch>.json``).

When batches take longer than the interval the generator runs behind: it allocates the next
batch as soon as fewer than ``spark.ckpt.stream.maxBatchesInFlight`` are queued or running.

Thread ownership: everything here belongs to the generator's own thread; other threads only
call :meth:`stop`. It touches the rest of the pipeline through what it is given: the tracker,
the batch queue, the driver-state log, a fencing check, a clock and a failure callback.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from spark_ckpt.faults import fault_point
from spark_ckpt.streaming.batch_queue import FINISH, BatchQueue, QueuedBatch

if TYPE_CHECKING:
    from spark_ckpt.clock import Clock
    from spark_ckpt.streaming.metalog import MetadataLog
    from spark_ckpt.streaming.tracker import ReceiverTracker

__all__ = ["JobGenerator"]

log = logging.getLogger(__name__)


class JobGenerator:
    def __init__(self, pipeline: str, *, tracker: ReceiverTracker, batches: BatchQueue,
                 driver_state: MetadataLog, positions: Callable[[], dict[str, Any]],
                 fence: Callable[[], None], clock: Clock, interval_ms: int, next_batch: int,
                 available_now: bool, skip_empty: bool,
                 on_failure: Callable[[int, BaseException], None]) -> None:
        self.pipeline = pipeline
        self._tracker = tracker
        self._batches = batches
        self._driver_state = driver_state
        self._positions = positions
        self._fence = fence
        self._clock = clock
        self._interval_ms = interval_ms
        self._on_failure = on_failure
        self.next_batch = next_batch
        self.available_now = available_now
        self._skip_empty = skip_empty or available_now
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._loop,
                                       name=f"spark-ckpt-generator-{pipeline}", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.stopping.set()

    def _loop(self) -> None:
        next_ms = self._clock.now_ms()
        try:
            while not self.stopping.is_set():
                if not self.available_now and self._clock.wait_until(next_ms, self.stopping):
                    return
                if not self._batches.reserve(self.stopping):
                    return
                try:
                    queued = self._generate(next_ms)
                except BaseException:
                    self._batches.release()
                    raise
                if queued is None:
                    self._batches.release()
                    if self.available_now:  # the scheduler finishes after the batches queued
                        self._batches.put_control(FINISH)
                        return
                next_ms = self._next_tick(next_ms)
        except BaseException as exc:  # noqa: BLE001 - handed to await_termination
            self._on_failure(self.next_batch, exc)

    def _generate(self, batch_time_ms: int) -> QueuedBatch | None:
        """Steps 1-5 for the next batch; None when it would be empty and may be skipped."""
        t0 = time.perf_counter()
        self._fence()
        allocation = self._tracker.allocate(self.next_batch, batch_time_ms,
                                            skip_if_empty=self._skip_empty)  # step 1
        if allocation is None:
            return None
        queued = QueuedBatch(allocation, holds_slot=True,
                             allocation_ms=int((time.perf_counter() - t0) * 1000))
        fault_point("stream.batch.allocated")
        self._batches.put(queued)  # steps 2-4
        self._driver_state.put(allocation.batch_id, {  # step 5
            "batch_time_ms": batch_time_ms,
            "next_batch_time_ms": self._next_tick(batch_time_ms),
            "positions": self._positions(),
        })
        self.next_batch += 1
        return queued

    def _next_tick(self, previous_ms: int) -> int:
        """The next tick; when behind, now (as fast as possible, never a burst to catch up)."""
        return max(previous_ms + self._interval_ms, self._clock.now_ms())
