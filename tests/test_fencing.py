"""Fencing by Delta commits: concurrent claims from separate processes get distinct, ordered
versions; exactly the newest claimant owns, every other one finds itself fenced."""

from __future__ import annotations

import json
import subprocess
import sys

from helpers import wait_for

from spark_ckpt.storage.fencing import Fence
from spark_ckpt.storage import Storage

CLAIMANT = """
import json, sys
from spark_ckpt.storage.fencing import Fence
from spark_ckpt.storage import Storage
storage = Storage(sys.argv[1])
fence = Fence(storage, storage.root, "job race")
sys.stdin.readline()  # every claimant starts at the same moment
print(json.dumps({"name": sys.argv[2], "version": fence.claim(sys.argv[2])}), flush=True)
sys.stdin.readline()  # every claim is in
print(json.dumps({"name": sys.argv[2], "fenced": fence.is_fenced()}), flush=True)
"""


def test_concurrent_claims_from_processes_leave_exactly_one_owner(tmp_path):
    procs = [subprocess.Popen([sys.executable, "-c", CLAIMANT, str(tmp_path), f"d{n}"],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
             for n in range(6)]
    for p in procs:
        p.stdin.write("go\n")
        p.stdin.flush()
    versions = {}
    for p in procs:
        claim = json.loads(p.stdout.readline())
        versions[claim["name"]] = claim["version"]
    for p in procs:
        p.stdin.write("check\n")
        p.stdin.flush()
    fenced = {}
    for p in procs:
        answer = json.loads(p.stdout.readline())
        fenced[answer["name"]] = answer["fenced"]
        p.wait(60)
        p.stdin.close()
        p.stdout.close()
    assert len(set(versions.values())) == 6  # distinct: each commit won its own version
    owner = max(versions, key=versions.get)
    assert [n for n, f in fenced.items() if not f] == [owner]


def test_a_later_claim_fences_an_earlier_one_in_order(tmp_path):
    storage = Storage(str(tmp_path))
    first, second = Fence(storage, storage.root, "p"), Fence(storage, storage.root, "p")
    assert not first.is_fenced()  # not claimed yet: nothing to lose
    v1 = first.claim("run 1")
    assert not first.is_fenced()
    v2 = second.claim("run 2")
    assert v2 > v1 and first.is_fenced() and not second.is_fenced()


def test_two_drivers_that_both_got_run_one_as_on_an_object_store_the_older_is_fenced(
        spark, tmp_path, monkeypatch):
    """On S3 create-if-absent is check-then-write: two drivers starting together can both
    "create" runs/00000001.json. The fence commit still orders them."""
    import pytest

    from spark_ckpt import JobFencedError, Settings, StreamingContext

    def make():
        ctx = StreamingContext(spark, 0.2, str(tmp_path / "ckpt"), "race",
                               settings=Settings(progress="never", batch_exchange_min_bytes=0))
        ctx.generator_stream("g", rows_per_batch=5).foreach_batch(lambda df, b: None, name="o")
        return ctx

    first = make()
    first.start()
    try:
        assert wait_for(lambda: first.last_progress is not None, 60, 0.05)
        second = make()
        # what a lost race on an object store looks like: the same run number, "created"
        monkeypatch.setattr(second._claim, "runs", lambda: [])
        monkeypatch.setattr(second.storage, "create_exclusive", lambda path, data: True)
        second._claim.write_metadata()
        assert second._claim.claim() == 1  # the same number as the first
        with pytest.raises(JobFencedError, match="newer driver"):
            first.await_termination(timeout=60)
    finally:
        first.stop(graceful=False, timeout=60)



def test_runs_whose_fence_claims_land_in_the_other_order_leave_exactly_one_owner(tmp_path):
    """Run 1 and run 2 numbered in that order, their fence claims committed in the other:
    the fence decides (run 1 owns) and only run 2 is fenced. Before, a newer run marker
    fenced run 1 too, and neither driver ran (test_stream_drivers' two drivers at once)."""
    import types

    import pytest

    from spark_ckpt.clock import ManualClock
    from spark_ckpt.errors import JobFencedError
    from spark_ckpt.streaming.runtime.run_claim import RunClaim

    storage = Storage(str(tmp_path))
    definition = types.SimpleNamespace(storage=storage, root=storage.root, name="p",
                                       clock=ManualClock(start_ms=0))
    first, second = RunClaim(definition, [], 1.0), RunClaim(definition, [], 1.0)
    storage.makedirs(f"{storage.root}/runs")
    for claim, number in ((first, 1), (second, 2)):
        assert storage.create_exclusive(f"{storage.root}/runs/{number:08d}.json", b"{}")
        claim.run = number
    second._fence.claim("run 2")
    first._fence.claim("run 1")
    first.check_fenced()  # the newest claim owns
    with pytest.raises(JobFencedError, match="run 2"):
        second.check_fenced()
