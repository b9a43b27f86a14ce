"""The runs of a pipeline: each driver's start claims ``runs/<n>.json`` in its checkpoint
directory (the newest run owns it; see :class:`~.run_claim.RunClaim`)."""

from __future__ import annotations

from spark_ckpt.storage import Storage, join

__all__ = ["run_numbers"]


def run_numbers(storage: Storage, root: str) -> list[int]:
    """The runs claimed in ``root`` (``runs/<n>.json``), oldest first."""
    runs = join(root, "runs")
    if not storage.exists(runs):
        return []
    return sorted(int(i.base_name[:8]) for i in storage.list_files(runs, recursive=False)
                  if i.base_name.endswith(".json") and i.base_name[:8].isdigit())
