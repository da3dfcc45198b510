"""celery_idem.durability: what the worker start does with a store's durability findings.

The findings come from a store's ``check_durability`` (tests/stores/test_durability.py reads
them from real redis-servers); here the store reports chosen findings, so that every branch of
the worker start's decision is seen: a note, a risk, several risks with one fix, an unreachable
store, and the refusal with ``idempotency_require_durable_store``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import pytest

from celery_idem.durability import REQUIRE_DURABLE_SETTING, check_replication, check_store
from celery_idem.exceptions import ImproperlyConfigured, StoreUnavailable
from celery_idem.stores.base import DurabilityFinding
from celery_idem.stores.memory import MemoryStore

# No Celery, kombu or redis-py code runs here: make test-compat runs it on its first Celery only.
pytestmark = pytest.mark.celery_independent

NO_AOF = DurabilityFinding("appendonly", "no", "a restart loses every record",
                           fix="set appendonly yes")
EVICTS = DurabilityFinding("maxmemory-policy", "allkeys-lru", "memory pressure evicts records",
                           fix="set maxmemory-policy noeviction")
EVICTS_TOO = DurabilityFinding("maxmemory", "1mb", "a small maxmemory evicts sooner",
                               fix="set maxmemory-policy noeviction")
NOTE = DurabilityFinding("CONFIG", None, "the server refuses CONFIG GET", level=logging.INFO)


class Reporting(MemoryStore):
    """A store whose server reports ``findings`` (or cannot be reached: ``down``)."""

    def __init__(self, findings: Iterable[DurabilityFinding] = (), down: bool = False,
                 replicas: list[str] | None = None) -> None:
        super().__init__(prefix="unit:")
        self.findings = list(findings)
        self.down = down
        self.replicas = replicas

    def check_durability(self) -> list[DurabilityFinding]:
        if self.down:
            raise StoreUnavailable("connection refused")
        return self.findings

    def replication_warnings(self) -> list[str]:
        if self.down:
            raise StoreUnavailable("connection refused")
        return self.replicas or []


def _lines(caplog: pytest.LogCaptureFixture) -> list[tuple[int, str]]:
    return [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "celery_idem"]


def test_a_durable_store_logs_nothing(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="celery_idem")
    check_store(Reporting())
    check_store(Reporting(), require=True)
    assert _lines(caplog) == []


def test_a_risk_is_one_warning_naming_setting_risk_fix_and_the_option(
    caplog: pytest.LogCaptureFixture,
) -> None:
    check_store(Reporting([NO_AOF]))
    [(level, line)] = _lines(caplog)
    assert level == logging.WARNING
    assert "(appendonly no)" in line and "a restart loses every record" in line
    assert "Fix: set appendonly yes;" in line and f"set {REQUIRE_DURABLE_SETTING} = True" in line


def test_several_risks_name_each_setting_and_each_distinct_fix_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    check_store(Reporting([EVICTS, NO_AOF, EVICTS_TOO]))
    [(_, line)] = _lines(caplog)
    assert "(maxmemory-policy allkeys-lru, appendonly no, maxmemory 1mb)" in line
    assert line.count("set maxmemory-policy noeviction") == 1
    assert "Fix: set maxmemory-policy noeviction; set appendonly yes;" in line


def test_require_refuses_to_start_on_a_risk_and_names_the_option() -> None:
    with pytest.raises(ImproperlyConfigured) as refused:
        check_store(Reporting([NO_AOF, EVICTS]), require=True)
    message = str(refused.value)
    assert message.startswith(f"{REQUIRE_DURABLE_SETTING} is set and the idempotency store can "
                              "lose records (appendonly no, maxmemory-policy allkeys-lru)")
    assert message.endswith(f"Fix: set appendonly yes; set maxmemory-policy noeviction, or unset "
                            f"{REQUIRE_DURABLE_SETTING}")


def test_a_note_is_info_and_never_refuses(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="celery_idem")
    check_store(Reporting([NOTE]), require=True)
    assert _lines(caplog) == [
        (logging.INFO, "celery_idem store durability not checked: the server refuses CONFIG GET"),
    ]


def test_an_unreachable_store_is_a_warning_not_a_refusal(caplog: pytest.LogCaptureFixture) -> None:
    check_store(Reporting(down=True), require=True)
    [(level, line)] = _lines(caplog)
    assert level == logging.WARNING and "could not check" in line and "connection refused" in line


def test_replication_warnings_are_logged_one_line_each(caplog: pytest.LogCaptureFixture) -> None:
    check_replication(Reporting(replicas=["0 of 1 replicas connected", "replica lag 12 s"]))
    assert _lines(caplog) == [
        (logging.WARNING, "celery_idem 0 of 1 replicas connected"),
        (logging.WARNING, "celery_idem replica lag 12 s"),
    ]
    caplog.clear()
    check_replication(Reporting(down=True))
    [(level, line)] = _lines(caplog)
    assert level == logging.WARNING and "could not check the store's replicas" in line
    caplog.clear()
    check_replication(Reporting())
    check_replication(MemoryStore(prefix="unit:"))
    assert _lines(caplog) == []
