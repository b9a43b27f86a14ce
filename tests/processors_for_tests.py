"""Keyed processors the tests pickle by reference (Python workers import this module)."""

from __future__ import annotations

from spark_ckpt import KeyedProcessor


class FailsOnKeySeven(KeyedProcessor):
    def process(self, key, rows, ctx):
        if key[0] == 7:
            raise ValueError("the price of key seven cannot be negative")
        yield (key[0], len(rows))


# -- gates for tests/test_cluster_faults.py ------------------------------------------------------
# A gate stops one task of a real cluster at an exact moment so that the test can SIGKILL its
# Python worker or its executor JVM: the first task attempt to claim a gate writes
# ``<name>.reached`` (its pids and where it runs) and blocks until it is killed. Any later task
# of the same Spark stage and partition (the retry) leaves ``<name>.rerun-*`` saying where it ran.

GATE_TIMEOUT_S = 240.0  # a gate nobody kills fails its task rather than hang the test
_rerun_seen: set[tuple[str, int]] = set()


def _parent_pid(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def _cmdline(pid: int) -> str:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read().replace(b"\0", b" ").decode(errors="replace")


def executor_jvm_pid() -> int | None:
    """The executor JVM this Python worker belongs to: worker -> pyspark daemon -> JVM."""
    import os

    pid = os.getpid()
    for _ in range(6):
        pid = _parent_pid(pid)
        if pid <= 1:
            return None
        if "CoarseGrainedExecutorBackend" in _cmdline(pid):
            return pid
    return None


def gate(gate_dir: str, name: str) -> None:
    """Block the first attempt that reaches gate ``name``; record reruns of its task."""
    import json
    import os
    import time

    from pyspark import TaskContext

    tc = TaskContext.get()
    seen = (name, tc.taskAttemptId())
    if seen in _rerun_seen:  # called per row: once per task attempt is enough
        return
    _rerun_seen.add(seen)
    where = {"stage": tc.stageId(), "partition": tc.partitionId(),
             "attempt": tc.attemptNumber(), "task": tc.taskAttemptId(),
             "worker": os.getpid(), "daemon": os.getppid(), "executor": executor_jvm_pid()}
    reached = os.path.join(gate_dir, f"{name}.reached")
    if tc.attemptNumber() == 0:  # the claim file leaves out a resubmitted stage's attempt 0
        try:
            os.close(os.open(os.path.join(gate_dir, f"{name}.claimed"),
                             os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            pass
        else:
            tmp = f"{reached}.tmp"
            with open(tmp, "w") as f:
                json.dump(where, f)
            os.replace(tmp, reached)
            deadline = time.monotonic() + GATE_TIMEOUT_S
            while time.monotonic() < deadline:
                if os.getppid() != where["daemon"]:  # orphaned: the executor is gone
                    os._exit(3)
                # the gate blocks until the test kills it: the sleep is only the interval of
                # checking for orphaning, never what the test waits on
                time.sleep(0.05)
            raise RuntimeError(f"gate {name}: reached but not killed in {GATE_TIMEOUT_S} s")
    if not os.path.exists(reached):
        return
    with open(reached) as f:
        gated = json.load(f)
    if (gated["stage"], gated["partition"]) == (tc.stageId(), tc.partitionId()):
        with open(os.path.join(gate_dir, f"{name}.rerun-{tc.taskAttemptId()}"), "w") as f:
            json.dump(where, f)


class GatedSequencer(KeyedProcessor):
    """jobs/stateful_counts.py's Sequencer (``(key, id, seq, prev_id)`` per row, numbered per
    key in id order) with gates for key ``key``. ``gates`` maps a gate name to where it is,
    ``"process"`` or ``"on_timer"``, and the rows the key must have seen first (so the state a
    retry needs is restored, not empty). The key registers a processing-time timer every batch,
    due in that batch: ``on_timer`` runs after the batch's changes were written to the state,
    before the task fixes its new version."""

    state_schema = "seen BIGINT, last_id BIGINT"

    def __init__(self, gate_dir: str, key: int, gates: dict[str, tuple[str, int]]) -> None:
        self.gate_dir = gate_dir
        self.key = key
        self.gates = dict(gates)

    def _gates(self, where: str, seen: int) -> None:
        for name, (callback, after) in self.gates.items():
            if callback == where and seen >= after:
                gate(self.gate_dir, name)

    def process(self, key, rows, ctx):
        seen = ctx.value("seen")
        last = ctx.value("last_id")
        n, prev = seen.get() or 0, last.get()
        if key[0] == self.key:
            self._gates("process", n)
            ctx.timers.register_processing_time(ctx.processing_time_ms)
        for i in sorted(rows["id"].tolist()):
            n += 1
            yield (key[0], i, n, prev)
            prev = i
        seen.update(n)
        last.update(prev)

    def on_timer(self, key, timer_ms, ctx):
        self._gates("on_timer", ctx.value("seen").get() or 0)
        return None
