"""How many groups a wave holds, estimated from two splits' samples: groups that recur across
splits are extrapolated, groups local to a split scale with the rows (batch.wave_groups)."""

from __future__ import annotations

import collections

import numpy as np
import pytest

from spark_ckpt.batch.wave_groups import GroupStats, estimate_wave_groups, group_stats


def _stats(a: np.ndarray, b: np.ndarray) -> GroupStats:
    """The stats group_stats computes, from two halves' group ids, in numpy."""
    in_a = collections.Counter(a.tolist())
    both = in_a + collections.Counter(b.tolist())
    return GroupStats(pairs=dict(collections.Counter((c, in_a.get(g, 0))
                                                     for g, c in both.items())))


@pytest.mark.parametrize("groups", [2_000, 20_000, 200_000])
def test_groups_that_recur_everywhere_are_extrapolated_to_the_wave(groups):
    rng = np.random.default_rng(3)
    wave = rng.integers(0, groups, 4_000_000)
    stats = _stats(wave[:50_000], wave[-50_000:])
    got = estimate_wave_groups(stats, len(wave))
    truth = len(np.unique(wave))
    assert got.recur, got.why
    assert 0.85 * truth <= got.groups <= 1.15 * truth, (got, truth)
    assert got.groups < 0.5 * stats.groups * len(wave) / stats.rows  # far below linear


@pytest.mark.parametrize("exponent", [1.1, 1.3, 1.6, 2.5])
def test_a_long_tail_of_groups_is_never_understated_by_more_than_a_fifth(exponent):
    # a skewed key: Chao's estimate is a lower bound there, so where the sample shows groups
    # growing faster than it predicts, the estimate falls back to scaling with the rows
    rng = np.random.default_rng(4)
    wave = rng.zipf(exponent, 4_000_000) % 5_000_000
    got = estimate_wave_groups(_stats(wave[:50_000], wave[-50_000:]), len(wave))
    truth = len(np.unique(wave))
    assert got.groups >= 0.8 * truth, (got, truth)
    assert not got.recur and ("skewed" in got.why or "long tail" in got.why), got.why


def test_groups_local_to_each_split_scale_with_the_rows():
    # events per (user, day) written by time, 8 splits of a few days each: the last split of
    # a wave shares no group with the first
    rng = np.random.default_rng(5)
    splits = [rng.integers(0, 20_000, 500_000) * 1000 + day for day in range(8)]
    wave = np.concatenate(splits)
    stats = _stats(splits[0][:50_000], rng.choice(splits[-1], 50_000, replace=False))
    got = estimate_wave_groups(stats, len(wave))
    assert not got.recur and "local" in got.why
    assert got.groups == pytest.approx(stats.groups * len(wave) / 100_000)
    assert got.groups >= 0.8 * len(np.unique(wave))


def test_rare_local_groups_behind_frequent_recurring_ones_are_not_extrapolated():
    # 3,000 groups everywhere (40 rows each in the sample) and 100,000 groups that live in
    # one split: the frequent ones share as random halves would, the rare ones not at all
    rng = np.random.default_rng(8)
    common = np.repeat(np.arange(3_000), 40)
    rng.shuffle(common)
    a = np.concatenate([common[:60_000], 10**6 + np.arange(50_000)])
    b = np.concatenate([common[60_000:], 10**7 + np.repeat(np.arange(500), 2)])
    got = estimate_wave_groups(_stats(a, b), 60_000_000)
    assert not got.recur, got.why


@pytest.mark.parametrize("a, b, why", [
    (np.arange(50_000), np.arange(50_000, 100_000), "too rare"),  # every group seen once
    (np.arange(10), np.array([], dtype=np.int64), "one split"),
])
def test_without_evidence_of_recurrence_the_estimate_is_linear(a, b, why):
    stats = _stats(a, b)
    got = estimate_wave_groups(stats, 1_000_000)
    assert not got.recur and why in got.why
    assert got.groups == pytest.approx(stats.groups * 1_000_000 / stats.rows)


def test_a_wave_no_larger_than_the_sample_holds_the_sample_s_groups():
    stats = _stats(np.arange(100) % 7, np.arange(100) % 5)
    assert estimate_wave_groups(stats, 150).groups == stats.groups


def test_group_stats_counts_what_numpy_counts(spark):
    from pyspark.sql import functions as F

    rng = np.random.default_rng(6)
    a, b = rng.integers(0, 3_000, 20_000), rng.integers(0, 3_000, 15_000)

    def frame(ids):  # keys named as the helper columns' short names once were
        return spark.createDataFrame([(int(i) % 50, int(i) // 50) for i in ids], "c int, hi int") \
            .groupBy("c", "hi").agg(F.count(F.lit(1)).alias("__sck_rows"))

    assert group_stats(frame(a), frame(b)) == _stats(a, b)


# -- in the planner: the same job, its files written two ways ---------------------------------
@pytest.fixture(scope="module")
def grouped_files(tmp_path_factory):
    """8 files of 120,000 rows over 40,000 (k1, k2) groups: in random order, and each file
    sorted by k2 (its first rows hold only the first keys)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(11)
    root = tmp_path_factory.mktemp("wave_groups")
    for layout in ("shuffled", "sorted"):
        (root / layout).mkdir()
        for f in range(8):
            k1 = rng.integers(0, 20, 120_000).astype(np.int32)
            k2 = rng.integers(0, 2_000, 120_000)
            if layout == "sorted":
                order = np.argsort(k2, kind="stable")
                k1, k2 = k1[order], k2[order]
            pq.write_table(pa.table({"k1": k1, "k2": pa.array([f"key{x:05d}" for x in k2]),
                                     "v": rng.random(120_000),
                                     "pad": pa.array(["p" * 12] * 120_000)}),
                           root / layout / f"part-{f}.parquet")
    return root


@pytest.mark.parametrize("layout, cut", [("shuffled", True), ("sorted", False)])
def test_the_planner_cuts_at_partials_a_wave_keeps_small_and_only_there(
        spark, grouped_files, tmp_path, monkeypatch, layout, cut):
    import dataclasses

    from pyspark.sql import functions as F

    from spark_ckpt import BatchJob, Settings
    from spark_ckpt.batch import cuts

    # a sample split of 20,000 rows sees ~13,000 groups (its partials ~60% of its bytes); a
    # wave of 8 splits holds the 40,000 groups of 960,000 rows (~3%), when they recur
    monkeypatch.setattr(cuts, "SAMPLE_ROWS", 20_000)
    settings = dataclasses.replace(Settings(progress="never"), batch_partitions_per_wave=8)
    job = BatchJob(f"wave-{layout}", spark=spark, work_dir=str(tmp_path / "work"),
                   settings=settings)
    rows = job.read_files("rows", str(grouped_files / layout))
    agg = job.vertex("agg", lambda df: df.groupBy("k1", "k2").agg(
        F.sum("v").alias("v"), F.count("*").alias("n")), rows.by("k1", "k2"), parallelism=4)
    job.write_delta(agg, str(tmp_path / "out"))
    plan = job.explain(show=False)
    if cut:
        reason = plan.cuts["agg-partial"].reason
        assert "groups recur across splits" in reason and "of a wave's input" in reason, reason
        assert plan.cuts["agg-partial"].ratio < 0.10
    else:
        assert "agg-partial" not in plan.cuts
        reason = plan.cuts["rows"].reason
        assert "of the input on a sample split" in reason and "groups are local" in reason, \
            reason
