"""The demo end to end, as a user runs it: a subprocess, its exit code and its table."""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterator

import pytest

from example_app.demo import SCENARIOS, Run, verdict
from tests.example.conftest import check_table, run_demo

pytestmark = pytest.mark.worker


def test_the_embedded_demo_needs_no_server_and_shows_one_effect_per_action() -> None:
    proc, seconds = run_demo()
    out = proc.stdout
    assert proc.returncode == 0, f"exit {proc.returncode}\n{out}\n{proc.stderr[-3000:]}"
    assert "broker   sqla+sqlite:///" in out and "backend  db+sqlite:///" in out
    assert "running 6 scenarios" in out and "done" in out  # progress while it runs
    check_table(out)
    assert "PASS in" in out
    assert seconds < 60, f"the demo took {seconds:.1f} s"
    # The outcome leads: the table, its limit rows set apart, the verdict, and only then the
    # story of each row; and it says how to keep the logs it deleted
    summary = out[out.index("naive (celery.Task)"):]
    limits = summary.index("limits (what idempotency alone does not give you):")
    assert max(summary.index(f"\n{tag} ") for tag in ("1", "2a", "3", "4", "5")) < limits
    assert limits < summary.index("\n2b ") < summary.index("PASS in") < summary.index("What happened")
    assert out.rstrip().endswith("keep them with --keep (python -m example_app.demo --keep, or "
                                 "make demo DEMO_ARGS=--keep)")


@pytest.fixture
def table_prefix(pg_url: str) -> Iterator[str]:
    """A table prefix no one else uses; its tables are dropped afterwards."""
    import sqlalchemy as sa

    prefix = f"exdemo_{uuid.uuid4().hex[:8]}_"
    yield prefix
    engine = sa.create_engine(pg_url)
    with engine.begin() as conn:
        names = conn.execute(sa.text("SELECT tablename FROM pg_tables WHERE tablename LIKE :p"),
                             {"p": prefix.replace("_", r"\_") + "%"}).scalars().all()
        for name in names:
            conn.execute(sa.text(f'DROP TABLE IF EXISTS "{name}" CASCADE'))
    engine.dispose()


def test_the_same_demo_passes_on_redis_and_postgresql(
    redis_url: str, pg_url: str, table_prefix: str, redis_client: object
) -> None:
    proc, seconds = run_demo("--broker", redis_url, "--backend", f"db+{pg_url}",
                             "--payments-db", pg_url, env={"EXAMPLE_TABLE_PREFIX": table_prefix})
    out = proc.stdout
    assert proc.returncode == 0, f"exit {proc.returncode}\n{out}\n{proc.stderr[-3000:]}"
    assert f"broker   {redis_url}" in out and f"backend  db+{pg_url}" in out
    check_table(out)
    assert seconds < 60, f"the demo took {seconds:.1f} s"
    # It used its own queue and key prefix, and removed them.
    run_id = re.search(r"orders ord_(\w+?)_\*", out)
    assert run_id, out
    left = list(redis_client.scan_iter(match=f"*demo-{run_id[1]}*", count=1000))  # type: ignore[attr-defined]
    assert left == [], f"the demo left Redis keys behind: {left[:5]}"


def _run(tag: str, variant: str, counts: tuple[int, int, int], error: str | None = None) -> Run:
    scenario = next(s for s in SCENARIOS if s.tag == tag)
    return Run(scenario, variant, f"ord_{tag}{variant[0]}", counts=counts, error=error)


def _all(idem: tuple[int, int, int] = (1, 1, 1), naive: tuple[int, int, int] = (2, 1, 1)) -> list[Run]:
    return [r for s in SCENARIOS for r in (_run(s.tag, "naive", naive), _run(s.tag, "idempotent", idem))]


def test_the_verdict_fails_when_an_idempotent_tool_has_two_effects() -> None:
    assert verdict(_all()) == []
    runs = _all()
    runs[7] = _run(runs[7].scenario.tag, "idempotent", (1, 2, 1))  # row 3: two e-mails
    problems = verdict(runs)
    assert len(problems) == 1 and "row 3" in problems[0] and "2 e-mail(s)" in problems[0]


def test_the_verdict_fails_when_the_naive_tools_show_no_duplicate() -> None:
    problems = verdict(_all(naive=(1, 1, 1)))
    assert len(problems) == len(SCENARIOS)
    assert all("did not reproduce" in p for p in problems)


def test_the_verdict_ignores_the_marked_limit_row_but_not_errors() -> None:
    runs = _all()
    limit = next(i for i, r in enumerate(runs) if r.scenario.limit and r.variant == "idempotent")
    runs[limit] = _run(runs[limit].scenario.tag, "idempotent", (3, 1, 1))
    assert verdict(runs) == []
    runs[limit] = _run(runs[limit].scenario.tag, "idempotent", (3, 1, 1), error="boom")
    assert any("boom" in p for p in verdict(runs))
