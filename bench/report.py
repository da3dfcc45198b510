"""Tables (Markdown pipe tables: readable on a terminal, rendered in the docs) and the machine."""

from __future__ import annotations

import datetime as dt
import os
import platform
import subprocess
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

from celery_idem.config import ACCELERATE_ENV, accelerate_switch

ROOT = Path(__file__).resolve().parents[1]


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    cells = [[str(h) for h in headers]] + [[_cell(v) for v in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    numeric = [all(_is_num(r[i]) for r in cells[1:]) and len(cells) > 1 for i in range(len(headers))]

    def line(r: list[str]) -> str:
        return "| " + " | ".join(c.rjust(w) if num else c.ljust(w)
                                 for c, w, num in zip(r, widths, numeric, strict=True)) + " |"

    sep = "|" + "|".join(("-" * (w + 1) + ":") if num else ("-" * (w + 2))
                         for w, num in zip(widths, numeric, strict=True)) + "|"
    return "\n".join([line(cells[0]), sep, *(line(r) for r in cells[1:])])


def _cell(v: Any) -> str:
    if v is None:
        return "n/a"
    if isinstance(v, float):
        return f"{v:,.0f}" if abs(v) >= 100 else f"{v:.2f}" if abs(v) < 10 else f"{v:.1f}"
    return str(v)


def _is_num(s: str) -> bool:
    return s.replace(",", "").replace(".", "").replace("-", "").replace("x", "").isdigit() or s == "n/a"


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"


#: What the scaled CPU figures assume: a core that runs :func:`cpu_reference_ms`'s loop in this
#: many ms (a recent desktop or server core; the figures scale roughly with it).
REFERENCE_MS = 150.0


def cpu_reference_ms(reps: int = 5) -> float:
    """This thread's CPU ms for ``sum(range(10**7))``, median of ``reps``: how fast this machine
    runs plain Python, so absolute µs figures can be read against another machine's."""
    import statistics
    import time

    times = []
    for _ in range(reps):
        t0 = time.thread_time()
        sum(range(10**7))
        times.append((time.thread_time() - t0) * 1e3)
    return statistics.median(times)


def machine(redis_client: Any, pg_version: str | None, cpu_ref_ms: float | None = None) -> dict[str, str]:
    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        git = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=ROOT, capture_output=True,
                             text=True, timeout=10).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        git = "unknown"
    info = redis_client.info("server")
    try:
        from redis.utils import HIREDIS_AVAILABLE as hiredis
    except ImportError:
        hiredis = False
    return {
        "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "nproc": str(os.cpu_count()),
        "cpu": cpu,
        "CPU speed: `sum(range(10**7))`, thread CPU": (
            f"{cpu_ref_ms:.0f} ms" if cpu_ref_ms is not None else "not measured"),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "celery": _version("celery"),
        "kombu": _version("kombu"),
        "redis-py": _version("redis"),
        "redis-py parser": "hiredis" if hiredis else "pure Python (hiredis not installed)",
        "redis server": str(info.get("redis_version")),
        "SQLAlchemy": _version("SQLAlchemy"),
        "psycopg": _version("psycopg"),
        "PostgreSQL server": pg_version or "not used",
        "celery-idem (git)": git,
        # The switch (config.accelerate_switch) for the in-process figures; the end-to-end rows measure
        # the "(accel off)" systems beside the default ones either way (their apps' setting), and
        # the PostgreSQL micro-bench times both paths in one run. CELERY_IDEM_ACCELERATE=0 turns
        # every system off.
        "accelerations (the fast paths)": (
            "on" if accelerate_switch() else f"off ({ACCELERATE_ENV}={os.environ.get(ACCELERATE_ENV, '')})"),
    }
