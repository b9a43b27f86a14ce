"""Operating a pipeline from outside its driver with the CLI, on real pipelines: status (a
stopped, a failed and a never-started run), plan, restore by id through a request the next
start takes, and cleanup (dry run by default, never a file newer than the newest run)."""

from __future__ import annotations

import json
import os
import time

import pytest
from click.testing import CliRunner
from pyspark.sql import functions as F

from spark_ckpt import Settings, StateSchemaError, StreamingContext, read_state
from spark_ckpt.ops.cli import main
from spark_ckpt.state.aggregates import count, max_
from spark_ckpt.ops.validate import checkpoint_dirs

KEYS = 7


def _run(spark, ckpt, rows, **aggs):
    ctx = StreamingContext(spark, 0.05, str(ckpt), "ops",
                           settings=Settings(progress="never", checkpoint_interval_ms=1,
                                             checkpoint_retained=4, state_parallelism=2,
                                             state_max_parallelism=8))
    gen = ctx.generator_stream("gen", rows_per_batch=100, total_rows=rows, keys=KEYS)
    gen.key_by("key").agg("totals", **(aggs or {"n": count()})) \
        .write_parquet(str(ckpt) + "-out", name="out")
    ctx.process_available(timeout=300)
    return ctx


def _cli(*args):
    result = CliRunner().invoke(main, [str(a) for a in args])
    return result.exit_code, result.output


def test_status_plan_restore_and_cleanup_of_a_real_pipeline(spark, tmp_path):
    ckpt = tmp_path / "ckpt"
    code, out = _cli("status", ckpt)
    assert code == 1 and "expected a pipeline's checkpoint directory" in out
    _run(spark, ckpt, 600)
    code, out = _cli("status", ckpt, "--json")
    found = json.loads(out)
    assert code == 0 and found["state"] == "stopped" and found["run"] == 1, found
    assert found["last_batch"]["batch_id"] == 5 and found["latest_checkpoint"]["barrier_batch"] == 5
    code, out = _cli("status", ckpt)
    assert code == 0 and "stopped" in out and "latest checkpoint" in out

    code, out = _cli("plan", "--pipeline", ckpt, "--json")
    plan = json.loads(out)
    assert code == 0 and plan["operators"]["totals"]["state_rows"] == KEYS
    assert plan["operators"]["totals"]["aggregations"] == {"n": ["count", None, None]}
    assert list(plan["sources"]) == ["gen"] and list(plan["outputs"]) == ["out"]

    completed = [c for c, s in checkpoint_dirs(str(ckpt / "checkpoints")).items()
                 if s == "completed"]
    older = completed[0]
    code, out = _cli("restore", ckpt, 10_000)
    assert code == 1 and "checkpoint 10000 is not there" in out and str(older) in out
    code, out = _cli("restore", ckpt, older)
    assert code == 0 and f"restores checkpoint {older}" in out
    assert json.loads(_cli("status", ckpt, "--json")[1])["restore_requested"] == older

    ctx = _run(spark, ckpt, 900)  # the request names the checkpoint: no code change
    assert ctx.restored.checkpoint_id == older
    dirs = checkpoint_dirs(str(ckpt / "checkpoints"))
    assert all(dirs[c] == "abandoned" for c in completed[1:]), dirs
    assert not (ckpt / "control" / "restore.json").exists()
    # replayed from the older checkpoint: every row counted once
    assert read_state(spark, str(ckpt), "totals").agg(F.sum("n")).first()[0] == 900

    # cleanup: an old orphan state file goes, one newer than the newest run stays
    state_dir = ckpt / "state" / "totals" / "kg00000-00003"
    state_dir.mkdir(parents=True, exist_ok=True)
    orphan, fresh = state_dir / "b000000000099-snapshot-old.parquet", \
        state_dir / "b000000000099-snapshot-new.parquet"
    orphan.write_bytes(b"x" * 100)
    fresh.write_bytes(b"y" * 100)
    past = time.time() - 3600
    os.utime(orphan, (past, past))
    code, out = _cli("cleanup", ckpt, "--json")
    found = json.loads(out)
    listed = {os.path.basename(f["path"]) for f in found["files"]}
    assert code == 0 and found["dry_run"] and orphan.name in listed and fresh.name not in listed
    assert orphan.exists()  # a dry run
    code, out = _cli("cleanup", ckpt, "--abandoned")
    assert code == 0 and "Would delete" in out and "abandoned checkpoint" in out
    code, out = _cli("cleanup", ckpt, "--delete", "--abandoned")
    assert code == 0 and "deleted" in out, out
    assert not orphan.exists() and fresh.exists()
    assert "abandoned" not in checkpoint_dirs(str(ckpt / "checkpoints")).values()
    assert _cli("validate", ckpt)[0] == 0  # nothing a restore needs went
    fresh.unlink()
    _run(spark, ckpt, 1000)
    assert read_state(spark, str(ckpt), "totals").agg(F.sum("n")).first()[0] == 1000


def test_status_of_a_failed_start_and_a_cancelled_restore(spark, tmp_path):
    ckpt = tmp_path / "ckpt"
    _run(spark, ckpt, 200)
    code, out = _cli("restore", ckpt, "--cancel")
    assert code == 0 and "no restore request was waiting" in out
    latest = json.loads(_cli("status", ckpt, "--json")[1])["latest_checkpoint"]["checkpoint_id"]
    assert _cli("restore", ckpt, latest)[0] == 0
    code, out = _cli("restore", ckpt, "--cancel")
    assert code == 0 and f"withdrew the request to restore checkpoint {latest}" in out
    with pytest.raises(StateSchemaError):  # a changed aggregation function: refused at start
        _run(spark, ckpt, 300, n=max_("value"))
    code, out = _cli("status", ckpt, "--json")
    found = json.loads(out)
    assert code == 1 and found["state"] == "failed" and found["run"] == 2
    assert "start failed: StateSchemaError" in found["ended"]["message"]


def test_cleanup_finds_checkpoints_kept_elsewhere(spark, tmp_path):
    """spark.ckpt.checkpoint.dir puts the checkpoints outside the pipeline's directory:
    metadata.json records where, so cleanup sees what they reference and lists none of it."""
    ckpt, elsewhere = tmp_path / "ckpt", tmp_path / "checkpoints-elsewhere"
    ctx = StreamingContext(spark, 0.05, str(ckpt), "ops",
                           settings=Settings(progress="never", checkpoint_interval_ms=1,
                                             state_parallelism=2, state_max_parallelism=8,
                                             checkpoint_dir=str(elsewhere)))
    gen = ctx.generator_stream("gen", rows_per_batch=100, total_rows=300, keys=KEYS)
    gen.key_by("key").agg("totals", n=count()).write_parquet(str(tmp_path / "out"), name="out")
    ctx.process_available(timeout=300)
    found = json.loads(_cli("cleanup", ckpt, "--json")[1])
    assert [f for f in found["files"] if "/state/" in f["path"]] == [], found
    assert json.loads(_cli("status", ckpt, "--json")[1])["latest_checkpoint"] is not None
    # a directory whose metadata does not say where (an older pipeline): refused, not guessed
    meta = json.loads((ckpt / "metadata.json").read_text())
    meta.pop("checkpoints")
    (ckpt / "metadata.json").write_text(json.dumps(meta))
    code, out = _cli("cleanup", ckpt)
    assert code == 1 and "pass --storage" in out
    code, out = _cli("cleanup", ckpt, "--storage", elsewhere, "--json")
    assert code == 0 and not [f for f in json.loads(out)["files"] if "/state/" in f["path"]]
