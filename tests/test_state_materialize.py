"""A rocksdb range's snapshot materialized off the batch's path: a thread of the worker
compacts the durable chain; a later task names the snapshot only once it is written whole,
and a worker killed mid-materialize leaves a chain that restores."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pyarrow as pa

from spark_ckpt.state import task as task_module
from spark_ckpt.state.backends import MemoryAggState
from spark_ckpt.state.chain import StateFile
from spark_ckpt.state.keygroups import KeyGroupRange
from spark_ckpt.state.task import _read
from tests.helpers import wait_for
from tests.materialize_batches import COLUMNS, RANGE, one_batch

BATCHES = [list(range(0, 40)), list(range(30, 60)), list(range(50, 100)), list(range(0, 10)),
           list(range(95, 120)), list(range(5, 15))]


def expected(upto: int) -> dict[int, int]:
    counts: dict[int, int] = {}
    for keys in BATCHES[:upto]:
        for k in keys:
            counts[k] = counts.get(k, 0) + 1
    return counts


def restored(handle: dict) -> dict[int, int]:
    """The range rebuilt from the handle's durable files alone."""
    state = MemoryAggState(["k"], [pa.int64()], COLUMNS, max_rows=10_000)
    for f in handle["files"]:
        state.apply(_read(StateFile.from_json(f), KeyGroupRange.parse(RANGE)), replace=True)
    return dict(zip(state.snapshot().column("k").to_pylist(),
                    state.snapshot().column("n").to_pylist(), strict=True))


def key() -> tuple[str, ...]:
    return ("p", "op", RANGE, "")


def test_a_due_snapshot_is_written_by_a_thread_and_named_by_the_next_batch(tmp_path):
    task_module._MATERIALIZING.clear()
    handle = None
    for batch in range(1, 4):
        meta = one_batch(tmp_path, handle, batch, BATCHES[batch - 1])
        handle = meta["handle"]
        assert [f["kind"] for f in handle["files"]] == ["changelog"] * batch
        assert restored(handle) == expected(batch)
    job = task_module._MATERIALIZING[key()]  # the third changelog: due, in a thread
    assert [f.batch for f in job.covered] == [1, 2, 3]
    assert wait_for(lambda: not job.thread.is_alive(), 120)
    assert job.error is None and job.result is not None and job.result.rows == 100
    meta = one_batch(tmp_path, handle, 4, BATCHES[3])
    handle = meta["handle"]
    assert [(f["kind"], f["batch"]) for f in handle["files"]] == [("snapshot", 3),
                                                                  ("changelog", 4)]
    assert meta["materialized"]["rows"] == 100
    assert restored(handle) == expected(4)
    assert key() not in task_module._MATERIALIZING


def test_a_snapshot_for_another_chain_is_not_named(tmp_path):
    """A finished snapshot whose chain is no longer the one the batch starts from (its batch
    failed and ran again from the earlier version) is dropped, not named."""
    task_module._MATERIALIZING.clear()
    handle = None
    for batch in range(1, 3):
        handle = one_batch(tmp_path, handle, batch, BATCHES[batch - 1])["handle"]
    one_batch(tmp_path, handle, 3, BATCHES[2])  # its handle never recorded
    job = task_module._MATERIALIZING[key()]
    assert wait_for(lambda: not job.thread.is_alive(), 120)
    retried = one_batch(tmp_path, handle, 3, BATCHES[2])["handle"]
    assert all(f["kind"] == "changelog" for f in retried["files"])
    assert restored(retried) == expected(3)


def test_a_worker_killed_mid_materialize_leaves_a_chain_that_restores(tmp_path):
    """A worker SIGKILLed while its thread writes the snapshot (a torn, empty file published
    under the snapshot's name) has named only the changelogs; the next worker restores from
    them and materializes again."""
    rules = [{"op": "write", "path": "*-snapshot-*", "action": "torn"}]
    script = textwrap.dedent(f'''
        import json
        from spark_ckpt.state import task as task_module
        from tests.materialize_batches import RANGE, one_batch
        handle = None
        for batch, keys in enumerate({BATCHES[:3]!r}, start=1):
            handle = one_batch({str(tmp_path)!r}, handle, batch, keys)["handle"]
            print(json.dumps(handle), flush=True)
        task_module._MATERIALIZING[("p", "op", RANGE, "")].thread.join()
        print("NOT KILLED", flush=True)
    ''')
    env = {**os.environ, "SPARK_CKPT_FAULT_FS": json.dumps(rules),
           "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=300, start_new_session=True)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert len(lines) == 3 and "NOT KILLED" not in proc.stdout
    handle = json.loads(lines[-1])
    torn = [p for p in (tmp_path / "durable").rglob("*-snapshot-*")]
    assert torn and all(p.stat().st_size == 0 for p in torn)  # published, never named
    assert [f["kind"] for f in handle["files"]] == ["changelog"] * 3
    assert restored(handle) == expected(3)
    task_module._MATERIALIZING.clear()  # the next batch in another worker
    meta = one_batch(tmp_path, handle, 4, BATCHES[3])
    job = task_module._MATERIALIZING[key()]
    assert wait_for(lambda: not job.thread.is_alive(), 120) and job.error is None
    handle = one_batch(tmp_path, meta["handle"], 5, BATCHES[4])["handle"]
    assert [(f["kind"], f["batch"]) for f in handle["files"]] == [("snapshot", 4),
                                                                  ("changelog", 5)]
    assert restored(handle) == expected(5)
    assert {Path(f["path"]).name for f in handle["files"]}.isdisjoint(p.name for p in torn)
