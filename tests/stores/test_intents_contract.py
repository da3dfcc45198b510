"""The intent verbs of the store contract (celery_idem/stores/base.py), run against every store
that keeps intents: memory, Redis, PostgreSQL, MariaDB/MySQL, SQLite and the Django store on
each of its databases (the store kinds and their clean-up are test_contract.py's ``make_store``).

Times are the store's clock; every wait polls it against a deadline (support.poll).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from celery_idem.exceptions import ImproperlyConfigured
from celery_idem.records import Claim, Intent, Record, State
from celery_idem.stores.base import Store
from tests.conftest import store_kinds
from tests.django.support import django_databases  # noqa: F401 - a fixture used by name

from . import test_contract
from .support import LONG, claim, poll
from .test_contract import MakeStore, done

# test_contract's store kinds: one store per kind, with its prefix and clean-up.
make_store, store = test_contract.make_store, test_contract.store

MESSAGE = b'{"body": "\x00\xff\xfe"}' + bytes(range(256))
SHORT = 0.2  # a relay_after that passes within a test


def intend(store: Store, key: str = "k", *, task_id: str = "t1", queue: str = "q",
           message: bytes = MESSAGE, relay_after: float = SHORT, ttl: float = LONG,
           eta: float | None = None) -> Intent:
    return store.intend(key, task_id, queue, message, relay_after=relay_after, ttl=ttl, eta=eta)


def due(store: Store, key: str = "k") -> tuple[Intent, Record | None] | None:
    """``key``'s entry among the due intents, if it is there."""
    return next((entry for entry in store.due_intents() if entry[0].key == key), None)


def poll_due(store: Store, key: str = "k") -> tuple[Intent, Record | None]:
    return poll(store, lambda: due(store, key), f"the intent of {key!r} to be due")


def only(intents: Iterator[Intent]) -> Intent:
    (intent,) = list(intents)
    return intent


def test_every_store_kind_keeps_intents(store: Store) -> None:
    assert type(store).keeps_intents is True


def test_an_intent_is_written_on_the_store_clock_and_is_due_only_after_its_deadline(store: Store) -> None:
    before = store.now()
    intent = intend(store, relay_after=0.5)
    assert (intent.key, intent.task_id, intent.queue, intent.message) == ("k", "t1", "q", MESSAGE)
    assert before - 1e-3 <= intent.enqueued <= store.now() + 1e-3
    assert intent.deadline == pytest.approx(intent.enqueued + 0.5, abs=1e-3)
    assert intent.expires == pytest.approx(intent.enqueued + LONG, abs=1e-3)
    assert intent.sent == intent.enqueued
    early = due(store)
    if store.now() < intent.deadline:  # read after the due_intents call: it was not due then
        assert early is None
    found, record = poll_due(store)
    assert store.now() >= found.deadline
    assert found == intent
    assert record is None  # never claimed


def test_a_due_intent_carries_its_keys_record_in_progress_then_done(store: Store) -> None:
    intend(store, relay_after=0)
    held: Claim = claim(store)
    _, record = poll_due(store)
    assert record is not None
    assert (record.key, record.state, record.token) == ("k", State.IN_PROGRESS, held.token)
    done(store, "k", held.token, data=b"[7]")
    _, record = poll_due(store)
    assert record is not None
    assert (record.state, record.data) == (State.DONE, b"[7]")


def test_eta_moves_the_deadline_and_a_past_eta_does_not(store: Store) -> None:
    now = store.now()
    later = intend(store, "later", relay_after=SHORT, eta=now + 30)
    assert later.deadline == pytest.approx(now + 30 + SHORT, abs=1.0)
    past = intend(store, "past", relay_after=SHORT, eta=now - 30)
    assert past.deadline == pytest.approx(past.enqueued + SHORT, abs=1e-3)
    poll_due(store, "past")
    assert due(store, "later") is None


def test_a_second_intend_replaces_the_first_and_close_takes_only_the_current_task_id(store: Store) -> None:
    intend(store, task_id="t1", queue="q1", message=b"first")
    second = intend(store, task_id="t2", queue="q2", message=b"second", relay_after=LONG)
    assert only(store.intents()) == second
    store.close_intent("k", "t1")  # the replaced message's task: not its intent any more
    assert only(store.intents()) == second
    store.close_intent("k", "t2")
    assert list(store.intents()) == []
    store.close_intent("k", "t2")  # closing a closed intent is fine


def test_reschedule_is_a_compare_and_set_on_the_deadline_and_task_id(store: Store) -> None:
    intend(store, relay_after=0)
    read, _ = poll_due(store)
    assert store.reschedule_intent(read, read.deadline + LONG)
    # A second relay acting on the same read loses: the deadline moved.
    assert not store.reschedule_intent(read, read.deadline + 2 * LONG)
    current = only(store.intents())
    assert current.deadline == pytest.approx(read.deadline + LONG, abs=1e-3)
    assert (current.enqueued, current.sent) == (read.enqueued, read.sent)  # not resent
    assert due(store) is None
    wrong_task = Intent(current.key, "t-other", current.queue, current.message, current.enqueued,
                        current.deadline, current.expires)
    assert not store.reschedule_intent(wrong_task, current.deadline + 1)
    # Store times are whole milliseconds: a re-send in the first send's millisecond would not
    # show a later ``sent``.
    before = poll(store, lambda: (now := store.now()) > read.sent + 0.002 and now,
                  "the store clock to pass the first send")
    assert store.reschedule_intent(current, before + LONG, resent=True)
    resent = only(store.intents())
    assert resent.sent >= before - 1e-3 and resent.sent > read.sent
    assert resent.enqueued == read.enqueued  # its place in the queue: the first send
    assert resent.deadline == pytest.approx(before + LONG, abs=1e-3)
    assert (resent.task_id, resent.message, resent.expires) == (read.task_id, read.message, read.expires)
    store.close_intent("k", "t1")
    assert not store.reschedule_intent(resent, resent.deadline + 1)


def test_reschedule_intents_is_each_compare_and_set_in_order(store: Store) -> None:
    for key in ("a", "b", "c"):
        intend(store, key, task_id=f"t-{key}", relay_after=0)
    reads = {key: poll_due(store, key)[0] for key in ("a", "b", "c")}
    assert store.reschedule_intent(reads["b"], reads["b"].deadline + LONG)  # another relay moved b
    before = store.now()
    moves = [(reads[key], before + LONG) for key in ("a", "b", "c")]
    assert store.reschedule_intents(moves, resent=True) == [True, False, True]
    assert store.reschedule_intents([]) == []
    moved = {i.key: i for i in store.intents()}
    for key in ("a", "c"):
        assert moved[key].deadline == pytest.approx(before + LONG, abs=1e-3)
        assert moved[key].sent >= before - 1e-3  # resent
        assert moved[key].enqueued == reads[key].enqueued
    assert moved["b"].deadline == pytest.approx(reads["b"].deadline + LONG, abs=1e-3)
    assert moved["b"].sent == reads["b"].sent
    assert due(store, "a") is None and due(store, "c") is None


def test_a_stale_intent_is_due_with_its_expiry_passed(store: Store) -> None:
    intent = intend(store, relay_after=0.3, ttl=0.1)
    assert intent.expires < intent.deadline
    found, _ = poll_due(store)
    assert found.expires <= store.now()
    assert found.key == "k"


def test_intents_lists_every_intent_across_pages_and_due_honours_the_limit(store: Store) -> None:
    keys = [f"k{n}" for n in range(5)]
    for key in keys:
        intend(store, key, relay_after=0)
    assert sorted(i.key for i in store.intents(count=2)) == keys
    poll(store, lambda: len(store.due_intents()) == 5, "all five intents to be due")
    first = store.due_intents(limit=2)
    assert len(first) == 2
    deadlines = [intent.deadline for intent, _ in first]
    assert deadlines == sorted(deadlines)
    rest = [i.deadline for i in store.intents() if i.key not in {intent.key for intent, _ in first}]
    assert max(deadlines) <= min(rest)  # the earliest deadlines first


def test_watermarks_keep_the_larger_value_per_queue(store: Store) -> None:
    assert store.watermarks() == {}
    store.raise_watermarks({})
    store.raise_watermarks({"a": 10.5, "b": 5.0})
    store.raise_watermarks({"a": 7.0, "b": 9.25, "queue ✓ c": 1.0})
    assert store.watermarks() == {"a": 10.5, "b": 9.25, "queue ✓ c": 1.0}


def test_odd_keys_and_queues_and_every_message_byte_round_trip(store: Store) -> None:
    keys = ["a key with spaces", "ünïcødé ✓ key", "K", "K "]  # K and "K " are two keys
    for n, key in enumerate(keys):
        intend(store, key, task_id=f"t{n}", queue="queue ✓ one", message=MESSAGE + bytes([n]),
               relay_after=0)
    listed = {i.key: i for i in store.intents()}
    assert sorted(listed) == sorted(keys)
    for n, key in enumerate(keys):
        assert (listed[key].task_id, listed[key].queue, listed[key].message) == (
            f"t{n}", "queue ✓ one", MESSAGE + bytes([n]))
    poll(store, lambda: len(store.due_intents()) == len(keys), "the intents to be due")
    assert {i.key: i.message for i, _ in store.due_intents()} == {k: listed[k].message for k in keys}
    store.close_intent("K ", "t3")
    assert sorted(i.key for i in store.intents()) == sorted(keys[:3])


def test_another_prefix_sees_none_of_the_intents_or_watermarks(make_store: MakeStore) -> None:
    ours, theirs = make_store(), make_store("other-app:")
    intend(ours, relay_after=0)
    ours.raise_watermarks({"q": 5.0})
    poll_due(ours)
    assert list(theirs.intents()) == []
    assert theirs.due_intents() == []
    assert theirs.watermarks() == {}
    theirs.close_intent("k", "t1")
    assert only(ours.intents()).key == "k"


@pytest.mark.parametrize("make_store", store_kinds("django-sqlite", "django-postgresql", "django-mysql"),
                         indirect=True)
def test_in_a_django_transaction_the_intent_commits_with_it_and_the_send_waits_for_the_commit(
    make_store: MakeStore,
) -> None:
    from django.db import transaction

    store = make_store()
    assert store.deferring() is None  # autocommit: nothing to wait for
    ran: list[str] = []
    with pytest.raises(RuntimeError), transaction.atomic(using=store.using):  # type: ignore[attr-defined]
        defer = store.deferring()
        assert defer is not None
        intend(store, "rolled back")
        defer(lambda: ran.append("rolled back"))
        raise RuntimeError
    with transaction.atomic(using=store.using):  # type: ignore[attr-defined]
        intend(store, "committed")
        defer = store.deferring()
        assert defer is not None
        defer(lambda: ran.append("committed"))
        assert ran == []
    assert ran == ["committed"]
    assert [i.key for i in store.intents()] == ["committed"]


class NoIntents(Store):
    """A store with the required verbs only (none of them is called)."""

    from_url = claim = record = release = renew = get = scan = None  # type: ignore[assignment]


def test_a_store_without_intents_refuses_every_intent_verb() -> None:
    bare = NoIntents()
    intent = Intent("k", "t", "q", b"", 0.0, 0.0, 0.0)
    assert NoIntents.keeps_intents is False
    calls = [lambda: intend(bare), bare.due_intents, lambda: bare.reschedule_intent(intent, 1.0),
             lambda: bare.reschedule_intents([(intent, 1.0)]),
             lambda: bare.close_intent("k", "t"), lambda: list(bare.intents()), bare.watermarks,
             lambda: bare.raise_watermarks({"q": 1.0})]
    for call in calls:
        with pytest.raises(ImproperlyConfigured, match="keeps no intents"):
            call()
