"""Stores by URL scheme. Backends are imported only when their scheme is used.

``celery_idem`` itself imports neither ``redis`` nor ``sqlalchemy``: a project that uses the SQL
store does not need the Redis client, and the other way round.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit

from ..config import DEFAULT_PREFIX
from ..exceptions import ImproperlyConfigured
from .base import Store

__all__ = ["SUPPORTED_SCHEMES", "Store", "store_from_url"]

# scheme -> (module, class, pip extra that provides its client library)
_BACKENDS: dict[str, tuple[str, str, str | None]] = {
    "redis": ("celery_idem.stores.redis", "RedisStore", "redis"),
    "rediss": ("celery_idem.stores.redis", "RedisStore", "redis"),
    "unix": ("celery_idem.stores.redis", "RedisStore", "redis"),
    "redis+cluster": ("celery_idem.contrib.redis_ha", "RedisClusterStore", "redis"),
    "rediss+cluster": ("celery_idem.contrib.redis_ha", "RedisClusterStore", "redis"),
    "sentinel": ("celery_idem.contrib.redis_ha", "RedisSentinelStore", "redis"),
    "db+postgresql": ("celery_idem.stores.sql", "SQLStore", "sql"),
    "db+sqlite": ("celery_idem.stores.sql", "SQLStore", "sql"),
    "db+mysql": ("celery_idem.stores.sql", "SQLStore", "sql"),
    "db+mariadb": ("celery_idem.stores.sql", "SQLStore", "sql"),
    "memory": ("celery_idem.stores.memory", "MemoryStore", None),
    # Django's own connection for a DATABASES alias; "django-db" (django-celery-results'
    # result_backend) is read as "django://" (the default alias).
    "django": ("celery_idem.contrib.django.store", "DjangoStore", "django"),
}

#: Every URL scheme a store exists for (``db+<dialect>+<driver>`` is accepted too).
SUPPORTED_SCHEMES = tuple(f"{scheme}://" for scheme in _BACKENDS)


def store_from_url(
    url: str,
    prefix: str = DEFAULT_PREFIX,
    options: Mapping[str, Any] | None = None,
    backend_transport_options: Mapping[str, Any] | None = None,
) -> Store:
    """Build the store for ``url``.

    Args:
        url: A result-backend style URL (``redis://``, ``rediss://``, ``unix://``,
            ``redis+cluster://``, ``rediss+cluster://``, ``sentinel://``,
            ``db+postgresql://``, ``db+sqlite://``, ``db+mysql://``, ``memory://``,
            ``django://[alias]`` or ``django-db``).
        prefix: Key prefix (Redis) or key column prefix (SQL) that keeps apps apart.
        options: Extra keyword arguments for the store's client (socket timeouts, pool size);
            ``accelerate`` (see :func:`celery_idem.config.accelerate_switch`) goes to the stores that
            have accelerations (Redis, SQL) and is dropped for the others.
        backend_transport_options: The app's ``result_backend_transport_options``; a
            ``sentinel://`` store takes ``master_name``, ``sentinel_kwargs`` and
            ``min_other_sentinels`` from it when neither ``options`` nor the URL give them.

    Raises:
        ImproperlyConfigured: The scheme has no store, or its client library is not installed.
    """
    if not isinstance(url, str) or not url:
        raise ImproperlyConfigured(
            f"celery_idem needs a store URL (idempotency_store or result_backend), got {url!r}; "
            f"supported schemes: {', '.join(SUPPORTED_SCHEMES)}"
        )
    scheme = "django" if url.strip().lower() == "django-db" else urlsplit(url).scheme.lower()
    if scheme.startswith("db+") and scheme.count("+") > 1:
        scheme = "+".join(scheme.split("+")[:2])  # db+postgresql+psycopg -> db+postgresql
    try:
        module_name, class_name, extra = _BACKENDS[scheme]
    except KeyError:
        shown = url.split("://", 1)[0] + "://" if "://" in url else url
        raise ImproperlyConfigured(
            f"celery_idem has no store for {shown!r}: the claim needs an atomic store and this "
            f"backend offers none. Supported schemes: {', '.join(SUPPORTED_SCHEMES)}. Set "
            f"result_backend to one of them, or set idempotency_store separately "
            f"(app.conf.idempotency_store = 'redis://...')."
        ) from None
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ImproperlyConfigured(
            f"the {scheme}:// store needs a client library that is not installed ({exc.name}): "
            f"pip install 'celery-idem[{extra}]'"
        ) from exc
    store_cls: type[Store] = getattr(module, class_name)
    kwargs = dict(options or {})
    if not store_cls.accelerates:  # the app's idempotency_accelerate: only for those that have some
        kwargs.pop("accelerate", None)
    if scheme == "sentinel" and backend_transport_options:
        kwargs["backend_transport_options"] = backend_transport_options
    return store_cls.from_url(url, prefix=prefix, **kwargs)
