#!/usr/bin/env python
"""Run the django_shop example end to end with one command.

    python example_app/django_shop/run.py                    # embedded SQLite (db.sqlite3)
    python example_app/django_shop/run.py --postgres postgresql://root@127.0.0.1:5432/shop

It migrates the database (celery_idem's tables included), starts a ``celery worker`` with two
processes, runs ``manage.py charge_twice`` (one order, its charge enqueued twice at once) and
stops the worker. The broker is Redis on 127.0.0.1:6379 unless ``CELERY_BROKER_URL`` says
otherwise. Expect both tasks to answer with the same result and ``charges=1``.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent  # the celery-idem checkout, for a run from a clone


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--postgres", metavar="URL", help="a PostgreSQL database URL (it must exist)")
    parser.add_argument("--sqlite", metavar="PATH", help="the SQLite file (default: db.sqlite3 here)")
    args = parser.parse_args()
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path}
    if args.postgres:
        env["DJANGO_SHOP_DATABASE"] = args.postgres
    if args.sqlite:
        env["DJANGO_SHOP_SQLITE"] = args.sqlite

    def manage(*argv: str) -> None:
        subprocess.run([sys.executable, "manage.py", *argv], cwd=HERE, env=env, check=True)

    manage("migrate", "-v", "0")
    log = Path(tempfile.mkstemp(prefix="django-shop-worker-", suffix=".log")[1])
    print(f"worker log: {log}")
    with log.open("w") as out:
        worker = subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "django_shop", "worker", "-c", "2", "-l", "INFO",
             "--without-gossip", "--without-mingle", "--without-heartbeat"],
            cwd=HERE, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while " ready." not in log.read_text(errors="replace"):
            if worker.poll() is not None or time.monotonic() > deadline:
                print(log.read_text(errors="replace")[-3000:], file=sys.stderr)
                return 1
            time.sleep(0.2)
        manage("charge_twice")
    finally:
        os.killpg(worker.pid, signal.SIGTERM)
        worker.wait(30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
