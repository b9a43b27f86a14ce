"""One batch being run: its allocation, the DataFrames its streams computed, its cleanups.

Threads and owners: a :class:`BatchRun` lives on the JobScheduler's thread for one batch and no
other thread sees it. It reaches the pipeline only through what the scheduler hands it: the
recorded inputs (:class:`BatchInputs`) and the operators' runtime state
(:class:`OperatorRuntime`), which the scheduler's thread owns.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

__all__ = ["BatchAllocation", "BatchInputs", "BatchRun", "BatchStats", "ComputedStream",
           "OperatorRuntime"]


class ComputedStream(Protocol):
    """What a batch run computes: a stream of the template (streaming.stream)."""

    id: int
    name: str

    def compute(self, run: BatchRun) -> DataFrame | None:
        """This batch's DataFrame, from the parents' DataFrames of the same batch."""


class DeadLetterTable(Protocol):
    def write(self, batch_id: int, source: str, rows: DataFrame) -> None:
        """Keep a source's malformed records of one batch."""


class BatchInputs(Protocol):
    """What a batch run reads from the pipeline: the session, the recorded allocations (a
    window reads earlier batches'), and where malformed records go."""

    @property
    def spark(self) -> SparkSession:
        """The pipeline's session."""

    @property
    def dead_letters(self) -> DeadLetterTable:
        """Where malformed records go."""

    def allocation(self, batch_id: int) -> BatchAllocation:
        """The recorded allocation of ``batch_id``."""


class OperatorRuntime(Protocol):
    """What a stateful operator gets while its batch runs (the JobScheduler's thread owns all
    of it): its runtime state, the two-phase outputs its tasks may write directly (operator
    chaining) and those a restore already shows, and a way to publish what changed."""

    @property
    def transactions(self) -> Mapping[str, Any]:
        """Output name -> its SinkTransactions (two-phase outputs with checkpoints)."""

    @property
    def skip_output_through(self) -> Mapping[str, int]:
        """Output name -> the last batch it already shows (written before a restore)."""

    def state(self, operator: str) -> Any:
        """The operator's runtime state (template.operator_state.OperatorState)."""

    def publish(self, operator: str) -> None:
        """The operator's state changed: release the state files it no longer holds and
        publish its new snapshot for readers on other threads."""


log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class BatchAllocation:
    """What batch ``batch_id`` reads from every source, recorded before it runs."""

    batch_id: int
    batch_time_ms: int
    pieces: dict[str, dict[str, Any]]
    allocated_ms: int = 0

    def body(self) -> dict[str, Any]:
        return {"batch_time_ms": self.batch_time_ms, "pieces": self.pieces,
                "allocated_ms": self.allocated_ms}

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> BatchAllocation:
        return cls(int(record["batch_id"]), int(record["batch_time_ms"]),
                   dict(record["pieces"]), int(record.get("allocated_ms", 0)))


@dataclasses.dataclass
class BatchStats:
    """What one batch observed, shared by the run and the runs of earlier batches it asks for."""

    batch_id: int = -1
    input_rows: dict[str, int | None] = dataclasses.field(default_factory=dict)
    dead_letters: dict[str, int] = dataclasses.field(default_factory=dict)
    computed: list[str] = dataclasses.field(default_factory=list)
    state: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    cleanups: list[Callable[[], Any]] = dataclasses.field(default_factory=list)
    # what sources learn from the batch's own jobs (rows counted, malformed rows found as the
    # jobs read them), run once those jobs have run, before the batch commits
    after_jobs: list[Callable[[], Any]] = dataclasses.field(default_factory=list)
    # source -> whether everything computed from it reads its batches whole
    whole_reads: dict[str, bool] = dataclasses.field(default_factory=dict)


class BatchRun:
    """The per-batch instance of the template: ``get_or_compute`` memoizes each stream once.

    Windows ask for earlier batches through :meth:`at`, which reads their recorded allocation
    and shares this run's memo, so a stream is computed at most once per (stream, batch).
    """

    def __init__(self, inputs: BatchInputs, allocation: BatchAllocation,
                 memo: dict[tuple[int, int], Any] | None = None,
                 stats: BatchStats | None = None,
                 operators: OperatorRuntime | None = None) -> None:
        self.inputs = inputs
        self.spark = inputs.spark
        self.operators = operators
        self.allocation = allocation
        self.batch_id = allocation.batch_id
        self.memo: dict[tuple[int, int], Any] = {} if memo is None else memo
        # outputs whose staged files a stateful task upstream wrote itself (operator chaining)
        self.chained: dict[str, dict[str, Any] | None] = {}
        self.stats = stats or BatchStats(batch_id=allocation.batch_id)

    def at(self, batch_id: int) -> BatchRun:
        if batch_id == self.batch_id:
            return self
        return BatchRun(self.inputs, self.inputs.allocation(batch_id), self.memo, self.stats,
                        self.operators)

    def get_or_compute(self, stream: ComputedStream) -> DataFrame | None:
        key = (stream.id, self.batch_id)
        if key not in self.memo:
            self.memo[key] = stream.compute(self)
            self.stats.computed.append(f"{stream.name}@{self.batch_id}")
        found: DataFrame | None = self.memo[key]
        return found

    def on_cleanup(self, fn: Callable[[], Any]) -> None:
        self.stats.cleanups.append(fn)

    def after_jobs(self, fn: Callable[[], Any]) -> None:
        self.stats.after_jobs.append(fn)

    def reads_whole(self, source: str) -> bool:
        return self.stats.whole_reads.get(source, False)

    def finish_reads(self) -> None:
        """Run what the sources asked for once the batch's jobs have read them (in order; a
        failure fails the batch before it commits)."""
        while self.stats.after_jobs:
            self.stats.after_jobs.pop(0)()

    def dead_letter(self, source: str, rows: DataFrame, count: int) -> None:
        if self.batch_id == self.stats.batch_id:
            self.stats.dead_letters[source] = self.stats.dead_letters.get(source, 0) + count
        self.inputs.dead_letters.write(self.batch_id, source, rows)

    def cleanup(self) -> None:
        for fn in self.stats.cleanups:
            try:
                fn()
            except Exception as exc:  # noqa: BLE001 - never hide the batch's own outcome
                log.warning("Batch %d: cleanup failed: %s", self.batch_id, exc)
        self.stats.cleanups.clear()
        self.stats.after_jobs.clear()
        self.memo.clear()
