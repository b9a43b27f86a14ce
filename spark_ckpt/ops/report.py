"""``spark-ckpt report``: one self-contained HTML page about a pipeline or a batch job.

A pipeline's page (from its checkpoint directory, no Spark needed): headline figures, then
checkpoint duration (with its synchronous, asynchronous and alignment parts) and size over
checkpoint ids, batch throughput and latency over batch ids with every restart marked, state
rows per operator, the runs and how each ended, and the latest checkpoints. A batch job's page
(from its event log): each attempt on one time axis (every finished partition a bar, by
vertex), what each attempt ran and reused, and why (where the job became durable, partitions
reset and their reasons).

Charts are drawn with matplotlib into inline SVG: the page loads nothing from anywhere.
"""

from __future__ import annotations

import datetime as dt
import html
import io
import statistics
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

from spark_ckpt.clock import Clock, SystemClock
from spark_ckpt.errors import JobDefinitionError
from spark_ckpt.storage import human_size

__all__ = ["job_report", "pipeline_report", "write_report"]

_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:0;background:#f6f7f9;
color:#1d2330}
header{background:#1d2330;color:#fff;padding:20px 32px}
header h1{margin:0;font-size:22px;font-weight:600} header p{margin:4px 0 0;color:#b8c0cc}
main{padding:20px 32px;max-width:1200px}
.cards{display:flex;flex-wrap:wrap;gap:12px;margin-bottom:20px}
.card{background:#fff;border-radius:8px;padding:12px 16px;min-width:140px;
box-shadow:0 1px 2px rgba(0,0,0,.08)}
.card .v{font-size:22px;font-weight:600} .card .k{font-size:12px;color:#6b7382;
text-transform:uppercase;letter-spacing:.04em}
.ok{color:#1a7f37} .bad{color:#c62828} .warn{color:#b26a00}
section{background:#fff;border-radius:8px;padding:16px 20px;margin-bottom:16px;
box-shadow:0 1px 2px rgba(0,0,0,.08)}
section h2{font-size:16px;margin:0 0 10px} svg{max-width:100%;height:auto}
table{border-collapse:collapse;width:100%;font-size:13px}
th,td{text-align:left;padding:5px 8px;border-bottom:1px solid #eceef2;vertical-align:top}
th{color:#6b7382;font-weight:600} .grid{display:grid;grid-template-columns:1fr 1fr;gap:16px}
.note{color:#6b7382;font-size:13px}
"""

_COLORS = ["#2f6fdb", "#e07b39", "#2ca58d", "#c94c7c", "#7b61c9", "#8a8f98"]


def _iso(ms: float | None) -> str:
    if ms is None:
        return "-"
    return dt.datetime.fromtimestamp(ms / 1000, dt.UTC).strftime("%Y-%m-%d %H:%M:%S")


def _esc(value: Any) -> str:
    return html.escape("-" if value is None else str(value))


def _svg(fig: Any) -> str:
    buf = io.StringIO()
    fig.savefig(buf, format="svg", bbox_inches="tight")
    text = buf.getvalue()
    return text[text.find("<svg"):]


def _figure(width: float = 7.0, height: float = 2.6) -> tuple[Any, Any]:
    from matplotlib.figure import Figure  # no pyplot: no global state, no display

    fig = Figure(figsize=(width, height), dpi=100)
    ax = fig.add_subplot()
    ax.spines[["top", "right"]].set_visible(False)
    ax.grid(axis="y", color="#eceef2")
    ax.tick_params(labelsize=8)
    return fig, ax


def _line_chart(series: dict[str, tuple[list[float], list[float]]], xlabel: str, ylabel: str,
                marks: Sequence[tuple[float, str]] = (), bad: tuple[list[float], list[float]]
                | None = None) -> str:
    fig, ax = _figure()
    for i, (name, (xs, ys)) in enumerate(series.items()):
        if xs:
            ax.plot(xs, ys, marker="o", markersize=3, linewidth=1.4,
                    color=_COLORS[i % len(_COLORS)], label=name)
    if bad and bad[0]:
        ax.scatter(bad[0], bad[1], marker="x", color="#c62828", zorder=5, label="aborted")
    for x, label in marks:
        ax.axvline(x, color="#8a8f98", linestyle="--", linewidth=1)
        ax.annotate(label, (x, 1), xycoords=("data", "axes fraction"), fontsize=7,
                    color="#6b7382", rotation=90, va="top", ha="right")
    ax.set_xlabel(xlabel, fontsize=9)
    ax.set_ylabel(ylabel, fontsize=9)
    if len(series) > 1 or bad:
        ax.legend(fontsize=8, frameon=False)
    return _svg(fig)


def _card(key: str, value: Any, cls: str = "") -> str:
    return f'<div class="card"><div class="k">{_esc(key)}</div>' \
           f'<div class="v {cls}">{_esc(value)}</div></div>'


def _table(header: list[str], rows: list[list[Any]]) -> str:
    head = "".join(f"<th>{_esc(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{_esc(c)}</td>" for c in row) + "</tr>"
                   for row in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def _page(title: str, subtitle: str, body: str) -> str:
    return (f"<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>"
            f"<title>{_esc(title)}</title><style>{_CSS}</style></head><body>"
            f"<header><h1>{_esc(title)}</h1><p>{_esc(subtitle)}</p></header>"
            f"<main>{body}</main></body></html>")


# -- a pipeline --------------------------------------------------------------------------------
def _ms(stamp: Any) -> float | None:
    try:
        return dt.datetime.fromisoformat(str(stamp).replace("Z", "+00:00")).timestamp() * 1000
    except ValueError:
        return None


def pipeline_report(checkpoint_dir: str, *, checkpoint_storage: str | None = None,
                    now_ms: int | None = None, clock: Clock | None = None) -> str:
    """The HTML page of the pipeline whose checkpoint directory is ``checkpoint_dir``, as of
    ``now_ms`` (by default the time of ``clock``, the system clock by default)."""
    from spark_ckpt.checkpoint.checkpoint_storage import CheckpointStorage
    from spark_ckpt.ops.pipeline_ops import pipeline_status, progress_records
    from spark_ckpt.streaming.runtime.pipeline_dir import open_pipeline_dir

    now_ms = now_ms if now_ms is not None else (clock or SystemClock()).now_ms()
    pipeline = open_pipeline_dir(checkpoint_dir, checkpoint_storage)
    status = pipeline_status(checkpoint_dir, checkpoint_storage=checkpoint_storage,
                             now_ms=now_ms)
    progress = progress_records(pipeline.storage, pipeline.root)
    checkpoints = CheckpointStorage(pipeline.checkpoints_uri)
    stats = sorted(checkpoints.history(), key=lambda s: int(s["checkpoint_id"]))
    runs = [(run, pipeline.run_record(run).get("started_ms"), pipeline.run_end(run))
            for run in pipeline.runs()]

    # restarts: the first batch each later run completed
    marks = []
    for run, started, _end in runs[1:]:
        first = next((p for p in progress if started and (_ms(p.get("timestamp")) or 0)
                      >= started), None)
        if first is not None:
            marks.append((float(first["batch_id"]), f"run {run}"))

    done = [s for s in stats if s.get("status") == "completed"]
    failed = [s for s in stats if s.get("status") != "completed"]
    durations = [int(s.get("duration_ms") or 0) for s in done]
    rows_total = sum(int(p.get("num_input_rows") or 0) for p in progress)
    state_cls = {"stopped": "ok", "running": "ok", "failed": "bad"}.get(status["state"], "warn")
    cards = "".join([
        _card("status", status["state"], state_cls),
        _card("batches", len(progress)),
        _card("rows", f"{rows_total:,}"),
        _card("checkpoints", f"{len(done)} ok / {len(failed)} failed",
              "bad" if failed else ""),
        _card("checkpoint p50", f"{statistics.median(durations):.0f} ms" if durations else "-"),
        _card("checkpoint max", f"{max(durations)} ms" if durations else "-"),
        _card("state", human_size(done[-1].get("full_bytes")) if done else "-"),
        _card("restarts", max(0, len(runs) - 1)),
    ])
    sections = [f'<div class="cards">{cards}</div>']

    if stats:
        ids = [float(s["checkpoint_id"]) for s in done]
        series = {"duration": (ids, [float(s.get("duration_ms") or 0) for s in done]),
                  "sync (max task)": (ids, [float(s.get("sync_ms") or 0) for s in done]),
                  "async (max task)": (ids, [float(s.get("async_ms") or 0) for s in done]),
                  "alignment (max task)": (ids, [float(s.get("alignment_ms") or 0)
                                                 for s in done])}
        bad = ([float(s["checkpoint_id"]) for s in failed],
               [float(s.get("duration_ms") or 0) for s in failed])
        top = max([int(s.get("full_bytes") or 0) for s in done], default=0)
        unit, scale = next(((u, f) for u, f in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10))
                            if top >= f), ("bytes", 1))
        size = {"full state": (ids, [(s.get("full_bytes") or 0) / scale for s in done]),
                "written (incremental)": (ids, [(s.get("incremental_bytes") or 0) / scale
                                                for s in done])}
        sections.append(
            "<div class='grid'><section><h2>Checkpoint duration</h2>"
            + _line_chart(series, "checkpoint id", "ms", bad=bad) + "</section>"
            "<section><h2>Checkpoint size</h2>"
            + _line_chart(size, "checkpoint id", unit) + "</section></div>")
    if progress:
        ids = [float(p["batch_id"]) for p in progress]
        rate = {"rows/s": (ids, [float(p.get("processed_rows_per_second") or 0)
                                 for p in progress])}
        latency = {"total": (ids, [float((p.get("durations_ms") or {}).get("total") or 0)
                                   for p in progress])}
        per_op: dict[str, tuple[list[float], list[float]]] = defaultdict(lambda: ([], []))
        for p in progress:
            for op, st in (p.get("state") or {}).items():
                if isinstance(st, dict) and st.get("state_rows") is not None:
                    per_op[op][0].append(float(p["batch_id"]))
                    per_op[op][1].append(float(st["state_rows"]))
        sections.append(
            "<div class='grid'><section><h2>Batch throughput</h2>"
            + _line_chart(rate, "batch id", "rows per second", marks) + "</section>"
            "<section><h2>Batch latency</h2>"
            + _line_chart(latency, "batch id", "ms", marks) + "</section></div>")
        if per_op:
            sections.append("<section><h2>State rows per operator</h2>"
                            + _line_chart(dict(per_op), "batch id", "keys in state", marks)
                            + "</section>")
    else:
        sections.append("<section><h2>Batches</h2><p class='note'>No batch progress recorded "
                        "yet.</p></section>")
    run_rows = []
    for run, started, end in runs:
        run_rows.append([run, _iso(started), (end or {}).get("status", "no end recorded "
                                                              "(running, or killed)"),
                         _iso((end or {}).get("ended_ms")) if end else "-",
                         (end or {}).get("final_checkpoint"), (end or {}).get("message") or ""])
    sections.append("<section><h2>Runs and restarts</h2>" + _table(
        ["run", "started (UTC)", "ended", "at", "final checkpoint", "message"], run_rows)
        + "</section>")
    sections.append("<section><h2>Latest checkpoints</h2>" + _table(
        ["id", "status", "barrier batch", "duration ms", "state", "written", "alignment ms",
         "reason"],
        [[s["checkpoint_id"], s.get("status"), s.get("barrier_batch"), s.get("duration_ms"),
          human_size(s.get("full_bytes")), human_size(s.get("incremental_bytes")),
          s.get("alignment_ms"), s.get("reason") or ""] for s in stats[-15:][::-1]])
        + "</section>")
    title = f"Pipeline {status['pipeline']}"
    subtitle = (f"{checkpoint_dir} · id {status['pipeline_id']} · report of {_iso(now_ms)} UTC")
    return _page(title, subtitle, "".join(sections))


# -- a batch job ------------------------------------------------------------------------------
def job_report(work_dir: str, job_id: str) -> str:
    """The HTML page of batch job ``job_id`` under ``work_dir``: its recovery timeline."""
    from spark_ckpt.batch.workdir import open_job
    from spark_ckpt.eventlog.events import EventType
    from spark_ckpt.eventlog.replay import replay

    read = open_job(work_dir, job_id)
    events = read.events
    history = replay(events)
    if not events:
        return _page(f"Job {job_id}", work_dir, "<p>No events recorded.</p>")
    t0 = min(e.time_us for e in events)
    ran: dict[int, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    bars: dict[str, list[tuple[float, float, int]]] = defaultdict(list)
    resets: list[list[Any]] = []
    for e in events:
        if e.type is EventType.EXECUTION_VERTEX_FINISHED and e.vertex_id:
            ran[e.job_attempt][e.vertex_id] += 1
            end = (e.time_us - t0) / 1e6
            bars[e.vertex_id].append((end - (e.duration_ms or 0) / 1000, end, e.job_attempt))
        elif e.type is EventType.EXECUTION_VERTEX_RESET:
            resets.append([e.job_attempt, e.vertex_id, "all" if e.partition is None
                           else e.partition, e.payload.get("reason", "")])
    attempts = sorted(history.attempts.values(), key=lambda a: a.attempt)
    sources = {v for v, d in history.vertices.items() if (d.get("cut") or {}).get("source")}
    vertices = [v for v in (list(history.vertices) or sorted(bars)) if v not in sources]
    fig, ax = _figure(9.0, max(2.0, 0.45 * len(vertices) + 1.0))
    for row, vid in enumerate(vertices):
        for start, end, attempt in bars.get(vid, ()):
            ax.barh(row, max(end - start, 0.05), left=start, height=0.6,
                    color=_COLORS[(attempt - 1) % len(_COLORS)], alpha=0.75)
    for a in attempts:
        ax.axvline((a.started_us - t0) / 1e6, color="#8a8f98", linestyle="--", linewidth=1)
        ax.annotate(f"attempt {a.attempt} ({a.mode or 'fresh'})",
                    ((a.started_us - t0) / 1e6, 1), xycoords=("data", "axes fraction"),
                    fontsize=7, color="#6b7382", rotation=90, va="top", ha="right")
    ax.set_yticks(range(len(vertices)), vertices, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("seconds since the first attempt started (each bar a partition, "
                  "colored by attempt)", fontsize=9)
    timeline = _svg(fig)
    total = sum(int(d.get("parallelism") or 0) for v, d in history.vertices.items()
                if v not in sources)
    last = attempts[-1] if attempts else None
    state = "completed" if history.completed else (last.status if last else "not started")
    cards = "".join([
        _card("status", state, "ok" if history.completed else
              ("bad" if state == "failed" else "warn")),
        _card("attempts", len(attempts)),
        _card("partitions", f"{len(history.finished)} / {total}"),
        _card("reused by the last attempt", last.reused if last else "-"),
        _card("run by the last attempt", last.ran if last and last.finished_us else "-"),
        _card("wall time, all attempts",
              f"{(max(e.time_us for e in events) - t0) / 1e6:.1f} s"),
    ])
    attempt_rows = [[a.attempt, a.mode or "fresh", _iso(a.started_us / 1000),
                     f"{(a.finished_us - a.started_us) / 1e6:.1f} s" if a.finished_us else "-",
                     a.status, sum(ran[a.attempt].values()),
                     a.reused if a.finished_us else "-", a.error or ""] for a in attempts]
    written: dict[str, int] = {}  # the files the kept partitions recorded (results, sinks)
    for (vid, _p), done in history.finished.items():
        written[vid] = written.get(vid, 0) + sum(f.size for f in done.outputs)
    cut_rows = []
    for vid, payload in history.vertices.items():
        cut = payload.get("cut") or {}
        decision = ("source" if cut.get("source") else "durable" if cut.get("durable")
                    else "chained") if cut else "durable"
        per = ", ".join(f"attempt {k}: {v[vid]}" for k, v in sorted(ran.items()) if v.get(vid))
        cut_rows.append([vid, decision, payload.get("parallelism"),
                         human_size(cut.get("est_bytes")),
                         human_size(written[vid]) if vid in written else "-",
                         per or "-", cut.get("reason", "")])
    body = (f'<div class="cards">{cards}</div>'
            "<section><h2>Recovery timeline</h2>" + timeline + "</section>"
            "<section><h2>Attempts: what each ran and reused</h2>" + _table(
                ["attempt", "mode", "started (UTC)", "took", "status", "partitions run",
                 "reused", "error"], attempt_rows) + "</section>"
            "<section><h2>Vertices: where the job is durable, and why</h2>" + _table(
                ["vertex", "decision", "partitions", "estimated bytes (sampled)",
                 "bytes written (kept partitions)", "finished per attempt", "why"],
                cut_rows) + "</section>")
    if resets:
        body += ("<section><h2>Partitions reset (their outputs could not be reused)</h2>"
                 + _table(["attempt", "vertex", "partition", "reason"], resets) + "</section>")
    return _page(f"Job {job_id}", f"{work_dir} · {len(events)} events", body)


def write_report(path: str, *, checkpoint_dir: str | None = None, job_id: str | None = None,
                 work_dir: str | None = None, checkpoint_storage: str | None = None) -> str:
    """Write the page of a pipeline (``checkpoint_dir``) or a job (``job_id`` under
    ``work_dir``) to ``path``; returns ``path``."""
    if (checkpoint_dir is None) == (job_id is None):
        raise JobDefinitionError(
            "expected a checkpoint directory or a job id, not both or neither")
    page = pipeline_report(checkpoint_dir, checkpoint_storage=checkpoint_storage) \
        if checkpoint_dir is not None else job_report(work_dir or ".", job_id or "")
    with open(path, "w", encoding="utf-8") as out:
        out.write(page)
    return path
