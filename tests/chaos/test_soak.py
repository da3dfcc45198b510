"""Scenario 10, the short version CI runs: 300 actions with random faults, through the same
script as the long soak (``python -m tests.chaos.soak --actions 2000``)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import PG_URL, require
from tests.integration.harness import ROOT

# The soak's own deadline bounds the run; pytest-timeout (300 s by default) must not cut it first.
pytestmark = [pytest.mark.worker, pytest.mark.crash, pytest.mark.slow, pytest.mark.timeout(900)]

# About 80 s on an idle 2-core machine, over 100 s beside two busy loops. The deadline bounds a
# hung run and is no speed requirement: copies still pending when it passes count as unresolved
# and fail the test, so it leaves a loaded machine several times the idle run.
DEADLINE = 600


def test_soak_with_random_faults_runs_nothing_twice_and_loses_nothing() -> None:
    require(PG_URL, 5432, "PostgreSQL")
    proc = subprocess.run(
        [sys.executable, "-m", "tests.chaos.soak", "--actions", "300", "--json",
         "--timeout", str(DEADLINE)],
        # past the deadline: the soak's settling (at most 15 s after it) and teardown
        cwd=ROOT, capture_output=True, text=True, timeout=DEADLINE + 180,
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
