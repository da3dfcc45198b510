"""The conformance run: Celery's own integration tests with plain Task and with IdempotentTask.

    python scripts/celery_suite.py                 # full run (make celery-suite)
    python scripts/celery_suite.py --subset        # CI subset (make celery-suite-ci)

Steps:

1. ``pip download --no-deps --no-binary :all: celery==<installed version>`` into
   ``.celery-suite/`` (git-ignored, kept between runs) and unpack its ``t/`` and
   ``pyproject.toml`` (Celery's pytest settings: strict markers, strict xfail).
2. Start a private ``redis-server`` on a free port (no persistence), used as broker and backend.
3. Run ``t/integration/test_tasks.py`` and ``t/integration/test_canvas.py`` twice, each on a
   freshly started Redis: ``plain`` (Celery's default Task) and ``idem``
   (``Celery(task_cls="celery_idem:IdempotentTask")``, injected by
   ``tests/conformance/celery_suite_plugin.py``). Every test has a timeout
   (``--timeout``, default 60 s; see the plugin) and each run a wall-clock limit (``--wall``).
4. ``tests/conformance/compare.py`` writes ``.celery-suite/out/diff.json`` (test id -> plain
   outcome, idem outcome, classification) and ``diff.md``; with ``--check`` (the subset does
   this) it fails on any difference that ``tests/conformance/by_design.txt`` does not allow.

The Redis server is stopped at the end, also on errors and Ctrl-C. Exit status: 0 when the run
completed (and, with ``--check``, no unexpected difference), else non-zero.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORK = ROOT / ".celery-suite"
CONFORMANCE = ROOT / "tests" / "conformance"
FILES = ("t/integration/test_tasks.py", "t/integration/test_canvas.py")


def log(msg: str) -> None:
    print(f"[celery-suite {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def celery_version(python: str) -> str:
    out = subprocess.run([python, "-c", "import celery; print(celery.__version__)"],
                         check=True, capture_output=True, text=True, timeout=60)
    return out.stdout.strip()


def fetch_tests(python: str, version: str) -> Path:
    """Celery's test tree for ``version``, from the sdist (downloaded once)."""
    dest = WORK / f"celery-{version}"
    if (dest / "t" / "integration" / "conftest.py").exists():
        return dest
    dl = WORK / "dl"
    dl.mkdir(parents=True, exist_ok=True)
    sdist = dl / f"celery-{version}.tar.gz"
    if not sdist.exists():
        log(f"pip download celery=={version} (sdist)")
        subprocess.run([python, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                        f"celery=={version}", "-d", str(dl)], check=True, timeout=600)
    tmp = WORK / f"celery-{version}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    with tarfile.open(sdist) as tar:
        prefix = f"celery-{version}/"
        members = [m for m in tar.getmembers()
                   if m.name.startswith((prefix + "t/", prefix + "pyproject.toml"))]
        for m in members:
            m.name = m.name[len(prefix):]
        tar.extractall(tmp, members=members, filter="data")
    tmp.rename(dest)
    return dest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class PrivateRedis:
    """A redis-server of our own: a free port, no persistence, stopped by ``stop()``."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.proc: subprocess.Popen[bytes] | None = None
        self.port = 0

    def start(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.proc = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", str(self.workdir), "--logfile",
             str(self.workdir / f"redis-{self.port}.log")],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), 0.5) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        log(f"private redis-server pid {self.proc.pid} on port {self.port}")
                        return
            except OSError:
                pass
            if self.proc.poll() is not None:
                break
            time.sleep(0.1)
        self.stop()
        raise SystemExit(f"private redis-server did not start (see {self.workdir})")

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        log(f"private redis-server pid {self.proc.pid} stopped")


def run_mode(python: str, tests_dir: Path, mode: str, ids: list[str], out: Path, timeout: float,
             wall: float, redis: PrivateRedis, reference: Path | None = None) -> float:
    """One pytest run of Celery's integration tests; returns its wall-clock seconds."""
    redis.stop()
    redis.start()  # a fresh, empty server per mode: no record survives from the other run
    url = f"redis://127.0.0.1:{redis.port}/0"
    env = dict(os.environ)
    env.update(
        TEST_BROKER=url, TEST_BACKEND=url, REDIS_HOST="127.0.0.1", REDIS_PORT=str(redis.port),
        PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p),
        CELERY_IDEM_CONFORMANCE=mode, CELERY_IDEM_CONFORMANCE_OUT=str(out),
        CELERY_IDEM_CONFORMANCE_TIMEOUT=str(timeout), PYTHONDONTWRITEBYTECODE="1",
        CELERY_IDEM_CONFORMANCE_REFERENCE=str(reference or ""),
    )
    env.pop("CELERY_CONFIG_MODULE", None)
    cmd = [python, "-m", "pytest", "-p", "celery.contrib.pytest",
           "-p", "tests.conformance.celery_suite_plugin", "-p", "no:cacheprovider",
           "--timeout=600", "--timeout-method=thread", "-q", "-rfE", "--no-header", *ids]
    log_path = out.with_suffix(".log")
    out.unlink(missing_ok=True)
    log(f"{mode}: {len(ids)} paths/ids, per-test timeout {timeout:.0f} s, wall limit {wall:.0f} s, "
        f"log {log_path.relative_to(ROOT)}")
    started = time.monotonic()
    with open(log_path, "w") as fh:
        proc = subprocess.Popen(cmd, cwd=tests_dir, env=env, stdout=fh, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            rc = proc.wait(wall)
        except subprocess.TimeoutExpired:
            log(f"{mode}: wall limit reached; stopping pytest (pid {proc.pid})")
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                rc = proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                rc = proc.wait(30)
    seconds = time.monotonic() - started
    tail = log_path.read_text(errors="replace").strip().splitlines()[-1:] or ["(no output)"]
    log(f"{mode}: pytest exit {rc} after {seconds:.0f} s: {tail[0]}")
    if not out.exists():
        raise SystemExit(f"{mode}: pytest wrote no results ({out}); see {log_path}")
    return seconds


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--python", default=sys.executable, help="interpreter that has celery")
    ap.add_argument("--subset", action="store_true",
                    help="only the ids in tests/conformance/subset.txt, and --check")
    ap.add_argument("--check", action="store_true",
                    help="fail on a difference outside tests/conformance/by_design.txt")
    ap.add_argument("--timeout", type=float, default=60, help="per-test timeout, seconds")
    ap.add_argument("--wall", type=float, default=3600, help="per-run wall-clock limit, seconds")
    ap.add_argument("--modes", default="plain,idem",
                    help="runs to make, in order (idem alone compares with the last plain run)")
    ap.add_argument("-k", dest="ids", action="append", default=[],
                    help="a test id or path inside Celery's tree (repeatable)")
    args = ap.parse_args(argv)

    version = celery_version(args.python)
    tests_dir = fetch_tests(args.python, version)
    out_dir = WORK / ("out-ci" if args.subset else "out")
    out_dir.mkdir(parents=True, exist_ok=True)
    ids = list(args.ids)
    if args.subset:
        ids += [line.split("#")[0].strip() for line in
                (CONFORMANCE / "subset.txt").read_text().splitlines()
                if line.split("#")[0].strip()]
        args.check = True
    ids = ids or list(FILES)

    redis = PrivateRedis(WORK / "redis")
    durations: dict[str, float] = {}
    try:
        for mode in args.modes.split(","):
            # The idem run limits each test by its plain duration (see celery_suite_plugin.py).
            reference = out_dir / "plain.json" if mode == "idem" else None
            durations[mode] = run_mode(args.python, tests_dir, mode, ids, out_dir / f"{mode}.json",
                                       args.timeout, args.wall, redis, reference)
    finally:
        redis.stop()
    for mode, secs in durations.items():
        log(f"{mode} run: {secs:.0f} s")
    cmd = [args.python, str(CONFORMANCE / "compare.py"), str(out_dir / "plain.json"),
           str(out_dir / "idem.json"), "--json", str(out_dir / "diff.json"),
           "--markdown", str(out_dir / "diff.md"), "--celery", version]
    if args.check:
        cmd.append("--check")
    if args.subset:
        cmd += ["--only", *ids]
    return subprocess.run(cmd, timeout=120).returncode


if __name__ == "__main__":
    sys.exit(main())
