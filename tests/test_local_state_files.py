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


def _run_at(tmp_path, token: str | None, batch: int) -> _Run:
    task = run(tmp_path, token)
    task.batch = batch
    return task


def test_spill_appends_each_batch_changelog_and_rewrites_past_the_factor(tmp_path):
    """After a full spill, a batch that changed a few keys leaves only its changelog (a delta
    naming the version it follows); a worker that has not seen the range loads the full spill
    and the deltas and holds what the writer held; once the deltas would outgrow the full
    spill, the range is written whole again and the older files go."""
    from spark_ckpt.state import task as task_module

    directory = tmp_path / "spark_ckpt_state" / "p" / "op"
    state = MemoryAggState(["k"], [pa.int64()], COLUMNS, max_rows=10_000)
    state.apply(partials(list(range(100))))
    state.token = "t1"
    _run_at(tmp_path, None, 1).spill(state, None)  # rebuilt: nothing to follow, written whole
    assert sorted(os.listdir(directory)) == ["kg00000-00064-t1.arrow"]
    parent = "t1"
    for i, keys in enumerate([[1, 2, 3], [3, 4, 500], list(range(40, 90))], start=2):
        changelog = state.apply(partials(keys))
        state.token = f"t{i}"
        _run_at(tmp_path, parent, i).spill(state, changelog)
        parent = state.token
        loaded = _run_at(tmp_path, parent, i + 1).load_spill(
            lambda: MemoryAggState(["k"], [pa.int64()], COLUMNS, max_rows=10_000))
        assert loaded is not None and loaded.token == parent
        assert loaded.snapshot().sort_by("k").equals(state.snapshot().sort_by("k"))
    assert sorted(os.listdir(directory)) == [
        "kg00000-00064-t1.arrow", "kg00000-00064-t2.delta.arrow",
        "kg00000-00064-t3.delta.arrow", "kg00000-00064-t4.delta.arrow"]
    assert state.spilled == ("t4", 3, 56, 100)
    changelog = state.apply(partials(list(range(60))))  # 56 + 60 > 1.0 x 100 rows
    state.token = "t5"
    _run_at(tmp_path, "t4", 5).spill(state, changelog)
    assert sorted(os.listdir(directory)) == ["kg00000-00064-t5.arrow"]
    assert state.spilled == ("t5", 0, 0, 101)
    assert task_module.SPILL_REWRITE_FACTOR == 1.0


def test_a_spill_chain_with_a_missing_or_torn_link_is_not_used(tmp_path):
    """A delta whose parent is gone, or a delta left half-written by a killed worker (only
    its temporary file), is never loaded: the task rebuilds the range from the durable
    chain instead."""
    directory = tmp_path / "spark_ckpt_state" / "p" / "op"
    state = MemoryAggState(["k"], [pa.int64()], COLUMNS, max_rows=10_000)
    state.apply(partials(list(range(50))))
    state.token = "t1"
    _run_at(tmp_path, None, 1).spill(state, None)
    changelog = state.apply(partials([1, 2]))
    state.token = "t2"
    _run_at(tmp_path, "t1", 2).spill(state, changelog)

    def make():
        return MemoryAggState(["k"], [pa.int64()], COLUMNS, max_rows=10_000)

    assert _run_at(tmp_path, "t2", 3).load_spill(make) is not None
    (directory / "kg00000-00064-t3.delta.arrow.tmp-999999").write_bytes(b"torn")
    assert _run_at(tmp_path, "t3", 3).load_spill(make) is None
    os.unlink(directory / "kg00000-00064-t1.arrow")
    assert _run_at(tmp_path, "t2", 3).load_spill(make) is None
