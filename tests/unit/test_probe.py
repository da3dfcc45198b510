"""What a store error means (celery_idem/probe.py): a configuration mistake or an outage.

The real servers' errors are checked through real workers in
tests/integration/test_worker_start.py; here, the classification and the re-queue log levels.
"""

from __future__ import annotations

import logging

import pytest
import redis
from sqlalchemy import exc as sa_exc

from celery_idem.exceptions import StoreUnavailable
from celery_idem.probe import (
    AUTHENTICATION,
    MISSING_DATABASE,
    REQUEUE_DELAY_CAP,
    log_store_down,
    misconfiguration,
    requeue_delay,
)


def wrapped(cause: BaseException) -> StoreUnavailable:
    try:
        raise StoreUnavailable("could not reach the store") from cause
    except StoreUnavailable as exc:
        return exc


class MySQLError(Exception):
    pass


@pytest.mark.parametrize(("cause", "reason"), [
    (redis.AuthenticationError("invalid username-password pair"), AUTHENTICATION),
    (redis.ResponseError("DB index is out of range"), MISSING_DATABASE),
    (sa_exc.OperationalError("connect", {}, MySQLError(1049, "Unknown database 'x'")),
     MISSING_DATABASE),
    (sa_exc.OperationalError("connect", {}, MySQLError(1045, "Access denied for user")),
     AUTHENTICATION),
    (sa_exc.OperationalError("connect", {}, Exception(
        'connection failed: FATAL:  database "x" does not exist')), MISSING_DATABASE),
    (sa_exc.OperationalError("connect", {}, Exception(
        'FATAL:  password authentication failed for user "u"')), AUTHENTICATION),
])
def test_a_configuration_mistake_is_recognised_through_its_causes(
    cause: BaseException, reason: str
) -> None:
    assert misconfiguration(wrapped(cause)) == reason


@pytest.mark.parametrize("cause", [
    redis.ConnectionError("Error 111 connecting to 127.0.0.1:1. Connection refused."),
    redis.TimeoutError("Timeout reading from socket"),
    sa_exc.OperationalError("connect", {}, MySQLError(2003, "Can't connect to MySQL server")),
    sa_exc.OperationalError("connect", {}, Exception("server closed the connection unexpectedly")),
])
def test_an_outage_is_not_a_mistake(cause: BaseException) -> None:
    assert misconfiguration(wrapped(cause)) is None


def test_the_requeue_delay_doubles_to_its_cap_and_never_overflows() -> None:
    assert [requeue_delay(n) for n in range(7)] == [1, 2, 4, 8, 16, 30, 30]
    assert requeue_delay(5000) == REQUEUE_DELAY_CAP


def test_an_outage_is_logged_at_warning_and_a_mistake_at_error(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.DEBUG, logger="celery_idem"):
        log_store_down("t", "id-1", "k", wrapped(redis.ConnectionError("refused")), 2)
        log_store_down("t", "id-2", "k", wrapped(redis.AuthenticationError("WRONGPASS")), 2)
    outage, mistake = caplog.records
    assert outage.levelno == logging.WARNING and "re-queued in 4 s" in outage.getMessage()
    assert "up to 30 s" in outage.getMessage()
    assert mistake.levelno == logging.ERROR and "WRONGPASS" in mistake.getMessage()
    assert "password" in mistake.getMessage()
