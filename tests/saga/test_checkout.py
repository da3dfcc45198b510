"""The checkout saga with real workers, a real provider and real SIGKILLs of the worker child.

Every crash is a SIGKILL of the pool child at a checkpoint (``tests/saga/tasks.py``); the broker
redelivers the message (``acks_late``), the saga is taken over after its 2 s lease and its body
runs again: the steps that were recorded answer from the store, a step whose write reached the
provider but was not recorded is taken over and replays the same write by its key.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest

from celery_idem import CachedResult
from celery_idem.contrib.saga import SagaFailed
from example_app.payments import ProviderClient
from tests.integration.conftest import Cluster
from tests.saga import tasks

pytestmark = [pytest.mark.worker, pytest.mark.crash]

INCLUDE = ("-I", "tests.saga.tasks")


def start(cluster: Cluster, provider: ProviderClient) -> Any:
    cluster.env["EXAMPLE_PAYMENTS_URL"] = f"http://{provider.host}:{provider.port}"
    return cluster.worker("saga", concurrency=1, extra=INCLUDE)


def effects(provider: ProviderClient, order_id: str, email: str) -> dict[str, int]:
    """How many of each effect the provider holds for the order."""
    led = provider.ledger(prefix=order_id)
    counts = {name: int(led[name].get(order_id, 0))
              for name in ("charges", "orders", "cancellations")}
    counts["refunds"] = int(led["charge_refunds"].get(order_id, 0))
    counts["receipts"] = int(led["emails"].get(email, 0))  # e-mails are counted by address
    return counts


def points(cluster: Cluster, order_id: str) -> list[str]:
    """The checkpoints the saga reached, in order (every run, killed ones included)."""
    raw = cluster.ledger.lrange(f"{cluster.prefix}points:{order_id}", 0, -1)
    return [v.decode().split()[0] for v in raw]


def test_crashes_between_and_inside_steps_resume_to_one_charge_one_order_one_receipt(
    cluster: Cluster, provider: ProviderClient
) -> None:
    w = start(cluster, provider)
    order_id, email = f"sg1_{cluster.prefix.strip(':')}", f"sg1_{cluster.prefix.strip(':')}@example.com"
    kills = ["charge_card:committed", "after:charge_card", "after:create_order"]
    started = time.monotonic()
    # Given a saga whose worker child is killed inside the charge step (after the provider
    # committed the charge, before the step was recorded), then between steps, twice
    r = tasks.checkout.delay(order_id, 4200, email, "book", kills)
    out = r.get(timeout=120)
    elapsed = time.monotonic() - started
    # Then the redeliveries resumed it to exactly one of each effect
    assert effects(provider, order_id, email) == {
        "charges": 1, "orders": 1, "cancellations": 0, "refunds": 0, "receipts": 1}
    assert out["order_id"] == order_id and provider.charges_for(order_id)[0]["id"] == out["charge"]
    # And every kill happened: three crashes, three takeovers of the saga
    # And the four runs went exactly as planned (a recorded step does not run again: its
    # ":committed" point is not reached again; the killed-inside step is re-run and replays)
    assert points(cluster, order_id) == [
        "charge_card:committed",                                              # run 1, killed
        "charge_card:committed", "after:charge_card",                         # run 2, killed
        "after:charge_card", "create_order:committed", "after:create_order",  # run 3, killed
        "after:charge_card", "after:create_order", "send_receipt:committed",  # run 4
    ]
    events = provider.ledger(prefix=order_id)["events"][order_id]
    assert events["charges"] == {"created": 1, "replayed by key": 1}
    assert events["orders"] == {"created": 1}
    assert w.text().count("celery_idem takeover") >= 4  # the saga 3 times, the charge step once
    print(f"\nsaga with 3 crashes: {elapsed:.1f} s; provider events {events}")


@pytest.fixture(params=["redis", "postgresql"])
def any_store_cluster(request: pytest.FixtureRequest, make_cluster: Callable[..., Cluster]) -> Cluster:
    """A cluster whose idempotency store is Redis, or the SQL store on PostgreSQL."""
    if request.param == "postgresql":
        return make_cluster(IDEM_STORE="db+" + request.getfixturevalue("pg_url"))
    return make_cluster()


def test_a_terminal_failure_compensates_in_reverse_once_even_when_compensations_crash(
    any_store_cluster: Cluster, provider: ProviderClient
) -> None:
    cluster = any_store_cluster
    w = start(cluster, provider)
    order_id, email = f"sg2_{cluster.prefix.strip(':')}", "not-an-address"
    # Given a saga whose last step fails terminally (the receipt address is rejected), and
    # whose worker child is killed inside each of the two compensations
    kills = ["create_order:compensate:committed", "charge_card:compensate:committed"]
    started = time.monotonic()
    r = tasks.checkout.delay(order_id, 4200, email, "book", kills)
    with pytest.raises(SagaFailed) as failed:
        r.get(timeout=120)
    elapsed = time.monotonic() - started
    assert "send_receipt" in str(failed.value) and "create_order, charge_card" in str(failed.value)
    # Then each completed step was compensated exactly once, newest first
    assert effects(provider, order_id, email) == {
        "charges": 1, "orders": 1, "cancellations": 1, "refunds": 1, "receipts": 0}
    assert points(cluster, order_id) == [
        "charge_card:committed", "after:charge_card", "create_order:committed",
        "after:create_order", "create_order:compensate:committed",              # run 1, killed
        "after:charge_card", "after:create_order",
        "create_order:compensate:committed", "charge_card:compensate:committed",  # run 2, killed
        "after:charge_card", "after:create_order", "charge_card:compensate:committed",  # run 3
    ]
    events = provider.ledger(prefix=order_id)["events"][order_id]
    assert events["cancellations"] == {"created": 1, "replayed by key": 1}
    assert events["charge_refunds"] == {"created": 1, "replayed by key": 1}
    # And the saga is recorded as failed: a duplicate publishes nothing and gets the same error
    again = tasks.checkout.delay(order_id, 4200, email, "book", [])
    assert isinstance(again, CachedResult)
    with pytest.raises(SagaFailed):
        again.get(timeout=30)
    assert effects(provider, order_id, email)["refunds"] == 1
    assert "celery_idem takeover" in w.text()
    print(f"\nsaga compensated with 2 crashes: {elapsed:.1f} s; provider events {events}")


def test_the_example_task_refunds_a_sold_out_order(cluster: Cluster, provider: ProviderClient) -> None:
    start(cluster, provider)
    checkout = cluster.app.tasks["shop.checkout"]  # example_app.saga's shared_task
    order_id, email = f"sg3_{cluster.prefix.strip(':')}", f"sg3_{cluster.prefix.strip(':')}@example.com"
    with pytest.raises(SagaFailed, match="sold out"):
        checkout.delay(order_id, 1500, email, "lamp").get(timeout=60)
    assert effects(provider, order_id, email) == {
        "charges": 1, "orders": 0, "cancellations": 0, "refunds": 1, "receipts": 0}
    ok_id = f"sg4_{cluster.prefix.strip(':')}"
    out = checkout.delay(ok_id, 900, email, "mug").get(timeout=60)
    assert out["order_id"] == ok_id
    assert effects(provider, ok_id, email)["charges"] == 1
