"""Fixtures: the integration tests' real workers (Redis) plus a real payments provider process."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from example_app.demo import start_provider, stop
from example_app.payments import ProviderClient
from tests.integration.conftest import cluster, make_cluster  # noqa: F401  (fixtures)


@pytest.fixture
def provider(tmp_path: Path) -> Iterator[ProviderClient]:
    """``python -m example_app.payments serve`` on a free port, its own SQLite database."""
    proc: subprocess.Popen[str]
    proc, url = start_provider(f"sqlite:///{tmp_path}/provider.sqlite", "", tmp_path / "provider.log")
    try:
        yield ProviderClient(url, timeout=10, retries=0)
    finally:
        stop(proc)
