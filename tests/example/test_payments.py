"""The provider is a real HTTP service: keys, fencing and socket-level faults, seen by its client."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from example_app.demo import start_provider, stop
from example_app.payments import FencedOff, ProviderClient, ProviderError


@pytest.fixture(scope="module")
def provider(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ProviderClient]:
    tmp: Path = tmp_path_factory.mktemp("provider")
    proc: subprocess.Popen[str]
    proc, url = start_provider(f"sqlite:///{tmp}/provider.sqlite", "", tmp / "provider.log")
    try:
        yield ProviderClient(url, timeout=0.5, retries=0)
    finally:
        stop(proc)


def charges(provider: ProviderClient, order_id: str) -> int:
    return int(provider.ledger(prefix=order_id)["charges"].get(order_id, 0))


def test_a_repeated_idempotency_key_gets_the_original_charge(provider: ProviderClient) -> None:
    first = provider.charge("pk_1", 500, idempotency_key="k-pk_1")
    again = provider.charge("pk_1", 500, idempotency_key="k-pk_1")
    assert again == first and first["id"].startswith("ch_")
    assert charges(provider, "pk_1") == 1
    # a different key is another charge
    provider.charge("pk_1", 500, idempotency_key="k-pk_1-other")
    assert charges(provider, "pk_1") == 2


def test_a_key_reused_with_another_request_is_refused(provider: ProviderClient) -> None:
    provider.charge("pk_2", 500, idempotency_key="k-pk_2")
    with pytest.raises(ProviderError) as err:
        provider.charge("pk_2", 999, idempotency_key="k-pk_2")
    assert err.value.status == 422
    assert charges(provider, "pk_2") == 1


def test_a_write_with_a_lower_fencing_token_is_refused(provider: ProviderClient) -> None:
    provider.charge("pk_3", 500, idempotency_key="k-pk_3", fencing_token=2)
    with pytest.raises(FencedOff) as err:
        provider.charge("pk_3", 500, idempotency_key="k-pk_3", fencing_token=1)
    assert err.value.status == 409 and err.value.body["highest_seen"] == 2
    # the same or a higher token passes (and replays the original)
    assert provider.charge("pk_3", 500, idempotency_key="k-pk_3", fencing_token=3)["order_id"] == "pk_3"
    with pytest.raises(FencedOff):
        provider.charge("pk_3", 500, idempotency_key="k-pk_3", fencing_token=2)
    assert charges(provider, "pk_3") == 1


def test_drop_commits_then_hangs_up_and_the_client_raises_connection_error(
    provider: ProviderClient,
) -> None:
    provider.add_rule("pk_4", "charges", "drop", count=1)
    with pytest.raises(ConnectionError):
        provider.charge("pk_4", 500, idempotency_key="k-pk_4")
    assert charges(provider, "pk_4") == 1  # committed before the hang-up
    # the retry with the same key gets the charge that was made
    assert provider.charge("pk_4", 500, idempotency_key="k-pk_4")["order_id"] == "pk_4"
    assert charges(provider, "pk_4") == 1


def test_delay_commits_then_answers_too_late_and_the_client_raises_timeout(
    provider: ProviderClient,
) -> None:
    provider.add_rule("pk_5", "charges", "delay", count=1, seconds=1.5)
    with pytest.raises(TimeoutError):
        provider.charge("pk_5", 500)
    assert charges(provider, "pk_5") == 1


def test_the_clients_own_retry_resends_the_same_key(provider: ProviderClient) -> None:
    client = ProviderClient(f"http://{provider.host}:{provider.port}", timeout=0.5, retries=1)
    provider.add_rule("pk_6", "charges", "drop", count=1)
    out = client.charge("pk_6", 500, idempotency_key="k-pk_6")
    assert out["order_id"] == "pk_6"
    assert charges(provider, "pk_6") == 1
    events = provider.ledger(prefix="pk_6")["events"]["pk_6"]["charges"]
    assert events == {"created": 1, "response dropped": 1, "replayed by key": 1}


def test_without_keys_every_request_charges_and_tokens_are_ignored(provider: ProviderClient) -> None:
    provider.add_rule("pk_7", "charges", keys=False)
    provider.charge("pk_7", 500, idempotency_key="k-pk_7", fencing_token=5)
    provider.charge("pk_7", 500, idempotency_key="k-pk_7", fencing_token=1)
    assert charges(provider, "pk_7") == 2


def test_reads_and_unknown_paths(provider: ProviderClient) -> None:
    provider.charge("pk_8", 700)
    assert [c["amount_cents"] for c in provider.charges_for("pk_8")] == [700]
    with pytest.raises(ProviderError) as err:
        provider.request("POST", "/v1/refunds", {"order_id": "pk_8"})
    assert err.value.status == 404
    assert provider.health()
