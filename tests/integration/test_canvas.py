"""The key travels with every canvas step and with retries; each step is its own action."""

from __future__ import annotations

import pytest
from celery import chain, chord, group

from tests.integration import app as tasks
from tests.integration.conftest import Cluster

pytestmark = pytest.mark.worker


def test_a_chain_run_twice_runs_each_step_once(cluster: Cluster) -> None:
    cluster.worker()
    flow = chain(tasks.add_step.s(0, "c1"), tasks.add_step.s("c2"), tasks.add_step.s("c3"))
    assert flow.apply_async().get(timeout=30) == 3
    assert flow.apply_async().get(timeout=30) == 3  # every step a duplicate: cached results
    for step in ("c1", "c2", "c3"):
        assert len(cluster.effects(f"step:{step}")) == 1


def test_a_group_with_a_repeated_action_runs_it_once(cluster: Cluster) -> None:
    cluster.worker()
    res = group(tasks.charge.s("g1", 1), tasks.charge.s("g2", 1), tasks.charge.s("g1", 1))
    out = res.apply_async().get(timeout=30)
    assert out[0] == out[2] and out[0]["order_id"] == "g1"
    assert len(cluster.effects("charge:g1")) == 1 and len(cluster.effects("charge:g2")) == 1


def test_a_chord_body_runs_once_per_distinct_input(cluster: Cluster) -> None:
    cluster.worker()
    header = [tasks.charge.s("h1", 1), tasks.charge.s("h2", 1)]
    assert chord(header)(tasks.summarize.s()).get(timeout=30) == ["h1", "h2"]
    assert chord(header)(tasks.summarize.s()).get(timeout=30) == ["h1", "h2"]
    assert len(cluster.effects("summary")) == 1
    assert len(cluster.effects("charge:h1")) == 1


def test_a_chain_built_again_runs_no_step_and_its_last_step_id_gets_the_result(cluster: Cluster) -> None:
    # A new chain object has new task ids (Celery 5.7 re-uses a frozen chain's ids, 5.4 does
    # not): the last step, published by the worker with its id chosen beforehand, must go out
    # even though its key is done, or the chain's result never arrives.
    cluster.worker()

    def flow() -> chain:
        return chain(tasks.add_step.s(0, "c4"), tasks.add_step.s("c5"), tasks.add_step.s("c6"))

    assert flow().apply_async().get(timeout=30) == 3
    assert flow().apply_async().get(timeout=30) == 3
    for step in ("c4", "c5", "c6"):
        assert len(cluster.effects(f"step:{step}")) == 1


def test_a_chord_built_again_runs_no_body_and_its_body_id_gets_the_result(cluster: Cluster) -> None:
    # The chord's body is published by the backend with its id chosen beforehand (and, before
    # Celery 5.7, no group id): it must go out even though its key is done.
    cluster.worker()

    def header() -> list[object]:
        return [tasks.charge.s("h3", 1), tasks.charge.s("h4", 1)]

    assert chord(header())(tasks.summarize.s()).get(timeout=30) == ["h3", "h4"]
    assert chord(header())(tasks.summarize.s()).get(timeout=30) == ["h3", "h4"]
    assert len(cluster.effects("summary")) == 1
    assert len(cluster.effects("charge:h3")) == 1


def test_self_retry_carries_the_same_key_and_hands_the_claim_over(cluster: Cluster) -> None:
    cluster.worker()
    expected = tasks.manual_retry.idempotency_key_for(("r1",))
    out = tasks.manual_retry.delay("r1").get(timeout=30)
    t1, t2 = (int(t) for t in cluster.effects("token:r1"))
    assert out["key"] == expected and out["token"] == t2 > t1  # the retry's claim, above the first
    assert cluster.effects("attempt:r1") == [expected, expected]
    assert len(cluster.effects("charge:r1")) == 1
