"""Named fault points, for the recovery tests that kill a real driver at an exact moment.

``SPARK_CKPT_FAULT`` holds ``point[:n][:action]``: when the driver passes ``point`` for the
``n``-th time (default 1; ``n-m`` for passes n to m, ``n-`` for every pass from n on), the action
runs. Actions: ``kill`` (SIGKILL the driver's whole process group, JVM and Python workers
included: a crash, not a shutdown), ``pause`` (sleep for ``SPARK_CKPT_FAULT_PAUSE_S`` seconds,
default an hour, so a test can race a second driver against this one; with
``SPARK_CKPT_FAULT_RELEASE=<file>`` the pause ends as soon as that file exists, and
``SPARK_CKPT_FAULT_REACHED=<file>`` is created when the pause begins, so a test waits on events,
not on a time window), ``fail`` (raise
``OSError``, as failing storage would) and ``executor`` (SIGKILL the JVM this process runs
under: from a Python worker, its executor, with every Python worker of it; the driver's JVM in
local mode). With ``SPARK_CKPT_FAULT_ONCE=<file>`` the action runs once over every process that
shares the file: the first to reach it creates the file, the others (a task's retry on another
executor) pass. Unset, a fault point costs one dict lookup. The points are listed in
:data:`POINTS` and in docs/recovery.md.

Time: ``time.sleep`` and ``time.monotonic`` directly, not a :class:`~spark_ckpt.clock.Clock`:
a pause is set up by the environment, in any process, and races real processes in real time.
"""

from __future__ import annotations

import os
import signal
import threading
import time

__all__ = ["POINTS", "fault_point"]

POINTS = (
    "attempt.started",  # after JobAttemptStarted is durable
    "vertex.initialized",  # after the JobVertexInitialized events are durable
    "partition.finished",  # after a flush that made ExecutionVertexFinished events durable
    "partition.written",  # a task wrote its manifest; its event is not yet logged
    "vertex.finished",  # after every partition of a vertex is durable
    "sink.commit.started",  # SinkCommitStarted durable, table not yet committed
    "sink.commit.files",  # Parquet sink: marker created, some files moved
    "sink.committed",  # sink table committed, SinkCommitted not yet logged
    "attempt.finished",  # JobAttemptFinished durable
    "stream.batch.allocated",  # a batch's allocation is durable, the batch not yet submitted
    "stream.batch.staged",  # every output of a batch staged, none committed
    "stream.output.committed",  # one output of a batch committed (counted per output)
    "stream.batch.committed",  # a batch's commit record is durable
    "sink.kafka.sent",  # a Python task sent a slice's records in a transaction not yet committed
    "stream.purge",  # a batch committed; the records of older batches are about to be purged
    "stream.block.stored",  # a receiver's block is durable, not yet counted as received
    "eventlog.write",  # an append to the event log is about to be written (counted per try)
    "eventlog.compact",  # an append is durable; the event log's files are about to be compacted
    "checkpoint.barrier",  # a barrier placed at a boundary, sinks not yet pre-committed
    "checkpoint.metadata",  # a completed checkpoint's metadata is about to be written
    "checkpoint.completed",  # a checkpoint's metadata is durable, sinks not yet committed
    "checkpoint.sink.committed",  # one sink committed a checkpoint's transaction
    "stream.stop.requested",  # a driver took a stop request (spark-ckpt stop), not yet acting
    "stream.stop.checkpointed",  # stopped with its final checkpoint, not yet answered
    "stream.stop.answered",  # the stop request's answer is durable, the driver not yet exited
    "state.materialize.compacted",  # a worker's thread compacted a chain, snapshot not written
)

_lock = threading.Lock()
_counts: dict[str, int] = {}
_spec_seen: list[str | None] = [None]  # passes are counted afresh when the spec changes


def _spec() -> tuple[str, int, float, str] | None:
    raw = os.environ.get("SPARK_CKPT_FAULT")
    if not raw:
        return None
    parts = raw.split(":")
    point = parts[0]
    nth = parts[1] if len(parts) > 1 and parts[1] else "1"
    first, dash, last = nth.partition("-")
    low = int(first)
    high: float = (int(last) if last else float("inf")) if dash else low
    action = parts[2] if len(parts) > 2 else "kill"
    return point, low, high, action


def fault_point(name: str) -> None:
    """Pass the fault point ``name``; crash or pause here if the environment asks for it."""
    spec = _spec()
    if spec is None or spec[0] != name:
        return
    with _lock:
        raw = os.environ.get("SPARK_CKPT_FAULT")
        if raw != _spec_seen[0]:
            _spec_seen[0] = raw
            _counts.clear()
        _counts[name] = _counts.get(name, 0) + 1
        hit = spec[1] <= _counts[name] <= spec[2]
    if not hit:
        return
    jvm = _jvm_ancestor() if spec[3] == "executor" else None  # found before the fault is taken
    once = os.environ.get("SPARK_CKPT_FAULT_ONCE")
    if once:
        try:
            os.close(os.open(once, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return  # another process (or an earlier attempt) took the fault already
    if jvm is not None:
        os.kill(jvm, signal.SIGKILL)
        time.sleep(60)  # this worker dies with its JVM's pipes; never goes on past the point
        os.kill(os.getpid(), signal.SIGKILL)
    if spec[3] == "fail":
        raise OSError(f"injected storage failure at fault point {name} "
                      f"(pass {_counts[name]}, SPARK_CKPT_FAULT)")
    if spec[3] == "pause":
        _pause(float(os.environ.get("SPARK_CKPT_FAULT_PAUSE_S", "3600")))
        return
    # A crash: the driver, its JVM and the Python workers die together, mid-write if need be.
    # The whole group only when this driver leads its own (a test started it in a new session);
    # never the group of whoever launched it.
    if os.getpgid(0) != os.getpgid(os.getppid()):
        os.killpg(os.getpgid(0), signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)


def _jvm_ancestor() -> int:
    """The nearest ancestor process that is a JVM (a Python worker's executor: the worker's
    parent is PySpark's daemon, whose parent is the executor)."""
    pid = os.getppid()
    while pid > 1:
        if os.path.basename(os.readlink(f"/proc/{pid}/exe")) == "java":
            return pid
        with open(f"/proc/{pid}/stat") as f:
            pid = int(f.read().rsplit(")", 1)[1].split()[1])
    from spark_ckpt.errors import InternalError

    raise InternalError("fault action executor: expected a JVM among this process's "
                        "ancestors (a Python worker's executor), found none")


def _pause(seconds: float) -> None:
    reached = os.environ.get("SPARK_CKPT_FAULT_REACHED")
    release = os.environ.get("SPARK_CKPT_FAULT_RELEASE")
    if reached:
        with open(reached, "w") as f:
            f.write(str(os.getpid()))
    if not release:
        time.sleep(seconds)
        return
    deadline = time.monotonic() + seconds
    while not os.path.exists(release) and time.monotonic() < deadline:
        time.sleep(0.05)
