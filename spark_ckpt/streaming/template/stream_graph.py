"""The graph of a pipeline's streams: its inputs and outputs, and what each batch computes.

As Spark's DStreamGraph, the graph keeps every input stream (so sources need no search) and
every output stream. Each batch, a breadth-first search from the outputs over the parents
gives the streams that batch needs; a stream no output reaches is never computed.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import Any, Protocol, cast

from spark_ckpt.errors import JobDefinitionError

__all__ = ["GraphStream", "StreamGraph"]


class GraphStream(Protocol):
    """A stream as the graph sees it (streaming.stream and streaming.keyed make them)."""

    name: str  # made unique by the graph

    @property
    def id(self) -> int: ...

    @property
    def parents(self) -> Sequence[GraphStream]: ...

    @property
    def is_input(self) -> bool:
        """A source's stream (its ``source`` is its Source)."""


class GraphOutput(GraphStream, Protocol):
    @property
    def output_name(self) -> str: ...

    @property
    def sink(self) -> Any:
        """A per-batch sink, or None."""

    @property
    def two_phase(self) -> Any:
        """A two-phase sink, or None."""


class GraphStateful(GraphStream, Protocol):
    @property
    def operator(self) -> str:
        """Names its state."""

    @property
    def kind(self) -> str: ...

    @property
    def keys(self) -> tuple[str, ...]: ...


class StreamGraph:
    def __init__(self) -> None:
        self.streams: list[GraphStream] = []
        self.inputs: list[Any] = []  # InputStream
        self.outputs: list[Any] = []  # Output (GraphOutput)
        self.stateful: list[Any] = []  # StatefulStream (GraphStateful)
        self.remember_batches = 1  # the longest window: how far back batches are read again
        self._whole: dict[int, bool] = {}  # reads_whole's answers (the graph is fixed once
        # batches run; a stream or output added clears them)

    def add_stream(self, stream: GraphStream) -> None:
        names = {s.name for s in self.streams}
        if stream.name in names and not stream.is_input:
            n = 2
            while f"{stream.name}#{n}" in names:
                n += 1
            stream.name = f"{stream.name}#{n}"  # unique names in progress and logs
        self.streams.append(stream)
        self._whole.clear()
        if stream.is_input:
            source = cast(Any, stream).source  # an InputStream (template.stream)
            if any(i.source.name == source.name for i in self.inputs):
                raise JobDefinitionError(
                    f"a source named {source.name!r} already exists in this pipeline; "
                    "source names must be unique (they name its offsets and received data)"
                )
            self.inputs.append(stream)

    def add_stateful(self, stream: GraphStateful) -> None:
        if any(s.operator == stream.operator for s in self.stateful):
            raise JobDefinitionError(
                f"a stateful operator named {stream.operator!r} already exists in this "
                "pipeline; pass name= to tell them apart (names key their state)"
            )
        self.stateful.append(stream)

    def check_output_name(self, name: str) -> None:
        from spark_ckpt.names import check_name

        check_name("output name", name)
        if any(o.output_name == name for o in self.outputs):
            raise JobDefinitionError(
                f"an output named {name!r} already exists in this pipeline; pass "
                "name= to tell outputs apart (names key their exactly-once commits)"
            )

    def add_output(self, output: GraphOutput) -> None:
        self.outputs.append(output)
        self._whole.clear()

    def remember(self, batches: int) -> None:
        self.remember_batches = max(self.remember_batches, batches)

    def validate(self) -> None:
        """Refuse a graph without outputs, or with a cycle (found by a depth-first search)."""
        if not self.outputs:
            raise JobDefinitionError(
                "the pipeline has no outputs; add one with foreach_batch, write_parquet or "
                "write_delta (streams no output reaches are never computed)"
            )
        state: dict[int, int] = {}  # 1: on the current path, 2: done

        def visit(stream: GraphStream, path: list[str]) -> None:
            state[stream.id] = 1
            for parent in stream.parents:
                mark = state.get(parent.id)
                if mark == 1:
                    cycle = " -> ".join([*path, stream.name, parent.name])
                    raise JobDefinitionError(f"the stream graph has a cycle: {cycle}")
                if mark is None:
                    visit(parent, [*path, stream.name])
            state[stream.id] = 2

        for output in self.outputs:
            if output.id not in state:
                visit(output, [])

    def reads_whole(self, stream: GraphStream) -> bool:
        """True when every stream computed from ``stream`` reads each of its batches whole:
        spark_ckpt's own operators (select, filter, joins, unions, windows, stateful
        operators) up to spark_ckpt's own sinks. A user's ``transform`` function, a
        ``foreach_batch`` function or a user's two-phase sink may read part of a batch (a
        limit, ``isEmpty()``), so whatever is counted as the batch is read is not the
        batch's count there. Asked every batch; found once."""
        if stream.id in self._whole:
            return self._whole[stream.id]
        self._whole[stream.id] = self._reads_whole(stream)
        return self._whole[stream.id]

    def _reads_whole(self, stream: GraphStream) -> bool:
        children: dict[int, list[Any]] = {}
        for s in self.reachable():
            for parent in s.parents:
                children.setdefault(parent.id, []).append(s)
        queue: deque[Any] = deque(children.get(stream.id, ()))
        while queue:
            s = queue.popleft()
            if not getattr(s, "reads_whole", True):
                return False
            queue.extend(children.get(s.id, ()))
        return True

    def reachable(self) -> list[Any]:
        """Every stream some output needs, found by BFS from the outputs (each once)."""
        seen: dict[int, Any] = {}
        queue: deque[Any] = deque(self.outputs)
        while queue:
            stream = queue.popleft()
            if stream.id in seen:
                continue
            seen[stream.id] = stream
            queue.extend(stream.parents)
        return list(seen.values())
