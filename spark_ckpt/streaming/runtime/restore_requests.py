"""Restore requests: ``control/restore.json`` asks the next start to restore a retained
checkpoint by id (``spark-ckpt restore`` writes it; the start that restores it deletes it)."""

from __future__ import annotations

from spark_ckpt.formats import dump_record, load_record
from spark_ckpt.storage import Storage, join

RESTORE_REQUEST = ("control", "restore.json")


# -- restore requests --------------------------------------------------------------------------
def restore_request_path(root: str) -> str:
    return join(root, *RESTORE_REQUEST)


def request_restore(storage: Storage, root: str, checkpoint_id: int, now_ms: int) -> None:
    """Ask the next start of the pipeline in ``root`` to restore ``checkpoint_id`` (replaces
    an earlier request that no start took yet)."""
    storage.makedirs(join(root, RESTORE_REQUEST[0]))
    storage.write_atomic(restore_request_path(root), dump_record(
        "restore-request", 1, {"checkpoint_id": int(checkpoint_id), "requested_ms": now_ms}))


def read_restore_request(storage: Storage, root: str) -> int | None:
    """The checkpoint id a ``spark-ckpt restore`` asked the next start for, if any."""
    path = restore_request_path(root)
    if not storage.exists(path):
        return None
    record = load_record(storage.read_bytes(path), "restore-request", (1,), where=path)
    return int(record["checkpoint_id"])


def take_restore_request(storage: Storage, root: str, checkpoint_id: int) -> None:
    """The start restored what was asked (and abandoned the newer checkpoints): done, unless
    the request was replaced by another meanwhile (that one is for the next start)."""
    try:
        if read_restore_request(storage, root) != checkpoint_id:
            return
    except (OSError, ValueError):
        return
    storage.delete_file(restore_request_path(root))


def cancel_restore_request(storage: Storage, root: str) -> int | None:
    """Withdraw a waiting request (even one that does not read); the id it asked for."""
    try:
        asked = read_restore_request(storage, root)
    except (OSError, ValueError):
        asked = -1  # unreadable: withdrawn all the same
    if storage.exists(restore_request_path(root)):
        storage.delete_file(restore_request_path(root))
    return asked
