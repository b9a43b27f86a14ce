"""How many groups a wave holds, estimated from two splits' samples: groups that recur across
splits are extrapolated, groups local to a split scale with the rows (batch.wave_groups)."""

from __future__ import annotations

import collections

import numpy as np
import pytest

from spark_ckpt.batch.wave_groups import GroupStats, estimate_wave_groups, group_stats


def _stats(a: np.ndarray, b: np.ndarray) -> GroupStats:
    """The stats group_stats computes, from two halves' group ids, in numpy."""
    counts = collections.Counter(a.tolist()) + collections.Counter(b.tolist())
    in_a = collections.Counter(a.tolist())
    return GroupStats(rows_a=len(a), rows_b=len(b), groups_a=len(in_a),
                      groups_b=len(set(b.tolist())),
                      histogram=dict(collections.Counter(counts.values())),
                      histogram_a=dict(collections.Counter(in_a.values())))


@pytest.mark.parametrize("groups", [2_000, 20_000, 200_000])
def test_groups_that_recur_everywhere_are_extrapolated_to_the_wave(groups):
    rng = np.random.default_rng(3)
    wave = rng.integers(0, groups, 4_000_000)
    stats = _stats(wave[:50_000], wave[-50_000:])
    got = estimate_wave_groups(stats, len(wave))
    truth = len(np.unique(wave))
    assert got.recur, got.why
    assert 0.85 * truth <= got.groups <= 1.15 * truth, (got, truth)
    assert got.groups < 0.5 * stats.groups * len(wave) / stats.rows or groups > 100_000


@pytest.mark.parametrize("exponent", [1.1, 1.3, 1.6, 2.5])
def test_a_long_tail_of_groups_is_never_understated_by_more_than_a_fifth(exponent):
    # a skewed key: Chao's estimate is a lower bound there, so where the sample shows groups
    # growing faster than it predicts, the estimate falls back to scaling with the rows
    rng = np.random.default_rng(4)
    wave = rng.zipf(exponent, 4_000_000) % 5_000_000
    got = estimate_wave_groups(_stats(wave[:50_000], wave[-50_000:]), len(wave))
    truth = len(np.unique(wave))
    assert got.groups >= 0.8 * truth, (got, truth)


def test_groups_local_to_each_split_scale_with_the_rows():
    # events per (user, day) written by time: each split has its own days, so the last split
    # of a wave shares no group with the first
    users = np.random.default_rng(5).integers(0, 20_000, 100_000)
    first, last = users[:50_000] * 1000 + 1, users[50_000:] * 1000 + 7
    stats = _stats(first, last)
    got = estimate_wave_groups(stats, 4_000_000)
    assert not got.recur and "local" in got.why
    assert got.groups == pytest.approx(stats.groups * 4_000_000 / 100_000)


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

    def frame(ids):
        return spark.createDataFrame([(int(i) % 50, int(i) // 50) for i in ids], "k1 int, k2 int") \
            .groupBy("k1", "k2").agg(F.count(F.lit(1)).alias("__sck_rows"))

    assert group_stats(frame(a), frame(b)) == _stats(a, b)
