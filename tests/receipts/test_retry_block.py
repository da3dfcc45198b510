"""A body may retry its receipt block after the block was rolled back (a deadlock, say).

The usual database idiom retries a transaction that failed with a deadlock or a serialization
error. A block rolled back by ``idempotent_transaction`` (commit=True) wrote no receipt, so a
second block in the same run is the same action's first receipt, not a second one.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from celery import Celery
from sqlalchemy.orm import Session

from celery_idem import IdempotentTask
from celery_idem.task import get_store
from tests.receipts.conftest import BusinessDB, make_db

app = Celery("receipts-retry", set_as_current=False)
app.conf.update(task_always_eager=True, idempotency_store="memory://",
                idempotency_key_prefix="receipts-retry:")

CURRENT: dict[str, Any] = {}


class Deadlock(Exception):
    """Stands for the database aborting the transaction (deadlock, serialization failure)."""


@app.task(base=IdempotentTask, bind=True, name="receipts-retry.place", idempotency_lease=5)
def place(self: IdempotentTask, action: str, commit: bool = True) -> Any:
    db: BusinessDB = CURRENT["db"]
    for attempt in range(3):
        try:
            with Session(db.engine) as session:
                if commit:
                    with self.idempotent_transaction(session, table=db.receipts) as tx:
                        session.execute(sa.insert(db.orders).values(
                            action=action, amount=attempt, task_id="t", token=1))
                        if attempt == 0:
                            raise Deadlock("deadlock detected")
                        tx.result = {"attempt": attempt}
                else:
                    with session.begin(), self.idempotent_transaction(
                            session, commit=False, table=db.receipts) as tx:
                        if attempt == 0:
                            raise Deadlock("deadlock detected")
                        tx.result = {"attempt": attempt}
            return tx.result
        except Deadlock:
            continue
    raise AssertionError("unreachable")


@pytest.fixture
def db(tmp_path: Path) -> BusinessDB:
    CURRENT["db"] = business = make_db(f"sqlite:///{tmp_path / 'business.db'}")
    get_store(app)._records.clear()  # type: ignore[attr-defined]
    return business


def test_a_block_rolled_back_by_the_transaction_may_run_again(db: BusinessDB) -> None:
    assert place.delay("r1").get() == {"attempt": 1}
    assert [(o.action, o.amount) for o in db.order_rows()] == [("r1", 1)]
    key = place.idempotency_key_for(("r1",), {})
    assert [r["key"] for r in db.receipt_rows()] == [f"receipts-retry:{key}"]


def test_with_commit_false_a_second_block_is_still_refused(db: BusinessDB) -> None:
    # The caller owns that transaction: whether it rolled back is not known here.
    with pytest.raises(RuntimeError, match="already used in this run"):
        place.delay("r2", commit=False).get()
