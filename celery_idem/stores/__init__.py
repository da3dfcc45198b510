"""Stores by URL scheme, each imported only when its scheme is used (so neither ``redis`` nor
``sqlalchemy`` is needed by a project that uses the other). The stores of add-ons and other
packages come from the ``celery_idem.stores`` entry point group (:mod:`celery_idem.plugins`).
"""

from __future__ import annotations

from collections.abc import Mapping
from importlib.metadata import EntryPoint
from typing import Any
from urllib.parse import urlsplit

from ..config import DEFAULT_PREFIX
from ..exceptions import ImproperlyConfigured
from ..plugins import registered
from .base import Store

__all__ = ["STORES", "Store", "store_from_url", "supported_schemes"]

#: The entry point group of stores by URL scheme.
STORES = "celery_idem.stores"


# The core's own stores; every other scheme is registered in the entry point group.
_BUILTIN = {scheme: EntryPoint(scheme, value, STORES) for scheme, value in {
    **dict.fromkeys(("redis", "rediss", "unix"), "celery_idem.stores.redis:RedisStore [redis]"),
    **dict.fromkeys(("db+postgresql", "db+sqlite", "db+mysql", "db+mariadb"),
                    "celery_idem.stores.sql:SQLStore [sql]"),
    "memory": "celery_idem.stores.memory:MemoryStore",
}.items()}


def _backends() -> dict[str, EntryPoint]:
    return {**registered(STORES), **_BUILTIN}


def supported_schemes() -> tuple[str, ...]:
    """Every URL scheme a store is known for (``db+<dialect>+<driver>`` is accepted too)."""
    return tuple(f"{scheme}://" for scheme in _backends())


def store_from_url(url: str, prefix: str = DEFAULT_PREFIX, options: Mapping[str, Any] | None = None,
                   backend_transport_options: Mapping[str, Any] | None = None) -> Store:
    """Build the store for ``url``.

    Args:
        url: A result-backend style URL (``redis://``, ``rediss://``, ``unix://``,
            ``db+postgresql://``, ``db+sqlite://``, ``db+mysql://``, ``memory://``, or a scheme
            of the ``celery_idem.stores`` group: ``redis+cluster://``, ``sentinel://``,
            ``django://[alias]``; ``django-db`` reads as ``django://``).
        prefix: Key prefix (Redis) or key column prefix (SQL) that keeps apps apart.
        options: Extra keyword arguments for the store's client; ``accelerate`` goes only to
            the stores that have fast paths (:attr:`Store.accelerates`).
        backend_transport_options: The app's ``result_backend_transport_options``, for a store
            that reads them (:attr:`Store.reads_transport_options`).

    Raises:
        ImproperlyConfigured: The scheme has no store, or its client library is not installed.
    """
    backends = _backends()
    if not isinstance(url, str) or not url:
        raise ImproperlyConfigured(
            f"celery_idem needs a store URL (idempotency_store or result_backend), got {url!r}; "
            f"supported schemes: {', '.join(supported_schemes())}")
    scheme = "django" if url.strip().lower() == "django-db" else urlsplit(url).scheme.lower()
    if scheme.startswith("db+") and scheme.count("+") > 1:
        scheme = "+".join(scheme.split("+")[:2])  # db+postgresql+psycopg -> db+postgresql
    try:
        point = backends[scheme]
    except KeyError:
        shown = url.split("://", 1)[0] + "://" if "://" in url else url
        raise ImproperlyConfigured(
            f"celery_idem has no store for {shown!r}: the claim needs an atomic store and this "
            f"backend offers none. Supported schemes: {', '.join(supported_schemes())}. Set "
            f"result_backend to one of them, or set idempotency_store separately "
            f"(app.conf.idempotency_store = 'redis://...').") from None
    try:
        store_cls: type[Store] = point.load()
    except ImportError as exc:
        extra = point.extras[0] if point.extras else scheme
        raise ImproperlyConfigured(
            f"the {scheme}:// store needs a client library that is not installed ({exc.name}): "
            f"pip install 'celery-idem[{extra}]'") from exc
    kwargs = dict(options or {})
    if not store_cls.accelerates:  # the app's idempotency_accelerate: only for those that have some
        kwargs.pop("accelerate", None)
    if store_cls.reads_transport_options and backend_transport_options:
        kwargs["backend_transport_options"] = backend_transport_options
    # The scheme in lower case: some clients (redis-py 6 and older) refuse ``REDIS://``.
    head, sep, rest = url.partition("://")
    return store_cls.from_url(head.lower() + sep + rest if sep else url, prefix=prefix, **kwargs)
