"""Where a driver's Spark time went, from its Spark event log: one line per Spark job.

    python scripts/eventlog_summary.py \
        benchmarks/results/<bench>.json.logs/events/eventlog_v2_local-*

``bench_batch.py --event-logs`` keeps every driver's event log beside its JSON. Per job (of at
least ``--min-run`` seconds of task time): its wall time, tasks, summed task run and GC time,
bytes read and written, shuffle bytes read and written, bytes spilled to disk, and its
description (spark_ckpt names the job, vertex and partitions). Reads plain and zstd-compressed
logs (Spark 4's default; needs the ``zstd`` command).
"""

from __future__ import annotations

import argparse
import collections
import json
import subprocess
from pathlib import Path


def _lines(directory: Path) -> list[str]:
    out: list[str] = []
    for f in sorted(directory.glob("events_*")):
        data = subprocess.run(["zstd", "-dc", str(f)], capture_output=True, check=True).stdout \
            if f.suffix == ".zstd" else f.read_bytes()
        out += [li for li in data.decode(errors="replace").splitlines() if li.strip()]
    return out


def summarize(directory: Path, min_run: float) -> list[str]:
    jobs: dict[int, dict] = {}
    stage_job: dict[int, int] = {}
    totals: dict[int, collections.Counter] = collections.defaultdict(collections.Counter)
    for line in _lines(directory):
        try:
            event = json.loads(line)
        except ValueError:
            continue  # the last line of a log still being written
        kind = event["Event"]
        if kind == "SparkListenerJobStart":
            props = event.get("Properties") or {}
            desc = props.get("spark.job.description") or props.get("spark.job.tags", "")
            jobs[event["Job ID"]] = {"desc": desc, "start": event["Submission Time"]}
            stage_job.update((s, event["Job ID"]) for s in event["Stage IDs"])
        elif kind == "SparkListenerJobEnd" and event["Job ID"] in jobs:
            jobs[event["Job ID"]]["end"] = event["Completion Time"]
        elif kind == "SparkListenerTaskEnd":
            metrics = event.get("Task Metrics") or {}
            shuffle_read = metrics.get("Shuffle Read Metrics") or {}
            c = totals[stage_job.get(event["Stage ID"], -1)]
            c["tasks"] += 1
            c["run"] += metrics.get("Executor Run Time", 0) / 1000
            c["gc"] += metrics.get("JVM GC Time", 0) / 1000
            c["read"] += (metrics.get("Input Metrics") or {}).get("Bytes Read", 0) / 1e9
            c["written"] += (metrics.get("Output Metrics") or {}).get("Bytes Written", 0) / 1e9
            c["shuffle_read"] += (shuffle_read.get("Remote Bytes Read", 0)
                                  + shuffle_read.get("Local Bytes Read", 0)) / 1e9
            c["shuffle_written"] += (metrics.get("Shuffle Write Metrics") or {}).get(
                "Shuffle Bytes Written", 0) / 1e9
            c["spilled"] += metrics.get("Disk Bytes Spilled", 0) / 1e9
    rows = [f"== {directory}"]
    for job_id, job in sorted(jobs.items()):
        c = totals[job_id]
        if c["run"] < min_run:
            continue
        wall = (job.get("end", job["start"]) - job["start"]) / 1000
        rows.append(f"job {job_id:4d} {wall:7.1f} s, {c['tasks']:4d} tasks, run {c['run']:7.1f} s, "
                    f"gc {c['gc']:5.1f} s, read {c['read']:5.2f} GB, wrote {c['written']:5.2f} GB, "
                    f"shuffle {c['shuffle_read']:5.2f}/{c['shuffle_written']:5.2f} GB, "
                    f"spilled {c['spilled']:5.2f} GB  {job['desc'][:100]}")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("logs", nargs="+", type=Path, help="event log directories")
    parser.add_argument("--min-run", type=float, default=2.0,
                        help="leave out jobs with less task time than this (seconds)")
    args = parser.parse_args()
    for directory in args.logs:
        print("\n".join(summarize(directory, args.min_run)))


if __name__ == "__main__":
    main()
