"""The built wheel, installed with each extra into a fresh virtualenv, runs a real worker.

Caught before: ``[redis]`` did not bring ``celery[redis]``, so kombu's Redis transport died on
``import packaging`` in a fresh venv. Each venv gets only the wheel and what its extra pulls
(``pip install`` from the index, or from ``CELERY_IDEM_WHEELHOUSE`` with ``--no-index`` when
set); pip's own cache keeps repeat runs fast. Select with ``-m packaging``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import uuid
import venv
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import REDIS_URL, require
from tests.integration.harness import ROOT, wait_for

pytestmark = [pytest.mark.packaging, pytest.mark.worker]

#: An app that only the installed wheel can serve: a Redis (or SQLite) broker and store.
APP = """\
import os
from celery import Celery
from celery_idem import IdempotentTask

app = Celery("wheelapp", broker=os.environ["WB"], backend=os.environ["WR"])
app.conf.update(task_default_queue=os.environ["WQ"], idempotency_key_prefix=os.environ["WP"],
                broker_connection_retry_on_startup=True)

@app.task(base=IdempotentTask, bind=True)
def double(self, x):
    return 2 * x
"""


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    # From a copy of what the sdist holds: setuptools builds in the source tree, and stale
    # build/ or *.egg-info files of the checkout must neither leak into the wheel nor be left.
    src = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy2(ROOT / name, src / name)
    shutil.copytree(ROOT / "celery_idem", src / "celery_idem",
                    ignore=shutil.ignore_patterns("__pycache__"))
    # --no-deps: this package only, in pip's isolated build environment (the setuptools
    # pyproject.toml asks for, from pip's cache after the first run).
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(out),
                    str(src)], check=True, timeout=300, env=_fresh_env())
    (found,) = out.glob("celery_idem-*.whl")
    return found


def _fresh_env() -> dict[str, str]:
    """This process's environment without what would let the checkout or another venv in."""
    return {k: v for k, v in os.environ.items()
            if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME") and not k.startswith("PIP_")}


def _venv(where: Path, requirement: str) -> Path:
    venv.EnvBuilder(with_pip=True, clear=True).create(where)
    py = where / "bin" / "python"
    cmd = [str(py), "-m", "pip", "install", "-q", "--disable-pip-version-check", requirement]
    house = os.environ.get("CELERY_IDEM_WHEELHOUSE")
    if house:
        cmd[5:5] = ["--no-index", "--find-links", house]
    subprocess.run(cmd, check=True, timeout=600, env=_fresh_env(), cwd=where)
    return py


@pytest.fixture
def workdir(tmp_path: Path) -> Iterator[Path]:
    (tmp_path / "wheelapp.py").write_text(APP)
    yield tmp_path


def _run_worker(py: Path, workdir: Path, env: dict[str, str]) -> None:
    """Start ``celery worker`` from the venv (not this checkout), send a task, get its result."""
    env = {**_fresh_env(), **env}
    log = (workdir / "worker.log").open("w")
    proc = subprocess.Popen([str(py), "-m", "celery", "-A", "wheelapp", "worker", "-P", "solo",
                             "-l", "INFO", "--without-gossip", "--without-mingle"],
                            cwd=workdir, env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        def ready() -> bool:
            text = (workdir / "worker.log").read_text()
            assert proc.poll() is None, f"the worker exited:\n{text[-3000:]}"
            return " ready." in text
        wait_for(ready, timeout=60, what="the worker from the fresh venv")
        client = ("from wheelapp import double\nimport celery_idem, sys\n"
                  "assert 'site-packages' in celery_idem.__file__, celery_idem.__file__\n"
                  "r1 = double.delay(21); v1 = r1.get(timeout=30)\n"
                  "r2 = double.delay(21)  # done: answered from the record\n"
                  "print(v1, r2.get(timeout=30), r1.id == r2.id)\n")
        out = subprocess.run([str(py), "-c", client], cwd=workdir, env=env, capture_output=True,
                             text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        assert out.stdout.split() == ["42", "42", "True"]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 15)
            proc.wait(30)
        log.close()


def test_the_redis_extra_runs_a_redis_broker_worker(
    wheel: Path, workdir: Path, tmp_path_factory: pytest.TempPathFactory,
) -> None:
    require(REDIS_URL, 6379, "Redis")
    py = _venv(tmp_path_factory.mktemp("venv-redis"), f"celery-idem[redis] @ {wheel.as_uri()}")
    tag = uuid.uuid4().hex[:10]
    base = REDIS_URL.rstrip("/") + "/0"
    _run_worker(py, workdir, {"WB": base, "WR": base, "WQ": f"wheel-{tag}", "WP": f"wheel-{tag}:"})


# A fresh venv's install (pip's own bound is 600 s), a worker and the demo (about a minute): the
# suite's 300 s per test was overrun on a loaded 2-core machine once [tools] joined the install.
@pytest.mark.timeout(900)
def test_the_sql_and_tools_extras_run_an_sqlite_worker_and_the_demo(
    wheel: Path, workdir: Path, tmp_path_factory: pytest.TempPathFactory,
) -> None:
    py = _venv(tmp_path_factory.mktemp("venv-sql"), f"celery-idem[sql,tools] @ {wheel.as_uri()}")
    db = workdir / "db.sqlite"
    _run_worker(py, workdir, {"WB": f"sqla+sqlite:///{db}", "WR": f"db+sqlite:///{db}",
                              "WQ": "wheel", "WP": "wheel:"})
    # What `make demo` installs (.[sql,tools]) is all the demo needs: run it from that venv
    clean = {k: v for k, v in _fresh_env().items() if not k.startswith(("CELERY_", "EXAMPLE_"))}
    out = subprocess.run([str(py), "-m", "example_app.demo", "--quiet"], cwd=ROOT, env=clean,
                         capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "PASS in" in out.stdout
