"""celery_idem.records: the values between the gate and a store.

The enum values are stored (the Redis hash's ``state`` field, the SQL table's ``state`` column)
and compared by every store: a renamed value is a format change, so they are pinned here.
"""

from __future__ import annotations

import dataclasses

import pytest

from celery_idem.records import Claim, ClaimStatus, Receipt, Record, Reservation, State

# No Celery, kombu or redis-py code runs here: make test-compat runs it on its first Celery only.
pytestmark = pytest.mark.celery_independent


def test_state_values_are_the_stored_strings() -> None:
    assert [s.value for s in State] == ["in_progress", "done", "failed", "released"]
    assert State("done") is State.DONE and State.DONE == "done"
    with pytest.raises(ValueError, match="'DONE' is not a valid State"):
        State("DONE")


def test_only_a_claim_or_a_takeover_holds_the_key() -> None:
    assert {s for s in ClaimStatus if s.holds} == {ClaimStatus.CLAIMED, ClaimStatus.TAKEOVER}
    assert [s.value for s in ClaimStatus] == [
        "claimed", "takeover", "done", "failed", "busy", "mismatch",
    ]


def test_a_record_defaults_to_no_holder_lease_or_payload() -> None:
    rec = Record(key="k", state=State.RELEASED, token=4)
    assert (rec.owner, rec.task_id, rec.attempt, rec.claim_id) == ("", "", 0, "")
    assert rec.lease_expires is rec.payload_hash is rec.content_type is rec.data is None
    assert rec.updated is None


def test_records_and_claims_are_values() -> None:
    rec = Record(key="k", state=State.DONE, token=2, data=b"1", content_type="application/json")
    assert rec == Record(key="k", state=State.DONE, token=2, data=b"1",
                         content_type="application/json")
    assert len({rec, dataclasses.replace(rec)}) == 1  # hashable, equal by value
    with pytest.raises(dataclasses.FrozenInstanceError):
        rec.token = 3  # type: ignore[misc]
    claim = Claim(ClaimStatus.BUSY, 2, rec, 100.0)
    assert claim.claim_id == ""
    with pytest.raises(dataclasses.FrozenInstanceError):
        claim.status = ClaimStatus.CLAIMED  # type: ignore[misc]
    assert Reservation("t-1") == Reservation("t-1", None)
    assert Reservation("t-1", "fp") != Reservation("t-1")


def test_a_receipts_value_stays_out_of_its_repr_and_identity_is_by_object() -> None:
    secret = {"card": "4111-1111"}
    receipt = Receipt(key="p:k", token=3, task_id="t-1", value=secret)
    assert "4111" not in repr(receipt) and "t-1" in repr(receipt)
    # eq=False: two receipts are never equal by value (the value may not compare)
    assert receipt != Receipt(key="p:k", token=3, task_id="t-1", value=secret)
    assert receipt == receipt
