"""``idempotency_check_on_enqueue``: the producer-side read of the record, and turning it off.

By default an enqueue of a done key reads the record and publishes nothing (see
test_worker_redis.py). With ``idempotency_check_on_enqueue = False`` the producer never reads
the store: every enqueue publishes, and the worker's gate answers a done key from the record
without running the body. Real worker, Redis broker, backend and store.
"""

from __future__ import annotations

from typing import Any

import pytest
from celery import Celery
from celery.signals import before_task_publish

from celery_idem import CachedResult, IdempotentTask, ImproperlyConfigured
from tests.integration import enqueue_app
from tests.integration.conftest import Cluster


@pytest.mark.worker
def test_without_the_check_a_done_key_is_published_and_answered_by_the_worker(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    cluster.worker(app="tests.integration.enqueue_app")
    first = enqueue_app.charge_unchecked.delay("ord_u1", 4200)
    value = first.get(timeout=30)
    assert value["ran_in"] == first.id

    # The producer must not read the store at all now; the worker (another process) still does.
    def no_read(key: str) -> Any:
        raise AssertionError(f"the producer read the store for {key!r}")

    monkeypatch.setattr(cluster.store, "get", no_read)
    published: list[str] = []

    def count(sender: object = None, headers: dict[str, Any] | None = None, **_: object) -> None:
        published.append((headers or {}).get("id", ""))

    before_task_publish.connect(count, weak=False)
    try:
        second = enqueue_app.charge_unchecked.delay("ord_u1", 4200)
    finally:
        before_task_publish.disconnect(count)
    assert not isinstance(second, CachedResult)
    assert published == [second.id] and second.id != first.id
    assert second.idempotency_key == first.idempotency_key
    # The worker answers it from the record: the first run's result, the body not run again
    assert second.get(timeout=30) == value
    assert cluster.effects("charge_unchecked:ord_u1") == [first.id]


def test_the_option_takes_a_bool_only() -> None:
    app = Celery("enqueue-check", set_as_current=False)
    with pytest.raises(ImproperlyConfigured, match="idempotency_check_on_enqueue must be True or False"):
        @app.task(shared=False, base=IdempotentTask, idempotency_check_on_enqueue="no")
        def bad(x: int) -> int:
            return x
        bad.idempotency_config  # noqa: B018  (resolved at definition or on first use)
    @app.task(shared=False, base=IdempotentTask)
    def good(x: int) -> int:
        return x
    assert good.idempotency_config.check_on_enqueue is True
