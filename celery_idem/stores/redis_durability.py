"""What a Redis server's settings mean for the records it keeps (``RedisStore.check_durability``,
read once at worker start)."""

from __future__ import annotations

from typing import Any

from .base import DurabilityFinding

__all__ = ["DURABILITY_SETTINGS", "config_get", "durability_findings", "text"]


def text(value: bytes | str) -> str:
    """``value`` as str (a reply of a client without ``decode_responses``)."""
    return value.decode() if isinstance(value, bytes) else value


#: The settings :meth:`RedisStore.check_durability` reads.
DURABILITY_SETTINGS = ("appendonly", "appendfsync", "maxmemory-policy", "maxmemory")
_FIX = (
    "set appendonly yes, appendfsync everysec (or always) and maxmemory-policy noeviction on the "
    "store's Redis (docs/reliability.md, 'Redis settings the store needs')")


def config_get(client: Any) -> dict[str, str]:
    """The server's :data:`DURABILITY_SETTINGS`, one ``CONFIG GET`` each (Redis before 7 takes
    one pattern per call)."""
    return {text(k): text(v) for name in DURABILITY_SETTINGS
            for k, v in dict(client.config_get(name)).items()}


def durability_findings(settings: dict[str, str], where: str) -> list[DurabilityFinding]:
    """What Redis ``settings`` (``CONFIG GET`` values) mean for records kept at ``where``."""
    findings: list[DurabilityFinding] = []
    appendonly = settings.get("appendonly", "").lower()
    if appendonly == "no":
        findings.append(DurabilityFinding(
            "appendonly", "no",
            f"{where}: appendonly is no, so a restart of redis-server (a crash, an upgrade, a "
            f"reboot) loses every record written since the last RDB snapshot: finished actions "
            f"run again on their next duplicate, and claims held at the time are issued again",
            fix=_FIX))
    elif settings.get("appendfsync", "").lower() == "no":
        findings.append(DurabilityFinding(
            "appendfsync", "no",
            f"{where}: appendfsync is no, so the kernel decides when the AOF reaches the disk and "
            f"a host crash or power loss can lose the last ~30 s of records (everysec: ~1 s)",
            fix=_FIX))
    policy = settings.get("maxmemory-policy", "").lower()
    if policy and policy != "noeviction":
        unlimited = settings.get("maxmemory", "") == "0"
        findings.append(DurabilityFinding(
            "maxmemory-policy", policy,
            f"{where}: maxmemory-policy is {policy}, so under memory pressure Redis evicts keys, "
            f"records included (every record has a TTL, so volatile-* policies evict them "
            f"too); an evicted record runs its action again"
            + (" (maxmemory is 0 now: nothing is evicted until a limit is set)" if unlimited else ""),
            fix=_FIX))
    return findings
