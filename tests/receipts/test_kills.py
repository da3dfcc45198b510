"""Kill after commit, with real workers: the CI-sized run of ``python -m tests.receipts.kills``.

Each action's first attempt commits its order and receipt in one PostgreSQL transaction, then
SIGKILLs its own prefork process before the record and the ack. The redelivery waits out the
2 s lease, takes over, finds the receipt and returns the committed result without writing.
(The >= 200-kill run and its figures are in docs/transactions.md.)
"""

from __future__ import annotations

import pytest

from tests.conftest import PG_URL, REDIS_URL, require
from tests.receipts.kills import run

pytestmark = [pytest.mark.worker, pytest.mark.crash]

KILLS = 10


@pytest.mark.parametrize("store", ["redis", "sql"])
def test_kill_after_commit_leaves_one_order_per_action_and_the_committed_results(
    store: str,
) -> None:
    require(PG_URL, 5432, "PostgreSQL")
    require(REDIS_URL, 6379, "Redis")  # redis-server must be installed; a private one is started
    report = run(KILLS, store)
    # Every action was killed once, right after its commit
    assert report.kills == KILLS, report.line()
    # Each redelivery found the receipt instead of writing
    assert report.receipts_found >= KILLS, report.line()
    # One order row per action, none missing, and every result is the committed attempt's
    assert report.duplicate_rows == 0 and report.missing == [], report.line()
    assert report.orders == KILLS, report.line()
    assert report.wrong_results == [], report.wrong_results


def test_the_same_kill_without_a_receipt_duplicates_every_order() -> None:
    """The control: the test above can fail. Without the receipt, each kill after the commit
    leaves a committed order with no record, and the takeover writes it again."""
    require(PG_URL, 5432, "PostgreSQL")
    report = run(3, "redis", plain=True)
    assert report.kills == 3, report.line()
    assert report.duplicate_rows == 3 and report.orders == 6, report.line()
