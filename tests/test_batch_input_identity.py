"""Batch inputs are told apart by more than their size: a file rewritten in place with the
same size but a later modification time (or another object version) runs again what read it;
``spark.ckpt.batch.onInputChanged=fail`` refuses it instead; an untouched file always reuses;
content rewritten with its old time kept is not detected (docs/recovery.md). Event logs of
format 1 (files recorded by path and size) are still read."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import types

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest
from chispa import assert_df_equality
from deltalake import write_deltalake
from pyspark.sql import functions as F

import test_recovery_faults as recovery
from helpers import ROOT, assert_outputs_equal, finished_in_log, read_daily
from spark_ckpt import BatchJob, InputChangedError, Settings, faults
from spark_ckpt.sources.file_identity import FileIdentity, identify
from spark_ckpt.sources.job_inputs import FileSource, decode_files, decode_splits, encode_splits
from spark_ckpt.storage.delta_reader import read_delta
from spark_ckpt.eventlog.events import EVENT_SCHEMA, Event, EventType
from spark_ckpt.eventlog.reader import read_events
from spark_ckpt.storage import Storage

SETTINGS = Settings(progress="never", event_log_flush_interval_ms=200)
REFUSE = dataclasses.replace(SETTINGS, batch_on_input_changed="fail")
FLIGHTS = "carrier STRING, day DATE, delay INT, distance INT"


# -- a small job: CSV flights, enriched (durable), a per-carrier, per-month report ----------
def write_flights(directory, files=4, rows=12):
    """``files`` CSV files of flights whose delays have two digits (a rewrite that changes
    them keeps every file's size)."""
    directory.mkdir()
    carriers = ("AA", "UA", "DL")
    for f in range(files):
        lines = ["carrier,day,delay,distance"]
        for r in range(rows):
            n = f * rows + r
            lines.append(f"{carriers[n % 3]},2026-0{1 + n % 2}-{10 + n % 18},"
                         f"{10 + (n * 7) % 90},{100 + (n * 37) % 900}")
        (directory / f"flights-{f}.csv").write_text("\n".join(lines) + "\n")
    return directory


def enrich(flights):
    return (flights.where(F.col("distance") > 0)
            .withColumn("month", F.date_format("day", "yyyy-MM"))
            .select("carrier", "month", "delay", "distance"))


def report(enriched):
    return enriched.groupBy("carrier", "month").agg(
        F.count("*").alias("flights"), F.sum("delay").alias("delay"),
        F.sum("distance").alias("distance"))


def flights_job(spark, tmp_path, job_id, settings=SETTINGS):
    job = BatchJob(job_id, spark=spark, work_dir=str(tmp_path / "work"), settings=settings)
    flights = job.read_files("flights", str(tmp_path / "flights"), format="csv",
                             parallelism=4, schema=FLIGHTS, options={"header": "true"})
    enriched = job.vertex("enriched", enrich, flights, durable=True)
    carrier_month = job.vertex("report", report, enriched.by("carrier", "month"),
                               parallelism=2)
    job.write_parquet(carrier_month, str(tmp_path / "out" / job_id))
    return job


def plain_report(spark, directory):
    return report(enrich(spark.read.options(header="true").schema(FLIGHTS)
                         .csv(str(directory))))


@contextlib.contextmanager
def failing_after_the_first_vertex(monkeypatch):
    """The job fails (an injected storage error) right after its first vertex's partitions
    became durable: a crash in this process, with the log as a killed driver leaves it."""
    monkeypatch.setattr(faults, "_spec_seen", [None])  # passes counted afresh, and
    monkeypatch.setattr(faults, "_counts", {})  # none of ours left to later tests
    monkeypatch.setenv("SPARK_CKPT_FAULT", "vertex.finished:1:fail")
    with pytest.raises(OSError, match="injected"):
        yield
    monkeypatch.delenv("SPARK_CKPT_FAULT")


def rewrite_delays(path):
    """Rewrite a flights file in place with other delays: the same size, other content."""
    header, *rows = path.read_text().splitlines()
    out = [header]
    for row in rows:
        carrier, day, delay, distance = row.split(",")
        out.append(f"{carrier},{day},{109 - int(delay)},{distance}")
    before = path.stat().st_size
    path.write_text("\n".join(out) + "\n")
    assert path.stat().st_size == before


def move_time_on(path, old):
    """The modification time after a rewrite, made surely later than ``old`` (a file system
    with a coarse clock could keep it otherwise)."""
    os.utime(path, ns=(old.st_atime_ns, max(path.stat().st_mtime_ns,
                                            old.st_mtime_ns + 5_000_000_000)))


# -- identities: unit cases (no Spark) ---------------------------------------------------------
def _fresh(source):
    files = source.identify()
    return source.discover(2, files), files


def test_an_untouched_input_compares_equal_to_what_another_process_recorded(tmp_path):
    directory = write_flights(tmp_path / "flights")
    record = ("import json, sys\n"
              "from spark_ckpt.sources.job_inputs import FileSource, encode_splits\n"
              "source = FileSource(sys.argv[1], 'csv')\n"
              "files = source.identify()\n"
              "print(json.dumps(encode_splits(source.discover(2, files), files)))\n")
    done = subprocess.run([sys.executable, "-c", record, str(directory)], capture_output=True,
                          text=True, check=True, cwd=ROOT)
    entries = json.loads(done.stdout)
    splits, files = decode_splits(entries), decode_files(entries)
    assert len(files) == 4 and all(f.mtime_ns is not None for f in files.values())
    recorded = dict(files)
    source = FileSource(str(directory), "csv")
    assert source.changed_splits("flights", splits, files, refuse=True) == set()
    assert files == recorded


def test_a_same_size_rewrite_with_a_later_time_changes_its_split_or_is_refused(tmp_path):
    directory = write_flights(tmp_path / "flights")
    source = FileSource(str(directory), "csv")
    files = source.identify()
    victim = directory / "flights-2.csv"
    old = victim.stat()
    rewrite_delays(victim)
    move_time_on(victim, old)

    with pytest.raises(InputChangedError) as refused:
        source.changed_splits("flights", source.discover(2, files), dict(files), refuse=True)
    message = str(refused.value)
    assert str(victim) in message and "modification time changed" in message
    assert f"recorded {files[str(victim)].describe()}; found " in message
    assert "1 rewritten file(s)" in message and "onInputChanged" in message

    splits = source.discover(2, files)
    assert source.changed_splits("flights", splits, files) == {1}  # files 2 and 3: split 1
    assert files[str(victim)].mtime_ns == victim.stat().st_mtime_ns
    assert encode_splits(splits, files) == encode_splits(*_fresh(source))


def test_content_rewritten_with_its_time_kept_is_not_detected(tmp_path):
    """rsync -t, touch -r: the same size and the same time. Undetectable without a checksum;
    documented in docs/recovery.md."""
    directory = write_flights(tmp_path / "flights")
    source = FileSource(str(directory), "csv")
    splits, files = _fresh(source)
    victim = directory / "flights-0.csv"
    old = victim.stat()
    rewrite_delays(victim)
    os.utime(victim, ns=(old.st_atime_ns, old.st_mtime_ns))
    assert source.changed_splits("flights", splits, files, refuse=True) == set()


def test_each_recorded_field_tells_a_rewrite_and_unknown_fields_are_not_compared():
    was = FileIdentity(10, 1_000, "ETag=\"a\"")
    assert was.changes(FileIdentity(10, 1_000, "ETag=\"a\"")) == []
    assert was.changes(FileIdentity(11, 1_000, "ETag=\"a\"")) == ["size"]
    assert was.changes(FileIdentity(10, 2_000, "ETag=\"a\"")) == ["modification time"]
    assert was.changes(FileIdentity(10, 1_000, "ETag=\"b\"")) == ["object version"]
    assert FileIdentity(10).changes(FileIdentity(10, 5, "generation=3")) == []  # format 1
    assert FileIdentity(10).completed(FileIdentity(10, 5, "generation=3")) == \
        FileIdentity(10, 5, "generation=3")
    assert "1970-01-01T00:00:01.000000002Z" in FileIdentity(3, 1_000_000_002).describe()


class _ObjectStore:
    """pyarrow's view of an object store, as far as identify() asks it."""

    def __init__(self, type_name, metadata):
        self.type_name = type_name
        self.metadata = metadata

    def open_input_file(self, path):
        if path not in self.metadata:
            raise FileNotFoundError(path)
        return contextlib.nullcontext(
            types.SimpleNamespace(metadata=lambda: self.metadata[path]))


@pytest.mark.parametrize("type_name, metadata, version", [
    ("s3", {"Content-Length": b"3", "ETag": b'"9a0364b9"'}, 'ETag="9a0364b9"'),
    ("s3", {"ETag": b'"9a0364b9"', "VersionId": b"3HL4kqtJ"}, "VersionId=3HL4kqtJ"),
    ("gcs", {"generation": b"1587627537231057", "etag": b"CNHZ"}, "generation=1587627537231057"),
    ("abfs", {"ETag": b"0x8DC"}, "ETag=0x8DC"),
    ("s3", {"Content-Length": b"3"}, None),  # a store that gives none
])
def test_object_stores_give_their_version_of_each_object(type_name, metadata, version):
    info = pafs.FileInfo("bucket/in/a.csv", pafs.FileType.File, size=3, mtime_ns=7_000_000)
    store = _ObjectStore(type_name, {"bucket/in/a.csv": metadata})
    assert identify(store, [info]) == [FileIdentity(3, 7_000_000, version)]
    assert identify(store, [info], versions=False) == [FileIdentity(3, 7_000_000, None)]
    gone = pafs.FileInfo("bucket/in/gone.csv", pafs.FileType.File, size=1, mtime_ns=1)
    assert identify(store, [gone]) == [FileIdentity(1, 1, None)]  # time and size still tell


def test_a_local_disk_has_no_object_version_and_is_not_asked_for_one(tmp_path):
    (tmp_path / "a.csv").write_text("x\n")
    store = Storage(str(tmp_path))
    infos = store.list_files(store.root)
    assert identify(store.fs, infos) == [
        FileIdentity(2, (tmp_path / "a.csv").stat().st_mtime_ns, None)]


# -- event logs of format 1 ------------------------------------------------------------------
# A JobVertexInitialized row of a file source as format 1 wrote it (Event.row() before this
# release): each file of a split recorded as [path, size].
V1_INITIALIZED = {
    "format_version": 1, "job_id": "flights", "job_attempt": 1, "seq": 2,
    "event_time": 1_795_000_000_000_000, "event_type": "JobVertexInitialized",
    "vertex_id": "flights", "partition": None, "attempt_id": None, "rows": None,
    "bytes": None, "duration_ms": None,
    "payload": '{"coordinator_state":{"checkpoint_id":-1,"schema":"{\\"fields\\":[],'
               '\\"type\\":\\"struct\\"}","splits":[[["/data/flights/flights-0.csv",301],'
               '["/data/flights/flights-1.csv",298]],[["/data/flights/flights-2.csv",305]]]},'
               '"descriptor":{"inputs":[]},"fingerprint":"5d41402abc4b2a76","parallelism":2}',
}


def test_a_format_1_event_is_read_and_its_files_recorded_by_size_only():
    event = Event.from_row(V1_INITIALIZED)
    entries = event.payload["coordinator_state"]["splits"]
    assert entries == [[["/data/flights/flights-0.csv", 301, None, None],
                        ["/data/flights/flights-1.csv", 298, None, None]],
                       [["/data/flights/flights-2.csv", 305, None, None]]]
    assert decode_splits(entries)[1] == [("/data/flights/flights-2.csv", 305)]
    assert decode_files(entries)["/data/flights/flights-0.csv"] == FileIdentity(301)
    assert event.payload["fingerprint"] == "5d41402abc4b2a76"
    assert Event.from_row(event.row()) == event  # written again as format 2


def test_a_log_of_format_1_rows_is_read_and_an_unknown_format_is_not(tmp_path):
    path = str(tmp_path / "events")
    finished = {**V1_INITIALIZED, "seq": 3, "event_type": "ExecutionVertexFinished",
                "vertex_id": "enriched", "partition": 0, "attempt_id": "a1-enriched-0-x",
                "payload": "{}"}
    write_deltalake(path, pa.Table.from_pylist([V1_INITIALIZED, finished],
                                               schema=EVENT_SCHEMA))
    read = read_events(Storage(str(tmp_path)), path)
    assert read.problems == []
    assert [e.type for e in read.events] == [EventType.JOB_VERTEX_INITIALIZED,
                                             EventType.EXECUTION_VERTEX_FINISHED]
    write_deltalake(path, pa.Table.from_pylist([{**finished, "format_version": 3, "seq": 4}],
                                               schema=EVENT_SCHEMA), mode="append")
    read = read_events(Storage(str(tmp_path)), path)
    assert len(read.events) == 2
    assert "this release reads 1, 2" in read.problems[0]


def as_format_1(work_dir, job_id):
    """Rewrite a job's event log as format 1 wrote it: every row of format 1, and a file
    source's files recorded as [path, size]."""
    path = str(work_dir / job_id / "events")
    rows = read_delta(path).to_pylist()
    for row in rows:
        row["format_version"] = 1
        payload = json.loads(row["payload"])
        state = payload.get("coordinator_state", {})
        if "splits" in state:
            state["splits"] = [[entry[:2] for entry in split] for split in state["splits"]]
            row["payload"] = json.dumps(payload, sort_keys=True, separators=(",", ":"))
    shutil.rmtree(path)  # the log is append-only: written anew
    write_deltalake(path, pa.Table.from_pylist(rows, schema=EVENT_SCHEMA))


def test_a_job_recovers_from_a_format_1_log_and_records_its_files_identities(
        spark, tmp_path, monkeypatch):
    """A log written before files carried their times: sizes are compared, everything durable
    is reused, and the source's record is completed with its files' times for later."""
    write_flights(tmp_path / "flights")
    with failing_after_the_first_vertex(monkeypatch):
        flights_job(spark, tmp_path, "old").run()
    as_format_1(tmp_path / "work", "old")
    result = flights_job(spark, tmp_path, "old").run()
    assert (result.vertices["enriched"].reused, result.vertices["report"].ran) == (4, 2)
    assert_df_equality(spark.read.parquet(str(tmp_path / "out" / "old")),
                       plain_report(spark, tmp_path / "flights"),
                       ignore_row_order=True, ignore_nullable=True)
    events = read_events(Storage(str(tmp_path)), str(tmp_path / "work" / "old" / "events"))
    last = [e for e in events.events if e.type is EventType.JOB_VERTEX_INITIALIZED
            and e.vertex_id == "flights"][-1]
    files = decode_files(last.payload["coordinator_state"]["splits"])
    victim = tmp_path / "flights" / "flights-1.csv"
    assert files[str(victim)] == FileIdentity(victim.stat().st_size,
                                              victim.stat().st_mtime_ns, None)


# -- a job that failed after enriched became durable, in this process -------------------------
def test_a_same_size_rewrite_reruns_what_read_it_unless_refused(spark, tmp_path, monkeypatch):
    """The reported bug, small: a same-size correction with a later time. Refused with
    onInputChanged=fail (naming the file; nothing runs); by default the split that read it,
    and everything downstream, run again: plain Spark's answer on the current input."""
    directory = write_flights(tmp_path / "flights")
    with failing_after_the_first_vertex(monkeypatch):
        flights_job(spark, tmp_path, "flights").run()
    before = finished_in_log(str(tmp_path / "work"), "flights")
    assert {p for v, p in before if v == "enriched"} == {0, 1, 2, 3}
    original = plain_report(spark, directory).collect()
    victim = directory / "flights-2.csv"
    old = victim.stat()
    rewrite_delays(victim)
    move_time_on(victim, old)

    with pytest.raises(InputChangedError, match=r"flights-2\.csv was rewritten") as refused:
        flights_job(spark, tmp_path, "flights", REFUSE).run()
    size = f"{old.st_size:,} bytes, modified "
    assert f"recorded {size}" in str(refused.value) and f"found {size}" in str(refused.value)
    assert finished_in_log(str(tmp_path / "work"), "flights") == before  # nothing ran

    result = flights_job(spark, tmp_path, "flights").run()
    assert {v: (s.reused, s.ran) for v, s in result.vertices.items()} == {
        "enriched": (3, 1), "report": (0, 2)}
    got = spark.read.parquet(str(tmp_path / "out" / "flights"))
    assert_df_equality(got, plain_report(spark, directory),
                       ignore_row_order=True, ignore_nullable=True)
    assert sorted(got.collect()) != sorted(original)  # the rewrite changed the answer


# -- real drivers, SIGKILLed after durable partitions were written -----------------------------
def fixed_size_layout(path, amounts=1):
    """Write an orders file again uncompressed, without dictionaries or statistics, with its
    amounts multiplied by ``amounts``: its size no longer depends on its values."""
    import pyarrow.compute as pc

    rows = pq.read_table(path)
    rows = rows.set_column(rows.schema.get_field_index("amount"), "amount",
                           pc.multiply(rows.column("amount"), amounts))
    pq.write_table(rows, path, compression="none", use_dictionary=False,
                   write_statistics=False)


def killed_after_enriched(orders_input, tmp_path):
    """A copy of the orders input (its second orders file laid out so that a rewrite keeps
    its size), and the orders report SIGKILLed once enriched's partitions were durable."""
    local = tmp_path / "input"
    shutil.copytree(orders_input, local)
    victim = sorted((local / "orders").glob("*.parquet"))[1]  # split 1 of 4
    fixed_size_layout(victim)  # the same rows: plain Spark's answer is unchanged
    recovery.crash(str(local), tmp_path, "vertex.finished:1")
    assert {p for v, p in finished_in_log(str(tmp_path / "work")) if v == "enriched"} == \
        {0, 1, 2, 3}
    return local, victim


@pytest.mark.slow
def test_a_killed_job_reruns_a_file_rewritten_with_the_same_size_or_refuses_it(
        spark, orders_input, expected_daily, tmp_path):
    local, victim = killed_after_enriched(orders_input, tmp_path)
    before = finished_in_log(str(tmp_path / "work"))
    old = victim.stat()
    fixed_size_layout(victim, amounts=2)
    assert victim.stat().st_size == old.st_size
    move_time_on(victim, old)

    refuse = dataclasses.replace(recovery.SETTINGS, batch_on_input_changed="fail")
    with pytest.raises(InputChangedError) as refused:
        recovery.resubmit(spark, str(local), tmp_path, settings=refuse)
    message = str(refused.value)
    assert f"input file {victim} was rewritten" in message
    assert f"recorded {old.st_size:,} bytes, modified " in message
    assert "1 rewritten file(s)" in message  # the other files, recorded by the killed driver
    assert finished_in_log(str(tmp_path / "work")) == before

    result = recovery.resubmit(spark, str(local), tmp_path)
    assert {v: s.ran for v, s in result.vertices.items()} == {
        "enriched": 1, "payments-to-settled": 4, "settled": 4, "daily": 2}
    assert result.vertices["enriched"].reused == 3
    recovery.assert_daily_is_plain_sparks(spark, local, tmp_path / "out")
    assert not read_daily(str(tmp_path / "out")).equals(expected_daily["daily"])


@pytest.mark.slow
def test_a_killed_job_cannot_tell_a_rewrite_that_kept_the_time_and_reuses_it(
        spark, orders_input, expected_daily, tmp_path):
    """Documented (docs/recovery.md): content rewritten with its size and time kept (rsync -t,
    touch -r) is the file the killed driver recorded; everything durable is reused, and the
    answer is the one from the content it read."""
    local, victim = killed_after_enriched(orders_input, tmp_path)
    old = victim.stat()
    fixed_size_layout(victim, amounts=2)
    os.utime(victim, ns=(old.st_atime_ns, old.st_mtime_ns))

    result = recovery.resubmit(spark, str(local), tmp_path)
    assert {v: s.ran for v, s in result.vertices.items()} == {
        "enriched": 0, "payments-to-settled": 4, "settled": 4, "daily": 2}
    assert result.vertices["enriched"].reused == 4  # and every untouched file's too
    assert_outputs_equal(spark, str(tmp_path / "out"), expected_daily)
