"""``spark-ckpt``: inspect jobs from their event logs (no Spark needed).

    spark-ckpt jobs                      # every job under the work directory
    spark-ckpt history JOB               # attempts, vertices, partitions finished/reused/re-run
    spark-ckpt events JOB --type ExecutionVertexFinished --limit 20
    spark-ckpt plan JOB                  # where the job became durable, why, bytes written
    spark-ckpt checkpoints list CKPT_DIR # a pipeline's checkpoints: retained and history
    spark-ckpt checkpoints show CKPT_DIR [ID]   # one checkpoint: sources, state, sinks, sizes
    spark-ckpt validate CKPT_DIR | --job JOB    # what a restore or a resubmission relies on
    spark-ckpt status CKPT_DIR | --job JOB      # running, stopped, failed; last batch, checkpoint
    spark-ckpt plan --pipeline CKPT_DIR         # sources, operators (state schema), outputs
    spark-ckpt stop CKPT_DIR                    # stop with a final checkpoint, print its id
    spark-ckpt restore CKPT_DIR ID [--cancel]   # the next start restores checkpoint ID
    spark-ckpt cleanup CKPT_DIR [--delete]      # files nothing reads again (dry run by default)
    spark-ckpt report CKPT_DIR | --job JOB      # one self-contained HTML page

Every command takes ``--json``. Exit codes: 0 done (validate: nothing wrong; status: the
pipeline or job is running, stopped or completed), 1 an error, something missing or corrupt
(validate), a failed run (status), 2 a usage error.

Every command opens its directory as a start reads it (streaming/runtime/pipeline_dir.py for a
pipeline's checkpoint directory, batch/workdir.py for a work directory and its jobs) and
refuses, with exit code 1 and a message saying what was expected, what was found and what to
do, a path where nothing is, a directory that is not what it reads (a work directory where a
checkpoint directory is expected, or the other way round) and one whose records do not read
(the file named): :class:`~spark_ckpt.errors.DirectoryError`. Any other error of spark_ckpt's
tree is printed the same way, without a traceback.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import sys
from collections import Counter, defaultdict

import click
from rich.console import Console
from rich.table import Table

from spark_ckpt.batch.workdir import open_job, open_work_dir
from spark_ckpt.clock import Clock, SystemClock
from spark_ckpt.errors import SparkCkptError
from spark_ckpt.eventlog.events import EventType
from spark_ckpt.eventlog.replay import replay
from spark_ckpt.options import OPTIONS, Settings
from spark_ckpt.storage import human_size

__all__ = ["main"]

CLOCK: Clock = SystemClock()  # what the commands read the time from, and wait on

_WORK_DIR_KEY = next(o.key for o in OPTIONS if o.field == "work_dir")


def _default_work_dir() -> str:
    if os.path.isfile("spark-defaults.conf"):
        from spark_ckpt.session import read_defaults

        value = read_defaults("spark-defaults.conf").get(_WORK_DIR_KEY)
        if value:
            return value
    return Settings().work_dir


def _console() -> Console:
    """Wide enough that a table's cells are not cut to "com…" when output is not a
    terminal (a pipe, a file, a notebook cell)."""
    return Console(width=max(160, Console().width))


def _table(*columns: str, title: str | None = None) -> Table:
    table = Table(title=title)
    for column in columns:
        table.add_column(column, overflow="fold")
    return table


def _time(us: int | None) -> str:
    if not us:
        return "-"
    return dt.datetime.fromtimestamp(us / 1e6, dt.UTC).strftime("%Y-%m-%d %H:%M:%S")


storage_option = click.option("--storage", default=None,
                              help="spark.ckpt.checkpoint.dir, if the pipeline set one.")

work_dir_option = click.option(
    "--work-dir", default=None,
    help=f"The {_WORK_DIR_KEY} the jobs ran with (default: from ./spark-defaults.conf, "
         "else spark-ckpt-work).",
)


class _Commands(click.Group):
    """spark_ckpt's errors as messages (exit code 1), not tracebacks."""

    def invoke(self, ctx: click.Context) -> object:
        try:
            return super().invoke(ctx)
        except SparkCkptError as exc:
            raise click.ClickException(str(exc)) from exc


@click.group(cls=_Commands)
def main() -> None:
    """Inspect spark_ckpt jobs and their event logs."""
    # S3 as the drivers see it: spark.hadoop.fs.s3a.* of the defaults file they read
    # ($SPARK_CKPT_DEFAULTS or ./spark-defaults.conf); else pyarrow's and delta-rs's own AWS_*
    from spark_ckpt.session import _find_defaults, read_defaults
    from spark_ckpt.storage import s3

    path = _find_defaults(None)
    if path is not None:
        s3.configure(read_defaults(path))


def _load(work_dir: str | None, job_id: str):
    """JOB_ID's events, or a refusal (no event log, a work directory that is none, a log that
    does not load)."""
    return open_job(work_dir or _default_work_dir(), job_id)


@main.command()
@work_dir_option
@click.option("--json", "as_json", is_flag=True, help="Print JSON lines instead.")
def jobs(work_dir: str | None, as_json: bool) -> None:
    """List the jobs under the work directory."""
    from spark_ckpt.batch.runner import job_summaries

    work_dir = work_dir or _default_work_dir()
    summaries = job_summaries(open_work_dir(work_dir))
    rows = [{"job_id": r["job_id"], "attempts": r["attempts"], "status": r["status"],
             "last_event": _time(r["last_event_us"]) if r["last_event_us"] else None,
             "finished": r["finished_partitions"]} for r in summaries]
    damaged = [r for r in summaries if r.get("problem")]
    if as_json:
        for row in rows:
            click.echo(json.dumps(row))
    else:
        table = _table("job", "attempts", "status", "last event (UTC)", "finished partitions")
        for row in rows:
            table.add_row(*("-" if v is None else str(v) for v in row.values()))
        _console().print(table)
    for r in damaged:  # listed all the same; the exit code says a log does not load
        try:
            open_job(work_dir, r["job_id"])
            problem = r["problem"]
        except SparkCkptError as exc:  # what, where, what to do
            problem = str(exc)
        click.echo(f"Error: job {r['job_id']}: {problem}", err=True)
    if damaged:
        sys.exit(1)


@main.command()
@click.argument("job_id")
@work_dir_option
@click.option("--json", "as_json", is_flag=True, help="Print a JSON summary instead.")
def history(job_id: str, work_dir: str | None, as_json: bool) -> None:
    """Attempts, vertices and partitions of JOB_ID: finished, reused and re-run."""
    read = _load(work_dir, job_id)
    h = replay(read.events)
    finished_by: dict[str, Counter[int]] = defaultdict(Counter)
    durations: dict[str, list[int]] = defaultdict(list)
    for e in read.events:
        if e.type is EventType.EXECUTION_VERTEX_FINISHED and e.vertex_id:
            finished_by[e.vertex_id][e.job_attempt] += 1
            durations[e.vertex_id].append(e.duration_ms or 0)
    if as_json:
        click.echo(json.dumps({
            "job_id": job_id, "completed": h.completed, "events": h.events,
            "attempts": [vars(a) for a in h.attempts.values()],
            "vertices": {v: {"parallelism": d.get("parallelism"),
                             "finished_per_attempt": dict(finished_by[v])}
                         for v, d in h.vertices.items()},
            "sinks": h.sink_committed, "problems": read.problems,
        }, indent=2, default=str))
        return
    console = Console()
    console.print(f"[bold]Job {job_id}[/]: {'completed' if h.completed else 'not completed'}, "
                  f"{h.events} events, {h.resets} partition resets")
    attempts = Table("attempt", "mode", "started (UTC)", "status", "duration", "ran",
                     "reused", title="Attempts")
    kept = []
    for a in sorted(h.attempts.values(), key=lambda a: a.attempt):
        duration = f"{(a.finished_us - a.started_us) / 1e6:.1f} s" if a.finished_us else "-"
        attempts.add_row(str(a.attempt), a.mode, _time(a.started_us), a.status, duration,
                         str(sum(c[a.attempt] for c in finished_by.values())),
                         str(a.reused) if a.finished_us else "-")
        if a.durable_share is not None and (a.reused or a.adopted):
            kept.append(f"attempt {a.attempt} started with {a.durable_share:.0%} of the work "
                        f"durable: reused {a.reused} partitions ({a.reused_in_waves} of them "
                        f"in waves of input splits), adopted {a.adopted}")
    console.print(attempts)
    for line in kept:
        console.print(line)
    vertices = Table("vertex", "partitions", "finished now", "finished per attempt",
                     "median task ms", title="Vertices")
    for vid, desc in h.vertices.items():
        per = ", ".join(f"a{k}: {n}" for k, n in sorted(finished_by[vid].items())) or "-"
        done = sum(1 for (v, _p) in h.finished if v == vid)
        ds = sorted(durations[vid])
        vertices.add_row(vid, str(desc.get("parallelism")), str(done), per,
                         str(ds[len(ds) // 2]) if ds else "-")
    console.print(vertices)
    if h.sink_started or h.sink_committed:
        sinks = Table("sink", "commit version", "state", title="Sinks")
        for name, version in sorted(h.sink_started.items()):
            state = "committed" if name in h.sink_committed else "commit in progress"
            sinks.add_row(name, str(version), state)
        console.print(sinks)
    for problem in read.problems:
        console.print(f"[yellow]warning:[/] {problem}")


@main.command()
@click.argument("job_id", required=False)
@click.option("--pipeline", "pipeline_dir", default=None,
              help="Show the streaming pipeline whose checkpoint directory this is instead.")
@work_dir_option
@storage_option
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead.")
def plan(job_id: str | None, pipeline_dir: str | None, work_dir: str | None,
         storage: str | None, as_json: bool) -> None:
    """Where JOB_ID becomes durable and why, as its driver decided (BatchJob.explain before
    a run), with what each vertex wrote: estimated against actual bytes. With --pipeline
    CKPT_DIR: the pipeline's sources, stateful operators (keys, parallelism, state schema at
    the latest checkpoint) and outputs."""
    _one_of(job_id, pipeline_dir, "JOB_ID or --pipeline CKPT_DIR")
    if pipeline_dir is not None:
        _pipeline_plan(pipeline_dir, storage, as_json)
        return
    assert job_id is not None
    read = _load(work_dir, job_id)
    vertices: dict[str, dict] = {}
    files: dict[str, dict[str, int]] = defaultdict(dict)  # each file once: a wave's are shared
    finished: dict[str, set[int]] = defaultdict(set)
    for e in read.events:
        if e.type is EventType.JOB_VERTEX_INITIALIZED and e.vertex_id:
            vertices[e.vertex_id] = e.payload
        elif e.type is EventType.EXECUTION_VERTEX_FINISHED and e.vertex_id:
            for out in e.payload.get("outputs", ()):
                files[e.vertex_id][out["path"]] = int(out.get("size", 0))
            finished[e.vertex_id].add(e.partition or 0)
    written = {vid: sum(sizes.values()) for vid, sizes in files.items()}
    rows = []
    for vid, payload in vertices.items():
        cut = payload.get("cut") or {}
        what = ("source" if cut.get("source") else "durable" if cut.get("durable") else
                "chained") if cut else "durable (recorded before cuts were planned)"
        rows.append({"vertex": vid, "decision": what, "by_hand": bool(cut.get("by_hand")),
                     "reason": cut.get("reason", ""), "parallelism": payload.get("parallelism"),
                     "estimated_bytes": cut.get("est_bytes"),
                     "written_bytes": written.get(vid, 0) if vid in finished else None,
                     "finished_partitions": len(finished.get(vid, ()))})
    if as_json:
        click.echo(json.dumps({"job_id": job_id, "vertices": rows}, indent=2))
        return
    table = Table("vertex", "decision", "partitions", "estimated", "written", "why",
                  title=f"Job {job_id}: where it becomes durable")
    for r in rows:
        table.add_row(r["vertex"], r["decision"] + (" (by hand)" if r["by_hand"] else ""),
                      f"{r['finished_partitions']}/{r['parallelism']}",
                      _size(r["estimated_bytes"]), _size(r["written_bytes"]), r["reason"])
    Console(width=max(160, Console().width)).print(table)


def _one_of(first: object, second: object, names: str) -> None:
    """A usage error unless exactly one of the two was given (``names``: "A or B")."""
    if (first is None) == (second is None):
        raise click.UsageError(f"expected either {names}, found "
                               + ("both" if first is not None else "neither"))


def _or_dash(value: object) -> str:
    return "-" if value is None else str(value)


def _pipeline_plan(checkpoint_dir: str, storage: str | None, as_json: bool) -> None:
    from spark_ckpt.ops.pipeline_ops import pipeline_plan

    found = pipeline_plan(checkpoint_dir, checkpoint_storage=storage)
    if as_json:
        click.echo(json.dumps(found, indent=2, default=str))
        return
    console = _console()
    console.print(f"[bold]Pipeline {found['pipeline']}[/] (id {found['pipeline_id']}): batch "
                  f"interval {found['batch_interval_s']} s, latest checkpoint "
                  f"{_or_dash(found['latest_checkpoint'])}")
    sources = _table("source", "kind", "schema", title="Sources")
    for name, src in found["sources"].items():
        sources.add_row(name, str((src["describe"] or {}).get("kind", "-")), src["schema"] or "-")
    console.print(sources)
    ops = _table("operator", "kind", "keys", "parallelism", "max parallelism", "state rows",
                 "state schema / aggregations", title="Stateful operators (at the latest "
                 "checkpoint)")
    for name, op in found["operators"].items():
        state = op["state_schema"] or "-"
        if op.get("aggregations"):
            state = ", ".join(f"{n}={f[0]}({f[1] or ''})" for n, f in op["aggregations"].items())
        ops.add_row(name, str(op["kind"]), ", ".join(op["keys"] or []),
                    str(op["parallelism"] or "-"), str(op["max_parallelism"] or "-"),
                    str(op["state_rows"]), state)
    console.print(ops)
    outputs = _table("output", "sink", title="Outputs")
    for name, desc in found["outputs"].items():
        outputs.add_row(name, json.dumps(desc, sort_keys=True, default=str))
    console.print(outputs)


@main.command()
@click.argument("job_id")
@work_dir_option
@click.option("--type", "event_type", type=click.Choice([t.value for t in EventType]),
              help="Only events of this type.")
@click.option("--limit", type=int, default=50, show_default=True, help="Newest N events.")
@click.option("--json", "as_json", is_flag=True,
              help="Accepted for symmetry: events are always printed as JSON lines.")
def events(job_id: str, work_dir: str | None, event_type: str | None, limit: int,
           as_json: bool) -> None:
    """Print JOB_ID's events as JSON lines, oldest first."""
    del as_json
    read = _load(work_dir, job_id)
    chosen = [e for e in read.events if event_type is None or e.type.value == event_type]
    for e in chosen[-limit:]:
        row = e.row()
        row["event_time"] = _time(e.time_us)
        row["payload"] = json.loads(row["payload"])
        click.echo(json.dumps(row, default=str))




@main.group()
def checkpoints() -> None:
    """A streaming pipeline's checkpoints (CKPT_DIR: its checkpoint directory)."""


def _checkpoint_storage(checkpoint_dir: str, storage_dir: str | None):
    """The checkpoints of the pipeline on CHECKPOINT_DIR, once it is opened (or refused)."""
    from spark_ckpt.checkpoint.checkpoint_storage import CheckpointStorage
    from spark_ckpt.streaming.runtime.pipeline_dir import open_pipeline_dir

    return CheckpointStorage(open_pipeline_dir(checkpoint_dir, storage_dir).checkpoints_uri)


_size = human_size


@checkpoints.command("list")
@click.argument("checkpoint_dir")
@storage_option
@click.option("--json", "as_json", is_flag=True, help="Print the history as JSON lines.")
def checkpoints_list(checkpoint_dir: str, storage: str | None, as_json: bool) -> None:
    """Every checkpoint in the history: status, barrier batch, duration, sizes."""
    from spark_ckpt.ops.validate import checkpoint_dirs

    store = _checkpoint_storage(checkpoint_dir, storage)
    history = {int(st["checkpoint_id"]): st for st in store.history()}
    dirs = checkpoint_dirs(store.uri)
    rows = []
    for cid in sorted(set(history) | set(dirs)):
        st = dict(history.get(cid) or {"checkpoint_id": cid})
        on_disk = dirs.get(cid)  # None: its files were removed (only statistics remain)
        # completed and retained, abandoned by a restore of an older one, or what the
        # statistics say (aborted, or completed and since removed by retention)
        st["retained"] = on_disk == "completed"
        st["restorable"] = on_disk == "completed"
        st["status"] = "abandoned" if on_disk == "abandoned" else \
            st.get("status") or ("incomplete" if on_disk == "incomplete" else "unknown")
        rows.append(st)
    if as_json:
        for st in rows:
            click.echo(json.dumps(st, sort_keys=True))
        return
    table = _table("id", "status", "retained", "barrier batch", "duration ms", "state",
                   "incremental", "max sync ms", "max async ms", "max alignment ms", "reason",
                   title=f"Checkpoints in {store.uri}")
    for st in rows:
        table.add_row(str(st["checkpoint_id"]), st["status"], "yes" if st["retained"] else "",
                      str(st.get("barrier_batch", "-")), str(st.get("duration_ms", "-")),
                      _size(st.get("full_bytes")), _size(st.get("incremental_bytes")),
                      str(st.get("sync_ms", "-")), str(st.get("async_ms", "-")),
                      str(st.get("alignment_ms", "-")), st.get("reason") or "")
    _console().print(table)
    if not rows:
        click.echo("no checkpoints yet")


@checkpoints.command("show")
@click.argument("checkpoint_dir")
@click.argument("checkpoint_id", required=False, type=int)
@storage_option
@click.option("--json", "as_json", is_flag=True, help="Print the metadata as JSON.")
def checkpoints_show(checkpoint_dir: str, checkpoint_id: int | None,
                     storage: str | None, as_json: bool) -> None:
    """One checkpoint (default: the latest completed): its sources' offsets, each operator's
    state (rows, bytes, files per task) and each sink's pending transactions. An abandoned
    checkpoint (a restore chose an older one) is shown, marked as not restorable."""
    from spark_ckpt.errors import CheckpointError
    from spark_ckpt.ops.validate import checkpoint_dirs

    store = _checkpoint_storage(checkpoint_dir, storage)
    dirs = checkpoint_dirs(store.uri)
    ids = [c for c, status in dirs.items() if status == "completed"]
    if checkpoint_id is None and not ids:
        raise click.ClickException(f"expected completed checkpoints in {store.uri}, found none")
    cid = checkpoint_id if checkpoint_id is not None else ids[-1]
    status = dirs.get(cid)
    if status not in ("completed", "abandoned"):
        listed = ", ".join(f"{c} ({s})" for c, s in dirs.items()) or "none"
        what = "was never completed (no metadata)" if status else "is not there"
        raise click.ClickException(
            f"checkpoint {cid} in {store.uri} {what}; checkpoints there: {listed}")
    try:
        meta = store.read_metadata(cid, abandoned=status == "abandoned")
    except CheckpointError as exc:
        raise click.ClickException(str(exc)) from exc
    if as_json:
        click.echo(json.dumps(meta | {"status": status}, indent=2, sort_keys=True))
        return
    console = _console()
    if status == "abandoned":
        console.print(f"[bold red]Checkpoint {cid} is abandoned[/]: a restore chose an older "
                      "checkpoint and started a new history from it; it is not restorable "
                      "and is shown for inspection only.")
    console.print(f"[bold]Checkpoint {cid}[/bold] of pipeline {meta['pipeline']} "
                  f"(id {meta.get('pipeline_id') or '-'}): barrier after batch "
                  f"{meta['barrier_batch']}, mode {meta.get('mode')}, completed "
                  f"{_time(int(meta['completed_ms']) * 1000)}")
    sources = _table("source", "position", title="Sources at the barrier")
    for name, ack in sorted(meta.get("sources", {}).items()):
        piece = ack.get("piece") or {}
        shown = {k: v for k, v in piece.items() if k != "files"}
        if "files" in piece:
            shown["files"] = len(piece["files"])
        sources.add_row(name, json.dumps(shown, sort_keys=True))
    console.print(sources)
    ops = _table("operator", "task", "key groups", "rows", "files", "bytes", title="Keyed state")
    for op, entry in sorted(meta.get("operators", {}).items()):
        for pid, handle in sorted(entry["handles"].items(), key=lambda kv: int(kv[0])):
            files = handle.get("files", [])
            ops.add_row(op, pid, handle["range"], str(handle.get("rows", 0)), str(len(files)),
                        _size(sum(f["bytes"] for f in files)))
    console.print(ops)
    sinks = _table("sink", "checkpoints",
                   title="Sinks: transactions this checkpoint commits (if not yet done)")
    for name, ack in sorted(meta.get("sinks", {}).items()):
        sinks.add_row(name, ", ".join(str(p[0]) for p in ack.get("pending", [])) or "-")
    console.print(sinks)


@main.command()
@click.argument("checkpoint_dir", required=False)
@click.option("--job", "job_id", default=None, help="Validate this batch job's event log "
              "and finished partitions instead of a checkpoint directory.")
@work_dir_option
@storage_option
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def validate(checkpoint_dir: str | None, job_id: str | None, work_dir: str | None,
             storage: str | None, as_json: bool) -> None:
    """Check what a restart relies on, changing nothing: a pipeline's checkpoints (metadata
    readable, every state file present with its recorded size) or, with --job, a batch job's
    event log and every file of its finished partitions. Exit code 1 when something is
    missing or corrupt."""
    from spark_ckpt.ops.validate import validate_checkpoints, validate_job

    _one_of(checkpoint_dir, job_id, "CHECKPOINT_DIR or --job JOB")
    if job_id is not None:
        report = validate_job(work_dir or _default_work_dir(), job_id)
        if as_json:
            click.echo(json.dumps(report.to_json(), indent=2))
        else:
            if report.completed:
                click.echo(f"Job {job_id}: completed ({report.events} events); a resubmission "
                           "needs none of its files")
            else:
                click.echo(f"Job {job_id}: {report.events} events, "
                           f"{report.finished_partitions} finished partitions, "
                           f"{report.files_checked} files checked: "
                           + ("intact" if report.ok else f"{len(report.problems)} problem(s)"))
            for problem in report.problems:
                click.echo(f"  {problem}")
            if report.lost:
                click.echo(f"  a resubmission runs these again (and what read them): "
                           f"{', '.join(f'{v}/{p}' for v, p in report.lost)}")
        sys.exit(0 if report.ok else 1)
    assert checkpoint_dir is not None
    store = _checkpoint_storage(checkpoint_dir, storage)
    reports = validate_checkpoints(store.uri)
    completed = [r for r in reports if r.status == "completed"]
    newest = next((r for r in reversed(completed) if r.restorable), None)
    ok = bool(completed) and completed[-1].restorable
    if as_json:
        click.echo(json.dumps({"checkpoints": [r.to_json() for r in reports], "ok": ok,
                               "restores": newest.checkpoint_id if newest else None},
                              indent=2))
    else:
        table = _table("id", "status", "state files", "state bytes", "problems",
                       title=f"Checkpoints in {store.uri}")
        for r in reports:
            table.add_row(str(r.checkpoint_id), r.status,
                          str(r.state_files) if r.status == "completed" else "-",
                          _size(r.state_bytes) if r.status == "completed" else "-",
                          "\n".join(r.problems) or ("ok" if r.status == "completed" else "-"))
        _console().print(table)
        if newest is None:
            click.echo("No restorable checkpoint: a restart starts from the sources' "
                       "beginning (or fails, if the pipeline requires a checkpoint).")
        else:
            click.echo(f"A restart restores checkpoint {newest.checkpoint_id}."
                       + ("" if ok else " Newer completed checkpoints are damaged: a restart "
                          "steps over one with missing state files and refuses one whose "
                          "metadata does not read (see the problems above)."))
    sys.exit(0 if ok else 1)


@main.command()
@click.argument("checkpoint_dir")
@click.option("--timeout", type=float, default=1800.0, show_default=True,
              help="Seconds to wait for the driver's answer (a final checkpoint may take up "
                   "to twice spark.ckpt.checkpoint.timeoutMs and a sink commit).")
@click.option("--json", "as_json", is_flag=True, help="Print the answer as JSON.")
def stop(checkpoint_dir: str, timeout: float, as_json: bool) -> None:
    """Stop the pipeline running on CHECKPOINT_DIR with a final checkpoint (as Flink's stop
    with a savepoint): its driver finishes the running batch, takes a checkpoint, commits its
    sinks and exits; this prints the checkpoint id. Exit code 0 when it stopped so; 1 when it
    failed, did not answer in time, or was gone (a later driver answers the request
    "abandoned" and is not stopped by it)."""
    from spark_ckpt.errors import DirectoryError
    from spark_ckpt.streaming.runtime.pipeline_dir import open_pipeline_dir
    from spark_ckpt.streaming.runtime.stop_control import (
        latest_run,
        read_answer,
        request_stop,
        withdraw,
    )

    try:
        store = open_pipeline_dir(checkpoint_dir).storage
    except DirectoryError as exc:
        raise click.ClickException(str(exc) if exc.kind == "damaged" else
                                   f"no pipeline has run on {checkpoint_dir}: {exc}") from exc
    run = latest_run(store, store.root)
    if run is None:
        raise click.ClickException(f"no pipeline has run on {checkpoint_dir}: expected a "
                                   "checkpoint directory with runs/, found none")
    request = request_stop(store, store.root, run, CLOCK.now_ms())
    if not as_json:
        click.echo(f"Asked run {run} of the pipeline on {checkpoint_dir} to stop with a final "
                   f"checkpoint (request {request.request_id}); waiting up to {timeout:g} s")
    deadline = CLOCK.monotonic_s() + timeout
    answer = read_answer(store, store.root, request.request_id)
    while answer is None and CLOCK.monotonic_s() < deadline:
        CLOCK.sleep(0.2)
        answer = read_answer(store, store.root, request.request_id)
    if answer is None:
        withdraw(store, store.root, request.request_id)
        answer = read_answer(store, store.root, request.request_id)  # answered meanwhile?
    if answer is None:
        newer = latest_run(store, store.root)
        why = (f"run {newer} started since" if newer is not None and newer > run else
               f"is run {run}'s driver still running?")
        message = (f"no answer from run {run} within {timeout:g} s ({why}); the request is "
                   "withdrawn (a driver that already took it still stops and answers in "
                   f"control/stop-{request.request_id}.answer.json)")
        if as_json:
            click.echo(json.dumps({"request_id": request.request_id, "run": run,
                                   "status": "no answer", "message": message}, indent=2))
            sys.exit(1)
        raise click.ClickException(message)
    if as_json:
        click.echo(json.dumps(answer.as_dict(), indent=2))
    elif answer.status == "stopped":
        click.echo(f"Stopped: {answer.message}")
        if answer.checkpoint_id is not None:
            click.echo(f"checkpoint {answer.checkpoint_id}")
    else:
        click.echo(f"Not stopped as asked ({answer.status}, answered by run {answer.run}): "
                   f"{answer.message}", err=True)
    sys.exit(0 if answer.status == "stopped" else 1)


@main.command()
@click.argument("checkpoint_dir", required=False)
@click.option("--job", "job_id", default=None, help="A batch job's status instead.")
@work_dir_option
@storage_option
@click.option("--json", "as_json", is_flag=True, help="Print the status as JSON.")
def status(checkpoint_dir: str | None, job_id: str | None, work_dir: str | None,
           storage: str | None, as_json: bool) -> None:
    """Whether the pipeline on CHECKPOINT_DIR runs, stopped or failed (a killed driver
    records no end: then the age of its last batch tells), its last batch, latest checkpoint
    and waiting requests; or, with --job, a batch job's attempt and progress per vertex. Exit
    code 1 for a failed run or attempt."""
    from spark_ckpt.ops.pipeline_ops import pipeline_status

    _one_of(checkpoint_dir, job_id, "CHECKPOINT_DIR or --job JOB")
    if job_id is not None:
        _job_status(job_id, work_dir, as_json)
        return
    assert checkpoint_dir is not None
    found = pipeline_status(checkpoint_dir, checkpoint_storage=storage,
                            now_ms=CLOCK.now_ms())
    if as_json:
        click.echo(json.dumps(found, indent=2, default=str))
        sys.exit(1 if found["state"] == "failed" else 0)
    console = _console()
    console.print(f"[bold]Pipeline {found['pipeline']}[/] on {checkpoint_dir}: "
                  f"[bold]{found['state']}[/]"
                  + (f" (run {found['run']}, started {found['run_started']})"
                     if found["run"] else ""))
    ended = found["ended"]
    if ended:
        console.print(f"  ended {ended['at']}"
                      + (f": {ended['message']}" if ended["message"] else "")
                      + (f"; final checkpoint {ended['final_checkpoint']}"
                         if ended["final_checkpoint"] is not None else ""))
    batch = found["last_batch"]
    if batch:
        console.print(f"  last batch {batch['batch_id']} at {batch['at']} "
                      f"({batch['seconds_ago']} s ago): {batch['input_rows']} rows in "
                      f"{batch['total_ms']} ms")
    latest = found["latest_checkpoint"]
    counts = found["checkpoints"]
    console.print("  latest checkpoint " + (
        f"{latest['checkpoint_id']} (barrier after batch {latest['barrier_batch']}, "
        f"{latest['duration_ms']} ms, state {_size(latest['full_bytes'])})" if latest else "none")
        + f"; {counts['completed']} completed retained, {counts['abandoned']} abandoned, "
          f"{counts['incomplete']} incomplete")
    for request in found["stop_requests_waiting"]:
        console.print(f"  stop request {request['request_id']} for run {request['run']} "
                      "waiting for an answer")
    if found["restore_requested"] is not None:
        console.print(f"  the next start restores checkpoint {found['restore_requested']} "
                      "(spark-ckpt restore)")
    sys.exit(1 if found["state"] == "failed" else 0)


def _job_status(job_id: str, work_dir: str | None, as_json: bool) -> None:
    read = _load(work_dir, job_id)
    h = replay(read.events)
    attempt = h.attempts.get(h.last_attempt) if h.attempts else None
    state = "completed" if h.completed else (attempt.status if attempt else "not started")
    vertices = {}
    for vid, desc in h.vertices.items():
        total = int(desc.get("parallelism") or 0)
        done = sum(1 for (v, _p) in h.finished if v == vid)
        vertices[vid] = {"finished": done, "partitions": total}
    total = sum(v["partitions"] for v in vertices.values())
    done = sum(v["finished"] for v in vertices.values())
    found = {"job_id": job_id, "state": state,
             "attempt": attempt.attempt if attempt else None,
             "attempt_started": _time(attempt.started_us) if attempt else None,
             "last_event": _time(read.events[-1].time_us) if read.events else None,
             "finished_partitions": done, "partitions": total, "vertices": vertices,
             "sinks_committed": sorted(h.sink_committed)}
    if as_json:
        click.echo(json.dumps(found, indent=2, default=str))
    else:
        share = f" ({done / total:.0%})" if total else ""
        click.echo(f"Job {job_id}: {state}; attempt {found['attempt']} started "
                   f"{found['attempt_started']}, last event {found['last_event']}; "
                   f"{done} of {total} partitions finished{share}")
        table = _table("vertex", "finished", "partitions")
        for vid, v in vertices.items():
            table.add_row(vid, str(v["finished"]), str(v["partitions"]))
        _console().print(table)
    sys.exit(1 if state == "failed" else 0)


@main.command()
@click.argument("checkpoint_dir")
@click.argument("checkpoint_id", type=int, required=False)
@click.option("--cancel", is_flag=True, help="Withdraw a restore request no start took yet.")
@storage_option
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
def restore(checkpoint_dir: str, checkpoint_id: int | None, cancel: bool, storage: str | None,
            as_json: bool) -> None:
    """Prepare a restore by id: the next start of the pipeline on CHECKPOINT_DIR restores
    retained checkpoint CHECKPOINT_ID (unless its code or settings name one) and abandons the
    newer checkpoints, which stay on disk for inspection. The checkpoint is validated first
    (metadata, every state file and its size); a running pipeline is not affected until it
    restarts (stop it with `spark-ckpt stop`)."""
    from spark_ckpt.ops.pipeline_ops import pipeline_status
    from spark_ckpt.ops.validate import validate_checkpoints
    from spark_ckpt.streaming.runtime.pipeline_dir import open_pipeline_dir
    from spark_ckpt.streaming.runtime.restore_requests import (
        cancel_restore_request,
        request_restore,
    )

    pipeline = open_pipeline_dir(checkpoint_dir, storage)
    store = pipeline.storage
    if cancel:
        had = cancel_restore_request(store, store.root)
        message = ("no restore request was waiting" if had is None else
                   "withdrew an unreadable restore request" if had < 0 else
                   f"withdrew the request to restore checkpoint {had}")
        click.echo(json.dumps({"cancelled": had}) if as_json else message)
        return
    if checkpoint_id is None:
        raise click.UsageError("expected CHECKPOINT_ID (or --cancel)")
    reports = {r.checkpoint_id: r for r in validate_checkpoints(pipeline.checkpoints_uri)}
    report = reports.get(checkpoint_id)
    if report is None or not report.restorable:
        restorable = [c for c, r in reports.items() if r.restorable]
        why = "is not there" if report is None else (
            f"is {report.status}" if report.status != "completed" else
            "is damaged: " + "; ".join(report.problems[:3]))
        raise click.ClickException(
            f"checkpoint {checkpoint_id} {why}; restorable checkpoints: {restorable or 'none'}")
    found = pipeline_status(checkpoint_dir, checkpoint_storage=storage,
                            now_ms=CLOCK.now_ms())
    request_restore(store, store.root, checkpoint_id, CLOCK.now_ms())
    newer = [c for c, r in reports.items() if c > checkpoint_id and r.status == "completed"]
    result = {"checkpoint_id": checkpoint_id, "abandons": newer, "pipeline_state": found["state"]}
    if as_json:
        click.echo(json.dumps(result, indent=2))
        return
    click.echo(f"The next start of pipeline {found['pipeline']} restores checkpoint "
               f"{checkpoint_id}" + (f" and abandons checkpoints {newer} (kept on disk, not "
                                     "restorable)" if newer else "") + ".")
    if found["state"].startswith("running"):
        click.echo(f"The pipeline may be running ({found['state']}): the restore happens "
                   "when it next starts; stop it first with `spark-ckpt stop`.")


@main.command()
@click.argument("checkpoint_dir")
@click.option("--delete", "do_delete", is_flag=True,
              help="Delete the files listed (without it: a dry run, nothing changes).")
@click.option("--abandoned", is_flag=True,
              help="Also delete abandoned checkpoints (a restore by id chose an older one).")
@storage_option
@click.option("--json", "as_json", is_flag=True, help="Print the files as JSON.")
def cleanup(checkpoint_dir: str, do_delete: bool, abandoned: bool, storage: str | None,
            as_json: bool) -> None:
    """Files in CHECKPOINT_DIR that nothing reads again: state files no completed checkpoint
    references, processor output and stop requests of ended runs, and (--abandoned) abandoned
    checkpoints. A dry run unless --delete. Never touches a file written since the newest run
    started (a running pipeline's state that no checkpoint references yet), and deletes nothing
    if a run started while it listed."""
    from spark_ckpt.ops.pipeline_ops import apply_cleanup, cleanup_candidates

    found = cleanup_candidates(checkpoint_dir, checkpoint_storage=storage, abandoned=abandoned)
    deleted = apply_cleanup(checkpoint_dir, found) if do_delete else 0
    if as_json:
        click.echo(json.dumps(found.to_json() | {"deleted": deleted, "dry_run": not do_delete},
                              indent=2))
        return
    table = _table("path", "bytes", "why",
                   title=("Deleted" if do_delete else "Would delete (dry run: add --delete)"))
    for path, size, why in found.files:
        table.add_row(path, _size(size), why)
    for path, why in found.directories:
        table.add_row(path + "/", "-", why)
    if found.files or found.directories:
        _console().print(table)
    click.echo(f"{len(found.files)} file(s), {_size(found.bytes)}"
               + (f" and {len(found.directories)} abandoned checkpoint(s)"
                  if found.directories else "")
               + (" deleted" if do_delete else " to delete")
               + f"; {found.kept_files} state file(s) kept (referenced, or newer than run "
                 f"{found.newest_run})")


@main.command()
@click.argument("checkpoint_dir", required=False)
@click.option("--job", "job_id", default=None, help="A batch job's report instead.")
@work_dir_option
@storage_option
@click.option("-o", "--output", default=None,
              help="The HTML file to write (default: spark-ckpt-report-<name>.html).")
@click.option("--json", "as_json", is_flag=True, help="Print the written path as JSON.")
def report(checkpoint_dir: str | None, job_id: str | None, work_dir: str | None,
           storage: str | None, output: str | None, as_json: bool) -> None:
    """Write one self-contained HTML page: for the pipeline on CHECKPOINT_DIR, checkpoint
    duration, size and alignment over time, batch throughput and latency, state per operator
    and restarts; with --job, the job's recovery timeline (what each attempt reused and ran,
    and why)."""
    from spark_ckpt.ops.report import write_report

    _one_of(checkpoint_dir, job_id, "CHECKPOINT_DIR or --job JOB")
    name = job_id or os.path.basename(os.path.normpath(checkpoint_dir or "pipeline"))
    path = output or f"spark-ckpt-report-{name}.html"
    # the page is built before the file is opened: a refused directory writes nothing
    write_report(path, checkpoint_dir=checkpoint_dir, job_id=job_id,
                 work_dir=work_dir or _default_work_dir(), checkpoint_storage=storage)
    click.echo(json.dumps({"report": os.path.abspath(path)}) if as_json else
               f"wrote {os.path.abspath(path)}")


if __name__ == "__main__":
    sys.exit(main())
