"""``wait_replicas``: the script and ``WAIT`` share one pipelined exchange, and survive a server
that lost its script cache (a restarted or newly promoted master)."""

from __future__ import annotations

from celery_idem.records import ClaimStatus
from celery_idem.stores import store_from_url
from tests.redis_ha.support import MASTER_NAME, LocalCluster, SentinelGroup
from tests.stores.support import claim


def test_a_master_without_the_scripts_gets_them_again_on_the_wait_path(
    sentinel_group: SentinelGroup, prefix: str,
) -> None:
    store = store_from_url(sentinel_group.url + f"?master_name={MASTER_NAME}", prefix=prefix,
                           options={"wait_replicas": 1})
    try:
        assert claim(store, "first").status is ClaimStatus.CLAIMED
        # Given a master that forgot every script (as a promoted replica has none)
        store.client.script_flush()
        # Then the next claim loads it again and is confirmed by the replica
        assert claim(store, "second").status is ClaimStatus.CLAIMED
    finally:
        store.close()


def test_the_cluster_wait_path_talks_to_the_master_that_owns_the_key(
    local_cluster: LocalCluster, prefix: str,
) -> None:
    store = store_from_url(local_cluster.url, prefix=prefix, options={"wait_replicas": 1})
    try:
        # Keys on every master: each WAIT is answered by that master's own replica
        names = [f"k{i}" for i in range(30)]
        homes = {local_cluster.master_of(store.name_of(n)) for n in names}
        assert len(homes) == 3
        for name in names:
            assert claim(store, name).status is ClaimStatus.CLAIMED
        assert {r.key for r in store.scan()} == set(names)
    finally:
        store.close()
