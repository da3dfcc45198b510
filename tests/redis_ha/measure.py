"""Measure the Redis Cluster / Sentinel stores: failover runs and the cost of ``wait_replicas``.

    .venv/bin/python -m tests.redis_ha.measure [--rounds 3] [--actions 60] [--kinds cluster,sentinel]

1. Latency of claim + record on a local 6-node cluster and a sentinel-managed master, with
   ``wait_replicas`` 0 and 1 (same host: this is the floor; across hosts WAIT adds about one
   master-to-replica round trip).
2. ``--rounds`` failover runs per deployment and setting: tests/redis_ha/test_failover.py with
   ``IDEM_HA_WAIT`` and ``IDEM_HA_ACTIONS``, each printing one line (duplicates, lost actions,
   promotion time, requeues). Its output is in docs/redis-cluster.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
import uuid

from celery_idem.records import State
from celery_idem.stores import store_from_url
from tests.integration.harness import ROOT
from tests.redis_ha.support import MASTER_NAME, LocalCluster, SentinelGroup


def latency(url: str, n: int) -> str:
    parts = []
    for wait in (0, 1):
        store = store_from_url(url, prefix=f"m-{uuid.uuid4().hex[:6]}:",
                               options={"wait_replicas": wait})
        samples = []
        for i in range(n):
            t = time.perf_counter()
            claim = store.claim(f"k{i}", owner="o", task_id="t", attempt=0, lease=60, ttl=600)
            store.record(f"k{i}", claim.token, state=State.DONE, content_type="application/json",
                         data=b"[1]", ttl=600)
            samples.append((time.perf_counter() - t) * 1000)
        store.close()
        samples.sort()
        parts.append(f"wait_replicas={wait}: median {statistics.median(samples):.2f} ms, "
                     f"p99 {samples[int(len(samples) * 0.99)]:.2f} ms")
    return "; ".join(parts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--actions", type=int, default=60)
    parser.add_argument("--latency-n", type=int, default=2000)
    parser.add_argument("--kinds", default="cluster,sentinel")
    parser.add_argument("--no-latency", action="store_true")
    args = parser.parse_args()
    kinds = args.kinds.split(",")

    if not args.no_latency:
        print("## claim + record latency (one process, sequential)")
        cluster = LocalCluster()
        try:
            print(f"cluster : {latency(cluster.url, args.latency_n)}")
        finally:
            cluster.cleanup()
        group = SentinelGroup()
        try:
            url = group.url + f"?master_name={MASTER_NAME}"
            print(f"sentinel: {latency(url, args.latency_n)}")
        finally:
            group.cleanup()

    print(f"\n## failover runs ({args.actions} actions x 3 copies, 2 workers x 2 processes)")
    for kind in kinds:
        for wait in (0, 1):
            for _ in range(args.rounds):
                env = {**os.environ, "IDEM_HA_WAIT": str(wait),
                       "IDEM_HA_ACTIONS": str(args.actions)}
                out = subprocess.run(
                    [sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider",
                     "tests/redis_ha/test_failover.py", "-k", kind],
                    cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800,
                )
                lines = [ln for ln in out.stdout.splitlines() if ln.startswith(f"{kind} wait")]
                verdict = "passed" if out.returncode == 0 else f"FAILED (exit {out.returncode})"
                print(f"{lines[0] if lines else kind + ': no run line'} [{verdict}]", flush=True)
                if out.returncode and not lines:
                    print(out.stdout[-3000:])


if __name__ == "__main__":
    main()
