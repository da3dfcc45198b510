"""The same behaviour with the SQL store (PostgreSQL and SQLite) under real workers."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from celery_idem import CachedResult, TerminalError
from tests.integration import app as tasks
from tests.integration.conftest import Cluster

pytestmark = pytest.mark.worker


@pytest.fixture(params=["postgresql", "sqlite"])
def sql_cluster(request: pytest.FixtureRequest, make_cluster: Callable[..., Cluster],
                tmp_path: Path) -> Cluster:
    if request.param == "postgresql":
        url = "db+" + request.getfixturevalue("pg_url")
    else:
        url = f"db+sqlite:///{tmp_path / 'store.db'}"
    return make_cluster(IDEM_STORE=url)


def test_sql_store_runs_each_action_once(sql_cluster: Cluster, tmp_path: Path) -> None:
    sql_cluster.worker(concurrency=2)
    first = tasks.charge.delay("sq_1", 10)
    dup = tasks.charge.apply_async(("sq_1", 10), link_error=tasks.plain.si("x"))
    assert dup.get(timeout=30) == first.get(timeout=30)
    again = tasks.charge.delay("sq_1", 10)
    holder = sql_cluster.store.get(tasks.charge.idempotency_key_for(("sq_1", 10)))
    assert isinstance(again, CachedResult) and again.id == holder.task_id in (first.id, dup.id)
    assert len(sql_cluster.effects("charge:sq_1")) == 1


def test_sql_store_releases_on_timeout_and_records_terminal_errors(sql_cluster: Cluster) -> None:
    sql_cluster.worker()
    assert tasks.flaky.delay("sq_2", fail_times=1).get(timeout=30)["attempts"] == 2
    assert len(sql_cluster.effects("charge:sq_2")) == 1
    with pytest.raises(TerminalError):
        tasks.declined.delay("sq_3").get(timeout=30)
    with pytest.raises(TerminalError):
        tasks.declined.apply_async(("sq_3",), link_error=tasks.plain.si("x")).get(timeout=30)
    assert len(sql_cluster.effects("charge:sq_3")) == 1


def test_sql_store_takeover_after_a_sigkill(sql_cluster: Cluster, tmp_path: Path) -> None:
    w = sql_cluster.worker(concurrency=1)
    marker = tmp_path / "pids"
    r = tasks.slow_charge.delay("sq_4", str(marker), 60)
    w.kill_child_running(marker)
    from tests.integration.harness import wait_for

    wait_for(lambda: len(marker.read_text().split()) >= 2, timeout=40, what="the takeover")
    sql_cluster.set_flag("release:sq_4")
    t1, t2 = (int(t) for t in Path(f"{marker}.tokens").read_text().split())
    assert r.get(timeout=40)["token"] == t2 > t1
    assert len(sql_cluster.effects("charge:sq_4")) == 1
