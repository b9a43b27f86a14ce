"""Which run units a vertex runs, and how: pure decisions over the graph and what is finished.

A vertex with a key runs in *hash mode* (partition *j*: the rows with ``pmod(hash(key),
parallelism) == j``), one run unit for every partition it runs; one without runs in *split
mode*, in *waves* (batch.cuts sizes them), each a run unit over exactly its inputs' files. A
keyed run of a few partitions may be written *positionally* (:func:`writes_positionally`). No
state: every function answers from its arguments.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from spark_ckpt.batch.cuts import wave_size, waves_of
from spark_ckpt.errors import JobDefinitionError

if TYPE_CHECKING:
    from spark_ckpt.eventlog.replay import FinishedPartition
    from spark_ckpt.execution.job_graph import JobGraph, JobVertex
    from spark_ckpt.options import Settings

__all__ = ["check_reads", "hash_mode", "partition_bytes", "reads_exchanges", "run_units",
           "waves", "writes_positionally"]

# A keyed vertex run for some of its partitions (a re-run, a recovery) can write through
# len(parts) Spark partitions, Spark partition i holding partition parts[i], instead of through
# its parallelism, where every partition not running is an empty task: when shuffling the
# output once more costs less than the empty tasks it saves. On the orders report (2 cores)
# 45 empty tasks took 0.4 s of wall time (9 ms each) and shuffling 8 MB of Parquet output
# (5 partitions) once more 0.2 s (6 ms per 256 KiB): this many output bytes per empty task
# saved leans, conservatively, towards the wide stage (sizes are compressed Parquet bytes; the
# shuffle moves more).
_EMPTY_TASK_BYTES = 256 * 1024


def hash_mode(vertex: JobVertex) -> bool:
    """True when ``vertex`` has a key: partition *j* is the rows hashing to *j*."""
    return bool(vertex.key)


def check_reads(graph: JobGraph, vertex: JobVertex) -> None:
    """Fail when ``vertex`` reads an input forward that its partitions cannot read
    partition by partition."""
    if not hash_mode(vertex):
        for edge in vertex.inputs:
            upstream = graph.vertices[edge.upstream]
            if edge.kind == "forward" and upstream.durable and not upstream.is_source \
                    and not hash_mode(upstream):
                raise JobDefinitionError(
                    f"vertex {vertex.id} reads {upstream.id} forward, but {upstream.id} has "
                    f"no key, so its partitions share files; read it with "
                    f"{upstream.id}.by(columns), or mark {upstream.id} durable=False"
                )
    for edge in vertex.inputs:
        upstream = graph.vertices[edge.upstream]
        if edge.kind == "forward" and hash_mode(vertex) and \
                tuple(upstream.key) != tuple(vertex.key):
            raise JobDefinitionError(
                f"vertex {vertex.id} (key {list(vertex.key)}) reads {upstream.id} forward, "
                f"but {upstream.id}'s partitions are not split by that key (its key: "
                f"{list(upstream.key) or 'none'}); read it with "
                f"{upstream.id}.by({', '.join(map(repr, vertex.key))})"
            )


def run_units(vertex: JobVertex, parts: list[int], settings: Settings) -> list[list[int]]:
    """The run units (one Spark job each) that run ``parts`` of ``vertex``: all of them in
    one (hash mode), or in waves (split mode); none for no parts."""
    if not parts:
        return []
    return [parts] if hash_mode(vertex) else waves(vertex, parts, settings)


# Splits a map-side partial vertex runs per Spark job (a union of as many scans).
MAP_SIDE_UNIT = 256


def waves(vertex: JobVertex, parts: list[int], settings: Settings) -> list[list[int]]:
    """Split mode's waves over ``parts``."""
    # A durable exchange's first waves are small: the join after it starts only when
    # every wave is done, so what a job killed early keeps is its finished waves
    per_wave = settings.batch_partitions_per_wave
    if vertex.map_side and per_wave == 0:
        # each task's partials are durable as it commits: nothing is kept per wave, and one
        # job keeps both cores busy (waves left a wave's tail idle while the next one's
        # broadcasts queued behind it: 1.16x plain Spark on shape (f), one job 1.0x)
        return waves_of(parts, MAP_SIDE_UNIT, ramp=False)
    fine = bool(vertex.partial_of or vertex.exchange_of)
    return waves_of(parts, wave_size(vertex.parallelism, per_wave, fine=fine),
                    ramp=per_wave == 0 and fine)



def reads_exchanges(graph: JobGraph, vertex: JobVertex) -> bool:
    """True when ``vertex`` reads durable exchanges: through catalog tables made per
    attempt (and dropped, uncaching what reads them, at the next attempt's start), so
    its plan never matches a killed client's; and it shuffles nothing to keep."""
    return any(graph.vertices[e.upstream].bucket_for == vertex.id
               for e in vertex.inputs if e.kind == "hash")


def writes_positionally(graph: JobGraph, vertex: JobVertex, parts: list[int],
                        finished: dict[tuple[str, int], FinishedPartition],
                        planning: str | None) -> bool:
    """True when a run of ``parts`` (fewer than all) of keyed ``vertex`` writes through
    ``len(parts)`` Spark partitions: partition ``parts[i]`` in Spark partition *i* (a row
    whose key is in no running partition fails the run before it is moved). A join of its
    hash inputs shuffles them as Spark plans any join (its shuffle partitions, coalesced by
    adaptive execution: Spark would widen a co-partitioning ``repartition(len(parts))`` to
    its shuffle partitions anyway), and the output is shuffled once more by position,
    instead of every partition not running being an empty task of stages as wide as the
    vertex. Chosen when that extra shuffle, estimated from the sizes of the vertex's
    finished partitions, costs less than the empty tasks (:data:`_EMPTY_TASK_BYTES` each).
    Never while planning (``planning`` not None), nor for a vertex reading durable exchanges
    (its bucketed scans are as wide as the vertex anyway)."""
    n = vertex.parallelism
    if not hash_mode(vertex) or not parts or len(parts) >= n or \
            planning is not None or reads_exchanges(graph, vertex):
        return False
    sizes = [partition_bytes(f) for (v, _), f in list(finished.items()) if v == vertex.id]
    if not sizes:
        return False
    estimate = len(parts) * sum(sizes) / len(sizes)
    return estimate <= (n - len(parts)) * _EMPTY_TASK_BYTES


def partition_bytes(finished: FinishedPartition) -> int:
    """The bytes of a finished partition's output: its largest write's files (every write
    holds the same rows)."""
    by_write: dict[tuple[str, str], int] = {}
    for o in finished.outputs:
        by_write[(o.kind, o.target)] = by_write.get((o.kind, o.target), 0) + o.size
    return max(by_write.values(), default=0)
