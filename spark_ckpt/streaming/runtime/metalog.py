"""Per-batch metadata logs in the checkpoint directory, in the manner of Spark's offset log.

One file per batch, ``<dir>/<batch id, 12 digits>.json``, a versioned JSON record created
*if absent*: only one driver can record a batch, so a second driver on the same checkpoint
directory fails at its first allocation instead of writing the same batch twice. Logs kept here:

* ``allocations/``: what each batch reads (ReceiverTracker), written before the batch runs;
* ``commits/``: written after every output of the batch has committed;
* ``driver/``: the driver's state after a batch was submitted (step 5 of seed 002).

Threads and owners: each log has one writer of new records: ``allocations/`` and ``driver/``
the pipeline loop's thread (the generator), ``commits/`` the JobScheduler's thread; ``start()``
sets torn records aside before any thread runs. The loop's thread purges old records of all
three after a commit, so ``commits/`` is written from two threads: ``_lock`` serializes every
change to a log's directory (record, replace, purge, set aside). Reads take no lock: a record
appears whole.
"""

from __future__ import annotations

import json
import logging
import threading
import uuid
from collections.abc import Callable
from typing import Any

from spark_ckpt.errors import FormatVersionError, RecordError
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
        self._lock = threading.Lock()  # serializes changes to the directory (see above)
        storage.makedirs(directory)

    def path(self, batch_id: int) -> str:
        return join(self.directory, f"{batch_id:012d}.json")

    def add(self, batch_id: int, body: dict[str, Any]) -> bool:
        """Record ``batch_id``; False if a record for it already exists (left untouched)."""
        data = dump_record(self.kind, VERSION, {"batch_id": batch_id, **body})
        with self._lock:
            created: bool = self.storage.create_exclusive(self.path(batch_id), data)
        return created

    def put(self, batch_id: int, body: dict[str, Any]) -> None:
        """Record ``batch_id``, replacing an earlier record (driver state only)."""
        data = dump_record(self.kind, VERSION, {"batch_id": batch_id, **body})
        with self._lock:
            self.storage.write_atomic(self.path(batch_id), data)

    def get(self, batch_id: int) -> dict[str, Any] | None:
        path = self.path(batch_id)
        if not self.storage.exists(path):
            return None
        try:
            record = load_record(self.storage.read_bytes(path), self.kind, (VERSION,),
                                 where=self.storage.spark_path(path))
        except RecordError:
            raise
        except FormatVersionError as exc:  # name the file
            raise RecordError(f"{self.storage.spark_path(path)}: {exc}") from exc
        found = record.get("batch_id")
        if found != batch_id:
            raise RecordError(
                f"{self.storage.spark_path(path)}: {self.kind} record field batch_id: expected "
                f"{batch_id} (the file's name), found {found!r}; correct the field or restore "
                "the file (nothing was run from it)"
            )
        return record

    def set_aside_torn_tail(self, may_drop: Callable[[int], bool],
                            fence: Callable[[], None] = lambda: None) -> int | None:
        """Move the newest record aside (to ``torn/``) if it is torn, that is its bytes do not
        parse (a crash mid-write on a store that publishes bytes as they come; local renames
        and object-store PUTs never tear), and ``may_drop(batch_id)`` says nothing came of it;
        return its batch id. Raise :class:`RecordError` for a torn record something came of.
        ``fence`` raises if this driver no longer owns the checkpoint directory; it is called
        right before the move, which happens only if the bytes are still the torn ones."""
        ids = self.batch_ids()
        if not ids:
            return None
        newest, path = ids[-1], self.path(ids[-1])
        raw = self.storage.read_bytes(path)
        try:
            json.loads(raw)
            return None
        except (ValueError, UnicodeDecodeError):
            pass
        where = self.storage.spark_path(path)
        if not may_drop(newest):
            raise RecordError(
                f"{where}: expected a whole {self.kind} record, found {len(raw)} bytes that do "
                f"not parse (torn), and batch {newest} has run past it, so it cannot be "
                "dropped; restore the file from a copy (nothing was run from it)"
            )
        aside = join(self.directory, "torn", f"{newest:012d}.{uuid.uuid4().hex[:8]}.json")
        with self._lock:
            fence()  # a driver that lost the claim race must not move the owner's record ...
            if self.storage.read_bytes(path) != raw:  # ... nor one written whole since then
                raise RecordError(f"{where}: changed while this driver was setting it aside "
                                  "as torn; another driver is writing this checkpoint directory")
            self.storage.move(path, aside)
        log.warning("%s: the newest %s record (batch %d) was torn by a crash mid-write "
                    "(%d bytes that do not parse); nothing came of it, so it was moved to %s "
                    "and the batch is recorded again", where, self.kind, newest, len(raw),
                    self.storage.spark_path(aside))
        return newest

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
        with self._lock:
            for batch_id in self.batch_ids():
                if batch_id >= below:
                    break
                self.storage.fs.delete_file(self.path(batch_id))
                gone += 1
        return gone
