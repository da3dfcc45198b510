"""example_app/django_shop: its one command, on the embedded SQLite and on PostgreSQL."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from tests.conftest import PG_URL, require
from tests.integration.harness import ROOT

pytestmark = [pytest.mark.worker]

RUN = ROOT / "example_app" / "django_shop" / "run.py"


def _run(args: list[str]) -> str:
    env = {**os.environ, "DJANGO_SHOP_QUEUE": f"django_shop_{uuid.uuid4().hex[:8]}"}
    out = subprocess.run([sys.executable, str(RUN), *args], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=180)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    return out.stdout


def _assert_charged_once(stdout: str) -> None:
    answers = re.findall(r"^(?:first|second) task (\S+): (.*)$", stdout, re.M)
    assert len(answers) == 2 and answers[0][1] == answers[1][1], stdout
    assert re.search(r"^order \d+: charges=1 charged_cents=4200$", stdout, re.M), stdout


def test_the_example_charges_once_on_the_embedded_sqlite(tmp_path: Path) -> None:
    _assert_charged_once(_run(["--sqlite", str(tmp_path / "shop.sqlite3")]))


def test_the_example_charges_once_on_postgresql() -> None:
    require(PG_URL, 5432, "PostgreSQL")
    from tests.django.support import _admin_sql, pg_params

    name = f"celery_idem_django_test_{uuid.uuid4().hex[:10]}"
    _admin_sql(f'CREATE DATABASE "{name}"')
    try:
        p = pg_params()
        auth = p["USER"] + (f":{p['PASSWORD']}" if p["PASSWORD"] else "")
        _assert_charged_once(_run(["--postgres", f"postgresql://{auth}@{p['HOST']}:{p['PORT']}/{name}"]))
    finally:
        _admin_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
