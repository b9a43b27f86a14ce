"""What a pipeline's start restores from its checkpoints, and what it clears.

Run by ``start()`` on the user's thread before any of the pipeline's threads runs: choose the
checkpoint to restore (the latest whose metadata and state files are all there, or the one the
user names), abandon newer ones when restoring an older one by id, delete state files no
retained checkpoint references (a crashed run's, never a newer driver's), discard completed
checkpoints older than the retained ones, and number this run's checkpoints past every id an
older driver may still hold. Every deletion checks the fence right before it: only the owner of
the checkpoint directory deletes.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from spark_ckpt.checkpoint import CheckpointStorage, CompletedCheckpoint
from spark_ckpt.errors import CheckpointError, RecordError
from spark_ckpt.storage import Storage, join, stat_any

__all__ = ["CheckpointRestore"]

log = logging.getLogger(__name__)


class CheckpointRestore:
    def __init__(self, pipeline: str, pipeline_id: str, storage: Storage, root: str,
                 checkpoints: CheckpointStorage, *, retained: int,
                 fence: Callable[[], None]) -> None:
        self.pipeline = pipeline
        self.pipeline_id = pipeline_id
        self.storage = storage  # the pipeline's checkpoint directory (state files live there)
        self.root = root
        self.checkpoints = checkpoints
        self.retained = retained
        self._fence = fence
        self.skipped: list[int] = []  # checkpoints that could not be read this start

    def choose(self, restore_id: int | None,
               ) -> tuple[CompletedCheckpoint | None, list[CompletedCheckpoint]]:
        """The checkpoint to restore (the latest readable one, or ``restore_id``) and the
        retained ones, newest first."""
        storage = self.checkpoints
        ids = storage.completed_ids()
        if restore_id is not None and restore_id not in ids:
            raise CheckpointError(
                f"pipeline {self.pipeline}: expected checkpoint {restore_id} in {storage.uri}, "
                f"found completed checkpoints {ids or 'none'}"
            )
        usable: list[CompletedCheckpoint] = []
        self.skipped = []
        for cid in reversed(ids):
            if restore_id is not None and cid > restore_id:
                continue
            try:
                meta = storage.read_metadata(cid, self.pipeline_id or None)
                missing = [p for p, size in zip(*_state_paths(meta), strict=True)
                           if size is None]
                if missing:
                    raise CheckpointError(
                        f"checkpoint {cid} references {len(missing)} missing state file(s), "
                        f"e.g. {missing[0]}"
                    )
            except CheckpointError as exc:
                if cid == restore_id or isinstance(exc.__cause__, RecordError):
                    raise  # a hand-edited record is refused, not silently stepped over
                log.warning("Pipeline %s: checkpoint %d cannot be restored (%s); falling back "
                            "to the previous one", self.pipeline, cid, exc)
                self.skipped.append(cid)
                continue
            usable.append(CompletedCheckpoint(cid, int(meta["barrier_batch"]), meta))
            if len(usable) >= self.retained:
                break
        return (usable[0] if usable else None), usable

    def abandon_newer(self, chosen: CompletedCheckpoint) -> None:
        """Restoring ``chosen`` by id abandons every newer checkpoint (only the owner does)."""
        self._fence()
        for cid in self.checkpoints.completed_ids():
            if cid > chosen.checkpoint_id:
                log.warning("Pipeline %s: restoring checkpoint %d abandons newer checkpoint %d",
                            self.pipeline, chosen.checkpoint_id, cid)
                self.checkpoints.abandon(cid)

    def cleanup_state(self, retained: list[CompletedCheckpoint], claimed_at: Any) -> None:
        """Delete state files no retained checkpoint references (left by a crashed run)
        and older than this driver's claim (a newer driver's files are left alone)."""
        keep = {p for c in retained for p in c.state_files()}
        keep_names = {p.rsplit("/", 1)[-1] for p in keep}
        doomed = []
        for info in self.storage.list_files(join(self.root, "state"), recursive=True):
            if info.base_name not in keep_names and (
                    claimed_at is None or info.mtime is None or info.mtime < claimed_at):
                doomed.append(info.path)
        self._fence()  # right before deleting: only the owner deletes
        for path in doomed:
            try:
                self.storage.fs.delete_file(path)
            except OSError as exc:
                log.warning("Pipeline %s: could not delete orphan state file %s: %s",
                            self.pipeline, path, exc)
        if doomed:
            log.info("Pipeline %s: deleted %d state file(s) no retained checkpoint references",
                     self.pipeline, len(doomed))

    def discard_unretained(self, retained: list[CompletedCheckpoint]) -> None:
        """Discard completed checkpoints older than the oldest retained one: a driver killed
        between completing a checkpoint and subsuming the oldest leaves one behind, and its
        state files are gone with the clean-up above, so it could not be restored anyway."""
        if not retained:
            return
        storage = self.checkpoints
        oldest = min(c.checkpoint_id for c in retained)
        for cid in storage.completed_ids():
            if cid < oldest:
                try:
                    storage.discard(cid)
                except OSError as exc:
                    log.warning("Pipeline %s: could not discard unretained checkpoint %d: %s",
                                self.pipeline, cid, exc)
                else:
                    log.info("Pipeline %s: discarded checkpoint %d, older than the %d "
                             "retained", self.pipeline, cid, len(retained))

    def delete_state_files(self, paths: list[str]) -> None:
        for path in paths:
            try:
                self.storage.fs.delete_file(self.storage.fs_path(path))
            except OSError as exc:
                log.warning("Pipeline %s: could not delete state file %s: %s", self.pipeline, path,
                            exc)

    def first_checkpoint_id(self, run: int, max_concurrent: int, sinks_committed: int = 0,
                            ) -> int:
        """Past every id used here, and past those an older driver may still hold pending
        (at most its ``maxConcurrent``, not yet on storage; 16 covers an older driver that ran
        with a different setting): a stale driver that wakes and writes its checkpoint's
        metadata then never takes an id this run uses. Past ``sinks_committed`` too, the
        highest id a two-phase sink has committed: a store restored from an older copy has
        forgotten it, and a sink takes an id it holds as committed. Ids are labels: gaps cost
        nothing."""
        held = max(max_concurrent, 16) if run > 1 else 0
        return max(self.checkpoints.highest_id(), sinks_committed) + 1 + held


def _state_paths(meta: dict[str, Any]) -> tuple[list[str], list[int | None]]:
    paths = sorted({f["path"] for op in meta.get("operators", {}).values()
                    for h in op.get("handles", {}).values() for f in h.get("files", [])})
    return paths, stat_any(paths)
