"""``spark-ckpt stop CKPT_DIR``: a running driver, asked from another process, finishes its
batch, takes a final checkpoint, commits and exits; the client prints the checkpoint id.

One chain of real driver processes (``jobs/stateful_counts.py``: keyed state, barrier
checkpoints, two-phase Delta sinks) on one checkpoint directory, SIGKILLed at each point of
a stop, each kill followed by the next driver:

1. A takes the request and is killed before acting on it (``stream.stop.requested``);
2. B answers that stale request ``abandoned`` (and runs on), takes a second one, completes its
   final checkpoint and is killed before answering (``stream.stop.checkpointed``);
3. C answers that one ``abandoned``, restores B's final checkpoint, takes a third request,
   answers it ``stopped`` with its checkpoint id, and is killed before exiting
   (``stream.stop.answered``): the client has the id;
4. a request made while no driver runs: D answers it ``abandoned``, restores C's final
   checkpoint by default (the newest), and is stopped with no fault: it exits 0 and what is
   committed is exactly the batches up to its final checkpoint's barrier, each id once with
   every key's sequence unbroken (Flink's exactly-once check).

CI starts with B (C answers the request a killed B took ``abandoned``, as B answers A's);
A runs with SPARK_CKPT_LONG_FAULTS=1.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import LONG_FAULTS, ROOT, child_env, kill_group, wait_for
from test_stream_drivers import events, rows_by_batch, stateful_command

from spark_ckpt.storage.delta_reader import read_delta

pytestmark = pytest.mark.slow

SLOW = 300


class Driver:
    def __init__(self, name: str, tmp_path: Path, fault: str | None = None) -> None:
        self.name = name
        self.log = tmp_path / f"{name}.log"
        # a source that outlasts the test (batches of 200 ids every 0.2 s): only a stop ends it
        cmd = stateful_command(tmp_path, available_now=False, checkpoint_ms=500)
        cmd[cmd.index("--total-rows") + 1] = "10000000"
        with open(self.log, "w") as out:
            self.proc = subprocess.Popen(
                cmd, env=child_env(fault), stdout=out,
                stderr=subprocess.STDOUT, text=True, start_new_session=True, cwd=ROOT)

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def completed_checkpoints(self) -> list[int]:
        return [int(m) for m in re.findall(r"CHECKPOINT id=(\d+) status=completed", self.text())]

    def wait_checkpoints(self, n: int) -> None:
        if not wait_for(lambda: len(self.completed_checkpoints()) >= n
                        or self.proc.poll() is not None, SLOW):
            pytest.fail(f"{self.name}: fewer than {n} checkpoints in {SLOW} s:\n"
                        f"{self.text()[-3000:]}")
        assert self.proc.poll() is None, f"{self.name} exited:\n{self.text()[-3000:]}"

    def wait(self) -> int:
        try:
            return self.proc.wait(timeout=SLOW)
        except subprocess.TimeoutExpired:
            pytest.fail(f"{self.name} still running after {SLOW} s:\n{self.text()[-3000:]}")


def stop_client(tmp_path: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "spark_ckpt.ops.cli", "stop",
                             str(tmp_path / "ckpt"), "--json", "--timeout", str(SLOW)],
                            env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=ROOT)


def answer_of(client: subprocess.Popen) -> tuple[int, dict]:
    out, err = client.communicate(timeout=SLOW + 60)
    try:
        return client.returncode, json.loads(out)
    except ValueError:
        pytest.fail(f"stop printed no JSON answer (exit {client.returncode}):\n{out}\n{err}")


def restored(driver: Driver) -> int | None:
    found = re.search(r"restored checkpoint (\d+)", driver.text())
    return int(found.group(1)) if found else None


@pytest.mark.timeout(1500)
def test_stop_with_a_final_checkpoint_under_a_kill_at_each_point(tmp_path):
    drivers: list[Driver] = []
    clients: list[subprocess.Popen] = []

    def start(name: str, fault: str | None = None) -> Driver:
        drivers.append(Driver(name, tmp_path, fault))
        return drivers[-1]

    try:
        # 1. A takes the request and dies before acting on it
        # CI keeps B, C, D (C answers a dead B's request as B A's); A with SPARK_CKPT_LONG_FAULTS=1
        if LONG_FAULTS:
            a = start("a", "stream.stop.requested:1:kill")
            a.wait_checkpoints(1)
            clients.append(stop_client(tmp_path))
            assert a.wait() == -9, a.text()[-3000:]
            assert "stop requested from outside" in a.text()

        # 2. B answers A's request abandoned and is not stopped by it; its own stop completes a
        # final checkpoint, and B dies before answering
        b = start("b", "stream.stop.checkpointed:1:kill")
        if clients:  # A's request
            code, answer = answer_of(clients[0])
            assert (code, answer["status"], answer["run"]) == (1, "abandoned", 2), answer
        b.wait_checkpoints(2)
        assert b.proc.poll() is None, "a stale request stopped the next driver"
        before = max(b.completed_checkpoints())
        clients.append(stop_client(tmp_path))
        to_b = clients[-1]
        assert b.wait() == -9, b.text()[-3000:]
        final_b = max(b.completed_checkpoints())
        assert final_b >= before

        # 3. C answers B's request abandoned, restores B's final checkpoint, answers its own
        # request with its checkpoint id and dies before exiting
        c = start("c", "stream.stop.answered:1:kill")
        code, answer = answer_of(to_b)
        assert (code, answer["status"]) == (1, "abandoned"), answer
        c.wait_checkpoints(1)
        assert restored(c) == final_b, c.text()[-3000:]
        clients.append(stop_client(tmp_path))
        code, answer = answer_of(clients[-1])
        assert (code, answer["status"]) == (0, "stopped"), answer
        final_c = answer["checkpoint_id"]
        assert final_c == max(c.completed_checkpoints()), (answer, c.text()[-3000:])
        assert c.wait() == -9, c.text()[-3000:]

        # 4. a request while no driver runs: D answers it abandoned, restores C's final
        # checkpoint, and then stops cleanly when asked
        clients.append(stop_client(tmp_path))
        idle = clients[-1]
        # the request names C's run before D claims the next (3 and 4; 2 and 3 without A)
        assert wait_for(lambda: len(list((tmp_path / "ckpt" / "control")
                                         .glob("*.request.json"))) == len(clients), SLOW)
        d = start("d")
        code, answer = answer_of(idle)
        assert (code, answer["status"]) == (1, "abandoned"), answer
        d.wait_checkpoints(1)
        assert restored(d) == final_c, d.text()[-3000:]
        clients.append(stop_client(tmp_path))
        code, answer = answer_of(clients[-1])
        assert (code, answer["status"]) == (0, "stopped"), answer
        assert d.wait() == 0, d.text()[-3000:]
        assert "RESULT" in d.text()
        final_d, barrier = answer["checkpoint_id"], answer["barrier_batch"]
        assert final_d == max(d.completed_checkpoints())
    finally:
        for client in clients:
            if client.poll() is None:
                client.kill()
        for driver in drivers:
            if driver.proc.poll() is None:
                kill_group(driver.proc)

    # what is committed is exactly the batches up to the final checkpoint's barrier
    metadata = json.loads((tmp_path / "ckpt" / "checkpoints" / f"chk-{final_d:08d}" /
                           "_metadata.json").read_text())
    assert metadata["barrier_batch"] == barrier
    frame = events(tmp_path)
    assert frame is not None
    ids = sorted(frame.id)
    assert ids == list(range(len(ids))), "an id is missing or shows twice"
    committed = rows_by_batch(tmp_path)
    assert len(ids) == sum(n for b, n in committed.items() if b <= barrier), (len(ids), barrier)
    assert max(committed) == barrier, "a batch after the final checkpoint committed"
    for key, rows in frame.sort_values("id").groupby("key"):
        assert rows.seq.tolist() == list(range(1, len(rows) + 1)), f"key {key}: seq gaps"
        assert rows.prev_id.iloc[1:].tolist() == rows.id.iloc[:-1].tolist(), key
    totals = read_delta(str(tmp_path / "out" / "totals")).to_pandas()
    assert int(totals.n.sum()) == len(ids)


def test_stop_without_a_pipeline_is_refused_clearly(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "spark_ckpt.ops.cli", "stop", str(tmp_path)],
                          env=child_env(), capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 1
    assert "no pipeline has run on" in proc.stderr and "found none" in proc.stderr
