"""Trust at the edge, the core's part: a key answers only its own action, for its own caller.

Tried as a careless or hostile caller would, through a real ``celery worker`` on Redis: a
per-call key taken from another task, a per-call key reused for another action, two tenants
with the same key, and message headers no ``apply_async`` would write.
"""

from __future__ import annotations

import pytest

from celery_idem import CachedResult, IdempotencyKeyMismatch, InvalidKey
from tests.integration import app as tasks
from tests.integration.conftest import Cluster
from tests.integration.harness import wait_for

pytestmark = pytest.mark.worker

REFUND = "tests.integration.app.refund"


def test_another_tasks_key_passed_per_call_is_a_new_action_of_this_task(cluster: Cluster) -> None:
    cluster.worker()
    salary = tasks.get_salary.delay("e-1")
    assert salary.get(timeout=30)["ssn"] == "078-05-1120"
    stolen = salary.idempotency_key
    # When a refund is enqueued with get_salary's key
    r = tasks.refund.apply_async(("ord-1", 100), idempotency_key=stolen)
    # Then the refund runs (once), and its result is a refund's, never the salary record
    out = r.get(timeout=30)
    assert out["refunded"] == "ord-1" and "ssn" not in out
    assert r.idempotency_key == f"{tasks.refund.name}:key={stolen}" == out["key"]
    assert len(cluster.effects("refund:ord-1")) == 1 and len(cluster.effects("salary:e-1")) == 1
    # The same through a hand-written message whose header is the stolen key
    sent = tasks.app.send_task(REFUND, ("ord-2", 100), headers={"idempotency_key": stolen})
    with pytest.raises(IdempotencyKeyMismatch):  # refund's record of that key is ord-1's
        sent.get(timeout=30)
    assert cluster.effects("refund:ord-2") == []


def test_a_per_call_key_reused_for_another_action_is_refused_at_enqueue_and_by_the_worker(
    cluster: Cluster,
) -> None:
    cluster.worker(concurrency=2)
    first = tasks.refund.apply_async(("ord-1001", 5000), idempotency_key="agent-k1")
    assert first.get(timeout=30)["refunded"] == "ord-1001"
    # At enqueue: the record is read there, nothing is sent
    with pytest.raises(IdempotencyKeyMismatch, match="use a new key"):
        tasks.refund.apply_async(("ord-9999", 1), idempotency_key="agent-k1")
    # By the worker: a canvas publish skips the producer's check
    dup = tasks.refund.apply_async(("ord-9999", 1), idempotency_key="agent-k1",
                                   link_error=tasks.plain.si("x"))
    assert not isinstance(dup, CachedResult)
    with pytest.raises(IdempotencyKeyMismatch):
        dup.get(timeout=30)
    # While the first action is still running, the copy with other arguments is refused too:
    # at enqueue (it would attach to the running action), and by the worker
    holder = tasks.refund.apply_async(("ord-2001", 70), {"hold": 30}, idempotency_key="agent-k2")
    wait_for(lambda: cluster.store.get(holder.idempotency_key), what="the holder's claim")
    with pytest.raises(IdempotencyKeyMismatch, match="in use by an action with different"):
        tasks.refund.apply_async(("ord-2999", 1), idempotency_key="agent-k2")
    busy = tasks.refund.apply_async(("ord-2999", 1), idempotency_key="agent-k2",
                                    link_error=tasks.plain.si("x"))
    with pytest.raises(IdempotencyKeyMismatch):
        busy.get(timeout=30)
    cluster.set_flag("release:ord-2001")
    assert holder.get(timeout=30)["refunded"] == "ord-2001"
    assert cluster.effects("refund:ord-9999") == [] and cluster.effects("refund:ord-2999") == []
    # The same key with the same identifying arguments (a reworded note) is the same action
    again = tasks.refund.apply_async(("ord-1001", 5000), {"note": "retried by the agent"},
                                     idempotency_key="agent-k1")
    assert again.get(timeout=30) == first.get(timeout=1)
    assert len(cluster.effects("refund:ord-1001")) == 1


def test_the_same_key_in_two_scopes_is_two_actions(cluster: Cluster) -> None:
    cluster.worker()
    a = tasks.refund.apply_async(("ord-1", 10), idempotency_key="order-1", idempotency_scope="t-a")
    b = tasks.refund.apply_async(("ord-2", 20), idempotency_key="order-1", idempotency_scope="t-b")
    assert a.get(timeout=30)["refunded"] == "ord-1" and b.get(timeout=30)["refunded"] == "ord-2"
    assert a.idempotency_key == f"{tasks.refund.name}@t-a:key=order-1"
    # Derived keys are scoped too: tenant b's refund of ord-1 is not tenant a's
    da = tasks.refund.apply_async(("ord-3", 30), idempotency_scope="t-a")
    db = tasks.refund.apply_async(("ord-3", 30), idempotency_scope="t-b")
    assert da.get(timeout=30) != db.get(timeout=30)
    assert len(cluster.effects("refund:ord-3")) == 2
    assert cluster.store.get(f"{tasks.refund.name}:key=order-1") is None


@pytest.mark.parametrize(
    ("header", "what"),
    [
        pytest.param("k" * 1_000_000, "characters", id="1MB"),
        pytest.param(123, "must be a str", id="int"),
        pytest.param(["a"], "must be a str", id="list"),
        pytest.param("ok\ncelery_idem recorded key=forged", r"U\+000A", id="newline"),
        pytest.param("\x1b[2J\x1b[31mred", r"U\+001B", id="ansi"),
        pytest.param("", "must not be empty", id="empty"),
    ],
)
def test_the_worker_refuses_a_bad_key_header_and_stores_nothing(
    cluster: Cluster, header: object, what: str,
) -> None:
    w = cluster.worker()
    sent = tasks.app.send_task(REFUND, ("ord-h", 1), headers={"idempotency_key": header})
    with pytest.raises(InvalidKey, match=what):
        sent.get(timeout=30)
    assert cluster.effects("refund:ord-h") == []
    assert list(cluster.store.scan()) == []  # nothing stored under that key (or any)
    assert "celery_idem recorded key=forged" not in w.text()
    big = [k for k in cluster.ledger.scan_iter(f"{cluster.prefix}*") if len(k) > 1000]
    assert big == []
