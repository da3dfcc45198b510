"""A look-alike key is visible as one in the worker's log lines.

Through a real ``celery worker``: keys with a Cyrillic "o" (U+043E) and with a non-breaking space print
like their ASCII twin unless escaped, as the CLI escapes them.
"""

from __future__ import annotations

import pytest

from tests.integration import app as tasks
from tests.integration.conftest import Cluster
from tests.integration.harness import wait_for

pytestmark = pytest.mark.worker


def test_the_worker_logs_look_alike_keys_escaped(cluster: Cluster) -> None:
    w = cluster.worker()
    keys = {"order-1\u043e": "order-1\\u043e", "order\xa01": "order\\xa01", "order-1o": "order-1o"}
    for n, key in enumerate(keys):
        first = tasks.refund.apply_async((f"ord-{n}", 1), idempotency_key=key)
        first.get(timeout=30)
        # The same key again, published (a canvas publish skips the enqueue check): the worker
        # answers it as a duplicate, an INFO line with the key.
        again = tasks.refund.apply_async((f"ord-{n}", 1), idempotency_key=key,
                                         link_error=tasks.plain.si("x"))
        assert again.get(timeout=30) == first.get(timeout=1)
    name = tasks.refund.name
    lines = lambda: [line for line in w.text().splitlines() if "celery_idem duplicate" in line]  # noqa: E731
    wait_for(lambda: len(lines()) >= 3, what="three duplicate lines")
    for shown in keys.values():
        assert any(f" key={name}:key={shown} " in line for line in lines()), (shown, lines())
    assert not any("\u043e" in line or "\xa0" in line for line in lines()), lines()
