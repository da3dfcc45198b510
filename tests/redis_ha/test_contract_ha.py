"""The store contract suite (tests/stores/test_contract.py), run on Redis Cluster and Sentinel.

Every test of the shared suite is imported and runs here against four more stores: a 6-node
cluster (``redis+cluster://``) and a sentinel-managed master (``sentinel://``), each with
``wait_replicas=0`` and with the default ``wait_replicas=1`` (the script and a ``WAIT`` pipelined
on the key's master).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from celery_idem.stores import store_from_url
from celery_idem.stores.base import Store
from tests.redis_ha.support import MASTER_NAME
from tests.stores.test_contract import *  # noqa: F403 - the shared suite, collected here too
from tests.stores.test_contract import MakeStore

HA_STORES = ["cluster", "cluster-wait", "sentinel", "sentinel-wait"]


@pytest.fixture(params=HA_STORES)
def make_store(request: pytest.FixtureRequest, prefix: str) -> Iterator[MakeStore]:
    kind: str = request.param
    options: dict[str, object] = {} if kind.endswith("-wait") else {"wait_replicas": 0}
    if kind.startswith("cluster"):
        url = request.getfixturevalue("local_cluster").url
    else:
        url = request.getfixturevalue("sentinel_group").url + f"?master_name={MASTER_NAME}"
    stores: list[Store] = []

    def make(store_prefix: str = prefix) -> Store:
        store = store_from_url(url, prefix=store_prefix, options=options)
        stores.append(store)
        return store

    yield make
    for store in stores:
        store.close()


def test_the_durability_check_reads_every_master_and_replica(make_store: MakeStore) -> None:
    """Cluster: each master holds a share of the records, so each one's settings are read;
    Sentinel: the current master's. Every replica's too: a failover promotes one. The test
    servers run without AOF: one finding per node, and one about wait_replicas when it is 0."""
    store = make_store()
    findings = store.check_durability()
    waits = [f for f in findings if f.setting == "wait_replicas"]
    assert len(waits) == (0 if getattr(store, "wait_replicas", 0) else 1)
    findings = [f for f in findings if f.setting != "wait_replicas"]
    assert findings and {f.setting for f in findings} == {"appendonly"}
    nodes = {f.risk.split(": ", 1)[0] for f in findings}
    assert len(nodes) == len(findings)
    masters = {n for n in nodes if " master " in n}
    replicas = {n for n in nodes if " replica " in n}
    if "cluster" in repr(store.__class__).lower():
        assert len(masters) == 3 and all(m.startswith("cluster master ") for m in masters)
        assert len(replicas) == 3 and all(r.startswith("cluster replica ") for r in replicas)
    else:
        assert len(masters) == 1 and len(replicas) == 1
