"""A checkpoint directory copied elsewhere (and the original deleted) restores from its latest
checkpoint, as a Flink savepoint does: state files are recorded relative to the directory.

The first runs happen in a child driver, so that the restart here finds no state of theirs in
its Python workers' memory or on local disk: every task rebuilds its range from the copied
files. Records written before (format 1, absolute paths) still restore in place and after a
move."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
from helpers import ROOT, child_env
from pyspark.sql import functions as F

from spark_ckpt import Settings, StreamingContext, read_state
from spark_ckpt.checkpoint.locations import is_relative, moved_roots, relative_to, resolve
from spark_ckpt.checkpoint.checkpoint_storage import CheckpointStorage
from spark_ckpt.storage.delta_reader import read_delta
from spark_ckpt.state import count, last, sum_

ROWS_PER_BATCH = 400
FIRST = 2400  # 6 batches before the copy
TOTAL = 4000  # 4 more after it
KEYS = 97
EVENTS_SCHEMA = "key BIGINT, id BIGINT, seq BIGINT, prev_id BIGINT"
# each case's first run: backend, snapshot every n changelogs, one task per range, processor
CASES = {
    "memory": dict(backend="memory", materialize_every=4, per_range=False, processor=False),
    "rocksdb": dict(backend="rocksdb", materialize_every=10, per_range=True, processor=True),
    "format1-in-place": dict(backend="memory", materialize_every=4, per_range=True,
                             processor=False),
    "format1-moved": dict(backend="rocksdb", materialize_every=4, per_range=False,
                          processor=True),
}


def pipeline(spark, ckpt: str, out: str, local: str, *, total: int, backend: str,
             materialize_every: int, per_range: bool, processor: bool) -> StreamingContext:
    settings = Settings(progress="never", checkpoint_interval_ms=1, state_parallelism=3,
                        state_max_parallelism=32, state_backend=backend,
                        state_materialize_every=materialize_every, state_local_dir=local,
                        state_small_batch_bytes=0 if per_range else 1 << 20)
    ctx = StreamingContext(spark, 0.05, ckpt, "relocated", settings=settings)
    gen = ctx.generator_stream("gen", rows_per_batch=ROWS_PER_BATCH, total_rows=total,
                               keys=KEYS)
    keyed = gen.key_by("key")
    agg = keyed.agg(name="totals", n=count(), total=sum_("value"),
                    last_v=last("value", "event_time"))
    agg.write_delta(f"{out}/totals", name="totals", merge_keys=["key"])
    agg.write_parquet(f"{out}/updates", name="updates")
    if processor:
        from stateful_counts import Sequencer

        keyed.process(Sequencer(), EVENTS_SCHEMA, name="sequencer") \
            .write_delta(f"{out}/events", name="events")
    return ctx


def first_runs(base: str) -> None:
    """In a child driver: every case's first 6 batches, ended by a final checkpoint."""
    from spark_ckpt import get_or_create_session

    spark = get_or_create_session("relocate-first-runs")
    for name, case in CASES.items():
        where = Path(base) / name
        progress = pipeline(spark, str(where / "ckpt"), str(where / "out"),
                            str(where / "local"), total=FIRST, **case) \
            .process_available(timeout=300)
        assert [p["batch_id"] for p in progress] == list(range(6)), progress


@pytest.fixture(scope="module")
def stopped(tmp_path_factory) -> Path:
    """Stopped pipelines, one per case, each run by a child driver (see the module)."""
    base = tmp_path_factory.mktemp("relocate")
    done = subprocess.run(
        [sys.executable, "-c", "import sys, test_relocate; test_relocate.first_runs(sys.argv[1])",
         str(base)], env=child_env(PYTHONPATH=os.pathsep.join(
             [str(ROOT), str(ROOT / "tests"), str(ROOT / "jobs"),
              os.environ.get("PYTHONPATH", "")])),
        capture_output=True, text=True, timeout=900, cwd=ROOT, start_new_session=True)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    return base


def latest_checkpoint(ckpt: Path) -> tuple[int, dict]:
    newest = max(ckpt.glob("checkpoints/chk-*/_metadata.json"))
    return int(newest.parent.name[4:]), json.loads(newest.read_text())


def recorded_paths(ckpt: Path) -> list[str]:
    return [f["path"] for meta in ckpt.glob("checkpoints/chk-*/_metadata.json")
            for op in json.loads(meta.read_text())["operators"].values()
            for h in op["handles"].values() for f in h["files"]]


def as_format_1(ckpt: Path) -> None:
    """Rewrite every checkpoint record as the code before relocatable records wrote it: format
    1, each state file by its absolute path in ``ckpt``, no root."""
    for meta_path in ckpt.glob("checkpoints/chk-*/_metadata.json"):
        meta = json.loads(meta_path.read_text())
        assert meta["format_version"] == 2 and meta.pop("root") == str(ckpt)
        meta["format_version"] = 1
        for op in meta["operators"].values():
            for handle in op["handles"].values():
                for f in handle["files"]:
                    assert is_relative(f["path"]) and f["path"].startswith("state/"), f
                    f["path"] = str(ckpt / f["path"])
        meta_path.write_text(json.dumps(meta))


def move(src: Path, dst: Path) -> None:
    """What the report did: copy the stopped pipeline's directory, delete the original."""
    shutil.copytree(src, dst)
    shutil.rmtree(src)


def generated(spark, total: int):
    """The generator source's rows, by plain Spark."""
    return spark.range(0, total).select(
        "id", F.pmod("id", F.lit(KEYS)).alias("key"),
        (F.pmod(F.xxhash64("id", F.lit(42)), F.lit(1_000_000)) / 100.0).alias("value"),
        F.timestamp_millis(F.lit(1_767_225_600_000) + F.col("id")).alias("event_time"))


def expected(spark) -> pd.DataFrame:
    return generated(spark, TOTAL).groupBy("key").agg(
        F.count("*").alias("n"), F.sum("value").alias("total"),
        F.max_by("value", "event_time").alias("last_v")).toPandas()


def same(got: pd.DataFrame, want: pd.DataFrame) -> None:
    got = got[list(want.columns)].sort_values("key").reset_index(drop=True)
    want = want.sort_values("key").reset_index(drop=True)
    pd.testing.assert_frame_equal(got, want, check_dtype=False, rtol=1e-9)


def restart(spark, tmp_path, ckpt: Path, out: Path, case: str, caplog) -> None:
    """Start the pipeline on ``ckpt`` over 4 more batches; check that it restored the latest
    checkpoint from its files, replayed nothing, and that every output equals one
    uninterrupted run's."""
    latest, meta = latest_checkpoint(ckpt)
    assert meta["barrier_batch"] == 5
    caplog.set_level(logging.INFO, logger="spark_ckpt")
    ctx = pipeline(spark, str(ckpt), str(out), str(tmp_path / "local-restart"), total=TOTAL,
                   **CASES[case])
    progress = ctx.process_available(timeout=300)
    assert "cannot be restored" not in caplog.text and "missing state file" not in caplog.text
    assert ctx.restored is not None and ctx.restored.checkpoint_id == latest
    assert ctx.restored.barrier_batch == 5
    # nothing before the restored barrier ran again; the new batches ran once each
    assert [(p["batch_id"], p["recovered"]) for p in progress] == \
        [(b, False) for b in range(6, 10)]
    # the first batch's tasks rebuilt their ranges from the copied files (no cache here)
    first = progress[0]["state"]
    for op in first:
        assert first[op]["restored_tasks"] > 0, first[op]
        assert {t["cache"] for t in first[op]["tasks"].values()} == {None}, first[op]
    want = expected(spark)
    same(read_delta(str(out / "totals")).to_pandas(), want)
    same(read_state(spark, str(ckpt), "totals").toPandas(), want)
    updates = spark.read.parquet(str(out / "updates")).toPandas()
    assert not updates.duplicated(["key", "n"]).any()  # no batch's changes twice
    same(updates.sort_values("n").groupby("key").tail(1), want)
    if CASES[case]["processor"]:
        events = read_delta(str(out / "events")).to_pandas()
        assert sorted(events.id) == list(range(TOTAL)), "an id is missing or shows twice"
        for key, rows in events.sort_values("seq").groupby("key"):
            assert rows.seq.tolist() == list(range(1, len(rows) + 1)), key
            assert rows.prev_id.iloc[1:].tolist() == rows.id.iloc[:-1].tolist(), key
        assert set(read_state(spark, str(ckpt), "sequencer").toPandas().seen) == \
            {TOTAL // KEYS, TOTAL // KEYS + 1}
    # the new checkpoints record their state files relative to the directory
    newest, meta = latest_checkpoint(ckpt)
    assert newest > latest and meta["format_version"] == 2 and meta["root"] == str(ckpt)
    paths = [f["path"] for op in meta["operators"].values() for h in op["handles"].values()
             for f in h["files"]]
    assert paths and all(p.startswith("state/") for p in paths), paths


def cli(*args: str) -> tuple[int, str]:
    from click.testing import CliRunner

    from spark_ckpt.ops.cli import main

    result = CliRunner().invoke(main, list(args))
    return result.exit_code, result.output


@pytest.mark.parametrize("case", ["memory", "rocksdb"])
def test_a_copied_directory_restores_its_latest_checkpoint_and_replays_nothing(
        spark, tmp_path, stopped, case, caplog):
    """The report: a stopped stateful pipeline's directory copied to a new path, the original
    deleted; the next start restores the latest checkpoint from the copy's own files (a chain
    of a snapshot and changelogs shared by several checkpoints, memory and RocksDB), replays
    none of the 6 earlier batches, and its outputs equal one uninterrupted run's."""
    original, ckpt = stopped / case / "ckpt", tmp_path / "moved" / "ckpt"
    before = recorded_paths(original)
    assert before and not any(p.startswith("/") for p in before)  # relative to the directory
    if case == "memory":  # a snapshot and the changelogs after it, each in its checkpoint
        _, meta = latest_checkpoint(original)
        kinds = {f["kind"] for h in meta["operators"]["totals"]["handles"].values()
                 for f in h["files"]}
        assert kinds == {"snapshot", "changelog"}, kinds
    move(original, ckpt)
    # the command line reads the copy before any start: every checkpoint intact, nothing to
    # clean, the latest one restorable
    latest, _ = latest_checkpoint(ckpt)
    code, out = cli("validate", str(ckpt), "--json")
    assert code == 0 and json.loads(out)["restores"] == latest, out
    code, out = cli("cleanup", str(ckpt), "--json")
    assert code == 0 and not [f for f in json.loads(out)["files"] if "/state/" in f["path"]], out
    code, out = cli("checkpoints", "show", str(ckpt), "--json")
    shown = [f["path"] for op in json.loads(out)["operators"].values()
             for h in op["handles"].values() for f in h["files"]]
    assert code == 0 and all(p.startswith(str(ckpt) + "/state/") for p in shown), shown
    restart(spark, tmp_path, ckpt, stopped / case / "out", case, caplog)
    assert f"written in {original}, its state files are read from {ckpt}" in caplog.text
    # the 4 new checkpoints subsumed the copied ones: nothing names the old place any more
    kept = [json.loads(p.read_text()) for p in ckpt.glob("checkpoints/chk-*/_metadata.json")]
    assert kept and {m["root"] for m in kept} == {str(ckpt)}


def test_format_1_records_with_absolute_paths_still_restore_in_place(
        spark, tmp_path, stopped, caplog):
    """Checkpoints written before relocatable records (format 1, absolute paths) restore where
    they are; the checkpoints after them are format 2."""
    ckpt = stopped / "format1-in-place" / "ckpt"
    as_format_1(ckpt)
    assert all(p.startswith(str(ckpt) + "/state/") for p in recorded_paths(ckpt))
    assert CheckpointStorage(str(ckpt / "checkpoints")).read_metadata(
        latest_checkpoint(ckpt)[0])["format_version"] == 1
    restart(spark, tmp_path, ckpt, stopped / "format1-in-place" / "out", "format1-in-place",
            caplog)
    assert "written in" not in caplog.text  # nothing was taken from elsewhere


def test_format_1_records_of_a_moved_directory_are_read_from_the_copy(
        spark, tmp_path, stopped, caplog):
    """Format 1 records name the old directory's files; the copy holds them under the same
    ``state/<operator>/`` paths, so they are read from the copy: the latest checkpoint
    restores and nothing is replayed."""
    original, ckpt = stopped / "format1-moved" / "ckpt", tmp_path / "elsewhere" / "ckpt"
    as_format_1(original)
    move(original, ckpt)
    assert all(p.startswith(str(original) + "/") for p in recorded_paths(ckpt))
    restart(spark, tmp_path, ckpt, stopped / "format1-moved" / "out", "format1-moved", caplog)
    assert f"written in {original}, its state files are read from {ckpt}" in caplog.text


# -- the record's paths, without Spark -------------------------------------------------------
def test_paths_inside_the_directory_are_relative_and_resolve_under_any_scheme():
    base = "s3a://bucket/pipelines/orders"
    inside = f"{base}/state/totals/kg00000-00032/b000000000001-changelog-x.parquet"
    assert relative_to(inside, base) == "state/totals/kg00000-00032/" \
        "b000000000001-changelog-x.parquet"
    assert resolve(relative_to(inside, base), "gs://other/copy") == \
        "gs://other/copy/state/totals/kg00000-00032/b000000000001-changelog-x.parquet"
    assert relative_to("/data/p/state/a.parquet", "file:///data/p") == "state/a.parquet"
    # the checkpoint directory holds the checkpoint storage, with the storage's scheme
    assert CheckpointStorage("s3://bucket/pipelines/orders/checkpoints?region=us-east-1") \
        .base == "s3://bucket/pipelines/orders"
    for outside in ("s3a://bucket/pipelines/orders2/state/a.parquet", "/elsewhere/a.parquet",
                    "abfss://c@acct.dfs.core.windows.net/p/state/a.parquet"):
        assert relative_to(outside, base) == outside and not is_relative(outside)
        assert resolve(outside, "gs://other/copy") == outside


def test_a_record_round_trips_through_a_move_and_keeps_outside_files_absolute(tmp_path):
    """Written at one path and read at another (the directory copied): files inside come back
    under the new directory, a file kept elsewhere as it was."""
    old, new = tmp_path / "old", tmp_path / "new"
    outside = str(tmp_path / "shared" / "kept.parquet")
    body = {"checkpoint_id": 3, "pipeline": "p", "pipeline_id": "i", "barrier_batch": 2,
            "operators": {"op": {"handles": {"0": {"range": "kg00000-00004", "token": "t",
                                                   "rows": 1, "files": [
                {"path": str(old / "state/op/kg00000-00004/a.parquet"), "kind": "snapshot",
                 "batch": 1, "rows": 1, "bytes": 5, "range": "kg00000-00004"},
                {"path": outside, "kind": "changelog", "batch": 2, "rows": 1, "bytes": 5,
                 "range": "kg00000-00004"}]}}}}}
    CheckpointStorage(str(old / "checkpoints")).write_metadata(3, body)
    assert body["operators"]["op"]["handles"]["0"]["files"][0]["path"].startswith(str(old))
    stored = json.loads((old / "checkpoints/chk-00000003/_metadata.json").read_text())
    assert [f["path"] for f in stored["operators"]["op"]["handles"]["0"]["files"]] == \
        ["state/op/kg00000-00004/a.parquet", outside]
    shutil.copytree(old, new)
    read = CheckpointStorage(f"file://{new}/checkpoints").read_metadata(3)
    assert [f["path"] for f in read["operators"]["op"]["handles"]["0"]["files"]] == \
        [str(new / "state/op/kg00000-00004/a.parquet"), outside]


def test_a_format_1_path_is_read_from_this_directory_only_when_it_holds_the_file(tmp_path):
    """Absolute paths of another directory (spark.ckpt.checkpoint.dir kept the checkpoints
    apart from the state) stay as they are unless this directory has the same file."""
    elsewhere = "/pipelines/p/state/op/kg00000-00004/b000000000001-snapshot-t.parquet"
    record = {"operators": {"op": {"handles": {"0": {"files": [{"path": elsewhere}]}}}}}
    assert moved_roots(record, str(tmp_path)) == {}
    copy = tmp_path / "state/op/kg00000-00004/b000000000001-snapshot-t.parquet"
    copy.parent.mkdir(parents=True)
    copy.write_bytes(b"x")
    assert moved_roots(record, str(tmp_path)) == {"/pipelines/p": str(tmp_path)}


def test_a_copied_queue_pipeline_reads_its_own_write_ahead_log(spark, tmp_path):
    """Allocations name write-ahead blocks by the path they had when received; a copy reads
    each block by its number from its own log, and a batch replayed after the move reads the
    copy's blocks (the original is gone)."""

    def start(ckpt: Path, got: dict[int, list[int]]):
        ctx = StreamingContext(spark, 0.05, str(ckpt), "queued",
                               settings=Settings(progress="never"))
        q = ctx.queue_stream("q", "id BIGINT, name STRING")
        q.foreach_batch(lambda df, b: got.setdefault(b, []).extend(
            r.id for r in df.collect()), name="ids")
        q.source.bind(ctx)
        return ctx, q

    first: dict[int, list[int]] = {}
    ctx, q = start(tmp_path / "a", first)
    q.source.push([(1, "a"), (2, "b")])
    q.source.push([(3, "c")])
    ctx.process_available(timeout=120)
    assert sorted(i for ids in first.values() for i in ids) == [1, 2, 3]
    last_batch = max(first)
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    shutil.rmtree(tmp_path / "a")
    # as if the driver died after the batch ran but before its commit record: it replays
    os.unlink(tmp_path / "b" / "commits" / f"{last_batch:012d}.json")

    again: dict[int, list[int]] = {}
    ctx, q = start(tmp_path / "b", again)
    q.source.push([(4, "d")])
    ctx.process_available(timeout=120)
    assert sorted(again.pop(last_batch)) == sorted(first[last_batch])  # read from the copy
    assert sorted(i for ids in again.values() for i in ids) == [4]
