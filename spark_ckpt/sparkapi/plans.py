"""Reading Spark's physical plan text: pure functions over what ``SparkApi.executed_plan``
answers (classic and Spark Connect print the same text), with no handle into Spark.

The only place spark_ckpt names the plan's words (``Exchange``, ``REPARTITION_BY_NUM``,
``[plan_id=...]``): tests/test_seam.py checks that no module outside spark_ckpt/sparkapi does.
"""

from __future__ import annotations

import re

__all__ = ["exchanges", "normalized", "only_repartitions_by_number", "shuffles"]

# an exchange that moves rows between partitions (a broadcast copies them to every one)
_EXCHANGE = re.compile(r"(?<!Broadcast)Exchange ")
_SHUFFLE = re.compile(r"(?<!Broadcast)Exchange |\bUnion\b|\bCoalesce\b")


def normalized(plan: str) -> str:
    """A plan's text without what differs between two analyses of one plan: expression ids
    (``#12``, ``#12L``) and plan ids."""
    plan = re.sub(r"#\d+L?", "", plan)
    return re.sub(r",? ?\[plan_id=\d+\]", "", plan).strip()


def shuffles(plan: str) -> bool:
    """True when the physical plan moves rows between partitions (broadcasts do not)."""
    return bool(_SHUFFLE.search(plan))


def exchanges(plan: str) -> list[str]:
    """The exchanges in the physical plan, without expression ids: what Spark moves."""
    out = []
    for line in plan.splitlines():
        if "Exchange " not in line:
            continue
        text = line[line.index("Exchange ") - (9 if "BroadcastExchange " in line else 0):]
        out.append(normalized(text))
    return out


def only_repartitions_by_number(plan: str) -> bool:
    """True when every exchange moving rows in the physical plan is a user's repartition by
    number: adaptive execution may coalesce or split the exchanges Spark adds itself
    (``ENSURE_REQUIREMENTS``), never those."""
    return all(not _EXCHANGE.search(line) or "REPARTITION_BY_NUM" in line
               for line in plan.splitlines())
