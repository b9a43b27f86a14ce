"""Sinks against real Delta tables and directories: idempotent, refusing to commit bad files."""

from spark_ckpt.storage.delta_reader import read_delta
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from deltalake import DeltaTable
from pyspark.sql.types import LongType, StructField, StructType

from spark_ckpt.sinks import DeltaSink, ParquetSink
from spark_ckpt.errors import CommitError, JobDefinitionError
from spark_ckpt.execution.job_graph import SinkSpec
from spark_ckpt.execution.result_partition import OutputFile

SCHEMA = StructType([StructField("x", LongType())])


def staging_of(sink, tag="w1"):
    sink.prepare(SCHEMA)
    directory = sink.staging_dir("v", tag)
    sink.store.makedirs(directory)
    return directory


def stage(directory, name, values):
    path = f"{directory}/{name}.parquet"
    pq.write_table(pa.table({"x": pa.array(values, pa.int64())}), path)
    import os

    return OutputFile("sink", "s", path, os.path.getsize(path), len(values))


def half_done_commit(sink, tmp_path):
    """Stage two files, then leave commit v1 as a crash would: marker created, one file moved."""
    from spark_ckpt.formats import dump_record

    staging = staging_of(sink)
    files = [stage(staging, "a", [1]), stage(staging, "b", [2])]
    moves = [[f.path, str(tmp_path / "out" / f.path.rsplit("/", 1)[1]), f.size] for f in files]
    sink.store.create_exclusive(sink._marker(1), dump_record(
        "parquet-sink-commit", 1, {"job_id": "job", "version": 1, "status": "committing",
                                   "moves": moves}))
    sink.store.move(moves[0][0], moves[0][1])
    return files


def test_delta_commit_is_idempotent_per_version(tmp_path):
    sink = DeltaSink(SinkSpec("s", "delta", str(tmp_path / "t")), "job")
    staging = staging_of(sink)
    files = [stage(staging, "a", [1, 2]), stage(staging, "b", [3])]
    version = sink.next_version()
    assert version == 1 and not sink.is_committed(1)
    sink.commit(files, version)
    assert sink.is_committed(1)
    assert sink.commit(files, version) == {"skipped": True}
    table = DeltaTable(str(tmp_path / "t"))
    assert sorted(table.to_pandas().x) == [1, 2, 3]
    assert table.transaction_version("spark_ckpt/job/s") == 1
    assert sink.next_version() == 2


def test_delta_refuses_to_commit_a_missing_or_resized_file(tmp_path):
    sink = DeltaSink(SinkSpec("s", "delta", str(tmp_path / "t")), "job")
    staging = staging_of(sink)
    good = stage(staging, "a", [1])
    ghost = OutputFile("sink", "s", f"{staging}/ghost.parquet", 10, 1)
    with pytest.raises(CommitError, match="ghost.parquet should be 10 bytes, found missing"):
        sink.commit([good, ghost], 1)
    assert not sink.is_committed(1)


def test_delta_overwrite_replaces_the_table(tmp_path):
    spec = SinkSpec("s", "delta", str(tmp_path / "t"), mode="overwrite")
    sink = DeltaSink(spec, "job")
    staging = staging_of(sink)
    sink.commit([stage(staging, "a", [1])], 1)
    sink.commit([stage(staging, "b", [2])], 2)
    assert read_delta(str(tmp_path / "t")).to_pandas().x.tolist() == [2]


def test_parquet_commit_moves_files_once_and_finishes_a_half_done_commit(tmp_path):
    sink = ParquetSink(SinkSpec("s", "parquet", str(tmp_path / "out")), "job")
    files = half_done_commit(sink, tmp_path)  # an earlier attempt died mid-commit
    sink.commit(files, 1)
    assert sink.is_committed(1)
    assert sorted(pq.read_table(str(tmp_path / "out")).column("x").to_pylist()) == [1, 2]
    assert sink.commit(files, 1) == {"skipped": True}


def test_parquet_sink_refuses_overwrite(tmp_path):
    with pytest.raises(JobDefinitionError, match="expected mode 'append'"):
        ParquetSink(SinkSpec("s", "parquet", str(tmp_path), mode="overwrite"), "job")


def test_parquet_commit_of_a_missing_file_leaves_no_marker(tmp_path):
    sink = ParquetSink(SinkSpec("s", "parquet", str(tmp_path / "out")), "job")
    staging = staging_of(sink)
    good = stage(staging, "a", [1])
    ghost = OutputFile("sink", "s", f"{staging}/ghost.parquet", 10, 1)
    with pytest.raises(CommitError, match="ghost.parquet should be 10 bytes, found missing"):
        sink.commit([good, ghost], 1)
    assert not sink.store.exists(sink._marker(1))  # recovery may re-run and commit v1
    assert sink.commit([good], 1) == {"files": 1}
    assert pq.read_table(str(tmp_path / "out" / "a.parquet")).column("x").to_pylist() == [1]


def test_a_new_run_finishes_a_half_done_commit_before_staging(tmp_path):
    sink = ParquetSink(SinkSpec("s", "parquet", str(tmp_path / "out")), "job")
    half_done_commit(sink, tmp_path)
    fresh = ParquetSink(SinkSpec("s", "parquet", str(tmp_path / "out")), "job")
    fresh.prepare(SCHEMA)  # a fresh run of the job id: v1 is completed first
    assert fresh.is_committed(1) and fresh.next_version() == 2
    assert sorted(pq.read_table(str(tmp_path / "out")).column("x").to_pylist()) == [1, 2]


# -- column statistics in the Delta log --------------------------------------------------------
def test_delta_add_actions_carry_column_statistics_readers_skip_files_on(tmp_path):
    import pyarrow.compute as pc

    sink = DeltaSink(SinkSpec("s", "delta", str(tmp_path / "t")), "job")
    staging = staging_of(sink)
    files = [stage(staging, "a", [1, 2, 3]), stage(staging, "b", [100, 150, None]),
             stage(staging, "c", [300, 301])]
    sink.commit(files, sink.next_version())
    table = DeltaTable(str(tmp_path / "t"))
    actions = pa.table(table.get_add_actions(flatten=True)).to_pylist()
    by_rows = {a["num_records"]: a for a in actions}
    assert (by_rows[3]["min.x"], by_rows[3]["max.x"]) in ((1, 3), (100, 150))
    assert sorted((a["min.x"], a["max.x"], a["null_count.x"]) for a in actions) == [
        (1, 3, 0), (100, 150, 1), (300, 301, 0)]
    dataset = table.to_pyarrow_dataset()
    wanted = pc.field("x") > 200
    assert len(list(dataset.get_fragments(filter=wanted))) == 1  # two files skipped
    assert dataset.to_table(filter=wanted).column("x").to_pylist() == [300, 301]


def test_statistics_of_files_spark_wrote_are_exact_and_leave_out_what_cannot_be(spark, tmp_path):
    import json

    from spark_ckpt.sinks.stats import file_stats

    df = spark.range(0, 3000, numPartitions=3).selectExpr(
        "id", "cast(id % 7 as string) as k", "repeat('x', 40) as wide",
        "date_add(date'2024-01-01', cast(id / 100 as int)) as d",
        "cast(id / 3 as decimal(10, 2)) as m", "cast(id as double) as f",
        "timestamp_seconds(id) as ts", "named_struct('a', id * 2) as st",
        "array(id) as arr", "IF(id % 5 = 0, NULL, id) as n")
    df.write.parquet(str(tmp_path / "files"))
    paths = sorted(str(p) for p in (tmp_path / "files").glob("part-*.parquet"))
    assert len(paths) == 3
    for path in paths:
        rows = spark.read.parquet(path)
        count = rows.count()
        stats = json.loads(file_stats(path, count, set()))
        want = rows.selectExpr(
            "min(id)", "max(id)", "min(k)", "max(k)", "cast(min(d) as string)",
            "cast(max(d) as string)", "cast(min(m) as string)", "cast(max(m) as string)",
            "min(st.a)", "max(st.a)", "count_if(n is null)").first()
        lo, hi = stats["minValues"], stats["maxValues"]
        assert (lo["id"], hi["id"], lo["k"], hi["k"]) == tuple(want[:4])
        assert (lo["d"], hi["d"]) == (want[4], want[5])
        assert (f"{lo['m']:.2f}", f"{hi['m']:.2f}") == (want[6], want[7])
        assert (lo["st"]["a"], hi["st"]["a"]) == (want[8], want[9])
        assert stats["nullCount"]["n"] == want[10] and stats["numRecords"] == count
        # no exact figure: a string longer than 32 characters, a double (NaN sorts above
        # every number in Spark and the footer does not say whether there is one), Spark's
        # INT96 timestamps (no footer statistics), an array
        for absent in ("wide", "f", "ts", "arr"):
            assert absent not in lo and absent not in hi
