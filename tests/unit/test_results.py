"""celery_idem.results: the plain result writer, the producer's answer write, a record's outcome.

In process, on the ``cache+memory://`` result backend (one per process: every test uses task ids
of its own).
"""

from __future__ import annotations

from typing import Any
from uuid import uuid4

import pytest
from celery import Celery
from celery.app.task import Context
from celery.states import FAILURE, PENDING, SUCCESS

from celery_idem import IdempotentTask, TerminalError
from celery_idem.codec import KombuCodec
from celery_idem.records import Record, State
from celery_idem.results import ResultWriter, recorded_outcome, store_answer


@pytest.fixture
def task() -> Any:
    app = Celery("test_results", broker="memory://", backend="cache+memory://",
                 set_as_current=False)
    app.conf.idempotency_store = "memory://"

    @app.task(base=IdempotentTask, shared=False)
    def charge(order_id: str) -> str:
        return order_id

    return charge


def request(**fields: Any) -> Context:
    return Context(**{"id": str(uuid4()), "is_eager": False, "called_directly": False, **fields})


def test_only_a_plain_sent_call_is_not_left_to_celery(task: Any) -> None:
    writer = ResultWriter(task)
    assert not writer.left_to_celery(request())
    for fields in ({"is_eager": True}, {"called_directly": True}, {"id": None},
                   {"callbacks": [{"task": "x"}]}, {"chain": [{"task": "x"}]},
                   {"chord": {"task": "x"}}, {"ignore_result": True}):
        assert writer.left_to_celery(request(**fields)), fields


def test_the_plain_writer_leaves_the_write_to_celery(task: Any) -> None:
    writer = ResultWriter(task)
    assert writer.folds is False
    assert writer.build(request(), "value") is None


def test_an_answer_is_stored_under_the_requests_id(task: Any) -> None:
    req = request()
    assert store_answer(task, None, req, "charged", SUCCESS)
    meta = task.backend.get_task_meta(req.id)
    assert (meta["status"], meta["result"]) == (SUCCESS, "charged")


def test_an_ignored_result_is_not_stored(task: Any) -> None:
    req = request(ignore_result=True)
    assert store_answer(task, None, req, "charged", SUCCESS)
    assert task.backend.get_task_meta(req.id)["status"] == PENDING


class Writer(ResultWriter):
    def __init__(self, task: Any, *, build_fails: bool = False, writes: bool = True) -> None:
        super().__init__(task)
        self.build_fails, self.writes = build_fails, writes
        self.written: list[Any] = []

    def build(self, request: Any, result: Any, state: str = SUCCESS) -> Any:
        if self.build_fails:
            raise ValueError("cannot build")
        return (request.id, result)

    def write(self, write: Any, state: str = SUCCESS) -> bool:
        self.written.append(write)
        return self.writes


def test_a_writer_that_writes_spares_the_backend(task: Any) -> None:
    req = request()
    writer = Writer(task)
    assert store_answer(task, writer, req, "charged", SUCCESS)
    assert writer.written == [(req.id, "charged")]
    assert task.backend.get_task_meta(req.id)["status"] == PENDING


@pytest.mark.parametrize("options", [{"build_fails": True}, {"writes": False}])
def test_the_backend_stores_what_the_writer_could_not(task: Any, options: dict[str, bool]) -> None:
    req = request()
    assert store_answer(task, Writer(task, **options), req, "charged", SUCCESS)
    assert task.backend.get_task_meta(req.id)["result"] == "charged"


def test_a_failed_backend_write_asks_for_the_message(task: Any,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: Any, **kwargs: Any) -> None:
        raise ConnectionError("backend down")

    monkeypatch.setattr(task.backend, "store_result", refuse)
    assert store_answer(task, None, request(), "charged", SUCCESS) is False


def test_recorded_outcome_decodes_a_value_or_an_error() -> None:
    codec = KombuCodec("json", ["json"])
    content_type, data = codec.encode_result({"charged": 5})
    done = Record(key="k", state=State.DONE, token=1, content_type=content_type, data=data)
    assert recorded_outcome(codec, done) == (SUCCESS, {"charged": 5})
    content_type, data = codec.encode_error(TerminalError("declined"))
    failed = Record(key="k", state=State.FAILED, token=1, content_type=content_type, data=data)
    state, error = recorded_outcome(codec, failed)
    assert state == FAILURE
    assert isinstance(error, TerminalError) and str(error) == "declined"
