"""Library operators built on the keyed processor: windowed aggregations, deduplication,
Top-N. Each is a :class:`ProcessedStream` whose processor, state schema and output schema
depend on its input's schema, so they are derived at ``start()`` (on the user's thread, before
any batch runs) from the template's dry run, and fixed from then on."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from spark_ckpt.errors import JobDefinitionError
from spark_ckpt.streaming.template.event_time import Watermark, declared_watermark
from spark_ckpt.streaming.template.keyed import KeyedStream, ProcessedStream, _SchemaRun

if TYPE_CHECKING:
    from pyspark.sql import DataFrame
    from pyspark.sql.types import StructType

__all__ = ["DEFINITION_VERSION", "Derived", "DerivedOperator"]

#: the version of the definition a derived operator records with its state (``derived`` in its
#: checkpoint entry: JSON values only). A reader that finds no record, or a newer version than
#: it knows, reads the raw layout.
DEFINITION_VERSION = 1


class Derived:
    """What an operator derives from its input's schema: its processor, the schema of the rows
    its tasks emit (``raw_schema``), and anything the operator keeps (``extra``)."""

    def __init__(self, processor: Any, raw_schema: StructType, extra: Any = None) -> None:
        self.processor = processor
        self.raw_schema = raw_schema
        self.extra = extra


class _Pending:
    """Stands for the processor until start derives it from the input's schema."""

    state_schema = "pending INT"


class DerivedOperator(ProcessedStream):
    """A processor-backed operator whose processor and schemas come from its input's schema
    (subclasses: :meth:`derive`, and :meth:`finish` to shape the emitted rows)."""

    def __init__(self, keyed: KeyedStream, name: str, *, event_time: str | None = None,
                 delay_ms: int = 0, ttl_ms: int | None = None) -> None:
        super().__init__(keyed, name, _Pending(), "pending INT",  # type: ignore[arg-type]
                         event_time=event_time, watermark_delay_ms=delay_ms, ttl_ms=ttl_ms,
                         state_schema="pending INT", inherit_watermark=False)
        self._derived: Derived | None = None

    @staticmethod
    def watermark_of_inputs(keyed: KeyedStream, what: str, *, required: bool) -> Watermark | None:
        mark = declared_watermark(keyed.inputs, what)
        if mark is None and required:
            raise JobDefinitionError(
                f"{what}: expected a watermark on its input, found none; declare one with "
                "stream.with_watermark('event_time', '10 seconds') (the watermark decides "
                "when its state can be dropped)")
        return mark

    def derive(self, schema: StructType) -> Derived:
        raise NotImplementedError

    def derived(self) -> Derived:
        if self._derived is None:
            schema = _SchemaRun(self.pipeline.spark).input_schema(self)
            missing = [k for k in self.input_keys() if k not in schema.fieldNames()]
            if missing:
                raise JobDefinitionError(
                    f"operator {self.operator}: key columns {missing} are not in its input; "
                    f"columns: {sorted(schema.fieldNames())}")
            self._derived = self.derive(schema)
        return self._derived

    def configure(self, restored: dict[str, Any] | None) -> Any:
        derived = self.derived()  # at start, on the user's thread: fixed from here on
        self.processor = derived.processor
        self._declared_state = derived.processor.state_schema
        self.declared_schema = derived.raw_schema
        self.output_schema = derived.raw_schema
        return super().configure(restored)

    def definition(self) -> dict[str, Any] | None:
        """What a reader of the checkpoint needs to show the state as the user sees the
        operator (``read_state``), as JSON values; ``operator`` names the reader (None: the
        raw layout)."""
        return None

    def describe_state(self, state: Any) -> dict[str, Any]:
        described = super().describe_state(state)
        if getattr(state, "state_schema", None) is None or \
                getattr(state, "key_schema", None) is None or state.rewrite:
            return described  # the files hold what the checkpoint said: its definition too
        definition = self.definition()
        if definition is None:
            return {k: v for k, v in described.items() if k != "derived"}
        return {**described, "derived": {"version": DEFINITION_VERSION, **definition}}

    def new_state(self, parallelism: int, max_parallelism: int, live: dict[int, Any]) -> Any:
        state = super().new_state(parallelism, max_parallelism, live)
        state.output_schema = self.derived().raw_schema
        return state

    def compute(self, run: Any) -> DataFrame | None:
        raw = super().compute(run)
        return None if raw is None else self.finish(raw)

    def finish(self, raw: DataFrame) -> DataFrame:
        """The emitted rows as the user sees them (default: as the tasks wrote them)."""
        return raw

    def schema_frame(self, schema_run: Any) -> DataFrame:
        """The output's schema (the template's dry run at start)."""
        from spark_ckpt.sparkapi import empty_frame

        return self.finish(empty_frame(self.pipeline.spark, self.derived().raw_schema))
