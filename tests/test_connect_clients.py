"""The batch client kills of the Connect parity run (test_connect.py's PARITY), in a file of
their own so that the other xdist worker runs them beside the rest of the parity run."""

from __future__ import annotations

import pytest
from helpers import LONG_FAULTS
from test_connect import CLIENT_KILLS, LONG_ONLY_GROUPS, run_parity

pytestmark = [pytest.mark.connect, pytest.mark.slow]


@pytest.mark.timeout(1800)
def test_the_batch_client_kills_pass_on_spark_connect(connect_url):
    """A killed batch client's next client recovers: the batch-client-killed group (and the
    batch-client-killed-long group with SPARK_CKPT_LONG_FAULTS=1)."""
    # CI runs batch-client-killed (Delta commit, adoption); the rest SPARK_CKPT_LONG_FAULTS=1
    run_parity(connect_url, [g for g in CLIENT_KILLS if LONG_FAULTS or g not in LONG_ONLY_GROUPS])
