"""Replayable streaming sources: the position of each batch is an offset the allocation records.

Every source answers four questions for the ReceiverTracker:

* ``plan()``: what the next batch would read (a JSON-able *piece*: files, versions, a row
  range or received blocks), never more than the source's per-batch limits;
* ``advance(piece)``: the piece was recorded durably; move past it;
* ``restore(pieces)``: rebuild the position from the recorded pieces after a restart;
* ``read(run, piece)``: the piece as a DataFrame, identical every time it is read.

Sources here: a directory of files (:class:`FileStreamSource`), a Delta table
(:class:`DeltaStreamSource`) and a deterministic generator (:class:`GeneratorSource`).
Receiver-based sources, for data that cannot be replayed, are in receivers.py. This module
holds what they all share: the :class:`Source` interface and what it sees of a pipeline
(:class:`SourceScope`) and of the batch it reads for (:class:`SourceRun`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from spark_ckpt.clock import Clock, SystemClock
from spark_ckpt.errors import RecordError
from spark_ckpt.formats import validate
from spark_ckpt.storage import Storage

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession
    from pyspark.sql.types import StructType

    from spark_ckpt.options import Settings

__all__ = ["RunStats", "Source", "SourceRun", "SourceScope"]

log = logging.getLogger(__name__)

_SYSTEM_CLOCK = SystemClock()  # a source's clock until it is bound to a pipeline that has one


class RunStats(Protocol):
    """The counters of the batch being run that a source adds to."""

    batch_id: int
    input_rows: dict[str, int | None]


class SourceRun(Protocol):
    """What a source's ``read`` sees of the batch it reads for (the runtime's ``BatchRun``):
    the session, the batch id, its counters, a place for cleanups and for what to do once the
    batch's jobs have read it, and its dead-letter table."""

    spark: SparkSession
    batch_id: int
    stats: RunStats

    def on_cleanup(self, fn: Callable[[], Any]) -> None: ...

    def after_jobs(self, fn: Callable[[], Any]) -> None:
        """``fn`` runs once the batch's jobs have run, before the batch commits."""

    def reads_whole(self, source: str) -> bool:
        """True when everything the pipeline computes from ``source`` reads each of its
        batches whole (spark_ckpt's own operators and sinks only)."""

    def dead_letter(self, source: str, rows: DataFrame, count: int) -> None: ...


class SourceScope(Protocol):
    """What a source reads of the pipeline it is bound to: its options, the checkpoint
    directory it keeps its records under, and the schema recorded for it (and, when it has one,
    its ``clock``: see :attr:`Source.clock`)."""

    settings: Settings
    storage: Storage
    root: str

    def recorded_schema(self, source: str) -> StructType | None: ...


class Source:
    """Base class of streaming sources. ``name`` is unique within a pipeline."""

    kind = "source"
    PIECE: Any = None  # the spec of this source's recorded pieces (see spark_ckpt.formats)

    def __init__(self, name: str) -> None:
        self.name = name
        self.pipeline: Any = None  # the pipeline it is bound to (a SourceScope)

    def bind(self, pipeline: SourceScope) -> None:
        self.pipeline = pipeline

    @property
    def clock(self) -> Clock:
        """The clock of the pipeline this source is bound to: its ``clock`` when it has one,
        else (and before it is bound) the system clock."""
        clock = getattr(self.pipeline, "clock", None)
        return clock if isinstance(clock, Clock) else _SYSTEM_CLOCK

    def schema(self) -> StructType:
        raise NotImplementedError

    def describe(self) -> dict[str, Any]:
        return {"kind": self.kind}

    def check_piece(self, piece: Any, where: str) -> None:
        """Refuse a recorded piece that is not this source's (a hand edit, a bug): RecordError
        naming ``where`` (the record's file), the field, what was expected and what was found."""
        field = f"pieces.{self.name}"
        try:
            if self.PIECE is not None:
                validate(piece, self.PIECE, field)
            self._check_places(piece, field)
        except RecordError as exc:
            raise RecordError(f"{where}: allocation record {exc}; correct the field or restore "
                              "the file (nothing was run from it)") from None

    def _check_places(self, piece: dict[str, Any], field: str) -> None:
        """Where the piece's files must be (beyond the spec); RecordError(field...) if not."""

    def restore(self, pieces: list[tuple[int, dict[str, Any]]]) -> None:
        """Rebuild the position from ``(batch id, piece)`` records, oldest first."""

    def plan(self) -> dict[str, Any]:
        raise NotImplementedError

    def advance(self, piece: dict[str, Any]) -> None:
        raise NotImplementedError

    def rows(self, piece: dict[str, Any]) -> int | None:
        return piece.get("rows")

    def position(self) -> dict[str, Any]:
        """Where the source stands, for the driver-state record."""
        return {}

    def is_empty(self, piece: dict[str, Any]) -> bool:
        return self.rows(piece) == 0

    def split_columns(self) -> tuple[str, ...]:
        """The columns of this source's rows that name the partition a row was read from,
        whose event times are ordered apart from the others' (a watermark declared on the
        source's rows is kept per partition); () where the source has none."""
        return ()

    def read(self, run: SourceRun, piece: dict[str, Any]) -> DataFrame:
        raise NotImplementedError

    def empty(self, spark: Any) -> DataFrame:
        """No rows, in a form Spark's optimizer recognizes, so an empty batch runs no job."""
        from pyspark.sql import functions as F

        return spark.range(1).select(
            *[F.lit(None).cast(f.dataType).alias(f.name) for f in self.schema().fields]
        ).where(F.lit(False))

    def start(self) -> None:
        """Start receiving (receiver sources)."""

    def stop(self) -> None:
        """Stop receiving (receiver sources)."""

    def purge(self, pieces_below: list[tuple[int, dict[str, Any]]], below: int) -> None:
        """Allocation records of batches ``< below`` are about to be deleted."""


