"""Per-batch metadata logs in the checkpoint directory, in the manner of Spark's offset log.

One file per batch, ``<dir>/<batch id, 12 digits>.json``, a versioned JSON record created
*if absent*: only one driver can record a batch, so a second driver on the same checkpoint
directory fails at its first allocation instead of writing the same batch twice. Logs kept here:

* ``allocations/``: what each batch reads (ReceiverTracker), written before the batch runs;
* ``commits/``: written after every output of the batch has committed;
* ``driver/``: the driver's state after a batch was submitted (step 5 of seed 002).
"""

from __future__ import annotations

import logging
from typing import Any

from spark_ckpt.errors import RecordError
from spark_ckpt.formats import dump_record, load_record
from spark_ckpt.storage import Storage, join

__all__ = ["MetadataLog"]

log = logging.getLogger(__name__)

VERSION = 1


class MetadataLog:
    def __init__(self, storage: Storage, directory: str, kind: str) -> None:
        self.storage = storage
        self.directory = directory
        self.kind = kind
        storage.makedirs(directory)

    def path(self, batch_id: int) -> str:
        return join(self.directory, f"{batch_id:012d}.json")

    def add(self, batch_id: int, body: dict[str, Any]) -> bool:
        """Record ``batch_id``; False if a record for it already exists (left untouched)."""
        data = dump_record(self.kind, VERSION, {"batch_id": batch_id, **body})
        return self.storage.create_exclusive(self.path(batch_id), data)

    def put(self, batch_id: int, body: dict[str, Any]) -> None:
        """Record ``batch_id``, replacing an earlier record (driver state only)."""
        data = dump_record(self.kind, VERSION, {"batch_id": batch_id, **body})
        self.storage.write_atomic(self.path(batch_id), data)

    def get(self, batch_id: int) -> dict[str, Any] | None:
        path = self.path(batch_id)
        if not self.storage.exists(path):
            return None
        record = load_record(self.storage.read_bytes(path), self.kind, (VERSION,),
                             where=self.storage.spark_path(path))
        found = record.get("batch_id")
        if found != batch_id:
            raise RecordError(
                f"{self.storage.spark_path(path)}: {self.kind} record field batch_id: expected "
                f"{batch_id} (the file's name), found {found!r}; correct the field or restore "
                "the file (nothing was run from it)"
            )
        return record

    def batch_ids(self) -> list[int]:
        ids = []
        for info in self.storage.list_files(self.directory, recursive=False):
            name = info.base_name
            if name.endswith(".json") and len(name) == 17 and name[:12].isdigit():
                ids.append(int(name[:12]))
        return sorted(ids)

    def purge(self, below: int) -> int:
        """Delete records of batches ``< below``; return how many went."""
        gone = 0
        for batch_id in self.batch_ids():
            if batch_id >= below:
                break
            self.storage.fs.delete_file(self.path(batch_id))
            gone += 1
        return gone
