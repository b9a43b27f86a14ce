"""The batch client kills of the Connect parity run (test_connect.py's PARITY), in a file of
their own so that the other xdist worker runs them beside the rest of the parity run."""

from __future__ import annotations

import pytest
from helpers import LONG_FAULTS, LONG_ONLY
from test_connect import CLIENT_KILLS, run_parity

pytestmark = [pytest.mark.connect, pytest.mark.slow]


@pytest.mark.skipif(not LONG_FAULTS, reason=LONG_ONLY)  # four minutes; CI kills a stream client
@pytest.mark.timeout(1800)
def test_the_batch_client_kills_pass_on_spark_connect(connect_url):
    """A killed batch client's next client recovers: the batch-client-killed groups."""
    run_parity(connect_url, list(CLIENT_KILLS))
