"""Two-phase-commit sinks: stage at every batch, pre-commit at the barrier, commit when the
checkpoint completes (Flink's TwoPhaseCommitSinkFunction on a micro-batch runtime).

Implement :class:`TwoPhaseCommitSink` for your own system and pass it to
``stream.write_two_phase(sink)``:

* ``write(df, batch_id)`` stages one batch's output invisibly and returns a JSON-able *piece*;
* ``pre_commit(checkpoint_id, pieces)`` makes the pieces since the previous barrier one durable,
  committable *transaction* (JSON-able, stored in the checkpoint's metadata). The barrier goes
  at the last *finished* batch, so ``pre_commit`` gets the pieces of the batches up to it,
  runs on the checkpoint coordinator's thread, and may run while ``write`` stages a later
  batch. Each piece must therefore stand alone: output staged by a later ``write`` must not
  become part of this transaction (a sink with one shared open transaction, such as a Kafka
  producer's, would commit a batch that a restore replays). It is not called when no piece
  was staged since the previous barrier;
* ``commit(checkpoint_id, txn)`` makes it visible. It must be idempotent: it runs again after a
  crash between checkpoint completion and commit, and a completed checkpoint's notification
  commits every earlier transaction a lost notification left pending (subsumption);
* ``abort(pieces)`` drops staged output that no checkpoint will commit.

Transactions are keyed by the checkpoint id *and* the pipeline's lineage id (kept in the
checkpoint directory's metadata, as Structured Streaming keeps a query id), so a pipeline started
with a new checkpoint directory on an existing table never mistakes its checkpoint 1 for another
lineage's.

Built in: :class:`DeltaTwoPhaseSink` (append, or merge by key for update streams) and
:class:`ParquetTwoPhaseSink`.
"""

from __future__ import annotations

import logging
import re
import threading
import uuid
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from spark_ckpt.checkpoint.listener import CheckpointListener
from spark_ckpt.errors import CommitError, JobDefinitionError
from spark_ckpt.execution.job_graph import SinkSpec
from spark_ckpt.execution.result_partition import OutputFile
from spark_ckpt.faults import fault_point
from spark_ckpt.formats import dump_record, load_record
from spark_ckpt.sinks import DeltaSink, check_files
from spark_ckpt.sinks.per_batch import PipelineScope, _FileSink, staged_files
from spark_ckpt.storage import Storage, delta_table, is_delta_table, join

if TYPE_CHECKING:
    from pyspark.sql import DataFrame

__all__ = ["DeltaTwoPhaseSink", "ParquetTwoPhaseSink", "SinkTransactions",
           "TwoPhaseCommitSink"]

log = logging.getLogger(__name__)


class TwoPhaseCommitSink:
    """Base class of two-phase-commit sinks. ``name`` is unique within the pipeline."""

    kind = "two_phase"

    def __init__(self, name: str) -> None:
        self.name = name
        self.lineage: str = ""  # "<pipeline>-<pipeline id>", set when the pipeline starts
        # set when the pipeline starts: the moment (storage's clock) this driver claimed the
        # checkpoint directory; a start-up clean-up leaves what was written since (a newer
        # driver's staged output) alone
        self.claimed_at: Any = None

    def describe(self) -> dict[str, Any]:
        """What the pipeline records of the sink (its kind; a subclass adds its target)."""
        return {"kind": self.kind}

    def prepare(self, df: DataFrame) -> None:
        """Check or create the target for the batch's schema."""

    def write(self, df: DataFrame, batch_id: int) -> dict[str, Any] | None:
        """Stage batch ``batch_id``'s rows where no reader sees them; return the piece (JSON)
        that names what was staged, or None when nothing was."""
        raise NotImplementedError

    def pre_commit(self, checkpoint_id: int, pieces: list[dict[str, Any]]) -> dict[str, Any]:
        """At checkpoint ``checkpoint_id``'s barrier: the transaction (JSON, kept in the
        checkpoint) made of the pieces staged since the last one."""
        return {"pieces": pieces}

    def commit(self, checkpoint_id: int, txn: dict[str, Any]) -> None:
        """Make transaction ``txn`` visible once checkpoint ``checkpoint_id`` completed.
        Idempotent: it runs again after a crash between completion and commit."""
        raise NotImplementedError

    def abort(self, pieces: list[dict[str, Any]]) -> None:
        """Drop staged pieces (default: leave them; they are never made visible)."""

    def cleanup_staging(self) -> None:
        """After a restore committed the pending transactions: drop every staged piece of this
        lineage (no checkpoint references them any more)."""

    def chain_target(self, batch_id: int) -> str | None:
        """A fresh staging directory the stateful task upstream may write this batch's Parquet
        files into itself (operator chaining, no Spark job of its own); None: not chainable."""
        return None

    def chained_piece(self, batch_id: int, directory: str,
                      files: list[dict[str, Any]]) -> dict[str, Any] | None:
        """The piece for files a chained task wrote (``path``, ``size``, ``rows`` each)."""
        return None

    def committed_batch(self) -> int | None:
        """The last batch whose output this lineage has made visible, if the sink can tell.

        After a restore from a checkpoint older than the sink's last commit (a corrupt latest
        checkpoint, or a restore by id) the replayed batches up to this one skip the sink, so
        nothing shows twice. None: the sink cannot tell (its output may then repeat)."""
        return None

    def committed_checkpoint(self) -> int | None:
        """The highest checkpoint id of this lineage the sink has committed, if it can tell.

        A start numbers its checkpoints past it, as well as past its checkpoint store's: a
        commit keyed by an id the sink already holds would be taken as done and skipped (a
        store restored from an older copy has forgotten the ids its sinks used). None: the
        sink cannot tell."""
        return None


def last_batch(txn: dict[str, Any]) -> int:
    return max((int(p["batch"]) for p in txn.get("pieces", []) if "batch" in p), default=-1)


class SinkTransactions(CheckpointListener):
    """A sink's open pieces and pending transactions, on the driver.

    Threads: the scheduler's thread stages pieces; the coordinator's thread pre-commits at
    barriers and commits on notification. ``_lock`` guards ``open`` (``(batch, piece)`` in
    batch order) and ``pending``; pre-commits and commits run outside it, in checkpoint order,
    on the coordinator's thread only.
    """

    def __init__(self, sink: TwoPhaseCommitSink, pipeline: str) -> None:
        self.sink = sink
        self.pipeline = pipeline
        self._lock = threading.Lock()
        self.open: list[tuple[int, dict[str, Any]]] = []
        self.pending: dict[int, dict[str, Any]] = {}
        self.committed_through = 0

    def staged(self, batch_id: int, piece: dict[str, Any] | None) -> None:
        if piece is not None:
            with self._lock:
                self.open.append((batch_id, piece))

    def pre_commit(self, checkpoint_id: int, through_batch: int) -> dict[str, Any]:
        """At the barrier after ``through_batch``: the pieces open up to that batch become
        checkpoint ``checkpoint_id``'s transaction (later batches' pieces stay open). Returns
        the acknowledgement state: every transaction not yet committed."""
        with self._lock:
            taken = [p for p in self.open if p[0] <= through_batch]
            self.open = [p for p in self.open if p[0] > through_batch]
            if not taken:  # nothing staged since the last barrier: no transaction
                return {"pending": [[cid, t] for cid, t in sorted(self.pending.items())]}
        try:
            txn = self.sink.pre_commit(checkpoint_id, [piece for _, piece in taken])
        except BaseException:
            with self._lock:  # declined: the pieces wait for the next barrier
                self.open[:0] = taken
            raise
        with self._lock:
            self.pending[checkpoint_id] = txn
            return {"pending": [[cid, t] for cid, t in sorted(self.pending.items())]}

    def notify_checkpoint_complete(self, checkpoint_id: int) -> None:
        with self._lock:
            due = sorted((cid, t) for cid, t in self.pending.items() if cid <= checkpoint_id)
        for cid, txn in due:
            self.sink.commit(cid, txn)
            fault_point("checkpoint.sink.committed")
            with self._lock:
                self.pending.pop(cid, None)
                self.committed_through = max(self.committed_through, cid)
            log.info("Pipeline %s: sink %s committed checkpoint %d", self.pipeline,
                     self.sink.name, cid)

    def notify_checkpoint_aborted(self, checkpoint_id: int) -> None:
        # the transaction stays pending: the next completed checkpoint commits it
        log.info("Pipeline %s: sink %s keeps checkpoint %d's transaction for the next "
                 "checkpoint", self.pipeline, self.sink.name, checkpoint_id)

    def recover(self, pending: list[list[Any]]) -> None:
        """After a restart: commit the transactions the restored checkpoint left pending."""
        for cid, txn in sorted(pending, key=lambda p: p[0]):
            self.sink.commit(int(cid), txn)
            self.committed_through = max(self.committed_through, int(cid))
            log.info("Pipeline %s: sink %s committed checkpoint %d on restore", self.pipeline,
                     self.sink.name, cid)


def _files(pieces: list[dict[str, Any]]) -> list[OutputFile]:
    return [OutputFile.from_json(f) for p in pieces for f in p.get("files", [])]


class _FileTwoPhaseSink(TwoPhaseCommitSink):
    """Two-phase sinks whose pieces are Parquet files Spark (or a chained task) writes into a
    staging directory per batch."""

    def __init__(self, name: str, path: str, partition_by: Sequence[str],
                 ctx: PipelineScope) -> None:
        super().__init__(name)
        self.path = path
        self.partition_by = tuple(partition_by)
        self.store = Storage(path)
        self.ctx = ctx
        self._writer = _FileSink(name, path, partition_by, ctx)

    def describe(self) -> dict[str, Any]:
        return {"kind": self.kind, "path": self.path, "partition_by": list(self.partition_by)}

    def prepare(self, df: DataFrame) -> None:
        self._writer.check_columns(df)

    def _staging_dir(self, batch_id: int) -> str:
        return join(self.store.root, "_spark_ckpt_staging", self.lineage,
                    f"{self.name}-b{batch_id:012d}-{uuid.uuid4().hex[:12]}")

    def write(self, df: DataFrame, batch_id: int) -> dict[str, Any] | None:
        if _FileSink.provably_empty(df):
            return None
        directory = self._staging_dir(batch_id)
        self._writer.write_parquet(df, directory)
        files = staged_files(self.store, directory, self.name)
        return {"batch": batch_id, "dir": directory, "files": [f.to_json() for f in files]}

    def chain_target(self, batch_id: int) -> str | None:
        if self.partition_by:
            return None
        return self._staging_dir(batch_id)

    def chained_piece(self, batch_id: int, directory: str,
                      files: list[dict[str, Any]]) -> dict[str, Any] | None:
        if not files:
            return None
        staged = [OutputFile("sink", self.name, self.store.spark_path(self.store.fs_path(
            f["path"])), int(f["size"]), int(f["rows"])) for f in files]
        return {"batch": batch_id, "dir": directory, "files": [f.to_json() for f in staged]}

    def abort(self, pieces: list[dict[str, Any]]) -> None:
        for piece in pieces:
            self.store.delete_dir(self.store.fs_path(piece["dir"]))

    def cleanup_staging(self) -> None:
        staging = join(self.store.root, "_spark_ckpt_staging", self.lineage)
        for info in self.store.fs.get_file_info(_dirs(staging)):
            if _STAGED.match(info.base_name) and \
                    info.base_name.rsplit("-b", 1)[0] == self.name and \
                    (self.claimed_at is None or info.mtime is None or
                     info.mtime < self.claimed_at):
                self.store.delete_dir(info.path)


class DeltaTwoPhaseSink(_FileTwoPhaseSink):
    """A Delta table: Spark writes each batch's Parquet files into the table directory (not yet
    in the log); the commit adds a checkpoint's files in one Delta transaction carrying the app
    transaction ``(spark_ckpt/<pipeline>-<lineage id>/<output>, checkpoint id)``, checked first.

    ``merge_keys``: upsert instead of append. Each commit merges the transaction's rows (the
    last row per key wins, in batch order) into the table with delta-rs, keyed by
    ``merge_keys``: the sink for update streams of keyed aggregations.
    """

    kind = "delta"

    def __init__(self, name: str, path: str, partition_by: Sequence[str],
                 ctx: PipelineScope, merge_keys: Sequence[str] = ()) -> None:
        super().__init__(name, path, partition_by, ctx)
        self.merge_keys = tuple(merge_keys)
        self._delta: DeltaSink | None = None
        self._prepared: str | None = None

    def describe(self) -> dict[str, Any]:
        return super().describe() | {"merge_keys": list(self.merge_keys)}

    def delta(self) -> DeltaSink:
        if self._delta is None:
            if not self.lineage:
                raise JobDefinitionError(f"sink {self.name}: expected a started pipeline (it "
                                         "names the sink's transactions), found none")
            spec = SinkSpec(self.name, "delta", self.path, "append", self.partition_by)
            self._delta = DeltaSink(spec, f"{self.lineage}-2pc",  # apart from per-batch ids
                                    clock=getattr(self.ctx, "clock", None))
        return self._delta

    def prepare(self, df: DataFrame) -> None:
        self._writer.check_columns(df)
        missing = [k for k in self.merge_keys if k not in df.columns]
        if missing:
            raise JobDefinitionError(
                f"Delta sink {self.name}: merge keys {missing} are not columns of the stream; "
                f"its columns: {df.columns}"
            )
        schema = df.schema.json()
        if self._prepared != schema:
            self.delta().prepare(df.schema)
            self._prepared = schema

    def _staging_dir(self, batch_id: int) -> str:
        if self.merge_keys:  # rows to merge: outside the table
            return super()._staging_dir(batch_id)
        # files to add: inside the table directory, not yet in its log
        return join(self.store.root, "spark_ckpt_staged",
                    f"{self.lineage}-{self.name}-b{batch_id}-{uuid.uuid4().hex[:12]}")

    def pre_commit(self, checkpoint_id: int, pieces: list[dict[str, Any]]) -> dict[str, Any]:
        check_files(self.name, _files(pieces))
        return {"pieces": pieces}

    def commit(self, checkpoint_id: int, txn: dict[str, Any]) -> None:
        sink = self.delta()
        files = _files(txn["pieces"])
        if not files or sink.is_committed(checkpoint_id):
            return
        meta = {"spark_ckpt.app": sink.app_id, "spark_ckpt.last_batch": str(last_batch(txn))}
        if not self.merge_keys:
            sink.commit(files, checkpoint_id, metadata=meta)
            return
        self._merge(sink, files, checkpoint_id, meta)

    def committed_checkpoint(self) -> int | None:

        sink = self.delta()
        return sink.committed_version() if is_delta_table(sink.uri) else None

    def committed_batch(self) -> int | None:

        sink = self.delta()
        if not is_delta_table(sink.uri) or sink.committed_version() is None:
            return None  # no commit of this lineage: the table's history is not read
        batches = [int(h["spark_ckpt.last_batch"]) for h in delta_table(sink.uri).history()
                   if h.get("spark_ckpt.app") == sink.app_id and "spark_ckpt.last_batch" in h]
        return max(batches, default=None)

    def _merge(self, sink: DeltaSink, files: list[OutputFile], checkpoint_id: int,
               meta: dict[str, str]) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq
        from deltalake import CommitProperties, Transaction

        from spark_ckpt.storage import stat_any

        if any(size is None for size in stat_any(f.path for f in files)):
            missing = [f.path for f, size in zip(files, stat_any(f.path for f in files),
                                                 strict=True) if size is None]
            raise CommitError(f"Delta sink {self.name}: expected the staged rows of checkpoint "
                              f"{checkpoint_id}, found {len(missing)} file(s) missing (e.g. "
                              f"{missing[0]}); refusing to merge")
        tables = [pq.read_table(self.store.fs_path(f.path), filesystem=self.store.fs)
                  for f in files]
        rows = pa.concat_tables(tables, promote_options="default")
        rows = rows.append_column("__seq", pa.array(range(rows.num_rows), pa.int64()))
        last = rows.group_by(list(self.merge_keys)).aggregate([("__seq", "max")])
        rows = rows.take(last.column("__seq_max")).drop_columns(["__seq"])
        table = delta_table(sink.uri)
        rows = rows.cast(pa.schema(table.schema()))
        # null keys match; each comparison in parentheses (delta-rs parses
        # `a IS NOT DISTINCT FROM b AND c ...` as `a IS NOT DISTINCT FROM (b AND c ...)`)
        predicate = " AND ".join(f"(t.`{k}` IS NOT DISTINCT FROM s.`{k}`)"
                                 for k in self.merge_keys)
        (table.merge(rows, predicate, source_alias="s", target_alias="t",
                     commit_properties=CommitProperties(custom_metadata=meta, app_transactions=[
                         Transaction(app_id=sink.app_id, version=checkpoint_id)]))
         .when_matched_update_all().when_not_matched_insert_all().execute())
        for f in files:  # staged outside the table; gone once merged
            directory = self.store.fs_path(f.path).rsplit("/", 1)[0]
            self.store.delete_dir(directory)


class ParquetTwoPhaseSink(_FileTwoPhaseSink):
    """A Parquet directory: each batch is staged under
    ``_spark_ckpt_staging/<lineage>/b<batch>-<uuid>/``; the commit of checkpoint ``n`` creates
    ``_spark_ckpt_commits/<lineage>-<output>-c<n>.json`` if absent (only one driver can), moves
    the files into place and marks the marker committed; a crash in between is finished from
    the marker."""

    kind = "parquet"

    def _marker(self, checkpoint_id: int) -> str:
        return join(self.store.root, "_spark_ckpt_commits",
                    f"{self.lineage}-{self.name}-c{checkpoint_id:08d}.json")

    def pre_commit(self, checkpoint_id: int, pieces: list[dict[str, Any]]) -> dict[str, Any]:
        check_files(self.name, _files(pieces))
        moves = []
        for piece in pieces:
            # compared as file-system paths: a staging directory and its files may be recorded
            # as paths or as Spark URIs (s3a://, abfss://container@account..., file:)
            prefix = self.store.fs_path(piece["dir"]).rstrip("/") + "/"
            for f in piece["files"]:
                src = self.store.fs_path(f["path"])
                if not src.startswith(prefix):
                    raise CommitError(
                        f"Parquet sink {self.name}: expected staged file {f['path']} under its "
                        f"staging directory {piece['dir']}, found it elsewhere; refusing to "
                        "move it")
                moves.append([src, join(self.store.root, src[len(prefix):])])
        return {"moves": moves, "dirs": [self.store.fs_path(p["dir"]) for p in pieces],
                "last_batch": max((int(p["batch"]) for p in pieces), default=-1)}

    def commit(self, checkpoint_id: int, txn: dict[str, Any]) -> None:
        if not txn["moves"]:
            return
        marker = self._marker(checkpoint_id)
        body = {"lineage": self.lineage, "checkpoint_id": checkpoint_id,
                "status": "committing", "moves": txn["moves"],
                "last_batch": txn.get("last_batch", -1)}
        moves = txn["moves"]
        if not self.store.create_exclusive(marker, dump_record("parquet-sink-commit", 1, body)):
            existing = load_record(self.store.read_bytes(marker), "parquet-sink-commit", (1,))
            if existing["status"] == "committed":
                return
            moves = existing["moves"]  # finish the commit an earlier driver began
            body = existing
        for i, (src, dst) in enumerate(moves):
            if self.store.exists(src):
                self.store.move(src, dst)
            elif not self.store.exists(dst):
                raise CommitError(
                    f"Parquet sink {self.name}: checkpoint {checkpoint_id} lost {src}; it is "
                    f"neither staged nor at {dst}"
                )
            if i == 0:
                fault_point("sink.commit.files")
        self.store.write_atomic(marker, dump_record("parquet-sink-commit", 1,
                                                    body | {"status": "committed"}))
        for directory in txn["dirs"]:
            self.store.delete_dir(self.store.fs_path(directory))

    def _markers(self) -> list[str]:
        prefix = f"{self.lineage}-{self.name}-c"
        return [info.path for info in self.store.list_files(
            join(self.store.root, "_spark_ckpt_commits"), recursive=False)
            if info.base_name.startswith(prefix) and info.base_name.endswith(".json")]

    def committed_checkpoint(self) -> int | None:
        # a marker still "committing" counts: whoever reads it next finishes its commit
        ids = [int(path.rsplit("-c", 1)[1].removesuffix(".json")) for path in self._markers()]
        return max(ids, default=None)

    def committed_batch(self) -> int | None:
        best: int | None = None
        for path in self._markers():
            record = load_record(self.store.read_bytes(path), "parquet-sink-commit", (1,))
            if record["status"] != "committed":  # a crash mid-commit: finish it first
                self.commit(int(record["checkpoint_id"]),
                            {"moves": record["moves"], "dirs": [],
                             "last_batch": record["last_batch"]})
            best = max(best if best is not None else -1, int(record["last_batch"]))
        return best


_STAGED = re.compile(r"^.+-b\d{12}-[0-9a-f]{12}$")


def _dirs(path: str) -> Any:
    import pyarrow.fs as pafs

    return pafs.FileSelector(path, allow_not_found=True, recursive=False)
