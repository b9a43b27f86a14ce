"""The JobGenerator: ticks on the batch interval and runs seed 002's five steps per batch.

1. the ReceiverTracker allocates the input since the previous batch, durably;
2. the template is instantiated from the outputs (lazily, by the scheduler: BFS, each stream
   once per batch);
3. the batch's input metadata (the allocation) travels with it;
4. the batch is submitted to the JobScheduler;
5. the driver's state is checkpointed (``driver/<batch>.json``).

When batches take longer than the interval the generator runs behind: it allocates the next
batch as soon as fewer than ``spark.ckpt.stream.maxBatchesInFlight`` are queued or running.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING

from spark_ckpt.faults import fault_point

if TYPE_CHECKING:
    from spark_ckpt.streaming.context import StreamingContext

__all__ = ["JobGenerator"]

log = logging.getLogger(__name__)


class JobGenerator:
    def __init__(self, ctx: StreamingContext, next_batch: int, available_now: bool) -> None:
        self.ctx = ctx
        self.next_batch = next_batch
        self.available_now = available_now
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._loop, name=f"spark-ckpt-generator-{ctx.name}",
                                       daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.stopping.set()

    def _loop(self) -> None:
        ctx = self.ctx
        interval = ctx.batch_interval
        next_time = time.time()
        skip_empty = self.available_now or ctx.settings.stream_skip_empty_batches
        try:
            while not self.stopping.is_set():
                if not self.available_now:
                    delay = next_time - time.time()
                    if delay > 0 and self.stopping.wait(delay):
                        return
                while not ctx.scheduler.in_flight.acquire(timeout=0.1):
                    if self.stopping.is_set():
                        return
                if self.stopping.is_set():
                    ctx.scheduler.in_flight.release()
                    return
                batch_time_ms = int(next_time * 1000)
                t0 = time.perf_counter()
                ctx.check_fenced()
                allocation = ctx.tracker.allocate(self.next_batch, batch_time_ms,
                                                  skip_if_empty=skip_empty)  # step 1
                if allocation is None:
                    ctx.scheduler.in_flight.release()
                    if self.available_now:  # the scheduler finishes after the batches queued
                        ctx.scheduler.finish()
                        return
                    next_time = _next_tick(next_time, interval)
                    continue
                ctx.allocation_ms[allocation.batch_id] = int((time.perf_counter() - t0) * 1000)
                ctx.remember_allocation(allocation)
                fault_point("stream.batch.allocated")
                ctx.scheduler.submit(allocation)  # steps 2-4
                ctx.driver_state.put(allocation.batch_id, {  # step 5
                    "batch_time_ms": batch_time_ms,
                    "next_batch_time_ms": int(_next_tick(next_time, interval) * 1000),
                    "positions": ctx.positions(),
                })
                self.next_batch += 1
                next_time = _next_tick(next_time, interval)
        except BaseException as exc:  # noqa: BLE001 - handed to await_termination
            ctx._batch_failed(self.next_batch, exc, drain=True)  # noqa: SLF001


def _next_tick(previous: float, interval: float) -> float:
    """The next tick; when behind, now (run as fast as possible, never a burst to catch up)."""
    return max(previous + interval, time.time())
