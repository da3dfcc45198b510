"""Replicated stores are safe by default, with real clusters and sentinels.

* ``RedisClusterStore`` and ``RedisSentinelStore`` wait for one replica unless told otherwise.
* The durability check at worker start reads every node a failover can promote (the replicas),
  says so when ``wait_replicas`` is 0, and warns when a master has fewer replicas connected
  than the store waits for.
* A ``MOVED`` redirect during a failover is followed (the write lands on the new master), not
  reported as a refusal.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from celery_idem.contrib.redis_ha import RedisClusterStore, RedisSentinelStore
from tests.integration.harness import wait_for
from tests.redis_ha.support import LocalCluster, SentinelGroup


@pytest.fixture
def cluster_store(local_cluster: LocalCluster) -> Iterator[RedisClusterStore]:
    store = RedisClusterStore.from_url(local_cluster.url, prefix=f"safe-{uuid.uuid4().hex[:8]}:")
    yield store
    store.close()


def sentinel_store(group: SentinelGroup, **options: object) -> RedisSentinelStore:
    return RedisSentinelStore.from_url(f"{group.url}?master_name=mymaster",
                                       prefix=f"safe-{uuid.uuid4().hex[:8]}:", **options)


def test_both_replicated_stores_wait_for_one_replica_by_default(
    cluster_store: RedisClusterStore, sentinel_group: SentinelGroup
) -> None:
    assert cluster_store.wait_replicas == 1
    store = sentinel_store(sentinel_group)
    try:
        assert store.wait_replicas == 1
        claim = store.claim("k", owner="o", task_id="t", attempt=0, lease=60, ttl=600)
        assert claim.token > 0  # one replica connected: the write was confirmed
    finally:
        store.close()


def test_the_cluster_durability_check_reads_every_replica(
    local_cluster: LocalCluster, cluster_store: RedisClusterStore
) -> None:
    # The test cluster runs with appendonly no on every node, replicas included.
    risks = " ".join(f.risk for f in cluster_store.check_durability())
    replicas = [p for p in local_cluster.nodes if p not in local_cluster.masters()]
    assert len(replicas) == 3
    for port in replicas:
        assert f"cluster replica 127.0.0.1:{port}: appendonly is no" in risks
    assert "wait_replicas is 0" not in risks


def test_the_sentinel_durability_check_reads_the_replica(sentinel_group: SentinelGroup) -> None:
    store = sentinel_store(sentinel_group)
    try:
        risks = " ".join(f.risk for f in store.check_durability())
    finally:
        store.close()
    assert f"sentinel replica 127.0.0.1:{sentinel_group.replica.port}" in risks


def test_wait_replicas_zero_is_a_durability_finding_that_names_its_fix(
    local_cluster: LocalCluster,
) -> None:
    store = RedisClusterStore.from_url(local_cluster.url, wait_replicas=0)
    try:
        [finding] = [f for f in store.check_durability() if f.setting == "wait_replicas"]
    finally:
        store.close()
    assert "lost when that replica is promoted" in finding.risk
    assert "idempotency_store_options" in finding.fix


def test_fewer_connected_replicas_than_wait_replicas_is_warned_at_start(
    local_cluster: LocalCluster, sentinel_group: SentinelGroup
) -> None:
    healthy = RedisClusterStore.from_url(local_cluster.url)
    greedy = RedisClusterStore.from_url(local_cluster.url, wait_replicas=2)
    sentinel = sentinel_store(sentinel_group, wait_replicas=2)
    try:
        assert healthy.replication_warnings() == []
        lines = greedy.replication_warnings()
        assert len(lines) == 3  # each master has one replica, the store waits for two
        assert all("1 connected replica(s)" in line and "wait_replicas" in line for line in lines)
        [line] = sentinel.replication_warnings()
        assert "'wait_replicas': 0" in line
    finally:
        healthy.close()
        greedy.close()
        sentinel.close()


def test_a_moved_redirect_in_a_failover_is_followed_not_reported_as_refused() -> None:
    cluster = LocalCluster()
    try:
        store = RedisClusterStore.from_url(cluster.url, prefix="moved:")
        try:
            key = "order-1"
            first = store.claim(key, owner="o", task_id="t1", attempt=0, lease=60, ttl=600)
            master = cluster.master_of(f"moved:{{{key}}}")
            replica = cluster.replica_of(master)
            # A manual failover: the old master stays up as a replica and answers MOVED to the
            # store, whose slot map still names it.
            with cluster.nodes[replica].client() as c:
                c.execute_command("CLUSTER", "FAILOVER")
            wait_for(lambda: replica in cluster.masters() and master not in cluster.masters(),
                     timeout=60, interval=0.1, what="the manual failover")
            refreshes: list[int] = []
            initialize = store.cluster.nodes_manager.initialize

            def counted() -> None:
                refreshes.append(1)
                initialize()

            store.cluster.nodes_manager.initialize = counted  # type: ignore[method-assign]
            store.release(key, first.token, claim_id=first.claim_id)  # MOVED, then the new master
            assert refreshes  # the old master did redirect the store
            second = store.claim(key, owner="o", task_id="t2", attempt=0, lease=60, ttl=600)
            assert second.token > first.token
        finally:
            store.close()
    finally:
        cluster.cleanup()
