"""``spark-ckpt``: inspect jobs from their event logs (no Spark needed).

    spark-ckpt jobs                      # every job under the work directory
    spark-ckpt history JOB               # attempts, vertices, partitions finished/reused/re-run
    spark-ckpt events JOB --type ExecutionVertexFinished --limit 20
    spark-ckpt plan JOB                  # where the job became durable, why, bytes written
    spark-ckpt checkpoints list CKPT_DIR # a pipeline's checkpoints: retained and history
    spark-ckpt checkpoints show CKPT_DIR [ID]   # one checkpoint: sources, state, sinks, sizes
    spark-ckpt validate CKPT_DIR | --job JOB    # what a restore or a resubmission relies on

Every command takes ``--json``. Exit codes: 0 done (validate: nothing wrong), 1 an error or
(validate) something missing or corrupt, 2 a usage error.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import sys
from collections import Counter, defaultdict

import click
from pyarrow.fs import FileSelector, FileType
from rich.console import Console
from rich.table import Table

from spark_ckpt.batch.runner import job_paths
from spark_ckpt.eventlog.events import EventType
from spark_ckpt.eventlog.reader import EventLogUnreadable, read_events
from spark_ckpt.eventlog.replay import replay
from spark_ckpt.options import OPTIONS, Settings
from spark_ckpt.storage import Storage, human_size

__all__ = ["main"]

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


work_dir_option = click.option(
    "--work-dir", default=None,
    help=f"The {_WORK_DIR_KEY} the jobs ran with (default: from ./spark-defaults.conf, "
         "else spark-ckpt-work).",
)


@click.group()
def main() -> None:
    """Inspect spark_ckpt jobs and their event logs."""


def _load(work_dir: str | None, job_id: str):  # noqa: ANN202
    storage = Storage(work_dir or _default_work_dir())
    paths = job_paths(storage, job_id)
    if not storage.exists(paths["events"]):
        raise click.ClickException(
            f"no event log for job {job_id!r} under {storage.uri} (expected {paths['events']})"
        )
    try:
        return read_events(storage, paths["events"])
    except EventLogUnreadable as exc:
        raise click.ClickException(str(exc)) from exc


@main.command()
@work_dir_option
@click.option("--json", "as_json", is_flag=True, help="Print JSON lines instead.")
def jobs(work_dir: str | None, as_json: bool) -> None:
    """List the jobs under the work directory."""
    storage = Storage(work_dir or _default_work_dir())
    rows = []
    if storage.exists(storage.root):
        infos = storage.fs.get_file_info(FileSelector(storage.root))
        for info in sorted(infos, key=lambda i: i.base_name):
            if info.type != FileType.Directory or "." in info.base_name:
                continue
            try:
                read = read_events(storage, job_paths(storage, info.base_name)["events"])
            except EventLogUnreadable:
                rows.append({"job_id": info.base_name, "attempts": None,
                             "status": "log unreadable", "last_event": None, "finished": None})
                continue
            if not read.events:
                continue
            history = replay(read.events)
            status = "completed" if history.completed else (
                history.attempts[history.last_attempt].status if history.attempts else "?")
            rows.append({"job_id": info.base_name, "attempts": len(history.attempts),
                         "status": status, "last_event": _time(read.events[-1].time_us),
                         "finished": len(history.finished)})
    if as_json:
        for row in rows:
            click.echo(json.dumps(row))
        return
    table = _table("job", "attempts", "status", "last event (UTC)", "finished partitions")
    for row in rows:
        table.add_row(*("-" if v is None else str(v) for v in row.values()))
    _console().print(table)


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
    for a in sorted(h.attempts.values(), key=lambda a: a.attempt):
        duration = f"{(a.finished_us - a.started_us) / 1e6:.1f} s" if a.finished_us else "-"
        attempts.add_row(str(a.attempt), a.mode, _time(a.started_us), a.status, duration,
                         str(sum(c[a.attempt] for c in finished_by.values())),
                         str(a.reused) if a.finished_us else "-")
    console.print(attempts)
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
@click.argument("job_id")
@work_dir_option
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead.")
def plan(job_id: str, work_dir: str | None, as_json: bool) -> None:
    """Where JOB_ID becomes durable and why, as its driver decided (BatchJob.explain before
    a run), with what each vertex wrote: estimated against actual bytes."""
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


@main.command()
@click.argument("job_id")
@work_dir_option
@click.option("--type", "event_type", type=click.Choice([t.value for t in EventType]),
              help="Only events of this type.")
@click.option("--limit", type=int, default=50, show_default=True, help="Newest N events.")
def events(job_id: str, work_dir: str | None, event_type: str | None, limit: int) -> None:
    """Print JOB_ID's events as JSON lines, oldest first."""
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


def _checkpoint_storage(checkpoint_dir: str, storage_dir: str | None):  # noqa: ANN202
    from spark_ckpt.checkpoint.storage import CheckpointStorage
    from spark_ckpt.storage import join

    return CheckpointStorage(storage_dir or join(checkpoint_dir, "checkpoints"))


_size = human_size


storage_option = click.option("--storage", default=None,
                              help="spark.ckpt.checkpoint.dir, if the pipeline set one.")


@checkpoints.command("list")
@click.argument("checkpoint_dir")
@storage_option
@click.option("--json", "as_json", is_flag=True, help="Print the history as JSON lines.")
def checkpoints_list(checkpoint_dir: str, storage: str | None, as_json: bool) -> None:
    """Every checkpoint in the history: status, barrier batch, duration, sizes."""
    from spark_ckpt.validate import checkpoint_dirs

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
    from spark_ckpt.validate import checkpoint_dirs

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
    from spark_ckpt.validate import validate_checkpoints, validate_job

    if (checkpoint_dir is None) == (job_id is None):
        raise click.UsageError("expected either CHECKPOINT_DIR or --job JOB, found "
                               + ("both" if job_id else "neither"))
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
    import time

    from spark_ckpt.storage import Storage
    from spark_ckpt.streaming.stop_control import latest_run, read_answer, request_stop, withdraw

    store = Storage(checkpoint_dir)
    run = latest_run(store, store.root)
    if run is None:
        raise click.ClickException(f"no pipeline has run on {checkpoint_dir}: expected a "
                                   "checkpoint directory with runs/, found none")
    request = request_stop(store, store.root, run, int(time.time() * 1000))
    if not as_json:
        click.echo(f"Asked run {run} of the pipeline on {checkpoint_dir} to stop with a final "
                   f"checkpoint (request {request.request_id}); waiting up to {timeout:g} s")
    deadline = time.monotonic() + timeout
    answer = read_answer(store, store.root, request.request_id)
    while answer is None and time.monotonic() < deadline:
        time.sleep(0.2)
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


if __name__ == "__main__":
    sys.exit(main())
