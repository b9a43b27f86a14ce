"""A vertex's output laid out for writing: in hash mode Spark partition *j* is partition *j*
(or, written positionally, Spark partition *i* is ``parts[i]``); in split mode any layout (a
wave is one unit). Also the output a Spark Connect server keeps persisted while a whole run of
a keyed vertex writes it, and what the physical plan of a frame says (its shuffles, its
exchanges), read through :mod:`spark_ckpt.sparkapi`.

:class:`Arrangement` holds no state of its own: it reads the frames, the lineages' inputs tag
and the attempt's finished partitions, from whichever thread lays out a run unit.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from spark_ckpt.batch.planning import hash_mode, reads_exchanges, writes_positionally
from spark_ckpt.errors import JobDefinitionError
from spark_ckpt.sparkapi import frame_api, is_connect, plans

if TYPE_CHECKING:
    from pyspark.sql import DataFrame

    from spark_ckpt.batch.job_attempt import Attempt
    from spark_ckpt.batch.lineage import Lineages
    from spark_ckpt.batch.vertex_frames import VertexFrames
    from spark_ckpt.execution.job_graph import JobVertex

__all__ = ["Arrangement", "exchanges", "plan_shuffles"]

log = logging.getLogger(__name__)


def plan_shuffles(df: DataFrame) -> bool:
    """True when the physical plan moves rows between partitions (broadcasts do not)."""
    return plans.shuffles(frame_api(df).executed_plan(df))


def exchanges(df: DataFrame) -> list[str]:
    """The exchanges in the physical plan, without expression ids: what Spark moves."""
    return plans.exchanges(frame_api(df).executed_plan(df))


def _ends_hash_partitioned(df: DataFrame, key: tuple[str, ...], parallelism: int) -> bool:
    """True when Spark's plan ends hash-partitioned by ``key`` into ``parallelism`` partitions
    and every exchange in it is a user repartition by number: adaptive execution may coalesce
    or split the exchanges Spark adds itself to meet a requirement, never those."""
    api = frame_api(df)
    plan = api.executed_plan(df)
    if not plans.only_repartitions_by_number(plan):
        return False
    return api.ends_hash_partitioned(df, tuple(key), parallelism, plan=plan)


class Arrangement:
    """Lays out one attempt's vertex outputs for writing (see the module's docstring)."""

    def __init__(self, job: Attempt, frames: VertexFrames, lineages: Lineages) -> None:
        self.job = job
        self.frames = frames
        self.lineages = lineages

    # -- a keyed vertex's output kept on a Spark Connect server -----------------------------
    def keeps_on_server(self, vertex: JobVertex) -> bool:
        """True when a whole run of ``vertex`` persists its output on the server while it
        runs (``spark.ckpt.batch.serverCache``): a Spark Connect session (a classic driver's
        cache dies with it), a keyed vertex (one Spark job whose partitions are its
        partitions), a real run, inputs that can be told apart (files)."""
        return (self.job.settings.batch_server_cache and is_connect(self.frames.spark)
                and hash_mode(vertex) and self.frames.planning is None
                and not self.job.explaining and not reads_exchanges(self.frames.graph, vertex)
                and self.lineages.inputs_tag() is not None)

    def _left_on_server(self, vertex: JobVertex, whole: DataFrame) -> bool:
        """True when a killed client of this server left ``whole`` (the vertex's whole output
        over the same inputs) persisted there."""
        from pyspark.storagelevel import StorageLevel

        if whole.storageLevel == StorageLevel.NONE:
            log.debug("Job %s attempt %d: nothing of %s persisted on the server (inputs %s)",
                      self.job.run_id, self.job.attempt, vertex.id, self.lineages.inputs_tag())
            return False
        log.info("Job %s attempt %d: %s reads the output a killed client of this server left "
                 "persisted (the partitions and shuffles it had computed)", self.job.run_id,
                 self.job.attempt, vertex.id)
        return True

    # -- the layout ------------------------------------------------------------------------
    def arranged(self, vertex: JobVertex, parts: list[int]) -> DataFrame:
        """The output of ``parts``, laid out so Spark partition *j* is partition *j* (hash
        mode) or in any layout (split mode, whose wave is one unit)."""
        return self.for_unit(vertex, parts)[0]

    def for_unit(self, vertex: JobVertex, parts: list[int]
                 ) -> tuple[DataFrame, DataFrame | None, bool]:
        """:meth:`arranged`, the frame to keep persisted on the server while it is written
        (:meth:`keeps_on_server`) or None, and whether Spark partition *i* is partition
        ``parts[i]`` instead (:func:`~spark_ckpt.batch.planning.writes_positionally`)."""
        from pyspark.sql import functions as F

        if not self.keeps_on_server(vertex):
            positional = writes_positionally(self.frames.graph, vertex, parts,
                                             self.job.finished, self.frames.planning)
            return self._arrange(vertex, parts, positional), None, positional
        tag = F.lit(self.lineages.inputs_tag())  # an always-true filter: in the plan, not the job
        whole = self._arrange(vertex, list(range(vertex.parallelism))).where(tag == tag)
        left = self._left_on_server(vertex, whole)
        if len(parts) == vertex.parallelism:
            return whole, whole, False
        if not left:  # read and shuffle only the rows of these partitions
            return self._arrange(vertex, parts), None, False
        # partition j of the kept output holds exactly bucket j's rows: filtering keeps that
        bucket = F.pmod(F.hash(*vertex.key), F.lit(vertex.parallelism))
        return whole.where(bucket.isin(parts)), whole, False

    def _arrange(self, vertex: JobVertex, parts: list[int], positional: bool = False
                 ) -> DataFrame:
        from pyspark.sql import functions as F

        whole = len(parts) == vertex.parallelism
        df = self.frames.compute(vertex, None if whole else parts, co_partition=not positional)
        if vertex.partial_of is not None:  # a wave may aggregate, what it reads may not
            for edge in vertex.inputs:
                # read as the function sees it, not as one Spark partition a split
                # (VertexFrames.split_tasks: that union is spark_ckpt's)
                with self.frames.plain_reads():
                    shuffles = edge.kind == "forward" and \
                        plan_shuffles(self.frames.frame(edge.upstream, parts))
                if shuffles:
                    raise JobDefinitionError(
                        f"vertex {edge.upstream}: its function shuffles rows (a groupBy, a join "
                        "of non-broadcast inputs, a distinct, a window), so it cannot run split "
                        "by split; set key= on it (and hash its inputs by it)")
        if not hash_mode(vertex):
            if vertex.partial_of is None and plan_shuffles(df):
                raise JobDefinitionError(
                    f"vertex {vertex.id}: its function shuffles rows (a groupBy, a join of "
                    f"non-broadcast inputs, a distinct, a window), so each output row must "
                    f"keep the key columns that place it in a partition; set key= on the vertex "
                    f"(and hash its inputs by it), found no key. Output columns: {df.columns}"
                )
            return df
        self.frames.check_key(vertex, df)
        bucket = F.pmod(F.hash(*vertex.key), F.lit(vertex.parallelism))
        if positional:  # Spark partition i: partition parts[i]
            position = {p: i for i, p in enumerate(parts)}
            lookup = F.array(*[F.lit(position.get(b, -1)) for b in range(vertex.parallelism)])
            return self._only_running(df, vertex, parts, bucket).repartitionById(
                len(parts), F.element_at(lookup, bucket + 1))
        if not _ends_hash_partitioned(df, vertex.key, vertex.parallelism):
            # By id, not repartition(n, key): Spark drops that one as redundant after an
            # aggregation by the key, leaving an exchange adaptive execution may coalesce.
            if not whole:
                df = self._only_running(df, vertex, parts, bucket)
            df = df.repartitionById(vertex.parallelism, bucket)
        return df

    @staticmethod
    def _only_running(df: DataFrame, vertex: JobVertex, parts: list[int],
                      bucket: Any) -> DataFrame:
        """``df``, failing on a row of a partition not running, before the output is moved
        (a filter under the exchange: not the partition id, which Spark does not evaluate for
        one partition), so before any task writes: a partition's file, once in place, is
        whole and only its own rows (the poller may log it at once). When Spark's plan
        already ends partitioned by the key, every row is in its own partition, and only
        running ones have rows: nothing to check."""
        from pyspark.sql import functions as F

        stray = F.raise_error(F.concat(
            F.lit(f"vertex {vertex.id}: a row of partition "), bucket.cast("string"),
            F.lit(f", which is not running, came out of partitions {parts[0]}..{parts[-1]}; the "
                  f"function must keep its key columns {list(vertex.key)} unchanged, so each "
                  "output row stays in the partition of its input")))
        return df.where(F.when(bucket.isin(parts), F.lit(True)).otherwise(stray))
