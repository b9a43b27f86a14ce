"""Records of run units (batch.unit_records): what a Spark Connect driver writes before its
writes start, read back by the next attempt. The adoption itself runs on a real Connect server:
tests/test_recovery_faults.py (through tests/test_connect.py)."""

from __future__ import annotations

import json

from spark_ckpt.batch.unit_records import UnitRecord, load_units, units_dir, write_unit
from spark_ckpt.clock import ManualClock
from spark_ckpt.storage import Storage


def _record(attempt: int = 1, number: int = 0, **changes: object) -> UnitRecord:
    fields = dict(attempt=attempt, vertex="settled", number=number,
                  tag=f"a{attempt}-u{number}-0123abcd", parts=(0, 1, 2, 3),
                  operations=("6f1c1c2e-3b0a-4d8e-9a43-4c0f5b1e2d3a",),
                  lineage="ab" * 16, schema='{"type":"struct","fields":[]}',
                  session="5a0e6a44-8f1e-4e0b-9d53-1f3a7c2b9e10", user="etl", per_task=True)
    fields.update(changes)
    return UnitRecord(**fields)  # type: ignore[arg-type]


def test_a_unit_record_reads_back_as_written_for_the_attempts_asked(tmp_path):
    storage = Storage(str(tmp_path))
    job = storage.path("orders")
    first, second, later = _record(1, 0), _record(1, 1, parts=(2,)), _record(3, 0)
    for record in (first, second, later):
        write_unit(storage, job, record)
    assert load_units(storage, job, {1}) == [first, second]
    assert load_units(storage, job, {2}) == []
    assert load_units(storage, job, {1, 3}) == [first, second, later]
    assert load_units(storage, str(tmp_path / "no-such-job"), {1}) == []


def test_a_unit_laid_out_by_position_says_so_and_an_older_record_reads_as_by_partition(
        tmp_path):
    """Version 2 records say whether Spark partition i of the unit's writes held partition
    parts[i] (a re-run of a few partitions); a version 1 record, written before that layout
    existed, reads as Spark partition j holding partition j."""
    storage = Storage(str(tmp_path))
    job = storage.path("orders")
    positional = _record(1, 0, parts=(2, 5), positional=True)
    write_unit(storage, job, positional)
    directory = tmp_path / "orders" / "units"
    body = json.loads((directory / "00001-u0-settled.json").read_text())
    assert body["format_version"] == 2 and body["positional"] is True
    older = {k: v for k, v in body.items() if k != "positional"}
    older.update(format_version=1, number=1, tag="a1-u1-0123abcd")
    (directory / "00001-u1-settled.json").write_text(json.dumps(older))
    assert load_units(storage, job, {1}) == [
        positional, _record(1, 1, parts=(2, 5), positional=False)]


def test_a_record_that_cannot_be_trusted_is_skipped_and_its_partitions_run_again(tmp_path, caplog):
    storage = Storage(str(tmp_path))
    job = storage.path("orders")
    good = _record(1, 0)
    write_unit(storage, job, good)
    write_unit(storage, job, _record(1, 1, tag="../../elsewhere"))  # a path, not a tag
    directory = tmp_path / "orders" / "units"
    (directory / "00001-u2-settled.json").write_text("{torn")
    body = json.loads((directory / "00001-u0-settled.json").read_text())
    body["parts"] = [-1]
    (directory / "00001-u3-settled.json").write_text(json.dumps(body))
    body = {**body, "parts": [0], "format_version": 99}
    (directory / "00001-u4-settled.json").write_text(json.dumps(body))
    assert load_units(storage, job, {1}) == [good]
    skipped = [r.getMessage() for r in caplog.records if "Unreadable record" in r.getMessage()]
    assert len(skipped) == 4, skipped
    assert any("elsewhere" in m for m in skipped) and any("parts" in m for m in skipped)
    assert units_dir(job).endswith("/orders/units")


class _RpcError(Exception):
    """What a gRPC stream raises: grpc.RpcError with a status code and details."""

    def __init__(self, code, details: str) -> None:
        import grpc

        assert isinstance(code, grpc.StatusCode)
        super().__init__(details)
        self._code, self._details = code, details

    def code(self):
        return self._code

    def details(self) -> str:
        return self._details


def _await_with(monkeypatch, streams, statuses=(), clock=None):
    """ConnectSpark.await_operation over a fake second client: each ReattachExecute call
    takes the next of ``streams`` (a list of responses, or an exception to raise); each
    GetStatus call the next of ``statuses`` (an OperationState, or None: not listed)."""
    import grpc
    from pyspark.sql.connect.proto import base_pb2 as pb2

    from spark_ckpt.sparkapi.connect import ConnectSpark

    class RpcError(_RpcError, grpc.RpcError):
        pass

    calls = {"reattach": 0, "status": 0, "closed": 0}
    streams, statuses = list(streams), list(statuses)

    class Stub:
        def ReattachExecute(self, request, metadata=None, timeout=None):
            assert request.operation_id == "op-1" and request.session_id == "old-session"
            assert timeout is not None and timeout > 0
            calls["reattach"] += 1
            item = streams.pop(0)
            if isinstance(item, tuple):
                raise RpcError(*item)
            return iter(item)

    class Builder:
        userAgent = "test"

        def metadata(self):
            return []

    class Client:
        _stub, _builder, _user_id = Stub(), Builder(), "etl"

        def _get_operation_statuses(self, ids):
            calls["status"] += 1
            state = statuses.pop(0)
            listed = [] if state is None else [
                pb2.GetStatusResponse.OperationStatus(operation_id="op-1", state=state)]
            return pb2.GetStatusResponse(operation_statuses=listed)

        def close(self):
            calls["closed"] += 1

    api = ConnectSpark(spark=None)
    monkeypatch.setattr(api, "_client_of", lambda session, user: Client())
    clock = clock or ManualClock(sleep_advances=True)  # a retry's sleep costs no real time
    return api.await_operation("old-session", "etl", "op-1", 60.0, clock=clock), calls


def test_waiting_for_a_killed_clients_operation_tells_each_end_apart(monkeypatch):
    import grpc
    from pyspark.sql.connect.proto import base_pb2 as pb2

    complete = pb2.ExecutePlanResponse(result_complete=pb2.ExecutePlanResponse.ResultComplete())
    progress = pb2.ExecutePlanResponse(operation_id="op-1")
    states = pb2.GetStatusResponse.OperationStatus.OperationState
    internal, unavailable = grpc.StatusCode.INTERNAL, grpc.StatusCode.UNAVAILABLE
    cases = [
        # the stream reaches the result; a stream ended early (the server's longest) again
        ([[progress, complete]], (), "succeeded", 1),
        ([[progress], [complete]], (), "succeeded", 2),
        # the server restarting: retried; its error: failed; no such operation: gone
        ([(unavailable, "connection refused"), [complete]], (), "succeeded", 2),
        ([(internal, "[TASK_FAILED] Job aborted")], (), "failed", 1),
        ([(internal, "[INVALID_HANDLE.OPERATION_NOT_FOUND] op-1")], (), "gone", 1),
        ([(internal, "[INVALID_HANDLE.SESSION_CLOSED] old-session")], (), "gone", 1),
        ([(internal, "[INVALID_HANDLE.OPERATION_ABANDONED] op-1")], (), "gone", 1),
        # responses released by the killed client: its status, polled until it ends
        ([(internal, "[INVALID_CURSOR.POSITION_NOT_AVAILABLE]")],
         (states.OPERATION_STATE_RUNNING, states.OPERATION_STATE_SUCCEEDED), "succeeded", 1),
        ([(internal, "[INVALID_CURSOR.POSITION_NOT_AVAILABLE]")],
         (states.OPERATION_STATE_RUNNING, states.OPERATION_STATE_TERMINATING), "ended", 1),
        ([(internal, "[INVALID_CURSOR.POSITION_NOT_AVAILABLE]")],
         (states.OPERATION_STATE_CANCELLED,), "failed", 1),
        ([(internal, "[INVALID_CURSOR.POSITION_NOT_AVAILABLE]")], (None,), "gone", 1),
    ]
    for streams, statuses, expected, reattached in cases:
        got, calls = _await_with(monkeypatch, streams, statuses)
        assert (got, calls["reattach"]) == (expected, reattached), (streams, statuses)
        assert calls["status"] == len(statuses) and calls["closed"] == 1


def test_a_wait_that_outlasts_its_time_says_still_running(monkeypatch):
    import grpc

    class Jumps(ManualClock):  # the reattach outlasts the whole wait
        readings = iter([0.0, 0.0, 100.0, 100.0])

        def monotonic_s(self):
            return next(self.readings)

    got, calls = _await_with(monkeypatch, [(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline")],
                             clock=Jumps())
    assert got == "running" and calls["reattach"] == 1
