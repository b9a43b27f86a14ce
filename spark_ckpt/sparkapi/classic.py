"""The seam on a classic session: the driver's JVM, through py4j.

The only module of spark_ckpt that touches py4j, ``_jdf``, ``_jsc``, ``_jvm`` or
``_jsparkSession`` (tests/test_seam.py checks).
"""
# ruff: noqa: SLF001 - reaching into PySpark's py4j handles is this module's purpose

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

from spark_ckpt.sparkapi.types import Expr, PlanNode, walk

_log = logging.getLogger(__name__)
# what a data source's jar needs beside it to read (a connector without its client library
# resolves, then fails at its first read)
_SOURCE_NEEDS = {"kafka": ("org.apache.kafka.clients.consumer.ConsumerConfig",)}

if TYPE_CHECKING:
    from pyspark.sql import Column, DataFrame, SparkSession

    from spark_ckpt.clock import Clock

__all__ = ["ClassicSpark"]

_GROUP_KEYS = ("spark.jobGroup.id", "spark.job.description", "spark.job.interruptOnCancel")


def _seq(s: Any) -> list[Any]:
    """A Scala Seq as a list."""
    return [s.apply(i) for i in range(s.size())]


def _kind(obj: Any) -> str:
    return obj.getClass().getSimpleName()


def _expr(e: Any) -> Expr:
    kind = _kind(e)
    try:
        data_type = e.dataType().sql()
    except Exception:  # noqa: BLE001 - an expression without a type (none in analysed plans)
        data_type = ""
    name = ""
    if kind in ("AttributeReference", "Alias"):
        name = e.name()
    function = None
    distinct = filtered = False
    if kind == "AggregateExpression":
        function = _expr(e.aggregateFunction())
        distinct = bool(e.isDistinct())
        filtered = bool(e.filter().isDefined())
    pretty = ""
    with contextlib.suppress(Exception):  # only functions have one
        pretty = e.prettyName()
    return Expr(kind=kind, sql=e.sql(), name=name, data_type=data_type,
                children=tuple(_expr(c) for c in _seq(e.children())), distinct=distinct,
                filtered=filtered, function=function, pretty_name=pretty)


def _node(plan: Any, mark: Any = None) -> PlanNode:
    kind = _kind(plan)
    grouping: tuple[Expr, ...] = ()
    aggregates: tuple[Expr, ...] = ()
    if kind == "Aggregate":
        grouping = tuple(_expr(e) for e in _seq(plan.groupingExpressions()))
        aggregates = tuple(_expr(e) for e in _seq(plan.aggregateExpressions()))
    children = tuple(_node(c, mark) for c in _seq(plan.children()))
    below = any(n.marked for c in children for n in walk(c))
    return PlanNode(kind=kind, name=plan.nodeName(), deterministic=bool(plan.deterministic()),
                    children=children, grouping=grouping, aggregates=aggregates,
                    marked=mark is not None and not below and bool(plan.sameResult(mark)),
                    subquery=not bool(plan.subqueries().isEmpty()))


def _at(plan: Any, path: tuple[int, ...]) -> Any:
    for index in path:
        plan = _seq(plan.children())[index]
    return plan


# Between a final aggregation and its exchange: codegen's wrappers only.
_MAP_SIDE_PASS = ("WholeStageCodegenExec", "InputAdapter")
_SHUFFLES = ("ShuffleExchangeExec", "AdaptiveSparkPlanExec", "AQEShuffleReadExec")
# Aggregate functions whose aggregation buffer is their result: one column, the same type
# (a merge of buffers is the same function over results). Not a decimal sum (its buffer has
# an isEmpty flag beside the sum).
_BUFFER_IS_RESULT = ("Count", "Min", "Max", "Sum")


def _nodes(plan: Any) -> list[Any]:
    out = [plan]
    for c in _seq(plan.children()):
        out.extend(_nodes(c))
    return out


def _single_child(plan: Any) -> Any:
    children = _seq(plan.children())
    return children[0] if len(children) == 1 else None


def _unwrapped(plan: Any) -> Any:
    """``plan`` under codegen's wrappers (:data:`_MAP_SIDE_PASS`); None: a wrapper without a
    single child."""
    while plan is not None and _kind(plan) in _MAP_SIDE_PASS:
        plan = _single_child(plan)
    return plan


def _map_branches(plan: Any, planning: bool = False) -> list[tuple[Any, list[int | str]]] | None:
    """The map sides ``plan``'s rows come from: one per final aggregation (a union of several
    aggregations' results has one each), as (the map side's plan, each of ``plan``'s columns
    as a column of the map side's output or a constant's SQL); None when ``plan`` is not
    such an aggregation or union of them (see :func:`_map_stage`). Under adaptive execution
    only while ``planning`` (the plan it starts from, not one to run: its stages are prepared
    as they start)."""
    if _kind(plan) == "AdaptiveSparkPlanExec" and planning:
        plan = plan.executedPlan()
    plan = _unwrapped(plan)
    if plan is None:
        return None
    branches = []
    for child in (_seq(plan.children()) if _kind(plan) == "UnionExec" else [plan]):
        found = _map_branch(child)
        if found is None:
            return None
        branches.append(found)
    return branches


def _map_branch(plan: Any) -> tuple[Any, list[int | str]] | None:
    """One aggregation's map side (:func:`_map_stage`), under a projection of its columns
    and constants (a union's branch: another aggregation's columns as nulls, a tag)."""
    plan = _unwrapped(plan)
    if plan is None:
        return None
    if _kind(plan) != "ProjectExec":
        return _map_stage(plan)
    found = _map_stage(plan.child())
    if found is None:
        return None
    child, columns = found
    below = _unwrapped(plan.child())
    position: dict[int, int | str] = {a.exprId().id(): columns[i]
                                      for i, a in enumerate(_seq(below.output()))}
    out = _columns(plan.projectList(), position)
    return None if out is None else (child, out)


def _map_stage(plan: Any) -> tuple[Any, list[int | str]] | None:
    """The map side of the exchange under ``plan``'s final aggregation and, for each column
    of ``plan``, its position in the map side's output (or a constant's SQL; see
    :func:`_final_aggregate`), when that exchange is the plan's only shuffle; else None."""
    found = _final_aggregate(plan)
    if found is None:
        return None
    final, ids = found
    exchange = _unwrapped(_single_child(final))
    if exchange is None or _kind(exchange) != "ShuffleExchangeExec" or \
            _kind(exchange.outputPartitioning()) != "HashPartitioning" or \
            any(_kind(n) in _SHUFFLES or (_kind(n) == "ReusedExchangeExec" and
                                          _kind(n.child()) != "BroadcastExchangeExec")
                for n in _nodes(exchange.child())):
        return None
    child = exchange.child()
    at = {a.exprId().id(): i for i, a in enumerate(_seq(child.output()))}
    if any(isinstance(c, int) and c not in at for c in ids):
        return None
    return child, [at[c] if isinstance(c, int) else c for c in ids]


def _streamed(plan: Any) -> Any:
    """The one child of ``plan`` its rows stream from (a broadcast join's other side is a
    broadcast); None: several."""
    children = [c for c in _seq(plan.children())
                if _kind(_unwrapped(c) or c) not in ("BroadcastExchangeExec", "ReusedExchangeExec")]
    return children[0] if len(children) == 1 else None


def _task_reads(plan: Any) -> list[tuple[str, ...]] | None:
    """The files each task of the map side ``plan`` reads, in task order, when its rows
    stream from file scans alone under row-by-row nodes: a scan (a task per file partition
    of it, as this session's settings cut them), a union of such reads (its tasks are theirs,
    in order), or a coalesce into one partition (one task: every file below it; an empty
    range, none). None: any other read. Builds the scans' RDDs."""
    node = plan
    while node is not None:
        kind = _kind(node)
        if kind == "UnionExec":
            out: list[tuple[str, ...]] = []
            for child in _seq(node.children()):
                reads = _task_reads(child)
                if reads is None:
                    return None
                out.extend(reads)
            return out
        if kind == "CoalesceExec":
            if int(node.numPartitions()) != 1:
                return None
            below = _task_reads(node.child())
            return None if below is None else [tuple(f for task in below for f in task)]
        if kind == "FileSourceScanExec":
            return _scan_reads(node)
        if kind == "RangeExec" and int(node.start()) == int(node.end()):
            return []  # no rows (an empty split's frame)
        node = _streamed(node)
    return None


def _scan_reads(scan: Any) -> list[tuple[str, ...]] | None:
    """The files of each partition of a file scan (None: not file partitions)."""
    partitions = scan.inputRDD().partitions()
    out = []
    for i in range(len(partitions)):
        partition = partitions[i]
        if _kind(partition) != "FilePartition":
            return None
        files = partition.files()
        out.append(tuple(str(files[j].filePath().toPath().toString())
                         for j in range(len(files))))
    return out


def _final_aggregate(plan: Any) -> tuple[Any, list[int | str]] | None:
    """The final aggregation at the top of ``plan`` (under codegen's wrappers) when each of
    its output columns is a grouping column, an aggregate's result or a constant, and each
    aggregate one whose buffer is its result (:data:`_BUFFER_IS_RESULT`, its evaluation its
    buffer); with, for each output column, the expression id of the map side's output
    attribute it is (an aggregate written twice is computed once) or the constant's SQL;
    else None."""
    plan = _unwrapped(plan)
    if plan is None:
        return None
    if _kind(plan) not in ("HashAggregateExec", "ObjectHashAggregateExec",
                           "SortAggregateExec"):
        return None
    aggregates = _seq(plan.aggregateExpressions())
    for a in aggregates:
        function = a.aggregateFunction()
        if str(a.mode().toString()) != "Final" or bool(a.isDistinct()) or \
                bool(a.filter().isDefined()) or _kind(function) not in _BUFFER_IS_RESULT or \
                (_kind(function) == "Sum" and
                 function.dataType().typeName().startswith("decimal")) or \
                len(_seq(function.aggBufferAttributes())) != 1 or \
                len(_seq(function.inputAggBufferAttributes())) != 1 or \
                not bool(function.evaluateExpression().semanticEquals(
                    function.aggBufferAttributes().apply(0))):
            return None
    grouping = _seq(plan.groupingExpressions())
    if any(_kind(e) != "AttributeReference" for e in grouping):
        return None
    # each output column as the attribute of the map side's output it is: a grouping column
    # (the same attribute), or an aggregate's buffer (its input buffer attribute)
    ids: dict[int, int | str] = {e.exprId().id(): e.exprId().id() for e in grouping}
    for a in aggregates:
        ids[a.resultAttribute().exprId().id()] = \
            a.aggregateFunction().inputAggBufferAttributes().apply(0).exprId().id()
    columns = _columns(plan.resultExpressions(), ids)
    return None if columns is None else (plan, columns)


def _columns(expressions: Any, position: dict[int, int | str]) -> list[int | str] | None:
    """Each of ``expressions`` as what ``position`` says of the attribute it is (a column of
    the map side's output, or a constant's SQL) or, a constant, its SQL; None: another
    expression."""
    out: list[int | str] = []
    for e in _seq(expressions):
        inner = e.child() if _kind(e) == "Alias" else e
        if _kind(inner) == "AttributeReference" and inner.exprId().id() in position:
            out.append(position[inner.exprId().id()])
        elif bool(inner.foldable()) and bool(inner.deterministic()):
            out.append(str(inner.sql()))
        else:
            return None
    return out


_LOGGED: set[str] = set()


def _once(key: str, level: int, message: str, *args: Any) -> None:
    """Log ``message`` the first time ``key`` comes up in this process."""
    if key not in _LOGGED:
        _LOGGED.add(key)
        _log.log(level, message, *args)


def _locality_class(spark: SparkSession) -> Any:
    """spark_ckpt's PreferredLocationsRDD class in the driver's JVM (spark_ckpt.jvm), its jar
    added to a running session first if needed (the driver's class loader, and the executors
    through ``addJar``); None, logged once, when the jar is missing or cannot be loaded."""
    from py4j.java_gateway import JavaClass

    from spark_ckpt.jvm import LOCALITY_CLASS, jar_path

    jvm = spark._jvm
    assert jvm is not None

    def lookup() -> Any:
        found = jvm
        for part in LOCALITY_CLASS.split("."):
            found = getattr(found, part)
        return found if isinstance(found, JavaClass) else None

    found = lookup()
    if found is not None:
        return found
    jar = jar_path()
    if jar is None:
        _once("no-jar", logging.INFO,
              "spark_ckpt's locality jar is not built (python -m spark_ckpt.jvm build): "
              "stateful tasks run wherever Spark puts them")
        return None
    try:
        loader = jvm.java.lang.Thread.currentThread().getContextClassLoader()
        loader.addURL(jvm.java.io.File(str(jar)).toURI().toURL())  # a MutableURLClassLoader
        spark.sparkContext._jsc.sc().addJar(str(jar))  # the executors fetch it before tasks
    except Exception as exc:  # noqa: BLE001 - py4j: a class loader without addURL
        _once("no-load", logging.INFO,
              "Could not add spark_ckpt's locality jar to this session (%s): stateful tasks "
              "run wherever Spark puts them", exc)
        return None
    found = lookup()
    if found is None:
        _once("no-class", logging.INFO,
              "spark_ckpt's locality jar %s was added but %s does not load: stateful tasks "
              "run wherever Spark puts them", jar, LOCALITY_CLASS)
    else:
        _log.info("Added spark_ckpt's locality jar %s to the running session", jar)
    return found


def _check_locality_wait(sc: Any) -> None:
    """Log once when Spark's delay scheduling is off for executor-local tasks: a preferred
    location is then only a tie-break, and a task whose executor is busy goes elsewhere."""
    conf = sc.getConf()
    raw = conf.get("spark.locality.wait.process", conf.get("spark.locality.wait", "3s"))
    if raw.strip().rstrip("ms").strip() in ("0", ""):
        _once("wait", logging.WARNING,
              "spark.locality.wait.process is %s: a stateful task runs where its key-group "
              "range's state is only when that executor is free at once; keep Spark's default "
              "(3s) for state locality (docs/checkpointing.md, \"Where state lives\")", raw)


def _executors(context: Any) -> list[tuple[str, str | None]]:
    """The application's live executors (the scheduler's, ``getExecutorIds``) as (executor
    id, host), the host from Spark's status store (what its UI lists), None where the store
    does not list it yet (it is filled through the listener bus) or cannot be read (it is
    Spark's internal API: logged once, and then no new range gets a preference). (Not the
    block manager master's registry: py4j's reflection over ``BlockManager`` loads classes the
    driver's class path may lack, which killed the gateway.)"""
    alive = {str(e) for e in _seq(context.getExecutorIds())}
    hosts: dict[str, str] = {}
    try:
        listed = context.statusStore().executorList(True)
        for i in range(listed.size()):
            summary = listed.apply(i)
            hosts[str(summary.id())] = _host_of(str(summary.hostPort()))
    except Exception as exc:  # noqa: BLE001 - a preference is an optimization, never a failure
        _once("status-store", logging.WARNING,
              "Spark's status store did not list the executors (%s): stateful ranges with no "
              "place yet run wherever Spark puts them", exc)
    return sorted((executor, hosts.get(executor)) for executor in alive)


def _host_of(host_port: str) -> str:
    """The host of Spark's ``host:port`` (``[v6]:port`` for IPv6; a bare host before the
    executor's block manager registered)."""
    if host_port.startswith("["):
        return host_port[1:host_port.index("]")] if "]" in host_port else host_port
    host, _, port = host_port.rpartition(":")
    return host if host and port.isdigit() and ":" not in host else host_port


def spread_ranges(partitions: int, locations: Mapping[int, tuple[str, str]],
                  executors: list[tuple[str, str | None]]) -> dict[int, str]:
    """Each key-group range's preferred location (Spark's names: ``executor_<host>_<id>`` or
    a host): the executor it last ran on while that executor lives (with the host its task
    reported); for a lost executor, its host if another executor runs there (its local disk
    may hold the range); and a range with neither (the first batch, a rescale, a host lost)
    goes to the live executor with the fewest ranges so far, among those whose host is known,
    so the first placement, which later batches keep, is even (without it Spark's first
    offers put most ranges on whichever executor offered first). Counted per operator, per
    call: ranges placed before an executor joined stay where they are."""
    live = {executor for executor, _host in executors}
    by_id = {executor: host for executor, host in executors if host is not None}
    hosts = set(by_id.values())
    load = {executor: 0 for executor in by_id}
    out: dict[int, str] = {}
    for pid, (host, executor) in sorted(locations.items()):
        if not 0 <= pid < partitions:
            continue
        if executor in live:
            out[pid] = f"executor_{host}_{executor}"  # (the host its task reported)
            if executor in load:
                load[executor] += 1
        elif host in hosts:
            out[pid] = host  # counted against the host's least loaded executor
            load[min((e for e, at in by_id.items() if at == host),
                     key=lambda e: (load[e], _executor_order(e)))] += 1
    for pid in range(partitions):
        if pid in out or not load:
            continue
        executor = min(load, key=lambda e: (load[e], _executor_order(e)))
        out[pid] = f"executor_{by_id[executor]}_{executor}"
        load[executor] += 1
    return out


def _executor_order(executor: str) -> tuple[int, str]:
    return (int(executor), "") if executor.isdigit() else (1 << 30, executor)


class ClassicSpark:
    """:class:`spark_ckpt.sparkapi.SparkApi` over a classic session's JVM."""

    kind = "classic"

    def __init__(self, spark: SparkSession) -> None:
        self.spark = spark

    @property
    def _sc(self) -> Any:
        return self.spark.sparkContext

    def app_id(self) -> str:
        return str(self._sc.applicationId)

    def default_parallelism(self) -> int:
        return int(self._sc.defaultParallelism)

    @contextlib.contextmanager
    def job_group(self, group: str, description: str, *,
                  owner: str | None = None) -> Iterator[None]:
        # owner: a classic driver's jobs end with its JVM; nobody interrupts them later
        sc = self._sc
        saved = {k: sc.getLocalProperty(k) for k in _GROUP_KEYS}
        sc.setJobGroup(group, description, interruptOnCancel=True)
        try:
            yield
        finally:
            for key, value in saved.items():
                sc.setLocalProperty(key, value)  # type: ignore[arg-type]

    def describe(self, text: str) -> None:
        self._sc.setLocalProperty("spark.job.description", text)

    def cancel_group(self, group: str) -> None:
        self._sc.cancelJobGroup(group)

    def executed_plan(self, df: DataFrame) -> str:
        return str(df._jdf.queryExecution().executedPlan().toString())

    def ends_hash_partitioned(self, df: DataFrame, key: tuple[str, ...], n: int,
                              plan: str | None = None) -> bool:
        return self.hash_partitioning(df) == (tuple(key), n)

    def hash_partitioning(self, df: DataFrame) -> tuple[tuple[str, ...] | None, int] | None:
        plan = df._jdf.queryExecution().executedPlan()
        if _kind(plan) == "AdaptiveSparkPlanExec":
            # the plan adaptive execution starts from: after EnsureRequirements and the rule
            # that turns a bucketed scan nobody needs into a plain one
            plan = plan.executedPlan()
        partitioning = plan.outputPartitioning()
        # a join's output is partitioned as each side is (PartitioningCollection): rows are
        # where either side's key puts them, and the key attributes are the ones kept
        found = _seq(partitioning.partitionings()) \
            if _kind(partitioning) == "PartitioningCollection" else [partitioning]
        output = {a.exprId().id() for a in _seq(plan.output())}
        best = None
        for candidate in found:
            if _kind(candidate) != "HashPartitioning":
                continue
            names: list[str] | None = []
            for e in _seq(candidate.expressions()):
                if _kind(e) != "AttributeReference" or e.exprId().id() not in output:
                    names = None
                    break
                names.append(e.name())  # type: ignore[union-attr]
            if names is not None:
                return tuple(names), int(candidate.numPartitions())
            best = best or (None, int(candidate.numPartitions()))
        return best

    def deterministic(self, df: DataFrame) -> bool | None:
        return bool(df._jdf.queryExecution().analyzed().deterministic())

    def size_estimate(self, df: DataFrame) -> int | None:
        size = df._jdf.queryExecution().optimizedPlan().stats().sizeInBytes()
        return int(str(size))  # a Scala BigInt: any size

    def data_source_available(self, name: str) -> bool | None:
        jvm = self._sc._jvm
        try:
            jvm.org.apache.spark.sql.execution.datasources.DataSource.lookupDataSource(
                name, self.spark._jsparkSession.sessionState().conf())
            for cls in _SOURCE_NEEDS.get(name, ()):  # the loader Spark's lookup uses
                jvm.org.apache.spark.util.Utils.classForName(cls, True, False)
        except Exception as exc:  # noqa: BLE001 - not found, or a class it needs is missing
            _log.debug("data source %s not available: %s", name,
                       str(exc).splitlines()[0][:300] if str(exc) else type(exc).__name__)
            return False
        return True

    def observe(self, df: DataFrame, name: str, *columns: Column, clock: Clock | None = None
                ) -> tuple[DataFrame, Callable[[float], dict[str, Any] | None]] | None:
        from pyspark.sql import Observation

        from spark_ckpt.clock import SystemClock

        clk = clock or SystemClock()
        observation = Observation(name)
        observed = df.observe(observation, *columns)

        def values(wait_s: float) -> dict[str, Any] | None:
            # Spark completes the observation's future when a query that ran its metrics
            # ends (from its listener: maybe just after the action returned); never get()
            # before that, it would wait for a job that may never come
            jo = observation._jo
            if jo is None:
                return None
            deadline = clk.monotonic_s() + wait_s
            while not jo.future().isCompleted():
                if clk.monotonic_s() >= deadline:
                    return None
                clk.sleep(0.01)  # polling Spark's future until a bounded deadline
            return dict(observation.get)

        return observed, values

    def provably_empty(self, df: DataFrame) -> bool:
        plan = df._jdf.queryExecution().optimizedPlan()
        return _kind(plan) == "LocalRelation" and bool(plan.data().isEmpty())

    def analyzed_plan(self, df: DataFrame, mark: DataFrame | None = None) -> PlanNode | None:
        marked = None if mark is None else mark._jdf.queryExecution().analyzed()
        return _node(df._jdf.queryExecution().analyzed(), marked)

    def plan_child_frame(self, df: DataFrame) -> DataFrame | None:
        plan = df._jdf.queryExecution().analyzed()
        if len(_seq(plan.children())) != 1:
            return None
        return self.plan_frame(df, (0,))

    def _frame(self, plan: Any) -> DataFrame:
        from pyspark.sql import DataFrame as PyDataFrame

        spark = self.spark
        jdf = spark._jvm.org.apache.spark.sql.classic.Dataset.ofRows(  # type: ignore[union-attr]
            spark._jsparkSession, plan)
        return PyDataFrame(jdf, spark)

    def plan_frame(self, df: DataFrame, path: tuple[int, ...]) -> DataFrame | None:
        return self._frame(_at(df._jdf.queryExecution().analyzed(), path))

    def map_side_plan(self, df: DataFrame) -> bool:
        plan = df._jdf.queryExecution().executedPlan()
        return _map_branches(plan, planning=True) is not None

    def map_side(self, df: DataFrame) -> tuple[DataFrame, list[tuple[str, ...]]] | None:
        from pyspark.sql import DataFrame as PyDataFrame
        from pyspark.sql import functions as F

        branches = _map_branches(df._jdf.queryExecution().executedPlan())
        if branches is None or any(len(c) != len(df.columns) for _, c in branches):
            return None
        frames, reads = [], []
        for child, columns in branches:
            # (the map stage's RDD first: it runs the plan's broadcasts and subqueries, which
            # a scan's partitions may depend on, dynamic partition pruning's)
            rows = child.execute()
            found = _task_reads(child)  # the same scans' partitions: the RDD's own
            if found is None or int(rows.getNumPartitions()) != len(found):
                return None
            reads.append(found)
            jdf = self.spark._jsparkSession.internalCreateDataFrame(rows, child.schema(), False)
            mapped = PyDataFrame(jdf, self.spark)
            mapped = mapped.toDF(*[f"c{i}" for i in range(len(mapped.columns))])
            frames.append(mapped.select(*[
                (F.col(f"c{c}") if isinstance(c, int) else F.expr(c)).alias(name)
                for c, name in zip(columns, df.columns, strict=True)]))
        same = [(f.dataType, g.dataType) for frame in frames
                for f, g in zip(frame.schema.fields, df.schema.fields, strict=True)]
        if not all(a == b for a, b in same):
            return None
        if len(frames) > 1 and len({len(r) for r in reads}) == 1 and reads[0]:
            return self._interleaved(frames, reads)
        out = frames[0]
        for frame in frames[1:]:
            out = out.union(frame)
        return out, [task for branch in reads for task in branch]

    def prefer_locations(self, df: DataFrame, partitions: int,
                         locations: Mapping[int, tuple[str, str]]
                         ) -> tuple[DataFrame, Callable[[], dict[int, tuple[str, str]]]] | None:
        from pyspark.sql import DataFrame as PyDataFrame

        if self._sc._jsc.sc().isLocal():
            return None  # one executor: every task finds its range there anyway
        rdd_class = _locality_class(self.spark)
        if rdd_class is None:
            return None
        _check_locality_wait(self._sc)
        jvm, gateway = self.spark._jvm, self._sc._gateway
        assert jvm is not None
        query = df._jdf.queryExecution()
        rows = query.toRdd()  # (under AQE this runs the stage's input shuffle, as collect would)
        found = int(rows.getNumPartitions())
        if found != partitions:
            _once(f"partitions:{found}:{partitions}", logging.WARNING,
                  "A stateful stage has %d Spark partitions for its %d key-group ranges; its "
                  "tasks run without preferred locations", found, partitions)
            return None
        context = self._sc._jsc.sc()
        executors = _executors(context)
        preferred = spread_ranges(partitions, locations, executors)
        wanted = gateway.new_array(jvm.java.lang.String, partitions)
        for pid, where in preferred.items():
            wanted[pid] = where
        wrapped = rdd_class(rows, wanted)
        jdf = self.spark._jsparkSession.internalCreateDataFrame(wrapped, df._jdf.schema(), False)

        def ran() -> dict[int, tuple[str, str]]:
            where: dict[int, tuple[str, str]] = {}
            for line in wrapped.ran():
                pid, executor, host = str(line).split(" ", 2)
                where[int(pid)] = (host, executor)
            return where

        return PyDataFrame(jdf, self.spark), ran

    def _interleaved(self, frames: list[DataFrame], reads: list[list[tuple[str, ...]]]
                     ) -> tuple[DataFrame, list[tuple[str, ...]]] | None:
        """Several aggregations' map stages over the same number of tasks (``reads``: each
        branch's tasks' files) as one frame whose Spark partition ``t * k + b`` is branch
        *b*'s task *t*: Spark launches a stage's tasks in partition order (where no locality
        preference reorders them), so a split's tasks (one an aggregation) run side by side,
        not the last aggregation's after every other's (shape (g): nothing was durable at 60%
        of the run). Each branch's rows as an RDD, pruned to one partition, unioned in turn,
        under the branches' schema, a column nullable where any branch's is."""
        from pyspark.sql import DataFrame as PyDataFrame
        from pyspark.sql.types import StructField, StructType

        jvm = self.spark._jvm
        assert jvm is not None
        k, tasks = len(frames), len(reads[0])
        rdds = [f._jdf.queryExecution().toRdd() for f in frames]
        pieces = []
        for t in range(tasks):
            keep = jvm.java.util.HashSet()
            keep.add(t)  # (a Scala set is a function of the partition index)
            only = jvm.scala.jdk.javaapi.CollectionConverters.asScala(keep)
            for rdd in rdds:
                pieces.append(jvm.org.apache.spark.rdd.PartitionPruningRDD.create(rdd, only))
        context = self.spark._jsparkSession.sparkContext()
        row = jvm.java.lang.Class.forName("org.apache.spark.sql.catalyst.InternalRow")
        union = context.union(self._scala_seq(pieces), jvm.scala.reflect.ClassTag.apply(row))
        if int(union.getNumPartitions()) != k * tasks:
            return None
        schema = StructType([
            StructField(f.name, f.dataType, any(fr.schema.fields[i].nullable for fr in frames))
            for i, f in enumerate(frames[0].schema.fields)])
        jdf = self.spark._jsparkSession.internalCreateDataFrame(
            union, self.spark._jsparkSession.parseDataType(schema.json()), False)
        return PyDataFrame(jdf, self.spark), [reads[b][t] for t in range(tasks)
                                              for b in range(k)]

    def replace_plan(self, df: DataFrame, path: tuple[int, ...],
                     replacement: DataFrame) -> DataFrame | None:
        jvm = self.spark._jvm
        assert jvm is not None
        expressions = jvm.org.apache.spark.sql.catalyst.expressions
        logical = jvm.org.apache.spark.sql.catalyst.plans.logical
        root = df._jdf.queryExecution().analyzed()
        old = _at(root, path)
        new = replacement._jdf.queryExecution().analyzed()
        old_out, new_out = _seq(old.output()), _seq(new.output())
        if len(old_out) != len(new_out):
            return None
        # the replacement's columns under the replaced node's attribute ids (what the plan
        # above it refers to), names and qualifiers
        aliases = [expressions.Alias(n, o.name(), o.exprId(), o.qualifier(),
                                     jvm.scala.Option.apply(None), self._scala_seq([]))
                   for o, n in zip(old_out, new_out, strict=True)]
        replaced = logical.Project(self._scala_seq(aliases), new)

        def rebuild(plan: Any, rest: tuple[int, ...]) -> Any:
            if not rest:
                return replaced
            children = _seq(plan.children())
            children[rest[0]] = rebuild(children[rest[0]], rest[1:])
            return plan.withNewChildren(self._scala_seq(children))

        return self._frame(rebuild(root, path))

    def _scala_seq(self, items: list[Any]) -> Any:
        jvm = self.spark._jvm
        assert jvm is not None
        java_list = jvm.java.util.ArrayList()
        for item in items:
            java_list.add(item)
        return jvm.scala.jdk.javaapi.CollectionConverters.asScala(java_list).toSeq()

    def session_id(self) -> str | None:
        return None

    def session_user(self) -> str | None:
        return None

    def interrupt_session(self, session_id: str, tag: str, user: str | None) -> list[str]:
        return []  # a classic driver's jobs end with its JVM

    @contextlib.contextmanager
    def operation_id(self, operation_id: str) -> Iterator[None]:
        yield  # a classic driver's jobs end with its JVM: nothing to find again

    def await_operation(self, session_id: str, user: str | None, operation_id: str,
                        timeout_s: float, *, clock: Clock | None = None) -> str:
        return "gone"
