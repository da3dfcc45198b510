"""Add-ons are found through entry point groups, a third-party package's as the bundled ones."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

from celery_idem.plugins import OBSERVERS, RECEIPTS, registered
from celery_idem.stores import STORES, supported_schemes

ROOT = Path(__file__).resolve().parents[2]


def test_the_bundled_add_ons_are_registered_in_the_groups() -> None:
    assert {"redis+cluster", "rediss+cluster", "sentinel", "django"} <= set(registered(STORES))
    assert set(registered(RECEIPTS)) >= {"sqlalchemy", "django"}
    assert "otel" in registered(OBSERVERS)
    assert {"sentinel://", "django://", "redis://", "memory://"} <= set(supported_schemes())


def test_a_third_party_store_and_observer_are_found_like_the_bundled_ones(tmp_path: Path) -> None:
    # A package installed beside celery_idem: its module and its dist-info's entry points
    (tmp_path / "acme_store.py").write_text(textwrap.dedent("""
        from celery_idem.stores.memory import MemoryStore
        LOADED = []

        class AcmeStore(MemoryStore):
            pass

        def observe(*args, **kwargs):
            LOADED.append(args)
    """))
    (tmp_path / "acme_observer.py").write_text(
        "from celery_idem.events import add_observer\nimport acme_store\n"
        "add_observer(acme_store.observe)\n")
    info = tmp_path / "acme_store-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: acme-store\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(
        "[celery_idem.stores]\nacme = acme_store:AcmeStore\n\n"
        "[celery_idem.observers]\nacme = acme_observer\n")
    code = ("import celery_idem.app, celery_idem.events as events, acme_store\n"
            "from celery_idem.stores import store_from_url\n"
            "store = store_from_url('acme://', prefix='p:')\n"
            "print(type(store).__name__, acme_store.observe in events.OBSERVERS)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["AcmeStore", "True"]
