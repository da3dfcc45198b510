"""celery_idem.contrib.flower on Flower's own event state, without servers: what it changes and what not."""

from __future__ import annotations

import itertools
from typing import Any

import flower.events
from celery.events.state import State as CeleryState
from prometheus_client import REGISTRY

import celery_idem.contrib.flower
from celery_idem.contrib.flower import FIELDS, IdempotencyTaskState

_clock = itertools.count(1)


def _event(type_: str, uuid: str = "t-1", **fields: Any) -> dict[str, Any]:
    n = next(_clock)
    return {"type": type_, "uuid": uuid, "hostname": "w1@host", "timestamp": 1000.0 + n,
            "local_received": 1000.0 + n, "clock": n, **fields}


def _idem(outcome: str, **fields: Any) -> dict[str, Any]:
    decision = {"idempotency_key": "op:abc", "outcome": outcome, "original_task_id": "t-0",
                "token": 1, **fields}
    return _event("task-idempotency", **decision)


RUN = [
    _event("task-received", name="shop.charge", args="()", kwargs="{}"),
    _event("task-started"),
    _idem("duplicate", record_state="done"),
    _event("task-succeeded", result="42", runtime=0.01),
]


def test_plain_celery_state_shows_no_decision() -> None:
    # Why the extension exists: the decision's fields are not in Celery's Task._fields. (The
    # record's state travels as "record_state", so it cannot overwrite the task's state.)
    state = CeleryState()
    for event in [RUN[0], RUN[1], RUN[3], RUN[2]]:  # the decision arrives after the success
        state.event(dict(event))
    task = state.tasks["t-1"]
    assert "idempotency_key" not in task.as_dict()
    assert task.state != "done"


def test_install_gives_flower_a_task_state_with_the_decisions_and_counts_them() -> None:
    celery_idem.contrib.flower.install()
    celery_idem.contrib.flower.install()  # idempotent: registers the counter once
    assert flower.events.EventsState.Task is IdempotencyTaskState

    def count() -> float:
        return REGISTRY.get_sample_value(
            "celery_idem_decisions_total", {"task": "shop.charge", "outcome": "duplicate"}) or 0.0

    before = count()
    state = flower.events.EventsState(max_tasks_in_memory=100)
    for event in [RUN[0], RUN[1], RUN[3], RUN[2]]:
        state.event(dict(event))
    task = state.tasks["t-1"].as_dict()
    assert task["state"] == "SUCCESS"
    assert {name: task[name] for name in FIELDS} == {
        "idempotency_outcome": "duplicate",
        "idempotency_key": "op:abc",
        "original_task_id": "t-0",
        "idempotency_duplicates": None,
        "idempotency_token": 1,
        "idempotency_outcomes": ["duplicate"],
        "idempotency_record_state": "done",
        "previous_task_id": None,
        "previous_owner": None,
        "idempotency_context": None,
    }
    assert count() - before == 1


def test_every_decision_is_kept_in_order_and_the_latest_details_win() -> None:
    task = IdempotencyTaskState("t-2")
    task.event("idempotency", fields=_idem("released", error="TimeoutError"))
    task.event("idempotency", fields=_idem("takeover", token=2, original_task_id="t-2",
                                           previous_task_id="t-2", previous_owner="h:1"))
    task.event("idempotency", fields=_idem("recorded", token=2, original_task_id="t-2"))
    assert task.idempotency_outcomes == ["released", "takeover", "recorded"]
    assert task.idempotency_outcome == "recorded" and task.idempotency_token == 2
    assert (task.previous_task_id, task.previous_owner) == ("t-2", "h:1")
    assert task.idempotency_context == "error=TimeoutError"
    # Flower pickles its state with --persistent: the fields survive
    import pickle

    copy = pickle.loads(pickle.dumps(task))
    assert copy.idempotency_outcomes == ["released", "takeover", "recorded"]


def test_a_run_keeps_its_outcome_and_worker_and_lists_the_answers_given_from_its_record() -> None:
    celery_idem.contrib.flower.install()
    state = flower.events.EventsState(max_tasks_in_memory=100)
    # Given a run on worker w1 that recorded the action
    for event in (_event("task-received", uuid="run", name="shop.charge"),
                  _event("task-started", uuid="run"),
                  _idem("claimed", uuid="run", original_task_id="run"),
                  _idem("recorded", uuid="run", original_task_id="run"),
                  _event("task-succeeded", uuid="run", result="42", runtime=0.01)):
        state.event(event)
    # When delay() of the same action is answered at enqueue under the run's own id (the
    # producer's event), and a copy delivered under its own id is answered by the worker
    state.event({**_idem("answered", uuid="run", original_task_id="run", record_state="done",
                         at="enqueue", name="shop.charge"), "hostname": "producer@web1"})
    state.event(_idem("duplicate", uuid="copy", original_task_id="run", record_state="done"))
    run = state.tasks["run"]
    # Then the run's page still says recorded, on the worker that ran it
    assert run.idempotency_outcome == "recorded"
    assert run.idempotency_outcomes == ["claimed", "recorded"]
    assert run.worker.hostname == "w1@host"
    # and lists both answers given from its record
    assert run.idempotency_duplicates == "answered at enqueue on producer@web1, copy (duplicate)"
    assert state.tasks["copy"].idempotency_outcome == "duplicate"


def test_no_label_flower_derives_from_a_field_name_is_garbled() -> None:
    from flower.utils.template import humanize

    for name in FIELDS:
        assert humanize(name) == name.replace("_", " ").capitalize(), name


def test_install_adds_the_outcome_column_to_the_task_list_after_the_state() -> None:
    import flower.views.tasks
    from tornado.options import options

    saved = options.tasks_columns
    try:
        options.tasks_columns = "name,uuid,state,received,runtime,worker"
        celery_idem.contrib.flower.install()
        assert options.tasks_columns == "name,uuid,state,idempotency_outcome,received,runtime,worker"
        assert flower.views.tasks.TASK_COLUMNS["idempotency_outcome"] == "Idempotency outcome"
        celery_idem.contrib.flower.install()  # once
        assert options.tasks_columns.count("idempotency_outcome") == 1
    finally:
        options.tasks_columns = saved
