"""``python -m bench.revisions``' probe runs on the checkout's own package and cleans up."""

from __future__ import annotations

import uuid

import redis

from bench import revisions


def test_the_probe_times_delay_and_the_gate_and_leaves_no_keys(redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url)
    # Its own prefix: other runs on this server (make test-compat's parallel Celery versions)
    # write and delete benchrev* keys of their own meanwhile.
    prefix = f"benchrev-test-{uuid.uuid4().hex[:8]}:"
    timings = revisions.probe(redis_url, 5, prefix)
    assert list(timings) == ["delay() first", "gate first", "gate duplicate"]
    for cpu_us, wall_us in timings.values():
        assert cpu_us > 0 and wall_us > 0
    assert list(client.scan_iter(prefix + "*", count=1000)) == []
    client.close()
