"""The app a benchmark worker runs: ``celery -A bench.worker_app worker`` (started by ``bench.e2e``).

Readiness is a Redis key set from ``worker_ready`` (the worker logs at WARNING, so there is no
" ready." line to wait for).
"""

from __future__ import annotations

import os
from typing import Any

import redis
from celery.signals import worker_ready

from bench.app import Settings, build_app

settings = Settings.from_env()
app = build_app(settings)


@worker_ready.connect(weak=False)
def _announce(sender: Any = None, **_: Any) -> None:
    client = redis.Redis.from_url(settings.redis_url)
    client.set(settings.ready_key, os.getpid(), ex=3600)
    client.close()
