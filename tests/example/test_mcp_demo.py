"""The example's tools over MCP, as a user runs the demo: one command, one charge per order."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from example_app.mcp_demo import SERVER_ARGS
from tests.example.conftest import ROOT

pytestmark = pytest.mark.worker


def test_the_mcp_demo_collapses_repeated_and_concurrent_calls_to_one_charge() -> None:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("CELERY_", "EXAMPLE_"))}
    proc = subprocess.run([sys.executable, "-m", "example_app.mcp_demo"], cwd=ROOT, env=clean,
                          capture_output=True, text=True, timeout=180)
    out = proc.stdout
    assert proc.returncode == 0, f"exit {proc.returncode}\n{out}\n{proc.stderr[-3000:]}"
    assert "celery -A example_app.celery_app idem mcp --toolbox example_app.agent:mcp_tools" in out
    assert re.search(r"call 1 +charge_card\(\S+\) -> ok", out)
    assert re.search(r"call 2 +charge_card\(\S+\) -> duplicate", out)
    assert re.search(r"charges at the provider: \S+: 1, \S+: 1", out), out
    assert "PASS in" in out


def test_the_documented_server_command_is_the_one_the_demo_runs() -> None:
    readme = (ROOT / "example_app" / "README.md").read_text()
    assert "celery " + " ".join(SERVER_ARGS[2:]) in readme
