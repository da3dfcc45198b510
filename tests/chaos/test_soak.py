"""Scenario 10, the short version CI runs: 300 actions with random faults, through the same
script as the long soak (``python -m tests.chaos.soak --actions 2000``)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import PG_URL, require
from tests.integration.harness import ROOT

pytestmark = [pytest.mark.worker, pytest.mark.crash, pytest.mark.slow]


def test_soak_with_random_faults_runs_nothing_twice_and_loses_nothing() -> None:
    require(PG_URL, 5432, "PostgreSQL")
    proc = subprocess.run(
        [sys.executable, "-m", "tests.chaos.soak", "--actions", "300", "--json",
         "--timeout", "150"],
        cwd=ROOT, capture_output=True, text=True, timeout=240,
    )
    lines = proc.stdout.strip().splitlines()
    assert lines and lines[-1].startswith("{"), proc.stdout + proc.stderr
    report = json.loads(lines[-1])
    assert report["actions"] == 300 and report["effects"] == 300, report
    assert report["duplicates"] == 0 and report["lost"] == 0, report["details"]
    assert report["unresolved"] == 0 and report["failed"] == 0, report["details"]
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # The faults really were injected
    assert report["random_kills"] > 0 and sum(report["store_drops"].values()) > 0
    assert report["replays_by_fault"] > 0
    print(proc.stdout)  # the figures, for -rP / -s
