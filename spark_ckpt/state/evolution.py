"""State schema evolution: what a restored operator's stored state columns become under the
state it declares now.

On a restore, every stateful operator compares the state columns its checkpoint stores with
the columns it declares (a processor's state variables, an aggregation's state columns), on the
driver, before any batch runs. What is allowed (as Flink's state evolution for POJO and Avro
state, and Spark's type widening):

- adding a column (null for every restored key: an added variable does not exist yet, an added
  aggregation output aggregates the rows from the restore on);
- removing a column (its values are dropped);
- reordering columns, and the fields of a struct at any depth (fields matched by name; a field
  may be added or removed as a column may);
- widening a type: ``TINYINT → SMALLINT → INT → BIGINT``, ``FLOAT → DOUBLE``,
  ``DECIMAL(p, s) → DECIMAL(p', s')`` with no fewer integer digits and no fewer fraction digits;
  inside structs, array elements and map values too;
- renaming a column through an explicit mapping ``{old: new}``.

Anything else (a narrowing, a change of kind such as STRING → BIGINT or a value to a list, a
changed map key type, a json variable becoming a string or back) is refused with
:class:`~spark_ckpt.errors.StateSchemaError`, naming the operator, both schemas and what to do.

A rename without the mapping reads as one column removed and another added: its values are
dropped. The restore logs every removed and added column, so that shows.

The result of a check, :class:`Evolution`, says where each declared column comes from in a
stored file; :func:`evolve_table` applies it to one restored file (tasks, worker side). A file
written after the change already has the declared columns, so a file is read by its own
columns: the declared name first, then the name it is renamed from.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import pyarrow as pa

from spark_ckpt.errors import StateSchemaError
from spark_ckpt.state.schema import EXPIRES_COLUMN as EXPIRES

__all__ = ["Evolution", "check_renames", "describe_schema", "evolve_array", "evolve_table",
           "plan_evolution", "type_problem"]

_INT_WIDTH = {pa.int8(): 8, pa.int16(): 16, pa.int32(): 32, pa.int64(): 64}

ADVICE = ("What to do: declare a type the stored one widens to (TINYINT → SMALLINT → INT → "
          "BIGINT, FLOAT → DOUBLE, DECIMAL with more digits), rename with "
          "state_renames={'old': 'new'}, declare the changed column under a new name (its "
          "state starts empty and the old one is dropped), restore an older pipeline version, "
          "or start in a new checkpoint directory")


def _spark_type(t: pa.DataType) -> str:
    """``t`` as Spark SQL writes it (BIGINT, STRUCT<a: INT>, DECIMAL(10,2), ...)."""
    from pyspark.sql.types import ArrayType, DecimalType, MapType, StructType

    from spark_ckpt.arrowtypes import to_spark

    def sql(dt: Any) -> str:
        if isinstance(dt, StructType):
            return "STRUCT<" + ", ".join(f"{f.name}: {sql(f.dataType)}" for f in dt.fields) + ">"
        if isinstance(dt, ArrayType):
            return f"ARRAY<{sql(dt.elementType)}>"
        if isinstance(dt, MapType):
            return f"MAP<{sql(dt.keyType)}, {sql(dt.valueType)}>"
        if isinstance(dt, DecimalType):
            return f"DECIMAL({dt.precision},{dt.scale})"
        name: str = dt.simpleString()
        return name.upper()

    if pa.types.is_null(t):
        return "VOID"
    return sql(to_spark(pa.schema([pa.field("v", t)])).fields[0].dataType)


def describe_schema(schema: pa.Schema, json_flags: Mapping[str, bool] | None = None) -> str:
    """``name TYPE, ...`` (``json`` for a json variable)."""
    flags = json_flags or {}
    return ", ".join(f"{f.name} {'json' if flags.get(f.name) else _spark_type(f.type)}"
                     for f in schema) or "(no columns)"


def type_problem(old: pa.DataType, new: pa.DataType, path: str) -> str | None:
    """Why a stored value of type ``old`` cannot be read as ``new``, or None when it can
    (equal, or a widening at every depth)."""
    if old.equals(new):
        return None
    if old in _INT_WIDTH and new in _INT_WIDTH:
        if _INT_WIDTH[new] >= _INT_WIDTH[old]:
            return None
        return (f"{path}: stored as {_spark_type(old)}, declared {_spark_type(new)}: a "
                "narrowing could lose values")
    if pa.types.is_floating(old) and pa.types.is_floating(new):
        if new.bit_width >= old.bit_width:
            return None
        return (f"{path}: stored as {_spark_type(old)}, declared {_spark_type(new)}: a "
                "narrowing loses precision")
    if pa.types.is_decimal(old) and pa.types.is_decimal(new):
        if new.scale >= old.scale and new.precision - new.scale >= old.precision - old.scale:
            return None
        return (f"{path}: stored as {_spark_type(old)}, declared {_spark_type(new)}: expected "
                f"at least {old.precision - old.scale} integer and {old.scale} fraction digits")
    if pa.types.is_struct(old) and pa.types.is_struct(new):
        problems = [type_problem(old.field(f.name).type, f.type, f"{path}.{f.name}")
                    for f in new if old.get_field_index(f.name) >= 0]
        return "; ".join(p for p in problems if p) or None
    if (pa.types.is_list(old) or pa.types.is_large_list(old)) and \
            (pa.types.is_list(new) or pa.types.is_large_list(new)):
        return type_problem(old.value_type, new.value_type, f"{path}[]")
    if pa.types.is_map(old) and pa.types.is_map(new):
        if not old.key_type.equals(new.key_type):
            return (f"{path}: stored as {_spark_type(old)}, declared {_spark_type(new)}: a "
                    "map's key type cannot change")
        return type_problem(old.item_type, new.item_type, f"{path}[value]")
    if pa.types.is_timestamp(old) and pa.types.is_timestamp(new) and \
            (old.tz is None) == (new.tz is None):
        return None  # units only (Spark's TIMESTAMP is microseconds everywhere)
    return (f"{path}: stored as {_spark_type(old)}, declared {_spark_type(new)}: the one "
            "does not widen to the other")


def check_renames(renames: Mapping[str, str] | None, stored: list[str], declared: list[str],
                  what: str) -> dict[str, str]:
    """``{new: old}`` of the renames that apply to this checkpoint; a rename that cannot apply
    (its target not declared, its source still declared, two sources for one target, neither
    name stored) is a problem raised by the caller."""
    out: dict[str, str] = {}
    for old, new in (renames or {}).items():
        if not isinstance(old, str) or not isinstance(new, str):
            raise StateSchemaError(
                f"{what}: state_renames expected a mapping of old name to new name, found "
                f"{old!r}: {new!r}"
            )
        if new not in declared:
            raise StateSchemaError(
                f"{what}: state_renames renames {old!r} to {new!r}, but {new!r} is not "
                f"declared (declared: {declared})"
            )
        if old in declared:
            raise StateSchemaError(
                f"{what}: state_renames renames {old!r} to {new!r}, but {old!r} is still "
                "declared; rename it or drop it from the declaration"
            )
        if new in out:
            raise StateSchemaError(
                f"{what}: state_renames renames both {out[new]!r} and {old!r} to {new!r}"
            )
        if old in stored and new in stored:
            raise StateSchemaError(
                f"{what}: state_renames renames {old!r} to {new!r}, but the checkpoint stores "
                f"both (stored: {stored})"
            )
        if old in stored:
            out[new] = old
        elif new not in stored:
            raise StateSchemaError(
                f"{what}: state_renames renames {old!r} to {new!r}, but the checkpoint stores "
                f"neither (stored: {stored}); expected the old name there, or the new one if "
                "the rename was made by an earlier run"
            )
        # else: an earlier run made the rename; the files have the new name already
    return out


@dataclasses.dataclass(frozen=True)
class Evolution:
    """Where each declared column comes from: ``sources[new] = old`` for a renamed column;
    ``changed`` when any stored file must be rewritten (a column added, removed, renamed or
    widened) so that no restored file outlives the run that changed the schema."""

    sources: dict[str, str]
    changed: bool
    added: tuple[str, ...] = ()
    removed: tuple[str, ...] = ()
    widened: tuple[str, ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {"sources": dict(self.sources)}


def plan_evolution(what: str, stored: pa.Schema, declared: pa.Schema,
                   renames: Mapping[str, str] | None = None, *,
                   stored_json: Mapping[str, bool] | None = None,
                   declared_json: Mapping[str, bool] | None = None,
                   noun: str = "state variable",
                   when: str = "nothing was run") -> Evolution:
    """Check that ``stored`` columns can be read as ``declared`` ones (see the module's rules);
    raise :class:`StateSchemaError` naming every problem and both schemas otherwise."""
    stored_names = [f.name for f in stored]
    declared_names = [f.name for f in declared]
    sources = check_renames(renames, stored_names, declared_names, what)
    problems: list[str] = []
    widened: list[str] = []
    for field in declared:
        source = sources.get(field.name, field.name)
        if source not in stored_names:
            continue
        old = stored.field(source)
        label = f"{noun} {field.name!r}" + (f" (renamed from {source!r})"
                                            if source != field.name else "")
        old_json = bool((stored_json or {}).get(source))
        new_json = bool((declared_json or {}).get(field.name))
        if old_json != new_json:
            problems.append(f"{label}: stored as {'json' if old_json else 'a typed value'}, "
                            f"declared {'json' if new_json else 'a typed value'}; json and "
                            "typed state do not convert")
            continue
        problem = type_problem(old.type, field.type, label)
        if problem:
            problems.append(problem)
        elif not old.type.equals(field.type):
            widened.append(field.name)
    if problems:
        raise StateSchemaError(
            f"{what}: the checkpoint's state cannot be read as the declared state; {when}."
            "\n  - " + "\n  - ".join(problems) +
            f"\n  stored:   {describe_schema(stored, stored_json)}"
            f"\n  declared: {describe_schema(declared, declared_json)}\n  {ADVICE}"
        )
    used = {sources.get(n, n) for n in declared_names}
    added = tuple(n for n in declared_names if sources.get(n, n) not in stored_names)
    removed = tuple(n for n in stored_names if n not in used)
    changed = bool(added or removed or sources or widened)
    return Evolution(sources, changed, added, removed, tuple(widened))


# -- worker side ----------------------------------------------------------------------------
def evolve_array(array: pa.Array | pa.ChunkedArray, target: pa.DataType) -> pa.Array:
    """``array``'s values as ``target`` (a type :func:`type_problem` accepts): struct fields by
    name (missing ones null, extra ones dropped), elements and map values likewise, scalars
    widened by Arrow's safe cast."""
    if isinstance(array, pa.ChunkedArray):
        array = array.combine_chunks()
    t = array.type
    if t.equals(target):
        return array
    if array.offset and (pa.types.is_nested(t)):
        array = pa.concat_arrays([array])  # a copy from offset 0: children line up
    if pa.types.is_struct(t) and pa.types.is_struct(target):
        children = []
        for field in target:
            index = t.get_field_index(field.name)
            children.append(evolve_array(array.field(index), field.type) if index >= 0
                            else pa.nulls(len(array), field.type))
        return pa.StructArray.from_arrays(children, fields=list(target),
                                          mask=array.is_null() if array.null_count else None)
    if pa.types.is_map(t) and pa.types.is_map(target):
        return pa.MapArray.from_arrays(
            array.offsets, array.keys, evolve_array(array.items, target.item_type),
            type=target, mask=array.is_null() if array.null_count else None)
    if (pa.types.is_list(t) or pa.types.is_large_list(t)) and pa.types.is_list(target):
        return pa.ListArray.from_arrays(
            array.offsets, evolve_array(array.values, target.value_type), type=target,
            mask=array.is_null() if array.null_count else None)
    return array.cast(target)


def evolve_table(table: pa.Table, schema: pa.Schema, sources: Mapping[str, str],
                 what: str, required: list[str] | None = None,
                 expires_of: list[str] | None = None) -> pa.Table:
    """``table`` (one restored file) as ``schema``: each column by its declared name, else by
    the name it is renamed from, else null; a ``required`` column (a key) that is missing
    stops the restore. ``expires_of`` (the declared variables, after a changing restore):
    the TTL deadlines (``_expires``, a map by variable name) follow the renames and lose the
    variables no longer declared."""
    arrays = []
    names = table.column_names
    for field in schema:
        name = field.name if field.name in names else sources.get(field.name)
        if name not in names:
            if field.name in (required or []):
                raise StateSchemaError(
                    f"{what}: expected the key column {field.name!r}, found the columns "
                    f"{names}; the key of a stateful operator cannot change under a "
                    "checkpoint (keep the old key or start a new checkpoint directory)"
                )
            arrays.append(pa.nulls(table.num_rows, field.type))
            continue
        column = table.column(name)
        if column.type.equals(field.type):
            arrays.append(column)
            continue
        try:
            arrays.append(evolve_array(column, field.type))
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError) as exc:
            raise StateSchemaError(
                f"{what}: state column {name!r} is stored as {column.type}, declared "
                f"{field.type}, and a value does not convert ({exc}); {ADVICE}"
            ) from None
    out = pa.Table.from_arrays(arrays, schema=schema)
    if expires_of is not None and EXPIRES in out.column_names:
        out = out.set_column(out.column_names.index(EXPIRES), schema.field(EXPIRES),
                             _renamed_deadlines(out.column(EXPIRES), sources, set(expires_of),
                                                schema.field(EXPIRES).type))
    return out


def _renamed_deadlines(column: pa.ChunkedArray, sources: Mapping[str, str], declared: set[str],
                       target: pa.DataType) -> pa.Array:
    """Each key's deadlines by declared name: an old name's under its new one, a removed
    variable's dropped."""
    renamed = {old: new for new, old in sources.items()}
    values: list[Any] = []
    for deadlines in column.to_pylist():
        if deadlines is None:
            values.append(None)
            continue
        kept = [(renamed.get(name, name), ms) for name, ms in deadlines
                if renamed.get(name, name) in declared]
        values.append(kept or None)
    return pa.array(values, target)
