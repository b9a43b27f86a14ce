"""Where a pipeline's outputs stand when it starts, checked against its checkpoint directory.

:func:`read_output_positions` reads every sink's committed position (``sinks/positions.py``)
and refuses a directory the sinks are ahead of (:class:`SinkAheadError`: nothing runs);
:func:`refuse_staged_two_phase` refuses a start without checkpoints over batches a run with
checkpoints only staged for a two-phase commit.

Threads and owners: both run on the user's thread in ``start()``, before any of the
pipeline's threads runs; the positions they return are read-only afterwards (the checkpoint
set-up takes the two-phase outputs' batches and checkpoint ids from them).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

from spark_ckpt.checkpoint import CheckpointStorage
from spark_ckpt.errors import CheckpointError
from spark_ckpt.sinks.positions import SinkPosition, read_positions, refuse_if_ahead

if TYPE_CHECKING:
    from spark_ckpt.streaming.template.definition import PipelineDefinition

__all__ = ["read_output_positions", "refuse_staged_two_phase"]


def read_output_positions(definition: PipelineDefinition, *, sources: Sequence[str],
                          dead_letters: Any, known_batches: Callable[[], Iterable[int]],
                          claimed_at: Any, checkpoints_uri: str,
                          fence: Callable[[], None]) -> dict[str, SinkPosition]:
    """Every sink's position (the two-phase sinks told the lineage and when this run claimed
    the directory); refuses a directory they are ahead of (nothing runs). ``known_batches``:
    the batches the directory has records of (listed once the fence is checked)."""
    # a driver that lost the race to claim stops here: reading a Parquet two-phase sink's
    # position finishes a commit a crash left half done
    fence()
    d = definition
    for output in d.graph.outputs:
        if output.two_phase is not None:
            output.two_phase.lineage = d.lineage
            output.two_phase.claimed_at = claimed_at
    known = max(known_batches(), default=-1)
    positions = read_positions(d.graph.outputs, dead_letters, list(sources))
    refuse_if_ahead(d.name, d.storage.spark_path(d.root), positions, known,
                    CheckpointStorage(checkpoints_uri).highest_id())
    return positions


def refuse_staged_two_phase(pipeline: str, outputs: Iterable[Any],
                            positions: dict[str, SinkPosition],
                            kept: dict[int, dict[str, Any] | None],
                            checkpoints_uri: str) -> None:
    """A start without checkpoints takes a batch with a commit record as done. A run with
    checkpoints writes that record once the batch's output is *staged* for a two-phase
    commit, which only a completed checkpoint makes visible: switching checkpoints off
    after such a run would skip those batches. Refused, naming them, unless every output
    already shows them. ``kept``: the kept commit records by batch."""
    outputs = list(outputs)
    shown = [p.batch if p.batch is not None else -1 for name, p in positions.items()
             if any(o.output_name == name and o.two_phase is not None for o in outputs)]
    if not shown:
        return
    visible = min(shown)
    # records written before they said how their output was committed: staged if this
    # directory ever checkpointed
    ever = CheckpointStorage(checkpoints_uri).highest_id() > 0
    staged = sorted(b for b, record in kept.items() if record and b > visible and (
        record.get("two_phase") or ("two_phase" not in record and ever)))
    if staged:
        raise CheckpointError(
            f"pipeline {pipeline}: expected every batch with a commit record to be "
            f"visible in its outputs, found batches {staged[0]}..{staged[-1]} staged by a "
            "run with checkpoints for a two-phase commit that no completed checkpoint made "
            f"visible (the outputs show batches through {visible}). Without checkpoints "
            "(spark.ckpt.checkpoint.enabled=false, or auto with no keyed state) they would "
            "count as done and their rows never appear. Nothing ran. Start once with "
            "spark.ckpt.checkpoint.enabled=true (the restore commits or replays them), "
            "then switch it off"
        )
