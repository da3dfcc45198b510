"""Without OpenTelemetry installed, celery_idem imports none of it and calls none of it."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.integration.harness import ROOT


def test_without_opentelemetry_installed_nothing_is_imported_or_called() -> None:
    # A process where the opentelemetry package cannot be imported, deciding in eager mode
    code = """
import sys
sys.modules["opentelemetry"] = None  # as if not installed
from celery import Celery
from celery_idem import IdempotentTask
from celery_idem.contrib import otel
app = Celery("x", set_as_current=False)
app.conf.task_always_eager = True
app.conf.idempotency_store = "memory://"
@app.task(base=IdempotentTask, bind=True, shared=False)
def t(self, x):
    return x
t.delay(1); t.delay(1); t.apply((1,))
assert otel.ENABLED is False
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         timeout=60, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
