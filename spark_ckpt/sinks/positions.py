"""Where each sink of a pipeline stands, read once at start, before any batch runs.

Sinks key their exactly-once commits by batch (per-batch sinks) or by checkpoint id
(two-phase sinks) and take a key they already hold as done. That is right only while the
checkpoint directory remembers everything the sinks hold: a directory restored from an older
copy, or one that lost its allocation records, would give new input to batch ids a sink already
shows, and the sink would skip it without a word. So a start reads every sink's position and:

* refuses to run when a sink holds a batch the directory never allocated
  (:func:`refuse_if_ahead`), naming the sink, both positions and what to do;
* numbers its checkpoints past the highest id any two-phase sink has committed, as well as past
  its store's (:func:`past_committed_ids`).

Runs on the user's thread inside ``start()``; nothing here is kept after it.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable
from typing import Any

from spark_ckpt.errors import SinkAheadError

__all__ = ["SinkPosition", "past_committed_ids", "read_positions", "refuse_if_ahead"]

log = logging.getLogger(__name__)

DEAD_LETTERS = "dead letters"


@dataclasses.dataclass(frozen=True)
class SinkPosition:
    """One sink's committed position: its last batch and, for a two-phase sink, its highest
    checkpoint id (None where it holds none or cannot tell)."""

    output: str
    target: str
    batch: int | None
    checkpoint: int | None = None

    def describe(self) -> str:
        where = f"checkpoint {self.checkpoint}, " if self.checkpoint is not None else ""
        return f"output {self.output} ({self.target}) has committed {where}batches through " \
               f"{self.batch}"


def _target(description: dict[str, Any]) -> str:
    path = description.get("path")
    return f"{description.get('kind', 'sink')} sink" + (f" at {path}" if path else "")


def read_positions(outputs: Iterable[Any], dead_letters: Any, sources: list[str],
                   ) -> dict[str, SinkPosition]:
    """Every output's position (per-batch sinks and two-phase sinks, whose lineage is set)
    and the dead-letter table's."""
    positions: dict[str, SinkPosition] = {}
    for output in outputs:
        # both of an output's sinks: a pipeline may have committed per batch in one run and
        # per checkpoint in another (checkpointing switched on between runs)
        batches: list[int | None] = []
        checkpoint = None
        if output.sink is not None:
            batches.append(output.sink.committed_batch())
        if output.two_phase is not None:
            checkpoint = output.two_phase.committed_checkpoint()
            batches.append(output.two_phase.committed_batch())
        known = [b for b in batches if b is not None]
        positions[output.output_name] = SinkPosition(
            output.output_name, _target((output.sink or output.two_phase).describe()),
            max(known) if known else None, checkpoint)
    positions[DEAD_LETTERS] = SinkPosition(
        DEAD_LETTERS, f"the dead-letter table at {dead_letters.path}",
        dead_letters.committed_batch(sources))
    return positions


def refuse_if_ahead(pipeline: str, directory: str, positions: dict[str, SinkPosition],
                    known_batch: int, known_checkpoint: int = 0) -> None:
    """Raise :class:`SinkAheadError` if a sink holds a batch past ``known_batch``, the last
    batch the checkpoint directory has allocated (-1: none), or if a two-phase sink that
    cannot tell its batch (the commits naming it were cleaned from its log) has committed a
    checkpoint past ``known_checkpoint``, the highest id the directory's store has used."""
    blind = [p for p in positions.values() if p.batch is None and p.checkpoint is not None
             and p.checkpoint > known_checkpoint]
    if blind:
        raise SinkAheadError(
            f"pipeline {pipeline}: expected its sinks to hold no checkpoint past what the "
            f"checkpoint directory {directory} knows (checkpoints through {known_checkpoint}), "
            "found " + "; ".join(
                f"output {p.output} ({p.target}) has committed checkpoint {p.checkpoint}, and "
                "its log no longer says which batches that held" for p in blind)
            + ". The directory was restored from an older copy, or lost its records: running "
            "on could skip new input or write some twice. Nothing ran. Restore a newer copy of "
            "the checkpoint directory, or start the pipeline on a new checkpoint directory "
            "with its sources past what the sinks hold; see 'A lost or damaged checkpoint "
            "directory' in docs/operations.md"
        )
    ahead = [p for p in positions.values() if p.batch is not None and p.batch > known_batch]
    if not ahead:
        return
    known = f"batches through {known_batch}" if known_batch >= 0 else "no batch"
    first = ahead[0]
    newest = max(p.batch for p in ahead if p.batch is not None)
    raise SinkAheadError(
        f"pipeline {pipeline}: expected its sinks to hold no batch past what the checkpoint "
        f"directory {directory} knows ({known}), found "
        + "; ".join(p.describe() for p in ahead)
        + ". The directory was restored from an older copy, or lost its records: running on "
        f"would give new input to batches {known_batch + 1}..{first.batch}, which the sink "
        "takes as already written, and skip it. Nothing ran. Restore a newer copy of the "
        f"checkpoint directory (one that knows batch {newest}), or start "
        "the pipeline on a new checkpoint directory with its sources past what the sinks hold "
        "(a file source over the files not yet written, a Delta source's starting_version); "
        "see 'A lost or damaged checkpoint directory' in docs/operations.md"
    )


def past_committed_ids(positions: dict[str, SinkPosition]) -> int:
    """The highest checkpoint id any two-phase sink has committed (0: none)."""
    return max((p.checkpoint for p in positions.values() if p.checkpoint is not None),
               default=0)
