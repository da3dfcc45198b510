"""App settings: every ``idempotency_*`` app setting is read once per app into a frozen object."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path
from types import SimpleNamespace

import pytest
from celery import Celery

from celery_idem import IdempotentTask, ImproperlyConfigured, config
from celery_idem.app import check_worker
from celery_idem.config import ACCELERATE_ENV, DEFAULT_PREFIX, Settings, forget_settings, settings

PACKAGE = Path(config.__file__).parent


def test_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ACCELERATE_ENV, raising=False)  # make test-plain sets it
    app = Celery("test_settings_defaults", set_as_current=False)
    read = settings(app)
    assert read == Settings()
    assert read.key_prefix == DEFAULT_PREFIX
    assert read.accelerate is True


def test_frozen_and_read_once() -> None:
    app = Celery("test_settings_once", set_as_current=False)
    app.conf.update(idempotency_key_prefix="first:", idempotency_store_options={"a": 1})
    read = settings(app)
    with pytest.raises(dataclasses.FrozenInstanceError):
        read.key_prefix = "other:"  # type: ignore[misc]
    with pytest.raises(TypeError):
        read.store_options["a"] = 2  # type: ignore[index]
    app.conf.idempotency_key_prefix = "second:"
    assert settings(app) is read  # not read again
    assert settings(app).key_prefix == "first:"
    forget_settings(app)
    assert settings(app).key_prefix == "second:"


def test_each_setting_is_read() -> None:
    app = Celery("test_settings_each", set_as_current=False)
    app.conf.update(
        idempotency_store="memory://", idempotency_key_prefix="p:", idempotency_events=True,
        idempotency_receipts_table="rcpt", idempotency_fold_results=False,
        idempotency_require_durable_store=True, idempotency_log_answers=False,
        idempotency_accelerate=False,
    )
    assert settings(app) == Settings(
        store="memory://", key_prefix="p:", events=True, receipts_table="rcpt",
        fold_results=False, require_durable_store=True, log_answers=False, accelerate=False,
    )


def test_every_app_setting_has_a_field() -> None:
    fields = {f"idempotency_{field.name}" for field in dataclasses.fields(Settings)}
    assert fields == config._APP_SETTINGS


@pytest.mark.parametrize("value", ["0", "false", "No", " off "])
def test_env_turns_acceleration_off(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv("CELERY_IDEM_ACCELERATE", value)
    app = Celery("test_settings_env", set_as_current=False)
    assert settings(app).accelerate is False


@pytest.mark.parametrize("value", ["1", "true", "", "yes"])
def test_env_leaves_acceleration_on(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv("CELERY_IDEM_ACCELERATE", value)
    app = Celery("test_settings_env_on", set_as_current=False)
    assert settings(app).accelerate is True


def _setting_constants(trees: list[ast.AST]) -> frozenset[str]:
    """Names bound to an ``idempotency_*`` string anywhere (``REQUIRE_DURABLE_SETTING = ...``)."""
    return frozenset(
        target.id
        for tree in trees
        for node in ast.walk(tree)
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant)
        and isinstance(node.value.value, str) and node.value.value.startswith("idempotency_")
        for target in node.targets
        if isinstance(target, ast.Name)
    )


def _setting_reads(tree: ast.AST, constants: frozenset[str] = frozenset()) -> list[tuple[int, str]]:
    """Reads of an ``idempotency_*`` setting from a configuration: ``x.conf.get("idempotency_…")``
    (or of a name in ``constants``), ``conf.get(…)``, ``conf["idempotency_…"]`` and
    ``x.conf.idempotency_…``."""
    found: list[tuple[int, str]] = []

    def is_conf(node: ast.AST) -> bool:
        return (isinstance(node, ast.Name) and node.id.endswith("conf")) or (
            isinstance(node, ast.Attribute) and node.attr == "conf") or (
            isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
            and node.func.id.endswith("conf"))

    def is_setting(node: ast.AST) -> bool:
        if isinstance(node, ast.Constant):
            return isinstance(node.value, str) and node.value.startswith("idempotency_")
        return isinstance(node, ast.Name) and node.id in constants

    for node in ast.walk(tree):
        getter = isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
            and node.func.attr == "get" and is_conf(node.func.value) and bool(node.args) \
            and is_setting(node.args[0])
        item = isinstance(node, ast.Subscript) and is_conf(node.value) and is_setting(node.slice)
        attribute = isinstance(node, ast.Attribute) and node.attr.startswith("idempotency_") \
            and is_conf(node.value)
        if getter or item or attribute:
            found.append((node.lineno, ast.unparse(node)))  # type: ignore[attr-defined]
    return found


def test_the_scan_finds_reads() -> None:
    code = (
        "NAME = 'idempotency_require_durable_store'\n"
        "a = app.conf.get('idempotency_store')\n"
        "b = conf.get('idempotency_events')\n"
        "c = self.app.conf.idempotency_key_prefix\n"
        "d = conf['idempotency_fold_results']\n"
        "e = _celery_conf().get('idempotency_key_prefix')\n"
        "f = app.conf.get(NAME)\n"
        "g = app.conf.get('task_time_limit')\n"  # Celery's own setting: allowed
        "h = conf.get(setting)\n"  # a name that holds no idempotency_* constant
    )
    tree = ast.parse(code)
    assert [line for line, _ in _setting_reads(tree, _setting_constants([tree]))] == [2, 3, 4, 5, 6, 7]


def test_settings_are_read_only_in_config() -> None:
    trees = {path: ast.parse(path.read_text(), str(path)) for path in sorted(PACKAGE.rglob("*.py"))}
    constants = _setting_constants(list(trees.values()))
    offenders = [
        f"{path.relative_to(PACKAGE.parent)}:{line}: {text}"
        for path, tree in trees.items()
        if path != PACKAGE / "config.py"
        for line, text in _setting_reads(tree, constants)
    ]
    assert not offenders, "read through celery_idem.config.settings(app):\n" + "\n".join(offenders)


def test_the_default_prefix_is_written_once() -> None:
    literal = '"celery-idem:"'
    holders = sorted(
        str(path.relative_to(PACKAGE.parent)) for path in PACKAGE.rglob("*.py")
        if literal in path.read_text() or literal.replace('"', "'") in path.read_text()
    )
    assert holders == ["celery_idem/config.py"], "use celery_idem.config.DEFAULT_PREFIX"


# -- unknown app settings ------------------------------------------------------------------------


def test_a_misspelt_app_setting_is_refused_with_the_setting_meant() -> None:
    app = Celery("test_settings_typo", set_as_current=False)
    app.conf.idempotency_stroe = "redis://127.0.0.1:6379/7"
    with pytest.raises(ImproperlyConfigured) as info:
        settings(app)
    assert "'idempotency_stroe'" in str(info.value)
    assert "Did you mean 'idempotency_store'?" in str(info.value)


def test_a_task_option_set_as_an_app_setting_is_refused() -> None:
    app = Celery("test_settings_option", set_as_current=False)
    app.conf.update(idempotency_ttl=60)
    with pytest.raises(ImproperlyConfigured, match="idempotency_ttl is a task option"):
        settings(app)


def test_an_unknown_app_setting_without_a_near_name_lists_the_settings() -> None:
    app = Celery("test_settings_unknown", set_as_current=False)
    app.conf.update(idempotency_colour="blue")
    with pytest.raises(ImproperlyConfigured) as info:
        settings(app)
    assert "Did you mean" not in str(info.value)
    assert "idempotency_store_options" in str(info.value)


def test_a_misspelt_setting_under_a_namespace_is_named_as_written() -> None:
    class DjangoSettings:
        CELERY_BROKER_URL = "memory://"
        CELERY_IDEMPOTENCY_STORE = "memory://"
        CELERY_IDEMPOTENCY_KEY_PREFXI = "shop:"

    app = Celery("test_settings_namespace", set_as_current=False)
    app.config_from_object(DjangoSettings, namespace="CELERY")
    with pytest.raises(ImproperlyConfigured) as info:
        settings(app)
    assert "'CELERY_IDEMPOTENCY_KEY_PREFXI'" in str(info.value)
    assert "Did you mean 'CELERY_IDEMPOTENCY_KEY_PREFIX'?" in str(info.value)
    del DjangoSettings.CELERY_IDEMPOTENCY_KEY_PREFXI
    app = Celery("test_settings_namespace_ok", set_as_current=False)
    app.config_from_object(DjangoSettings, namespace="CELERY")
    assert settings(app).store == "memory://"


def test_the_first_enqueue_refuses_a_misspelt_setting() -> None:
    app = Celery("test_settings_enqueue", broker="memory://", set_as_current=False)
    app.conf.update(task_always_eager=True, idempotency_stroe="memory://")

    @app.task(base=IdempotentTask, shared=False)
    def charge(order_id: str) -> str:
        return order_id

    with pytest.raises(ImproperlyConfigured, match="Did you mean 'idempotency_store'"):
        charge.delay("ord_1")


def test_a_worker_with_a_misspelt_setting_does_not_start(caplog: pytest.LogCaptureFixture) -> None:
    app = Celery("test_settings_worker", set_as_current=False)
    app.conf.idempotency_stroe = "memory://"
    with pytest.raises(SystemExit, match=r"cannot start.*Did you mean 'idempotency_store'"):
        check_worker(SimpleNamespace(app=app))
    assert "idempotency_stroe" in caplog.text


@pytest.mark.parametrize(("value", "read"), [(None, None), (0, 0), (5, 5)])
def test_store_requeues_is_a_bound_or_none(value: int | None, read: int | None) -> None:
    app = Celery("test_settings_requeues", set_as_current=False)
    assert settings(app).store_requeues == 3
    forget_settings(app)
    app.conf.idempotency_store_requeues = value
    assert settings(app).store_requeues == read


@pytest.mark.parametrize("value", [-1, 2.5, "3", True])
def test_store_requeues_refuses_what_is_not_a_count(value: object) -> None:
    app = Celery("test_settings_requeues_bad", set_as_current=False)
    app.conf.idempotency_store_requeues = value
    with pytest.raises(config.ImproperlyConfigured, match="idempotency_store_requeues must be"):
        settings(app)
