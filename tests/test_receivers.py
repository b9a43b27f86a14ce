"""Receiver sources: every acknowledged block is read exactly once, whatever the threads and
restarts; socket lines are bounded without losing a byte."""

from __future__ import annotations

import random
import socket
import threading
from types import SimpleNamespace

import pyarrow.parquet as pq
import pytest
from helpers import wait_for

from spark_ckpt import Settings
from spark_ckpt.storage import Storage
from spark_ckpt.sources.receivers import QueueSource, SocketSource


def bound(source, tmp_path, **settings):
    storage = Storage(str(tmp_path / "ckpt"))
    source.bind(SimpleNamespace(storage=storage, root=storage.root,
                                settings=Settings(progress="never", **settings)))
    return source


def queue(tmp_path):
    return bound(QueueSource("q", "id BIGINT"), tmp_path)


def ids_of(blocks):
    return sorted(i for b in blocks for i in pq.read_table(b[1]).column("id").to_pylist())


def allocate(source, pieces):
    piece = source.plan()
    pieces.append((len(pieces), piece))
    source.advance(piece)


def test_a_block_acknowledged_late_is_not_lost_by_a_restart(spark, tmp_path, monkeypatch):
    monkeypatch.setenv("SPARK_CKPT_FAULT", "stream.block.stored:1:pause")
    monkeypatch.setenv("SPARK_CKPT_FAULT_PAUSE_S", "1.5")
    source = queue(tmp_path)
    slow = threading.Thread(target=source.push, args=([(i,) for i in range(10)],))
    slow.start()  # block 0 is written, then its push pauses before it counts as received
    first = tmp_path / "ckpt" / "receivedData" / "q" / f"{0:012d}.parquet"
    assert wait_for(first.exists, 30, 0.02)
    source.push([(i,) for i in range(10, 20)])  # block 1, acknowledged
    pieces: list = []
    allocate(source, pieces)  # a batch is allocated while block 0 may still be in flight
    slow.join(30)
    allocate(source, pieces)
    taken = [b for _, p in pieces for b in p["blocks"]]
    # a restart after the allocations: what the batches took plus what the restored source
    # still has pending is every acknowledged row, once
    restarted = queue(tmp_path)
    restarted.restore(pieces[:1])  # the crash came after the first allocation only
    again = restarted.plan()["blocks"]
    assert ids_of([b for _, p in pieces[:1] for b in p["blocks"]] + again) == list(range(20))
    assert ids_of(taken) == list(range(20))


def test_many_pushing_threads_against_an_allocator_then_a_restart(spark, tmp_path,
                                                                  monkeypatch):
    # every push lingers 0-10 ms between its write and counting as received (storage that is
    # slow to answer): a wide window for pushes to overtake each other around an allocation
    from spark_ckpt import faults

    jitter = random.Random(7)
    real = faults.fault_point

    def slow_storage(name):
        if name == "stream.block.stored":
            threading.Event().wait(jitter.uniform(0, 0.01))
        real(name)

    monkeypatch.setattr(faults, "fault_point", slow_storage)
    source = queue(tmp_path)
    pushers, per_thread = 8, 10
    stop = threading.Event()
    pieces: list = []
    errors: list[BaseException] = []

    def push(t):
        try:
            for n in range(per_thread):
                source.push([(t * 1000 + n,)])
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    def allocator():  # a generator ticking every 3 ms
        while not stop.wait(0.003):
            allocate(source, pieces)
        allocate(source, pieces)

    alloc = threading.Thread(target=allocator)
    alloc.start()
    threads = [threading.Thread(target=push, args=(t,)) for t in range(pushers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    stop.set()
    alloc.join(60)
    assert not errors
    want = sorted(t * 1000 + n for t in range(pushers) for n in range(per_thread))
    rows = {b[0]: pq.read_table(b[1]).column("id").to_pylist()
            for _, p in pieces for b in p["blocks"]}
    assert sorted(i for r in rows.values() for i in r) == want  # each block allocated once
    # a crash after any allocation: what was allocated plus what a restart finds pending
    crash_points = [i + 1 for i, (_, p) in enumerate(pieces) if p["blocks"]]
    for crash_after in crash_points:
        restarted = queue(tmp_path)
        restarted.restore(pieces[:crash_after])
        seqs = [b[0] for _, p in pieces[:crash_after] for b in p["blocks"]]
        seqs += [b[0] for b in restarted.plan()["blocks"]]
        assert sorted(i for q in seqs for i in rows[q]) == want, crash_after


# -- the socket receiver -------------------------------------------------------------------
@pytest.mark.parametrize("limit", [7, 1 << 20])
def test_socket_lines_are_bounded_cut_on_characters_and_never_dropped(spark, tmp_path, limit):
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    long_line = "é" * 20 + "x" * 5  # 45 bytes: a cut every 7 bytes falls inside a character
    payload = f"short\r\n{long_line}\r\nlast\n".encode()
    received: list[str] = []
    source = bound(SocketSource("s", "127.0.0.1", server.getsockname()[1]), tmp_path,
                   stream_receiver_block_interval_ms=50, stream_receiver_max_line_bytes=limit)
    done = threading.Event()

    def serve():
        conn, _ = server.accept()
        with conn:
            conn.sendall(payload)
            done.wait(30)

    threading.Thread(target=serve, daemon=True).start()
    source.start()
    try:
        def lines():
            blocks = source.plan()["blocks"]
            received[:] = [v for b in blocks for v in pq.read_table(b[1]).column("value")
                           .to_pylist()]
            return received and received[-1] == "last"
        assert wait_for(lines, 30, 0.02)
    finally:
        done.set()
        source.stop()
        server.close()
    assert received[0] == "short"
    assert "".join(received[1:-1]) == long_line  # every byte, in order, no replacement char
    if limit == 7:
        assert len(received) > 3
        assert all(len(p.encode()) <= limit for p in received[1:-1])
    else:
        assert received == ["short", long_line, "last"]
