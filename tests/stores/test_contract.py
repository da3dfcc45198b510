"""The store contract (celery_idem/stores/base.py), run against every store.

Each test runs once per store: memory, Redis, PostgreSQL, MariaDB/MySQL and SQLite, and the
Django store (celery_idem.contrib.django) on SQLite and PostgreSQL through Django's connections
(one migrated table per database for the whole session; tests keep apart by prefix). Every store
gets a key prefix no other test uses (Redis: its keys are deleted by prefix afterwards, never
FLUSHDB) and, for SQL, a table of its own that is dropped afterwards. A server that does not
answer skips its tests locally and fails them in CI, through tests/conftest.py's ``require``.

Only what the contract promises is asserted: statuses, tokens, records, the exception types and
their ``key``/``token``. Wording of messages and the order of ``scan`` are the stores' own.
Tokens are asserted as promised: strictly increasing per key (a lost record included), at least
the store clock in microseconds, exact in a double; never as the numbers 1, 2, 3.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from celery_idem.config import accelerate_switch
from celery_idem.exceptions import LeaseLost
from celery_idem.records import Claim, ClaimStatus, State
from celery_idem.stores import store_from_url
from celery_idem.stores.base import Store
from tests.conftest import store_kinds
from tests.django.support import django_databases  # noqa: F401 - a fixture used by name

from .support import LONG, claim, drop_table, lose, poll, set_token

STORES = store_kinds("memory", "redis", "postgresql", "mysql", "sqlite", "django-sqlite",
                     "django-postgresql", "django-mysql")

MakeStore = Callable[..., Store]


@pytest.fixture(params=STORES)
def make_store(request: pytest.FixtureRequest, prefix: str, tmp_path: Path) -> Iterator[MakeStore]:
    """Build stores of one kind on one server (and, for SQL, one table of this test's).

    ``make()`` uses this test's prefix; ``make(other_prefix)`` a second app on the same server.
    """
    kind: str = request.param
    # The store's fast paths as the switch says (make test-plain runs the contract with it off).
    options: dict[str, object] = {"accelerate": accelerate_switch()}
    if kind == "memory":
        url = "memory://"
    elif kind == "redis":
        url = request.getfixturevalue("redis_url")
        request.getfixturevalue("redis_cleanup")  # SCAN + DEL of this test's prefix afterwards
    elif kind.startswith("django-"):
        pytest.importorskip("django")  # the [django] extra (make test-compat's venvs lack it)
        request.getfixturevalue("django_databases")
        url = {"django-sqlite": "django://", "django-postgresql": "django://pg",
               "django-mysql": "django://mysql"}[kind]
        if kind == "django-mysql":
            from tests.django.support import require_mysql

            require_mysql()
    else:
        if kind == "sqlite":
            url = f"db+sqlite:///{tmp_path / 'idem.db'}"
        else:
            url = "db+" + request.getfixturevalue("pg_url" if kind == "postgresql" else "mysql_url")
        options["table_name"] = f"t_{uuid.uuid4().hex[:12]}"
    stores: list[Store] = []

    def make(store_prefix: str = prefix) -> Store:
        store = store_from_url(url, prefix=store_prefix, options=options)
        stores.append(store)
        return store

    yield make
    try:
        if ("table_name" in options or kind.startswith("django-")) and stores:
            drop_table(stores[0])
    finally:
        for store in stores:
            store.close()


@pytest.fixture
def store(make_store: MakeStore) -> Store:
    return make_store()


def done(store: Store, key: str, token: int, data: bytes = b"[42]", ttl: float = LONG) -> None:
    store.record(key, token, state=State.DONE, content_type="application/json", data=data, ttl=ttl)


# -- claim ------------------------------------------------------------------------------------


def assert_clock_token(result: Claim) -> None:
    """A taking claim's token: at least the store clock in µs at the claim, exact in a double."""
    assert isinstance(result.token, int)
    # The claim's ``now`` may be rounded to the millisecond (Redis), the token is not.
    assert result.token >= int(result.now * 1_000_000) - 1000
    assert result.token < 2**53


def test_a_first_claim_gets_a_clock_token_and_a_claim_id_and_writes_an_in_progress_record(
    store: Store,
) -> None:
    result = claim(store, who="a", attempt=2, lease=LONG)
    assert result.status is ClaimStatus.CLAIMED
    assert_clock_token(result)
    assert isinstance(result.claim_id, str) and result.claim_id
    assert result.record is None
    rec = store.get("k")
    assert rec is not None
    assert (rec.key, rec.state, rec.token, rec.owner, rec.task_id, rec.attempt, rec.claim_id) == (
        "k",
        State.IN_PROGRESS,
        result.token,
        "host:a",
        "task-a",
        2,
        result.claim_id,
    )
    assert rec.lease_expires == pytest.approx(result.now + LONG, abs=1e-3)
    assert rec.data is None


def test_a_second_claim_is_busy_and_describes_the_live_holder(store: Store) -> None:
    first = claim(store, who="a")
    result = claim(store, who="b")
    assert result.status is ClaimStatus.BUSY
    assert result.token == first.token
    assert result.claim_id == ""  # only a holder gets one
    assert result.record is not None
    assert (result.record.owner, result.record.task_id) == ("host:a", "task-a")
    assert store.get("k") == result.record  # nothing was written


def test_a_done_key_answers_every_later_claim_with_its_result(store: Store) -> None:
    token = claim(store).token
    done(store, "k", token, b"[42]")
    result = claim(store, who="b")
    assert result.status is ClaimStatus.DONE
    assert result.token == token
    assert result.record is not None
    assert (result.record.state, result.record.content_type, result.record.data) == (
        State.DONE,
        "application/json",
        b"[42]",
    )
    assert result.record.lease_expires is None
    assert claim(store, who="a", attempt=1).status is ClaimStatus.DONE  # a retry does not rerun it


def test_a_failed_key_answers_every_later_claim_with_its_error(store: Store) -> None:
    token = claim(store).token
    store.record("k", token, state=State.FAILED, content_type="x-error", data=b"boom", ttl=LONG)
    result = claim(store, who="a", attempt=3)  # a retry does not take over a FAILED record
    assert result.status is ClaimStatus.FAILED
    assert result.token == token
    assert result.record is not None
    assert (result.record.state, result.record.content_type, result.record.data) == (
        State.FAILED,
        "x-error",
        b"boom",
    )


def test_a_release_keeps_a_tombstone_and_the_next_claim_gets_a_higher_token(store: Store) -> None:
    first = claim(store, payload_hash="h1")
    t1 = first.token
    store.release("k", t1, claim_id=first.claim_id)
    tomb = store.get("k")
    assert tomb is not None
    assert (
        tomb.state,
        tomb.token,
        tomb.owner,
        tomb.task_id,
        tomb.lease_expires,
        tomb.payload_hash,
        tomb.data,
    ) == (State.RELEASED, t1, "", "", None, None, None)
    # The released holder can neither release, renew nor record again.
    for stale in (
        lambda: store.release("k", t1),
        lambda: store.renew("k", t1, LONG),
        lambda: done(store, "k", t1),
        lambda: store.release("k", t1, claim_id=first.claim_id),
    ):
        with pytest.raises(LeaseLost):
            stale()
    assert store.get("k") == tomb
    # A released key is free, whatever hash the next claim brings.
    result = claim(store, who="b", payload_hash="h2")
    assert result.status is ClaimStatus.CLAIMED
    assert result.token > t1
    assert_clock_token(result)
    assert result.claim_id != first.claim_id
    assert result.record == tomb


def test_an_expired_lease_is_taken_over_with_the_next_token(store: Store) -> None:
    first = claim(store, who="a", lease=0.3)

    def takeover() -> Claim | None:
        result = claim(store, who="b")
        assert result.status in (ClaimStatus.BUSY, ClaimStatus.TAKEOVER)
        return result if result.status is ClaimStatus.TAKEOVER else None

    result = poll(store, takeover, "the lease to expire")
    assert result.token > first.token
    assert_clock_token(result)
    assert result.record is not None
    assert (result.record.owner, result.record.token) == ("host:a", first.token)
    rec = store.get("k")
    assert rec is not None
    assert (rec.state, rec.owner, rec.token, rec.claim_id) == (
        State.IN_PROGRESS, "host:b", result.token, result.claim_id)


def test_a_retry_of_the_same_task_takes_over_at_once(store: Store) -> None:
    first = claim(store, who="a", attempt=1)
    assert claim(store, who="a", attempt=1).status is ClaimStatus.BUSY  # same attempt
    assert claim(store, who="a", attempt=0).status is ClaimStatus.BUSY  # an earlier attempt
    assert claim(store, who="b", attempt=5).status is ClaimStatus.BUSY  # another task
    result = claim(store, who="a", attempt=2)
    assert result.status is ClaimStatus.TAKEOVER
    assert result.token > first.token
    assert result.record is not None and result.record.attempt == 1
    rec = store.get("k")
    assert rec is not None and (rec.token, rec.attempt) == (result.token, 2)


def test_a_payload_hash_mismatch_is_reported_before_done(store: Store) -> None:
    first = claim(store, payload_hash="aaa")
    result = claim(store, who="b", payload_hash="bbb")
    assert result.status is ClaimStatus.MISMATCH
    assert result.record is not None and result.record.payload_hash == "aaa"
    # Not validating, or the same hash: no mismatch.
    assert claim(store, who="b").status is ClaimStatus.BUSY
    assert claim(store, who="b", payload_hash="aaa").status is ClaimStatus.BUSY
    # The mismatch is checked before DONE.
    done(store, "k", first.token)
    assert claim(store, who="b", payload_hash="bbb").status is ClaimStatus.MISMATCH
    assert claim(store, who="b", payload_hash="aaa").status is ClaimStatus.DONE


def test_a_validating_claim_refuses_a_record_without_a_payload_hash(store: Store) -> None:
    # A record made without a hash cannot show it is the caller's action.
    claim(store)
    assert claim(store, who="b", payload_hash="bbb").status is ClaimStatus.MISMATCH
    assert claim(store, who="b").status is ClaimStatus.BUSY  # a caller that does not validate
    # A released tombstone is no action: the validating claim takes it.
    released = claim(store, "k2")
    store.release("k2", released.token, claim_id=released.claim_id)
    assert claim(store, "k2", payload_hash="bbb").status is ClaimStatus.CLAIMED


def test_keys_differing_only_in_case_are_different_keys(store: Store) -> None:
    assert claim(store, "Refund:x").status is ClaimStatus.CLAIMED
    assert claim(store, "refund:x").status is ClaimStatus.CLAIMED


def test_keys_differing_only_in_trailing_spaces_are_different_keys(store: Store) -> None:
    # MySQL/MariaDB's PAD SPACE collations would make these one row (and one primary key).
    first = claim(store, "K")
    assert first.status is ClaimStatus.CLAIMED
    assert claim(store, "K ").status is ClaimStatus.CLAIMED
    done(store, "K", first.token)
    answered = store.get("K ")
    assert answered is not None and answered.state is State.IN_PROGRESS


# -- fenced writes ----------------------------------------------------------------------------


def test_a_stale_holder_loses_record_release_and_renew(store: Store) -> None:
    first = claim(store, who="a", attempt=0)
    t1, c1 = first.token, first.claim_id
    retry = claim(store, who="a", attempt=1)
    assert retry.status is ClaimStatus.TAKEOVER and retry.token > t1  # the retry took over
    for verb, stale in (
        ("record", lambda: done(store, "k", t1, b"stale")),
        ("release", lambda: store.release("k", t1)),
        ("renew", lambda: store.renew("k", t1, LONG)),
        ("record with its claim id", lambda: store.record(
            "k", t1, state=State.DONE, content_type="c", data=b"stale", ttl=LONG, claim_id=c1)),
        ("release with its claim id", lambda: store.release("k", t1, claim_id=c1)),
        ("renew with its claim id", lambda: store.renew("k", t1, LONG, claim_id=c1)),
    ):
        with pytest.raises(LeaseLost) as info:
            stale()
        assert (info.value.key, info.value.token) == ("k", t1), verb
    rec = store.get("k")
    assert rec is not None
    assert (rec.state, rec.token, rec.data) == (State.IN_PROGRESS, retry.token, None)
    done(store, "k", retry.token, b"fresh")  # the current holder still can
    rec = store.get("k")
    assert rec is not None and (rec.state, rec.data) == (State.DONE, b"fresh")


def test_fenced_writes_on_a_missing_key_lose_the_lease(store: Store) -> None:
    assert store.get("nope") is None
    for stale in (
        lambda: done(store, "nope", 1),
        lambda: store.release("nope", 1),
        lambda: store.renew("nope", 1, LONG),
        lambda: store.release("nope", 1, claim_id="abc"),
    ):
        with pytest.raises(LeaseLost) as info:
            stale()
        assert (info.value.key, info.value.token) == ("nope", 1)
    assert store.get("nope") is None


def test_recording_again_with_the_same_token_is_a_no_op(store: Store) -> None:
    token = claim(store).token
    done(store, "k", token, b"first")
    first = store.get("k")
    done(store, "k", token, b"again")  # a retry after a lost reply
    assert store.get("k") == first  # succeeded, changed nothing
    for other in (
        lambda: store.record("k", token, state=State.FAILED, content_type="c", data=b"", ttl=LONG),
        lambda: store.release("k", token),
        lambda: store.renew("k", token, LONG),
    ):
        with pytest.raises(LeaseLost):
            other()
    assert store.get("k") == first


@pytest.mark.parametrize("state", [State.IN_PROGRESS, State.RELEASED])
def test_record_rejects_states_other_than_done_and_failed(store: Store, state: State) -> None:
    token = claim(store).token
    before = store.get("k")
    with pytest.raises(ValueError, match="DONE or FAILED"):
        store.record("k", token, state=state, content_type="c", data=b"", ttl=LONG)
    assert store.get("k") == before


def test_renew_extends_the_lease_on_the_store_clock(store: Store) -> None:
    first = claim(store, lease=0.5)
    expires = store.renew("k", first.token, 30.0)
    assert expires == pytest.approx(store.now() + 30.0, abs=2.0)
    rec = store.get("k")
    assert rec is not None and rec.lease_expires == pytest.approx(expires, abs=1e-6)
    start = store.now()
    poll(store, lambda: store.now() >= start + 1.0, "the original lease to run out")
    assert claim(store, who="b").status is ClaimStatus.BUSY


def test_renew_keeps_the_record_alive_as_long_as_the_lease(store: Store) -> None:
    """A body that runs past the TTL, renewing its lease, must not lose its record."""
    first = claim(store, lease=0.5, ttl=1.0)
    store.renew("k", first.token, 3.0)

    def outlived_the_ttl() -> bool:
        now = store.now()
        rec = store.get("k")
        assert rec is not None, (
            f"the record vanished {now - first.now:.2f} s after a claim with ttl=1.0 although "
            f"its lease was renewed for 3 s"
        )
        assert (rec.state, rec.token) == (State.IN_PROGRESS, first.token)
        return now >= first.now + 1.5

    poll(store, outlived_the_ttl, "1.5 s of store time")
    assert claim(store, who="b").status is ClaimStatus.BUSY
    done(store, "k", first.token)  # the holder can still record its result
    rec = store.get("k")
    assert rec is not None and rec.state is State.DONE


def test_renew_never_shortens_the_records_ttl(store: Store) -> None:
    first = claim(store, lease=0.3, ttl=LONG)
    store.renew("k", first.token, 0.3)
    poll(store, lambda: store.now() >= first.now + 1.0, "the renewed lease to run out")
    rec = store.get("k")
    assert rec is not None and rec.state is State.IN_PROGRESS  # the TTL is still LONG
    assert claim(store, who="b").status is ClaimStatus.TAKEOVER


# -- claim ids and lost records ---------------------------------------------------------------


def test_fenced_writes_check_the_claim_id_as_well_as_the_token(store: Store) -> None:
    held = claim(store)
    token, other = held.token, held.claim_id[::-1] + "x"
    for verb, wrong in (
        ("record", lambda: store.record("k", token, state=State.DONE, content_type="c",
                                        data=b"wrong", ttl=LONG, claim_id=other)),
        ("release", lambda: store.release("k", token, claim_id=other)),
        ("renew", lambda: store.renew("k", token, LONG, claim_id=other)),
    ):
        with pytest.raises(LeaseLost) as info:
            wrong()
        assert (info.value.key, info.value.token) == ("k", token), verb
    still = store.get("k")
    assert still is not None and (still.state, still.data) == (State.IN_PROGRESS, None)
    # The holder's own claim id passes; no claim id (a caller from before claim ids) checks the
    # token alone.
    store.renew("k", token, LONG, claim_id=held.claim_id)
    store.renew("k", token, LONG)
    done(store, "k", token, b"mine")
    store.record("k", token, state=State.DONE, content_type="application/json", data=b"mine",
                 ttl=LONG, claim_id=held.claim_id)  # a retry after a lost reply
    with pytest.raises(LeaseLost):  # but not a retry by another claim with the same token
        store.record("k", token, state=State.DONE, content_type="application/json",
                     data=b"theirs", ttl=LONG, claim_id=other)
    rec = store.get("k")
    assert rec is not None and (rec.state, rec.data, rec.claim_id) == (
        State.DONE, b"mine", held.claim_id)


def test_after_the_store_loses_a_held_record_the_next_token_is_higher_and_the_stale_holder_is_refused(
    store: Store,
) -> None:
    stale = claim(store, who="a")
    lose(store, "k")  # FLUSHALL, a restart without persistence, a deleted row
    # A lost record leaves only the clock to stay above: SQLite's (julianday) moves in whole
    # milliseconds, so a claim in the same millisecond would get the same token. A real loss
    # (a restart, a flush) takes longer than that; here the test waits it out.
    poll(store, lambda: int(store.now() * 1_000_000) > stale.token, "the store clock to pass the lost token")
    fresh = claim(store, who="b")
    assert fresh.status is ClaimStatus.CLAIMED and fresh.record is None
    assert fresh.token > stale.token
    for verb, refused in (
        ("renew", lambda: store.renew("k", stale.token, LONG, claim_id=stale.claim_id)),
        ("record", lambda: store.record("k", stale.token, state=State.DONE, content_type="c",
                                        data=b"stale", ttl=LONG, claim_id=stale.claim_id)),
        ("release", lambda: store.release("k", stale.token, claim_id=stale.claim_id)),
    ):
        with pytest.raises(LeaseLost):
            refused()
        assert store.get("k") is not None, verb
    store.record("k", fresh.token, state=State.DONE, content_type="c", data=b"fresh", ttl=LONG,
                 claim_id=fresh.claim_id)
    rec = store.get("k")
    assert rec is not None and (rec.state, rec.token, rec.data) == (State.DONE, fresh.token, b"fresh")


def test_a_token_issued_twice_is_still_refused_to_the_stale_claim(store: Store) -> None:
    """The one case the clock cannot cover: a loss, then a store clock that stepped back."""
    stale = claim(store, who="a")
    lose(store, "k")
    fresh = claim(store, who="b")
    set_token(store, "k", stale.token)  # the new claim got the stale claim's token number
    for verb, refused in (
        ("renew", lambda: store.renew("k", stale.token, LONG, claim_id=stale.claim_id)),
        ("record", lambda: store.record("k", stale.token, state=State.DONE, content_type="c",
                                        data=b"stale", ttl=LONG, claim_id=stale.claim_id)),
        ("release", lambda: store.release("k", stale.token, claim_id=stale.claim_id)),
    ):
        with pytest.raises(LeaseLost) as info:
            refused()
        assert (info.value.key, info.value.token) == ("k", stale.token), verb
    rec = store.get("k")
    assert rec is not None and (rec.state, rec.owner, rec.claim_id) == (
        State.IN_PROGRESS, "host:b", fresh.claim_id)
    store.record("k", stale.token, state=State.DONE, content_type="c", data=b"fresh", ttl=LONG,
                 claim_id=fresh.claim_id)
    with pytest.raises(LeaseLost):  # nor may the stale claim pass off its record as a retry
        store.record("k", stale.token, state=State.DONE, content_type="c", data=b"stale",
                     ttl=LONG, claim_id=stale.claim_id)
    rec = store.get("k")
    assert rec is not None and (rec.state, rec.data) == (State.DONE, b"fresh")


# -- TTL --------------------------------------------------------------------------------------


def test_a_record_past_its_ttl_counts_as_absent(store: Store) -> None:
    claim(store, ttl=0.3)
    first = store.now()
    poll(store, lambda: store.get("k") is None, "the TTL to pass")
    assert list(store.scan()) == []
    with pytest.raises(LeaseLost) as info:
        done(store, "k", 1)
    assert info.value.token == 1
    result = claim(store, who="b")
    assert result.status is ClaimStatus.CLAIMED
    assert result.record is None
    assert result.token > int(first * 1_000_000)  # the expired token is not issued again


def test_record_sets_the_ttl_of_the_result(store: Store) -> None:
    token = claim(store, ttl=LONG).token
    done(store, "k", token, ttl=0.3)
    poll(store, lambda: store.get("k") is None, "the recorded TTL to pass")
    assert claim(store, who="b").status is ClaimStatus.CLAIMED


def test_record_keeps_a_result_for_its_ttl_even_when_the_claim_ttl_was_short(store: Store) -> None:
    first = claim(store, ttl=0.5)
    done(store, "k", first.token, ttl=LONG)
    poll(store, lambda: store.now() >= first.now + 1.0, "the claim's TTL to pass")
    result = claim(store, who="b")
    assert result.status is ClaimStatus.DONE


# -- concurrency ------------------------------------------------------------------------------


@pytest.mark.parametrize("released_first", [False, True], ids=["absent", "released"])
def test_concurrent_claims_from_threads_have_exactly_one_winner(
    store: Store, released_first: bool
) -> None:
    setup = None
    if released_first:
        setup = claim(store, who="setup")
        store.release("k", setup.token, claim_id=setup.claim_id)
    threads = 8
    barrier = threading.Barrier(threads)

    def contend(i: int) -> Claim:
        barrier.wait()
        return claim(store, who=f"w{i}")

    with ThreadPoolExecutor(threads) as pool:
        results = list(pool.map(contend, range(threads)))
    winners = [r for r in results if r.status.holds]
    assert [w.status for w in winners] == [ClaimStatus.CLAIMED]
    winner = winners[0]
    assert_clock_token(winner)
    if setup is not None:
        assert winner.token > setup.token
    holder = store.get("k")
    assert holder is not None and (holder.token, holder.claim_id) == (winner.token, winner.claim_id)
    for loser in results:
        if loser is winner:
            continue
        assert loser.status is ClaimStatus.BUSY
        assert loser.record is not None
        assert (loser.record.token, loser.record.owner) == (winner.token, holder.owner)


# -- reads ------------------------------------------------------------------------------------


def test_scan_lists_this_prefixs_live_records_filtered_by_state(
    make_store: MakeStore, prefix: str
) -> None:
    store, other = make_store(prefix + "one:"), make_store(prefix + "two:")
    tokens = {key: claim(store, key).token for key in ["e", "a", "d", "c", "b", "f"]}
    done(store, "b", tokens["b"])
    store.record("d", tokens["d"], state=State.FAILED, content_type="x-error", data=b"boom", ttl=LONG)
    store.release("f", tokens["f"])
    claim(other, "a")  # another app's record on the same server
    claim(other, "z")
    claim(store, "expired", ttl=0.2)
    poll(store, lambda: store.get("expired") is None, "the TTL to pass")

    expected = {
        None: ["a", "b", "c", "d", "e", "f"],
        State.IN_PROGRESS: ["a", "c", "e"],
        State.DONE: ["b"],
        State.FAILED: ["d"],
        State.RELEASED: ["f"],
    }
    for state, keys in expected.items():
        for count in (1, 2, 100):
            records = list(store.scan(state, count=count))
            assert sorted(r.key for r in records) == keys, (state, count)
            for rec in records:
                assert rec == store.get(rec.key)
    assert sorted(r.key for r in other.scan()) == ["a", "z"]


def test_a_large_binary_result_comes_back_byte_for_byte(store: Store) -> None:
    data = b"\xff\x00\xc3(" + bytes(range(256)) * 4096  # over 1 MiB, not UTF-8, with NULs
    with pytest.raises(UnicodeDecodeError):
        data.decode("utf-8")
    token = claim(store).token
    store.record("k", token, state=State.DONE, content_type="application/x-bytes", data=data, ttl=LONG)
    rec = store.get("k")
    assert rec is not None and rec.data == data
    result = claim(store, who="b")
    assert result.status is ClaimStatus.DONE
    assert result.record is not None and result.record.data == data


def test_two_prefixes_on_one_server_do_not_see_each_other(make_store: MakeStore, prefix: str) -> None:
    one, two = make_store(prefix + "one:"), make_store(prefix + "two:")
    first = claim(one, "k", who="a")
    assert first.status is ClaimStatus.CLAIMED
    assert two.get("k") is None
    second = claim(two, "k", who="b")
    assert second.status is ClaimStatus.CLAIMED
    done(one, "k", first.token, b"one")
    busy = claim(two, "k", who="c")
    assert busy.status is ClaimStatus.BUSY
    assert busy.record is not None and busy.record.owner == "host:b"
    two.release("k", second.token)
    rec_one, rec_two = one.get("k"), two.get("k")
    assert rec_one is not None and (rec_one.state, rec_one.data) == (State.DONE, b"one")
    assert rec_two is not None and rec_two.state is State.RELEASED
    assert [(r.key, r.state) for r in one.scan()] == [("k", State.DONE)]
    assert [(r.key, r.state) for r in two.scan()] == [("k", State.RELEASED)]


def test_now_is_close_to_the_local_clock_and_stamps_the_records(store: Store) -> None:
    assert store.now() == pytest.approx(time.time(), abs=5.0)
    result = claim(store, lease=10.0)
    assert result.now == pytest.approx(time.time(), abs=5.0)
    rec = store.get("k")
    assert rec is not None
    assert rec.updated == pytest.approx(result.now, abs=1e-3)
    assert rec.lease_expires == pytest.approx(result.now + 10.0, abs=1e-3)
    before = store.now()
    poll(store, lambda: store.now() > before, "the store clock to move")
