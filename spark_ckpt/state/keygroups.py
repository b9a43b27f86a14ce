"""Key groups: the unit in which keyed state is stored, assigned and redistributed.

A key belongs to key group ``pmod(xxhash64(key columns), max_parallelism)``, computed by Spark
(the same in every process and every Python hash seed). A stateful operator with parallelism
``P`` runs ``P`` tasks; task ``i`` owns the contiguous range of key groups ``g`` with
``g * P // max_parallelism == i`` (Flink's assignment), so changing ``P`` between runs moves
whole key groups between tasks and never splits one.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING

from spark_ckpt.errors import JobDefinitionError

if TYPE_CHECKING:
    from pyspark.sql import Column

__all__ = ["KG_COLUMN", "PID_COLUMN", "KeyGroupRange", "key_group_column", "partition_column",
           "ranges"]

KG_COLUMN = "_kg"
PID_COLUMN = "_pid"


@dataclasses.dataclass(frozen=True, order=True)
class KeyGroupRange:
    """Key groups ``start`` (inclusive) to ``end`` (exclusive)."""

    start: int
    end: int

    def __contains__(self, key_group: object) -> bool:
        return isinstance(key_group, int) and self.start <= key_group < self.end

    def overlaps(self, other: KeyGroupRange) -> bool:
        return self.start < other.end and other.start < self.end

    @property
    def label(self) -> str:
        return f"kg{self.start:05d}-{self.end:05d}"

    @classmethod
    def parse(cls, label: str) -> KeyGroupRange:
        start, end = label.removeprefix("kg").split("-")
        return cls(int(start), int(end))


MAX_KEY_GROUPS = 32768  # key groups are stored in two bytes below RocksDB's reserved prefixes


def ranges(parallelism: int, max_parallelism: int) -> list[KeyGroupRange]:
    """The key-group range of each of ``parallelism`` tasks."""
    if not 1 <= max_parallelism <= MAX_KEY_GROUPS:
        raise JobDefinitionError(
            f"expected a max parallelism from 1 to {MAX_KEY_GROUPS}, found {max_parallelism} "
            "(spark.ckpt.state.maxParallelism or key_by(max_parallelism=))"
        )
    if not 1 <= parallelism <= max_parallelism:
        raise JobDefinitionError(
            f"expected 1 <= parallelism <= max parallelism ({max_parallelism}), found "
            f"parallelism {parallelism}; raise spark.ckpt.state.maxParallelism for a new "
            "pipeline (it cannot change under a checkpoint)"
        )
    bounds = [-(-i * max_parallelism // parallelism) for i in range(parallelism + 1)]
    return [KeyGroupRange(bounds[i], bounds[i + 1]) for i in range(parallelism)]


def key_group_column(keys: Sequence[str], max_parallelism: int) -> Column:
    from pyspark.sql import functions as F

    return F.pmod(F.xxhash64(*keys), F.lit(max_parallelism)).cast("int")


def partition_column(max_parallelism: int, parallelism: int,
                     key_group: Column | None = None) -> Column:
    """Task index of a row's key group: ``kg * P // max_parallelism`` (``key_group``: the key
    group's expression, when it is not yet a column)."""
    from pyspark.sql import functions as F

    kg = F.col(KG_COLUMN) if key_group is None else key_group
    return ((kg * F.lit(parallelism)) / F.lit(max_parallelism)).cast("int")
