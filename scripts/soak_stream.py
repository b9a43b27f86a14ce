"""Soak: a stateful pipeline for MINUTES with a SIGKILL every KILL_EVERY, tracking growth.

    python scripts/soak_stream.py [--minutes 30] [--kill-every 180] [--dir /tmp/soak]
                                  [--json /tmp/soak.json]

Runs ``jobs/stateful_counts.py`` (keyed state, barrier checkpoints, two two-phase Delta sinks)
as a real driver on an endless deterministic source, SIGKILLs its whole process group every
``--kill-every`` seconds and starts it again. Every ``--sample`` seconds it records the RSS and
open file descriptors of the driver and its JVM and the bytes and files under each part of the
checkpoint directory. At the end it checks the output is exactly once (every id from 0 to the
highest committed one shows once, each key's ``seq`` runs 1, 2, 3... and ``prev_id`` chains
its ids: Flink's check) and that the checkpoint directory stopped growing once retention
applies (its size, less the progress log, which rotation bounds by itself, in the last
quarter of the run is within 1.5x of its size in the second quarter). The output tables
themselves grow with the data, as they should. Not a test: a benchmark of what a long run
keeps; write its result into docs/benchmarks.md (and the round into
docs/benchmarks-history.md), its JSON into benchmarks/results/.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PARTS = ("state", "checkpoints", "allocations", "commits", "driver", "progress", "fence",
         "runs", "sources")


def tree(path: Path) -> tuple[int, int]:
    size = files = 0
    for dirpath, _dirs, names in os.walk(path):
        for name in names:
            try:
                size += os.stat(os.path.join(dirpath, name)).st_size
                files += 1
            except FileNotFoundError:
                pass
    return size, files


def process_stats(pid: int) -> tuple[int, int]:
    """RSS bytes and open file descriptors of ``pid`` (0, 0 if it is gone)."""
    try:
        with open(f"/proc/{pid}/statm") as f:
            rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        return rss, len(os.listdir(f"/proc/{pid}/fd"))
    except (FileNotFoundError, ProcessLookupError):
        return 0, 0


def jvm_heap(pid: int) -> tuple[int, int]:
    """The JVM's live heap (bytes used right after a full GC, which ``jcmd GC.run`` forces)
    and its committed heap; (0, 0) without ``jcmd``/``jstat`` or if the JVM is gone. Live heap
    is the leak signal: RSS follows the committed heap, which the JVM grows up to -Xmx and
    rarely gives back."""
    try:
        subprocess.run(["jcmd", str(pid), "GC.run"], capture_output=True, timeout=30,
                       check=True)
        out = subprocess.run(["jstat", "-gc", str(pid)], capture_output=True, text=True,
                             timeout=30, check=True).stdout.split("\n")
        row = dict(zip(out[0].split(), out[1].split(), strict=False))
        used = sum(float(row[k]) for k in ("S0U", "S1U", "EU", "OU"))
        committed = sum(float(row[k]) for k in ("S0C", "S1C", "EC", "OC"))
        return int(used * 1024), int(committed * 1024)
    except (OSError, subprocess.SubprocessError, KeyError, IndexError, ValueError):
        return 0, 0


def children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(p) for p in f.read().split()]
    except FileNotFoundError:
        return []


def start(ckpt: Path, out: Path, log: Path) -> subprocess.Popen:
    env = dict(os.environ, PYSPARK_PYTHON=sys.executable,
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               SPARK_CKPT_DEFAULTS=str(ROOT / "spark-defaults.conf"))
    cmd = [sys.executable, str(ROOT / "jobs" / "stateful_counts.py"), "--checkpoint", str(ckpt),
           "--output", str(out), "--total-rows", str(10**12), "--rows-per-batch", "200",
           "--keys", "50", "--interval", "0.5", "--checkpoint-ms", "5000"]
    return subprocess.Popen(cmd, env=env, stdout=log.open("a"), stderr=subprocess.STDOUT,
                            start_new_session=True, cwd=ROOT)


def check_exactly_once(out: Path) -> dict[str, object]:
    from spark_ckpt.storage.delta_reader import read_delta

    events = read_delta(str(out / "events")).to_pandas()
    ids = events["id"].sort_values().tolist()
    verdict: dict[str, object] = {"rows": len(ids), "max_id": ids[-1] if ids else None}
    verdict["ids_once_and_gapless"] = ids == list(range(len(ids)))
    ok_seq = ok_chain = True
    for _key, group in events.sort_values("id").groupby("key"):
        ok_seq &= group["seq"].tolist() == list(range(1, len(group) + 1))
        ok_chain &= group["prev_id"].tolist()[1:] == group["id"].tolist()[:-1]
    totals = read_delta(str(out / "totals")).to_pandas().set_index("key")["n"]
    counts = events.groupby("key").size()
    verdict.update(seq_gapless=bool(ok_seq), prev_id_chains=bool(ok_chain),
                   totals_match_events=bool((totals.reindex(counts.index) == counts).all()))
    verdict["exactly_once"] = all(verdict[k] for k in (
        "ids_once_and_gapless", "seq_gapless", "prev_id_chains", "totals_match_events"))
    return verdict


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=30)
    parser.add_argument("--kill-every", type=float, default=180, help="seconds")
    parser.add_argument("--sample", type=float, default=10, help="seconds")
    parser.add_argument("--dir", default="/tmp/spark-ckpt-soak")
    parser.add_argument("--json", default="/tmp/spark-ckpt-soak.json")
    args = parser.parse_args()
    base = Path(args.dir)
    if base.exists():
        import shutil

        shutil.rmtree(base)
    base.mkdir(parents=True)
    ckpt, out, log = base / "ckpt", base / "out", base / "driver.log"
    began = time.monotonic()
    end = began + args.minutes * 60
    proc = start(ckpt, out, log)
    next_kill = began + args.kill_every
    kills, samples = 0, []
    while time.monotonic() < end:
        time.sleep(args.sample)
        now = time.monotonic()
        driver_rss, driver_fds = process_stats(proc.pid)
        jvm = [c for c in children(proc.pid)]
        jvm_rss = sum(process_stats(c)[0] for c in jvm)
        jvm_fds = sum(process_stats(c)[1] for c in jvm)
        live, committed = jvm_heap(jvm[0]) if jvm else (0, 0)
        sample = {"t_s": round(now - began, 1), "driver_rss": driver_rss,
                  "driver_fds": driver_fds, "jvm_rss": jvm_rss, "jvm_fds": jvm_fds,
                  "jvm_heap_live": live, "jvm_heap_committed": committed, "kills": kills}
        for part in PARTS:
            sample[f"{part}_bytes"], sample[f"{part}_files"] = tree(ckpt / part)
        sample["ckpt_bytes"], sample["ckpt_files"] = tree(ckpt)
        sample["out_bytes"], sample["out_files"] = tree(out)
        samples.append(sample)
        print(json.dumps(sample), flush=True)
        if proc.poll() is not None:
            print(f"driver exited by itself with {proc.returncode}; see {log}", flush=True)
            break
        if now >= next_kill and now + 60 < end:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            kills += 1
            proc = start(ckpt, out, log)
            next_kill = now + args.kill_every
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    verdict = check_exactly_once(out)
    # progress.jsonl is bounded on its own (rotated at 10 MiB, 3 files): leave it out here
    quarter = max(1, len(samples) // 4)

    def kept(s: dict[str, int]) -> int:
        return s["ckpt_bytes"] - s["progress_bytes"]

    second = max(kept(s) for s in samples[quarter:2 * quarter]) if samples else 0
    last = max(kept(s) for s in samples[-quarter:]) if samples else 0
    verdict["ckpt_bytes_second_quarter_max"] = second
    verdict["ckpt_bytes_last_quarter_max"] = last
    verdict["ckpt_bounded"] = bool(second and last <= 1.5 * second)
    for part in ("checkpoints", "state", "allocations", "commits", "runs"):
        files = [s[f"{part}_files"] for s in samples]
        verdict[f"{part}_files_second_quarter_max"] = max(files[quarter:2 * quarter] or [0])
        verdict[f"{part}_files_last_quarter_max"] = max(files[-quarter:] or [0])
    summary = {"minutes": args.minutes, "kill_every_s": args.kill_every, "kills": kills,
               "restarts": kills, "verdict": verdict}
    for key in ("driver_rss", "jvm_rss", "jvm_heap_live", "jvm_heap_committed", "driver_fds",
                "jvm_fds", "ckpt_bytes", "ckpt_files", "checkpoints_files",
                "state_bytes", "checkpoints_bytes", "allocations_files", "commits_files",
                "progress_bytes", "out_bytes"):
        series = [s[key] for s in samples if s["driver_rss"]] or [0]
        summary[key] = {"min": min(series), "max": max(series), "final": series[-1]}
    Path(args.json).write_text(json.dumps({"summary": summary, "samples": samples}, indent=1))
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
