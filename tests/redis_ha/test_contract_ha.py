"""The store contract suite (tests/stores/test_contract.py), run on Redis Cluster and Sentinel.

Every test of the shared suite is imported and runs here against four more stores: a 6-node
cluster (``redis+cluster://``) and a sentinel-managed master (``sentinel://``), each without and
with ``wait_replicas=1`` (the script and a ``WAIT`` pipelined on the key's master).
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
    options: dict[str, object] = {"wait_replicas": 1} if kind.endswith("-wait") else {}
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


def test_the_durability_check_reads_every_master(make_store: MakeStore) -> None:
    """Cluster: each master holds a share of the records, so each one's settings are read;
    Sentinel: the current master's. The test servers run without AOF: one finding per master."""
    store = make_store()
    findings = store.check_durability()
    assert findings and {f.setting for f in findings} == {"appendonly"}
    masters = {f.risk.split(": ", 1)[0] for f in findings}
    assert len(masters) == len(findings)
    if "cluster" in repr(store.__class__).lower():
        assert len(masters) == 3 and all(m.startswith("cluster master ") for m in masters)
