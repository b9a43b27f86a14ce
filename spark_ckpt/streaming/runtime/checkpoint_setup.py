"""What a start wires for checkpointing: whether the pipeline checkpoints at all, where its
checkpoints are, the checkpoint it restores (and the batches to replay after its barrier), the
two-phase sinks' transactions, the coordinator, its sinks' pre-commit and its first checkpoint
id.

Threads and owners: :func:`checkpointing_wanted` and :func:`set_up_checkpointing` run on the
user's thread in ``start()``, before any of the pipeline's threads runs; they fill the
transactions and ``skip_output_through`` they are given, configure every stateful operator on
the :class:`OperatorStates` and set ``checkpoints`` on the definition, all read-only once the
threads start. The coordinator they build is then its own thread's (it owns pending and
completed checkpoints and their history); :class:`SinkPreCommit` runs on that thread at each
barrier. The restore itself (choose, abandon, clear) is :mod:`.restore`'s.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from spark_ckpt.checkpoint import (
    CheckpointConfig,
    CheckpointCoordinator,
    CheckpointStorage,
    CompletedCheckpoint,
    TaskAck,
)
from spark_ckpt.errors import CheckpointError, JobDefinitionError
from spark_ckpt.sinks.positions import past_committed_ids
from spark_ckpt.sinks.two_phase import SinkTransactions
from spark_ckpt.storage import join
from spark_ckpt.streaming.runtime.restore import CheckpointRestore
from spark_ckpt.streaming.runtime.restore_requests import read_restore_request, take_restore_request
from spark_ckpt.streaming.runtime.run_claim import absolute_path

if TYPE_CHECKING:
    from spark_ckpt.clock import Clock
    from spark_ckpt.options import Settings
    from spark_ckpt.sinks.positions import SinkPosition
    from spark_ckpt.storage import Storage
    from spark_ckpt.streaming.runtime.operators import OperatorStates
    from spark_ckpt.streaming.template.batch_run import BatchAllocation
    from spark_ckpt.streaming.template.definition import PipelineDefinition
    from spark_ckpt.streaming.template.stream_graph import StreamGraph

__all__ = ["CheckpointSetup", "SinkPreCommit", "checkpointing_wanted", "checkpoints_uri",
           "set_up_checkpointing"]

log = logging.getLogger(__name__)


def checkpoints_uri(settings: Settings, storage: Storage, root: str) -> str:
    """Where a pipeline's checkpoints are (spark.ckpt.checkpoint.dir, or inside ``root``)."""
    return absolute_path(settings.checkpoint_dir) or storage.spark_path(join(root, "checkpoints"))


def checkpointing_wanted(pipeline: str, settings: Settings, graph: StreamGraph) -> bool:
    """Whether the pipeline checkpoints (spark.ckpt.checkpoint.enabled: auto checkpoints for
    keyed state and two-phase outputs); refuses settings its template cannot run under."""
    mode = settings.checkpoint_enabled
    two_phase_only = [o.output_name for o in graph.outputs if o.sink is None]
    if mode == "false":
        if graph.stateful:
            raise JobDefinitionError(
                f"pipeline {pipeline}: keyed state "
                f"({[s.operator for s in graph.stateful]}) needs checkpoints, but "
                "spark.ckpt.checkpoint.enabled=false; set it to auto or true"
            )
        if two_phase_only:
            raise JobDefinitionError(
                f"pipeline {pipeline}: outputs {two_phase_only} commit in two phases and "
                "need checkpoints, but spark.ckpt.checkpoint.enabled=false"
            )
        return False
    if settings.checkpoint_mode == "at_least_once" and two_phase_only:
        raise JobDefinitionError(
            f"pipeline {pipeline}: outputs {two_phase_only} commit in two phases; "
            "spark.ckpt.checkpoint.mode=at_least_once has no two-phase commit (use "
            "exactly_once)"
        )
    return mode == "true" or bool(graph.stateful) or bool(two_phase_only)


class SinkPreCommit:
    """At the barrier of a checkpoint (the coordinator's thread): every two-phase sink's
    acknowledgement, or why it declined."""

    def __init__(self, transactions: Mapping[str, SinkTransactions], clock: Clock) -> None:
        self._transactions = transactions
        self._clock = clock

    def __call__(self, checkpoint_id: int, batch_id: int) -> dict[str, TaskAck | Exception]:
        out: dict[str, TaskAck | Exception] = {}
        for name, txns in self._transactions.items():
            t0 = self._clock.monotonic_s()
            try:
                state = txns.pre_commit(checkpoint_id, batch_id)
            except Exception as exc:  # noqa: BLE001 - a declined checkpoint, not a crash
                out[f"sink:{name}"] = exc
                continue
            out[f"sink:{name}"] = TaskAck(f"sink:{name}", state, {
                "sync_ms": int((self._clock.monotonic_s() - t0) * 1000)})
        return out


@dataclasses.dataclass(frozen=True)
class CheckpointSetup:
    """What :func:`set_up_checkpointing` wired."""
    storage: CheckpointStorage
    restored: CompletedCheckpoint | None
    coordinator: CheckpointCoordinator
    pending: list[BatchAllocation]  # the batches to replay after the restored barrier


def set_up_checkpointing(
        definition: PipelineDefinition, records: list[BatchAllocation],
        restore_id: int | None, *, run: int | None, claimed_at: Any,
        operators: OperatorStates, transactions: dict[str, SinkTransactions],
        skip_output_through: dict[str, int], sink_positions: dict[str, SinkPosition],
        fence: Callable[[], None], on_failure: Callable[[BaseException], None],
        on_stats: Callable[[dict[str, Any]], None]) -> CheckpointSetup:
    """Pick and restore a checkpoint, recover the two-phase sinks' transactions, build the
    coordinator; the batches to replay after the restored barrier are in ``pending``."""
    d = definition
    s = d.settings
    storage = CheckpointStorage(checkpoints_uri(s, d.storage, d.root))
    d.checkpoints = storage
    # spark-ckpt restore's request, when the code or the settings name no checkpoint
    requested = None if restore_id or s.checkpoint_restore_from else \
        read_restore_request(d.storage, d.root)
    if requested is None and (restore_id or s.checkpoint_restore_from) and \
            d.storage.exists(join(d.root, "control", "restore.json")):
        log.warning("Pipeline %s: restoring checkpoint %s as the code or settings ask; a "
                    "`spark-ckpt restore` request in control/restore.json is left for a "
                    "later start (cancel it with `spark-ckpt restore CKPT_DIR --cancel`)",
                    d.name, restore_id or s.checkpoint_restore_from)
    restore_id = restore_id or s.checkpoint_restore_from or requested or None
    restore = CheckpointRestore(d.name, d.pipeline_id, d.storage, d.root, storage,
                                retained=s.checkpoint_retained, fence=fence)
    try:
        chosen, retained = restore.choose(restore_id)
    except CheckpointError as exc:
        if requested is None:
            raise
        raise CheckpointError(
            f"{exc} (asked by `spark-ckpt restore` in {d.storage.spark_path(d.root)}"
            "/control/restore.json; ask for another id, or cancel with `spark-ckpt "
            "restore CKPT_DIR --cancel`)") from exc
    restored_ops = chosen.metadata.get("operators", {}) if chosen else {}
    for op in d.graph.stateful:  # writes nothing; may refuse the declared state
        operators.add(op, op.configure(restored_ops.get(op.operator)))
    if chosen is not None and restore_id is not None:
        restore.abandon_newer(chosen)  # only once nothing refused the restore
        if requested is not None:
            take_restore_request(d.storage, d.root, requested)
            log.info("Pipeline %s: restored checkpoint %d as `spark-ckpt restore` asked",
                     d.name, chosen.checkpoint_id)
    # a driver that lost the race to claim stops before it commits pending transactions
    # or deletes staged and state files: those may already be the newer owner's
    fence()
    if s.checkpoint_mode == "exactly_once":
        _recover_transactions(d.name, d.graph, chosen, transactions, skip_output_through,
                              sink_positions)
    replay_from = chosen.barrier_batch + 1 if chosen else 0
    pending = [a for a in records if a.batch_id >= replay_from]
    if pending and pending[0].batch_id != replay_from:
        what = f"checkpoint {chosen.checkpoint_id}" if chosen else "from the start"
        raise CheckpointError(
            f"pipeline {d.name}: restoring {what} "
            f"needs the allocation of batch {replay_from}, but the oldest kept is "
            f"{pending[0].batch_id}; it cannot be replayed"
        )
    if restore.skipped:
        log.warning("Pipeline %s: not deleting unreferenced state files this start: "
                    "checkpoint(s) %s could not be read and may only be unreachable for "
                    "now", d.name, restore.skipped)
    else:
        restore.cleanup_state(retained, claimed_at)  # checks the fence before deleting
        restore.discard_unretained(retained)
    coordinator = CheckpointCoordinator(
        d.name, d.pipeline_id, CheckpointConfig.from_settings(s), storage,
        completed=list(reversed(retained)),
        next_id=restore.first_checkpoint_id(run or 0, s.checkpoint_max_concurrent,
                                            past_committed_ids(sink_positions)),
        listeners=list(transactions.values()),
        on_failure=on_failure, on_stats=on_stats,
        delete_files=restore.delete_state_files,
        live_files=operators.live_files, fence=fence, clock=d.clock,
        pre_commit=SinkPreCommit(transactions, d.clock))
    operators.release_to(coordinator.release_files)
    if chosen is not None:
        log.info("Pipeline %s: restored checkpoint %d (barrier after batch %d); replaying "
                 "%d batch(es)", d.name, chosen.checkpoint_id, chosen.barrier_batch,
                 len(pending))
    return CheckpointSetup(storage, chosen, coordinator, pending)


def _recover_transactions(pipeline: str, graph: StreamGraph, chosen: CompletedCheckpoint | None,
                          transactions: dict[str, SinkTransactions],
                          skip_output_through: dict[str, int],
                          sink_positions: Mapping[str, SinkPosition]) -> None:
    """Every two-phase output's transactions, recovered from the restored checkpoint; an
    output already showing batches past its barrier skips them when they are replayed."""
    sinks = chosen.metadata.get("sinks", {}) if chosen else {}
    for output in graph.outputs:
        if output.two_phase is None:
            continue
        txns = SinkTransactions(output.two_phase, pipeline)
        transactions[output.output_name] = txns
        txns.recover(sinks.get(output.output_name, {}).get("pending", []))
        through = sink_positions[output.output_name].batch
        if through is not None and chosen is not None and \
                through > chosen.barrier_batch:
            skip_output_through[output.output_name] = through
            log.warning("Pipeline %s: output %s already shows batches up to %d, past "
                        "restored checkpoint %d (batch %d); replayed batches up to %d "
                        "skip it", pipeline, output.output_name, through,
                        chosen.checkpoint_id, chosen.barrier_batch, through)
        elif through is not None and chosen is None:
            skip_output_through[output.output_name] = through
        output.two_phase.cleanup_staging()
