"""celery_idem.stores.redis_durability: what a Redis server's settings mean for its records.

The settings are given as ``CONFIG GET`` returns them (and read once from the shared Redis);
tests/stores/test_durability.py reads them from real redis-servers started with each setting.
"""

from __future__ import annotations

import logging

import pytest

from celery_idem.stores.redis_durability import (
    DURABILITY_SETTINGS,
    config_get,
    durability_findings,
    text,
)

DURABLE = {"appendonly": "yes", "appendfsync": "everysec", "maxmemory-policy": "noeviction",
           "maxmemory": "0"}


def _settings(**changes: str) -> dict[str, str]:
    return {**DURABLE, **{k.replace("_", "-"): v for k, v in changes.items()}}


def test_a_durable_server_has_no_finding() -> None:
    assert durability_findings(DURABLE, "store") == []
    assert durability_findings(_settings(appendfsync="always"), "store") == []
    # A server that reports nothing (CONFIG renamed away) is not a finding of this function
    assert durability_findings({}, "store") == []


def test_no_aof_loses_every_record_on_a_restart() -> None:
    [finding] = durability_findings(_settings(appendonly="no"), "redis://h:6379/0")
    assert (finding.setting, finding.value, finding.level) == ("appendonly", "no", logging.WARNING)
    assert finding.risk.startswith("redis://h:6379/0: appendonly is no, so a restart")
    assert "appendonly yes" in finding.fix and "noeviction" in finding.fix


def test_appendfsync_no_matters_only_with_the_aof_on() -> None:
    [finding] = durability_findings(_settings(appendfsync="no"), "store")
    assert (finding.setting, finding.value) == ("appendfsync", "no")
    assert "host crash or power loss" in finding.risk
    # Without the AOF, appendfsync says nothing more: one finding, the AOF's
    only = durability_findings(_settings(appendonly="no", appendfsync="no"), "store")
    assert [f.setting for f in only] == ["appendonly"]


@pytest.mark.parametrize("policy", ["allkeys-lru", "volatile-ttl", "ALLKEYS-LFU"])
def test_an_evicting_policy_is_a_finding_named_as_configured(policy: str) -> None:
    [finding] = durability_findings(_settings(maxmemory_policy=policy, maxmemory="100mb"), "s")
    assert (finding.setting, finding.value) == ("maxmemory-policy", policy.lower())
    assert "evicts keys, records included" in finding.risk
    assert "maxmemory is 0" not in finding.risk


def test_an_evicting_policy_without_a_limit_says_nothing_is_evicted_yet() -> None:
    [finding] = durability_findings(_settings(maxmemory_policy="allkeys-lru"), "s")
    assert finding.risk.endswith("(maxmemory is 0 now: nothing is evicted until a limit is set)")


def test_both_risks_are_reported_in_order() -> None:
    found = durability_findings(_settings(appendonly="no", maxmemory_policy="allkeys-lru"), "s")
    assert [f.setting for f in found] == ["appendonly", "maxmemory-policy"]


@pytest.mark.parametrize("decode", [False, True])
def test_config_get_reads_each_setting_as_text_from_a_real_server(redis_url: str,
                                                                   decode: bool) -> None:
    import redis

    client = redis.Redis.from_url(redis_url, decode_responses=decode)
    try:
        settings = config_get(client)
    finally:
        client.close()
    assert sorted(settings) == sorted(DURABILITY_SETTINGS)
    assert all(isinstance(v, str) for v in settings.values())
    assert settings["appendonly"] in ("yes", "no")
    assert text(b"yes") == "yes" and text("yes") == "yes"
