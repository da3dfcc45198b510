"""Task options, checked when the task class is created and resolved once per task.

Precedence, call > task (``@app.task`` keyword, then base-class attribute) > default, and the
app settings apart: docs/configuration.md, "Precedence".
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
import math
import os
import weakref
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from .exceptions import IdempotencyKeyMismatch, ImproperlyConfigured, TerminalError

__all__ = ["DEFAULT_PREFIX", "KNOWN_OPTIONS", "MIN_LEASE", "MIN_PERIOD", "IdempotencyConfig",
           "Settings", "check_app_settings", "check_options", "default_release_on",
           "forget_settings", "near_miss", "settings"]

#: Attributes with the prefix that are not options (set by the library at run time).
_RUNTIME_ATTRIBUTES = frozenset({"idempotency_key", "idempotency_token", "idempotency_config"})

_OPTIONAL_RELEASE_ON = (
    ("redis.exceptions", ("ConnectionError", "TimeoutError")),
    ("kombu.exceptions", ("OperationalError",)),
    ("requests.exceptions", ("ConnectionError", "Timeout")),
    ("httpx", ("TimeoutException", "NetworkError")))


@functools.cache
def default_release_on() -> tuple[type[BaseException], ...]:
    """The timeout-class errors that release a claim by default: ``TimeoutError``,
    ``ConnectionError``, billiard's ``SoftTimeLimitExceeded``, and the timeout/connection errors
    of redis, kombu, requests and httpx where installed ("the effect may not have happened")."""
    from billiard.exceptions import SoftTimeLimitExceeded

    found: list[type[BaseException]] = [TimeoutError, ConnectionError, SoftTimeLimitExceeded]
    for module_name, names in _OPTIONAL_RELEASE_ON:
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        found.extend(getattr(module, name) for name in names if hasattr(module, name))
    return tuple(dict.fromkeys(found))


#: The shortest lease and the shortest ``idempotency_period`` (:func:`resolve`'s messages say why).
MIN_LEASE = 0.5
MIN_PERIOD = 1.0

DEFAULT_TERMINAL_ON: tuple[type[BaseException], ...] = (TerminalError, IdempotencyKeyMismatch)


@dataclass(frozen=True)
class IdempotencyConfig:
    """The resolved options of one task (see ``IdempotentTask`` for their meaning)."""

    operation: str
    fields: tuple[str, ...] | None
    key_func: Callable[..., str] | None
    ttl: float
    lease: float
    release_on: tuple[type[BaseException], ...]
    terminal_on: tuple[type[BaseException], ...]
    validate: bool
    wait: float
    record_timeout: float
    check_on_enqueue: bool = True
    fingerprint: bool = True
    period: float | None = None
    intent: bool = False


#: Every ``idempotency_*`` task option: one per :class:`IdempotencyConfig` field.
KNOWN_OPTIONS = frozenset(f"idempotency_{f.name}" for f in dataclasses.fields(IdempotencyConfig))


def _exception_tuple(name: str, value: Any) -> tuple[type[BaseException], ...]:
    items = (value,) if isinstance(value, type) else tuple(value or ())
    for item in items:
        if not (isinstance(item, type) and issubclass(item, BaseException)):
            raise ImproperlyConfigured(f"{name} must be exception classes, got {item!r}")
    return items


def _positive(name: str, value: Any, *, zero_ok: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ImproperlyConfigured(f"{name} must be a number of seconds, got {value!r}")
    if value < 0 or (value == 0 and not zero_ok):
        raise ImproperlyConfigured(f"{name} must be {'>= 0' if zero_ok else '> 0'}, got {value!r}")
    return float(value)


#: The prefix every option shares, and the fewest letters of it a near miss may abbreviate it to.
_PREFIX = "idempotency"
_MIN_ABBREVIATION = 4


def _distance(a: str, b: str) -> int:
    """Edit distance (optimal string alignment: a swap of adjacent letters, ``feilds``, is one)."""
    previous2: list[int] = []
    previous = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        current = [i] + [0] * len(b)
        for j, cb in enumerate(b, 1):
            current[j] = min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (ca != cb))
            if i > 1 and j > 1 and ca == b[j - 2] and a[i - 2] == cb:
                current[j] = min(current[j], previous2[j - 2] + 1)
        previous2, previous = previous, current
    return previous[-1]


def _close_suffix(tail: str, options: Iterable[str] = KNOWN_OPTIONS) -> str | None:
    """The option whose suffix (after ``idempotency_``) ``tail`` is, give or take one typo up to
    four letters (two edits from ``ttl`` reach many ordinary words), two else."""
    best: tuple[int, str] | None = None
    for option in sorted(options):
        suffix = option.removeprefix(f"{_PREFIX}_")
        d = _distance(tail, suffix)
        if d <= (1 if len(suffix) <= 4 else 2) and (best is None or d < best[0]):
            best = (d, option)
    return best[1] if best else None


def near_miss(name: str) -> str | None:
    """The option ``name`` was probably meant to be, or None: within two edits of an option
    (``idempotencyfields``), or its prefix misspelt or abbreviated (``idem_feilds``)."""
    if name.startswith("_") or name.startswith(f"{_PREFIX}_"):
        return None  # private, or handled as an unknown option by check_options
    for option in sorted(KNOWN_OPTIONS):
        if _distance(name, option) <= 2:
            return option
    head, _, tail = name.partition("_")
    abbreviation = len(head) >= _MIN_ABBREVIATION and _PREFIX.startswith(head)
    if not tail or not (abbreviation or _distance(head, _PREFIX) <= 2):
        return None
    return _close_suffix(tail)


def check_options(owner: str, namespace: Iterable[str]) -> None:
    """Reject unknown ``idempotency_*`` names and near misses of options in ``namespace``
    (``vars(cls)``), naming the option meant: Celery keeps any ``@app.task`` keyword silently."""
    for name in namespace:
        if name.startswith("idempotency_") and name not in KNOWN_OPTIONS | _RUNTIME_ATTRIBUTES:
            if name in _APP_SETTINGS:
                raise ImproperlyConfigured(
                    f"{owner}: {name!r} is an app setting, not a task option: set "
                    f"app.conf.{name} instead")
            # Compare what follows the shared prefix, or every name would look close.
            close = _close_suffix(name.removeprefix(f"{_PREFIX}_"))
            hint = f" Did you mean {close!r}?" if close else ""
            raise ImproperlyConfigured(
                f"{owner}: unknown option {name!r}.{hint} Known options: "
                f"{', '.join(sorted(KNOWN_OPTIONS))}")
        meant = near_miss(name)
        if meant is not None:
            raise ImproperlyConfigured(
                f"{owner}: {name!r} is not a celery_idem option. Did you mean {meant!r}? "
                f"Celery would keep {name!r} as a plain attribute and celery_idem would use "
                f"{meant}'s default instead; rename it to {meant!r} (or, if it is an attribute "
                f"of your own, give it a name further from the option's)")


def resolve(owner: str, attrs: Any, signature: inspect.Signature | None) -> IdempotencyConfig:
    """Check the options of ``attrs`` (a task class or instance; ``idempotency_fields`` against
    ``signature``) and freeze them, or raise ``ImproperlyConfigured`` naming the option."""
    fields = attrs.idempotency_fields
    if fields is not None:
        if isinstance(fields, str):
            raise ImproperlyConfigured(
                f"{owner}: idempotency_fields must be a sequence of argument names, got the "
                f"string {fields!r}; write ({fields!r},)")
        fields = tuple(fields)
        if not fields or not all(isinstance(f, str) for f in fields):
            raise ImproperlyConfigured(
                f"{owner}: idempotency_fields must be a non-empty sequence of argument names, "
                f"got {attrs.idempotency_fields!r}")
        if signature is not None:
            params = signature.parameters
            missing = [f for f in fields if f not in params]
            if missing:
                raise ImproperlyConfigured(
                    f"{owner}: idempotency_fields names {missing} that are not arguments of the "
                    f"task (its arguments: {', '.join(params)})")
    # Read without binding: a plain function on the task class would become a method.
    key_func = inspect.getattr_static(attrs, "idempotency_key_func", None)
    if isinstance(key_func, (staticmethod, classmethod)):
        key_func = key_func.__func__
    if key_func is not None and not callable(key_func):
        raise ImproperlyConfigured(f"{owner}: idempotency_key_func must be callable")
    if key_func is not None and fields is not None:
        raise ImproperlyConfigured(f"{owner}: set idempotency_fields or idempotency_key_func, not both")
    operation = attrs.idempotency_operation or owner
    if not isinstance(operation, str) or not operation or not operation.isprintable():
        raise ImproperlyConfigured(
            f"{owner}: idempotency_operation must be a non-empty str of printable characters, "
            f"got {operation!r}")
    if "@" in operation:  # it separates the scope in a key
        raise ImproperlyConfigured(
            f"{owner}: the operation {operation!r} contains '@', which separates the operation "
            f"from the scope in a key; set idempotency_operation to a name without '@'")
    ttl = _positive("idempotency_ttl", attrs.idempotency_ttl)
    lease = _positive("idempotency_lease", attrs.idempotency_lease)
    if lease < MIN_LEASE:
        raise ImproperlyConfigured(
            f"{owner}: idempotency_lease ({lease:g} s) cannot be renewed before it ends: it is "
            f"renewed every third of it, and a store round trip or a pause longer than the "
            f"{lease * 2 / 3:.2g} s left lets a duplicate take over a live holder. Use at least "
            f"{MIN_LEASE:g} s")
    if ttl < lease:
        raise ImproperlyConfigured(
            f"{owner}: idempotency_ttl ({ttl:g} s) must be at least idempotency_lease "
            f"({lease:g} s), or a record could vanish while its claim is live")
    period = _period(owner, attrs.idempotency_period, ttl)
    release_on = attrs.idempotency_release_on
    return IdempotencyConfig(
        operation=operation, fields=fields, key_func=key_func, ttl=ttl, lease=lease,
        release_on=default_release_on() if release_on is None
            else _exception_tuple("idempotency_release_on", release_on),
        terminal_on=_exception_tuple("idempotency_terminal_on", attrs.idempotency_terminal_on),
        validate=bool(attrs.idempotency_validate),
        wait=_positive("idempotency_wait", attrs.idempotency_wait, zero_ok=True),
        record_timeout=_positive("idempotency_record_timeout", attrs.idempotency_record_timeout),
        check_on_enqueue=_flag(owner, "idempotency_check_on_enqueue", attrs.idempotency_check_on_enqueue),
        fingerprint=_flag(owner, "idempotency_fingerprint", attrs.idempotency_fingerprint),
        period=period,
        intent=_flag(owner, "idempotency_intent", attrs.idempotency_intent))


def _period(owner: str, value: Any, ttl: float) -> float | None:
    """``idempotency_period``, checked: None, or finite seconds in [MIN_PERIOD, ttl]."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ImproperlyConfigured(
            f"{owner}: idempotency_period must be a number of seconds (at least {MIN_PERIOD:g}) "
            f"or None, got {value!r}")
    if value < MIN_PERIOD:
        raise ImproperlyConfigured(
            f"{owner}: idempotency_period must be at least {MIN_PERIOD:g} s, got {value!r}: two "
            f"senders of one tick (two beat processes) are often a second apart, and only sends "
            f"within half a period of the same slot share a key")
    if ttl < value:
        raise ImproperlyConfigured(
            f"{owner}: idempotency_ttl ({ttl:g} s) must be at least idempotency_period "
            f"({value:g} s), or a slot's record could vanish before the slot's last send is run")
    return float(value)


def _flag(owner: str, name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ImproperlyConfigured(f"{owner}: {name} must be True or False, got {value!r}")
    return value


# -- app settings --------------------------------------------------------------------------------

#: The key prefix when ``idempotency_key_prefix`` is not set: the one place this literal lives.
DEFAULT_PREFIX = "celery-idem:"


@dataclass(frozen=True)
class Settings:
    """The ``idempotency_*`` app settings of one app, read once (:func:`settings`), each field
    the setting ``idempotency_<field>`` (docs/configuration.md, "App settings")."""

    store: Any = None
    key_prefix: str = DEFAULT_PREFIX
    store_options: Mapping[str, Any] | None = None
    events: bool = False
    receipts_table: str | None = None
    fold_results: bool = True
    require_durable_store: bool = False
    log_answers: bool = True
    accelerate: bool = True
    store_requeues: int | None = 3
    relay: bool = True
    relay_after: float = 60.0
    relay_interval: float = 1.0
    intent_max_bytes: int = 256 * 1024


_settings: weakref.WeakKeyDictionary[Any, Settings] = weakref.WeakKeyDictionary()

#: App settings (``app.conf``), which are not task options: one per :class:`Settings` field.
_APP_SETTINGS = frozenset(f"idempotency_{f.name}" for f in dataclasses.fields(Settings))

#: The environment variable that turns every acceleration off (``0``/``false``/``no``/``off``).
ACCELERATE_ENV = "CELERY_IDEM_ACCELERATE"


def accelerate_switch(setting: bool = True) -> bool:
    """The acceleration switch: off when :data:`ACCELERATE_ENV` says so (it wins over the app's
    ``idempotency_accelerate``), else ``setting``; read once per app by :func:`settings`."""
    return os.environ.get(ACCELERATE_ENV, "").strip().lower() not in {"0", "false", "no", "off"} \
        and setting


def settings(app: Any) -> Settings:
    """The ``idempotency_*`` settings of ``app``, all read here at the first call and nowhere
    else (a later change of ``app.conf`` is not seen: :func:`forget_settings`)."""
    found = _settings.get(app)
    if found is None:
        conf = app.conf
        check_app_settings(conf)
        options = conf.get("idempotency_store_options")
        found = _settings[app] = Settings(
            store=conf.get("idempotency_store"),
            key_prefix=conf.get("idempotency_key_prefix") or DEFAULT_PREFIX,
            store_options=MappingProxyType(dict(options)) if options else None,
            events=bool(conf.get("idempotency_events")),
            receipts_table=conf.get("idempotency_receipts_table") or None,
            fold_results=conf.get("idempotency_fold_results") is not False,
            require_durable_store=bool(conf.get("idempotency_require_durable_store")),
            log_answers=conf.get("idempotency_log_answers", True) is not False,
            accelerate=accelerate_switch(conf.get("idempotency_accelerate", True) is not False),
            store_requeues=_store_requeues(conf.get("idempotency_store_requeues", 3)),
            relay=conf.get("idempotency_relay", True) is not False,
            relay_after=_positive("idempotency_relay_after", conf.get("idempotency_relay_after", 60.0)),
            relay_interval=_positive("idempotency_relay_interval",
                                     conf.get("idempotency_relay_interval", 1.0)),
            intent_max_bytes=int(_positive("idempotency_intent_max_bytes",
                                           conf.get("idempotency_intent_max_bytes", 256 * 1024))))
    return found


def check_app_settings(conf: Any) -> None:
    """Raise ``ImproperlyConfigured``, naming the setting meant, for an unknown ``idempotency_*``
    setting of ``conf`` (an ``app.conf``, any ``namespace=``): Celery keeps any setting silently,
    and a misspelt ``idempotency_store`` would leave the records elsewhere."""
    written_names = list(conf.keys())  # first: it loads the configuration, and its namespace
    prefix = conf.prefix or ""
    for written in written_names:
        name = written[len(prefix):].lower() if prefix and written.startswith(prefix) else written
        if not name.startswith(f"{_PREFIX}_") or name in _APP_SETTINGS:
            continue
        if name in KNOWN_OPTIONS:
            raise ImproperlyConfigured(
                f"app setting {written!r}: {name} is a task option, not an app setting; set "
                f"it on the task (@app.task(..., {name}=...)) or on an IdempotentTask subclass")
        meant = _close_suffix(name.removeprefix(f"{_PREFIX}_"), _APP_SETTINGS)
        spelt = f"{prefix}{meant.upper()}" if meant and prefix and written.isupper() else meant
        hint = f" Did you mean {spelt!r}?" if meant else ""
        raise ImproperlyConfigured(
            f"unknown app setting {written!r}.{hint} celery_idem would ignore it and use the "
            f"default. App settings: {', '.join(sorted(_APP_SETTINGS))}")


def _store_requeues(value: Any) -> int | None:
    if value is None or (type(value) is int and value >= 0):
        return value
    raise ImproperlyConfigured(f"idempotency_store_requeues must be an int >= 0 or None, got {value!r}")


def forget_settings(app: Any) -> None:
    """Drop the settings read for ``app``: the next read sees ``app.conf`` (for tests)."""
    _settings.pop(app, None)
