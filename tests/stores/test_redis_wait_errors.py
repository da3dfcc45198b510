"""``wait_replicas`` path: a script's error reaches the caller as on the plain path.

The script and ``WAIT`` are pipelined; a foreign value under a record's name must still give
:class:`CorruptRecord` (not a retried ``StoreUnavailable``, which would re-queue for ever).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis

from celery_idem.exceptions import CorruptRecord
from celery_idem.stores.redis import RedisStore
from tests.stores.support import claim


@pytest.mark.parametrize("wait_replicas", [0, 1])
def test_a_foreign_key_is_a_corrupt_record_with_or_without_wait(
    redis_url: str, prefix: str, redis_client: redis.Redis, redis_cleanup: Iterator[None],
    wait_replicas: int,
) -> None:
    redis_client.set(f"{prefix}foreign", b"not a record", ex=600)
    store = RedisStore.from_url(redis_url, prefix=prefix, wait_replicas=wait_replicas,
                                wait_timeout=0.2)
    try:
        with pytest.raises(CorruptRecord, match="is not a celery_idem record"):
            claim(store, "foreign")
    finally:
        store.close()
