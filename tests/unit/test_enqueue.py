"""celery_idem.enqueue: CachedResult and the answer from the record, in process (eager mode,
``memory://`` store), with the result codec CachedResult carries.

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
from celery_idem.enqueue import answer_from_record
from celery_idem.exceptions import IdempotencyKeyMismatch
from celery_idem.records import Record, State


@pytest.fixture
def app() -> Celery:
    app = Celery("test_enqueue", set_as_current=False)
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


def _done(task: Any, key: str, value: Any, payload_hash: str | None = None) -> Record:
    content_type, data = task.idempotency_gate.codec.encode_result(value)
    return Record(key=key, state=State.DONE, token=3, task_id="orig-id",
                  payload_hash=payload_hash, content_type=content_type, data=data)


def test_answer_from_record_answers_a_done_record_with_its_value(app: Celery) -> None:
    echo, _, runs = make_tasks(app)
    rec = _done(echo, "k-done", "stored")
    answer = answer_from_record(echo, echo.idempotency_gate, None, "k-done", ("x",), {}, None, {},
                                arguments_hash=lambda: None, record=rec)
    assert isinstance(answer, CachedResult)
    assert (answer.id, answer.get(), answer.state) == ("orig-id", "stored", "SUCCESS")
    assert (answer.original_task_id, answer.idempotency_key) == ("orig-id", "k-done")
    assert runs == []


def test_answer_from_record_publishes_when_the_key_is_not_done(app: Celery) -> None:
    echo, _, _ = make_tasks(app)
    gate = echo.idempotency_gate
    running = Record(key="k-run", state=State.IN_PROGRESS, token=1, task_id="t")
    assert answer_from_record(echo, gate, None, "k-run", (), {}, None, {},
                              arguments_hash=lambda: None, record=running) is None
    # Read from the store when not given: an unknown key has no record
    assert answer_from_record(echo, gate, None, "k-absent", (), {}, None, {},
                              arguments_hash=lambda: None) is None


def test_answer_from_record_refuses_other_arguments_under_the_same_key(app: Celery) -> None:
    echo, _, _ = make_tasks(app)
    rec = _done(echo, "k-fp", "stored", payload_hash="first")
    with pytest.raises(IdempotencyKeyMismatch, match="different arguments") as info:
        answer_from_record(echo, echo.idempotency_gate, None, "k-fp", (), {}, None, {},
                           arguments_hash=lambda: "second", record=rec)
    assert info.value.key == "k-fp"
    same = answer_from_record(echo, echo.idempotency_gate, None, "k-fp", (), {}, None, {},
                              arguments_hash=lambda: "first", record=rec)
    assert same is not None and same.get() == "stored"
