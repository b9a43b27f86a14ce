"""The JobGenerator: seed 002's five steps for each batch, on the pipeline loop's ticks.

1. the ReceiverTracker allocates the input since the previous batch, durably;
2. the template is instantiated from the outputs (lazily, by the scheduler: BFS, each stream
   once per batch);
3. the batch's input metadata (the allocation) travels with it;
4. the batch is handed to the JobScheduler through the :class:`BatchQueue`;
5. the driver's state is checkpointed (``driver/<batch>.json``).

The generator has no thread of its own: the :class:`~spark_ckpt.streaming.runtime.pipeline_loop.
PipelineLoop` calls :meth:`JobGenerator.generate` when a batch is due on its clock and an
in-flight slot is free (when batches take longer than the interval the generator runs behind:
the next batch is generated as soon as a slot frees), so the next batch id and the allocations
it records have one owner, the loop's thread. It touches the rest of the pipeline through what
it is given: the tracker, the batch queue, the driver-state log, a fencing check and a clock.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from spark_ckpt.faults import fault_point
from spark_ckpt.streaming.runtime.batch_queue import BatchQueue, QueuedBatch

if TYPE_CHECKING:
    from spark_ckpt.clock import Clock
    from spark_ckpt.streaming.runtime.metalog import MetadataLog
    from spark_ckpt.streaming.runtime.receiver_tracker import ReceiverTracker

__all__ = ["JobGenerator"]

log = logging.getLogger(__name__)


class JobGenerator:
    def __init__(self, pipeline: str, *, tracker: ReceiverTracker, batches: BatchQueue,
                 driver_state: MetadataLog, positions: Callable[[], dict[str, Any]],
                 fence: Callable[[], None], clock: Clock, interval_ms: int, next_batch: int,
                 skip_empty: bool, time_moved: Callable[[int | None], bool] | None = None) -> None:
        self.pipeline = pipeline
        self._tracker = tracker
        self._batches = batches
        self._driver_state = driver_state
        self._positions = positions
        self._fence = fence
        self._clock = clock
        self._interval_ms = interval_ms
        self.next_batch = next_batch
        self._skip_empty = skip_empty
        # whether an operator's event time moved past what its tasks last ran with (None: the
        # pipeline has no event-time operator)
        self.time_moved = time_moved

    def generate(self, batch_time_ms: int, *, no_data: bool = False) -> QueuedBatch | None:
        """Steps 1-5 for the next batch; None when it would be empty and may be skipped.
        ``no_data``: allocated even when no source has new input (a no-data batch, which
        fires the timers and closes the windows event time has reached, as Structured
        Streaming's no-data batches do)."""
        t0 = self._clock.monotonic_s()
        self._fence()
        allocation = self._tracker.allocate(self.next_batch, batch_time_ms,
                                            skip_if_empty=self._skip_empty and not no_data)
        if allocation is not None and no_data:
            log.info("Pipeline %s batch %d: a no-data batch (event time moved)", self.pipeline,
                     allocation.batch_id)
        if allocation is None:
            return None
        queued = QueuedBatch(allocation, holds_slot=True,
                             allocation_ms=int((self._clock.monotonic_s() - t0) * 1000))
        fault_point("stream.batch.allocated")
        self._batches.put(queued)  # steps 2-4
        self._driver_state.put(allocation.batch_id, {  # step 5
            "batch_time_ms": batch_time_ms,
            "next_batch_time_ms": self.next_tick(batch_time_ms),
            "positions": self._positions(),
        })
        self.next_batch += 1
        return queued

    def next_tick(self, previous_ms: int) -> int:
        """The next tick; when behind, now (as fast as possible, never a burst to catch up)."""
        return max(previous_ms + self._interval_ms, self._clock.now_ms())
