"""Every ``spark-ckpt`` command on a directory that is not what it reads: a path where nothing
is, a foreign directory (a job work directory where a pipeline's checkpoint directory is
expected, the other way round, a directory of other files) and a damaged one (a record that
does not read as a start reads it). Each is refused with exit code 1 and a message saying what
was expected and what was found, naming the damaged file; nothing is written. The same
commands on the good directories answer as before (exit code 0)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from spark_ckpt import BatchJob, DirectoryError, Settings, StreamingContext
from spark_ckpt.ops.cli import main
from spark_ckpt.state.aggregates import count

JOB = "tiny"
# every command, by what it reads: a pipeline's checkpoint directory (D) or a work directory
# holding job JOB (W); OUT: where a report would go
PIPELINE_COMMANDS = {
    "checkpoints list": ["checkpoints", "list", "D"],
    "checkpoints show": ["checkpoints", "show", "D"],
    "validate": ["validate", "D"],
    "status": ["status", "D"],
    "plan --pipeline": ["plan", "--pipeline", "D"],
    "stop": ["stop", "D", "--timeout", "0.1"],
    "restore": ["restore", "D", "1"],
    "restore --cancel": ["restore", "D", "--cancel"],
    "cleanup": ["cleanup", "D"],
    "report": ["report", "D", "-o", "OUT"],
}
JOB_COMMANDS = {
    "jobs": ["jobs", "--work-dir", "W"],
    "history": ["history", JOB, "--work-dir", "W"],
    "events": ["events", JOB, "--work-dir", "W"],
    "plan": ["plan", JOB, "--work-dir", "W"],
    "validate --job": ["validate", "--job", JOB, "--work-dir", "W"],
    "status --job": ["status", "--job", JOB, "--work-dir", "W"],
    "report --job": ["report", "--job", JOB, "--work-dir", "W", "-o", "OUT"],
}
COMMANDS = {**PIPELINE_COMMANDS, **JOB_COMMANDS}


def _files(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes()
            for p in sorted(directory.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def dirs(spark, tmp_path_factory) -> dict[str, Path]:
    """One small pipeline and one small batch job, run for real; copies with one record
    damaged: the pipeline's metadata.json (a field of the wrong type), the job's event log
    (every commit torn)."""
    base = tmp_path_factory.mktemp("refusals")
    ckpt, work = base / "ckpt", base / "work"
    ctx = StreamingContext(spark, 0.05, str(ckpt), "refusals",
                           settings=Settings(progress="never", checkpoint_interval_ms=1,
                                             state_parallelism=2, state_max_parallelism=8))
    gen = ctx.generator_stream("gen", rows_per_batch=100, total_rows=200, keys=5)
    gen.key_by("key").agg("totals", n=count()).write_parquet(str(base / "out"), name="out")
    ctx.process_available(timeout=300)
    job = BatchJob(JOB, spark=spark, work_dir=str(work), settings=Settings(progress="never"))
    numbers = job.source("numbers", lambda s: s.range(0, 10), parallelism=2, split_by=["id"])
    job.write_parquet(numbers, str(base / "job-out"))
    assert job.run().status == "succeeded"

    damaged_ckpt = base / "ckpt-damaged"
    shutil.copytree(ckpt, damaged_ckpt)
    meta = json.loads((damaged_ckpt / "metadata.json").read_text())
    (damaged_ckpt / "metadata.json").write_text(json.dumps({**meta, "name": 3}))
    damaged_work = base / "work-damaged"
    shutil.copytree(work, damaged_work)
    for commit in (damaged_work / JOB / "events" / "_delta_log").glob("*.json"):
        commit.write_bytes(commit.read_bytes()[:40])  # torn: none loads
    others = base / "others"
    others.mkdir()
    (others / "notes.txt").write_text("not spark_ckpt's")
    (others / "data").mkdir()
    return {"ckpt": ckpt, "work": work, "ckpt-damaged": damaged_ckpt,
            "work-damaged": damaged_work, "others": others, "missing": base / "nowhere"}


def _run(command: str, directory: Path, out: Path) -> tuple[int, str, BaseException | None]:
    args = [str(directory) if a in ("D", "W") else str(out) if a == "OUT" else a
            for a in COMMANDS[command]]
    result = CliRunner().invoke(main, args)
    return result.exit_code, result.output, result.exception


def test_the_matrix_covers_every_command():
    def leaves(group, prefix=()):
        for name, cmd in group.commands.items():
            if isinstance(cmd, click.Group):
                yield from leaves(cmd, (*prefix, name))
            else:
                yield " ".join((*prefix, name))

    named = {c if c.startswith("checkpoints") else c.split(" ")[0] for c in COMMANDS}
    assert set(leaves(main)) == named


@pytest.mark.parametrize("kind", ["missing", "foreign", "others", "damaged"])
@pytest.mark.parametrize("command", list(COMMANDS))
def test_a_directory_that_is_not_what_the_command_reads_is_refused(dirs, tmp_path, command,
                                                                   kind):
    pipeline = command in PIPELINE_COMMANDS
    directory = {"missing": dirs["missing"], "others": dirs["others"],
                 "foreign": dirs["work"] if pipeline else dirs["ckpt"],
                 "damaged": dirs["ckpt-damaged"] if pipeline else dirs["work-damaged"]}[kind]
    before = _files(directory) if directory.exists() else None
    out = tmp_path / "report.html"
    code, output, exc = _run(command, directory, out)
    assert code == 1, output
    assert isinstance(exc, SystemExit), exc  # a message, not a traceback
    text = " ".join(output.split())  # rich and click wrap long lines
    what = "a pipeline's checkpoint directory" if pipeline else "a batch job work directory"
    if kind == "missing":
        assert f"expected {what} at {directory}, found nothing at that path" in text
    elif kind == "foreign" and pipeline:  # a work directory: the jobs are named
        assert f"expected {what} at {directory} (with metadata.json), found none: a batch " \
               f"job work directory (jobs {JOB}/)" in text
    elif kind == "foreign":
        assert f"expected {what} at {directory} (a directory per job, with its event log), " \
               "found a pipeline's checkpoint directory" in text
    elif kind == "others":
        assert f"expected {what} at {directory}" in text and "notes.txt" in text
    elif pipeline:
        assert f"found {directory / 'metadata.json'} damaged: pipeline-metadata record " \
               "field name: expected a string, found 3" in text
    else:  # the log is named; validate reports it as what a resubmission finds
        assert f"event log at {directory / JOB / 'events'} cannot be loaded: every commit " \
               "is torn" in text
        if command != "validate --job":
            assert f"expected the event log of job '{JOB}' at {directory / JOB / 'events'} " \
                   "to load as recovery loads it, found it damaged" in text
    assert (_files(directory) if directory.exists() else None) == before  # nothing written
    assert not out.exists()


@pytest.mark.parametrize("command", [c for c in COMMANDS if c != "stop"])
def test_the_same_commands_on_the_good_directories_answer(dirs, tmp_path, command):
    """stop is left out: no driver runs here to answer it."""
    directory = dirs["ckpt"] if command in PIPELINE_COMMANDS else dirs["work"]
    args = COMMANDS[command]
    if command == "restore":  # it writes a request: on a copy, of a checkpoint it retains
        directory = tmp_path / "ckpt"
        shutil.copytree(dirs["ckpt"], directory)
        found = json.loads(CliRunner().invoke(main, ["status", str(directory), "--json"]).output)
        args = [*args[:-1], str(found["latest_checkpoint"]["checkpoint_id"])]
    result = CliRunner().invoke(main, [str(directory) if a in ("D", "W") else
                                       str(tmp_path / "report.html") if a == "OUT" else a
                                       for a in args])
    assert result.exit_code == 0, result.output


@pytest.mark.parametrize("record,damage,found", [
    ("metadata.json", b"{not json", "expected a JSON pipeline-metadata record, found "
                                    "unparseable data"),
    ("runs/00000001.json", b'{"kind": "pipeline-run", "format_version": 1, "pipeline": '
                           b'"refusals", "started_ms": -5}',
     "pipeline-run record field started_ms: expected an integer >= 0, found -5"),
    ("runs/ended/00000001.json", b"{", "expected a JSON pipeline-run-end record, found "
                                       "unparseable data"),
    ("control/restore.json", b'{"kind": "restore-request", "format_version": 7}',
     "restore-request record has format_version 7"),
])
def test_each_record_status_and_report_read_is_checked_and_named(dirs, tmp_path, record,
                                                                 damage, found):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(dirs["ckpt"], ckpt)
    (ckpt / record).parent.mkdir(parents=True, exist_ok=True)
    (ckpt / record).write_bytes(damage)
    for command in ("status", "report"):
        code, output, exc = _run(command, ckpt, tmp_path / "report.html")
        text = " ".join(output.split())
        assert code == 1 and isinstance(exc, SystemExit), output
        assert f"found {ckpt / record} damaged: {found}" in text, text
    if record == "control/restore.json":  # withdrawn all the same
        assert CliRunner().invoke(main, ["restore", str(ckpt), "--cancel"]).exit_code == 0
        assert CliRunner().invoke(main, ["status", str(ckpt)]).exit_code == 0


def test_a_pipeline_directory_that_lost_its_metadata_is_damaged_not_foreign(dirs, tmp_path):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(dirs["ckpt"], ckpt)
    (ckpt / "metadata.json").unlink()
    code, output, _ = _run("checkpoints list", ckpt, tmp_path / "x")
    text = " ".join(output.split())
    assert code == 1 and f"found {ckpt / 'metadata.json'} missing, though the directory " \
                          "holds runs/, allocations/, commits/, which a pipeline wrote" in text


def test_the_library_raises_what_the_command_line_prints(spark, dirs):
    from spark_ckpt import read_state
    from spark_ckpt import shell as ck
    from spark_ckpt.ops.pipeline_ops import pipeline_status

    for directory, kind in ((dirs["missing"], "missing"), (dirs["work"], "foreign"),
                            (dirs["ckpt-damaged"], "damaged")):
        with pytest.raises(DirectoryError) as info:
            pipeline_status(str(directory), now_ms=0)
        assert info.value.kind == kind
        with pytest.raises(DirectoryError, match="expected a pipeline's checkpoint directory"):
            read_state(spark, str(directory), "totals")
        with pytest.raises(DirectoryError):
            ck.runs(spark, str(directory))
    with pytest.raises(DirectoryError) as info:
        ck.events(spark, JOB, str(dirs["work-damaged"]))
    assert info.value.kind == "damaged" and info.value.path.endswith(f"{JOB}/events")
    assert ck.runs(spark, str(dirs["ckpt"])).count() == 1
