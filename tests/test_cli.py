"""spark-ckpt on a real job's event log (no Spark needed to inspect)."""

import json

import pytest
from click.testing import CliRunner

import orders_report as report
from spark_ckpt import Settings
from spark_ckpt.ops.cli import main


@pytest.fixture(scope="module")
def finished_job(spark, orders_input, tmp_path_factory):
    base = tmp_path_factory.mktemp("cli")
    job = report.build_job("cli-job", orders_input, str(base / "out"), parallelism=4,
                           agg_parallelism=2, work_dir=str(base / "work"), spark=spark,
                           settings=Settings(progress="never", batch_exchange_min_bytes=0))
    job.run()
    return str(base / "work")


def test_jobs_lists_the_job_as_completed(finished_job):
    result = CliRunner().invoke(main, ["jobs", "--work-dir", finished_job])
    assert result.exit_code == 0, result.output
    assert "cli-job" in result.output and "completed" in result.output


def test_history_shows_attempts_vertices_and_sinks(finished_job):
    result = CliRunner().invoke(main, ["history", "cli-job", "--work-dir", finished_job])
    assert result.exit_code == 0, result.output
    for text in ("Attempts", "succeeded", "settled", "daily", "daily-delta", "committed"):
        assert text in result.output


def test_history_json_counts_partitions_per_attempt(finished_job):
    result = CliRunner().invoke(main, ["history", "cli-job", "--work-dir", finished_job,
                                       "--json"])
    data = json.loads(result.output)
    assert data["completed"] is True
    assert data["vertices"]["settled"]["finished_per_attempt"] == {"1": 4}


def test_events_filters_by_type(finished_job):
    result = CliRunner().invoke(main, ["events", "cli-job", "--work-dir", finished_job,
                                       "--type", "SinkCommitted"])
    lines = [json.loads(line) for line in result.output.splitlines()]
    assert {line["payload"]["sink"] for line in lines} == {"daily-delta", "settled-parquet"}


def test_unknown_job_is_a_clear_error(tmp_path):
    result = CliRunner().invoke(main, ["history", "nope", "--work-dir", str(tmp_path)])
    assert result.exit_code != 0
    assert "no event log for job 'nope'" in result.output


def test_jobs_json_and_validate_of_a_completed_job(finished_job):
    listed = CliRunner().invoke(main, ["jobs", "--work-dir", finished_job, "--json"])
    rows = [json.loads(line) for line in listed.output.splitlines()]
    assert rows == [{**rows[0], "job_id": "cli-job", "status": "completed"}]
    checked = CliRunner().invoke(main, ["validate", "--job", "cli-job", "--work-dir",
                                        finished_job])
    assert checked.exit_code == 0, checked.output
    assert "completed" in checked.output and "needs none of its files" in checked.output
    usage = CliRunner().invoke(main, ["validate"])
    assert usage.exit_code == 2 and "expected either CHECKPOINT_DIR or --job JOB" in usage.output


def test_wide_tables_are_not_cut_when_output_is_not_a_terminal(finished_job):
    shown = CliRunner().invoke(main, ["jobs", "--work-dir", finished_job], env={"COLUMNS": "40"})
    assert "completed" in shown.output and "…" not in shown.output


def test_every_command_has_help_and_json():
    import click

    def commands(group, prefix=()):
        for name, cmd in group.commands.items():
            if isinstance(cmd, click.Group):
                yield from commands(cmd, (*prefix, name))
            else:
                yield (*prefix, name), cmd

    found = dict(commands(main))
    assert {"jobs", "history", "plan", "events", "validate", "stop", "status", "restore",
            "cleanup", "report"} <= {p[-1] for p in found}
    for path, cmd in found.items():
        assert "--json" in {o for p in cmd.params for o in getattr(p, "opts", [])}, path
        shown = CliRunner().invoke(main, [*path, "--help"])
        assert shown.exit_code == 0 and "Usage:" in shown.output, path
