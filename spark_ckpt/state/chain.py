"""State handles: the durable form of a key-group range's state, a chain of Parquet files.

A chain is the newest *snapshot* of the range followed by the *changelogs* of the batches
since, oldest first (Flink's changelog state backend, FLIP-158: every batch makes only its
changes durable; full snapshots are materialized now and then). A checkpoint holds one handle
per task: a list of file references, so consecutive checkpoints share every file they have in
common and an incremental checkpoint costs only the changelogs written since the previous one.

After a change of parallelism a new range is restored from the chains of every old range it
overlaps, each read with a filter on the key group (files hold a ``_kg`` column).
"""

from __future__ import annotations

import bisect
import dataclasses
from typing import Any

from spark_ckpt.state.keygroups import KeyGroupRange

__all__ = ["StateFile", "StateHandle", "restore_plan", "restore_plans"]


@dataclasses.dataclass(frozen=True)
class StateFile:
    path: str  # URI or absolute path (relative only inside a stored checkpoint's metadata)
    kind: str  # "snapshot" or "changelog"
    batch: int
    rows: int
    bytes: int
    range: str  # the range of the task that wrote it

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> StateFile:
        return cls(str(raw["path"]), str(raw["kind"]), int(raw["batch"]), int(raw["rows"]),
                   int(raw["bytes"]), str(raw["range"]))


@dataclasses.dataclass(frozen=True)
class StateHandle:
    """The durable state of one key-group range after some batch, and its version token."""

    range: str
    token: str | None
    files: tuple[StateFile, ...] = ()
    rows: int = 0

    @property
    def key_group_range(self) -> KeyGroupRange:
        return KeyGroupRange.parse(self.range)

    @property
    def bytes(self) -> int:
        return sum(f.bytes for f in self.files)

    def to_json(self) -> dict[str, Any]:
        return {"range": self.range, "token": self.token, "rows": self.rows,
                "files": [f.to_json() for f in self.files]}

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> StateHandle:
        return cls(str(raw["range"]), raw.get("token"),
                   tuple(StateFile.from_json(f) for f in raw.get("files", [])),
                   int(raw.get("rows", 0)))

    @staticmethod
    def empty(rng: KeyGroupRange) -> StateHandle:
        return StateHandle(rng.label, None)


def restore_plan(target: KeyGroupRange, handles: list[StateHandle]) -> list[StateFile]:
    """Files to read, in order, to rebuild ``target`` from the handles of another layout."""
    files: list[StateFile] = []
    for handle in handles:
        if handle.key_group_range.overlaps(target):
            files.extend(handle.files)
    return files


def restore_plans(targets: list[KeyGroupRange],
                  handles: list[StateHandle]) -> list[list[StateFile]]:
    """:func:`restore_plan` of every range of a new layout at once: each target finds the old
    ranges it overlaps by bisection, as a layout's ranges are disjoint and in order, so
    1,000 old and 2,000 new ranges take milliseconds, not the 2,000,000 overlap tests (12 s)
    of one plan after another (scripts/sim_scale.py). Handles not in that order (not a
    layout ``ranges`` makes) are planned one target at a time, with the same result."""
    parsed = [h.key_group_range for h in handles]
    ordered = all(a.end <= b.start for a, b in zip(parsed, parsed[1:], strict=False))
    if not ordered:
        return [restore_plan(t, handles) for t in targets]
    ends = [r.end for r in parsed]
    plans = []
    for target in targets:
        files: list[StateFile] = []
        i = bisect.bisect_right(ends, target.start)  # the first old range ending after it
        while i < len(parsed) and parsed[i].start < target.end:
            if parsed[i].overlaps(target):
                files.extend(handles[i].files)
            i += 1
        plans.append(files)
    return plans
