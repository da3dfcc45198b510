"""How ``redis+cluster://`` and ``sentinel://`` URLs and settings become stores (no server needed:
a sentinel client connects on first use, and the cluster errors here are raised before)."""

from __future__ import annotations

import pytest
from celery import Celery

import celery_idem.app as idem_app
from celery_idem.contrib.redis_ha import RedisSentinelStore
from celery_idem.exceptions import ImproperlyConfigured
from celery_idem.stores import store_from_url, supported_schemes

CELERY_URL = "sentinel://:s3cret@10.0.0.1:26379/3;sentinel://10.0.0.2:26380/3"


def sentinel(url: str = CELERY_URL, **kwargs: object) -> RedisSentinelStore:
    store = store_from_url(url, **kwargs)  # type: ignore[arg-type]
    assert isinstance(store, RedisSentinelStore)
    return store


def test_the_new_schemes_are_listed_as_supported() -> None:
    for scheme in ("redis+cluster://", "rediss+cluster://", "sentinel://"):
        assert scheme in supported_schemes()


def test_celerys_sentinel_url_gives_every_sentinel_and_the_first_parts_db_and_password() -> None:
    store = sentinel(options={"master_name": "orders"})
    assert [c.connection_pool.connection_kwargs["port"] for c in store.sentinel.sentinels] == [
        26379, 26380]
    kwargs = store.client.connection_pool.connection_kwargs
    assert kwargs["db"] == 3 and kwargs["password"] == "s3cret"
    assert store.master_name == "orders"
    assert store.location == "sentinel master 'orders' (db 3) via 10.0.0.1:26379,10.0.0.2:26380"


def test_a_comma_list_of_sentinels_works_too() -> None:
    store = sentinel("sentinel://h1:26379,h2:26379,h3:26379/0?master_name=m")
    assert len(store.sentinel.sentinels) == 3


def test_the_master_name_comes_from_options_then_the_url_then_the_backend_options() -> None:
    url = CELERY_URL + "?master_name=from-url"
    backend = {"master_name": "from-backend"}
    assert sentinel(url, options={"master_name": "from-options"},
                    backend_transport_options=backend).master_name == "from-options"
    assert sentinel(url, backend_transport_options=backend).master_name == "from-url"
    assert sentinel(backend_transport_options=backend).master_name == "from-backend"


def test_sentinel_kwargs_go_to_the_sentinel_connections() -> None:
    store = sentinel(backend_transport_options={"master_name": "m",
                                                "sentinel_kwargs": {"password": "sentinel-pw"}})
    assert store.sentinel.sentinels[0].connection_pool.connection_kwargs["password"] == "sentinel-pw"


def test_a_sentinel_url_without_a_master_name_is_a_clear_error() -> None:
    with pytest.raises(ImproperlyConfigured, match="master_name"):
        sentinel()


def test_every_part_of_a_sentinel_url_is_sentinel() -> None:
    with pytest.raises(ImproperlyConfigured, match="sentinel://"):
        sentinel("sentinel://h1:26379;redis://h2:6379?master_name=m")


def test_the_app_store_takes_the_master_name_from_result_backend_transport_options() -> None:
    app = Celery("t", broker="memory://", backend=CELERY_URL, set_as_current=False)
    app.conf.result_backend_transport_options = {"master_name": "celery-master"}
    try:
        store = idem_app.get_store(app)
        assert isinstance(store, RedisSentinelStore)
        assert store.master_name == "celery-master"
    finally:
        idem_app.forget_store(app)


@pytest.mark.parametrize("url, problem", [
    ("redis+cluster://127.0.0.1:7000/2", "only database 0"),
    ("redis+cluster://127.0.0.1", "host:port"),
    ("redis+cluster://a:1,b", "host:port"),
])
def test_malformed_cluster_urls_are_clear_errors(url: str, problem: str) -> None:
    with pytest.raises(ImproperlyConfigured, match=problem):
        store_from_url(url)


@pytest.mark.parametrize("options, problem", [
    ({"wait_replicas": -1}, "wait_replicas"),
    ({"wait_replicas": "1"}, "wait_replicas"),
    ({"wait_replicas": 1, "wait_timeout": 0}, "wait_timeout"),
])
def test_bad_wait_settings_are_clear_errors(options: dict[str, object], problem: str) -> None:
    with pytest.raises(ImproperlyConfigured, match=problem):
        sentinel(options={"master_name": "m", **options})
