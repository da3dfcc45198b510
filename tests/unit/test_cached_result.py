"""CachedResult and the result codec, in process (eager mode, ``memory://`` store).

The real-worker counterparts are in tests/integration/test_result_ids.py.
"""

from __future__ import annotations

import copy
import pickle
from typing import Any

import pytest
from celery import Celery
from celery.result import AsyncResult, GroupResult, ResultSet

from celery_idem import CachedResult, IdempotentTask, TerminalError
from celery_idem.codec import KombuCodec


@pytest.fixture
def app() -> Celery:
    app = Celery("test_cached_result", set_as_current=False)
    app.conf.task_always_eager = True
    app.conf.idempotency_store = "memory://"
    return app


def make_tasks(app: Celery) -> tuple[Any, Any, list[str]]:
    runs: list[str] = []

    @app.task(base=IdempotentTask, bind=True, shared=False)
    def echo(self: Any, value: str) -> str:
        runs.append(value)
        return value

    @app.task(base=IdempotentTask, bind=True, shared=False)
    def declined(self: Any, value: str) -> str:
        runs.append(value)
        raise TerminalError(f"declined {value}")

    return echo, declined, runs


def test_a_chosen_task_id_is_the_cached_results_id(app: Celery) -> None:
    echo, _, runs = make_tasks(app)
    first = echo.delay("a")

    chosen = echo.apply_async(("a",), task_id="my-id")
    sig = echo.s("a")
    frozen = sig.freeze()
    by_freeze = sig.apply_async()

    assert isinstance(chosen, CachedResult) and chosen.id == "my-id"
    assert chosen.original_task_id == first.id and chosen.get() == "a"
    assert isinstance(by_freeze, CachedResult) and by_freeze.id == frozen.id
    # Without a chosen id: the original task id, as before
    assert echo.delay("a").id == first.id
    assert runs == ["a"]


def test_result_sets_and_group_results_holding_cached_results_join(app: Celery) -> None:
    echo, declined, _ = make_tasks(app)
    echo.delay("a")
    with pytest.raises(TerminalError):
        declined.delay("d").get()
    cached, failed = echo.delay("a"), declined.delay("d")
    assert isinstance(cached, CachedResult) and isinstance(failed, CachedResult)
    assert cached.backend is app.backend and cached.app is app

    assert ResultSet([cached, cached]).get() == ["a", "a"]
    assert ResultSet([cached]).join() == ["a"]
    assert GroupResult("g", [cached]).get() == ["a"]
    assert [v for _, v in cached.collect()] == ["a"]
    with pytest.raises(TerminalError, match="declined d"):
        ResultSet([cached, failed]).get()
    values = ResultSet([cached, failed]).join(propagate=False)
    assert values[0] == "a" and isinstance(values[1], TerminalError)


def test_a_cached_result_survives_copy_and_pickle(app: Celery) -> None:
    echo, _, _ = make_tasks(app)
    echo.delay("a")
    cached = echo.apply_async(("a",), task_id="my-id")
    for clone in (copy.copy(cached), pickle.loads(pickle.dumps(cached))):
        assert isinstance(clone, CachedResult)
        assert (clone.id, clone.get(), clone.state) == ("my-id", "a", "SUCCESS")
        assert clone.original_task_id == cached.original_task_id
        assert clone.idempotency_key == cached.idempotency_key


def test_the_codec_prepares_results_as_the_backend_does(app: Celery) -> None:
    backend = app.backend
    codec = KombuCodec("json", ["json"], prepare=backend.prepare_value)
    child = AsyncResult("child-id", app=app)
    ctype, data = codec.encode_result(child)
    assert codec.decode_result("k", ctype, data) == [["child-id", None], None]
    group = GroupResult("g", [child], app=app)
    ctype, data = codec.encode_result(group)
    assert codec.decode_result("k", ctype, data) == [["g", None], [[["child-id", None], None]]]
    # Without prepare (the codec on its own), JSON cannot encode it
    with pytest.raises(Exception, match="not JSON serializable"):
        KombuCodec("json").encode_result(child)


def test_a_body_returning_an_async_result_is_recorded_and_answered_as_celery_stores_it(
    app: Celery,
) -> None:
    @app.task(base=IdempotentTask, bind=True, shared=False)
    def spawn(self: Any, name: str) -> AsyncResult:
        return AsyncResult(f"{name}-child", app=app)

    spawn.delay("s")
    # A duplicate gets what Celery's JSON backend would hand back: the as_tuple() form
    assert spawn.delay("s").get() == [["s-child", None], None]
