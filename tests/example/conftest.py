"""Helpers for the example app's tests: run the demo as a user does, and read its table."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

#: One row of the demo's table: tag, title, provider mode, 3 naive counts, 3 idempotent
#: counts, verdict.
ROW = re.compile(
    r"^(?P<tag>\d[a-z]?)\s+(?P<title>.+?)\s+(?P<provider>no keys|keys)\s+"
    r"(?P<n>\d+\s+\d+\s+\d+)\s+(?P<i>\d+\s+\d+\s+\d+)\s+(?P<verdict>\S.*)$",
    re.M,
)
#: In the order printed: the ok rows, then the limit rows below a rule of their own.
ROWS = ("1", "2a", "3", "4", "5", "2b")
LIMIT_ROWS = {"2b"}


def run_demo(*args: str, env: dict[str, str] | None = None,
             timeout: float = 120) -> tuple[subprocess.CompletedProcess[str], float]:
    """``python -m example_app.demo ARGS`` in a fresh process; returns it and its wall time."""
    clean = {k: v for k, v in os.environ.items()
             if not k.startswith(("CELERY_", "EXAMPLE_"))}  # only what the test passes
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "example_app.demo", *args], cwd=ROOT,
                          env={**clean, **(env or {})}, capture_output=True, text=True,
                          timeout=timeout)
    return proc, time.monotonic() - started


def parse_table(out: str) -> dict[str, dict[str, object]]:
    rows = {}
    for m in ROW.finditer(out):
        rows[m["tag"]] = {
            "provider": m["provider"],
            "naive": tuple(int(x) for x in m["n"].split()),
            "idempotent": tuple(int(x) for x in m["i"].split()),
            "verdict": m["verdict"].strip(),
        }
    return rows


def check_table(out: str) -> dict[str, dict[str, object]]:
    """Assert the issue's criterion on the printed table and return the rows."""
    rows = parse_table(out)
    assert tuple(rows) == ROWS, f"the table's rows are {list(rows)}:\n{out}"
    for tag, row in rows.items():
        naive, idem = row["naive"], row["idempotent"]
        assert max(naive) > 1, f"row {tag}: the naive tools show no duplicate: {naive}\n{out}"  # type: ignore[call-overload]
        if tag in LIMIT_ROWS:
            assert row["verdict"].startswith("limit"), out  # type: ignore[attr-defined]
            continue
        assert idem == (1, 1, 1), f"row {tag}: the idempotent tools had {idem}\n{out}"
        assert row["verdict"].startswith("ok"), f"row {tag}: {row['verdict']}\n{out}"
    # One charge per order for the idempotent column, more for the naive one, where the
    # scenario is about charges.
    for tag in ("1", "2a", "3"):
        assert rows[tag]["idempotent"][0] == 1 < rows[tag]["naive"][0]  # type: ignore[index]
    assert rows["4"]["naive"][2] > 1 and rows["5"]["naive"][1] > 1  # type: ignore[index]
    return rows
