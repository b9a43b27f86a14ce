"""Which input each batch reads: the durable ``allocations/`` log and its in-memory view.

The ReceiverTracker records an allocation (create-if-absent) and purges old ones after a
commit, both on the pipeline loop's thread (its one writer); the scheduler reads allocations of
the batch it runs and of earlier batches a window reaches back to.

Threads and owners: one writer, the pipeline loop's thread (record, purge; ``start()``
restores before any thread runs); readers on any thread (the JobScheduler reads the batch it
runs and the earlier batches a window reaches back to, through :class:`RecordedInputs`).
``_lock`` guards ``_memory``. Storage calls happen outside the lock except the record itself,
so a slow read never holds up the loop.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import TYPE_CHECKING

from spark_ckpt.errors import JobDefinitionError
from spark_ckpt.streaming.runtime.metalog import MetadataLog
from spark_ckpt.streaming.template.batch_run import BatchAllocation, DeadLetterTable

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

__all__ = ["AllocationStore", "RecordedInputs"]


class AllocationStore:
    def __init__(self, log: MetadataLog) -> None:
        self._log = log
        self._lock = threading.Lock()
        self._memory: dict[int, BatchAllocation] = {}

    def restore(self) -> list[BatchAllocation]:
        """Every recorded allocation, oldest first (and kept in memory)."""
        records = [BatchAllocation.from_record(r) for r in
                   (self._log.get(b) for b in self._log.batch_ids()) if r]
        with self._lock:
            for record in records:
                self._memory[record.batch_id] = record
        return records

    def path(self, batch_id: int) -> str:
        """The file that records ``batch_id``'s allocation (for messages)."""
        return self._log.storage.spark_path(self._log.path(batch_id))

    def record(self, allocation: BatchAllocation) -> bool:
        """Record ``allocation`` durably; False if its batch was already recorded (by another
        driver: nothing is changed)."""
        if not self._log.add(allocation.batch_id, allocation.body()):
            return False
        with self._lock:
            self._memory[allocation.batch_id] = allocation
        return True

    def get(self, batch_id: int) -> BatchAllocation | None:
        """The allocation of ``batch_id``, or None if it is not (or no longer) recorded."""
        with self._lock:
            found = self._memory.get(batch_id)
        if found is not None:
            return found
        record = self._log.get(batch_id)
        if record is None:
            return None
        allocation = BatchAllocation.from_record(record)
        with self._lock:
            return self._memory.setdefault(batch_id, allocation)

    def below(self, batch_id: int) -> list[BatchAllocation]:
        """The allocations in memory of batches ``< batch_id``, oldest first."""
        with self._lock:
            return [a for b, a in sorted(self._memory.items()) if b < batch_id]

    def purge(self, below: int) -> None:
        """Forget and delete the records of batches ``< below``."""
        with self._lock:
            for b in [b for b in self._memory if b < below]:
                del self._memory[b]
        self._log.purge(below)


@dataclasses.dataclass(frozen=True)
class RecordedInputs:
    """What a batch run reads (a ``BatchInputs``): the session, the recorded allocations and
    where malformed records go. Immutable; any thread."""

    pipeline: str
    spark: SparkSession
    dead_letters: DeadLetterTable
    store: AllocationStore
    retained: int  # spark.ckpt.stream.minBatchesToRetain, for the message below

    def allocation(self, batch_id: int) -> BatchAllocation:
        """The recorded allocation of ``batch_id``."""
        found = self.store.get(batch_id)
        if found is None:
            raise JobDefinitionError(
                f"pipeline {self.pipeline}: batch {batch_id} is no longer recorded (a window "
                f"reaches further back than spark.ckpt.stream.minBatchesToRetain="
                f"{self.retained})"
            )
        return found
