"""The streaming runtime on the shared session: template, sources, sinks, scheduler, progress."""

from __future__ import annotations

from spark_ckpt.storage.delta_reader import read_delta
import json
import os
import shutil
import socket
import threading
import time

import orders_data
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from deltalake import DeltaTable, write_deltalake
from pyspark.sql import functions as F

from spark_ckpt import (
    JobDefinitionError,
    JobFencedError,
    PipelineFailedError,
    Settings,
    SourceError,
    StreamingContext,
    StreamingListener,
)

SETTINGS = Settings(progress="never")


def make_ctx(spark, tmp_path, name="p", interval=0.2, **settings):
    return StreamingContext(spark, interval, str(tmp_path / "ckpt"), name,
                            settings=Settings(progress="never", **settings))


def collect(pq_dir):
    return sorted(pq.read_table(pq_dir).column("id").to_pylist())


# -- the template --------------------------------------------------------------------------
def test_each_batch_computes_only_what_outputs_reach_each_stream_once(spark, tmp_path):
    ctx = make_ctx(spark, tmp_path)
    calls: dict[str, list[int]] = {"shared": [], "unreached": []}

    def shared(df):
        calls["shared"].append(1)
        return df.where("value > 10")

    def unreached(df):
        calls["unreached"].append(1)
        return df

    gen = ctx.generator_stream("gen", rows_per_batch=100, total_rows=300)
    base = gen.transform(shared, name="shared")
    gen.transform(unreached, name="unreached").select("id")  # no output reaches it
    base.select("id").write_parquet(str(tmp_path / "a"), name="a")
    base.select("id", "key").write_parquet(str(tmp_path / "b"), name="b")
    progress = ctx.process_available(timeout=120)
    assert [p["batch_id"] for p in progress] == [0, 1, 2]
    assert calls["unreached"] == []
    assert len(calls["shared"]) == 3  # once per batch although two outputs read it
    for p in progress:
        computed = p["streams_computed"]
        assert len(computed) == len(set(computed))
        assert not any(c.startswith("unreached") for c in computed)
    assert collect(tmp_path / "a") == collect(tmp_path / "b")


def test_cycles_foreign_streams_and_missing_outputs_are_refused(spark, tmp_path):
    ctx = make_ctx(spark, tmp_path / "one")
    other = make_ctx(spark, tmp_path / "two", name="other")
    a = ctx.generator_stream("gen", rows_per_batch=10)
    b = other.generator_stream("gen", rows_per_batch=10)
    with pytest.raises(JobDefinitionError, match="another StreamingContext"):
        a.join(b, "id")
    with pytest.raises(JobDefinitionError, match="no outputs"):
        ctx.start()
    ctx2 = make_ctx(spark, tmp_path / "three", name="cyc")
    x = ctx2.generator_stream("gen", rows_per_batch=10)
    y = x.select("id")
    z = y.select("id")
    z.foreach_batch(lambda df, b: None, name="out")
    x.parents = (z,)  # streams are built parent-first; only tampering makes a cycle
    with pytest.raises(JobDefinitionError, match="cycle"):
        ctx2.start()
    with pytest.raises(JobDefinitionError, match="already exists"):
        y.foreach_batch(lambda df, b: None, name="out")


def test_union_join_static_join_and_window(spark, tmp_path):
    ctx = make_ctx(spark, tmp_path)
    a = ctx.generator_stream("a", rows_per_batch=50, total_rows=200)
    b = ctx.generator_stream("b", rows_per_batch=50, total_rows=200, seed=7)
    static = spark.range(0, 1000).select(F.col("id").alias("key"),
                                         (F.col("id") % 3).alias("bucket"))
    seen: dict[str, dict[int, int]] = {"union": {}, "join": {}, "static": {}, "window": {}}

    def record(kind):
        return lambda df, batch: seen[kind].__setitem__(batch, df.count())

    a.union(b).foreach_batch(record("union"), name="union")
    a.join(b.select("id", F.col("value").alias("v2")), "id").foreach_batch(record("join"),
                                                                          name="join")
    a.join_static(static, "key").foreach_batch(record("static"), name="static")
    a.window(3, slide=2).foreach_batch(record("window"), name="window")
    ctx.process_available(timeout=120)
    assert seen["union"] == {0: 100, 1: 100, 2: 100, 3: 100}
    assert seen["join"] == {0: 50, 1: 50, 2: 50, 3: 50}
    assert seen["static"] == {0: 50, 1: 50, 2: 50, 3: 50}
    assert seen["window"] == {1: 100, 3: 150}  # batches 0-1, then 1-3


# -- sources -------------------------------------------------------------------------------
def _drop(landing, n, first=0, rows=100, fmt="parquet", **kw):
    return orders_data.drop_order_files(str(landing), files=n, first_file=first,
                                        rows_per_file=rows, fmt=fmt, **kw)


def _ids(df, batch, into):
    into[batch] = sorted(r.order_id for r in df.select("order_id").collect())


def test_file_source_limits_order_and_exact_offsets(spark, tmp_path):
    landing = tmp_path / "landing"
    paths = _drop(landing, 5)
    # stable order is (modification time, path): make file 4 the oldest
    os.utime(paths[4], (1_000_000_000, 1_000_000_000))
    ctx = make_ctx(spark, tmp_path)
    got: dict[int, list[int]] = {}
    ctx.file_stream("orders", str(landing), "parquet", max_files_per_batch=2) \
        .foreach_batch(lambda df, b: _ids(df, b, got), name="ids")
    progress = ctx.process_available(timeout=120)
    assert [p["num_input_rows"] for p in progress] == [200, 200, 100]
    assert got[0] == list(range(0, 100)) + list(range(400, 500))
    assert got[1] == list(range(100, 300))
    assert got[2] == list(range(300, 400))
    recorded = json.loads((tmp_path / "ckpt" / "allocations" / "000000000001.json").read_text())
    assert [os.path.basename(f[0]) for f in recorded["pieces"]["orders"]["files"]] == \
        ["orders-000001.parquet", "orders-000002.parquet"]

    # bytes limit: at least one file, then as many as fit
    size = os.path.getsize(paths[0])
    ctx2 = StreamingContext(spark, 0.2, str(tmp_path / "ckpt2"), "p2", settings=SETTINGS)
    ctx2.file_stream("orders", str(landing), "parquet", max_bytes_per_batch=int(size * 1.5)) \
        .foreach_batch(lambda df, b: None, name="n")
    assert len(ctx2.process_available(timeout=120)) == 5

    # a restart picks up only new files
    _drop(landing, 2, first=5)
    ctx3 = make_ctx(spark, tmp_path)
    got3: dict[int, list[int]] = {}
    ctx3.file_stream("orders", str(landing), "parquet", max_files_per_batch=2) \
        .foreach_batch(lambda df, b: _ids(df, b, got3), name="ids")
    ctx3.process_available(timeout=120)
    assert got3 == {3: list(range(500, 700))}


def test_malformed_parquet_file_stops_with_its_name_and_nothing_allocated(spark, tmp_path):
    landing = tmp_path / "landing"
    _drop(landing, 1)
    (landing / "zz-broken.parquet").write_bytes(b"not parquet at all")
    os.utime(landing / "zz-broken.parquet", (2_000_000_000, 2_000_000_000))
    ctx = make_ctx(spark, tmp_path)
    ctx.file_stream("orders", str(landing), "parquet", max_files_per_batch=1) \
        .foreach_batch(lambda df, b: None, name="n")
    with pytest.raises(PipelineFailedError, match="zz-broken.parquet") as info:
        ctx.process_available(timeout=120)
    assert isinstance(info.value.__cause__, SourceError)
    allocated = sorted(os.listdir(tmp_path / "ckpt" / "allocations"))
    assert allocated == ["000000000000.json"]  # the good file only
    # moved away, the pipeline goes on where it stopped
    (landing / "zz-broken.parquet").unlink()
    _drop(landing, 1, first=1)
    ctx2 = make_ctx(spark, tmp_path)
    got: dict[int, list[int]] = {}
    ctx2.file_stream("orders", str(landing), "parquet", max_files_per_batch=1) \
        .foreach_batch(lambda df, b: _ids(df, b, got), name="n")
    ctx2.process_available(timeout=120)
    assert got == {1: list(range(100, 200))}


def test_json_and_csv_bad_rows_go_to_the_dead_letter_table(spark, tmp_path):
    landing = tmp_path / "landing"
    _drop(landing, 2, rows=100, fmt="json", malformed_every=10)
    csv = tmp_path / "csv"
    csv.mkdir()
    (csv / "a.csv").write_text("1,x,2.5\n2,y,notanumber\n3,z\n4,w,1.0\n")
    ctx = make_ctx(spark, tmp_path)
    got: dict[int, list[int]] = {}
    ctx.file_stream("orders", str(landing), "json", schema=orders_data.ORDER_EVENT_SCHEMA) \
        .foreach_batch(lambda df, b: _ids(df, b, got), name="ids")
    rows: list = []
    ctx.file_stream("csv", str(csv), "csv", schema="id INT, name STRING, score DOUBLE") \
        .foreach_batch(lambda df, b: rows.extend(df.collect()), name="csv")
    progress = ctx.process_available(timeout=120)
    assert progress[0]["sources"]["orders"] == {"input_rows": 200, "dead_letter_rows": 20}
    assert progress[0]["sources"]["csv"] == {"input_rows": 4, "dead_letter_rows": 2}
    assert len(got[0]) == 180 and all(i % 10 != 9 for i in got[0])
    assert sorted(r.id for r in rows) == [1, 4]
    dead = read_delta(str(tmp_path / "ckpt" / "deadletter")).to_pandas()
    assert sorted(dead.groupby("source").size().to_dict().items()) == [("csv", 2), ("orders", 20)]
    assert dead.record.str.contains("oops").sum() == 20
    assert set(dead.batch_id) == {0}


def test_json_source_requires_a_schema(spark, tmp_path):
    ctx = make_ctx(spark, tmp_path)
    with pytest.raises(JobDefinitionError, match="needs a schema"):
        ctx.file_stream("j", str(tmp_path), "json")
    with pytest.raises(JobDefinitionError, match="expected a format"):
        ctx.file_stream("x", str(tmp_path), "avro")


def test_delta_source_reads_each_new_version_and_refuses_rewrites(spark, tmp_path):
    table = str(tmp_path / "src")
    write_deltalake(table, pa.table({"id": [0, 1], "p": ["a", "b"]}), partition_by=["p"])
    write_deltalake(table, pa.table({"id": [2], "p": ["a"]}), mode="append", partition_by=["p"])
    ctx = make_ctx(spark, tmp_path)
    got: dict[int, list] = {}
    ctx.delta_stream("src", table, max_versions_per_batch=1).foreach_batch(
        lambda df, b: got.__setitem__(b, sorted((r.id, r.p) for r in df.collect())), name="o")
    progress = ctx.process_available(timeout=120)
    # the first batch is the table's snapshot (versions 0-1), whatever max_versions_per_batch
    assert got == {0: [(0, "a"), (1, "b"), (2, "a")]}
    assert [p["num_input_rows"] for p in progress] == [3]
    write_deltalake(table, pa.table({"id": [3], "p": ["b"]}), mode="append", partition_by=["p"])
    write_deltalake(table, pa.table({"id": [9], "p": ["b"]}), mode="overwrite",
                    partition_by=["p"])
    ctx2 = make_ctx(spark, tmp_path)
    got2: dict[int, list] = {}
    ctx2.delta_stream("src", table, max_versions_per_batch=1).foreach_batch(
        lambda df, b: got2.__setitem__(b, sorted(r.id for r in df.collect())), name="o")
    with pytest.raises(PipelineFailedError, match="append-only"):
        ctx2.process_available(timeout=120)
    assert got2 == {1: [3]}


def test_generator_offsets_replay_identically(spark, tmp_path):
    ctx = make_ctx(spark, tmp_path)
    seen: dict[int, list] = {}
    ctx.generator_stream("g", rows_per_batch=7, total_rows=20).foreach_batch(
        lambda df, b: seen.__setitem__(b, sorted(map(tuple, df.collect()))), name="o")
    ctx.process_available(timeout=120)
    assert [len(seen[b]) for b in sorted(seen)] == [7, 7, 6]
    allocations = [json.loads((tmp_path / "ckpt" / "allocations" / f"{b:012d}.json").read_text())
                   ["pieces"]["g"] for b in range(3)]
    assert [(a["start"], a["end"]) for a in allocations] == [(0, 7), (7, 14), (14, 20)]
    from spark_ckpt.streaming.template.batch_run import BatchRun

    again = BatchRun(ctx, ctx.allocation(1))
    replayed = sorted(map(tuple, again.get_or_compute(ctx.graph.inputs[0]).collect()))
    assert replayed == seen[1]


def test_queue_blocks_are_written_ahead_and_survive_a_restart(spark, tmp_path):
    ctx = make_ctx(spark, tmp_path, interval=3600)
    q = ctx.queue_stream("q", "id BIGINT, name STRING")
    q.write_parquet(str(tmp_path / "out"), name="out")
    q.source.bind(ctx)  # blocks can be pushed before start: they are durable at once
    assert q.source.push([(1, "a"), (2, "b")]) == 0
    assert q.source.push([{"id": 3, "name": "c"}]) == 1
    with pytest.raises(SourceError, match="expected rows"):
        q.source.push([("x", "y", "z")])
    wal = sorted(os.listdir(tmp_path / "ckpt" / "receivedData" / "q"))
    assert wal == ["000000000000.parquet", "000000000001.parquet"]
    # a new driver on the same checkpoint finds both blocks unallocated
    ctx2 = make_ctx(spark, tmp_path)
    q2 = ctx2.queue_stream("q", "id BIGINT, name STRING")
    q2.write_parquet(str(tmp_path / "out"), name="out")
    progress = ctx2.process_available(timeout=120)
    assert progress[0]["num_input_rows"] == 3
    assert collect(tmp_path / "out") == [1, 2, 3]


def test_socket_receiver_writes_lines_ahead(spark, tmp_path):
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    port = server.getsockname()[1]

    lines: list[str] = []
    done = threading.Event()

    def serve():
        conn, _ = server.accept()
        with conn:
            conn.sendall(b"alpha\nbeta\r\ngam")
            # the rest of the line only once the first two lines went through a batch: the
            # partial "gam" must wait in the receiver across blocks and batches
            if _wait(lambda: len(lines) >= 2, 60):
                conn.sendall(b"ma\n")
            done.wait(60)  # keep the connection open until the test has its answer

    threading.Thread(target=serve, daemon=True).start()
    ctx = make_ctx(spark, tmp_path, interval=0.3, stream_receiver_block_interval_ms=100)
    ctx.socket_stream("sock", "127.0.0.1", port).foreach_batch(
        lambda df, b: lines.extend(r.value for r in df.collect()), name="o")
    ctx.start()
    try:
        assert _wait(lambda: len(lines) >= 3, 60)
    finally:
        done.set()
        ctx.stop()
        server.close()
    assert lines == ["alpha", "beta", "gamma"]


def _wait(predicate, timeout):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return False


# -- sinks, scheduler, progress -------------------------------------------------------------
def test_rerun_batches_do_not_duplicate_delta_or_parquet_output(spark, tmp_path):
    ctx = make_ctx(spark, tmp_path)
    g = ctx.generator_stream("g", rows_per_batch=10, total_rows=30)
    g.write_delta(str(tmp_path / "delta"), name="d")
    g.write_parquet(str(tmp_path / "pq"), name="p", partition_by=["key"])
    ctx.process_available(timeout=120)
    # forget that batches 1 and 2 finished: a restart reruns them over the same rows
    for b in (1, 2):
        (tmp_path / "ckpt" / "commits" / f"{b:012d}.json").unlink()
    ctx2 = make_ctx(spark, tmp_path)
    g2 = ctx2.generator_stream("g", rows_per_batch=10, total_rows=30)
    g2.write_delta(str(tmp_path / "delta"), name="d")
    g2.write_parquet(str(tmp_path / "pq"), name="p", partition_by=["key"])
    progress = ctx2.process_available(timeout=120)
    assert [(p["batch_id"], p["recovered"]) for p in progress] == [(1, True), (2, True)]
    assert all(o == {"skipped": "already committed"} for p in progress
               for o in p["outputs"].values())
    delta = DeltaTable(str(tmp_path / "delta"))
    assert sorted(read_delta(delta.table_uri).column("id").to_pylist()) == list(range(30))
    lineage = f"p-{json.loads((tmp_path / 'ckpt' / 'metadata.json').read_text())['pipeline_id']}"
    assert delta.transaction_version(f"spark_ckpt/{lineage}/d") == 3
    assert sorted(spark.read.parquet(str(tmp_path / "pq")).select("id").toPandas().id) == \
        list(range(30))


def test_progress_listeners_job_groups_and_json_lines(spark, tmp_path):
    events: list[tuple[str, object]] = []

    class Listener(StreamingListener):
        def on_batch_started(self, info):
            events.append(("started", info["batch_id"]))

        def on_batch_completed(self, progress):
            events.append(("completed", progress["batch_id"]))

        def on_pipeline_terminated(self, error):
            events.append(("terminated", error))

    ctx = make_ctx(spark, tmp_path, name="prog")
    ctx.add_listener(Listener())
    ctx.generator_stream("g", rows_per_batch=1000, total_rows=2000).write_parquet(
        str(tmp_path / "out"), name="out")
    progress = ctx.process_available(timeout=120)
    assert events == [("started", 0), ("completed", 0), ("started", 1), ("completed", 1),
                      ("terminated", None)]
    p = progress[-1]
    assert p["num_input_rows"] == 1000 and p["processed_rows_per_second"] > 0
    assert set(p["durations_ms"]) >= {"allocation", "planning", "output.out", "commit", "total"}
    lines = (tmp_path / "ckpt" / "progress" / "progress.jsonl").read_text().splitlines()
    assert [json.loads(line)["batch_id"] for line in lines] == [0, 1]
    tracker = spark.sparkContext.statusTracker()
    assert tracker.getJobIdsForGroup("spark_ckpt-prog-b1")


def test_a_failing_batch_stops_the_pipeline_with_its_error(spark, tmp_path):
    ctx = make_ctx(spark, tmp_path)

    def boom(df, batch):
        if batch == 1:
            raise ValueError("bad batch")

    ctx.generator_stream("g", rows_per_batch=5, total_rows=50).foreach_batch(boom, name="b")
    with pytest.raises(PipelineFailedError, match="batch 1 failed.*bad batch"):
        ctx.process_available(timeout=120)
    assert sorted(os.listdir(tmp_path / "ckpt" / "commits")) == ["000000000000.json"]


def test_stop_graceful_and_await_termination_timeout(spark, tmp_path):
    ctx = make_ctx(spark, tmp_path, interval=0.2)
    slow_started = threading.Event()
    release = threading.Event()

    def slow(df, batch):
        slow_started.set()
        assert release.wait(60)

    ctx.generator_stream("g", rows_per_batch=5).foreach_batch(slow, name="s")
    ctx.start()
    assert not ctx.await_termination(timeout=0.3)
    assert slow_started.wait(30)
    stopper = threading.Thread(target=ctx.stop, kwargs={"graceful": True, "timeout": 60})
    stopper.start()
    # the stop waits for the running batch: let it finish only once the stop has begun
    assert _wait(lambda: ctx.loop.stopping.is_set(), 30)
    release.set()
    stopper.join(60)
    assert ctx.await_termination(0)
    committed = sorted(os.listdir(tmp_path / "ckpt" / "commits"))
    assert committed  # the running batch finished before the stop
    last = ctx.last_progress["batch_id"]
    assert committed[-1] == f"{last:012d}.json"


def test_a_second_driver_on_the_same_checkpoint_is_fenced(spark, tmp_path):
    first = make_ctx(spark, tmp_path, interval=0.2)
    first.generator_stream("g", rows_per_batch=5).foreach_batch(lambda df, b: None, name="o")
    first.start()
    assert _wait(lambda: first.last_progress is not None, 60)
    second = make_ctx(spark, tmp_path, interval=3600)  # claims a newer run
    second.generator_stream("g", rows_per_batch=5).foreach_batch(lambda df, b: None, name="o")
    second._claim.write_metadata()
    second._claim.claim()
    with pytest.raises(JobFencedError, match="newer driver"):
        first.await_termination(timeout=60)


def test_changed_sources_under_a_checkpoint_are_refused(spark, tmp_path):
    ctx = make_ctx(spark, tmp_path)
    ctx.generator_stream("g", rows_per_batch=5, total_rows=5).foreach_batch(
        lambda df, b: None, name="o")
    ctx.process_available(timeout=120)
    ctx2 = make_ctx(spark, tmp_path)
    ctx2.generator_stream("other", rows_per_batch=5).foreach_batch(lambda df, b: None, name="o")
    with pytest.raises(JobDefinitionError, match="sources cannot change"):
        ctx2.start()
    shutil.rmtree(tmp_path / "ckpt")


def test_old_records_are_purged_and_restart_still_skips_seen_files(spark, tmp_path):
    landing = tmp_path / "landing"
    _drop(landing, 12, rows=10)
    ctx = make_ctx(spark, tmp_path, stream_min_batches_to_retain=3)
    ctx.file_stream("orders", str(landing), "parquet", max_files_per_batch=1) \
        .write_parquet(str(tmp_path / "out"), name="out")
    assert len(ctx.process_available(timeout=180)) == 12
    ckpt = tmp_path / "ckpt"
    # purged at batch 10 below batch 8: records 8..11 remain, earlier files are in a snapshot
    assert sorted(os.listdir(ckpt / "allocations"))[0] == "000000000008.json"
    assert sorted(os.listdir(ckpt / "commits"))[0] == "000000000008.json"
    assert os.listdir(ckpt / "sources" / "orders") == ["seen-000000000008.parquet"]
    markers = sorted(os.listdir(tmp_path / "out" / "_spark_ckpt_commits"))
    assert len(markers) == 4 and markers[0].endswith("-v00009.json")  # batches 8..11 only
    _drop(landing, 1, first=12, rows=10)
    ctx2 = make_ctx(spark, tmp_path, stream_min_batches_to_retain=3)
    ctx2.file_stream("orders", str(landing), "parquet", max_files_per_batch=1) \
        .write_parquet(str(tmp_path / "out"), name="out")
    progress = ctx2.process_available(timeout=120)
    assert [p["batch_id"] for p in progress] == [12]
    ids = sorted(spark.read.parquet(str(tmp_path / "out")).toPandas().order_id)
    assert ids == list(range(130))


def test_stop_now_cancels_the_running_batch_which_reruns_on_restart(spark, tmp_path):
    ctx = make_ctx(spark, tmp_path, interval=0.2)
    running = threading.Event()

    def slow(df, batch):
        running.set()

        def sleepy(rows):
            time.sleep(60)
            return iter([])

        df.rdd.mapPartitions(sleepy).count()

    ctx.generator_stream("g", rows_per_batch=5, partitions=1).foreach_batch(slow, name="s")
    ctx.start()
    assert running.wait(60)
    tracker = spark.sparkContext.statusTracker()

    def task_running():  # the Spark job of batch 0 has a task running (sleeping)
        if not tracker.getJobIdsForGroup("spark_ckpt-p-b0"):
            return False
        return any(getattr(tracker.getStageInfo(s), "numActiveTasks", 0)
                   for s in tracker.getActiveStageIds())

    assert _wait(task_running, 60)
    started = time.monotonic()
    ctx.stop(graceful=False, timeout=60)
    assert time.monotonic() - started < 30
    assert ctx.await_termination(0)  # stopped on request: no error
    assert not (tmp_path / "ckpt" / "commits" / "000000000000.json").exists()
    assert (tmp_path / "ckpt" / "allocations" / "000000000000.json").exists()
