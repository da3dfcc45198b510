"""A scope follows the work, and a key header stays in its call's scope.

Through a real ``celery worker`` on Redis: two tenants place the same order, whose body enqueues
the charge; a chain's next step; a message header naming another tenant's stored key.
"""

from __future__ import annotations

import pytest
from celery import chain

from celery_idem import CachedResult
from tests.integration import app as tasks
from tests.integration import scope_app
from tests.integration.conftest import Cluster
from tests.integration.harness import wait_for

pytestmark = pytest.mark.worker

APP = "tests.integration.scope_app"


def test_a_child_enqueued_by_a_scoped_body_is_in_its_scope(cluster: Cluster) -> None:
    cluster.worker(app=APP)
    alice = scope_app.place_order.apply_async(("1001", 50), idempotency_scope="alice")
    a = alice.get(timeout=30)
    # The charge ran for Alice before Bob orders: Bob's must not be answered with Alice's.
    assert cluster.app.AsyncResult(a["child_id"]).get(timeout=30)["order_id"] == "1001"
    bob = scope_app.place_order.apply_async(("1001", 50), idempotency_scope="bob")
    b = bob.get(timeout=30)
    assert (a["scope"], b["scope"]) == ("alice", "bob")
    assert not b["child_cached"] and b["child_id"] != a["child_id"]
    assert cluster.app.AsyncResult(b["child_id"]).get(timeout=30)["order_id"] == "1001"
    assert a["child_key"].startswith(f"{tasks.charge.name}@alice:")
    assert b["child_key"].startswith(f"{tasks.charge.name}@bob:")
    assert len(cluster.effects("charge:1001")) == 2  # once per tenant
    # Bob again: his own charge's record answers, nothing runs
    again = scope_app.place_order.apply_async(("1001", 50), idempotency_scope="bob")
    assert isinstance(again, CachedResult) and again.get(timeout=30) == b
    assert len(cluster.effects("charge:1001")) == 2


def test_a_sagas_step_enqueues_in_the_sagas_scope(cluster: Cluster) -> None:
    cluster.worker(app=APP)
    out = [scope_app.saga_order.apply_async(("2002", 70), idempotency_scope=tenant).get(timeout=30)
           for tenant in ("alice", "bob")]
    assert [o["child_key"].split(":")[0] for o in out] == [
        f"{tasks.charge.name}@alice", f"{tasks.charge.name}@bob"]
    wait_for(lambda: len(cluster.effects("charge:2002")) == 2, what="one charge per tenant")


def test_a_chains_next_step_is_in_the_first_steps_scope(cluster: Cluster) -> None:
    cluster.worker(app=APP)
    results = [chain(scope_app.pick.s("o-7"), scope_app.ship.s()).apply_async(
        idempotency_scope=tenant) for tenant in ("t-a", "t-b")]
    shipped = [r.get(timeout=30) for r in results]
    assert [s["scope"] for s in shipped] == ["t-a", "t-b"]
    assert shipped[0]["key"].startswith(f"{scope_app.ship.name}@t-a:")
    assert sorted(cluster.effects("ship:o-7")) == ["t-a", "t-b"]


def test_a_header_key_is_in_the_calls_scope(cluster: Cluster) -> None:
    cluster.worker()
    bob = tasks.refund.apply_async(("ord-1", 10), headers={"idempotency_key": "http-k1"},
                                   idempotency_scope="bob")
    assert bob.idempotency_key == f"{tasks.refund.name}@bob:key=http-k1"
    assert bob.get(timeout=30)["key"] == bob.idempotency_key
    carol = tasks.refund.apply_async(("ord-2", 20), headers={"idempotency_key": "http-k1"},
                                     idempotency_scope="carol")
    assert carol.get(timeout=30)["refunded"] == "ord-2"
    assert len(cluster.effects("refund:ord-1")) == 1 == len(cluster.effects("refund:ord-2"))


def test_a_header_spelling_another_scopes_key_never_reads_its_record(cluster: Cluster) -> None:
    cluster.worker()
    alice = tasks.refund.apply_async(("ord-9", 900), idempotency_scope="alice")
    assert alice.get(timeout=30)["refunded"] == "ord-9"
    stolen = alice.idempotency_key
    assert stolen.startswith(f"{tasks.refund.name}@alice:")
    for scope in ("bob", None):
        r = tasks.refund.apply_async(("ord-10", 1), headers={"idempotency_key": stolen},
                                     idempotency_scope=scope)
        head = tasks.refund.name if scope is None else f"{tasks.refund.name}@{scope}"
        assert r.idempotency_key == f"{head}:key={stolen}"  # a caller's key of this scope
        assert r.id != alice.id and r.get(timeout=30)["refunded"] == "ord-10"
    wait_for(lambda: len(cluster.effects("refund:ord-10")) == 2, what="both refunds")
    assert len(cluster.effects("refund:ord-9")) == 1


def test_a_scoped_retry_keeps_its_key(cluster: Cluster) -> None:
    cluster.worker()
    r = tasks.flaky.apply_async(("ord-r",), idempotency_scope="t-r")
    assert r.get(timeout=30)["retries"] == 2
    assert r.idempotency_key.startswith(f"{tasks.flaky.name}@t-r:")
    assert cluster.store.get(r.idempotency_key) is not None  # recorded under the caller's key
    assert len(cluster.effects("charge:ord-r")) == 1
