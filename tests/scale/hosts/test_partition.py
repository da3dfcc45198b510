"""Many hosts, one broker and one store: a host is cut off mid-run while it holds claims.

Three hosts are Linux network namespaces made by the test (``tests/scale/hosts/netns.py``),
each with a ``celery worker`` (prefork -c 2) under a hostname of its own. They reach one private
``redis-server`` (broker and result backend) bound on their gateway addresses, and PostgreSQL
through a TCP proxy bound there too (the ledger; and the store, when it is not the Redis).

While host 0 runs bodies that hold claims, its link goes down: it keeps running but can reach
nothing. Its leases expire; duplicates and the broker's redelivery (visibility timeout 8 s)
bring its actions to the other hosts, which take the keys over with a higher token and commit
the effects. Then host 0 comes back and finishes its stale bodies. The test asserts:

* every action has exactly one effect in the ledger (no duplicate, none lost) and a done record;
* each action host 0 held was taken over (a token above host 0's) by another host;
* host 0's late commits reached the ledger and were refused by the fence, and its records were
  refused by the store (``lease_lost``).

If the machine cannot make namespaces, the test skips locally and fails in CI.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from celery_idem.records import State
from tests.chaos.support import ChaosRedis, Ledger, Stack, TcpProxy
from tests.conftest import IN_CI, PG_URL
from tests.integration.harness import ROOT, Worker, wait_for
from tests.scale.hosts import app as host_app
from tests.scale.hosts.netns import Host, Hosts, netns_unavailable

# The waits below add up past pytest-timeout's 300 s default on a loaded machine.
pytestmark = [pytest.mark.worker, pytest.mark.crash, pytest.mark.slow, pytest.mark.timeout(900)]

HOSTS = 3
VISIBILITY = 8  # seconds: the broker redelivers a cut host's unacknowledged messages after it
HOLD = 2.0  # seconds each body works before it commits


class HostWorker(Worker):
    """A ``celery worker`` inside a host's namespace, under the host's own hostname."""

    def __init__(self, host: Host, env: dict[str, str], concurrency: int = 2) -> None:
        self.env = env
        self.name = host.hostname
        self.host = host
        self.log = Path(tempfile.mkstemp(prefix=f"celery-idem-{self.name}-", suffix=".log")[1])
        cmd = host.command([
            sys.executable, "-m", "celery", "-A", "tests.scale.hosts.app", "worker",
            "-P", "prefork", "-c", str(concurrency), "-n", f"w@{host.hostname}", "-l", "INFO",
            "--without-gossip", "--without-mingle", "--without-heartbeat",
        ])
        self._fh = self.log.open("w")
        self.proc = subprocess.Popen(
            cmd, cwd=ROOT, env={**os.environ, **env}, stdout=self._fh, stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self._wait_ready(90)


@pytest.fixture
def hosts() -> Iterator[Hosts]:
    why = netns_unavailable()
    if why:
        if IN_CI:
            pytest.fail(f"cannot make network namespaces: {why}")
        pytest.skip(f"cannot make network namespaces: {why}")
    made = Hosts(HOSTS)
    try:
        yield made
    finally:
        made.close()


@pytest.fixture
def healed(tmp_path: Path) -> Path:
    """The file that tells host 0's bodies the partition has healed (see ``fenced_effect``)."""
    return tmp_path / "healed"


@pytest.fixture
def store_kind() -> str:
    """The idempotency store: the private Redis, or a PostgreSQL table (parametrized)."""
    return "redis"


@pytest.fixture
def cluster(hosts: Hosts, pg_ledger_url: str, healed: Path, store_kind: str) -> Iterator[Stack]:
    """One private Redis and a PostgreSQL proxy on every gateway; one worker per host.

    The broker and result backend are the Redis; the store is the Redis too, or a PostgreSQL
    table of its own reached through the same proxy as the ledger.
    """
    redis = ChaosRedis("--bind", "127.0.0.1", *hosts.gateways, "--protected-mode", "no")
    ledger = Ledger(pg_ledger_url)
    ledger.conn.execute(f"CREATE TABLE {ledger.base}_fence (action text PRIMARY KEY, "
                        f"token bigint NOT NULL)")
    table = f"{ledger.base}_records"
    pg_store = "db+" + PG_URL
    store_url, options = ((redis.url, None) if store_kind == "redis"
                          else (pg_store, {"table_name": table}))
    stack = Stack(redis, store_url, ledger, env={"IDEM_VISIBILITY": str(VISIBILITY)},
                  store_options=options, name="hosts")
    proxies: list[TcpProxy] = []
    try:
        for host in hosts:
            proxy = TcpProxy(5432, listen_host=host.gateway)
            proxies.append(proxy)
            redis_url = f"redis://{host.gateway}:{redis.port}/0"
            via_proxy = f"{host.gateway}:{proxy.port}"
            env = {**stack.env, "IDEM_BROKER": redis_url, "IDEM_BACKEND": redis_url,
                   "IDEM_LEDGER": redis_url,
                   "IDEM_STORE": (redis_url if store_kind == "redis"
                                  else pg_store.replace("127.0.0.1:5432", via_proxy)),
                   "IDEM_PG_URL": pg_ledger_url.replace("127.0.0.1:5432", via_proxy)}
            if host.index == 0:
                env["SCALE_WORK_UNTIL"] = str(healed)
            stack.workers.append(HostWorker(host, env))
        with stack.active():
            yield stack
    finally:
        for host in hosts:
            if host.is_cut:
                host.restore()  # let the cut worker hear its SIGTERM's consequences quickly
        stack.close()
        for proxy in proxies:
            proxy.close()
        ledger.conn.execute(f"DROP TABLE IF EXISTS {ledger.base}_fence")
        ledger.conn.execute(f"DROP TABLE IF EXISTS {table}")
        ledger.drop()
        redis.cleanup()


def calls(stack: Stack, run: str) -> list[dict[str, Any]]:
    return [c for c in stack.ledger.all_calls() if c["action"].startswith(run)]


@pytest.mark.parametrize(("store_kind", "mode"), [
    ("redis", "blackhole"), ("redis", "linkdown"), ("postgresql", "blackhole"),
])
def test_a_host_cut_off_while_holding_claims_causes_no_duplicate_and_loses_no_action(
    hosts: Hosts, cluster: Stack, action: Callable[[str], str], store_kind: str, mode: str,
    healed: Path,
) -> None:
    stack, cut = cluster, hosts[0]
    run = action("")
    names = [action(f"a{i}") for i in range(18)]
    key_of = {host_app.fenced_effect.idempotency_key_for((n,)): n for n in names}
    store = stack.store
    # Given 18 actions, each enqueued twice, running on three hosts (6 processes)
    for n in names + names:
        host_app.fenced_effect.apply_async(kwargs={"action": n, "hold": HOLD})

    def held_by_cut_host() -> set[str]:
        return {key_of[r.key] for r in store.scan(State.IN_PROGRESS)
                if r.key in key_of and r.owner.startswith(f"{cut.hostname}:")}

    # When host 0 is cut off while it holds claims
    held = wait_for(held_by_cut_host, timeout=60, interval=0.02, what="host 0 to hold a claim")
    cut.cut(mode)
    cut_at = time.time()
    held |= held_by_cut_host()  # claims it made between the look and the cut

    # Then the other hosts finish every action, host 0's included, while it is still cut off
    def all_done() -> bool:
        return all((rec := store.get(k)) is not None and rec.state is State.DONE for k in key_of)

    wait_for(all_done, timeout=120, interval=0.2, what="every action to be done without host 0")
    done_at = time.time()
    final_token: dict[str, int] = {}
    for key, name in key_of.items():
        rec = store.get(key)
        assert rec is not None
        final_token[name] = rec.token
    taken_over = [c for c in calls(stack, run) if c["action"] in held and c["applied"]]
    assert {c["action"] for c in taken_over} == held
    assert all(c["tag"] != cut.hostname for c in taken_over), taken_over
    # When host 0 comes back, and its bodies, still working, finish after the partition
    cut.restore()
    restored_at = time.time()
    healed.touch()

    # Then each stale body commits late with its old token: the fence refuses every commit,
    # and the store refuses every record (lease_lost). A claim sent at the instant of the cut can
    # be committed by the store while its reply is lost: the store shows it held by host 0, but
    # host 0 saw StoreUnavailable and re-queued the message, so no body of its runs (and none
    # commits). Only the held actions whose claim host 0 did not re-queue have a stale body.
    worker0 = stack.workers[0]

    def ran_on_cut_host() -> set[str]:
        lines = [line for line in worker0.text().splitlines()
                 if "celery_idem requeued key=" in line and "reason=store_unavailable" in line]
        requeued = {name for key, name in key_of.items()
                    if any(f"celery_idem requeued key={key} " in line for line in lines)}
        return held - requeued

    def stale_calls() -> list[dict[str, Any]]:
        expected = ran_on_cut_host()
        found = [c for c in calls(stack, run) if c["tag"] == cut.hostname and c["action"] in held]
        return found if expected and len(found) >= len(expected) else []

    # A black hole leaves TCP retransmitting with exponential back-off (up to 120 s between
    # tries on Linux): after a long cut on a loaded machine, the first retry past the restore can
    # be two minutes away.
    stale = wait_for(stale_calls, timeout=300, interval=0.2, what="host 0's stale commits")
    assert not any(c["applied"] for c in stale), stale
    # their old tokens, below the takeovers' (each held action was taken over from host 0)
    assert all(c["token"] < final_token[c["action"]] for c in stale), stale
    wait_for(lambda: worker0.text().count("celery_idem lease_lost") >= len(stale), timeout=60,
             what="host 0's records to be refused (lease_lost)")
    late = f"last_stale_commit_after_restore_s={max(c['at'] for c in stale) - restored_at:.1f}"
    wait_for(stack.queue_empty, timeout=120, what="the queue to drain")
    # And every action has exactly one effect: no duplicate, none lost
    counts = stack.ledger.effect_counts(run)
    assert counts == {n: 1 for n in names}, counts
    takeovers = sum(1 for w in stack.workers[1:] for line in w.text().splitlines()
                    if "celery_idem takeover" in line and f"previous_owner={cut.hostname}:" in line)
    assert takeovers >= len(held)
    everything = calls(stack, run)
    print(f"\n[scale/hosts {store_kind} {mode}] hosts={HOSTS} processes={HOSTS * 2} actions={len(names)} "
          f"messages={2 * len(names)} held_by_cut_host={len(held)} takeovers={takeovers} "
          f"others_done_after_cut_s={done_at - cut_at:.1f} stale_commits_refused={len(stale)} "
          f"{late} calls={len(everything)} effects={sum(counts.values())}")
