"""Receiver-based sources: data that cannot be replayed is written ahead before it counts.

A receiver (an in-process queue, a TCP socket) hands what it got to a :class:`BlockStore`,
which writes it as one Parquet *block* under ``<checkpoint>/receivedData/<source>/`` (atomically:
a block is whole or absent) and only then reports it received. The ReceiverTracker allocates
every block received since the previous batch to the next batch and records the block ids in
the allocation, so a restarted driver reads exactly those blocks again; blocks received but not
yet allocated are found by listing the directory and go to the first batch after the restart.

Receivers run as threads of the driver (not on executors as in Spark Streaming): the blocks are
durable before they count, so losing the driver loses nothing that was acknowledged.
"""

from __future__ import annotations

import logging
import socket
import threading
from typing import TYPE_CHECKING, Any, cast

from spark_ckpt.errors import JobDefinitionError, RecordError, SourceError
from spark_ckpt.formats import PATH, ListOf, Row, integer
from spark_ckpt.sources.source import Source, SourceRun
from spark_ckpt.storage import join

if TYPE_CHECKING:
    from pyspark.sql import DataFrame
    from pyspark.sql.types import StructType

    from spark_ckpt.sources.source import SourceScope

__all__ = ["BlockStore", "QueueSource", "ReceiverSource", "SocketSource"]

log = logging.getLogger(__name__)


class BlockStore:
    """The write-ahead log of one receiver: ``<seq, 12 digits>.parquet`` files."""

    def __init__(self, storage: Any, directory: str) -> None:
        self.storage = storage
        self.directory = directory
        storage.makedirs(directory)
        self.next_seq = max((seq for seq, _path in self._files()), default=-1) + 1

    def _files(self) -> list[tuple[int, str]]:
        """Every complete block as ``(seq, file-system path)``, in order, from names alone."""
        out = []
        for info in self.storage.list_files(self.directory, recursive=False):
            name = info.base_name
            if name.endswith(".parquet") and name[:12].isdigit() and len(name) == 20:
                out.append((int(name[:12]), info.path))
        return sorted(out)

    def path(self, seq: int) -> str:
        """Where block ``seq`` is, as recorded in allocations."""
        return self.storage.spark_path(join(self.directory, f"{seq:012d}.parquet"))

    def blocks(self, schema: Any = None) -> list[tuple[int, str, int]]:
        """Every complete block as ``(seq, path, rows)``, in order (reads each footer); with
        ``schema`` (Arrow), a block whose columns differ is refused (a hand edit)."""
        import pyarrow.parquet as pq

        out = []
        for seq, path in self._files():
            meta = pq.read_metadata(path, filesystem=self.storage.fs)
            found = meta.schema.to_arrow_schema()
            if schema is not None and [(f.name, f.type) for f in found] != \
                    [(f.name, f.type) for f in schema]:
                raise RecordError(
                    f"{self.storage.spark_path(path)}: receiver block columns: expected "
                    f"{[f'{f.name} {f.type}' for f in schema]}, found "
                    f"{[f'{f.name} {f.type}' for f in found]}; restore the file (nothing was "
                    "run from it)"
                )
            out.append((seq, self.storage.spark_path(path), meta.num_rows))
        return out

    def append(self, table: Any) -> tuple[int, str, int]:
        """Write ``table`` as the next block; return ``(seq, path, rows)`` once it is durable.

        The caller holds the receiver's lock: numbering, writing and counting a block as
        received are one step, so blocks become pending in sequence order."""
        import pyarrow as pa
        import pyarrow.parquet as pq

        buffer = pa.BufferOutputStream()
        pq.write_table(table, buffer, compression="zstd")
        seq = self.next_seq
        path = join(self.directory, f"{seq:012d}.parquet")
        self.storage.write_atomic(path, buffer.getvalue().to_pybytes())
        self.next_seq += 1  # only once written: a failed write leaves no hole in the numbers
        return seq, self.storage.spark_path(path), table.num_rows

    def delete_through(self, seq: int) -> int:
        gone = 0
        for s, path in self._files():
            if s > seq:
                break
            self.storage.fs.delete_file(path)
            gone += 1
        return gone


class ReceiverSource(Source):
    """A source whose batches are the blocks its receiver wrote ahead."""

    kind = "receiver"
    PIECE = {"blocks": ListOf(Row(integer(0), PATH, integer(0))), "rows": integer(0)}

    def __init__(self, name: str, schema: StructType | str) -> None:
        from pyspark.sql.types import StructType

        super().__init__(name)
        self._schema = cast(StructType, StructType.fromDDL(schema)) if isinstance(schema, str) \
            else schema
        self.store: BlockStore | None = None
        # Thread ownership: receivers and push() (any thread) add blocks, the generator plans
        # and advances, restore runs before any of them; ``_lock`` guards the block store's
        # numbering, ``_pending`` and ``allocated_through``. Blocks become pending in sequence
        # order, so what batches take is always a prefix of the numbers.
        self.allocated_through = -1  # highest block seq given to a batch
        self._pending: list[tuple[int, str, int]] = []
        self._lock = threading.Lock()
        self.received_rows = 0

    def schema(self) -> StructType:
        return self._schema

    def bind(self, pipeline: SourceScope) -> None:
        super().bind(pipeline)
        self.store = BlockStore(pipeline.storage, join(pipeline.root, "receivedData", self.name))

    def _check_places(self, piece: dict[str, Any], field: str) -> None:
        # A block is read by its number from this checkpoint directory's write-ahead log, so a
        # copy of the directory at another path or URI reads its own blocks: the recorded path
        # must name block ``seq`` of this source's log, wherever that log was then.
        assert self.store is not None
        for i, (seq, path, _rows) in enumerate(piece["blocks"]):
            expected = self.store.path(seq)
            tail = f"/receivedData/{self.name}/{seq:012d}.parquet"
            if path != expected and not str(path).endswith(tail):
                raise RecordError(f"field {field}.blocks[{i}][1]: expected block {seq} at "
                                  f"{expected}, found {path!r}")

    def restore(self, pieces: list[tuple[int, dict[str, Any]]]) -> None:
        from spark_ckpt.arrowtypes import to_arrow

        assert self.store is not None
        taken = {b[0] for _batch, piece in pieces for b in piece["blocks"]}
        with self._lock:
            self.allocated_through = max(taken, default=self.allocated_through)
            # every block no recorded batch took and not below a purged one (purged batches'
            # blocks are deleted with them, through the highest seq they took)
            blocks = self.store.blocks(to_arrow(self._schema))
            purged = self._purged_through(taken)
            self._pending = [b for b in blocks if b[0] not in taken and b[0] > purged]
        if self._pending:
            log.info("Source %s: %d block(s) received before the restart await a batch",
                     self.name, len(self._pending))

    def store_block(self, table: Any) -> int:
        """Write a block ahead; it counts as received when this returns."""
        from spark_ckpt.arrowtypes import to_arrow

        assert self.store is not None, "source is not bound to a pipeline"
        expected = to_arrow(self._schema)
        try:
            table = table.select(expected.names).cast(expected)
        except Exception as exc:
            raise SourceError(
                f"receiver {self.name}: expected rows of {self._schema.simpleString()}, found "
                f"{table.schema}: {exc}"
            ) from exc
        from spark_ckpt import faults

        with self._lock:
            block = self.store.append(table)
            faults.fault_point("stream.block.stored")
            self._pending.append(block)
            self.received_rows += block[2]
        return block[0]

    def plan(self) -> dict[str, Any]:
        with self._lock:
            blocks = [list(b) for b in self._pending]
        return {"blocks": blocks, "rows": sum(b[2] for b in blocks)}

    def advance(self, piece: dict[str, Any]) -> None:
        """Move past exactly the blocks ``piece`` took (blocks received since stay pending)."""
        taken = {b[0] for b in piece["blocks"]}
        if not taken:
            return
        with self._lock:
            self._pending = [b for b in self._pending if b[0] not in taken]
            self.allocated_through = max(self.allocated_through, *taken)

    def _purged_through(self, taken: set[int]) -> int:
        """Blocks below the oldest block a kept allocation took belong to purged batches (a
        purge that failed half-way can leave some of their files behind)."""
        return min(taken) - 1 if taken else -1

    def position(self) -> dict[str, Any]:
        with self._lock:
            return {"allocated_through": self.allocated_through, "pending_blocks":
                    len(self._pending)}

    def is_empty(self, piece: dict[str, Any]) -> bool:
        return not piece["blocks"]

    def read(self, run: SourceRun, piece: dict[str, Any]) -> DataFrame:
        if not piece["blocks"]:
            return self.empty(run.spark)
        assert self.store is not None
        return run.spark.read.schema(self._schema).parquet(
            *[self.store.path(b[0]) for b in piece["blocks"]])  # here, wherever it was written

    def purge(self, pieces_below: list[tuple[int, dict[str, Any]]], below: int) -> None:
        last = max((b[0] for _b, p in pieces_below for b in p["blocks"]), default=-1)
        if last >= 0 and self.store is not None:
            self.store.delete_through(last)


class QueueSource(ReceiverSource):
    """An in-process queue: ``push`` rows, a pandas DataFrame or an Arrow table.

    ``push`` returns the block's sequence number once the block is in the write-ahead log.
    """

    kind = "queue"

    def push(self, data: Any) -> int:
        import pyarrow as pa

        from spark_ckpt.arrowtypes import to_arrow

        expected = to_arrow(self._schema)
        if isinstance(data, pa.Table):
            table = data
        elif hasattr(data, "to_dict") and hasattr(data, "columns"):  # pandas
            table = pa.Table.from_pandas(data, preserve_index=False)
        else:
            try:
                rows = [r if isinstance(r, dict) else dict(zip(expected.names, r, strict=True))
                        for r in data]
                table = pa.Table.from_pylist(rows, schema=expected)
            except Exception as exc:
                raise SourceError(
                    f"queue {self.name}: expected rows of {self._schema.simpleString()}, "
                    f"cannot convert them: {exc}"
                ) from exc
        return self.store_block(table)


class SocketSource(ReceiverSource):
    """Text lines from a TCP server (``value STRING``), as Spark's ``socketTextStream``.

    A thread connects, reconnects after a failure, and writes what it read as a block every
    ``spark.ckpt.stream.receiverBlockIntervalMs``.
    """

    kind = "socket"

    def __init__(self, name: str, host: str, port: int) -> None:
        super().__init__(name, "value STRING")
        if not 0 < int(port) < 65536:
            raise JobDefinitionError(f"socket source {name}: expected a port 1-65535, found "
                                     f"{port!r}")
        self.host = host
        self.port = int(port)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None
        self.cut_lines = 0  # lines longer than receiverMaxLineBytes, emitted in pieces

    def describe(self) -> dict[str, Any]:
        return {"kind": self.kind, "host": self.host, "port": self.port}

    def start(self) -> None:
        self._thread = threading.Thread(target=self._receive, name=f"spark-ckpt-recv-{self.name}",
                                        daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def _flush(self, lines: list[str]) -> None:
        import pyarrow as pa

        if lines:
            self.store_block(pa.table({"value": pa.array(lines, pa.string())}))
            lines.clear()

    def _receive(self) -> None:
        interval = self.pipeline.settings.stream_receiver_block_interval_ms / 1000.0
        backoff = 0.1
        while not self._stop.is_set():
            try:
                with socket.create_connection((self.host, self.port), timeout=interval) as conn:
                    backoff = 0.1
                    self._read(conn, interval)
            except OSError as exc:
                if self._stop.is_set():
                    return
                log.warning("Receiver %s: %s:%d: %s; reconnecting in %.1f s", self.name,
                            self.host, self.port, exc, backoff)
                self._stop.wait(backoff)
                backoff = min(backoff * 2, 5.0)

    def _read(self, conn: socket.socket, interval: float) -> None:
        settings = self.pipeline.settings
        splitter = LineSplitter(settings.stream_receiver_max_line_bytes)
        max_block = settings.stream_receiver_max_block_bytes
        lines: list[str] = []
        held = 0
        warned = 0
        last = self.clock.monotonic_s()
        try:
            while not self._stop.is_set():
                try:
                    chunk = conn.recv(65536)
                except TimeoutError:
                    chunk = None
                if chunk == b"":  # closed by the server
                    lines.extend(splitter.close())
                    self._flush(lines)
                    raise ConnectionResetError("server closed the connection")
                if chunk:
                    for line in splitter.feed(chunk):
                        lines.append(line)
                        held += len(line)
                    if splitter.cut_lines > warned:  # said when it happens, not at the end
                        warned = splitter.cut_lines
                        log.warning("Receiver %s: a line longer than spark.ckpt.stream."
                                    "receiverMaxLineBytes=%d is emitted in pieces of at most "
                                    "that many bytes (%d line(s) so far); raise the option to "
                                    "receive such lines whole", self.name, splitter.limit,
                                    warned)
                if held >= max_block or self.clock.monotonic_s() - last >= interval:
                    self._flush(lines)
                    held = 0
                    last = self.clock.monotonic_s()
            self._flush(lines)
        finally:
            self.cut_lines += splitter.cut_lines


class LineSplitter:
    """Bytes in, text lines out: ``\n`` ends a line (a ``\r`` before it is dropped, as
    Spark's socket source does), and a line longer than ``limit`` bytes comes out in pieces
    of at most ``limit`` bytes, cut between UTF-8 characters, so memory stays bounded and no
    byte is lost or mangled."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._buffer = b""
        self._cutting = False  # the current line already gave out a piece
        self.cut_lines = 0

    def feed(self, chunk: bytes) -> list[str]:
        out: list[str] = []
        self._buffer += chunk
        while True:
            end = self._buffer.find(b"\n")
            if end >= 0:
                content = end - 1 if self._buffer[end - 1:end] == b"\r" else end
                if content <= self.limit:
                    out.append(_decode(self._buffer[:content]))
                    self._buffer = self._buffer[end + 1:]
                    self._cutting = False
                    continue
            elif len(self._buffer) <= self.limit + 1:  # + 1: a "\r" whose "\n" is to come
                return out
            # this line is longer than the limit: give out a piece, cut between characters
            cut = self.limit
            while cut > 0 and (self._buffer[cut] & 0xC0) == 0x80:
                cut -= 1
            cut = cut or self.limit
            out.append(_decode(self._buffer[:cut]))
            self._buffer = self._buffer[cut:]
            if not self._cutting:
                self._cutting = True
                self.cut_lines += 1

    def close(self) -> list[str]:
        """What is left when the connection ends: the last line, without its newline."""
        rest, self._buffer = self._buffer, b""
        return [_decode(rest[:-1] if rest.endswith(b"\r") else rest)] if rest else []


def _decode(data: bytes) -> str:
    return data.decode("utf-8", errors="replace")
