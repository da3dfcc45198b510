"""Stores by URL scheme (celery_idem/stores/__init__.py): ``store_from_url`` and its registry.

Each built-in scheme reaches its store, ``db+<dialect>+<driver>`` reaches the dialect's, and a
scheme of the ``celery_idem.stores`` entry point group reaches the registered class; what the
caller gets for a URL no store takes, or a store whose client library is missing, is an
:class:`ImproperlyConfigured` that says what to do. Building a store connects to nothing: no
server is needed here. How a third-party package registers a store is tests/unit/test_plugins.py's.
"""

from __future__ import annotations

from collections.abc import Iterator
from importlib.metadata import EntryPoint
from typing import Any, ClassVar

import pytest

import celery_idem.stores as stores_module
from celery_idem.exceptions import ImproperlyConfigured
from celery_idem.stores import STORES, store_from_url, supported_schemes
from celery_idem.stores.base import Store
from celery_idem.stores.memory import MemoryStore
from celery_idem.stores.redis import RedisStore
from celery_idem.stores.sql import SQLStore


class Recording(MemoryStore):
    """A registered store that keeps what ``store_from_url`` passed it."""

    built: ClassVar[list[tuple[str, str, dict[str, Any]]]] = []

    @classmethod
    def from_url(cls, url: str, *, prefix: str = "", **options: Any) -> Recording:
        cls.built.append((url, prefix, options))
        return cls(prefix=prefix)


class RecordingReader(Recording):
    """As :class:`Recording`, for a store that reads the backend's transport options."""

    reads_transport_options = True


@pytest.fixture
def registry(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, EntryPoint]]:
    """The entry point group as the test fills it (no installed distribution is read)."""
    points: dict[str, EntryPoint] = {}
    monkeypatch.setattr(stores_module, "registered",
                        lambda group: dict(points) if group == STORES else {})
    Recording.built.clear()
    yield points
    Recording.built.clear()


def _register(points: dict[str, EntryPoint], scheme: str, value: str) -> None:
    points[scheme] = EntryPoint(scheme, value, STORES)


@pytest.fixture
def built() -> Iterator[list[Store]]:
    made: list[Store] = []
    yield made
    for store in made:
        store.close()


@pytest.mark.parametrize(("url", "cls"), [
    ("redis://127.0.0.1:1/0", RedisStore),
    ("rediss://127.0.0.1:1/0", RedisStore),
    ("unix:///tmp/no-such.sock?db=0", RedisStore),
    ("REDIS://127.0.0.1:1/0", RedisStore),  # schemes are case-blind
    ("db+postgresql://root@127.0.0.1:1/x", SQLStore),
    ("db+postgresql+psycopg://root@127.0.0.1:1/x", SQLStore),  # the driver does not pick
    ("db+mysql+pymysql://root@127.0.0.1:1/x", SQLStore),
    ("db+mariadb://root@127.0.0.1:1/x", SQLStore),
    ("db+sqlite:///:memory:", SQLStore),
    ("memory://", MemoryStore),
])
def test_each_built_in_scheme_reaches_its_store(url: str, cls: type[Store],
                                                built: list[Store]) -> None:
    store = store_from_url(url, prefix="app1:")
    built.append(store)
    assert type(store) is cls
    assert store.prefix == "app1:"


def test_a_registered_scheme_reaches_its_class_and_django_db_reads_as_django(
    registry: dict[str, EntryPoint]
) -> None:
    _register(registry, "acme", f"{__name__}:Recording")
    _register(registry, "django", f"{__name__}:Recording")
    assert "acme://" in supported_schemes() and "django://" in supported_schemes()
    assert isinstance(store_from_url("acme://h/1", prefix="p:"), Recording)
    assert isinstance(store_from_url(" Django-DB ", prefix="p:"), Recording)
    assert [(url, prefix) for url, prefix, _ in Recording.built] == [
        ("acme://h/1", "p:"), (" Django-DB ", "p:")]


def test_a_registered_scheme_does_not_replace_a_built_in_one(
    registry: dict[str, EntryPoint], built: list[Store]
) -> None:
    _register(registry, "redis", f"{__name__}:Recording")
    store = store_from_url("redis://127.0.0.1:1/0")
    built.append(store)
    assert type(store) is RedisStore and Recording.built == []


@pytest.mark.parametrize("url", ["amqp://guest:secret@127.0.0.1//", "cache+memory://",
                                 "rpc://", "nothing-at-all"])
def test_a_url_no_store_takes_is_refused_without_its_credentials(url: str) -> None:
    with pytest.raises(ImproperlyConfigured) as raised:
        store_from_url(url)
    text = str(raised.value)
    assert "has no store for" in text and "redis://" in text and "memory://" in text
    assert "secret" not in text  # the URL's scheme is shown, never its password


@pytest.mark.parametrize("url", ["", None, 42])
def test_no_url_is_refused(url: Any) -> None:
    with pytest.raises(ImproperlyConfigured, match="needs a store URL"):
        store_from_url(url)


def test_a_store_whose_client_library_is_missing_says_what_to_install(
    registry: dict[str, EntryPoint]
) -> None:
    _register(registry, "acme", "celery_idem_no_such_client:AcmeStore [acme]")
    with pytest.raises(ImproperlyConfigured) as raised:
        store_from_url("acme://h")
    text = str(raised.value)
    assert "celery_idem_no_such_client" in text and "pip install 'celery-idem[acme]'" in text


def test_accelerate_reaches_only_the_stores_that_have_fast_paths(
    registry: dict[str, EntryPoint], built: list[Store]
) -> None:
    _register(registry, "acme", f"{__name__}:Recording")
    store_from_url("acme://", options={"accelerate": False, "flavour": "x"})
    assert Recording.built[-1][2] == {"flavour": "x"}  # Store.accelerates is False
    plain = store_from_url("redis://127.0.0.1:1/0", options={"accelerate": False})
    fast = store_from_url("redis://127.0.0.1:1/0", options={"accelerate": True})
    built += [plain, fast]
    assert isinstance(plain, RedisStore) and isinstance(fast, RedisStore)
    assert (plain.accelerated, fast.accelerated) == (False, True)


def test_the_backends_transport_options_reach_only_a_store_that_reads_them(
    registry: dict[str, EntryPoint]
) -> None:
    _register(registry, "reads", f"{__name__}:RecordingReader")
    _register(registry, "ignores", f"{__name__}:Recording")
    options = {"global_keyprefix": "app1:"}
    store_from_url("reads://", backend_transport_options=options)
    store_from_url("ignores://", backend_transport_options=options)
    assert [kwargs for _, _, kwargs in Recording.built] == [
        {"backend_transport_options": options}, {}]
