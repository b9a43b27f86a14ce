"""``spark-ckpt report``: one self-contained HTML page of a real pipeline (two runs, a
restart) and of a real batch job, rendered by headless Chromium."""

from __future__ import annotations

import os
import re
import shutil
import subprocess

import pytest
from click.testing import CliRunner

from spark_ckpt import Settings, StreamingContext
from spark_ckpt.ops.cli import main
from spark_ckpt.state.aggregates import count, sum_

CHROMIUM = next((c for c in ("chromium", "chromium-browser", "google-chrome")
                 if shutil.which(c)), None)


def _pipeline(spark, ckpt, rows):
    ctx = StreamingContext(spark, 0.05, str(ckpt), "report",
                           settings=Settings(progress="never", checkpoint_interval_ms=1,
                                             state_parallelism=2, state_max_parallelism=8))
    gen = ctx.generator_stream("gen", rows_per_batch=200, total_rows=rows, keys=11)
    gen.key_by("key").agg("totals", n=count(), total=sum_("value")) \
        .write_parquet(str(ckpt) + "-out", name="out")
    ctx.process_available(timeout=300)


def _self_contained(page: str) -> None:
    """Nothing is loaded from anywhere: no scripts, stylesheets, images or frames by URL
    (SVG namespace declarations are names, not loads)."""
    assert not re.search(r"<(script|link|img|iframe)\b", page, re.I)
    assert not re.search(r"(src|href)\s*=\s*[\"'](https?:)?//", page, re.I)
    assert "url(http" not in page


def _render(path: str, tmp_path) -> tuple[str, str]:
    """Chromium's DOM of the page after layout, and a screenshot of it."""
    shot = str(tmp_path / (os.path.basename(path) + ".png"))
    args = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
            "--window-size=1280,2200", f"--user-data-dir={tmp_path / 'chromium-profile'}"]
    dom = subprocess.run([*args, "--dump-dom", f"file://{path}"], capture_output=True,
                         text=True, timeout=120, check=True).stdout
    subprocess.run([*args, f"--screenshot={shot}", f"file://{path}"], capture_output=True,
                   timeout=120, check=True)
    return dom, shot


def test_pipeline_report_is_one_page_with_every_chart(spark, tmp_path):
    ckpt = tmp_path / "ckpt"
    _pipeline(spark, ckpt, 1200)
    _pipeline(spark, ckpt, 2000)  # a restart: run 2 continues from run 1's checkpoint
    from spark_ckpt import shell as ck

    assert [(r.run, r.status) for r in ck.runs(spark, str(ckpt)).collect()] == \
        [(1, "stopped"), (2, "stopped")]
    assert ck.progress(spark, str(ckpt)).count() == 10
    assert ck.checkpoints(spark, str(ckpt)).where("status = 'completed'").count() >= 2
    assert ck.pipeline(spark, str(ckpt)).first().state == "stopped"
    out = tmp_path / "pipeline.html"
    result = CliRunner().invoke(main, ["report", str(ckpt), "-o", str(out)])
    assert result.exit_code == 0, result.output
    page = out.read_text()
    _self_contained(page)
    for title in ("Checkpoint duration", "Checkpoint size", "Batch throughput",
                  "Batch latency", "State rows per operator", "Runs and restarts",
                  "Latest checkpoints"):
        assert f"<h2>{title}</h2>" in page, title
    assert page.count("<svg") == 5
    assert "run 2" in page  # the restart is marked on the batch charts
    assert ">stopped<" in page and ">10<" in page  # status card; batches (2000 / 200)
    if CHROMIUM is None:
        pytest.skip("no Chromium here to render the page (CI installs it: .ci/run)")
    dom, shot = _render(str(out), tmp_path)
    assert dom.count("<svg") == 5 and "Pipeline report" in dom
    assert os.path.getsize(shot) > 20_000  # a page with charts, not a blank one


def test_job_report_shows_its_attempts_and_cuts(spark, tmp_path, orders_input, monkeypatch):
    import orders_report as report

    work = tmp_path / "work"

    def job():
        return report.build_job("report-job", orders_input, str(tmp_path / "out"),
                                parallelism=4, agg_parallelism=2, work_dir=str(work),
                                spark=spark, settings=Settings(progress="never",
                                                               batch_exchange_min_bytes=0))

    # attempt 1 fails (its storage fails) after two vertices; attempt 2 reuses them
    monkeypatch.setenv("SPARK_CKPT_FAULT", "vertex.finished:2:fail")
    with pytest.raises(OSError, match="injected storage failure"):
        job().run()
    monkeypatch.delenv("SPARK_CKPT_FAULT")
    job().run()
    # the same history as DataFrames (spark_ckpt.shell), as a shell user reads it
    from spark_ckpt import shell as ck

    listed = ck.jobs(spark, str(work)).collect()
    assert [(r.job_id, r.attempts, r.status) for r in listed] == [("report-job", 2, "completed")]
    tried = ck.attempts(spark, "report-job", str(work)).orderBy("attempt").collect()
    assert [(r.mode, r.status, r.ran, r.reused) for r in tried] == \
        [("fresh", "failed", 8, 0), ("recovery", "succeeded", 6, 8)]
    logged = ck.events(spark, "report-job", str(work))
    assert logged.where("event_type = 'ExecutionVertexFinished'").count() == 14
    out = tmp_path / "job.html"
    result = CliRunner().invoke(main, ["report", "--job", "report-job", "--work-dir",
                                       str(work), "-o", str(out)])
    assert result.exit_code == 0, result.output
    page = out.read_text()
    _self_contained(page)
    for title in ("Recovery timeline", "Attempts: what each ran and reused",
                  "Vertices: where the job is durable, and why"):
        assert f"<h2>{title}</h2>" in page, title
    assert "settled" in page and "completed" in page and page.count("<svg") == 1
    assert "attempt 2 (recovery)" in page and ">failed<" in page and ">succeeded<" in page
    assert ">14 / 14<" in page  # every partition of the vertices that run (not the sources)
    # what the kept partitions wrote, per vertex, from the files their events recorded
    rows = re.findall(r"<tr><td>([^<]+)</td><td>(\w+)</td><td>\d+</td><td>([^<]+)</td>"
                      r"<td>([^<]+)</td>", page)
    written = {vid: size for vid, _decision, _est, size in rows}
    assert written and all(written[v] != "-" for v in ("settled", "daily")), rows
    assert all(size.endswith(("B", "KiB", "MiB")) for size in written.values() if size != "-")
    bad = CliRunner().invoke(main, ["report", "--job", "nope", "--work-dir", str(work)])
    assert bad.exit_code == 1 and "no event log for job 'nope'" in bad.output
    if CHROMIUM is None:
        pytest.skip("no Chromium here to render the page (CI installs it: .ci/run)")
    dom, shot = _render(str(out), tmp_path)
    assert dom.count("<svg") == 1 and os.path.getsize(shot) > 10_000
