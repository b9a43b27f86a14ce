"""A file system that fails, stalls, tears or crashes at chosen operations: faulty storage for
the recovery tests, in any process that has the rules.

``SPARK_CKPT_FAULT_FS`` holds a JSON list of rules (or ``@<file>`` naming a file that holds it)::

    [{"op": "write", "path": "*/allocations/*", "nth": "2", "action": "fail"}]

* ``op``: ``write`` (a whole-record write or an output stream), ``create`` (create-if-absent),
  ``read``, ``rename``, ``delete`` or ``list``.
* ``path``: an ``fnmatch`` pattern matched against the path the storage is asked for.
* ``nth``: which matching passes fire, counted per rule and per process: ``"3"``, ``"2-4"``,
  ``"2-"`` (every pass from the second on); default ``"1"``.
* ``action``:

  - ``fail``: ``OSError(EIO)`` before anything is written (a storage error);
  - ``enospc``: half the bytes land in the temporary file, then ``OSError(ENOSPC)`` (a full
    disk: nothing is published);
  - ``torn``: the first ``keep`` bytes (default: half) are *published* at the destination and
    the process group is SIGKILLed: a crash mid-write on a store without atomic publish (a read
    returns the first ``keep`` bytes instead; an output stream opened directly on the wrapped
    file system, whose bytes are not known yet, publishes an empty file);
  - ``delay``: sleep ``ms`` milliseconds, then go on (slow storage);
  - ``kill``: SIGKILL the process group before the operation.

Every :class:`~spark_ckpt.storage.Storage` asks :func:`active` on each operation, and wraps
its pyarrow file system with :func:`wrap` so direct ``fs`` calls meet the same rules. Unset,
a check costs one environment lookup. Not for production: it exists so that tests can show
what a real storage failure does to a real driver.

Time: ``time.sleep`` directly, not a :class:`~spark_ckpt.clock.Clock`: a ``delay`` is set up
by the environment, in any process (executors too), and stands for slow storage in real time.
"""

from __future__ import annotations

import errno
import fnmatch
import json
import os
import signal
import threading
import time
from dataclasses import dataclass
from typing import Any

import pyarrow.fs as pafs

from spark_ckpt.errors import ConfigurationError

__all__ = ["ENV", "Rule", "active", "crash", "wrap"]

ENV = "SPARK_CKPT_FAULT_FS"
OPS = ("write", "create", "read", "rename", "delete", "list")
ACTIONS = ("fail", "enospc", "torn", "delay", "kill")


@dataclass(frozen=True)
class Rule:
    op: str
    path: str
    low: int
    high: float
    action: str
    ms: int = 0
    keep: int | None = None

    @classmethod
    def parse(cls, raw: dict[str, Any]) -> Rule:
        op, action = raw.get("op"), raw.get("action", "fail")
        if op not in OPS or action not in ACTIONS:
            raise ConfigurationError(f"{ENV}: expected op in {OPS} and action in {ACTIONS}, "
                                     f"found op={op!r} action={action!r}")
        first, dash, last = str(raw.get("nth", "1")).partition("-")
        high: float = (int(last) if last else float("inf")) if dash else int(first)
        return cls(op, str(raw.get("path", "*")), int(first), high, action,
                   int(raw.get("ms", 0)), raw.get("keep"))

    def tear(self, data: bytes) -> bytes:
        return data[: len(data) // 2 if self.keep is None else int(self.keep)]


_lock = threading.Lock()
_state: dict[str, Any] = {"raw": None, "rules": [], "counts": {}}


def _rules() -> list[Rule]:
    raw = os.environ.get(ENV)
    if not raw:
        return []
    with _lock:
        if raw != _state["raw"]:  # new rules: passes are counted afresh
            if raw.startswith("@"):
                with open(raw[1:]) as fh:
                    text = fh.read()
            else:
                text = raw
            _state.update(raw=raw, rules=[Rule.parse(r) for r in json.loads(text)], counts={})
        return _state["rules"]


def active(op: str, path: str) -> Rule | None:
    """The rule that fires for this pass of ``op`` on ``path``, after running the actions that
    need nothing from the caller (``fail``, ``kill``, ``delay``); None if none fires."""
    rules = _rules()
    if not rules:
        return None
    fired = None
    with _lock:
        for i, rule in enumerate(rules):
            if rule.op != op or not fnmatch.fnmatchcase(path, rule.path):
                continue
            n = _state["counts"][i] = _state["counts"].get(i, 0) + 1
            if fired is None and rule.low <= n <= rule.high:
                fired = rule
    if fired is None:
        return None
    if fired.action == "delay":
        time.sleep(fired.ms / 1000)
        return None
    if fired.action == "kill":
        crash()
    if fired.action == "fail":
        raise OSError(errno.EIO, f"injected I/O error ({ENV}: {op} {path})")
    return fired  # enospc and torn: the caller knows what they mean for its operation


def enospc(op: str, path: str) -> OSError:
    return OSError(errno.ENOSPC, f"injected: no space left on device ({ENV}: {op} {path})")


def crash() -> None:
    """SIGKILL this process's group when it leads its own (a driver a test started in a new
    session: JVM and Python workers die with it), else this process alone."""
    if os.getpgid(0) != os.getpgid(os.getppid()):
        os.killpg(os.getpgid(0), signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)


def wrap(fs: pafs.FileSystem) -> pafs.FileSystem:
    """``fs`` itself when no rules are set, else ``fs`` behind the rules."""
    if not os.environ.get(ENV):
        return fs
    return pafs.PyFileSystem(_Handler(fs))


class _Handler(pafs.FileSystemHandler):
    """Every call goes to the wrapped file system after the rules had their say."""

    def __init__(self, fs: pafs.FileSystem) -> None:
        self.fs = fs

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Handler) and self.fs.equals(other.fs)

    def __ne__(self, other: object) -> bool:
        return not self == other

    def get_type_name(self) -> str:
        return "faulty+" + self.fs.type_name

    def normalize_path(self, path: str) -> str:
        return self.fs.normalize_path(path)

    def get_file_info(self, paths: list[str]) -> list[pafs.FileInfo]:
        return self.fs.get_file_info(paths)

    def get_file_info_selector(self, selector: pafs.FileSelector) -> list[pafs.FileInfo]:
        if active("list", selector.base_dir):
            raise enospc("list", selector.base_dir)
        return self.fs.get_file_info(selector)

    def create_dir(self, path: str, recursive: bool) -> None:
        self.fs.create_dir(path, recursive=recursive)

    def delete_dir(self, path: str) -> None:
        if active("delete", path):
            raise enospc("delete", path)
        self.fs.delete_dir(path)

    def delete_dir_contents(self, path: str, missing_dir_ok: bool = False) -> None:
        if active("delete", path):
            raise enospc("delete", path)
        self.fs.delete_dir_contents(path, missing_dir_ok=missing_dir_ok)

    def delete_root_dir_contents(self) -> None:
        self.fs.delete_dir_contents("/", accept_root_dir=True)

    def delete_file(self, path: str) -> None:
        if active("delete", path):
            raise enospc("delete", path)
        self.fs.delete_file(path)

    def move(self, src: str, dest: str) -> None:
        if active("rename", src):
            raise enospc("rename", src)
        self.fs.move(src, dest)

    def copy_file(self, src: str, dest: str) -> None:
        self.fs.copy_file(src, dest)

    def open_input_stream(self, path: str) -> Any:
        rule = active("read", path)
        if rule is not None:
            if rule.action != "torn":
                raise enospc("read", path)
            with self.fs.open_input_stream(path) as stream:
                return pa_buffer_stream(rule.tear(stream.read()))
        return self.fs.open_input_stream(path)

    def open_input_file(self, path: str) -> Any:
        if active("read", path):
            raise enospc("read", path)
        return self.fs.open_input_file(path)

    def open_output_stream(self, path: str, metadata: Any) -> Any:
        rule = active("write", path)
        if rule is not None:
            if rule.action == "torn":
                with self.fs.open_output_stream(path) as out:
                    out.write(b"")
                crash()
            raise enospc("write", path)
        return self.fs.open_output_stream(path, metadata=metadata)

    def open_append_stream(self, path: str, metadata: Any) -> Any:
        if active("write", path):
            raise enospc("write", path)
        return self.fs.open_append_stream(path, metadata=metadata)


def pa_buffer_stream(data: bytes) -> Any:
    import pyarrow as pa

    return pa.BufferReader(data)
