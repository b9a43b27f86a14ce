"""Stopping a running pipeline from outside its driver with a final checkpoint
(``spark-ckpt stop CKPT_DIR``, as Flink's ``stop --savepointPath``).

The request and its answer are files in the checkpoint directory::

    CKPT/control/stop-<request id>.request.json   written by the client (create-if-absent)
    CKPT/control/stop-<request id>.answer.json    written by a driver (whole or not at all)

A request names the run it is for: the newest run when it was made (``CKPT/runs/``). The
driver of that run looks for requests on its pipeline loop's clock
(``spark.ckpt.stop.pollIntervalMs``); when it finds one it stops gracefully (finishes the
running batch, takes a final checkpoint, commits its two-phase sinks) and answers with the
checkpoint's id. A request for an older run was made for a driver that is gone (killed, or
stopped before it looked): whichever driver runs next answers it ``abandoned`` and keeps
running: a stale request never stops a later run.

Under a kill at any moment: before the driver took the request, no answer comes from that
run and the next driver answers ``abandoned``; after it took it and before the answer, the
next driver answers it ``abandoned`` too (the final checkpoint, if it completed, is a
completed checkpoint like any other and the next run restores from it); after the answer,
the client has the checkpoint id. In no case does a batch commit twice or a row go missing:
the stop only runs the pipeline's own graceful-stop path.

Storage: the request and the answer are each created with :meth:`Storage.create_exclusive`
(a reader sees nothing or all of it; the first answer stands: atomic on a local disk, checked
then written on an object store, where two drivers answering one request within the same
instant could both write).
"""

from __future__ import annotations

import dataclasses
import logging
import uuid
from typing import TYPE_CHECKING, Any

from spark_ckpt.errors import FormatVersionError, InternalError
from spark_ckpt.formats import dump_record, load_record
from spark_ckpt.storage import join

if TYPE_CHECKING:
    from spark_ckpt.storage import Storage

__all__ = ["StopAnswer", "StopControl", "StopRequest", "latest_run", "read_answer",
           "read_run_end", "request_stop", "withdraw"]

log = logging.getLogger(__name__)

CONTROL = "control"
_REQUEST = ".request.json"
_ANSWER = ".answer.json"


@dataclasses.dataclass(frozen=True)
class StopRequest:
    request_id: str
    run: int  # the run it is for
    requested_ms: int


@dataclasses.dataclass(frozen=True)
class StopAnswer:
    request_id: str
    run: int  # the run that answered
    status: str  # "stopped", "failed" or "abandoned"
    checkpoint_id: int | None
    barrier_batch: int | None
    message: str
    answered_ms: int

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _paths(root: str, request_id: str) -> tuple[str, str]:
    base = join(root, CONTROL, f"stop-{request_id}")
    return base + _REQUEST, base + _ANSWER


def latest_run(storage: Storage, root: str) -> int | None:
    """The newest run number claimed in ``root`` (None: no driver ever started there)."""
    from spark_ckpt.streaming.runtime.runs import run_numbers

    return max(run_numbers(storage, root), default=None)


def request_stop(storage: Storage, root: str, run: int, now_ms: int) -> StopRequest:
    """Ask run ``run`` of the pipeline in ``root`` to stop with a final checkpoint."""
    request = StopRequest(uuid.uuid4().hex[:16], run, now_ms)
    path, _ = _paths(root, request.request_id)
    storage.makedirs(join(root, CONTROL))
    body = {"request_id": request.request_id, "run": run, "requested_ms": now_ms}
    if not storage.create_exclusive(path, dump_record("stop-request", 1, body)):
        raise InternalError(f"expected to create the stop request {path}, found it there "
                            "already (a fresh random id: never in practice)")
    return request


def _end_path(root: str, run: int) -> str:
    return join(root, "runs", "ended", f"{run:08d}.json")


def read_run_end(storage: Storage, root: str, run: int) -> dict[str, Any] | None:
    """How run ``run`` ended (``runs/ended/<run>.json``), or None: it is running, or its
    driver was killed before it could say."""
    path = _end_path(root, run)
    if not storage.exists(path):
        return None
    return load_record(storage.read_bytes(path), "pipeline-run-end", (1,), where=path)


def read_answer(storage: Storage, root: str, request_id: str) -> StopAnswer | None:
    _, path = _paths(root, request_id)
    if not storage.exists(path):
        return None
    record = load_record(storage.read_bytes(path), "stop-answer", (1,), where=path)
    fields: dict[str, Any] = {f.name: record.get(f.name) for f in dataclasses.fields(StopAnswer)}
    return StopAnswer(**fields)


def withdraw(storage: Storage, root: str, request_id: str) -> None:
    """Remove an unanswered request (the client gave up waiting). A driver that already took
    it still stops and answers."""
    path, _ = _paths(root, request_id)
    storage.delete_file(path)


class StopControl:
    """The driver's side: find the requests for this run, answer them. Used by one thread
    (the pipeline loop's)."""

    def __init__(self, storage: Storage, root: str, pipeline: str, run: int) -> None:
        self.storage = storage
        self.root = root
        self.pipeline = pipeline
        self.run = run
        self._seen_bad: set[str] = set()

    def _requests(self) -> list[StopRequest]:
        directory = join(self.root, CONTROL)
        if not self.storage.exists(directory):
            return []
        names = {i.base_name for i in self.storage.list_files(directory, recursive=False)}
        found = []
        for name in sorted(names):
            if not (name.startswith("stop-") and name.endswith(_REQUEST)):
                continue
            request_id = name[len("stop-"):-len(_REQUEST)]
            if f"stop-{request_id}{_ANSWER}" in names or name in self._seen_bad:
                continue
            path = join(directory, name)
            try:
                record = load_record(self.storage.read_bytes(path), "stop-request", (1,),
                                     where=path)
                found.append(StopRequest(str(record["request_id"]), int(record["run"]),
                                         int(record["requested_ms"])))
            except FileNotFoundError:  # withdrawn meanwhile
                continue
            except (FormatVersionError, KeyError, TypeError, ValueError) as exc:
                self._seen_bad.add(name)
                log.warning("Pipeline %s run %d: ignoring stop request %s, which cannot be "
                            "read: %s", self.pipeline, self.run, path, exc)
        return sorted(found, key=lambda r: (r.requested_ms, r.request_id))

    def poll(self, now_ms: int) -> StopRequest | None:
        """The oldest unanswered request for this run, if any. Requests for earlier runs are
        answered ``abandoned`` here (their driver is gone); later runs' are left alone (this
        driver is fenced by that run)."""
        mine = None
        for request in self._requests():
            if request.run < self.run:
                try:
                    self.answer(request, "abandoned", None, None,
                                f"run {request.run}, which the request was for, ended before "
                                f"it answered; run {self.run} of this pipeline is running and "
                                f"was not stopped: ask again to stop it", now_ms)
                except Exception as exc:  # noqa: BLE001 - answered at the next look
                    log.warning("Pipeline %s run %d: answering stale stop request %s failed: "
                                "%s", self.pipeline, self.run, request.request_id, exc)
            elif request.run == self.run and mine is None:
                mine = request
        return mine

    def answer(self, request: StopRequest, status: str, checkpoint_id: int | None,
               barrier_batch: int | None, message: str, now_ms: int) -> StopAnswer:
        answer = StopAnswer(request.request_id, self.run, status, checkpoint_id, barrier_batch,
                            message, now_ms)
        _, path = _paths(self.root, request.request_id)
        # the first answer stands: a driver still stopping when a newer run answered its
        # request "abandoned" does not change what the client may already have read
        if not self.storage.create_exclusive(path, dump_record("stop-answer", 1,
                                                               answer.as_dict())):
            log.warning("Pipeline %s run %d: stop request %s was answered already (%s); "
                        "this run's answer (%s, checkpoint %s) is not written", self.pipeline,
                        self.run, request.request_id, path, status, checkpoint_id)
            return answer
        log.info("Pipeline %s run %d: answered stop request %s: %s (checkpoint %s)",
                 self.pipeline, self.run, request.request_id, status, checkpoint_id)
        return answer

    def record_end(self, status: str, message: str, checkpoint_id: int | None,
                   barrier_batch: int | None, now_ms: int) -> None:
        """Say how this run ended (``stopped`` or ``failed``), for ``spark-ckpt status``;
        never raises (a killed driver says nothing, which status reports as such)."""
        try:
            self.storage.makedirs(join(self.root, "runs", "ended"))
            self.storage.write_atomic(_end_path(self.root, self.run), dump_record(
                "pipeline-run-end", 1,
                {"run": self.run, "status": status, "message": message[:4000],
                 "final_checkpoint": checkpoint_id, "final_barrier": barrier_batch,
                 "ended_ms": now_ms}))
        except Exception as exc:  # noqa: BLE001 - the run ended either way
            log.warning("Pipeline %s run %d: could not record how it ended: %s", self.pipeline,
                        self.run, exc)
