"""The bench measures ``IdempotentTask`` with accelerations off beside the default."""

from __future__ import annotations

import json

import pytest

from bench import cli
from bench.app import Settings, build_app
from bench.e2e import ACCEL_OFF, Summary
from celery_idem import config


def test_an_accel_off_system_turns_them_off_through_its_app_setting_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The environment variable wins over the app setting (make test-plain sets it): not here.
    monkeypatch.delenv("CELERY_IDEM_ACCELERATE", raising=False)
    on = Settings("p:", "q", "redis://127.0.0.1:6379/0")
    off = Settings("p:", "q-off", "redis://127.0.0.1:6379/0", accelerate=False)
    # The worker reads its Settings from the environment: the flag must survive the trip.
    assert Settings(**json.loads(off.to_env()["BENCH_SETTINGS"])) == off
    apps = [build_app(s) for s in (on, off)]
    try:
        assert [config.settings(a).accelerate for a in apps] == [True, False]
    finally:
        for a in apps:
            a.close()


def _summary(system: str, ratios: list[float]) -> Summary:
    return Summary("unique", "prefork", system, 1.0, [1.0], 1.0, 1.0, None, 0, 10,
                   ratio=sorted(ratios)[len(ratios) // 2], ratios=ratios)


def test_the_targets_report_the_ratio_with_accelerations_on_and_off() -> None:
    by = {(s.workload, s.pool, s.system): s for s in (
        _summary("idem/redis", [0.9, 0.92, 0.94]), _summary("idem/redis" + ACCEL_OFF, [0.8, 0.85, 0.86]),
        _summary("idem/postgres", [0.88]))}  # no postgres off: no row for it
    rows = cli.accel_rows(by)
    assert rows == [["throughput ratio vs plain, prefork, redis store: accelerations on / off", "reported",
                     "0.920 / 0.850 (per rep: 0.90 0.92 0.94 / 0.80 0.85 0.86)", "reported"]]
    assert cli._label("idem/postgres" + ACCEL_OFF) == "postgres store, accelerations off"
