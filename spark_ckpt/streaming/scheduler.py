"""The JobScheduler: runs each batch's output jobs on Spark, in batch order, one batch at a time.

Per batch: instantiate the template from the outputs (BFS, each stream once), *stage* every
output (Spark jobs in a job group named after pipeline and batch, described per output), then
*commit* every output keyed by the batch id, then record the batch in ``commits/``. Outputs a
previous driver already committed for this batch are skipped, so a rerun batch shows nothing
twice. Progress goes to the listeners and the progress log.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import TYPE_CHECKING, Any

from spark_ckpt.faults import fault_point
from spark_ckpt.streaming.batch import BatchAllocation, BatchRun
from spark_ckpt.streaming.progress import notify

if TYPE_CHECKING:
    from spark_ckpt.streaming.context import StreamingContext

__all__ = ["JobScheduler"]

log = logging.getLogger(__name__)

_STOP = object()


class JobScheduler:
    def __init__(self, ctx: StreamingContext) -> None:
        self.ctx = ctx
        self.queue: queue.Queue[Any] = queue.Queue()
        self.in_flight = threading.Semaphore(ctx.settings.stream_max_batches_in_flight)
        self.thread = threading.Thread(target=self._loop, name=f"spark-ckpt-scheduler-{ctx.name}",
                                       daemon=True)
        self.running_group: str | None = None
        self._last_start: float | None = None
        self._stopping = threading.Event()

    def start(self) -> None:
        self.thread.start()

    def submit(self, allocation: BatchAllocation, recovered: bool = False) -> None:
        self.queue.put((allocation, recovered))

    def stop(self, *, drain: bool = False) -> None:
        """Stop after the running batch; with ``drain``, after every batch already queued."""
        if not drain:
            self._stopping.set()
        self.queue.put(_STOP)

    def _loop(self) -> None:
        while True:
            item = self.queue.get()
            if item is _STOP or self._stopping.is_set():
                return
            allocation, recovered = item
            try:
                self.run_batch(allocation, recovered)
            except BaseException as exc:  # noqa: BLE001 - handed to await_termination
                self.ctx._batch_failed(allocation.batch_id, exc)  # noqa: SLF001
                return
            finally:
                self.in_flight.release()
            if self.ctx.available_now_done(allocation.batch_id):
                return

    # -- one batch -----------------------------------------------------------------------
    def run_batch(self, allocation: BatchAllocation, recovered: bool) -> dict[str, Any]:
        ctx = self.ctx
        b = allocation.batch_id
        started = time.perf_counter()
        wall_start = time.time()
        since_last = (started - self._last_start) if self._last_start is not None else None
        self._last_start = started
        run = BatchRun(ctx, allocation)
        sc = ctx.spark.sparkContext
        group = f"spark_ckpt-{ctx.name}-b{b}"
        self.running_group = group
        durations: dict[str, float] = {}
        outputs: dict[str, Any] = {}
        staged: dict[str, Any] = {}
        notify(ctx.listeners, "on_batch_started", {
            "pipeline": ctx.name, "batch_id": b, "batch_time_ms": allocation.batch_time_ms,
            "recovered": recovered})
        try:
            sc.setJobGroup(group, f"spark_ckpt pipeline {ctx.name} batch {b}",
                           interruptOnCancel=True)
            planning = 0.0
            for output in ctx.graph.outputs:
                sink = output.sink
                if sink.is_committed(b):
                    outputs[sink.name] = {"skipped": "already committed"}
                    continue
                finished = sink.finish_pending(b)
                if finished is not None:
                    outputs[sink.name] = {"finished_pending_commit": True, **finished}
                    continue
                t0 = time.perf_counter()
                df = run.get_or_compute(output)
                if df is None:
                    outputs[sink.name] = {"skipped": "no batch (window slide)"}
                    continue
                sink.prepare(df)
                t1 = time.perf_counter()
                planning += t1 - t0
                sc.setLocalProperty("spark.job.description",
                                    f"spark_ckpt pipeline {ctx.name} batch {b} output {sink.name}")
                staged[sink.name] = sink.stage(df, b)
                durations[f"output.{sink.name}"] = _ms(time.perf_counter() - t1)
            durations["planning"] = _ms(planning)
            fault_point("stream.batch.staged")
            t0 = time.perf_counter()
            ctx.check_fenced()
            for output in ctx.graph.outputs:
                name = output.sink.name
                if name in staged:
                    outputs[name] = output.sink.commit(b, staged[name]) or {}
                    fault_point("stream.output.committed")
            ctx.commits.add(b, {"outputs": {k: _jsonable(v) for k, v in outputs.items()},
                                "finished_ms": int(time.time() * 1000)})
            durations["commit"] = _ms(time.perf_counter() - t0)
            fault_point("stream.batch.committed")
        finally:
            self.running_group = None
            sc.setLocalProperty("spark.jobGroup.id", None)
            sc.setLocalProperty("spark.job.description", None)
            run.cleanup()
        total = time.perf_counter() - started
        durations["total"] = _ms(total)
        durations["allocation"] = ctx.allocation_ms.pop(b, 0)
        rows = run.stats.input_rows
        known = [r for r in rows.values() if r is not None]
        num_rows = sum(known) if len(known) == len(rows) else None
        progress = {
            "pipeline": ctx.name,
            "batch_id": b,
            "batch_time_ms": allocation.batch_time_ms,
            "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(wall_start)) +
            f".{int(wall_start * 1000) % 1000:03d}Z",
            "recovered": recovered,
            "num_input_rows": num_rows,
            "input_rows_per_second": (num_rows / since_last if num_rows is not None and
                                      since_last else None),
            "processed_rows_per_second": num_rows / total if num_rows is not None and total
            else None,
            "sources": {name: {"input_rows": rows.get(name),
                               "dead_letter_rows": run.stats.dead_letters.get(name, 0)}
                        for name in ctx.tracker.sources},
            "streams_computed": list(run.stats.computed),
            "durations_ms": durations,
            "outputs": {k: _jsonable(v) for k, v in outputs.items()},
        }
        ctx.batch_completed(progress)
        return progress


def _ms(seconds: float) -> int:
    return int(round(seconds * 1000))


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if isinstance(value, str | int | float | bool) or value is None:
        return value
    return str(value)
