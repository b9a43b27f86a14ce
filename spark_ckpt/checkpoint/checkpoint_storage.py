"""Checkpoint storage on any URI pyarrow understands.

Layout under the checkpoint storage root (``spark.ckpt.checkpoint.dir``, by default
``<checkpoint directory>/checkpoints``)::

    chk-<id>/_metadata.json   a completed checkpoint: written last, created if absent (a
                              local link, a conditional PUT on S3); its presence is completion
    history/<id>.json         statistics of the newest checkpoints, completed or aborted
                              (``spark.ckpt.checkpoint.historyRetained``, default 100)

Metadata is a versioned JSON record (kind ``checkpoint-metadata``); an unknown version, a record
of another pipeline or unreadable bytes are rejected with a message, and restore falls back to
the previous checkpoint. Format 2 records the state files inside the checkpoint directory (the
directory holding the storage root) relative to it, and that directory as ``root`` (where it was
written); format 1 recorded absolute paths and is still read (checkpoint/locations.py). Callers
always see absolute paths.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from spark_ckpt.checkpoint.locations import moved_roots, relativized, resolve_files
from spark_ckpt.errors import CheckpointError, FormatVersionError
from spark_ckpt.faults import fault_point
from spark_ckpt.formats import dump_record, load_record
from spark_ckpt.storage import Storage, join

__all__ = ["METADATA_VERSION", "CheckpointStorage"]

log = logging.getLogger(__name__)

METADATA_VERSION = 2  # 2: state files inside the checkpoint directory relative to it
READ_VERSIONS = (1, 2)


class CheckpointStorage:
    def __init__(self, uri: str) -> None:
        self.store = Storage(uri)
        self.root = self.store.root
        self.uri = uri
        # the checkpoint directory: recorded state file paths are relative to it
        self.base = self.store.spark_path(self.root.rsplit("/", 1)[0] or "/")

    def directory(self, checkpoint_id: int) -> str:
        """The directory of checkpoint ``checkpoint_id`` (it holds its ``_metadata.json``)."""
        return join(self.root, f"chk-{checkpoint_id:08d}")

    def metadata_path(self, checkpoint_id: int) -> str:
        return join(self.directory(checkpoint_id), "_metadata.json")

    def write_metadata(self, checkpoint_id: int, body: dict[str, Any]) -> int:
        """Write a completed checkpoint's metadata atomically; return its size in bytes."""
        fault_point("checkpoint.metadata")
        # in memory, paths stay absolute: a copy
        record = relativized({**body, "root": self.base}, self.base)
        data = dump_record("checkpoint-metadata", METADATA_VERSION, record)
        path = self.metadata_path(checkpoint_id)
        # atomic on local disks (link) and on S3 (a conditional PUT)
        if not self.store.create_exclusive(path, data):
            raise CheckpointError(
                f"checkpoint {checkpoint_id}: expected to create {path}, found it already "
                "written (another driver completed this checkpoint id)"
            )
        return len(data)

    def read_metadata(self, checkpoint_id: int, pipeline_id: str | None = None, *,
                      abandoned: bool = False) -> dict[str, Any]:
        """A completed checkpoint's metadata (``abandoned``: an abandoned one's, to inspect),
        its state files by absolute path, wherever the directory was written."""
        path = self.metadata_path(checkpoint_id)
        if abandoned:
            path = path.replace("_metadata.json", "_metadata.abandoned.json")
        try:
            raw = self.store.read_bytes(path)
        except OSError as exc:
            raise CheckpointError(f"checkpoint {checkpoint_id}: cannot read {path}: {exc}") \
                from exc
        try:
            record = load_record(raw, "checkpoint-metadata", READ_VERSIONS)
        except FormatVersionError as exc:
            raise CheckpointError(f"checkpoint {checkpoint_id} at {path}: {exc}") from exc
        if int(record.get("checkpoint_id", -1)) != checkpoint_id:
            raise CheckpointError(
                f"checkpoint {checkpoint_id} at {path}: expected checkpoint_id {checkpoint_id}, "
                f"found {record.get('checkpoint_id')!r}"
            )
        if pipeline_id is not None and record.get("pipeline_id") != pipeline_id:
            raise CheckpointError(
                f"checkpoint {checkpoint_id} at {path} belongs to pipeline id "
                f"{record.get('pipeline_id')!r}, not {pipeline_id!r}"
            )
        written_in = record.get("root")
        moved = {written_in: self.base} if isinstance(written_in, str) and \
            written_in.rstrip("/") != self.base.rstrip("/") else {}
        if record["format_version"] == 1:
            moved = moved_roots(record, self.base)
        if moved:
            log.info("Checkpoint %d: written in %s, its state files are read from %s",
                     checkpoint_id, ", ".join(sorted(moved)), self.base)
        resolve_files(record, self.base, moved)
        return record

    def completed_ids(self) -> list[int]:
        ids = []
        for info in self.store.fs.get_file_info(_selector(self.root)):
            name = info.base_name
            if name.startswith("chk-") and name[4:].isdigit() and \
                    self.store.exists(self.metadata_path(int(name[4:]))):
                ids.append(int(name[4:]))
        return sorted(ids)

    def highest_id(self) -> int:
        """The highest checkpoint id ever used here (completed, aborted or half-written)."""
        ids = [0]
        for info in self.store.fs.get_file_info(_selector(self.root)):
            if info.base_name.startswith("chk-") and info.base_name[4:].isdigit():
                ids.append(int(info.base_name[4:]))
        for info in self.store.list_files(join(self.root, "history"), recursive=False):
            stem = info.base_name.removesuffix(".json")
            if stem.isdigit():
                ids.append(int(stem))
        return max(ids)

    def abandon(self, checkpoint_id: int) -> None:
        """Make a completed checkpoint no longer restorable (a restore chose an older one and
        started a new history from it); its files stay for inspection."""
        path = self.metadata_path(checkpoint_id)
        if self.store.exists(path):
            self.store.move(path, path.replace("_metadata.json", "_metadata.abandoned.json"))

    def discard(self, checkpoint_id: int) -> None:
        self.store.delete_dir(self.directory(checkpoint_id))

    def write_stats(self, checkpoint_id: int, stats: dict[str, Any]) -> None:
        try:
            self.store.write_atomic(join(self.root, "history", f"{checkpoint_id:08d}.json"),
                                    dump_record("checkpoint-stats", 1, stats))
        except OSError as exc:  # statistics never fail a checkpoint
            log.warning("Checkpoint %d: could not write statistics: %s", checkpoint_id, exc)

    def prune_history(self, newest_id: int, keep: int) -> int:
        """Delete statistics records of checkpoints older than the ``keep`` newest ids up to
        ``newest_id``; return how many went. A failure is logged, never raised."""
        doomed = []
        try:
            for info in self.store.list_files(join(self.root, "history"), recursive=False):
                stem = info.base_name.removesuffix(".json")
                if stem.isdigit() and int(stem) <= newest_id - keep:
                    doomed.append(info.path)
            for path in doomed:
                self.store.fs.delete_file(path)
        except OSError as exc:
            log.warning("Could not prune checkpoint statistics below %d: %s",
                        newest_id - keep + 1, exc)
        return len(doomed)

    def history(self) -> list[dict[str, Any]]:
        out = []
        for info in sorted(self.store.list_files(join(self.root, "history"), recursive=False),
                           key=lambda i: i.base_name):
            try:
                out.append(load_record(self.store.read_bytes(info.path), "checkpoint-stats",
                                       (1,)))
            except (OSError, FormatVersionError, json.JSONDecodeError) as exc:
                log.warning("Skipping unreadable checkpoint statistics %s: %s", info.path, exc)
        return out


def _selector(root: str) -> Any:
    import pyarrow.fs as pafs

    return pafs.FileSelector(root, allow_not_found=True, recursive=False)
