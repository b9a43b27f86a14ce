"""The driver side at a scale this machine cannot run: 1,000 executors, 10,000 key groups, a
1,000,000-event job log. What each checkpoint, each batch and each recovery costs the driver,
and what grows with what.

    python scripts/sim_scale.py                                   # the named sizes
    python scripts/sim_scale.py --tasks 100 --events 50000        # a quick look
    python scripts/sim_scale.py --json benchmarks/results/sim-scale-DATE.json

Real code, fake tasks. What is real: the CheckpointCoordinator (its own thread, a ManualClock
driven by this script), the checkpoint storage on local disk (metadata and statistics written
and read as a pipeline does), the operators' runtime state and acknowledgements
(``OperatorStates`` with the operator's own ``ack_entry``/``ack_state``/``snapshot_of``: the
entry, its ``extra`` copied once per cut), the task results taken as ``_run_job`` takes them
(``take_task_results``: one JSON row per task into a StateHandle), the restore reading the
latest metadata and planning a rescale with ``restore_plans``, and the batch job's Delta event
log (EventLogWriter appends and compactions, read_table + replay_table on recovery). What is
fake: the tasks (no Spark; each "runs" by returning the JSON row a real task returns: a
chain of state files that grows by one changelog per batch and is materialized every
``--materialize-every`` batches), the state files (paths only: the coordinator never opens
them; deletions are counted) and the two-phase sink (it pre-commits one piece per task).

Per batch: decode every task's result row, publish the boundary (sources' positions, every
task's acknowledgement) to the coordinator. Per checkpoint: the time from the boundary's
publication to the completion future (acknowledgements, metadata written, store and shared
registry, sweep, statistics, listeners). Per recovery: reading the latest metadata and every
handle, and planning a rescale to twice the parallelism; for the batch job, reading and
replaying the whole event log.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, NamedTuple

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from spark_ckpt.checkpoint.checkpoint_storage import CheckpointStorage  # noqa: E402
from spark_ckpt.checkpoint.coordinator import CheckpointConfig, CheckpointCoordinator  # noqa: E402
from spark_ckpt.checkpoint.pending import Boundary, TaskAck  # noqa: E402
from spark_ckpt.clock import ManualClock  # noqa: E402
from spark_ckpt.eventlog.events import Event, EventType  # noqa: E402
from spark_ckpt.eventlog.reader import read_table  # noqa: E402
from spark_ckpt.eventlog.replay import replay_table  # noqa: E402
from spark_ckpt.eventlog.writer import EventLogWriter  # noqa: E402
from spark_ckpt.state.chain import StateFile, StateHandle, restore_plans  # noqa: E402
from spark_ckpt.state.keygroups import KeyGroupRange  # noqa: E402
from spark_ckpt.state.keygroups import ranges as keygroup_ranges  # noqa: E402
from spark_ckpt.storage import Storage  # noqa: E402
from spark_ckpt.streaming.runtime.operators import OperatorStates  # noqa: E402
from spark_ckpt.streaming.template.keyed import StatefulStream, take_task_results  # noqa: E402
from spark_ckpt.streaming.template.operator_state import (  # noqa: E402
    OperatorState,
    SnapshotBoard,
)

INTERVAL_MS = 10_000


def ranges(key_groups: int, parallelism: int) -> list[KeyGroupRange]:
    return keygroup_ranges(parallelism, key_groups)


class FakeOperator:
    """One stateful operator: fake tasks, and the real driver-side code around them (its
    runtime state, how results are taken, what its acknowledgements and snapshots hold)."""

    kind = "process"
    # the operator's real methods (template/keyed.py), on this stand-in for the stream
    ack_entry = StatefulStream.ack_entry
    ack_state = StatefulStream.ack_state
    describe_state = StatefulStream.describe_state
    snapshot_of = StatefulStream.snapshot_of

    def __init__(self, name: str, state_dir: str, key_groups: int, tasks: int, *,
                 materialize_every: int, rows_per_task: int, splits: int) -> None:
        self.operator = name
        self.keys = ["key"]
        self.state_dir = state_dir
        self.ranges = ranges(key_groups, tasks)
        self.materialize_every = materialize_every
        self.rows = rows_per_task
        # operator-level state kept in its checkpoint entry: here the per-partition event-time
        # maxima of a watermark over ``splits`` source partitions (as a Kafka input tracks)
        self.state = OperatorState(tasks, key_groups, {}, extra={
            "applied_watermark_ms": 0,
            "event_splits": {f"0|events:{p}": [0, 0] for p in range(splits)}},
            restored_describe={"state_schema": json.dumps({"type": "struct", "fields": [
                {"name": f"v{i}", "type": "long", "nullable": True, "metadata": {}}
                for i in range(4)]}), "key_schema": "{}", "derived": {"version": 1}})

    def task_rows(self, batch: int) -> list[TaskRow]:
        """What each task returns after ``batch``: its new handle (a chain grown by one
        changelog, or a fresh snapshot every materialize_every batches) and metrics."""
        rows = []
        for pid, rng in enumerate(self.ranges):
            old = self.state.live.get(pid)
            label = rng.label
            base = f"{self.state_dir}/{label}/b{batch:08d}"
            if old is None or batch % self.materialize_every == 0:
                files = [StateFile(f"{base}-snapshot.parquet", "snapshot", batch, self.rows,
                                   self.rows * 40, label)]
            else:
                files = [*old.files, StateFile(f"{base}-changelog.parquet", "changelog", batch,
                                               self.rows // 20, self.rows * 2, label)]
            handle = StateHandle(label, f"t{batch}", tuple(files), self.rows)
            rows.append(TaskRow(pid, json.dumps({
                "handle": handle.to_json(), "sync_ms": 1, "async_ms": 3, "alignment_ms": 0,
                "channels": 1, "apply_ms": 20, "restore_ms": 0, "restored": False,
                "input_rows": 1000, "changed": 50, "written_bytes": self.rows * 2,
                "total_ms": 40, "executor": str(pid), "worker": 1, "cache": "process"})))
        return rows

    def advance(self, batch: int) -> None:
        """The operator's driver-side state after a batch (a watermark moved)."""
        self.state.extra["applied_watermark_ms"] = batch * 1000
        splits = self.state.extra["event_splits"]
        for key in splits:
            splits[key] = [batch * 1000, batch * 1000]


class TaskRow(NamedTuple):
    """A task's result row as the collect returns it."""

    pid: int
    meta: str


class FakeSink:
    """A two-phase sink whose pre-commit names one staged piece per task."""

    def __init__(self, name: str, tasks: int, every: int) -> None:
        self.name = name
        self.tasks = tasks
        self.every = every
        self.committed: list[int] = []

    def pre_commit(self, checkpoint_id: int, batch_id: int) -> dict[str, TaskAck | Exception]:
        # a Parquet sink's transaction: the pieces staged since the last checkpoint, a
        # directory per batch with one file per task (SinkTransactions.pre_commit's shape)
        pieces = [{"dir": f"/sink/_staging/b{b:08d}",
                   "files": [{"path": f"/sink/_staging/b{b:08d}/part-{t:05d}.parquet"}
                             for t in range(self.tasks)]}
                  for b in range(batch_id - self.every + 1, batch_id + 1)]
        state = {"pending": [[checkpoint_id, {"pieces": pieces}]]}
        return {f"sink:{self.name}": TaskAck(f"sink:{self.name}", state, {"sync_ms": 1})}

    def notify_checkpoint_complete(self, checkpoint_id: int) -> None:
        self.committed.append(checkpoint_id)

    def notify_checkpoint_aborted(self, checkpoint_id: int) -> None:
        pass


def source_piece(batch: int, partitions: int) -> dict[str, Any]:
    """A Kafka source's piece of a batch: every partition's offset range."""
    return {"kind": "kafka", "ranges": {f"events:{p}": [batch * 1000, (batch + 1) * 1000]
                                        for p in range(partitions)}}


def simulate_streaming(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    clock = ManualClock(1_000_000)
    storage = CheckpointStorage(str(work / "ckpt" / "checkpoints"))
    operators = [FakeOperator(f"op{i}", str(work / "ckpt" / "state" / f"op{i}"),
                              args.key_groups, args.tasks,
                              materialize_every=args.materialize_every,
                              rows_per_task=args.rows_per_task, splits=args.partitions)
                 for i in range(args.operators)]
    sink = FakeSink("out", args.tasks, args.checkpoint_every)
    states = OperatorStates(SnapshotBoard(), transactions={}, skip_output_through={})
    for op in operators:
        states.add(op, op.state)  # type: ignore[arg-type]  # the stand-in has what it uses
    deleted: list[int] = []
    stats: list[dict[str, Any]] = []
    failures: list[BaseException] = []
    coordinator = CheckpointCoordinator(
        "sim", "sim-id", CheckpointConfig(interval_ms=INTERVAL_MS, min_pause_ms=0,
                                          max_concurrent=1, timeout_ms=600_000,
                                          tolerable_failures=0, retained=1,
                                          history_retained=100, mode="exactly_once"),
        storage, completed=[], next_id=1, listeners=[sink], on_failure=failures.append,
        on_stats=stats.append, delete_files=lambda paths: deleted.append(len(paths)),
        live_files=states.live_files,
        clock=clock, pre_commit=sink.pre_commit)
    states.release_to(coordinator.release_files)
    coordinator.start()
    per_batch: list[dict[str, float]] = []
    per_checkpoint: list[dict[str, Any]] = []
    try:
        for batch in range(args.batches):
            rows = [op.task_rows(batch) for op in operators]  # the fake tasks' work: not timed
            t0 = time.perf_counter()
            for op, op_rows in zip(operators, rows, strict=True):
                take_task_results(op.state, op_rows, batch)
                op.advance(batch)
                states.publish(op.operator)  # snapshot; dropped files to the coordinator
            t1 = time.perf_counter()
            acks = [TaskAck("source:events", {"batch": batch,
                                              "piece": source_piece(batch, args.partitions)})]
            acks.extend(states.acks(batch))
            boundary = Boundary(batch, tuple(acks), (sink.name,))
            t2 = time.perf_counter()
            due = (batch + 1) % args.checkpoint_every == 0
            before = len(stats)
            coordinator.publish_boundary(boundary)
            if due:
                clock.advance(INTERVAL_MS)  # the coordinator's clock: a checkpoint is due
                _wait(lambda n=before: len(stats) > n, failures)
                t3 = time.perf_counter()
                last = stats[-1]
                assert last["status"] == "completed", last
                per_checkpoint.append({
                    "checkpoint_id": last["checkpoint_id"], "batch": batch,
                    "complete_s": round(t3 - t2, 4), "metadata_bytes": last["metadata_bytes"],
                    "acknowledged": last["acknowledged"],
                    "stats_bytes": len(json.dumps(last))})
            per_batch.append({"decode_s": round(t1 - t0, 4), "boundary_s": round(t2 - t1, 4)})
        # recovery: the latest metadata and every handle, and a rescale plan to 2x
        t0 = time.perf_counter()
        latest = CheckpointStorage(str(work / "ckpt" / "checkpoints"))
        cid = latest.completed_ids()[-1]
        meta = latest.read_metadata(cid)
        handles = {name: [StateHandle.from_json(h) for _p, h in
                          sorted(op["handles"].items(), key=lambda kv: int(kv[0]))]
                   for name, op in meta["operators"].items()}
        t1 = time.perf_counter()
        new_ranges = ranges(args.key_groups, args.tasks * 2)
        plans = {name: restore_plans(new_ranges, hs) for name, hs in handles.items()}
        t2 = time.perf_counter()
        assert all(len(p) == len(new_ranges) for p in plans.values())
    finally:
        coordinator.stop()
    if failures:
        raise failures[0]
    steady = per_checkpoint[1:] or per_checkpoint
    return {
        "batches": args.batches, "checkpoints": len(per_checkpoint),
        "committed": len(sink.committed), "deleted_files": sum(deleted),
        "per_batch_decode_s_median": statistics.median(b["decode_s"] for b in per_batch),
        "per_batch_boundary_s_median": statistics.median(b["boundary_s"] for b in per_batch),
        "per_checkpoint_complete_s_median": statistics.median(c["complete_s"] for c in steady),
        "per_checkpoint_complete_s_max": max(c["complete_s"] for c in per_checkpoint),
        "metadata_bytes": per_checkpoint[-1]["metadata_bytes"],
        "stats_bytes": per_checkpoint[-1]["stats_bytes"],
        "acknowledgements": per_checkpoint[-1]["acknowledged"],
        "restore_read_s": round(t1 - t0, 4), "rescale_plan_s": round(t2 - t1, 4),
        "checkpoints_detail": per_checkpoint, "batches_detail": per_batch}


def _wait(ready: Any, failures: list[BaseException], timeout_s: float = 600.0) -> Any:
    """Poll ``ready()`` (the coordinator's thread completes the checkpoint)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if failures:
            raise failures[0]
        value = ready()
        if value:
            return value
        time.sleep(0.001)
    raise TimeoutError("the checkpoint did not complete")


def finished_event(vertex: int, partition: int) -> Event:
    return Event(EventType.EXECUTION_VERTEX_FINISHED, {
        "outputs": [{"path": f"vertices/v{vertex:04d}/part-{partition:06d}-a1.parquet",
                     "rows": 1000, "bytes": 65536, "version": "mtime=1767225600000000000"}],
        "schema": "id BIGINT, key BIGINT, value DOUBLE", "shared": []},
        vertex_id=f"v{vertex:04d}", partition=partition, attempt_id=f"a{partition}",
        rows=1000, bytes=65536, duration_ms=120)


def simulate_event_log(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """A batch job's log of ``--events`` finished partitions, appended as the writer appends
    (flushes of ``flushMaxEvents``), then read and replayed as a resubmitted driver does."""
    from spark_ckpt.options import OPTIONS

    defaults = {o.key: o.default for o in OPTIONS}
    flush_max = int(defaults["spark.ckpt.eventLog.flushMaxEvents"])
    compact = int(defaults["spark.ckpt.eventLog.compactAtFiles"]) \
        if args.compact_at_files is None else args.compact_at_files
    storage = Storage(str(work / "job"))
    writer = EventLogWriter(storage, storage.root + "/events", job_id="sim", job_attempt=1,
                            flush_interval_ms=3_600_000, flush_max_events=flush_max,
                            compact_at_files=compact)
    writer.start()
    writer.append(Event(EventType.JOB_ATTEMPT_STARTED, {"mode": "fresh"}))
    vertices = max(1, args.events // args.tasks)
    t0 = time.perf_counter()
    flush_s: list[float] = []
    n = 0
    for vertex in range(vertices):
        for partition in range(args.tasks):
            writer.append(finished_event(vertex, partition))
            n += 1
            if n % flush_max == 0:
                f0 = time.perf_counter()
                writer.flush()
                flush_s.append(time.perf_counter() - f0)
            if n % 100_000 == 0:
                print(f"  event log: {n:,} events appended ({time.perf_counter() - t0:.0f} s)",
                      flush=True)
    writer.close()
    t1 = time.perf_counter()
    table, version, problems = read_table(storage, storage.root + "/events")
    t2 = time.perf_counter()
    history = replay_table(table)
    t3 = time.perf_counter()
    assert not problems and len(history.finished) == n, (problems, len(history.finished), n)
    tenth = max(1, len(flush_s) // 10)
    return {"events": n, "commits": writer.commits, "compactions": writer.compactions,
            "compact_at_files": compact, "delta_version": version,
            "append_s": round(t1 - t0, 2),
            "flush_s_first_tenth_median": round(statistics.median(flush_s[:tenth]), 4),
            "flush_s_last_tenth_median": round(statistics.median(flush_s[-tenth:]), 4),
            "read_s": round(t2 - t1, 2), "replay_s": round(t3 - t2, 2),
            "log_bytes": sum(p.stat().st_size for p in (work / "job").rglob("*")
                             if p.is_file())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tasks", type=int, default=1000,
                        help="executors, one stateful task each per operator (1,000)")
    parser.add_argument("--key-groups", type=int, default=10_000)
    parser.add_argument("--operators", type=int, default=2)
    parser.add_argument("--partitions", type=int, default=1000,
                        help="the Kafka source's partitions (positions per batch; the "
                        "watermark's per-partition maxima in each operator's entry)")
    parser.add_argument("--batches", type=int, default=60)
    parser.add_argument("--checkpoint-every", type=int, default=10, help="batches")
    parser.add_argument("--materialize-every", type=int, default=10, help="batches")
    parser.add_argument("--rows-per-task", type=int, default=10_000)
    parser.add_argument("--events", type=int, default=1_000_000)
    parser.add_argument("--compact-at-files", type=int, default=None,
                        help="the event log writer's compactAtFiles (default: the "
                        "option's; 0: never, as before it existed)")
    parser.add_argument("--skip-event-log", action="store_true")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="spark-ckpt-sim-"))
    print(f"sizes: tasks={args.tasks} key_groups={args.key_groups} operators={args.operators} "
          f"partitions={args.partitions} batches={args.batches} events={args.events}",
          flush=True)
    result: dict[str, Any] = {
        "command": " ".join(sys.argv), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": f"{platform.machine()} {os.cpu_count()} cores", "args": vars(args)}
    try:
        t0 = time.perf_counter()
        result["streaming"] = simulate_streaming(args, work)
        result["streaming"]["wall_s"] = round(time.perf_counter() - t0, 2)
        summary = {k: v for k, v in result["streaming"].items() if not k.endswith("_detail")}
        print("streaming: " + json.dumps(summary), flush=True)
        if not args.skip_event_log:
            t0 = time.perf_counter()
            result["event_log"] = simulate_event_log(args, work)
            result["event_log"]["wall_s"] = round(time.perf_counter() - t0, 2)
            print("event log: " + json.dumps(result["event_log"]), flush=True)
        result["max_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024
        print(f"max RSS: {result['max_rss_mb']} MB", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
