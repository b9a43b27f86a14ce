"""A Delta streaming source on a table that is maintained and changed while it is read:
OPTIMIZE, DELETE, UPDATE, MERGE, overwrite, VACUUM, log cleanup, schema changes, deletion
vectors and column mapping, between runs and within one run, under each of Delta's options
(ignore_deletes, ignore_changes, skip_change_commits). Real delta-rs tables throughout; the
pipelines run on the shared SparkSession."""

from __future__ import annotations

import datetime as dt
import json
import os
from pathlib import Path
from types import SimpleNamespace

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from deltalake import DeltaTable, write_deltalake
from pyspark.sql import functions as F

from spark_ckpt import PipelineFailedError, Settings, SourceError, StreamingContext
from spark_ckpt.delta_reader import read_delta
from spark_ckpt.storage import Storage
from spark_ckpt.streaming.delta_log import CommitKind, earliest_commit, parse_commit, read_commit
from spark_ckpt.streaming.sources import DeltaStreamSource

OPTIONS = {
    "default": {},
    "ignore_deletes": {"ignore_deletes": True},
    "ignore_changes": {"ignore_changes": True},
    "skip_change_commits": {"skip_change_commits": True},
}


# -- helpers ---------------------------------------------------------------------------------
def append(table: str, ids, *, mode: str = "append", **kwargs) -> None:
    ids = list(ids)
    write_deltalake(table, pa.table({"id": pa.array(ids, pa.int64()),
                                     "p": pa.array([i % 2 for i in ids], pa.int64()),
                                     "v": pa.array([0] * len(ids), pa.int64())}),
                    mode=mode, partition_by=["p"], **kwargs)


def version(table: str) -> int:
    return DeltaTable(table).version()


def log_json(table: str, v: int) -> Path:
    return Path(table) / "_delta_log" / f"{v:020d}.json"


def make_ctx(spark, tmp_path, ckpt="ckpt", **settings):
    return StreamingContext(spark, 0.1, str(tmp_path / ckpt), "delta-maint",
                            settings=Settings(progress="never", **settings))


def run(spark, tmp_path, table, *, ckpt="ckpt", **options):
    """One available-now run of ``table -> write_parquet(<ckpt>-out)``."""
    ctx = make_ctx(spark, tmp_path, ckpt)
    ctx.delta_stream("src", table, **options).write_parquet(str(tmp_path / f"{ckpt}-out"),
                                                            name="out")
    return ctx.process_available(timeout=180)


def run_collecting(spark, tmp_path, table, got, on_batch, **options):
    """One available-now run, one version and one batch in flight at a time: each batch's ids
    go to ``got[batch_id]``, then ``on_batch(batch_id)`` runs (before the next batch is
    planned, after this one's rows were read)."""
    ctx = make_ctx(spark, tmp_path, stream_max_batches_in_flight=1)

    def collect(df, batch_id):
        got[batch_id] = sorted(r.id for r in df.select("id").collect())
        on_batch(batch_id)

    ctx.delta_stream("src", table, max_versions_per_batch=1, **options).foreach_batch(
        collect, name="o")
    return ctx.process_available(timeout=180)


def output_ids(tmp_path, ckpt="ckpt") -> list[int]:
    out = tmp_path / f"{ckpt}-out"
    return sorted(pq.read_table(out).column("id").to_pylist()) if out.exists() else []


def drain(source: DeltaStreamSource) -> list[dict]:
    """Plan and advance until the source has nothing more: the pieces planned."""
    pieces = []
    while True:
        piece = source.plan()
        if source.is_empty(piece):
            return pieces
        source.advance(piece)
        pieces.append(piece)


def piece_rows(pieces) -> int:
    return sum(p["rows"] for p in pieces)


def compact(table: str) -> None:
    DeltaTable(table).optimize.compact()


def vacuum_all(table: str) -> None:
    DeltaTable(table).vacuum(retention_hours=0, enforce_retention_duration=False,
                             dry_run=False)


def merge_upsert(table: str, ids) -> None:
    ids = list(ids)
    source = pa.table({"id": pa.array(ids, pa.int64()), "p": pa.array([i % 2 for i in ids],
                                                                       pa.int64()),
                       "v": pa.array([7] * len(ids), pa.int64())})
    (DeltaTable(table).merge(source, "s.id = t.id", source_alias="s", target_alias="t")
     .when_matched_update_all().when_not_matched_insert_all().execute())


# -- the commit log, classified ----------------------------------------------------------------
def test_each_commit_is_classified_by_its_data_changing_actions(tmp_path):
    table = str(tmp_path / "t")
    append(table, range(0, 100))                                        # 0 WRITE
    append(table, range(100, 200))                                      # 1 WRITE
    compact(table)                                                      # 2 OPTIMIZE
    DeltaTable(table).delete("p = 1")                                   # 3 DELETE (files)
    DeltaTable(table).delete("id < 10")                                 # 4 DELETE (rows)
    DeltaTable(table).update(updates={"v": "v + 1"}, predicate="id = 20")  # 5 UPDATE
    merge_upsert(table, [501, 503])                                     # 6 MERGE (inserts)
    merge_upsert(table, [20, 505])                                      # 7 MERGE (upsert)
    append(table, [900], mode="overwrite")                              # 8 WRITE (overwrite)
    vacuum_all(table)                                                   # 9, 10 VACUUM
    DeltaTable(table).alter.set_table_properties({"delta.appendOnly": "false"})  # 11
    write_deltalake(table, pa.table({"id": pa.array([901], pa.int64()),
                                     "p": pa.array([1], pa.int64()),
                                     "v": pa.array([0], pa.int64()), "x": ["new"]}),
                    mode="append", partition_by=["p"], schema_mode="merge")  # 12 WRITE + schema
    store = Storage(table)
    got = [(c.operation, c.kind) for c in (read_commit(store, v) for v in range(13))]
    assert got == [
        ("WRITE", CommitKind.APPEND), ("WRITE", CommitKind.APPEND),
        ("OPTIMIZE", CommitKind.NO_DATA_CHANGE), ("DELETE", CommitKind.DELETE),
        ("DELETE", CommitKind.CHANGE), ("UPDATE", CommitKind.CHANGE),
        ("MERGE", CommitKind.APPEND), ("MERGE", CommitKind.CHANGE),
        ("WRITE", CommitKind.CHANGE), ("VACUUM START", CommitKind.NO_DATA_CHANGE),
        ("VACUUM END", CommitKind.NO_DATA_CHANGE), ("SET TBLPROPERTIES", CommitKind.NO_DATA_CHANGE),
        ("WRITE", CommitKind.APPEND),
    ]
    first = read_commit(store, 0)
    assert first.schema_string is not None and first.column_mapping is None
    assert sorted(f.rows for f in first.added) == [50, 50]
    assert {f.partition_values["p"] for f in first.added} == {"0", "1"}
    assert read_commit(store, 12).schema_string and "\"x\"" in read_commit(store, 12).schema_string
    assert read_commit(store, 13) is None
    assert earliest_commit(store) == 0


def test_parsing_reads_paths_decoded_and_flags_deletion_vectors_and_cdc_files():
    lines = [
        {"commitInfo": {"operation": "DELETE"}},
        {"remove": {"path": "p=a%2520b/f1.parquet", "dataChange": True}},
        {"add": {"path": "p=a%2520b/f2.parquet", "size": 10, "dataChange": True,
                 "partitionValues": {"p": "a b"}, "stats": "{\"numRecords\": 3}",
                 "deletionVector": {"storageType": "u", "pathOrInlineDv": "ab^-aqEH.-t@S}K{vb[*k^",
                                    "offset": 1, "sizeInBytes": 36, "cardinality": 2}}},
        {"cdc": {"path": "_change_data/c.parquet", "size": 5, "dataChange": False}},
    ]
    commit = parse_commit(7, "\n".join(json.dumps(x) for x in lines) + "\n")
    assert (commit.version, commit.operation, commit.kind) == (7, "DELETE", CommitKind.CHANGE)
    assert commit.removed == ("p=a%20b/f1.parquet",)
    (added,) = commit.added
    assert (added.path, added.size, added.rows, added.deletion_vector) == \
        ("p=a%20b/f2.parquet", 10, 3, True)
    with pytest.raises(SourceError, match=r"expected a Delta commit .* in x.json, found line 2"):
        parse_commit(1, '{"commitInfo": {}}\nnot json\n', "x.json")


# -- options, commit by commit (planning only) -------------------------------------------------
def changed_table(tmp_path, name, operation):
    """Versions 0-1 appends (ids 0-199), then ``operation`` (one commit or more), then an append
    of ids 1000-1099. Returns (table, the operation's first version, its name in the log)."""
    table = str(tmp_path / name)
    append(table, range(0, 100))
    append(table, range(100, 200))
    first = version(table) + 1
    logged = {"optimize": "OPTIMIZE", "delete_files": "DELETE", "delete_rows": "DELETE",
              "update": "UPDATE", "merge": "MERGE", "overwrite": "WRITE",
              "vacuum": "OPTIMIZE"}[operation]
    if operation in ("optimize", "vacuum"):
        compact(table)
        if operation == "vacuum":
            vacuum_all(table)
    elif operation == "delete_files":
        DeltaTable(table).delete("p = 1")
    elif operation == "delete_rows":
        DeltaTable(table).delete("id < 10")
    elif operation == "update":
        DeltaTable(table).update(updates={"v": "v + 1"}, predicate="id = 20")
    elif operation == "merge":
        merge_upsert(table, [20, 505])
    elif operation == "overwrite":
        append(table, [900, 901], mode="overwrite")
    append(table, range(1000, 1100))
    return table, first, logged


# what each operation does under each option: "read" (its adds are read as new rows), "skip",
# or "stop"
EXPECTED = {
    "optimize": {"default": "skip", "ignore_deletes": "skip", "ignore_changes": "skip",
                 "skip_change_commits": "skip"},
    "vacuum": {"default": "skip", "ignore_deletes": "skip", "ignore_changes": "skip",
               "skip_change_commits": "skip"},
    "delete_files": {"default": "stop", "ignore_deletes": "skip", "ignore_changes": "skip",
                     "skip_change_commits": "skip"},
    **{op: {"default": "stop", "ignore_deletes": "stop", "ignore_changes": "read",
            "skip_change_commits": "skip"}
       for op in ("delete_rows", "update", "merge", "overwrite")},
}


@pytest.mark.parametrize("operation", sorted(EXPECTED))
def test_each_operation_between_runs_follows_the_options(tmp_path, operation):
    table, first, logged = changed_table(tmp_path, operation, operation)
    assert first == 2
    for option, outcome in EXPECTED[operation].items():
        # versions 0-1 were read by an earlier run (their files may be vacuumed since)
        source = DeltaStreamSource("src", table, starting_version=2, max_versions_per_batch=1,
                                   **OPTIONS[option])
        if outcome == "stop":
            with pytest.raises(SourceError, match=(
                    rf"version {first} of .* \({logged}\) removed \d+ file\(s\).*"
                    r"Nothing was allocated.*(ignore_deletes|skip_change_commits)=True")):
                source.plan()
            assert source.version == 1, option
            continue
        pieces = drain(source)
        assert pieces[-1]["to_version"] == version(table), option
        changed = [f for p in pieces for f in p["files"] if p["to_version"] < version(table)]
        appended = [f for p in pieces for f in p["files"] if p["to_version"] == version(table)]
        assert sum(f[2] for f in appended) == 100, option
        if outcome == "skip":
            assert changed == [], (operation, option)
        else:  # ignore_changes: the rewritten files are read again
            assert changed and all(f[2] for f in changed), (operation, option)


def test_max_versions_per_batch_counts_skipped_versions(tmp_path):
    table = str(tmp_path / "t")
    append(table, range(0, 100))
    append(table, range(100, 200))
    compact(table)                                                          # 2
    DeltaTable(table).alter.set_table_properties({"delta.appendOnly": "false"})  # 3
    append(table, range(200, 300))                                          # 4
    source = DeltaStreamSource("src", table, max_versions_per_batch=2)
    pieces = drain(source)
    assert [(p["from_version"], p["to_version"], p["rows"]) for p in pieces] == \
        [(-1, 1, 200), (1, 3, 0), (3, 4, 100)]
    assert not source.is_empty(pieces[1])  # no rows, but it moves the position
    assert source.is_empty(source.plan())


# -- end to end: rows exactly once -----------------------------------------------------------
def test_a_table_compacted_between_runs_then_appended_gives_each_row_once(spark, tmp_path):
    """The issue's case: compacted files were read again as new data (7,000 rows for 4,000
    ids with ignore_deletes=True; a refusal without)."""
    table = str(tmp_path / "src")
    for start in (0, 1000, 2000):
        append(table, range(start, start + 1000))
    for option in ("default", "ignore_deletes"):
        run(spark, tmp_path, table, ckpt=option, **OPTIONS[option])
        assert output_ids(tmp_path, option) == list(range(3000))
    compact(table)
    append(table, range(3000, 4000))
    for option in ("default", "ignore_deletes"):
        progress = run(spark, tmp_path, table, ckpt=option, **OPTIONS[option])
        assert output_ids(tmp_path, option) == list(range(4000)), option
        assert sum(p["num_input_rows"] for p in progress) == 1000


def test_maintenance_and_changes_within_one_run_skip_with_skip_change_commits(spark, tmp_path):
    """One run, one version per batch: after the first batch was read the table is compacted,
    vacuumed, deleted from, updated, merged into and overwritten, with appends in between; each
    appended row comes exactly once, nothing a change commit wrote is read."""
    table = str(tmp_path / "src")
    append(table, range(0, 50))                                    # 0
    append(table, range(50, 100))                                  # 1

    def maintain(batch_id):
        if batch_id != 1:
            return
        compact(table)                                             # 2
        vacuum_all(table)  # 3, 4: deletes the files batches 0 and 1 read
        append(table, range(100, 200))                             # 5
        DeltaTable(table).delete("p = 1")  # 6: removes the odd ids, appended ones too
        append(table, range(200, 300))                             # 7
        DeltaTable(table).update(updates={"v": "v + 1"}, predicate="id = 250")  # 8
        append(table, range(300, 400))                             # 9
        merge_upsert(table, [300, 9001])  # 10: its insert is in a change commit
        append(table, range(400, 500))                             # 11
        append(table, [9002], mode="overwrite")                    # 12
        append(table, range(500, 600))                             # 13

    got: dict[int, list[int]] = {}
    progress = run_collecting(spark, tmp_path, table, got, maintain, skip_change_commits=True)
    store = Storage(table)
    assert [read_commit(store, v).operation for v in range(2, 14, 2)] == \
        ["OPTIMIZE", "VACUUM END", "DELETE", "UPDATE", "MERGE", "WRITE"]
    assert sorted(i for ids in got.values() for i in ids) == list(range(600))
    assert {b: len(ids) for b, ids in got.items() if ids} == \
        {0: 50, 1: 50, 5: 100, 7: 100, 9: 100, 11: 100, 13: 100}
    assert [p["batch_id"] for p in progress] == list(range(14))  # a batch per version


def test_a_change_within_one_run_stops_naming_version_and_operation(spark, tmp_path):
    table = str(tmp_path / "src")
    append(table, range(0, 100))
    append(table, range(100, 200))

    def change(batch_id):
        if batch_id == 0:
            DeltaTable(table).update(updates={"v": "v + 1"}, predicate="id = 3")  # 2
            append(table, range(200, 300))                                        # 3

    got: dict[int, list[int]] = {}
    with pytest.raises(PipelineFailedError) as info:
        run_collecting(spark, tmp_path, table, got, change)
    cause = info.value.__cause__
    assert isinstance(cause, SourceError)
    assert "version 2 of" in str(cause) and "(UPDATE)" in str(cause)
    assert "skip_change_commits=True" in str(cause) and "ignore_changes=True" in str(cause)
    assert {b: len(ids) for b, ids in got.items()} == {0: 100, 1: 100}
    run_collecting(spark, tmp_path, table, got, change, skip_change_commits=True)  # restarted
    assert {b: len(ids) for b, ids in got.items()} == {0: 100, 1: 100, 2: 0, 3: 100}
    assert sorted(i for ids in got.values() for i in ids) == list(range(300))


def test_deletes_and_rewrites_between_runs_follow_the_options(spark, tmp_path):
    table = str(tmp_path / "src")
    append(table, range(0, 100))
    append(table, range(100, 200))
    run(spark, tmp_path, table)
    compact(table)                     # 2
    vacuum_all(table)                  # 3, 4
    DeltaTable(table).delete("p = 1")  # 5: files only
    append(table, range(200, 300))     # 6
    assert [read_commit(Storage(table), v).operation for v in (2, 4, 5)] == \
        ["OPTIMIZE", "VACUUM END", "DELETE"]
    with pytest.raises(PipelineFailedError, match=r"version 5 of .* \(DELETE\) removed 1 "
                       r"file\(s\) .* and added none.*ignore_deletes=True"):
        run(spark, tmp_path, table)
    assert output_ids(tmp_path) == list(range(200))
    run(spark, tmp_path, table, ignore_deletes=True)
    assert output_ids(tmp_path) == list(range(300))
    DeltaTable(table).delete("id = 202")  # 7: rewrites a file, not a delete-only commit
    append(table, range(300, 400))        # 8
    with pytest.raises(PipelineFailedError, match=r"version 7 of .* \(DELETE\) .* and added 1: "
                       r"it rewrote rows .*ignore_deletes=True covers only"):
        run(spark, tmp_path, table, ignore_deletes=True)
    run(spark, tmp_path, table, skip_change_commits=True)
    assert output_ids(tmp_path) == list(range(400))


def test_ignore_changes_reads_the_rewritten_files_again(spark, tmp_path):
    table = str(tmp_path / "src")
    append(table, range(0, 100))
    run(spark, tmp_path, table)
    DeltaTable(table).update(updates={"v": "v + 1"}, predicate="id = 4")  # in the p=0 file
    append(table, range(100, 110))
    run(spark, tmp_path, table, ignore_changes=True)
    out = pq.read_table(tmp_path / "ckpt-out").to_pylist()
    counts = {}
    for row in out:
        counts[row["id"]] = counts.get(row["id"], 0) + 1
    assert {i for i, n in counts.items() if n == 2} == set(range(0, 100, 2))  # the p=0 file
    assert {i for i, n in counts.items() if n == 1} == set(range(1, 100, 2)) | set(range(100, 110))
    assert sorted(r["v"] for r in out if r["id"] == 4) == [0, 1]


# -- what cannot be read ---------------------------------------------------------------------
def test_a_vacuumed_file_not_yet_read_stops_naming_its_version(spark, tmp_path):
    table = str(tmp_path / "src")
    append(table, range(0, 100))
    source = DeltaStreamSource("src", table)
    source.advance(source.plan())
    append(table, range(100, 200))  # version 1, not read yet
    compact(table)
    vacuum_all(table)  # deletes version 1's files
    with pytest.raises(SourceError, match=r"version 1 of .* added p=\d/part-.*, found the file "
                       r"missing \(2 missing.*VACUUM.*ignoreMissingFiles=true"):
        source.plan()
    source.bind(SimpleNamespace(spark=spark))
    spark.conf.set("spark.sql.files.ignoreMissingFiles", "true")
    try:
        piece = source.plan()
    finally:
        spark.conf.unset("spark.sql.files.ignoreMissingFiles")
    assert (piece["to_version"], piece["files"]) == (version(table), [])


def test_a_cleaned_up_log_stops_naming_the_version_and_what_to_do(tmp_path):
    table = str(tmp_path / "src")
    for start in range(0, 400, 100):
        append(table, range(start, start + 100))
    DeltaTable(table).create_checkpoint()
    for v in (0, 1):  # what the log cleanup after that checkpoint removes
        os.remove(log_json(table, v))
    source = DeltaStreamSource("src", table)
    with pytest.raises(SourceError, match=r"expected the commit of version 0 at .*"
                       r"00000000000000000000.json, found it gone \(the oldest commit still in "
                       r"the log is version 2\).*starting_version=2"):
        source.plan()
    assert piece_rows(drain(DeltaStreamSource("src", table, starting_version=2))) == 200


def test_deletion_vectors_are_refused_by_name_unless_their_commit_is_skipped(tmp_path):
    table = str(tmp_path / "src")
    append(table, range(0, 10))
    path = read_commit(Storage(table), 0).added[0].path
    dv = {"storageType": "i", "sizeInBytes": 40, "cardinality": 6,
          "pathOrInlineDv": "wi5b=000010000siXQKl0rr91000f55c8Xg0@@D72lkbi5=-{L"}
    actions = [{"commitInfo": {"operation": "DELETE"}},
               {"remove": {"path": path, "dataChange": True, "deletionTimestamp": 1}},
               {"add": {"path": path, "partitionValues": {"p": path[2]}, "size": 1,
                        "modificationTime": 1, "dataChange": True, "deletionVector": dv}}]
    log_json(table, 1).write_text("".join(json.dumps(a) + "\n" for a in actions))
    with pytest.raises(SourceError, match=r"version 1 of .* \(DELETE\) added p=\d/part-.* with a "
                       r"deletion vector.*skip_change_commits=True"):
        drain(DeltaStreamSource("src", table, ignore_changes=True))
    assert piece_rows(drain(DeltaStreamSource("src", table, skip_change_commits=True))) == 10


def test_column_mapping_is_refused_by_name(tmp_path):
    table = str(tmp_path / "src")
    write_deltalake(table, pa.table({"id": pa.array([1, 2], pa.int64())}),
                    configuration={"delta.columnMapping.mode": "name"})
    with pytest.raises(SourceError, match=r"uses column mapping at its latest version 0 "
                       r"\(delta.columnMapping.mode=name\)"):
        DeltaStreamSource("src", table).plan()


def test_a_schema_change_after_start_stops_and_a_new_pipeline_reads_the_new_schema(spark,
                                                                                    tmp_path):
    table = str(tmp_path / "src")
    append(table, range(0, 4))
    source = DeltaStreamSource("src", table)
    source.advance(source.plan())  # the source's schema is now id, p, v
    write_deltalake(table, pa.table({"id": pa.array([4], pa.int64()),
                                     "p": pa.array([0], pa.int64()),
                                     "v": pa.array([0], pa.int64()), "x": ["new"]}),
                    mode="append", partition_by=["p"], schema_mode="merge")
    with pytest.raises(SourceError, match=r"version 1 of .* \(WRITE\) changed the table's schema "
                       r"to .*x:string.*column x is not in the source's schema.*"
                       r"starting_version=1"):
        source.plan()
    fresh = DeltaStreamSource("src", table)  # reads the older versions with the new schema
    piece = fresh.plan()
    rows = fresh.read(SimpleNamespace(spark=spark), piece).orderBy("id").collect()
    assert [(r.id, r.x) for r in rows] == [(0, None), (1, None), (2, None), (3, None),
                                           (4, "new")]


# -- pieces ----------------------------------------------------------------------------------
def test_pieces_hold_decoded_paths_and_partition_values_read_exactly(
        spark, tmp_path):
    table = str(tmp_path / "src")
    when = dt.datetime(2024, 1, 1, 10, 0, 0, 123456, tzinfo=dt.UTC)
    write_deltalake(table, pa.table({
        "id": pa.array([1, 2, 3], pa.int64()),
        "name": pa.array(["x y%z=é", None, "a/../b"]),
        "n": pa.array([1, None, 3], pa.int32()),
        "ts": pa.array([when] * 3, pa.timestamp("us", tz="UTC")),
    }), partition_by=["name", "n", "ts"])
    source = DeltaStreamSource("src", table)
    piece = source.plan()
    source.check_piece(piece, "allocation 0")
    assert all(Path(table, f[0]).exists() for f in piece["files"])
    assert sorted((f[3]["name"] or "", f[3]["n"] or 0) for f in piece["files"]) == \
        [("", 0), ("a/../b", 3), ("x y%z=é", 1)]
    assert {f[3]["ts"] for f in piece["files"]} == {"2024-01-01T10:00:00.123456Z"}
    run_ = SimpleNamespace(spark=spark)
    original = spark.conf.get("spark.sql.session.timeZone")
    spark.conf.set("spark.sql.session.timeZone", "America/New_York")
    try:
        got = sorted(tuple(r) for r in source.read(run_, piece).select(
            "id", "name", "n", F.unix_micros("ts")).collect())
    finally:
        spark.conf.set("spark.sql.session.timeZone", original)
    want = read_delta(table).to_pylist()
    micros = int(when.timestamp()) * 1_000_000 + 123456
    assert got == sorted((r["id"], r["name"], r["n"], micros) for r in want)


def test_a_piece_the_snapshot_planner_recorded_still_restores_and_reads(spark, tmp_path):
    """Pieces keep their format: one recorded by the planner that diffed snapshots (paths and
    typed partition values of delta-rs's add actions) is the piece planned now, and reads."""
    table = str(tmp_path / "src")
    append(table, range(0, 10))
    adds = pa.table(DeltaTable(table).get_add_actions(flatten=True)).to_pylist()
    old = {"from_version": -1, "to_version": 0, "rows": 10, "files": sorted(
        [a["path"], a["size_bytes"], a["num_records"], {"p": a["partition.p"]}] for a in adds)}
    source = DeltaStreamSource("src", table)
    source.check_piece(old, "allocations/000000000000.json")
    assert source.plan() == old
    source.restore([(0, old)])
    assert source.version == 0 and source.is_empty(source.plan())
    rows = source.read(SimpleNamespace(spark=spark), old).collect()
    assert sorted((r.id, r.p) for r in rows) == [(i, i % 2) for i in range(10)]
