"""Fencing: which driver owns a job id or a checkpoint directory, decided by a Delta commit.

Each driver *claims* ownership by appending one commit to a small Delta table (``fence/``)
beside what it protects. Delta writes each log entry ``_delta_log/<version>.json`` with
put-if-absent, so concurrent claims get distinct, totally ordered versions; the claim with the
highest version owns, and a driver is fenced as soon as any newer claim exists, which costs
one existence check of ``_delta_log/<own version + 1>.json``. This is a compare-and-swap
wherever Delta's own multi-writer guarantee holds: local disks, HDFS, ADLS, GCS, and S3 with
conditional writes (delta-rs's default there, and ``conditional_put=etag`` is passed:
``storage/s3.py``) or a DynamoDB lock provider. Plain ``create_exclusive`` markers, atomic on
local disks and S3 but check-then-write on the other object stores, only number the attempts;
they do not decide who may commit.

Log cleanup is off on the fence table, so the check of the next version stays valid for as
long as the table lives (one small commit per driver start). A claim's ``claimed_ms`` is read
from the injected :class:`~spark_ckpt.clock.Clock`.
"""

from __future__ import annotations

import json
import logging
import socket
import uuid
from typing import Any

import pyarrow as pa

from spark_ckpt.clock import Clock, SystemClock
from spark_ckpt.errors import JobFencedError
from spark_ckpt.formats import load_record
from spark_ckpt.sparkapi import spark_api
from spark_ckpt.storage import Storage, delta_options, join

__all__ = ["Fence", "client_session", "interrupt_earlier_clients"]

log = logging.getLogger(__name__)

_SCHEMA = pa.schema([("claim_id", pa.string()), ("owner", pa.string()),
                     ("host", pa.string()), ("claimed_ms", pa.int64())])
_CONFIG = {"delta.enableExpiredLogCleanup": "false", "delta.appendOnly": "true"}
_CLAIM_KEY = "spark_ckpt.claim"
_CLAIM_TRIES = 5  # a claim that conflicted with a concurrent commit (nothing committed)


class Fence:
    """One driver's claim on ``<directory>/fence``.

    Thread ownership: :meth:`claim` runs once on the driver's main thread before any other
    thread starts; afterwards :meth:`is_fenced` may be called from any thread (it only
    reads).
    """

    def __init__(self, storage: Storage, directory: str, what: str, *,
                 clock: Clock | None = None) -> None:
        self._storage = storage
        self._clock = clock or SystemClock()
        self._path = join(directory, "fence")
        self._uri = storage.spark_path(self._path)
        self._what = what
        self.version: int | None = None

    def claim(self, owner: str) -> int:
        """Append this driver's claim; return its version (the driver's epoch)."""
        from deltalake import CommitProperties, DeltaTable, write_deltalake
        from deltalake.exceptions import CommitFailedError

        options = delta_options(self._uri)  # S3: conditional commits (storage/s3.py)
        if not DeltaTable.is_deltatable(self._uri, storage_options=options):
            try:
                DeltaTable.create(self._uri, _SCHEMA, mode="ignore", name="spark_ckpt_fence",
                                  configuration=_CONFIG, storage_options=options)
            except Exception:  # another driver created it at the same moment
                if not DeltaTable.is_deltatable(self._uri, storage_options=options):
                    raise
        claim_id = uuid.uuid4().hex
        row = pa.table({"claim_id": [claim_id], "owner": [owner],
                        "host": [socket.gethostname()],
                        "claimed_ms": [self._clock.now_ms()]}, schema=_SCHEMA)
        for attempt in range(_CLAIM_TRIES):
            try:
                write_deltalake(self._uri, row, mode="append", storage_options=options,
                                commit_properties=CommitProperties(custom_metadata={
                                    _CLAIM_KEY: claim_id}))
                break
            except CommitFailedError:
                # not committed: a driver racing to create the table committed its metadata
                # as this claim read the table (seen on S3 with six claims at once); the
                # same claim again, which _find then locates by its id
                if attempt == _CLAIM_TRIES - 1:
                    raise
                log.info("%s: %s's claim conflicted with a concurrent commit; claiming again",
                         self._what, owner)
        newest = DeltaTable(self._uri, storage_options=options).version()
        self.version = self._find(claim_id, newest)
        log.info("%s: %s claimed ownership (fence version %d)", self._what, owner,
                 self.version)
        return self.version

    def _find(self, claim_id: str, newest: int) -> int:
        """The version of the commit carrying ``claim_id`` (read from the log itself)."""
        for version in range(newest, -1, -1):
            for line in self._commit(version).splitlines():
                info = json.loads(line).get("commitInfo") if line.strip() else None
                if info is not None and info.get(_CLAIM_KEY) == claim_id:
                    return version
        raise JobFencedError(f"{self._what}: this driver's claim {claim_id} is not in the "
                             f"fence log at {self._uri}; expected it after committing it")

    def _commit(self, version: int) -> str:
        path = join(self._path, "_delta_log", f"{version:020d}.json")
        return self._storage.read_bytes(path).decode("utf-8")

    def is_fenced(self) -> bool:
        """Whether a newer claim exists (always False before :meth:`claim`)."""
        if self.version is None:
            return False
        return self._storage.exists(join(self._path, "_delta_log",
                                         f"{self.version + 1:020d}.json"))


def client_session(spark: Any, tag: str) -> dict[str, str]:
    """The fields a driver's run or attempt marker carries on Spark Connect: the session its
    operations run in, the user the server knows it as, and ``tag``, the tag every Spark
    operation of this run or attempt carries: the next driver interrupts what this one leaves
    running, and nothing else of that session."""
    api = spark_api(spark)
    session = api.session_id()
    if not session:
        return {}
    return {"connect_session": session, "connect_user": api.session_user() or "",
            "connect_tag": tag}


def interrupt_earlier_clients(spark: Any, storage: Storage, markers: list[str], kind: str,
                              who: str) -> int:
    """Interrupt the operations earlier drivers left running on a Spark Connect server.

    A classic driver's Spark jobs die with its JVM. A Spark Connect client's do not: the server
    runs a killed client's operation on (until its detach timeout) and a fenced client's for as
    long as it keeps submitting. Their output never commits (staging is per try and commits are
    fenced), but they hold the server's cores. ``markers`` are the earlier drivers' run or
    attempt records (``kind``); each names its Connect session and the tag of its operations
    (:func:`client_session`): only those are interrupted, whatever else that session (a
    notebook's) runs now. Returns how many; a failure to interrupt only costs time."""
    api = spark_api(spark)
    own = api.session_id()
    if own is None:
        return 0
    interrupted = 0
    for path in markers:
        try:
            record = load_record(storage.read_bytes(path), kind, (1,))
        except Exception:  # noqa: BLE001 - an unreadable marker names no session
            continue
        session, tag = record.get("connect_session"), record.get("connect_tag")
        if not session or not tag or session == own:
            continue
        try:
            ids = api.interrupt_session(str(session), str(tag),
                                        str(record.get("connect_user") or "") or None)
        except Exception as exc:  # noqa: BLE001 - costs the server's cores, not correctness
            log.warning("%s: could not interrupt what an earlier driver left running in "
                        "Spark Connect session %s: %s", who, session, exc)
            continue
        if ids:
            log.warning("%s: interrupted %d operation(s) an earlier driver left running in "
                        "Spark Connect session %s (tag %s)", who, len(ids), session, tag)
        interrupted += len(ids)
    return interrupted
