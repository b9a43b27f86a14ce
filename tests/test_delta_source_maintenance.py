"""A Delta streaming source on a table that is maintained and changed while it is read:
OPTIMIZE, DELETE, UPDATE, MERGE, overwrite, VACUUM, log cleanup, schema changes, deletion
vectors and column mapping, between runs and within one run, under each of Delta's options
(ignore_deletes, ignore_changes, skip_change_commits); where a new pipeline starts (the table's
snapshot, or an explicit starting_version), add paths given as absolute URIs, and a table
created again at the same path. Real delta-rs tables throughout; the pipelines run on the
shared SparkSession."""

from __future__ import annotations

import datetime as dt
import json
import os
import shutil
import struct
from collections import Counter
from pathlib import Path
from types import SimpleNamespace
from urllib.parse import quote

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from deltalake import DeltaTable, write_deltalake
from pyspark.sql import functions as F

from spark_ckpt import PipelineFailedError, Settings, SourceError, StreamingContext
from spark_ckpt.storage.delta_reader import read_delta
from spark_ckpt.storage import Storage
from spark_ckpt.sources.delta_log import CommitKind, earliest_commit, parse_commit, read_commit
from spark_ckpt.sources.delta_stream import DeltaStreamSource

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


_Z85 = "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ.-:+=^!/*?&<>()[]{}@%$#"


def inline_deletion_vector(rows) -> dict:
    """A valid inline deletion vector (Delta's RoaringBitmapArray, Z85-encoded) marking
    ``rows`` (< 65536) of a file deleted, as delta-rs applies it."""
    rows = sorted(rows)
    bitmap = struct.pack("<II", 12346, 1) + struct.pack("<HH", 0, len(rows) - 1)
    bitmap += struct.pack("<I", len(bitmap) + 4) + b"".join(struct.pack("<H", r) for r in rows)
    data = struct.pack("<iqi", 1681511377, 1, 0) + bitmap
    size = len(data)
    data += b"\0" * (-len(data) % 4)
    encoded = []
    for i in range(0, len(data), 4):
        n, chunk = int.from_bytes(data[i:i + 4], "big"), ""
        for _ in range(5):
            n, digit = divmod(n, 85)
            chunk = _Z85[digit] + chunk
        encoded.append(chunk)
    return {"storageType": "i", "pathOrInlineDv": "".join(encoded), "sizeInBytes": size,
            "cardinality": len(rows)}


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
def operate(table: str, operation: str) -> None:
    """One maintenance operation or change on ``table`` (one commit, or two for vacuum)."""
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
    else:  # pragma: no cover - a typo in a test
        raise ValueError(operation)


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
    operate(table, operation)
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
    source = DeltaStreamSource("src", table, starting_version=0, max_versions_per_batch=2)
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
    progress = run_collecting(spark, tmp_path, table, got, maintain, starting_version=0,
                              skip_change_commits=True)
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
        run_collecting(spark, tmp_path, table, got, change, starting_version=0)
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


def cleaned_up_table(tmp_path: Path) -> str:
    """Four appends of 100 rows, a log checkpoint, then versions 0 and 1's commits removed, as
    the log cleanup after that checkpoint does."""
    table = str(tmp_path / "src")
    for start in range(0, 400, 100):
        append(table, range(start, start + 100))
    DeltaTable(table).create_checkpoint()
    for v in (0, 1):
        os.remove(log_json(table, v))
    return table


def test_a_cleaned_up_log_stops_naming_the_version_and_what_to_do(tmp_path):
    table = cleaned_up_table(tmp_path)
    source = DeltaStreamSource("src", table, starting_version=0)
    with pytest.raises(SourceError, match=r"expected the commit of version 0 at .*"
                       r"00000000000000000000.json, found it gone \(the oldest commit still in "
                       r"the log is version 2\).*without starting_version it reads the "
                       r"table's current rows first.*starting_version=2"):
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
        drain(DeltaStreamSource("src", table, starting_version=0, ignore_changes=True))
    assert piece_rows(drain(DeltaStreamSource("src", table, starting_version=0,
                                              skip_change_commits=True))) == 10


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
    planned = source.plan()
    assert planned.pop("table_id") == DeltaTable(table).metadata().id
    assert planned == old  # the first batch is the snapshot again, as then
    source.restore([(0, old)])
    assert source.version == 0 and source.is_empty(source.plan())
    rows = source.read(SimpleNamespace(spark=spark), old).collect()
    assert sorted((r.id, r.p) for r in rows) == [(i, i % 2) for i in range(10)]


# -- where a new pipeline starts: the table's current rows, then its changes -------------------
def deleted_then_appended(tmp_path) -> str:
    """write(0..9), delete("id < 3") (rewrites both files), append(10..19): 17 rows."""
    table = str(tmp_path / "src")
    append(table, range(0, 10))          # 0
    DeltaTable(table).delete("id < 3")   # 1
    append(table, range(10, 20))         # 2
    assert read_delta(table).num_rows == 17
    return table


@pytest.mark.parametrize("option", sorted(OPTIONS))
def test_a_new_pipeline_reads_the_tables_current_rows_first(spark, tmp_path, option):
    """The first batch is the table as it is (Delta Lake's source without startingVersion):
    rows an earlier DELETE removed do not come back, and the DELETE does not stop the pipeline
    (reading history instead gave a SourceError at version 1 by default, 20 rows with
    skip_change_commits, 27 with ignore_changes)."""
    table = deleted_then_appended(tmp_path)
    progress = run(spark, tmp_path, table, **OPTIONS[option])
    assert output_ids(tmp_path) == list(range(3, 20))
    assert progress[0]["num_input_rows"] == 17
    assert sum(p["num_input_rows"] for p in progress) == 17
    append(table, range(20, 30))         # 3: read as a change, once
    progress = run(spark, tmp_path, table, **OPTIONS[option])
    assert output_ids(tmp_path) == list(range(3, 30))
    assert sum(p["num_input_rows"] for p in progress) == 10


def test_an_explicit_starting_version_reads_the_changes_from_it(tmp_path):
    """starting_version=k is Delta's startingVersion: the commits from k, under the options."""
    table = deleted_then_appended(tmp_path)
    with pytest.raises(SourceError, match=r"version 1 of .* \(DELETE\) removed 2 file\(s\)"):
        DeltaStreamSource("src", table, starting_version=0).plan()
    assert piece_rows(drain(DeltaStreamSource("src", table, starting_version=0,
                                              skip_change_commits=True))) == 20
    assert piece_rows(drain(DeltaStreamSource("src", table, starting_version=2))) == 10
    first = DeltaStreamSource("src", table, starting_version=5).plan()  # not written yet
    assert (first["from_version"], first["to_version"], first["files"]) == (4, 4, [])


def test_a_new_pipeline_reads_a_table_whose_first_commits_were_cleaned_up(tmp_path):
    table = cleaned_up_table(tmp_path)
    source = DeltaStreamSource("src", table)
    (piece,) = drain(source)
    assert (piece["from_version"], piece["to_version"], piece["rows"]) == (-1, 3, 400)
    assert all(Path(table, f[0]).exists() for f in piece["files"])
    append(table, range(400, 500))
    (piece,) = drain(source)
    assert (piece["from_version"], piece["to_version"], piece["rows"]) == (3, 4, 100)


def test_the_snapshot_is_one_batch_then_max_versions_per_batch_bounds_the_changes(tmp_path):
    table = str(tmp_path / "src")
    append(table, range(0, 100))          # 0
    append(table, range(100, 200))        # 1
    compact(table)                        # 2
    DeltaTable(table).delete("id < 10")   # 3
    append(table, range(200, 300))        # 4
    source = DeltaStreamSource("src", table, max_versions_per_batch=1)
    first = source.plan()
    assert (first["from_version"], first["to_version"], first["rows"]) == (-1, 4, 290)
    source.advance(first)
    append(table, range(300, 400))        # 5
    compact(table)                        # 6
    append(table, range(400, 500))        # 7
    assert [(p["from_version"], p["to_version"], p["rows"]) for p in drain(source)] == \
        [(4, 5, 100), (5, 6, 0), (6, 7, 100)]


def test_a_snapshot_with_deletion_vectors_is_refused_by_name(tmp_path):
    table = str(tmp_path / "src")
    append(table, range(0, 10))
    add = pa.table(DeltaTable(table).get_add_actions(flatten=True)).to_pylist()[0]
    actions = [{"commitInfo": {"operation": "DELETE"}},
               {"remove": {"path": add["path"], "dataChange": True, "deletionTimestamp": 1}},
               {"add": {"path": add["path"], "partitionValues": {"p": str(add["partition.p"])},
                        "size": add["size_bytes"], "modificationTime": 1, "dataChange": True,
                        "stats": json.dumps({"numRecords": add["num_records"]}),
                        "deletionVector": inline_deletion_vector([0, 2])}}]
    log_json(table, 1).write_text("".join(json.dumps(a) + "\n" for a in actions))
    assert pa.table(DeltaTable(table).deletion_vectors()).column(  # delta-rs reads it
        "selection_vector").to_pylist() == [[False, True, False, True, True]]
    with pytest.raises(SourceError, match=r"at version 1, which a new pipeline reads first .* "
                       r"holds 1 file\(s\) with deletion vectors \(.*p=\d/part-.*\).*REORG "
                       r"TABLE.*starting_version=2"):
        DeltaStreamSource("src", table, skip_change_commits=True).plan()
    append(table, range(10, 20))  # 2
    assert piece_rows(drain(DeltaStreamSource("src", table, starting_version=2))) == 10


# -- add actions that name their file by an absolute URI (shallow clones) -----------------------
def test_add_paths_with_a_scheme_are_absolute_and_decoded(tmp_path):
    source = DeltaStreamSource("src", str(tmp_path))  # no table needed to resolve paths
    cases = {
        "p=a%2520b/x.parquet": "p=a%20b/x.parquet",
        "file:/data/a%20b/p%3D1/x%2520y.parquet": "file:///data/a b/p=1/x%20y.parquet",
        "file:///data/a%20b/x.parquet": "file:///data/a b/x.parquet",
        "file://localhost/data/x.parquet": "file:///data/x.parquet",
        "s3://bucket/dir/a%20b.parquet": "s3://bucket/dir/a b.parquet",
        "s3a://bucket/k%3D1/x.parquet": "s3a://bucket/k=1/x.parquet",
        "abfss://c@acct.dfs.core.windows.net/t/x%20y.parquet":
            "abfss://c@acct.dfs.core.windows.net/t/x y.parquet",
        "gs://bucket/x%20y.parquet": "gs://bucket/x y.parquet",
        "/data/x%20y.parquet": "/data/x y.parquet",
    }
    for raw, want in cases.items():
        line = json.dumps({"add": {"path": raw, "size": 1, "dataChange": True}})
        (added,) = parse_commit(1, line).added
        assert added.path == want, raw
        full = source._full(added.path)
        assert full == (want if raw[0] != "p" else f"{tmp_path}/{want}"), raw


@pytest.mark.parametrize("form", ["file:{}", "file://{}"])
def test_a_file_named_by_an_absolute_uri_is_read_where_it_is(spark, tmp_path, form):
    """A shallow clone's add actions name the source table's files by absolute URI (Hadoop's
    ``file:/abs`` form has no ``//``); they were joined under the table's path and missing."""
    table = str(tmp_path / "src")
    append(table, range(0, 4))
    elsewhere = tmp_path / "cloned from" / "p=1"
    elsewhere.mkdir(parents=True)
    pq.write_table(pa.table({"id": pa.array([101, 103], pa.int64()),
                             "v": pa.array([0, 0], pa.int64())}), elsewhere / "x y.parquet")
    actions = [{"commitInfo": {"operation": "WRITE"}},
               {"add": {"path": form.format(quote(str(elsewhere / "x y.parquet"))),
                        "partitionValues": {"p": "1"},
                        "size": (elsewhere / "x y.parquet").stat().st_size,
                        "modificationTime": 1, "dataChange": True,
                        "stats": json.dumps({"numRecords": 2})}}]
    log_json(table, 1).write_text("".join(json.dumps(a) + "\n" for a in actions))
    for source in (DeltaStreamSource("src", table),
                   DeltaStreamSource("src", table, starting_version=0)):
        pieces = drain(source)
        assert piece_rows(pieces) == 6
        got = [(r.id, r.p) for p in pieces
               for r in source.read(SimpleNamespace(spark=spark), p).collect()]
        assert sorted(got) == [(0, 0), (1, 1), (2, 0), (3, 1), (101, 1), (103, 1)]


# -- a table created again at the same path ----------------------------------------------------
def test_a_table_created_again_at_the_same_path_stops_naming_both_ids(spark, tmp_path):
    table = str(tmp_path / "src")
    for start in (0, 100, 200):                   # versions 0-2
        append(table, range(start, start + 100))
    run(spark, tmp_path, table)
    old_id = DeltaTable(table).metadata().id
    shutil.rmtree(table)
    for start in range(1000, 1500, 100):          # versions 0-4 of another table
        append(table, range(start, start + 100))
    new_id = DeltaTable(table).metadata().id
    assert new_id != old_id
    with pytest.raises(PipelineFailedError, match=(
            rf"read through version 2 at .* \(table id {old_id}\), found another table there "
            rf"\(table id {new_id}, latest version 4\): the table was deleted and created "
            r"again.*start a new pipeline.*put it back")):
        run(spark, tmp_path, table)
    assert output_ids(tmp_path) == list(range(300))  # nothing of the new table was read
    run(spark, tmp_path, table, ckpt="fresh")
    assert output_ids(tmp_path, "fresh") == list(range(1000, 1500))


def test_pieces_record_the_table_id_and_older_pieces_without_one_still_catch_a_going_back(
        tmp_path):
    table = str(tmp_path / "src")
    for start in (0, 100, 200):
        append(table, range(start, start + 100))
    table_id = DeltaTable(table).metadata().id
    source = DeltaStreamSource("src", table)
    piece = source.plan()
    assert piece["table_id"] == table_id
    source.check_piece(piece, "allocations/000000000000.json")
    restored = DeltaStreamSource("src", table)
    restored.restore([(0, piece)])
    assert restored.table_id == table_id
    older = {k: v for k, v in piece.items() if k != "table_id"}  # recorded before ids were
    source = DeltaStreamSource("src", table)
    source.check_piece(older, "allocations/000000000000.json")
    source.restore([(0, older)])
    shutil.rmtree(table)
    append(table, range(1000, 1100))              # version 0 of another table
    with pytest.raises(SourceError, match=r"expected version 2 or later of .* found the table's "
                       r"latest version 0 \(table id .*\): a Delta table's versions never go "
                       r"back.*start a new pipeline"):
        source.plan()
    with pytest.raises(SourceError, match=rf"table id {table_id}\), found another table"):
        restored.plan()


# -- changes between runs and within a run, end to end -------------------------------------------
@pytest.mark.parametrize("operation", ["merge", "overwrite"])
def test_merge_and_overwrite_between_runs_follow_the_options(spark, tmp_path, operation):
    table = str(tmp_path / "src")
    append(table, range(0, 100))
    append(table, range(100, 200))
    for ckpt in ("skip", "changes"):
        run(spark, tmp_path, table, ckpt=ckpt)
    operate(table, operation)             # 2
    append(table, range(1000, 1100))      # 3
    logged = {"merge": "MERGE", "overwrite": "WRITE"}[operation]
    with pytest.raises(PipelineFailedError, match=rf"version 2 of .* \({logged}\) removed \d+ "
                       r"file\(s\).* it rewrote rows.*skip_change_commits=True"):
        run(spark, tmp_path, table, ckpt="skip")
    assert output_ids(tmp_path, "skip") == list(range(200))
    run(spark, tmp_path, table, ckpt="skip", skip_change_commits=True)
    assert output_ids(tmp_path, "skip") == list(range(200)) + list(range(1000, 1100))
    # ignore_changes: every file the commit added is read as new rows, once
    rewritten = [i for f in read_commit(Storage(table), 2).added
                 for i in pq.read_table(Path(table, f.path)).column("id").to_pylist()]
    want = Counter(range(200)) + Counter(rewritten) + Counter(range(1000, 1100))
    run(spark, tmp_path, table, ckpt="changes", ignore_changes=True)
    out = pq.read_table(tmp_path / "changes-out").to_pylist()
    assert Counter(r["id"] for r in out) == want
    if operation == "merge":
        assert {20, 505} <= set(rewritten)
        assert sorted(r["v"] for r in out if r["id"] == 20) == [0, 7]
    else:
        assert sorted(rewritten) == [900, 901]


@pytest.mark.parametrize("option", ["default", "ignore_deletes"])
def test_compaction_then_append_within_one_run_gives_each_row_once(spark, tmp_path, option):
    table = str(tmp_path / "src")
    append(table, range(0, 100))               # 0
    append(table, range(100, 200))             # 1

    def maintain(batch_id):
        if batch_id == 0:  # the snapshot at version 1 was read
            compact(table)                     # 2
            append(table, range(200, 300))     # 3
        elif batch_id == 2:  # version 3 was read (batch b > 0 reads version b + 1)
            compact(table)                     # 4
            vacuum_all(table)                  # 5, 6: deletes every file read so far
            append(table, range(300, 400))     # 7

    got: dict[int, list[int]] = {}
    progress = run_collecting(spark, tmp_path, table, got, maintain, **OPTIONS[option])
    assert sorted(i for ids in got.values() for i in ids) == list(range(400))
    assert {b: len(ids) for b, ids in got.items() if ids} == {0: 200, 2: 100, 6: 100}
    assert [p["batch_id"] for p in progress] == list(range(7))


RESTARTED = {
    "default": ["optimize", "vacuum"],
    "ignore_deletes": ["optimize", "vacuum", "delete_files"],
    "skip_change_commits": ["optimize", "vacuum", "delete_files", "delete_rows", "update",
                            "merge", "overwrite"],
}


@pytest.mark.parametrize("option", sorted(RESTARTED))
def test_a_pipeline_restarted_after_each_maintenance_operation_gives_each_row_once(
        spark, tmp_path, option):
    """Stop, maintain, append, restart, for each operation the option lets through: every row
    appended is in the output once; the table's rows before the first start are read as they
    were then (a DELETE before it does not stop the pipeline, nor bring rows back)."""
    table = str(tmp_path / "src")
    append(table, range(0, 100))
    DeltaTable(table).delete("id >= 90")
    run(spark, tmp_path, table, **OPTIONS[option])
    want = list(range(90))
    assert output_ids(tmp_path) == want
    for n, operation in enumerate(RESTARTED[option], 1):
        operate(table, operation)
        append(table, range(1000 * n, 1000 * n + 10))
        want += range(1000 * n, 1000 * n + 10)
        run(spark, tmp_path, table, **OPTIONS[option])
        assert output_ids(tmp_path) == want, operation
