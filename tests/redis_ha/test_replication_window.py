"""The inherent window of asynchronous replication, made deterministic, and what closes it.

A Redis master acknowledges a write before its replica has it. If the master dies in that
moment and the replica is promoted, the write is gone. Here that moment is held open: the
replica is frozen (SIGSTOP) and the master drops its replication link (``CLIENT KILL TYPE
replica``: what a partition between the two does), the stores write, the master is SIGKILLed,
the replica resumed and promoted:

* with ``wait_replicas=0`` (set explicitly; the default is 1) the acknowledged done record is
  lost: the next claim of
  the key is ``claimed`` again, so a duplicate would run its body (its token is still above the
  lost one: tokens follow the server clock across the loss);
* with ``wait_replicas=1`` the store refuses to acknowledge (``StoreUnavailable``: the gate
  re-queues the message and no body runs), gives the unconfirmed claim back, and every write it
  did acknowledge survives the failover.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest
import redis

from celery_idem.exceptions import StoreUnavailable
from celery_idem.records import Claim, ClaimStatus, Record, State
from celery_idem.stores import store_from_url
from celery_idem.stores.base import Store
from tests.integration.harness import wait_for
from tests.redis_ha.support import MASTER_NAME, LocalCluster, SentinelGroup
from tests.stores.support import LONG, claim

pytestmark = [pytest.mark.crash]


@dataclass
class Deployment:
    plain: Store  # wait_replicas=0
    safe: Store  # wait_replicas=1
    keys: dict[str, str]  # role -> a key that lives on the master about to die
    replica_pid: int
    master_port: int
    kill_master: Callable[[], None]
    wait_promoted: Callable[[], None]
    restart_old_master: Callable[[], None]


def _done(store: Store, key: str, token: int) -> None:
    store.record(key, token, state=State.DONE, content_type="application/json", data=b"[1]",
                 ttl=LONG)


def _answer(call: Callable[[], object]) -> Callable[[], object]:
    """``call``, with a store still failing over counted as 'not yet' (for wait_for)."""
    def attempt() -> object:
        try:
            return call() or None
        except StoreUnavailable:
            return None
    return attempt


def check_window(d: Deployment) -> None:
    before, lost, unconfirmed = d.keys["before"], d.keys["lost"], d.keys["unconfirmed"]
    # Given a key the WAIT store recorded as done while replication was working
    first = claim(d.safe, before)
    _done(d.safe, before, first.token)
    # When the replica freezes, the default store records a result the master acknowledges
    os.kill(d.replica_pid, signal.SIGSTOP)
    try:
        with redis.Redis(host="127.0.0.1", port=d.master_port, socket_timeout=5) as master:
            master.execute_command("CLIENT", "KILL", "TYPE", "replica")
        taken = claim(d.plain, lost)
        assert taken.status is ClaimStatus.CLAIMED
        _done(d.plain, lost, taken.token)
        rec = d.plain.get(lost)
        assert rec is not None and rec.state is State.DONE
        # And the WAIT store cannot get its claim confirmed, so it does not acknowledge it
        with pytest.raises(StoreUnavailable, match="replicas confirmed"):
            claim(d.safe, unconfirmed)
        # (it gave the claim back at once: a re-queued message claims again without waiting)
        rec = d.safe.get(unconfirmed)
        assert rec is not None and rec.state is State.RELEASED
        # Then the master dies before the replica got any of it, and the replica is promoted
        d.kill_master()
    finally:
        os.kill(d.replica_pid, signal.SIGCONT)
    d.wait_promoted()
    # The default store's acknowledged done record is gone: a duplicate would run the body
    # again. Its fencing token does not start over: it is above the lost one (the promoted
    # replica's clock has moved on since the lost claim)
    again: Claim = wait_for(_answer(lambda: claim(d.plain, lost, who="dup")), timeout=60,
                            what="the store to answer after the failover")
    assert again.status is ClaimStatus.CLAIMED and again.record is None
    assert again.token > taken.token
    # Every write the WAIT store acknowledged survived
    kept: Record = wait_for(_answer(lambda: d.safe.get(before)), timeout=60, what="the record")
    assert kept.state is State.DONE and kept.token == first.token
    # Its unconfirmed claim was never acknowledged, so no body ran under it; once the old master
    # is back as a replica, the WAIT store takes writes again
    d.restart_old_master()
    fresh: Claim = wait_for(_answer(lambda: claim(d.safe, unconfirmed, who="next")), timeout=60,
                            what="the WAIT store to accept writes again")
    assert fresh.status is ClaimStatus.CLAIMED


def keys_on(master_of: Callable[[str], int], store: Store, master: int) -> dict[str, str]:
    """Three keys whose records live on ``master``."""
    found = [k for k in (f"w{i}" for i in range(2000))
             if master_of(store.name_of(k)) == master][:3]
    return dict(zip(("before", "lost", "unconfirmed"), found, strict=True))


@pytest.fixture
def cluster_deployment(prefix: str) -> Iterator[Deployment]:
    cluster = LocalCluster()
    plain = store_from_url(cluster.url, prefix=prefix, options={"wait_replicas": 0})
    safe = store_from_url(cluster.url, prefix=prefix, options={"wait_replicas": 1})
    try:
        master = cluster.masters()[0]
        replica = cluster.replica_of(master)
        slots: dict[int, int] = {}

        def master_of(name: str) -> int:
            with cluster.nodes[master].client() as c:
                slot = int(c.execute_command("CLUSTER", "KEYSLOT", name))
            if not slots:
                with cluster.nodes[master].client() as c:
                    for start, end, owner, *_ in c.execute_command("CLUSTER", "SLOTS"):
                        slots.update(dict.fromkeys(range(int(start), int(end) + 1), int(owner[1])))
            return slots[slot]

        proc = cluster.nodes[replica].proc
        assert proc is not None
        yield Deployment(
            plain, safe, keys_on(master_of, plain, master), proc.pid, master,
            kill_master=lambda: cluster.kill_master(master),
            wait_promoted=lambda: cluster.wait_promoted(master) and None,
            restart_old_master=lambda: cluster.restart(master),
        )
    finally:
        plain.close()
        safe.close()
        cluster.cleanup()


@pytest.fixture
def sentinel_deployment(prefix: str) -> Iterator[Deployment]:
    group = SentinelGroup()
    url = group.url + f"?master_name={MASTER_NAME}"
    plain = store_from_url(url, prefix=prefix, options={"wait_replicas": 0})
    safe = store_from_url(url, prefix=prefix, options={"wait_replicas": 1})
    old = group.master.port
    try:
        proc = group.replica.proc
        assert proc is not None
        yield Deployment(
            plain, safe, {"before": "before", "lost": "lost", "unconfirmed": "unconfirmed"},
            proc.pid, old,
            kill_master=lambda: group.master.stop(),
            wait_promoted=lambda: wait_for(
                lambda: group.master_port() == group.replica.port, timeout=60, interval=0.1,
                what="the sentinels to promote the replica") and None,
            restart_old_master=lambda: group.restart(old),
        )
    finally:
        plain.close()
        safe.close()
        group.cleanup()


def test_cluster_loses_an_acknowledged_record_without_wait_and_none_with_it(
    cluster_deployment: Deployment,
) -> None:
    check_window(cluster_deployment)


def test_sentinel_loses_an_acknowledged_record_without_wait_and_none_with_it(
    sentinel_deployment: Deployment,
) -> None:
    check_window(sentinel_deployment)
