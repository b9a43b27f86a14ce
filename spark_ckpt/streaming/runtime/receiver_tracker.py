"""The ReceiverTracker: which input belongs to which batch, recorded before the batch runs.

``allocate`` asks every source for what it has since the previous batch (within its limits),
records the whole allocation as ``allocations/<batch>.json`` (create-if-absent: a second
driver on the same checkpoint fails here), and only then moves the sources past it. A
restarted driver rebuilds every source's position from the recorded allocations and runs an
allocated but unfinished batch over exactly the data it was given.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from spark_ckpt.errors import JobFencedError, RecordError
from spark_ckpt.streaming.template.batch_run import BatchAllocation

if TYPE_CHECKING:
    from spark_ckpt.clock import Clock
    from spark_ckpt.sources.source import Source
    from spark_ckpt.streaming.runtime.allocations import AllocationStore

__all__ = ["ReceiverTracker"]

log = logging.getLogger(__name__)


class ReceiverTracker:
    """Thread ownership: ``allocate`` (the generator's step 1) and ``purge`` (after a commit)
    run on the pipeline loop's thread; sources guard their own positions, and the allocation
    records belong to the :class:`AllocationStore`."""

    def __init__(self, pipeline: str, sources: list[Source], allocations: AllocationStore,
                 clock: Clock) -> None:
        self.pipeline = pipeline
        self.sources = {s.name: s for s in sources}
        self.allocations = allocations
        self._clock = clock

    def restore(self) -> list[BatchAllocation]:
        """Rebuild source positions; return every recorded allocation, oldest first."""
        records = self.allocations.restore()
        for allocation in records:  # refuse a hand-edited record before anything runs
            where = self.allocations.path(allocation.batch_id)
            for name, source in self.sources.items():
                if name not in allocation.pieces:
                    raise RecordError(
                        f"{where}: allocation record field pieces.{name}: expected the piece of "
                        f"source {name}, found the field missing; correct the field or restore "
                        "the file (nothing was run from it)"
                    )
                source.check_piece(allocation.pieces[name], where)
        for name, source in self.sources.items():
            source.restore([(a.batch_id, a.pieces[name]) for a in records if name in a.pieces])
        return records

    def start(self) -> None:
        for source in self.sources.values():
            source.start()

    def stop(self) -> None:
        for source in self.sources.values():
            source.stop()

    def allocate(self, batch_id: int, batch_time_ms: int, *,
                 skip_if_empty: bool = False) -> BatchAllocation | None:
        """Allocate and record batch ``batch_id``; None (nothing recorded) when
        ``skip_if_empty`` and no source has new input."""
        pieces = {name: source.plan() for name, source in self.sources.items()}
        if skip_if_empty and all(self.sources[n].is_empty(p) for n, p in pieces.items()):
            return None
        allocation = BatchAllocation(batch_id, batch_time_ms, pieces, self._clock.now_ms())
        if not self.allocations.record(allocation):
            raise JobFencedError(
                f"pipeline {self.pipeline}: batch {batch_id} was already allocated by another "
                "driver on this checkpoint directory; this driver stops (only one driver may "
                "run a pipeline)"
            )
        for name, source in self.sources.items():
            source.advance(pieces[name])
        log.info("Pipeline %s batch %d: allocated %s", self.pipeline, batch_id,
                 {name: self.sources[name].rows(piece) for name, piece in pieces.items()})
        return allocation

    def purge(self, below: int) -> None:
        """Drop allocation records of batches ``< below`` (sources fold what they need)."""
        old = self.allocations.below(below)
        if not old:
            return
        for name, source in self.sources.items():
            source.purge([(a.batch_id, a.pieces[name]) for a in old if name in a.pieces], below)
        self.allocations.purge(below)
