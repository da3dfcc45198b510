"""Fixtures of the Redis Cluster / Sentinel tests: private deployments, one per session.

The contract-suite deployments are shared by the tests that only read and write keys (each test
has its own prefix); tests that kill servers build their own with the classes in support.py.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.redis_ha.support import LocalCluster, SentinelGroup


@pytest.fixture(scope="session")
def local_cluster() -> Iterator[LocalCluster]:
    cluster = LocalCluster()
    yield cluster
    cluster.cleanup()


@pytest.fixture(scope="session")
def sentinel_group() -> Iterator[SentinelGroup]:
    group = SentinelGroup()
    yield group
    group.cleanup()
