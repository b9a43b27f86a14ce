"""Recovery of a resubmitted job from its replayed history (FLIP-383, steps 1, 2 and 4).

1. Vertices whose definition (fingerprint) still matches what the log recorded keep their
   decided parallelism and coordinator state (a file source's splits); a changed vertex loses
   its finished partitions, and so does everything downstream of it.
2. A partition counts as finished only if every file its event lists still exists with the
   recorded size. A partition whose output is lost is unfinished, and so is every partition
   downstream that read it: a re-run producer need not reproduce byte-identical output, so its
   old consumers could disagree with new ones.
3. From every unfinished sink partition, walk upstream to what must run (JobGraph.restart_set).
"""

from __future__ import annotations

import dataclasses
import logging

from spark_ckpt.eventlog.replay import FinishedPartition, JobHistory
from spark_ckpt.execution.job_graph import JobGraph
from spark_ckpt.storage import stat_any

__all__ = ["RecoveryPlan", "plan_recovery"]

log = logging.getLogger(__name__)


@dataclasses.dataclass
class RecoveryPlan:
    finished: dict[tuple[str, int], FinishedPartition]
    changed_vertices: list[str]
    lost: list[tuple[str, int]]  # finished partitions whose files are gone
    invalidated: list[tuple[str, int]]  # finished partitions downstream of lost or changed ones
    to_run: dict[str, list[int]]

    @property
    def reused(self) -> int:
        return len(self.finished)


def plan_recovery(graph: JobGraph, history: JobHistory, fingerprints: dict[str, str],
                  committed_sinks: set[str], *,
                  changed_inputs: set[tuple[str, int]] = frozenset()) -> RecoveryPlan:  # type: ignore[assignment]
    """Decide what to keep and what to run. ``committed_sinks``: sinks whose commit began
    (their staged files may have moved already, so they are not validated). Partitions of
    virtual sources (read in place) are always finished and not counted as reused;
    ``changed_inputs`` are source partitions whose files were replaced since they were read:
    everything downstream of them runs again."""
    live = {v.id for v in graph.live_vertices()}
    changed = [
        vid for vid in graph.ids()
        if vid in live and history.vertices.get(vid, {}).get("fingerprint") != fingerprints[vid]
    ]
    candidates = {k: f for k, f in history.finished.items() if k[0] in live}
    changed_closure = graph.downstream_closure(
        (vid, p) for vid in changed for p in range(graph.vertices[vid].parallelism)
    ) | {(vid, p) for vid in changed for p in range(graph.vertices[vid].parallelism)}

    # Step 2: validate every file of every finished partition in one batch of stat calls.
    to_check: list[tuple[tuple[str, int], str, int]] = []
    for key, fp in candidates.items():
        if key in changed_closure:
            continue
        for out in fp.outputs:
            if out.kind == "sink" and out.target in committed_sinks:
                continue
            to_check.append((key, out.path, out.size))
    sizes = stat_any(path for _, path, _ in to_check)
    lost: set[tuple[str, int]] = set()
    for (key, path, size), found in zip(to_check, sizes, strict=True):
        if found != size:
            if key not in lost:
                log.warning("Job %s: partition %s/%d lost output %s (expected %d bytes, found %s)",
                            graph.job_id, key[0], key[1], path, size,
                            "nothing" if found is None else f"{found} bytes")
            lost.add(key)
    seeds = lost | set(changed_inputs)
    invalid = (graph.downstream_closure(seeds) | changed_closure | seeds) & set(candidates)
    invalid |= _shared_with(graph, candidates, lost | invalid)
    finished = {k: f for k, f in candidates.items() if k not in lost and k not in invalid}

    # A vertex whose sinks have all begun committing needs nothing more.
    for vertex in graph.live_vertices():
        if vertex.sinks and all(s.name in committed_sinks for s in vertex.sinks):
            for p in range(vertex.parallelism):
                if (vertex.id, p) in candidates:
                    finished[(vertex.id, p)] = candidates[(vertex.id, p)]
    virtual = {(v.id, p) for v in graph.live_vertices() if graph.is_virtual(v.id)
               for p in range(v.parallelism)}
    to_run = graph.restart_set(set(finished), virtual)
    return RecoveryPlan(
        finished=finished,
        changed_vertices=[v for v in changed if v in history.vertices],
        lost=sorted(lost),
        invalidated=sorted(invalid - lost),
        to_run=to_run,
    )


def _shared_with(graph: JobGraph, candidates: dict[tuple[str, int], FinishedPartition],
                 bad: set[tuple[str, int]]) -> set[tuple[str, int]]:
    """Finished partitions that must run again because they share files with one that does.

    The partitions of a split-mode wave share its files, each of which holds the rows of
    all of them: a partition of a wave is kept only if every partition of the wave is kept
    (a crash can log some of a wave's partitions and not the others), and nothing that shares
    a file with a partition that runs again. What those read runs again too.
    """
    owners: dict[str, set[tuple[str, int]]] = {}
    for key, fp in candidates.items():
        for out in fp.outputs:
            owners.setdefault(out.path, set()).add(key)
    bad = set(bad)
    extra: set[tuple[str, int]] = set()
    while True:
        new = set()
        for key, fp in candidates.items():
            if key in bad:
                continue
            wave_lost = any((key[0], p) not in candidates or (key[0], p) in bad
                            for p in fp.shared)
            file_lost = any(owners[out.path] & bad for out in fp.outputs)
            if wave_lost or file_lost:
                new.add(key)
        if not new:
            return extra
        new |= graph.downstream_closure(new) & set(candidates)
        new -= bad
        bad |= new
        extra |= new
