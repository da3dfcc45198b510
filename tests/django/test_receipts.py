"""The Django receipt block in-process: one atomic, nested atomic blocks, on_commit hooks.

The kill-after-commit run with real workers is tests/django/test_worker.py; here the block's
object is driven directly, as the task layer drives it, on SQLite and on PostgreSQL.
"""

from __future__ import annotations

import uuid
from typing import Any

import pytest

from celery_idem.codec import KombuCodec
from tests.django.support import django_databases  # noqa: F401

ALIASES = ["default", "pg"]


class Found(BaseException):
    def __init__(self, receipt: Any) -> None:
        super().__init__(receipt)
        self.receipt = receipt


def block(alias: str, key: str, token: int, ttl: float = 60) -> Any:
    from celery_idem.contrib.django.receipts import DjangoReceiptTransaction

    return DjangoReceiptTransaction(using=alias, key=key, token=token, task_id=f"task-{token}",
                                    codec=KombuCodec("json"), ttl=ttl, on_found=Found)


def orders(alias: str, action: str) -> int:
    from tests.django.shop.models import Order

    return int(Order.objects.using(alias).filter(action=action).count())


def write(alias: str, action: str, token: int) -> None:
    from tests.django.shop.models import Order

    Order.objects.using(alias).create(action=action, amount=1, task_id="t", token=token, pid=0)


@pytest.fixture(params=ALIASES)
def alias(request: pytest.FixtureRequest, django_databases: Any) -> str:  # noqa: F811
    return str(request.param)


def test_a_later_attempt_gets_the_committed_result_and_its_hooks_never_run(alias: str) -> None:
    from django.db import transaction

    key, action, fired = f"r:{uuid.uuid4().hex}", uuid.uuid4().hex, []
    # The first attempt commits its write and receipt (and then, say, dies before the record)
    with block(alias, key, 1) as tx:
        write(alias, action, 1)
        transaction.on_commit(lambda: fired.append(1), using=alias)
        tx.result = {"order": action}
    assert fired == [1]
    # A later attempt finds the receipt: its block never runs, so it registers no hook
    with pytest.raises(Found) as found, block(alias, key, 2):
        write(alias, action, 2)
        transaction.on_commit(lambda: fired.append(2), using=alias)
    assert found.value.receipt.value == {"order": action} and found.value.receipt.token == 1
    assert orders(alias, action) == 1 and fired == [1]


def test_inside_an_outer_atomic_the_receipt_commits_and_rolls_back_with_it(alias: str) -> None:
    from django.db import transaction

    key, action, fired = f"r:{uuid.uuid4().hex}", uuid.uuid4().hex, []
    with pytest.raises(RuntimeError), transaction.atomic(using=alias):
        with block(alias, key, 1) as tx:  # a savepoint
            write(alias, action, 1)
            transaction.on_commit(lambda: fired.append(1), using=alias)
            tx.result = "first"
        assert fired == []  # hooks wait for the outermost commit
        raise RuntimeError("the outer transaction fails after the block")
    # Rolled back with the outer transaction: no write, no receipt, no hook; the action may run
    assert orders(alias, action) == 0 and fired == []
    with transaction.atomic(using=alias), block(alias, key, 2) as tx:
        write(alias, action, 2)
        transaction.on_commit(lambda: fired.append(2), using=alias)
        tx.result = "second"
    assert orders(alias, action) == 1 and fired == [2]


def test_an_error_in_the_block_rolls_back_the_write_and_the_receipt(alias: str) -> None:
    key, action = f"r:{uuid.uuid4().hex}", uuid.uuid4().hex
    tx = block(alias, key, 1)
    with pytest.raises(ValueError), tx:
        write(alias, action, 1)
        raise ValueError("the body fails")
    assert tx.rolled_back and orders(alias, action) == 0
    with block(alias, key, 2) as again:
        write(alias, action, 2)
        again.result = 2
    assert orders(alias, action) == 1


def test_an_expired_receipt_lets_the_action_run_again_and_is_purged(alias: str) -> None:
    from django.db import connections

    from celery_idem.contrib.django.receipts import purge_receipts

    key, action = f"r:{uuid.uuid4().hex}", uuid.uuid4().hex
    with block(alias, key, 1, ttl=-1) as tx:  # expired as soon as it is written
        write(alias, action, 1)
        tx.result = 1
    with block(alias, key, 2) as tx:
        write(alias, action, 2)
        tx.result = 2
    assert orders(alias, action) == 2
    with block(alias, f"r:{uuid.uuid4().hex}", 1, ttl=-1) as tx:
        tx.result = 0
    assert purge_receipts(alias) >= 1
    with connections[alias].cursor() as cursor:
        cursor.execute('SELECT COUNT(*) FROM celery_idem_receipts WHERE "key" = %s', [key])
        assert cursor.fetchone()[0] == 1  # the live one stays
