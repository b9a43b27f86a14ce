"""Hostile names and paths: a name that would become a path segment outside its directory is
refused clearly; odd characters in user paths work."""

from __future__ import annotations

import json

import pytest

from spark_ckpt import (
    BatchJob,
    CheckpointError,
    JobDefinitionError,
    Settings,
    StreamingContext,
)
from spark_ckpt.names import check_name


@pytest.mark.parametrize("name", ["orders", "orders-daily", "v2.1", "a_b", "2026-11-23",
                                  "zählung", "訂單"])
def test_plain_names_are_accepted(name):
    assert check_name("name", name) == name


@pytest.mark.parametrize("name", [
    "", "..", "../escape", "a/b", "a\\b", "a\x00b", " a", "a b", ".hidden", "_x", "a#b",
    "50%", "job@key", "x" * 129,
])
def test_names_that_could_leave_their_directory_are_refused(name):
    with pytest.raises(JobDefinitionError, match="source name: expected") as info:
        check_name("source name", name)
    assert f"found {name!r}" in str(info.value)


def test_a_streaming_source_named_to_escape_the_checkpoint_is_refused(spark, tmp_path):
    ctx = StreamingContext(spark, 0.1, str(tmp_path / "ckpt"), "p",
                           settings=Settings(progress="never", batch_exchange_min_bytes=0))
    with pytest.raises(JobDefinitionError, match=r"source name: expected .*'\.\./up'"):
        ctx.queue_stream("../up", "id BIGINT")
    with pytest.raises(JobDefinitionError, match="output name"):
        ctx.generator_stream("g", rows_per_batch=1).foreach_batch(lambda df, b: None,
                                                                   name="../out")
    with pytest.raises(JobDefinitionError, match="pipeline name"):
        StreamingContext(spark, 0.1, str(tmp_path / "ckpt"), "a b")


def test_batch_ids_and_vertex_names_are_checked(spark, tmp_path):
    with pytest.raises(JobDefinitionError, match="job id"):
        BatchJob("..", spark=spark, work_dir=str(tmp_path))
    with pytest.raises(JobDefinitionError, match="run key"):
        BatchJob("daily", run_key="2026/11/23")
    job = BatchJob("j", spark=spark, work_dir=str(tmp_path))
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.json").write_text(json.dumps({"id": 1}) + "\n")
    with pytest.raises(JobDefinitionError, match="vertex id"):
        job.read_files("../src", str(tmp_path / "in"), format="json", schema="id BIGINT")


def test_a_pipeline_on_paths_with_spaces_and_non_ascii_characters(spark, tmp_path):
    base = tmp_path / "landing zone ü"
    base.mkdir()
    (base / "part 1.json").write_text("".join(json.dumps({"id": i}) + "\n" for i in range(5)))
    ctx = StreamingContext(spark, 0.1, str(tmp_path / "check point é"), "odd",
                           settings=Settings(progress="never", batch_exchange_min_bytes=0))
    got: list[int] = []
    ctx.file_stream("f", str(base), "json", schema="id BIGINT").foreach_batch(
        lambda df, b: got.extend(r.id for r in df.collect()), name="o")
    ctx.process_available(timeout=120)
    assert sorted(got) == list(range(5))


# == hostile input files (issue 9) ============================================================
# Each test compares with what plain Spark does on the same files and options, where
# spark_ckpt stands in for Spark, and otherwise expects a clear error that loses nothing.
import os  # noqa: E402
import shutil  # noqa: E402
import socket  # noqa: E402
import threading  # noqa: E402
from pathlib import Path  # noqa: E402

import pyarrow as pa  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402
from helpers import wait_for  # noqa: E402

from spark_ckpt import InputChangedError, PipelineFailedError, SourceError  # noqa: E402
from spark_ckpt.sources.job_inputs import FileSource  # noqa: E402
from spark_ckpt.storage.delta_reader import read_delta  # noqa: E402
from spark_ckpt.errors import RecordError  # noqa: E402
from spark_ckpt.formats import load_record  # noqa: E402
from spark_ckpt.sources.receivers import SocketSource  # noqa: E402

QUIET = Settings(progress="never", event_log_flush_interval_ms=200,
                 batch_exchange_min_bytes=0)
BASE = pa.table({"id": pa.array([1, 2], pa.int64()), "v": pa.array(["a", "b"])})
DRIFT = {  # one file each: how a later file differs from BASE
    "added": pa.table({"id": pa.array([3], pa.int64()), "v": pa.array(["c"]),
                       "x": pa.array([1.5])}),
    "retyped": pa.table({"id": pa.array(["3"]), "v": pa.array(["c"])}),
    "renamed": pa.table({"id": pa.array([3], pa.int64()), "w": pa.array(["c"])}),
}
GOOD = pa.table({"id": pa.array([4, 5], pa.int64()), "v": pa.array(["d", "e"])})


def copy_job(spark, tmp_path: Path, landing: Path, name: str,
             options: dict | None = None) -> BatchJob:
    """A batch job that copies the Parquet files in ``landing`` to ``tmp_path / name``."""
    j = BatchJob(name, spark=spark, work_dir=str(tmp_path / "work"), settings=QUIET)
    src = j.read_files("in", str(landing), format="parquet", options=options, parallelism=2)
    j.write_parquet(j.vertex("out", lambda df: df, src), str(tmp_path / name))
    return j


def put(path: Path, table: pa.Table, mtime: int) -> Path:
    """Write a Parquet file aside and move it in, with a modification time (ordering)."""
    tmp = path.parent / f".{path.name}.tmp"
    pq.write_table(table, tmp)
    os.utime(tmp, (mtime, mtime))
    tmp.rename(path)
    return path


def rows(df) -> list[tuple]:
    return sorted((tuple(r) for r in df.collect()), key=repr)


def spark_fails(fn) -> bool:
    try:
        fn()
    except Exception:  # noqa: BLE001 - Spark's own answer, whatever its error class
        return True
    return False


def file_pipeline(spark, tmp_path, landing, *, schema=None, options=None, fmt="parquet",
                  name="drift"):
    ctx = StreamingContext(spark, 0.1, str(tmp_path / f"ckpt-{name}"), name, settings=QUIET)
    ctx.file_stream("f", str(landing), fmt, schema=schema, options=options).write_parquet(
        str(tmp_path / f"out-{name}"), name="o")
    return ctx


def out_rows(spark, tmp_path, name="drift") -> list[tuple]:
    out = tmp_path / f"out-{name}"
    if not any(out.glob("*.parquet")):
        return []
    return rows(spark.read.parquet(str(out)).select("id", "v"))


# -- 1. schema drift -------------------------------------------------------------------------
def test_streaming_parquet_drift_stops_before_allocation_and_a_restart_loses_nothing(
        spark, tmp_path):
    """Without a declared schema the source's schema is the first file's: a later file with a
    column added, retyped or renamed stops the pipeline before anything is allocated from it,
    naming the file and both schemas; once it is moved out, a restart goes on with every row
    of the other files once."""
    landing = tmp_path / "landing"
    landing.mkdir()
    put(landing / "a.parquet", BASE, 1_000)
    file_pipeline(spark, tmp_path, landing).process_available(timeout=120)
    assert out_rows(spark, tmp_path) == [(1, "a"), (2, "b")]
    for i, (case, table) in enumerate(DRIFT.items()):
        bad = put(landing / f"b-{case}.parquet", table, 2_000 + i)
        ctx = file_pipeline(spark, tmp_path, landing)
        with pytest.raises(PipelineFailedError) as info:
            ctx.process_available(timeout=120)
        cause = info.value.__cause__
        assert isinstance(cause, SourceError), info.value
        text = str(cause)
        assert str(bad) in text and "expected struct<id:bigint,v:string>" in text, text
        assert "found struct<" in text and {"added": "added", "retyped": "column id is string",
                                            "renamed": "column v is missing"}[case] in text
        allocations = sorted(p.name for p in (tmp_path / "ckpt-drift" / "allocations").iterdir())
        assert allocations == ["000000000000.json"], "a batch was allocated from a bad file"
        bad.unlink()  # the user moves it out
    put(landing / "c.parquet", GOOD, 3_000)
    file_pipeline(spark, tmp_path, landing).process_available(timeout=120)
    assert out_rows(spark, tmp_path) == [(1, "a"), (2, "b"), (4, "d"), (5, "e")]


def test_streaming_declared_schema_reads_drift_as_spark_does(spark, tmp_path):
    """With a declared schema, Spark's answer: an added column is ignored, a renamed one reads
    as null, a lossless widening is read; a type Spark cannot read is refused at allocation
    (where Spark itself would fail the batch), naming the file."""
    landing = tmp_path / "landing"
    landing.mkdir()
    put(landing / "a.parquet", BASE, 1_000)
    put(landing / "b.parquet", DRIFT["added"], 2_000)
    put(landing / "c.parquet", DRIFT["renamed"], 3_000)
    put(landing / "d.parquet", pa.table({"id": pa.array([6], pa.int32()), "v": ["f"]}), 4_000)
    schema = "id BIGINT, v STRING"
    file_pipeline(spark, tmp_path, landing, schema=schema).process_available(timeout=120)
    want = rows(spark.read.schema(schema).parquet(str(landing)))
    assert out_rows(spark, tmp_path) == want and (3, None) in want
    # mergeSchema=true without a schema: the first file's schema, read the same way
    file_pipeline(spark, tmp_path, landing, options={"mergeSchema": "true"},
                  name="merge").process_available(timeout=120)
    assert out_rows(spark, tmp_path, "merge") == want
    bad = put(landing / "e.parquet", DRIFT["retyped"], 5_000)
    assert spark_fails(lambda: spark.read.schema(schema).parquet(str(bad)).collect())
    with pytest.raises(PipelineFailedError, match="column id is string, expected bigint"):
        file_pipeline(spark, tmp_path, landing, schema=schema).process_available(timeout=120)


def test_batch_parquet_drift_is_refused_unless_the_options_say_how(spark, tmp_path):
    """spark.read.parquet(dir) takes one file's schema and reads a renamed column as null,
    silently; a BatchJob refuses the drifted file before any partition runs, naming it. With
    mergeSchema=true it gives Spark's answer; after the file is moved out, the same job
    runs and reads every other row once."""
    landing = tmp_path / "landing"
    landing.mkdir()
    put(landing / "a.parquet", BASE, 1_000)
    bad = put(landing / "b.parquet", DRIFT["renamed"], 2_000)
    silent = rows(spark.read.parquet(str(landing)))
    assert silent[0][1] is None or silent[-1][-1] is None  # Spark: nulls, no error

    def job(name, options=None):
        return copy_job(spark, tmp_path, landing, name, options)

    with pytest.raises(SourceError) as info:
        job("strict").run()
    text = str(info.value)
    named = [(f, x, y) for f, x, y in ((bad, "v", "w"), (landing / "a.parquet", "w", "v"))
             if str(f) in text]  # Spark inferred the schema from a.parquet or from b.parquet
    assert named, text
    _, x, y = named[0]
    assert f"column {x} is missing" in text and f"expected struct<id:bigint,{x}:string>" in \
        text and f"found struct<id:bigint,{y}:string>" in text, text
    assert not list((tmp_path / "strict").glob("*.parquet")), "the sink committed"
    job("merged", {"mergeSchema": "true"}).run()
    assert rows(spark.read.parquet(str(tmp_path / "merged"))) == rows(
        spark.read.option("mergeSchema", "true").parquet(str(landing)))
    bad.unlink()
    for case in ("added", "retyped"):  # Spark infers from either file: either may be named
        other = put(landing / f"c-{case}.parquet", DRIFT[case], 3_000)
        with pytest.raises(SourceError, match=r"does not match the schema .* expected "
                           r"struct<.*found struct<") as info:
            job(f"strict-{case}").run()
        assert str(other) in str(info.value) or str(landing / "a.parquet") in str(info.value)
        other.unlink()
    job("strict").run()
    assert rows(spark.read.parquet(str(tmp_path / "strict"))) == [(1, "a"), (2, "b")]


# -- 2. empty files --------------------------------------------------------------------------
def empty_inputs(directory: Path) -> dict:
    """(path, format, options, schema) of directories with empty files beside a real one."""
    cases = {}
    d = directory / "parquet"
    d.mkdir(parents=True)
    pq.write_table(BASE, d / "a.parquet")
    (d / "b.parquet").write_bytes(b"")  # 0 bytes
    pq.write_table(BASE.slice(0, 0), d / "c.parquet")  # a schema and no rows
    cases["parquet"] = (d, "parquet", {}, None)
    d = directory / "json"
    d.mkdir()
    (d / "a.json").write_text('{"id": 1, "v": "a"}\n')
    (d / "b.json").write_text("")
    (d / "c.json").write_text("\n")
    cases["json"] = (d, "json", {}, "id BIGINT, v STRING")
    d = directory / "csv"
    d.mkdir()
    (d / "a.csv").write_text("id,v\n1,a\n")
    (d / "b.csv").write_text("id,v\n")  # header only
    (d / "c.csv").write_text("")
    cases["csv"] = (d, "csv", {"header": "true"}, "id BIGINT, v STRING")
    return cases


def test_empty_files_give_spark_reads_answer_batch_and_streaming(spark, tmp_path):
    for case, (path, fmt, options, schema) in empty_inputs(tmp_path / "in").items():
        reader = spark.read.format(fmt).options(**options)
        want = rows((reader.schema(schema) if schema else reader).load(str(path)))
        assert want == [(1, "a"), (2, "b")] if fmt == "parquet" else want == [(1, "a")]
        job = BatchJob(f"empty-{case}", spark=spark, work_dir=str(tmp_path / "work"),
                       settings=QUIET)
        src = job.read_files("in", str(path), format=fmt, options=options, schema=schema,
                             parallelism=2)
        job.write_parquet(job.vertex("out", lambda df: df, src), str(tmp_path / f"b-{case}"))
        job.run()
        assert rows(spark.read.parquet(str(tmp_path / f"b-{case}"))) == want, case
        got: list = []
        ctx = StreamingContext(spark, 0.1, str(tmp_path / f"ckpt-{case}"), f"e-{case}",
                               settings=QUIET)
        ctx.file_stream("f", str(path), fmt, schema=schema, options=options).foreach_batch(
            lambda df, b, got=got: got.extend(tuple(r) for r in df.collect()), name="o")
        ctx.process_available(timeout=120)
        assert sorted(got, key=repr) == want, case


# -- 4. files that vanish between listing and reading ----------------------------------------
def test_a_streaming_batch_whose_file_vanished_fails_clearly_and_commits_nothing(
        spark, tmp_path):
    """Batch 0 is allocated (recorded) and fails before it commits; its file is deleted. The
    restart refuses to run batch 0 without it, naming the file, and commits nothing; with
    spark.sql.files.ignoreMissingFiles=true it runs without it, as Spark's file source does;
    here the file is put back instead and every row lands once."""
    landing = tmp_path / "landing"
    landing.mkdir()
    a = put(landing / "a.parquet", BASE, 1_000)
    put(landing / "b.parquet", GOOD, 2_000)
    gate = {"fail": True}

    def pipeline():
        ctx = StreamingContext(spark, 0.1, str(tmp_path / "ckpt"), "vanish", settings=QUIET)
        f = ctx.file_stream("f", str(landing), "parquet")
        f.write_delta(str(tmp_path / "out"), name="o")

        def gatekeeper(df, batch_id):
            if gate["fail"]:
                raise RuntimeError("the first run dies before batch 0 commits")
        f.foreach_batch(gatekeeper, name="gate")
        return ctx

    with pytest.raises(PipelineFailedError):
        pipeline().process_available(timeout=120)
    assert (tmp_path / "ckpt" / "allocations" / "000000000000.json").exists()
    gate["fail"] = False
    saved = a.read_bytes()
    a.unlink()  # after the allocation, before the batch ran
    with pytest.raises(PipelineFailedError) as info:
        pipeline().process_available(timeout=120)
    assert isinstance(info.value.__cause__, SourceError)
    assert str(a) in str(info.value.__cause__) and "ignoreMissingFiles" in str(info.value.__cause__)
    assert not (tmp_path / "out" / "_delta_log").exists() or \
        len(read_delta(str(tmp_path / "out")).to_pandas()) == 0, "a smaller batch committed"
    a.write_bytes(saved)
    pipeline().process_available(timeout=120)
    got = read_delta(str(tmp_path / "out")).to_pandas()
    assert sorted(got["id"]) == [1, 2, 4, 5]


def test_a_streaming_batch_skips_a_vanished_file_when_spark_would(spark, tmp_path,
                                                                  monkeypatch):
    landing = tmp_path / "landing"
    landing.mkdir()
    a = put(landing / "a.parquet", BASE, 1_000)
    put(landing / "b.parquet", GOOD, 2_000)
    got: list = []
    ctx = StreamingContext(spark, 0.1, str(tmp_path / "ckpt"), "skip", settings=QUIET)
    f = ctx.file_stream("f", str(landing), "parquet",
                        options={"ignoreMissingFiles": "true"})
    real_plan = type(f.source).plan

    def plan_then_delete(self):  # the file vanishes right after it was listed and allocated
        piece = real_plan(self)
        if a.exists() and piece["files"]:
            a.unlink()
        return piece
    monkeypatch.setattr(type(f.source), "plan", plan_then_delete)
    f.foreach_batch(lambda df, b: got.extend(r.id for r in df.collect()), name="o")
    ctx.process_available(timeout=120)
    assert sorted(got) == [4, 5]  # Structured Streaming's answer with ignoreMissingFiles


def test_a_batch_source_file_deleted_after_listing_fails_clearly(spark, tmp_path, monkeypatch):
    """A run lists its files, records them, then reads them: a file deleted in between is an
    InputChangedError naming it and nothing is committed; with ignoreMissingFiles=true the
    run gives Spark's answer (the file is skipped)."""
    landing = tmp_path / "landing"
    landing.mkdir()
    put(landing / "a.parquet", BASE, 1_000)
    gone = put(landing / "b.parquet", GOOD, 2_000)
    real_resolve = FileSource.resolve

    def resolve_then_delete(self, spark_, vertex_id, splits):
        schema = real_resolve(self, spark_, vertex_id, splits)
        gone.unlink(missing_ok=True)  # after the listing is recorded, before any read
        return schema
    monkeypatch.setattr(FileSource, "resolve", resolve_then_delete)

    def job(name, options=None):
        return copy_job(spark, tmp_path, landing, name, options)

    with pytest.raises(InputChangedError) as info:
        job("strict").run()
    assert str(gone) in str(info.value) and "ignoreMissingFiles" in str(info.value)
    assert not list((tmp_path / "strict").glob("*.parquet")), "the sink committed"
    put(gone, GOOD, 2_000)
    job("lenient", {"ignoreMissingFiles": "true"}).run()
    assert rows(spark.read.parquet(str(tmp_path / "lenient"))) == [(1, "a"), (2, "b")]


# -- 3. huge rows ----------------------------------------------------------------------------
HUGE = 20 * 1024 * 1024  # one 20 MiB string: over Spark's JSON maxStringLen (20,000,000)


def test_a_huge_row_through_a_batch_file_source(spark, tmp_path):
    """Parquet and CSV read it whole; JSON gives spark.read's answer, which with the option
    maxStringLen is the whole row too."""
    big = "x" * HUGE
    (tmp_path / "pq").mkdir()
    pq.write_table(pa.table({"id": [1, 2], "s": [big, "small"]}), tmp_path / "pq" / "a.parquet")
    (tmp_path / "json").mkdir()
    (tmp_path / "json" / "a.json").write_text(json.dumps({"id": 1, "s": big}) + "\n"
                                              + json.dumps({"id": 2, "s": "small"}) + "\n")
    for fmt, options in (("parquet", {}), ("json", {"maxStringLen": str(1 << 30)})):
        job = BatchJob(f"huge-{fmt}", spark=spark, work_dir=str(tmp_path / "work"),
                       settings=QUIET)
        src = job.read_files("in", str(tmp_path / ("pq" if fmt == "parquet" else fmt)),
                             format=fmt, options=options,
                             schema=None if fmt == "parquet" else "id BIGINT, s STRING")
        job.write_parquet(job.vertex("out", lambda df: df, src), str(tmp_path / f"o-{fmt}"))
        job.run()
        got = {r.id: r.s for r in spark.read.parquet(str(tmp_path / f"o-{fmt}")).collect()}
        assert got == {1: big, 2: "small"}, fmt


def test_a_huge_json_row_in_a_stream_is_dead_lettered_naming_the_limit(spark, tmp_path):
    """Spark's JSON reader takes a string over maxStringLen for a malformed record: the stream
    sends it whole to the dead-letter table with a reason naming the limit and the option
    (never dropped). With the option set it is read (the batch test shows that)."""
    landing = tmp_path / "landing"
    landing.mkdir()
    big = "y" * HUGE
    (landing / "a.json").write_text(json.dumps({"id": 1, "s": big}) + "\n"
                                    + json.dumps({"id": 2, "s": "small"}) + "\n")
    got: dict = {}
    ctx = StreamingContext(spark, 0.1, str(tmp_path / "ckpt"), "plain", settings=QUIET)
    ctx.file_stream("f", str(landing), "json", schema="id BIGINT, s STRING").foreach_batch(
        lambda df, b: got.update((r.id, r.s) for r in df.collect()), name="o")
    ctx.process_available(timeout=180)
    assert got == {2: "small"}  # as spark.read: the huge row is not a row of the schema
    dead = read_delta(str(tmp_path / "ckpt" / "deadletter")).to_pandas()
    assert len(dead) == 1 and big in dead["record"][0]  # whole, not dropped
    assert "maxStringLen=20000000" in dead["reason"][0] and "set the source option" in \
        dead["reason"][0]


def test_a_huge_row_pushed_to_a_queue_is_read_whole(spark, tmp_path):
    got: dict = {}
    ctx = StreamingContext(spark, 0.1, str(tmp_path / "ckpt"), "q", settings=QUIET)
    stream = ctx.queue_stream("q", "id BIGINT, s STRING")
    stream.foreach_batch(lambda df, b: got.update((r.id, len(r.s)) for r in df.collect()),
                         name="o")
    stream.source.push([(1, "z" * HUGE), (2, "small")])
    ctx.process_available(timeout=120)
    assert got == {1: HUGE, 2: 5}


@pytest.mark.parametrize("limit", [32 << 20, 1 << 20])
def test_a_huge_socket_line_is_whole_under_its_limit_else_cut_with_a_warning_right_away(
        spark, tmp_path, caplog, limit):
    """receiverMaxLineBytes above the line: one row, whole (Spark reads the block). Below it:
    pieces of at most the limit whose concatenation is the line, and the warning naming the
    option comes while the connection is still open, not when it ends."""
    from types import SimpleNamespace

    from spark_ckpt.storage import Storage

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    line = "é" + "w" * (HUGE - 2)
    storage = Storage(str(tmp_path / "ckpt"))
    source = SocketSource("s", "127.0.0.1", server.getsockname()[1])
    source.bind(SimpleNamespace(storage=storage, root=storage.root, settings=Settings(
        progress="never", stream_receiver_max_line_bytes=limit,
        stream_receiver_max_block_bytes=64 << 20, stream_receiver_block_interval_ms=50)))
    done = threading.Event()

    def serve():
        conn, _ = server.accept()
        with conn:
            conn.sendall((line + "\nlast\n").encode())
            done.wait(60)  # the connection stays open until the test has checked

    threading.Thread(target=serve, daemon=True).start()
    caplog.set_level("WARNING", logger="spark_ckpt.sources.receivers")
    source.start()
    try:
        def received():
            blocks = source.plan()["blocks"]
            values = [v for b in blocks for v in pq.read_table(b[1]).column("value").to_pylist()]
            return values if values and values[-1] == "last" else None
        assert wait_for(received, 60, 0.05)
        values = received()
        warned = [r.getMessage() for r in caplog.records if "receiverMaxLineBytes" in
                  r.getMessage()]
        if limit > HUGE:
            assert values == [line, "last"] and not warned
            df = spark.read.schema("value STRING").parquet(*[b[1] for b in
                                                              source.plan()["blocks"]])
            assert sorted(len(r.value) for r in df.collect()) == [4, len(line)]
        else:
            assert "".join(values[:-1]) == line and len(values) > 2
            assert all(len(v.encode()) <= limit for v in values[:-1])
            assert warned and f"receiverMaxLineBytes={limit}" in warned[0]
    finally:
        done.set()
        source.stop()
        server.close()


# -- 5. hand-edited records ------------------------------------------------------------------
@pytest.fixture(scope="module")
def committed_checkpoint(spark, tmp_path_factory):
    """A pipeline (file source + queue) that committed batch 0 and then its files were purged
    into a seen-files snapshot by hand: the base every edit below starts from."""
    base = tmp_path_factory.mktemp("records")
    landing = base / "landing"
    landing.mkdir()
    (landing / "a.json").write_text('{"id": 1}\n{"id": 2}\n')
    ctx = records_pipeline(spark, base / "ckpt", landing, base / "out", [])
    ctx.process_available(timeout=120)
    return base


def records_pipeline(spark, ckpt, landing, out, called):
    ctx = StreamingContext(spark, 0.1, str(ckpt), "rec", settings=QUIET)
    f = ctx.file_stream("f", str(landing), "json", schema="id BIGINT")
    q = ctx.queue_stream("q", "id BIGINT")
    q.source.push([(10,)]) if not called else None
    both = f.union(q)
    both.write_parquet(str(out), name="o")
    both.foreach_batch(lambda df, b: called.append(b), name="seen")
    return ctx


def edit_json(path: Path, fn) -> None:
    record = json.loads(path.read_text())
    fn(record)
    path.write_text(json.dumps(record))


ALLOC = "allocations/000000000000.json"
EDITS = {
    "negative batch id": (ALLOC, lambda r: r.update(batch_id=-1), "field batch_id",
                          "expected an integer >= 0", "found -1"),
    "batch id of another file": (ALLOC, lambda r: r.update(batch_id=7), "field batch_id",
                                 "expected 0 (the file's name)", "found 7"),
    "size as a string": (ALLOC, lambda r: r["pieces"]["f"]["files"][0].__setitem__(1, "34"),
                         "field pieces.f.files[0][1]", "expected an integer >= 0",
                         "found '34'"),
    "file name with ..": (ALLOC, lambda r: r["pieces"]["f"]["files"][0].__setitem__(
        0, r["pieces"]["f"]["files"][0][0].replace("/a.json", "/../x/a.json")),
        "field pieces.f.files[0][0]", "expected a path without '..' segments", "/../x/a.json"),
    "file outside the source directory": (ALLOC, lambda r: r["pieces"]["f"]["files"][0]
                                          .__setitem__(0, "/etc/passwd"),
                                          "field pieces.f.files[0][0]",
                                          "expected a file directly in", "'/etc/passwd'"),
    "missing piece": (ALLOC, lambda r: r["pieces"].pop("q"), "field pieces.q",
                      "expected the piece of source q", "found the field missing"),
    "block path elsewhere": (ALLOC, lambda r: r["pieces"]["q"]["blocks"][0].__setitem__(
        1, "/tmp/other.parquet"), "field pieces.q.blocks[0][1]", "expected block 0 at",
        "'/tmp/other.parquet'"),
    "pieces as a list": (ALLOC, lambda r: r.update(pieces=[]), "field pieces",
                         "expected a JSON object", "found []"),
    "commit outputs as a list": ("commits/000000000000.json", lambda r: r.update(outputs=[]),
                                 "field outputs", "expected a JSON object", "found []"),
    "commit without outputs": ("commits/000000000000.json", lambda r: r.pop("outputs"),
                               "field outputs", "expected a value", "the field missing"),
}


def restart_refused(spark, committed_checkpoint, tmp_path):
    """A copy of the committed checkpoint (its records name the shared landing directory, which
    gets a new file to run), and what a refused restart must leave unchanged."""
    landing = committed_checkpoint / "landing"
    (landing / "b.json").write_text('{"id": 3}\n')
    shutil.copytree(committed_checkpoint / "ckpt", tmp_path / "ckpt")
    for record in (tmp_path / "ckpt" / "allocations").iterdir():  # blocks are in the copy
        record.write_text(record.read_text().replace(str(committed_checkpoint / "ckpt"),
                                                     str(tmp_path / "ckpt")))
    shutil.copytree(committed_checkpoint / "out", tmp_path / "out")
    shutil.copytree(committed_checkpoint / "out", tmp_path / "out-before")
    return landing, tmp_path / "ckpt"


def assert_nothing_ran(tmp_path, called):
    assert called == [], "a batch ran from a refused record"
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == sorted(
        p.name for p in (tmp_path / "out-before").iterdir()), "output was committed"
    assert sorted(p.name for p in (tmp_path / "ckpt" / "allocations").iterdir()) == [
        "000000000000.json"], "a batch was allocated"


@pytest.mark.parametrize("case", list(EDITS))
def test_a_hand_edited_record_is_refused_and_nothing_runs(spark, tmp_path, committed_checkpoint,
                                                          case):
    relative, edit, field, expected, found = EDITS[case]
    landing, ckpt = restart_refused(spark, committed_checkpoint, tmp_path)
    edit_json(ckpt / relative, edit)
    called: list = []
    ctx = records_pipeline(spark, ckpt, landing, tmp_path / "out", called)
    with pytest.raises(RecordError) as info:
        ctx.process_available(timeout=120)
    text = str(info.value)
    assert str(ckpt / relative) in text and field in text and expected in text \
        and found in text, text
    assert_nothing_ran(tmp_path, called)


@pytest.mark.parametrize("case", ["block", "snapshot-path", "snapshot-type"])
def test_hand_edited_blocks_and_seen_files_snapshots_are_refused(spark, tmp_path,
                                                                 committed_checkpoint, case):
    landing, ckpt = restart_refused(spark, committed_checkpoint, tmp_path)
    if case == "block":
        target = ckpt / "receivedData" / "q" / "000000000000.parquet"
        pq.write_table(pa.table({"id": ["ten"]}), target)
        want = ["receiver block columns", "expected ['id int64']", "found ['id string']"]
    else:
        (ckpt / "sources" / "f").mkdir(parents=True)
        target = ckpt / "sources" / "f" / "seen-000000000000.parquet"
        paths, mtimes = ([f"{landing}/../secret.json"], pa.array([1], pa.int64())) \
            if case == "snapshot-path" else ([f"{landing}/a.json"], pa.array(["1"]))
        pq.write_table(pa.table({"path": paths, "mtime_ns": mtimes}), target)
        want = (["seen-files snapshot column path", "/../secret.json"]
                if case == "snapshot-path" else
                ["seen-files snapshot column mtime_ns", "expected type int64",
                 "found type string"])
    called: list = []
    ctx = records_pipeline(spark, ckpt, landing, tmp_path / "out", called)
    with pytest.raises(RecordError) as info:
        ctx.process_available(timeout=120)
    assert str(target) in str(info.value), info.value
    assert all(w in str(info.value) for w in want), info.value
    assert_nothing_ran(tmp_path, called)


@pytest.fixture(scope="module")
def stateful_checkpoint(spark, tmp_path_factory):
    """A keyed pipeline with a two-phase Delta output that completed checkpoints."""
    base = tmp_path_factory.mktemp("stateful")
    stateful_pipeline(spark, base / "ckpt", base / "out", 10).process_available(timeout=180)
    return base


def stateful_pipeline(spark, ckpt, out, total):
    from spark_ckpt.state import count

    ctx = StreamingContext(spark, 0.1, str(ckpt), "keyed", settings=QUIET)
    ctx.generator_stream("g", rows_per_batch=5, total_rows=total, keys=3).key_by("key").agg(
        name="per_key", n=count()).write_delta(str(out), name="o", merge_keys=["key"])
    return ctx


METADATA_EDITS = {
    "barrier batch as a string": (lambda m: m.update(barrier_batch="1"), "field barrier_batch",
                                  "expected an integer >= -1", "found '1'"),
    "state file path with ..": (
        lambda m: next(f for op in m["operators"].values() for h in op["handles"].values()
                       for f in h["files"]).update(path="/tmp/../etc/state.parquet"),
        "files[0].path", "expected a path without '..' segments", "'/tmp/../etc/state.parquet'"),
    "negative state rows": (
        lambda m: next(h for op in m["operators"].values() for h in op["handles"].values()
                       ).update(rows=-4), ".rows", "expected an integer >= 0", "found -4"),
    "handles missing": (lambda m: next(iter(m["operators"].values())).pop("handles"),
                        ".handles", "expected a value", "the field missing"),
}


@pytest.mark.parametrize("case", list(METADATA_EDITS))
def test_a_hand_edited_checkpoint_metadata_is_refused_not_stepped_over(
        spark, tmp_path, stateful_checkpoint, case):
    """A checkpoint's _metadata.json whose fields were edited is refused with the file, field,
    expected and found; the restart neither restores an older checkpoint instead nor runs a
    batch nor commits output."""
    edit, field, expected, found = METADATA_EDITS[case]
    shutil.copytree(stateful_checkpoint, tmp_path / "c")
    ckpt, out = tmp_path / "c" / "ckpt", tmp_path / "c" / "out"
    latest = sorted((ckpt / "checkpoints").glob("chk-*"))[-1] / "_metadata.json"
    edit_json(latest, edit)
    versions = len(list((out / "_delta_log").glob("*.json")))
    allocations = sorted(p.name for p in (ckpt / "allocations").iterdir())
    with pytest.raises(CheckpointError) as info:
        stateful_pipeline(spark, ckpt, out, 20).process_available(timeout=120)
    assert isinstance(info.value.__cause__, RecordError)
    text = str(info.value)
    assert str(latest) in text and field in text and expected in text and found in text, text
    assert len(list((out / "_delta_log").glob("*.json"))) == versions
    assert sorted(p.name for p in (ckpt / "allocations").iterdir()) == allocations


def test_record_specs_name_the_field_expected_and_found():
    base = {"kind": "allocation", "format_version": 1, "batch_id": 3, "batch_time_ms": 5,
            "pieces": {"f": {}}}
    assert load_record(json.dumps(base), "allocation", (1,))["batch_id"] == 3
    for change, message in [
        ({"batch_id": "3"}, "field batch_id: expected an integer >= 0 and <= 999999999999, "
                            "found '3'"),
        ({"batch_id": True}, "field batch_id: expected an integer"),
        ({"batch_id": 10**13}, "field batch_id: expected an integer >= 0"),
        ({"batch_time_ms": -5}, "field batch_time_ms: expected an integer >= 0, found -5"),
        ({"pieces": {"f": 1}}, "field pieces.f: expected a JSON object, found 1"),
    ]:
        with pytest.raises(RecordError, match="^/c/3.json: allocation record ") as info:
            load_record(json.dumps(base | change), "allocation", (1,), where="/c/3.json")
        assert message in str(info.value)


# -- 6. files Spark reads fine are not drift -------------------------------------------------
def batch_rows(spark, tmp_path, path, name, **kwargs) -> list[tuple]:
    """What a BatchJob reading the Parquet source ``path`` (read_files ``kwargs``) wrote."""
    job = BatchJob(name, spark=spark, work_dir=str(tmp_path / "work"), settings=QUIET)
    src = job.read_files("in", str(path), format="parquet", parallelism=2, **kwargs)
    job.write_parquet(job.vertex("out", lambda df: df, src), str(tmp_path / f"batch-{name}"))
    job.run()
    return rows(spark.read.parquet(str(tmp_path / f"batch-{name}")))


def stream_rows(spark, tmp_path, landing, name, *, schema=None, options=None) -> list[tuple]:
    """The rows a file stream over ``landing`` hands its output, all batches."""
    got: list = []
    ctx = StreamingContext(spark, 0.1, str(tmp_path / f"ckpt-{name}"), name, settings=QUIET)
    ctx.file_stream("f", str(landing), "parquet", schema=schema, options=options).foreach_batch(
        lambda df, b: got.extend(tuple(r) for r in df.collect()), name="o")
    ctx.process_available(timeout=120)
    return sorted(got, key=repr)


def test_non_null_nested_fields_spark_writes_are_not_drift(spark, tmp_path):
    """collect_list, split, structs of non-null values: Spark writes their elements and fields
    as required; it reads them nullable, and so must the drift check (nullability at any
    depth is never drift)."""
    landing = tmp_path / "nested"
    spark.range(4).selectExpr("id", "array(id) as l", "split(cast(id as string), ',') as w",
                              "named_struct('a', id, 'b', array(id)) as s",
                              "map(id, id) as m").write.parquet(str(landing))
    want = rows(spark.read.parquet(str(landing)))
    assert len(want) == 4
    assert batch_rows(spark, tmp_path, landing, "nested") == want
    schema = ("id BIGINT, l ARRAY<BIGINT>, w ARRAY<STRING>, s STRUCT<a: BIGINT, "
              "b: ARRAY<BIGINT>>, m MAP<BIGINT, BIGINT>")
    assert stream_rows(spark, tmp_path, landing, "nested", schema=schema) == rows(
        spark.read.schema(schema).parquet(str(landing)))


def test_int96_timestamps_read_as_spark_reads_them(spark, tmp_path):
    """INT96 (Spark's long-time default, Hive, Impala) is TIMESTAMP to Spark, at any depth;
    pyarrow's footer says a timestamp without a zone (TIMESTAMP_NTZ)."""
    landing = tmp_path / "int96"
    spark.conf.set("spark.sql.parquet.outputTimestampType", "INT96")
    try:
        spark.range(3).selectExpr("id", "timestamp_seconds(id) as ts",
                                  "array(timestamp_seconds(id)) as tl",
                                  "named_struct('t', timestamp_seconds(id)) as st"
                                  ).write.parquet(str(landing))
    finally:
        spark.conf.unset("spark.sql.parquet.outputTimestampType")
    meta = pq.read_metadata(next(landing.glob("*.parquet")))
    assert meta.schema.column(1).physical_type == "INT96"
    want = rows(spark.read.parquet(str(landing)))
    assert dict(spark.read.parquet(str(landing)).dtypes)["ts"] == "timestamp" and len(want) == 3
    assert batch_rows(spark, tmp_path, landing, "int96") == want
    assert stream_rows(spark, tmp_path, landing, "int96") == want


def test_a_column_of_a_type_the_check_cannot_map_is_left_to_spark(spark, tmp_path):
    """Unsigned integers (pyarrow, parquet-cpp writers) do not map to a Spark type here; Spark
    reads uint32 as bigint: the check leaves such a column to Spark instead of refusing."""
    landing = tmp_path / "unsigned"
    landing.mkdir()
    put(landing / "a.parquet", pa.table({"id": pa.array([1, 2], pa.int64()),
                                         "u": pa.array([7, 2**32 - 1], pa.uint32())}), 1_000)
    want = rows(spark.read.parquet(str(landing)))
    assert want == [(1, 7), (2, 2**32 - 1)]
    assert batch_rows(spark, tmp_path, landing, "unsigned") == want
    assert stream_rows(spark, tmp_path, landing, "unsigned") == want


def test_column_names_match_in_either_case_as_spark_matches_them(spark, tmp_path):
    """spark.sql.caseSensitive=false (the default): a file's ID is the schema's id."""
    landing = tmp_path / "case"
    landing.mkdir()
    put(landing / "a.parquet", BASE, 1_000)
    put(landing / "b.parquet", pa.table({"ID": pa.array([4, 5], pa.int64()),
                                         "V": pa.array(["d", "e"])}), 2_000)
    want = rows(spark.read.parquet(str(landing)))
    assert sorted(want) == [(1, "a"), (2, "b"), (4, "d"), (5, "e")]
    assert batch_rows(spark, tmp_path, landing, "case") == want
    assert stream_rows(spark, tmp_path, landing, "case") == want


def test_merge_schema_from_the_session_conf_or_any_case_of_the_option(spark, tmp_path):
    """spark.sql.parquet.mergeSchema=true on the session is Spark's mergeSchema; the option's
    name matches in any case (Spark's options are case-insensitive), batch and streaming."""
    landing = tmp_path / "merge"
    landing.mkdir()
    put(landing / "a.parquet", BASE, 1_000)
    put(landing / "b.parquet", DRIFT["added"], 2_000)
    schema = "id BIGINT, v STRING"  # the stream's schema: the first file's
    streamed = rows(spark.read.schema(schema).parquet(str(landing)))
    assert stream_rows(spark, tmp_path, landing, "merge-option",
                       options={"MERGESCHEMA": "true"}) == streamed
    spark.conf.set("spark.sql.parquet.mergeSchema", "true")
    try:
        want = rows(spark.read.parquet(str(landing)))
        assert len(want[0]) == 3  # merged: id, v, x
        assert batch_rows(spark, tmp_path, landing, "merge") == want
        assert stream_rows(spark, tmp_path, landing, "merge-conf") == streamed
    finally:
        spark.conf.unset("spark.sql.parquet.mergeSchema")


def test_partition_columns_below_a_base_path_are_not_missing_columns(spark, tmp_path):
    """path .../region=eu with basePath above it: region is a partition column, as Spark reads
    it, not a column missing from the files."""
    root = tmp_path / "parts"
    (root / "region=eu").mkdir(parents=True)
    pq.write_table(BASE, root / "region=eu" / "a.parquet")
    options = {"basePath": str(root)}
    want = rows(spark.read.options(**options).parquet(str(root / "region=eu")))
    assert want == [(1, "a", "eu"), (2, "b", "eu")]
    assert batch_rows(spark, tmp_path, root / "region=eu", "parts", options=options) == want


def test_only_the_file_paths_spark_ckpt_writes_are_path_checked(tmp_path):
    """A Delta source's partition values (a column named path or dir, null or any string) and
    a user's two-phase sink transaction are data: a checkpoint holding them loads. The file
    positions the built-in sources and sinks write are still refused with '..'."""
    from deltalake import write_deltalake

    from spark_ckpt.sources.delta_stream import DeltaStreamSource

    table = tmp_path / "delta"
    write_deltalake(str(table), pa.table({"id": pa.array([1, 2], pa.int64()),
                                          "path": pa.array([None, "a/../b"]),
                                          "dir": pa.array(["..", ".."])}),
                    partition_by=["path", "dir"])
    piece = DeltaStreamSource("d", str(table)).plan()
    assert {f[3]["path"] for f in piece["files"]} == {None, "a/../b"}
    own = {"pieces": [{"batch": 0, "data": {"path": "s3://bucket/x/../y", "dir": None}}]}
    parquet_txn = {"moves": [["/t/_s/b/x.parquet", "/t/x.parquet"]], "dirs": ["/t/_s/b"],
                   "last_batch": 0}
    delta_txn = {"pieces": [{"batch": 0, "dir": "/t/_s/b", "files": [
        {"kind": "sink", "target": "o", "path": "/t/_s/b/x.parquet", "size": 1, "rows": 1,
         "groups": {}, "partition_values": {"path": None, "dir": ".."}}]}]}

    def metadata(source_piece, txn):
        return json.dumps({
            "kind": "checkpoint-metadata", "format_version": 1, "checkpoint_id": 1,
            "barrier_batch": 0, "sources": {"d": {"batch": 0, "piece": source_piece}},
            "sinks": {"o": {"pending": [[1, txn]]}}})

    for txn in (own, parquet_txn, delta_txn):
        load_record(metadata(piece, txn), "checkpoint-metadata", (1,))
    bad = [
        (metadata({"files": [["/in/../x.json", 1, 1]]}, own), "sources.d.piece.files[0][0]"),
        (metadata({"blocks": [[0, "/r/../b.parquet", 1]]}, own), "sources.d.piece.blocks[0][1]"),
        (metadata(piece, parquet_txn | {"moves": [["/t/a", "/t/../a"]]}),
         "sinks.o.pending[0][1].moves[0][1]"),
        (metadata(piece, parquet_txn | {"dirs": ["/t/../s"]}), "sinks.o.pending[0][1].dirs[0]"),
        (metadata(piece, {"pieces": [delta_txn["pieces"][0] | {"dir": "/t/.."}]}),
         "sinks.o.pending[0][1].pieces[0].dir"),
        (metadata(piece, {"pieces": [delta_txn["pieces"][0] | {"files": [{"path": "../x"}]}]}),
         "sinks.o.pending[0][1].pieces[0].files[0].path"),
    ]
    for record, field in bad:
        with pytest.raises(RecordError, match="expected a path without '..' segments") as info:
            load_record(record, "checkpoint-metadata", (1,))
        assert f"field {field}:" in str(info.value), info.value
