"""Executor-local state files left by dead Python workers are removed, live ones kept."""

from __future__ import annotations

import os
import subprocess
import sys

import pyarrow as pa

from spark_ckpt.state.backends import MemoryAggState, RocksAggState
from spark_ckpt.state.task import _Run

COLUMNS = [("n", "add", pa.int64())]


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def run(tmp_path, token: str | None = None) -> _Run:
    params = {"pipeline_id": "p", "operator": "op", "batch": 1, "local_dir": str(tmp_path),
              "state_dir": str(tmp_path / "durable"), "local_spill": True,
              "materialize_every": 10}
    plans = {0: {"range": "kg00000-00064", "token": token, "files": []}}
    return _Run(params, plans, pid=0)


def partials(keys: list[int]) -> pa.Table:
    return pa.table({"_kg": pa.array([k % 64 for k in keys], pa.int32()),
                     "k": pa.array(keys, pa.int64()), "n": pa.array([1] * len(keys), pa.int64())})


def test_spill_removes_temporary_files_of_dead_workers_only(tmp_path):
    task = run(tmp_path)
    directory = tmp_path / "spark_ckpt_state" / "p" / "op"
    directory.mkdir(parents=True)
    gone = directory / f"kg00000-00064-aaaa.arrow.tmp-{dead_pid()}"
    live = directory / f"kg00000-00064-bbbb.arrow.tmp-{os.getppid()}"  # a live process
    other_range = directory / f"kg00064-00128-cccc.arrow.tmp-{dead_pid()}"
    for f in (gone, live, other_range):
        f.write_bytes(b"partial")
    state = MemoryAggState(["k"], [pa.int64()], COLUMNS, max_rows=100)
    state.apply(partials([1, 2, 3]))
    state.token = "t1"
    task.spill(state)
    assert not gone.exists() and live.exists() and other_range.exists()
    assert (directory / "kg00000-00064-t1.arrow").exists()


def test_private_rocksdb_copies_go_with_their_task_or_their_dead_worker(tmp_path):
    task = run(tmp_path)
    base = task.rocks_path()
    os.makedirs(os.path.dirname(base), exist_ok=True)
    stale = f"{base}-{dead_pid()}"
    RocksAggState(stale, ["k"], [pa.int64()], COLUMNS, fresh=True).close()
    kept = f"{base}-{os.getppid()}"
    RocksAggState(kept, ["k"], [pa.int64()], COLUMNS, fresh=True).close()

    def make(path, fresh):
        return RocksAggState(path, ["k"], [pa.int64()], COLUMNS, fresh=fresh)

    holder = make(base, False)  # the executor's copy, locked by another (zombie) attempt
    state, ready = task.open_rocks(make)
    assert not ready and state.path == f"{base}-{os.getpid()}"
    assert not os.path.exists(stale) and os.path.exists(kept)
    state.apply(partials([5, 6]), token=task.token)
    list(task.finish(state, None, state.snapshot, pa.schema([("_kg", pa.int32()),
                                                            ("k", pa.int64()),
                                                            ("n", pa.int64())]), {}))
    assert not os.path.exists(state.path)  # the private copy: never opened again
    assert os.path.exists(base)
    holder.close()
