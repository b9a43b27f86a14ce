"""How many groups a wave of input splits holds, estimated from a sample of two splits.

A partial vertex aggregates a whole wave of its input's splits (tens of millions of rows), so
what it writes is one row per group *of the wave*. A sample of a few hundred thousand rows
sees fewer groups than the wave holds, but how many more the wave holds depends on where the
groups are:

* groups that recur everywhere in the input (carrier × month × aircraft, read in any order)
  saturate: a wave of 60 million rows holds the same million groups a sample half-sees, and
  the unseen ones can be counted from how many groups the sample saw once and twice
  (Chao's estimator of unseen classes, extrapolated to the wave's rows);
* groups that live in one part of the input (events per user and day, written by time) do
  not: every split brings its own, and the wave holds as many groups per row as the sample.

Which of the two holds is measured, not assumed: the sample is two halves, the first rows of
the wave's first split and a random sample of its last split, and the groups the halves share
are compared with what two halves drawn at random from the same rows would share, on the rare
groups the extrapolation counts from (frequent groups that recur everywhere must not vouch for
rare ones that live in one split). A random sample on one side also catches files sorted or
clustered by the key, whose first rows hold only the first keys. Groups that recur as they
would at random, and whose sizes look alike (ACE's coefficient of variation: a skewed key's
long tail is what Chao's estimate, a lower bound, cannot see), are extrapolated; otherwise the
estimate scales with the rows, and the planner keeps the sample split's own ratio.

The extrapolation reaches far past the sample (a hundredfold and more), where Chao's estimate
is exact only for groups of alike sizes: that is what the checks above guard, and why an
estimate that does not pass them is not used at all.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pyspark.sql import DataFrame

__all__ = ["GroupStats", "WaveEstimate", "estimate_wave_groups", "group_stats"]

# Observed / expected overlap of the two halves' groups at or above which groups recur
RECUR_MIN = 0.8
# Groups seen / groups extrapolated from the sample's first half above which the sample shows a
# long tail the extrapolation would understate
TAIL_MAX = 1.05
# ACE's squared coefficient of variation of group sizes above which groups are taken as skewed
SPREAD_MAX = 0.1
# Expected overlap, as a share of the groups seen, below which the test says nothing (every
# group seen once: no recurrence is visible in the sample either way)
OVERLAP_MIN = 0.02

_ROWS, _HALF = "__sck_rows", "__sck_half"
_C, _A, _K = "__sck_c", "__sck_a", "__sck_k"  # rows in a group, of which in half a; groups
# Groups of at most this many rows in the sample are rare: what the estimates count from
RARE = 10


@dataclasses.dataclass(frozen=True)
class GroupStats:
    """Group sizes in a sample made of two halves, a and b: ``pairs`` maps (rows in a group,
    of which in half a) to the number of such groups."""

    pairs: dict[tuple[int, int], int]

    @property
    def histogram(self) -> dict[int, int]:
        """Rows in a group -> groups with that many rows (both halves)."""
        out: dict[int, int] = {}
        for (c, _a), k in self.pairs.items():
            out[c] = out.get(c, 0) + k
        return out

    @property
    def histogram_a(self) -> dict[int, int]:
        """The same, in half a alone."""
        out: dict[int, int] = {}
        for (_c, a), k in self.pairs.items():
            if a:
                out[a] = out.get(a, 0) + k
        return out

    @property
    def rows_a(self) -> int:
        return sum(a * k for (_c, a), k in self.pairs.items())

    @property
    def rows(self) -> int:
        return sum(c * k for (c, _a), k in self.pairs.items())

    @property
    def groups(self) -> int:
        return sum(self.pairs.values())

    def overlap(self, lo: int = 1, hi: int | None = None) -> tuple[float, int, int]:
        """Groups of ``lo``..``hi`` rows: (expected in both halves were the rows split at
        random, observed in both, how many such groups)."""
        p = self.rows_a / self.rows if self.rows else 0.0
        expected, observed, groups = 0.0, 0, 0
        for (c, a), k in self.pairs.items():
            if c < lo or (hi is not None and c > hi):
                continue
            expected += k * (1 - p ** c - (1 - p) ** c)
            observed += k if 0 < a < c else 0
            groups += k
        return expected, observed, groups


@dataclasses.dataclass(frozen=True)
class WaveEstimate:
    groups: float  # estimated groups in a wave
    recur: bool  # groups recur across splits (extrapolated), or not (scaled with the rows)
    why: str


def estimate_wave_groups(stats: GroupStats, wave_rows: int) -> WaveEstimate:
    """Expected groups among ``wave_rows`` rows, from the sample's ``stats``."""
    n, g = stats.rows, stats.groups
    if g == 0 or n == 0:
        return WaveEstimate(0.0, False, "the sample has no rows")
    linear = g * max(wave_rows, n) / n
    if wave_rows <= n:
        return WaveEstimate(float(g), False, "the sample is the wave")
    if stats.rows_a == 0 or stats.rows_a == n:
        return WaveEstimate(linear, False, "one split only: scaled with the rows")
    # The test is on the rare groups (2 to RARE rows in the sample), the ones the
    # extrapolation counts from: frequent groups that recur everywhere must not vouch for
    # rare ones that live in one split. Where there are too few rare ones, on all groups
    expected, observed, rare = stats.overlap(2, RARE)
    if rare == 0 or expected < OVERLAP_MIN * rare:
        expected, observed, _all = stats.overlap()
        if expected < OVERLAP_MIN * g:
            return WaveEstimate(linear, False, "groups too rare in the sample to tell "
                                "whether they recur: scaled with the rows")
    share = observed / expected
    if share < RECUR_MIN:
        return WaveEstimate(linear, False, f"the two splits share {share:.0%} of the groups "
                            "random halves would: groups are local, scaled with the rows")
    # Chao's estimate is exact for groups of one size and a lower bound for groups of many
    # sizes (a skewed key: a long tail it cannot see): extrapolated only where the sample's
    # rare groups look alike (ACE's coefficient of variation; Chao and Lee 1992)
    spread = _variation(stats.histogram)
    if spread > SPREAD_MAX:
        return WaveEstimate(linear, False, f"group sizes vary (squared coefficient of "
                            f"variation {spread:.2f}): a skewed key, scaled with the rows")
    # the extrapolation, checked where it can be: from half a to the whole sample
    predicted = _extrapolate(stats.histogram_a, stats.rows_a, n)
    if g > TAIL_MAX * predicted:
        return WaveEstimate(linear, False, f"the sample's groups grow faster than an "
                            f"extrapolation from its first half predicts ({g:,} seen, "
                            f"{predicted:,.0f} predicted): a long tail, scaled with the rows")
    groups = min(float(wave_rows), _extrapolate(stats.histogram, n, wave_rows))
    return WaveEstimate(groups, True, f"groups recur across splits ({share:.0%} of random "
                        f"halves' overlap): about {groups:,.0f} in a wave of {wave_rows:,} "
                        "rows, extrapolated from the groups seen once and twice")


def _variation(histogram: dict[int, int]) -> float:
    """ACE's estimate of the squared coefficient of variation of group sizes, over the groups
    seen at most ``RARE`` times (0 for groups of one size)."""
    f1 = histogram.get(1, 0)
    rows = sum(c * k for c, k in histogram.items() if c <= RARE)
    groups = sum(k for c, k in histogram.items() if c <= RARE)
    if rows <= 1:
        return 0.0  # no rare groups: every group seen many times
    if f1 >= rows:
        return math.inf  # every rare group seen once: nothing to tell
    coverage = 1 - f1 / rows
    pairs = sum(c * (c - 1) * k for c, k in histogram.items() if c <= RARE)
    return max(groups / coverage * pairs / (rows * (rows - 1)) - 1, 0.0)


def _extrapolate(histogram: dict[int, int], rows: int, to_rows: int) -> float:
    """Expected groups among ``to_rows`` rows, from ``rows`` rows' histogram of group sizes
    (Chao's unseen-class estimate, extrapolated; Chao et al. 2014)."""
    g = sum(histogram.values())
    f1, f2 = histogram.get(1, 0), histogram.get(2, 0)
    unseen = f1 * (f1 - 1) / (2 * (f2 + 1))  # Chao1, bias-corrected
    if unseen <= 0 or f1 <= 0 or to_rows <= rows:
        return float(g)
    return g + unseen * (1 - math.exp(-(to_rows - rows) * f1 / (rows * unseen)))


def group_stats(half_a: DataFrame, half_b: DataFrame) -> GroupStats:
    """Stats of two frames' rows per group, each frame a group-count frame (its key columns and
    ``__sck_rows``, from :meth:`AggSplit.group_counts`): one Spark job, a small result."""
    from pyspark.sql import functions as F

    keys = [c for c in half_a.columns if c != _ROWS]
    tagged = half_a.withColumn(_HALF, F.lit(0)).unionByName(half_b.withColumn(_HALF, F.lit(1)))
    per_group = tagged.groupBy(*[F.col(_q(k)) for k in keys]).agg(
        F.sum(_ROWS).alias(_C),
        F.sum(F.when(F.col(_HALF) == 0, F.col(_ROWS)).otherwise(0)).alias(_A))
    rows = per_group.groupBy(_C, _A).agg(F.count(F.lit(1)).alias(_K)).collect()
    return GroupStats(pairs={(int(r[_C]), int(r[_A])): int(r[_K]) for r in rows})


def _q(name: str) -> str:
    return "`" + name.replace("`", "``") + "`"
