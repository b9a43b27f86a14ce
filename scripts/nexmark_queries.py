"""Nexmark queries as Flink's nexmark suite defines them, written with spark_ckpt's operators,
each with its reference: the same query as batch Spark SQL over all events.

``QUERIES[name] = (streaming, reference, mode)``:

- ``streaming(events)`` builds the query on the event stream (``file_input``: the
  generator's files, or ``kafka_input``: its Kafka topic; either with
  ``with_watermark("dateTime", "4 seconds")``, as Flink's DDL, and the same columns);
- ``reference(spark, events)`` is batch Spark over every event (a DataFrame of the same rows);
- ``mode``: ``"append"`` (every row once: compare all rows), ``"upsert:<keys>"`` (an update
  stream: the last row per key is the answer), or ``"closed:<column>[+ms]"`` (windows the
  final watermark closes: the reference keeps the rows whose column, plus ms, is at or before
  it; ``"closed-window:<time column>:<size ms>"``: the rows whose tumbling window it closes).

Built: q0–q5, q7–q22 (q5 also outputs its window's start, to compare the windows the final
watermark closes; q6 is left out, as Flink leaves it out). q12's processing-time windows take
each batch's time on the pipeline's clock, so its reference (``q12_reference``) is computed from
the run's batch times (``mode`` ``"proctime"``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import nexmark_gen
import nexmark_sql
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from spark_ckpt.state import count, count_distinct, max_, mean, min_, sum_
from spark_ckpt.streaming import session, sliding, tumbling

WATERMARK_DELAY = "4 seconds"


def file_input(ctx: Any, path: str, max_files_per_batch: int | None = None,
               name: str = "events") -> Any:
    """The generator's Parquet files under ``path`` (``nexmark_gen.write``), watermarked."""
    return ctx.file_stream(name, path, "parquet", nexmark_gen.SPARK_SCHEMA,
                           max_files_per_batch=max_files_per_batch) \
        .with_watermark("dateTime", WATERMARK_DELAY)


def kafka_input(ctx: Any, bootstrap: str, topic: str, max_offsets_per_batch: int | None = None,
                name: str = "events", **kafka: Any) -> Any:
    """The generator's Kafka topic (``nexmark_gen.produce``) from its earliest offsets, each
    JSON value parsed into ``nexmark_gen.SPARK_SCHEMA``: the columns and types of
    ``file_input``, so every query runs on either (``kafka``: more ``kafka_stream``
    arguments, such as ``options`` or ``reader``)."""
    return ctx.kafka_stream(name, bootstrap, topics=[topic], starting_offsets="earliest",
                            max_offsets_per_batch=max_offsets_per_batch, value_format="json",
                            value_schema=nexmark_gen.SPARK_SCHEMA, **kafka) \
        .with_watermark("dateTime", WATERMARK_DELAY)


def persons(events: Any) -> Any:
    return events.filter("event_type = 0").select("person.*")


def auctions(events: Any) -> Any:
    return events.filter("event_type = 1").select("auction.*")


def bids(events: Any) -> Any:
    return events.filter("event_type = 2").select("bid.*")


# -- q0 pass-through, q1 currency conversion, q2 selection ----------------------------------
def q0(events: Any) -> Any:
    return bids(events).select("auction", "bidder", "price", "dateTime", "extra")


def q1(events: Any) -> Any:
    return bids(events).select("auction", "bidder", (F.lit(0.908) * F.col("price"))
                               .alias("price"), "dateTime", "extra")


def q2(events: Any) -> Any:
    return bids(events).filter("auction % 123 = 0").select("auction", "price")


# -- q3 local item suggestion: a join without a time bound (Flink's regular join) -----------
def q3(events: Any) -> Any:
    a = auctions(events).filter("category = 10") \
        .select(F.col("id"), F.col("seller"), F.col("dateTime").alias("a_time"))
    p = persons(events).filter("state IN ('OR', 'ID', 'CA')") \
        .select(F.col("id").alias("seller"), "name", "city", "state",
                F.col("dateTime").alias("p_time"))
    return a.join_stream(p, "seller", "inner", ttl="1 hour", name="q3") \
        .select("name", "city", "state", "id")


def q3_reference(spark: SparkSession, ev: DataFrame) -> DataFrame:
    a = ev.where("event_type = 1").select("auction.*").where("category = 10")
    p = ev.where("event_type = 0").select("person.*").where("state IN ('OR', 'ID', 'CA')")
    return a.join(p, a.seller == p.id).select(p.name, p.city, p.state, a.id)


# -- q4 average winning price per category -------------------------------------------------
def q4(events: Any) -> Any:
    a = auctions(events).select(F.col("id").alias("auction"), "category",
                                F.col("dateTime").alias("a_time"), "expires") \
        .with_watermark("a_time", WATERMARK_DELAY)
    b = bids(events).select("auction", "price", F.col("dateTime").alias("b_time")) \
        .with_watermark("b_time", WATERMARK_DELAY)
    winning = a.join_stream(b, "auction", "inner", between=("0 seconds", "610 seconds"),
                            name="q4_join").filter("b_time <= expires") \
        .key_by("auction", "category").agg("q4_max", final=max_("price"))
    # Flink retracts a category's old maximum when it grows; here each batch averages the
    # whole state of maxima (Structured Streaming's complete mode)
    return winning.full_state().transform(
        lambda df: df.groupBy("category").agg(F.avg("final").alias("avg_final")))


def q4_reference(spark: SparkSession, ev: DataFrame) -> DataFrame:
    ev.where("event_type = 1").select("auction.*").createOrReplaceTempView("auction")
    ev.where("event_type = 2").select("bid.*").createOrReplaceTempView("bid")
    return spark.sql("""
        SELECT Q.category, AVG(Q.final) AS avg_final FROM (
          SELECT MAX(B.price) AS final, A.category FROM auction A, bid B
          WHERE A.id = B.auction AND B.dateTime BETWEEN A.dateTime AND A.expires
          GROUP BY A.id, A.category) Q
        GROUP BY Q.category""")


# -- q5 hot items: the auctions with the most bids in each sliding window --------------------
def q5(events: Any) -> Any:
    counts = bids(events).key_by("auction").window(sliding("10 seconds", "2 seconds")) \
        .agg(name="q5_counts", num=count()) \
        .select("auction", "num", F.col("window.start").alias("starttime"),
                F.col("window.end").alias("endtime"), F.window_time("window").alias("wt"))
    # the largest count per window runs with the counts' watermark (declares none), so it
    # closes a window in the batch the counts emit it
    maxes = counts.key_by("starttime", "endtime").window(tumbling("2 seconds", on="wt")) \
        .agg(name="q5_max", maxn=max_("num")) \
        .select("starttime", "endtime", "maxn", F.window_time("window").alias("mt")) \
        .with_watermark("mt", "0 seconds")
    return counts.with_watermark("wt", "0 seconds") \
        .join_stream(maxes, ["starttime", "endtime"], "inner",
                     between=("0 seconds", "0 seconds"), name="q5") \
        .filter("num >= maxn").select("auction", "num", "starttime")


def q5_reference(spark: SparkSession, ev: DataFrame) -> DataFrame:
    ev.where("event_type = 2").select("bid.*").createOrReplaceTempView("bid")
    return spark.sql("""
        WITH counts AS (
          SELECT auction, count(*) AS num, window.start AS starttime, window.end AS endtime
          FROM bid GROUP BY auction, window(dateTime, '10 seconds', '2 seconds'))
        SELECT C.auction, C.num, C.starttime FROM counts C JOIN (
          SELECT max(num) AS maxn, starttime, endtime FROM counts
          GROUP BY starttime, endtime) M
        ON C.starttime = M.starttime AND C.endtime = M.endtime AND C.num >= M.maxn""")


# -- q7 highest bid per window: a window's maximum joined back with its bids -----------------
def q7(events: Any) -> Any:
    b = bids(events)
    maxes = b.with_column("all", F.lit(1)).key_by("all").window(tumbling("10 seconds")) \
        .agg(name="q7_max", maxprice=max_("price")) \
        .select(F.col("maxprice").alias("price"),  # TUMBLE_ROWTIME: the window's end - 1 ms
                (F.col("window.end") - F.expr("INTERVAL 1 millisecond")).alias("m_time")) \
        .with_watermark("m_time", "0 seconds")
    return b.select("auction", "price", "bidder", "dateTime", "extra") \
        .join_stream(maxes, "price", "inner", between=("0 seconds", "10 seconds"), name="q7") \
        .select("auction", "price", "bidder", "dateTime", "extra")


def q7_reference(spark: SparkSession, ev: DataFrame) -> DataFrame:
    ev.where("event_type = 2").select("bid.*").createOrReplaceTempView("bid")
    return spark.sql("""
        SELECT B.auction, B.price, B.bidder, B.dateTime, B.extra FROM bid B JOIN (
          SELECT MAX(price) AS maxprice, window.end - INTERVAL 1 millisecond AS dateTime
          FROM bid GROUP BY window(dateTime, '10 seconds')) B1
        ON B.price = B1.maxprice
        WHERE B.dateTime BETWEEN B1.dateTime - INTERVAL 10 SECONDS AND B1.dateTime""")


# -- q8 new users: persons and their auctions in the same 10-second window ------------------
def q8(events: Any) -> Any:
    def windowed(stream: Any, key: str, name: str, prefix: str) -> Any:
        keys = ("id", "name") if key == "id" else (key,)
        return stream.key_by(*keys).window(tumbling("10 seconds")) \
            .agg(name=name, n=count()) \
            .select(*[F.col(k) for k in keys if k != key], F.col(key).alias("id"),
                    F.col("window.start").alias("starttime"),
                    F.window_time("window").alias(f"{prefix}_time")) \
            .with_watermark(f"{prefix}_time", "0 seconds")
    p = windowed(persons(events), "id", "q8_persons", "p")
    a = windowed(auctions(events), "seller", "q8_sellers", "a")
    return p.join_stream(a, ["id", "starttime"], "inner", between=("0 seconds", "0 seconds"),
                         name="q8").select("id", "name", "starttime")


def q8_reference(spark: SparkSession, ev: DataFrame) -> DataFrame:
    ev.where("event_type = 0").select("person.*").createOrReplaceTempView("person")
    ev.where("event_type = 1").select("auction.*").createOrReplaceTempView("auction")
    return spark.sql("""
        SELECT P.id, P.name, P.starttime FROM (
          SELECT id, name, window.start AS starttime, window.end AS endtime FROM person
          GROUP BY id, name, window(dateTime, '10 seconds')) P
        JOIN (
          SELECT seller, window.start AS starttime, window.end AS endtime FROM auction
          GROUP BY seller, window(dateTime, '10 seconds')) A
        ON P.id = A.seller AND P.starttime = A.starttime AND P.endtime = A.endtime""")


# -- q9 winning bids: each auction's highest bid before it expires ---------------------------
def q9(events: Any) -> Any:
    a = auctions(events).select(F.col("id").alias("auction"), "itemName", "description",
                                "initialBid", "reserve", "dateTime", "expires", "seller",
                                "category", "extra")
    b = bids(events).select("auction", "bidder", "price",
                            F.col("dateTime").alias("bid_dateTime"),
                            F.col("extra").alias("bid_extra")) \
        .with_watermark("bid_dateTime", WATERMARK_DELAY)
    # a bid between the auction's start and its expiry (at most 610 s later, the generator's)
    joined = a.join_stream(b, "auction", "inner", between=("0 seconds", "610 seconds"),
                           name="q9_join").filter("bid_dateTime <= expires")
    return joined.key_by("auction").top_n(1, [("price", "desc"), ("bid_dateTime", "asc")],
                                          name="q9") \
        .select(F.col("auction").alias("id"), "itemName", "description", "initialBid",
                "reserve", "dateTime", "expires", "seller", "category", "extra", "auction",
                "bidder", "price", "bid_dateTime", "bid_extra")


def q9_reference(spark: SparkSession, ev: DataFrame) -> DataFrame:
    ev.where("event_type = 1").select("auction.*").createOrReplaceTempView("auction")
    ev.where("event_type = 2").select("bid.*").createOrReplaceTempView("bid")
    return spark.sql("""
        SELECT id, itemName, description, initialBid, reserve, dateTime, expires, seller,
          category, extra, auction, bidder, price, bid_dateTime, bid_extra FROM (
          SELECT A.*, B.auction, B.bidder, B.price, B.dateTime AS bid_dateTime,
            B.extra AS bid_extra, ROW_NUMBER() OVER (PARTITION BY A.id
              ORDER BY B.price DESC, B.dateTime ASC) AS rownum
          FROM auction A, bid B
          WHERE A.id = B.auction AND B.dateTime BETWEEN A.dateTime AND A.expires)
        WHERE rownum <= 1""")


# -- q10 log to a file system, partitioned by day and minute ---------------------------------
def _q10(b: Any) -> Any:
    return b.select("auction", "bidder", "price", "dateTime", "extra",
                    F.date_format("dateTime", "yyyy-MM-dd").alias("dt"),
                    F.date_format("dateTime", "HH:mm").alias("hm"))


def q10(events: Any) -> Any:
    return _q10(bids(events))


# -- q13 a bounded side input, joined by key -------------------------------------------------
def side_input(spark: SparkSession) -> DataFrame:
    return spark.range(10_000).select(F.col("id").alias("key"),
                                      F.concat(F.lit("value-"), F.col("id").cast("string"))
                                      .alias("value"))


def q13(events: Any) -> Any:
    spark = events.pipeline.spark
    return bids(events).with_column("key", F.col("auction") % 10_000) \
        .join_static(side_input(spark), "key") \
        .select("auction", "bidder", "price", "dateTime", "value")


def q13_reference(spark: SparkSession, ev: DataFrame) -> DataFrame:
    b = ev.where("event_type = 2").select("bid.*")
    return b.join(side_input(spark), (b.auction % 10_000) == F.col("key")) \
        .select("auction", "bidder", "price", "dateTime", "value")


# -- q16 channel statistics per day ------------------------------------------------------------
def q16(events: Any) -> Any:
    b = _ranked(bids(events).with_column("day", F.date_format("dateTime", "yyyy-MM-dd"))
                .with_column("minute", F.date_format("dateTime", "HH:mm")))
    return b.key_by("channel", "day").window(tumbling("1 day"), output_mode="update") \
        .agg(name="q16", minute=max_("minute"), **_rank_counts()) \
        .transform(lambda df: df.drop("window"))


def q16_reference(spark: SparkSession, ev: DataFrame) -> DataFrame:
    ev.where("event_type = 2").select("bid.*").createOrReplaceTempView("bid")
    return spark.sql("""
        SELECT channel, DATE_FORMAT(dateTime, 'yyyy-MM-dd') AS day,
          max(DATE_FORMAT(dateTime, 'HH:mm')) AS minute,""" + _RANK_SQL + """
        FROM bid GROUP BY channel, DATE_FORMAT(dateTime, 'yyyy-MM-dd')""")


# -- q11 user sessions ------------------------------------------------------------------------
def q11(events: Any) -> Any:
    return bids(events).key_by("bidder").window(session("10 seconds")) \
        .agg(name="q11", bid_count=count()) \
        .select("bidder", "bid_count", F.col("window.start").alias("starttime"),
                F.col("window.end").alias("endtime"))


def q11_reference(spark: SparkSession, ev: DataFrame) -> DataFrame:
    b = ev.where("event_type = 2").select("bid.*")
    return b.groupBy("bidder", F.session_window("dateTime", "10 seconds").alias("w")) \
        .agg(F.count(F.lit(1)).alias("bid_count")) \
        .select("bidder", "bid_count", F.col("w.start").alias("starttime"),
                F.col("w.end").alias("endtime"))


# -- q12 processing-time windows: each batch's bids at its batch's time on the pipeline's clock
def q12(events: Any) -> Any:
    return bids(events).key_by("bidder").window(tumbling("10 seconds", processing_time=True)) \
        .agg(name="q12", bid_count=count()) \
        .select("bidder", "bid_count", F.col("window.start").alias("starttime"),
                F.col("window.end").alias("endtime"))


def q12_reference(spark: SparkSession, ev: DataFrame, file_times_ms: dict[str, int],
                  close_ms: int) -> DataFrame:
    """q12 as batch Spark given the run's batches: each file's bids at the time of the batch
    that read it (``file_times_ms``: file name -> batch time), the windows that ``close_ms``
    (the last batch's time) closes: a processing-time window closes in the first batch at or
    after its end."""
    stamps = spark.createDataFrame(sorted(file_times_ms.items()), "file STRING, stamp_ms BIGINT")
    b = ev.withColumn("file", F.regexp_extract(F.input_file_name(), r"([^/]+)$", 1)) \
        .where("event_type = 2").select("bid.bidder", "file").join(F.broadcast(stamps), "file")
    w = F.window(F.timestamp_millis("stamp_ms"), "10 seconds")
    return b.groupBy("bidder", w.alias("w")).agg(F.count(F.lit(1)).alias("bid_count")) \
        .where(F.unix_millis(F.col("w.end")) <= F.lit(close_ms)) \
        .select("bidder", "bid_count", F.col("w.start").alias("starttime"),
                F.col("w.end").alias("endtime"))


def batch_files(ctx: Any, progress: list[dict[str, Any]], source: str = "events",
                operator: str = "q12") -> dict[str, int]:
    """File name -> the processing time the operator stamped the batch that read it with
    (the batch's watermark: its time, or the last batch's if the clock read earlier), from
    the run's allocations."""
    times = {}
    for p in progress:
        piece = ctx.allocation(p["batch_id"]).pieces.get(source) or {}
        stamp = (p.get("state") or {}).get(operator, {}).get("watermark_ms")
        for path, *_rest in piece.get("files", []):
            times[str(path).rsplit("/", 1)[-1]] = int(stamp if stamp is not None
                                                      else p["batch_time_ms"])
    return times


# -- q14 calculation --------------------------------------------------------------------------
def _q14(b: Any) -> Any:
    hour = F.hour("dateTime")
    price = F.lit(0.908) * F.col("price")
    return b.filter((price > 1_000_000) & (price < 50_000_000)).select(
        "auction", "bidder", price.alias("price"),
        F.when((hour >= 8) & (hour <= 18), "dayTime")
        .when((hour <= 6) | (hour >= 20), "nightTime").otherwise("otherTime")
        .alias("bidTimeType"), "dateTime", "extra",
        (F.length("extra") - F.length(F.regexp_replace("extra", "c", ""))).alias("c_counts"))


def q14(events: Any) -> Any:
    return _q14(bids(events))


# -- q15, q17: statistics per day (Flink: an unbounded GROUP BY, an update stream) ----------
_RANKS = ((None, 10_000), (10_000, 1_000_000), (1_000_000, None))


def _ranked(b: Any) -> Any:
    """Bids with r1..r3 (1 where the price is in that rank) and the rank's bidder and auction
    (null outside it): count() and count_distinct() of them are Flink's FILTER clauses."""
    for rank, (low, high) in enumerate(_RANKS, start=1):
        cond = F.lit(True)
        if low is not None:
            cond = cond & (F.col("price") >= low)
        if high is not None:
            cond = cond & (F.col("price") < high)
        b = b.with_column(f"r{rank}", F.when(cond, F.lit(1))) \
            .with_column(f"r{rank}_bidder", F.when(cond, F.col("bidder"))) \
            .with_column(f"r{rank}_auction", F.when(cond, F.col("auction")))
    return b


def _rank_counts() -> dict[str, Any]:
    out: dict[str, Any] = {"total_bids": count()}
    out |= {f"rank{r}_bids": count(f"r{r}") for r in (1, 2, 3)}
    for what in ("bidder", "auction"):
        out[f"total_{what}s"] = count_distinct(what)
        out |= {f"rank{r}_{what}s": count_distinct(f"r{r}_{what}") for r in (1, 2, 3)}
    return out


_RANK_SQL = nexmark_sql.RANK_SQL


def q15(events: Any) -> Any:
    b = _ranked(bids(events).with_column("day", F.date_format("dateTime", "yyyy-MM-dd")))
    return b.key_by("day").window(tumbling("1 day"), output_mode="update") \
        .agg(name="q15", **_rank_counts()).transform(lambda df: df.drop("window"))


def q15_reference(spark: SparkSession, ev: DataFrame) -> DataFrame:
    ev.where("event_type = 2").select("bid.*").createOrReplaceTempView("bid")
    return spark.sql("""
        SELECT DATE_FORMAT(dateTime, 'yyyy-MM-dd') AS day,""" + _RANK_SQL + """
        FROM bid GROUP BY DATE_FORMAT(dateTime, 'yyyy-MM-dd')""")


def q17(events: Any) -> Any:
    b = bids(events).with_column("day", F.date_format("dateTime", "yyyy-MM-dd")) \
        .with_column("r1", F.when(F.col("price") < 10_000, F.lit(1))) \
        .with_column("r2", F.when((F.col("price") >= 10_000) & (F.col("price") < 1_000_000),
                                  F.lit(1))) \
        .with_column("r3", F.when(F.col("price") >= 1_000_000, F.lit(1)))
    return b.key_by("auction", "day").window(tumbling("1 day"), output_mode="update").agg(
        name="q17", total_bids=count(), rank1_bids=count("r1"), rank2_bids=count("r2"),
        rank3_bids=count("r3"), min_price=min_("price"), max_price=max_("price"),
        avg_price=mean("price"), sum_price=sum_("price")) \
        .transform(lambda df: df.drop("window"))


def q17_reference(spark: SparkSession, ev: DataFrame) -> DataFrame:
    ev.where("event_type = 2").select("bid.*").createOrReplaceTempView("bid")
    return spark.sql("""
        SELECT auction, DATE_FORMAT(dateTime, 'yyyy-MM-dd') AS day,
          count(*) AS total_bids,
          count(*) FILTER (WHERE price < 10000) AS rank1_bids,
          count(*) FILTER (WHERE price >= 10000 AND price < 1000000) AS rank2_bids,
          count(*) FILTER (WHERE price >= 1000000) AS rank3_bids,
          min(price) AS min_price, max(price) AS max_price, avg(price) AS avg_price,
          sum(price) AS sum_price
        FROM bid GROUP BY auction, DATE_FORMAT(dateTime, 'yyyy-MM-dd')""")


# -- q18 last bid per bidder and auction, q19 top 10 bids per auction --------------------------
def q18(events: Any) -> Any:
    return bids(events).key_by("bidder", "auction").last_row("dateTime", name="q18")


def q18_reference(spark: SparkSession, ev: DataFrame) -> DataFrame:
    ev.where("event_type = 2").select("bid.*").createOrReplaceTempView("bid")
    return spark.sql("""
        SELECT auction, bidder, price, channel, url, dateTime, extra FROM (
          SELECT *, ROW_NUMBER() OVER (PARTITION BY bidder, auction ORDER BY dateTime DESC)
            AS rank_number FROM bid) WHERE rank_number <= 1""")


def q19(events: Any) -> Any:
    return bids(events).key_by("auction").top_n(10, [("price", "desc")], name="q19")


def q19_reference(spark: SparkSession, ev: DataFrame) -> DataFrame:
    ev.where("event_type = 2").select("bid.*").createOrReplaceTempView("bid")
    return spark.sql("""
        SELECT * FROM (
          SELECT *, CAST(ROW_NUMBER() OVER (PARTITION BY auction ORDER BY price DESC) AS INT)
            AS rank FROM bid) WHERE rank <= 10""")


# -- q20 expand a bid with its auction (a regular join), q21 channel id, q22 URL parts -------
def q20(events: Any) -> Any:
    b = bids(events).select("auction", "bidder", "price", "channel", "url",
                            F.col("dateTime").alias("b_dateTime"),
                            F.col("extra").alias("b_extra"))
    a = auctions(events).filter("category = 10").select(
        F.col("id").alias("auction"), "itemName", "description", "initialBid", "reserve",
        F.col("dateTime").alias("a_dateTime"), "expires", "seller", "category",
        F.col("extra").alias("a_extra"))
    return b.join_stream(a, "auction", "inner", ttl="1 hour", name="q20")


def q20_reference(spark: SparkSession, ev: DataFrame) -> DataFrame:
    b = ev.where("event_type = 2").select("bid.*")
    a = ev.where("event_type = 1").select("auction.*").where("category = 10")
    return b.join(a, b.auction == a.id).select(
        b.auction, "bidder", "price", "channel", "url", b.dateTime.alias("b_dateTime"),
        b.extra.alias("b_extra"), "itemName", "description", "initialBid", "reserve",
        a.dateTime.alias("a_dateTime"), "expires", "seller", "category",
        a.extra.alias("a_extra"))


def _q21(b: Any) -> Any:
    lower = F.lower("channel")
    return b.select("auction", "bidder", "price", "channel", F.when(lower == "apple", "0")
                    .when(lower == "google", "1").when(lower == "facebook", "2")
                    .when(lower == "baidu", "3")
                    .otherwise(F.regexp_extract("url", "(&|^)channel_id=([^&]*)", 2))
                    .alias("channel_id")) \
        .filter(F.col("channel_id").isNotNull() & (F.col("channel_id") != ""))


def q21(events: Any) -> Any:
    return _q21(bids(events))


def _q22(b: Any) -> Any:
    parts = F.split("url", "/")
    return b.select("auction", "bidder", "price", "channel",
                    F.try_element_at(parts, F.lit(4)).alias("dir1"),
                    F.try_element_at(parts, F.lit(5)).alias("dir2"),
                    F.try_element_at(parts, F.lit(6)).alias("dir3"))


def q22(events: Any) -> Any:
    return _q22(bids(events))


def _unchecked(b: Any) -> Any:
    raise NotImplementedError("q12's reference depends on the run's batches: q12_reference")


def _stateless(fn: Callable[[Any], Any]) -> Callable[[SparkSession, DataFrame], DataFrame]:
    """The reference of a stateless query: the same expressions over all bids."""
    def reference(spark: SparkSession, ev: DataFrame) -> DataFrame:
        result: DataFrame = fn(ev.where("event_type = 2").select("bid.*"))
        return result
    return reference


QUERIES: dict[str, tuple[Callable[[Any], Any], Callable[[SparkSession, DataFrame], DataFrame],
                         str]] = {
    "q0": (q0, _stateless(lambda b: b.select("auction", "bidder", "price", "dateTime",
                                             "extra")), "append"),
    "q1": (q1, _stateless(lambda b: b.select("auction", "bidder", (F.lit(0.908) *
                                                                   F.col("price"))
                                             .alias("price"), "dateTime", "extra")), "append"),
    "q2": (q2, _stateless(lambda b: b.filter("auction % 123 = 0").select("auction", "price")),
           "append"),
    "q3": (q3, q3_reference, "append"),
    "q4": (q4, q4_reference, "upsert:category"),
    "q5": (q5, q5_reference, "closed:starttime+10000"),
    "q7": (q7, q7_reference, "closed-window:dateTime:10000"),
    "q8": (q8, q8_reference, "closed:starttime+10000"),
    "q9": (q9, q9_reference, "upsert:auction"),
    "q10": (q10, _stateless(_q10), "append"),
    "q11": (q11, q11_reference, "closed:endtime"),
    "q12": (q12, _stateless(_unchecked), "proctime"),  # reference: q12_reference
    "q13": (q13, q13_reference, "append"),
    "q14": (q14, _stateless(_q14), "append"),
    "q15": (q15, q15_reference, "upsert:day"),
    "q16": (q16, q16_reference, "upsert:channel,day"),
    "q17": (q17, q17_reference, "upsert:auction,day"),
    "q18": (q18, q18_reference, "upsert:bidder,auction"),
    "q19": (q19, q19_reference, "upsert:auction,rank"),
    "q20": (q20, q20_reference, "append"),
    "q21": (q21, _stateless(_q21), "append"),
    "q22": (q22, _stateless(_q22), "append"),
}


# -- comparing a query's rows with its reference's ------------------------------------------
def closed(frame: Any, mode: str, final_watermark_ms: int, base_ms: int) -> Any:
    """The rows of the windows that the final watermark closes (all rows for other modes):
    ``closed:<end column>[+ms]`` and ``closed-window:<time column>:<size ms>`` (tumbling
    windows of that size from ``base_ms``)."""

    if mode.startswith("closed-window:"):
        _, column, size = mode.split(":")
        t = _micros(frame[column]) // 1000 - base_ms
        ends = base_ms + (t // int(size) + 1) * int(size)
        return frame[ends <= final_watermark_ms]
    if mode.startswith("closed:"):
        end, _, plus = mode.split(":")[1].partition("+")
        ends = _micros(frame[end]) // 1000 + int(plus or 0)
        return frame[ends <= final_watermark_ms]
    return frame


def comparable(got: Any, expected: Any, mode: str, final_watermark_ms: int,
               base_ms: int) -> tuple[Any, Any]:
    """A run's rows (pandas, each with its batch's id in ``__batch``) and its reference's
    (pandas), ``normal`` and comparable: an update stream's last row per key, the
    reference's rows of the windows ``final_watermark_ms`` closes."""
    if mode.startswith("upsert:"):
        keys = mode.split(":")[1].split(",")
        got = got.sort_values("__batch", kind="stable").groupby(keys, as_index=False).tail(1)
    expected = closed(expected, mode, final_watermark_ms, base_ms)
    return normal(got.drop(columns="__batch")), normal(expected)


def _micros(column: Any) -> Any:
    """A time column as UTC microseconds, whatever its unit (Spark's pandas are in ns,
    delta-rs' in µs) and zone (naive is UTC)."""
    import pandas as pd

    return pd.to_datetime(column, utc=True).dt.as_unit("us").astype("int64")


def normal(frame: Any, decimals: int = 6) -> Any:
    """``frame`` comparable row for row: floats rounded, times as UTC microseconds, columns
    and rows sorted."""
    import pandas as pd

    frame = frame.copy()
    for column in frame.columns:
        if frame[column].dtype == object and frame[column].map(
                lambda v: isinstance(v, float)).any():
            frame[column] = frame[column].astype(float)
        if pd.api.types.is_float_dtype(frame[column]):
            frame[column] = frame[column].round(decimals)
        if pd.api.types.is_datetime64_any_dtype(frame[column]):
            frame[column] = _micros(frame[column])
    cols = sorted(frame.columns)
    return frame[cols].sort_values(cols).reset_index(drop=True)
