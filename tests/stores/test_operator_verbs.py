"""The operators' verbs of the store contract, run against every store: ``forget`` (``idem
forget``) and ``expires_at`` (``idem show``)."""

from __future__ import annotations

import pytest

from celery_idem.exceptions import LeaseLost
from celery_idem.records import ClaimStatus, State
from celery_idem.stores.base import Store
from tests.django.support import django_databases  # noqa: F401 - a fixture used by name

from .support import LONG, claim
from .test_contract import done, make_store, store  # noqa: F401 (fixtures)


@pytest.mark.parametrize("outcome", [State.DONE, State.FAILED])
def test_forget_leaves_a_tombstone_with_the_token_so_the_next_claim_runs_with_the_next(
    store: Store, outcome: State,  # noqa: F811
) -> None:
    token = claim(store, "k").token
    store.record("k", token, state=outcome, content_type="application/json", data=b"1", ttl=LONG)
    store.forget("k", token)
    rec = store.get("k")
    assert rec is not None and rec.state is State.RELEASED and rec.token == token
    again = claim(store, "k", who="b")
    assert again.status is ClaimStatus.CLAIMED and again.token > token


def test_forget_is_fenced_and_refuses_a_claim_in_progress_or_a_missing_key(
    store: Store,  # noqa: F811
) -> None:
    token = claim(store, "k").token
    with pytest.raises(LeaseLost):
        store.forget("k", token)  # in progress: `release` gives a claim back, not forget
    done(store, "k", token)
    with pytest.raises(LeaseLost):
        store.forget("k", token + 1)
    with pytest.raises(LeaseLost):
        store.forget("absent", 1)
    rec = store.get("k")
    assert rec is not None and rec.state is State.DONE


def test_expires_at_is_the_records_ttl_on_the_store_clock(store: Store) -> None:  # noqa: F811
    token = claim(store, "k").token
    done(store, "k", token, ttl=300)
    now = store.now()
    expires = store.expires_at("k")
    assert expires is not None and now + 295 < expires <= now + 301
    assert store.expires_at("absent") is None
