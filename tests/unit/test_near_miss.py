"""Near-miss option names: refused at definition as firmly as unknown ``idempotency_*``.

Celery keeps any ``@app.task`` keyword as a task attribute without a word, so
``idempotancy_fields=("order_id", "amount_cents")`` would leave the key covering every argument
and two calls differing only in a note would both charge. Each refusal names the option meant;
Celery's own task attributes and ordinary attribute names are never refused.
"""

from __future__ import annotations

from typing import Any

import celery
import pytest
from celery import Celery

import celery_idem
from celery_idem import IdempotentTask
from celery_idem.config import KNOWN_OPTIONS, check_options, near_miss


@pytest.fixture
def app() -> Celery:
    app = Celery("test_near_miss", set_as_current=False)
    app.conf.idempotency_store = "memory://"
    return app


def charge(order_id: str, amount_cents: int, note: str = "") -> str:
    return order_id


def define(app: Celery, **options: Any) -> Any:
    options.setdefault("base", IdempotentTask)
    app.task(shared=False, **options)(charge)
    app.finalize()
    return app.tasks[f"{charge.__module__}.{charge.__name__}"]


@pytest.mark.parametrize(("name", "meant"), [
    ("idempotancy_fields", "idempotency_fields"),  # the issue's one-letter typo in the prefix
    ("idempotency_field", "idempotency_fields"),   # exact prefix: the unknown-option path
    ("idem_fields", "idempotency_fields"),
    ("idempotency_feilds", "idempotency_fields"),
    ("idempotencyfields", "idempotency_fields"),
    ("idempotent_fields", "idempotency_fields"),
    ("idem_ttl", "idempotency_ttl"),
    ("idempotancy_lease", "idempotency_lease"),
    ("idemp_wiat", "idempotency_wait"),
    ("idempotence_key_func", "idempotency_key_func"),
])
def test_a_near_miss_is_refused_at_definition_naming_the_option_meant(
    app: Celery, name: str, meant: str
) -> None:
    with pytest.raises(celery_idem.ImproperlyConfigured) as info:
        define(app, **{name: ("order_id", "amount_cents")})
    message = str(info.value)
    assert repr(name) in message
    assert f"Did you mean {meant!r}" in message


def test_the_issue_s_example_no_longer_defines_a_task_that_keys_every_argument(app: Celery) -> None:
    with pytest.raises(celery.exceptions.ImproperlyConfigured, match="'idempotency_fields'"):
        define(app, idempotancy_fields=("order_id", "amount_cents"))


def test_a_near_miss_on_a_subclass_is_refused_at_the_class_statement() -> None:
    with pytest.raises(celery_idem.ImproperlyConfigured, match="Did you mean 'idempotency_lease'"):

        class Base(IdempotentTask):
            idem_lease = 30


def test_no_attribute_of_celery_s_task_or_idempotent_task_is_a_near_miss() -> None:
    names = set(dir(celery.Task)) | set(dir(IdempotentTask)) | set(vars(celery.Task))
    assert {n: near_miss(n) for n in names if near_miss(n)} == {}
    check_options("celery.Task", sorted(names - {n for n in names if n.startswith("idempotency_")}
                                        | KNOWN_OPTIONS))


ORDINARY = [
    "fields", "ttl", "lease", "wait", "validate", "operation", "key_func", "key", "timeout",
    "name", "max_retries", "queue", "routing_key", "idem", "idempotent", "identity", "ident",
    "id_fields", "ident_fields", "item_fields", "index_fields", "idempotent_transaction",
    "idem_key", "idempotency_key", "idempotency_token", "idempotency_config", "order_fields",
    "idle_wait", "items_ttl", "iden_fields", "retry_backoff", "autoretry_for", "default_fields",
    "_idem_fields", "__module__", "__qualname__", "__doc__", "__wrapped__", "request_ttl",
]


@pytest.mark.parametrize("name", ORDINARY)
def test_ordinary_names_are_left_to_celery(app: Celery, name: str) -> None:
    assert near_miss(name) is None
    check_options("charge", [name])


def test_every_option_and_a_real_definition_with_celery_options_still_pass(app: Celery) -> None:
    check_options("charge", sorted(KNOWN_OPTIONS))
    task = define(app, max_retries=3, acks_late=True, rate_limit="10/s", soft_time_limit=30,
                  idempotency_fields=("order_id", "amount_cents"), idempotency_ttl=600)
    assert task.idempotency_config.fields == ("order_id", "amount_cents")
