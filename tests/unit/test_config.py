"""Task options: checked when the task is defined, resolved into a frozen config.

Celery creates ``@app.task`` classes lazily (a proxy evaluated at first use or at
``app.finalize()``), so each test forces the class into existence before asserting.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import celery.exceptions
import kombu.exceptions
import pytest
import redis.exceptions
from billiard.exceptions import SoftTimeLimitExceeded
from celery import Celery

import celery_idem
from celery_idem import IdempotentTask
from celery_idem.config import DEFAULT_TERMINAL_ON, KNOWN_OPTIONS, default_release_on

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def app() -> Celery:
    app = Celery("test_config", set_as_current=False)
    app.conf.idempotency_store = "memory://"
    return app


def define(app: Celery, fun: Callable[..., Any], **options: Any) -> Any:
    """Define ``fun`` as an IdempotentTask on ``app`` and force Celery to build its class."""
    # shared=False: a shared task would be built by every app finalized later in the process,
    # so one deliberately broken definition would break every other test.
    options.setdefault("base", IdempotentTask)
    app.task(shared=False, **options)(fun)
    app.finalize()
    return app.tasks[f"{fun.__module__}.{fun.__name__}"]


def charge(order_id: str, amount_cents: int, note: str = "") -> str:
    return order_id


def charge_bound(self: Any, order_id: str, amount_cents: int) -> str:
    return order_id


def test_a_misspelt_option_is_rejected_at_definition_with_a_did_you_mean_hint(
    app: Celery,
) -> None:
    with pytest.raises(celery_idem.ImproperlyConfigured) as info:
        define(app, charge, idempotency_feilds=("order_id",))
    message = str(info.value)
    assert "'idempotency_feilds'" in message
    assert "Did you mean 'idempotency_fields'?" in message


def test_the_rejection_is_also_celerys_improperly_configured(app: Celery) -> None:
    with pytest.raises(celery.exceptions.ImproperlyConfigured):
        define(app, charge, idempotency_tll=60)


def test_the_rejection_happens_when_the_lazy_task_is_first_used(app: Celery) -> None:
    # Given a lazily created task with a typo (nothing is built yet)
    proxy = app.task(base=IdempotentTask, shared=False, idempotency_wiat=5)(charge)
    # When the task is first touched, Then its class is built and refused
    with pytest.raises(celery_idem.ImproperlyConfigured, match="idempotency_wait"):
        _ = proxy.name


def test_an_unknown_option_lists_every_known_option(app: Celery) -> None:
    with pytest.raises(celery_idem.ImproperlyConfigured) as info:
        define(app, charge, idempotency_xyzzy=True)
    assert all(option in str(info.value) for option in KNOWN_OPTIONS)


@pytest.mark.parametrize("name", ["idempotency_xyzzy", "idempotency_store"])
def test_a_name_close_to_no_option_gets_no_misleading_hint(app: Celery, name: str) -> None:
    # Every option shares the 12-character "idempotency_" prefix, so a hint must be chosen by
    # the rest of the name: "idempotency_store" (an app setting) is not a typo of "..._ttl".
    with pytest.raises(celery_idem.ImproperlyConfigured) as info:
        define(app, charge, **{name: 1})
    assert "Did you mean 'idempotency_ttl'" not in str(info.value)


def test_a_misspelt_option_on_a_subclass_is_rejected_at_the_class_statement() -> None:
    with pytest.raises(celery_idem.ImproperlyConfigured, match="Did you mean 'idempotency_lease'"):

        class Base(IdempotentTask):
            idempotency_leese = 30


def test_options_without_the_prefix_are_left_to_celery(app: Celery) -> None:
    task = define(app, charge, max_retries=3, idempotency_ttl=600)
    assert task.max_retries == 3
    assert task.idempotency_config.ttl == 600


def test_fields_naming_a_non_argument_are_rejected_with_the_real_arguments(app: Celery) -> None:
    with pytest.raises(celery_idem.ImproperlyConfigured) as info:
        define(app, charge, idempotency_fields=("order", "amount_cents"))
    message = str(info.value)
    assert "'order'" in message
    assert "order_id, amount_cents, note" in message


def test_self_of_a_bound_task_is_not_an_argument_that_fields_can_name(app: Celery) -> None:
    with pytest.raises(celery_idem.ImproperlyConfigured, match="'self'"):
        define(app, charge_bound, bind=True, idempotency_fields=("self", "order_id"))


def test_fields_of_a_bound_task_name_its_business_arguments(app: Celery) -> None:
    task = define(app, charge_bound, bind=True, idempotency_fields=("order_id",))
    assert task.idempotency_config.fields == ("order_id",)


def test_fields_given_as_a_string_are_rejected_with_the_tuple_to_write(app: Celery) -> None:
    with pytest.raises(celery_idem.ImproperlyConfigured) as info:
        define(app, charge, idempotency_fields="order_id")
    assert "('order_id',)" in str(info.value)


def test_empty_fields_are_rejected(app: Celery) -> None:
    with pytest.raises(celery_idem.ImproperlyConfigured, match="non-empty"):
        define(app, charge, idempotency_fields=())


def test_fields_given_as_a_list_are_frozen_into_a_tuple(app: Celery) -> None:
    task = define(app, charge, idempotency_fields=["order_id", "amount_cents"])
    assert task.idempotency_config.fields == ("order_id", "amount_cents")


@pytest.mark.parametrize(
    ("options", "fragment"),
    [
        pytest.param({"idempotency_ttl": 10, "idempotency_lease": 30}, "at least", id="ttl < lease"),
        pytest.param({"idempotency_wait": -1}, "idempotency_wait", id="negative wait"),
        pytest.param({"idempotency_lease": 0}, "idempotency_lease", id="zero lease"),
        pytest.param({"idempotency_ttl": -5}, "idempotency_ttl", id="negative ttl"),
        pytest.param({"idempotency_ttl": "1d"}, "number of seconds", id="ttl as text"),
        pytest.param({"idempotency_lease": True}, "number of seconds", id="lease as bool"),
        pytest.param({"idempotency_record_timeout": 0}, "idempotency_record_timeout",
                     id="zero record timeout"),
        pytest.param({"idempotency_key_func": "not callable"}, "callable", id="key_func not callable"),
        pytest.param({"idempotency_key_func": lambda *a, **k: "x",
                      "idempotency_fields": ("order_id",)}, "not both", id="key_func and fields"),
        pytest.param({"idempotency_release_on": ("TimeoutError",)}, "exception classes",
                     id="release_on of names"),
        pytest.param({"idempotency_terminal_on": (ValueError, 3)}, "exception classes",
                     id="terminal_on with a non-class"),
        pytest.param({"idempotency_operation": 42}, "idempotency_operation", id="operation not str"),
    ],
)
def test_a_wrong_option_value_is_rejected_at_definition(
    app: Celery, options: dict[str, Any], fragment: str
) -> None:
    with pytest.raises(celery_idem.ImproperlyConfigured, match=fragment):
        define(app, charge, **options)


def test_zero_wait_is_allowed(app: Celery) -> None:
    assert define(app, charge, idempotency_wait=0).idempotency_config.wait == 0


def test_ttl_equal_to_lease_is_allowed(app: Celery) -> None:
    cfg = define(app, charge, idempotency_ttl=30, idempotency_lease=30).idempotency_config
    assert (cfg.ttl, cfg.lease) == (30, 30)


@pytest.mark.parametrize(
    "error",
    [
        TimeoutError,
        ConnectionError,
        SoftTimeLimitExceeded,
        redis.exceptions.ConnectionError,
        redis.exceptions.TimeoutError,
        kombu.exceptions.OperationalError,
    ],
)
def test_the_default_release_on_set_contains_each_timeout_class_error(
    app: Celery, error: type[BaseException]
) -> None:
    assert error in default_release_on()
    assert error in define(app, charge).idempotency_config.release_on


def test_the_default_release_on_set_has_no_duplicates_and_no_ordinary_errors() -> None:
    release = default_release_on()
    assert len(release) == len(set(release))
    assert not any(issubclass(ValueError, cls) for cls in release)


def test_an_explicit_release_on_replaces_the_default_set(app: Celery) -> None:
    cfg = define(app, charge, idempotency_release_on=(KeyError,)).idempotency_config
    assert cfg.release_on == (KeyError,)


def test_a_single_exception_class_is_accepted_as_release_on(app: Celery) -> None:
    cfg = define(app, charge, idempotency_release_on=KeyError).idempotency_config
    assert cfg.release_on == (KeyError,)


def test_the_documented_defaults(app: Celery) -> None:
    task = define(app, charge)
    cfg = task.idempotency_config
    assert cfg.operation == task.name
    assert cfg.fields is None
    assert cfg.key_func is None
    assert cfg.ttl == 86400
    assert 30 <= cfg.lease <= 60
    assert cfg.terminal_on == DEFAULT_TERMINAL_ON == (
        celery_idem.TerminalError, celery_idem.IdempotencyKeyMismatch,
    )
    assert cfg.validate is False
    assert cfg.wait == 0  # a delivered copy of a busy key re-queues at once


def test_acks_late_and_reject_on_worker_lost_are_on_by_default(app: Celery) -> None:
    task = define(app, charge)
    assert task.acks_late is True
    assert task.reject_on_worker_lost is True
    assert IdempotentTask.acks_late is True
    assert IdempotentTask.reject_on_worker_lost is True


def test_the_operation_option_replaces_the_task_name(app: Celery) -> None:
    assert define(app, charge, idempotency_operation="charge").idempotency_config.operation == (
        "charge"
    )


def test_the_resolved_config_is_frozen(app: Celery) -> None:
    cfg = define(app, charge).idempotency_config
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.ttl = 1  # type: ignore[misc]


class ShortLived(IdempotentTask):
    """A project-wide base with its own defaults."""

    idempotency_ttl = 3600
    idempotency_lease = 20
    idempotency_wait = 2


def test_a_base_subclass_overrides_the_library_defaults(app: Celery) -> None:
    cfg = define(app, charge, base=ShortLived).idempotency_config
    assert (cfg.ttl, cfg.lease, cfg.wait) == (3600, 20, 2)


def test_an_app_task_keyword_beats_the_base_subclass(app: Celery) -> None:
    cfg = define(app, charge, base=ShortLived, idempotency_ttl=120,
                 idempotency_wait=0).idempotency_config
    # The keyword wins where given, the subclass where not
    assert (cfg.ttl, cfg.lease, cfg.wait) == (120, 20, 0)


def test_a_subclass_with_a_wrong_value_is_rejected_at_the_class_statement() -> None:
    with pytest.raises(celery_idem.ImproperlyConfigured, match="at least"):

        class Broken(IdempotentTask):
            idempotency_ttl = 5
            idempotency_lease = 10


def test_a_keyword_that_breaks_the_subclass_invariant_is_rejected(app: Celery) -> None:
    # ShortLived has lease 20: a ttl below it is wrong even though ShortLived alone is fine
    with pytest.raises(celery_idem.ImproperlyConfigured, match="at least"):
        define(app, charge, base=ShortLived, idempotency_ttl=10)


def test_a_misspelt_option_surfaces_at_the_first_delay_before_anything_is_published() -> None:
    # As docs/configuration.md says: Celery builds an @app.task class lazily, so the decorator
    # (the import of a tasks module) does not raise; the first delay() does, and sends nothing.
    app = Celery("test_config_surface", broker="memory://", set_as_current=False)
    app.conf.update(idempotency_store="memory://", task_default_queue="surface-q")
    task = app.task(shared=False, base=IdempotentTask, idempotency_feilds=("order_id",))(charge)
    with pytest.raises(celery_idem.ImproperlyConfigured, match="Did you mean 'idempotency_fields'"):
        task.delay("ord_1", 4200)
    with app.connection_for_write() as conn:
        assert conn.SimpleQueue("surface-q").qsize() == 0
    text = " ".join((ROOT / "docs" / "configuration.md").read_text().split())
    assert "The options are checked when the task class is created." in text
    assert "not at import" in text and "first `delay()` before anything is published" in text
