#!/usr/bin/env bash
# Run a test subset once per supported Celery version, each in its own venv (made by
# `make test-compat` under DIR/celery-<version>/), and print one line per version:
# the celery/kombu/redis versions installed, the pytest summary and the wall time.
#
# Usage: bash scripts/compat.sh DIR "5.4.0 5.5.3 ..." TEST_PATH...
# Exit status 0 only when every version passes (pytest's "no tests collected" is a failure).
#
# The first version listed (the oldest: oldest kombu, redis-py and SQLAlchemy of the set) runs every
# selected test. The others leave out the tests marked `celery_independent` (SQL and in-process
# store tests, and the unit tests of the package's source and of its pure functions: no Celery,
# kombu or redis-py code runs in them), which would repeat the first version's run or the main
# suite's on the same SQLAlchemy and drivers: 471 tests, 106 s of the 1,078 s of test time on
# 5.4.0 (measured with --durations on a loaded machine). Everything that goes through Celery,
# kombu or redis-py (the task seam, apply_async and the enqueue check, signals, canvas, results
# and backends, the Redis stores, real workers, time limits, redelivery, events) runs on every
# version; the real-worker integration tests are 876 s of those 1,078. COMPAT_EVERY_TEST=1 runs
# every selected test on every version.
# COMPAT_JOBS=N (default 1) runs up to N versions at once; each log is printed when it ends.
# COMPAT_WORKERS=N (default 0) runs each version's pytest in N pytest-xdist workers, each test
# file whole on one of them (--dist loadfile, as `make test`); a venv made before its install
# listed pytest-xdist gets it here.
set -uo pipefail

dir="$1"; versions="$2"; shift 2
jobs="${COMPAT_JOBS:-1}"
workers="${COMPAT_WORKERS:-0}"
failed=0

# One version: its pytest log in DIR/celery-<v>/pytest.log, its summary line in .../report.
run_one() {
    local v="$1" first="$2"; shift 2
    local py="$dir/celery-$v/bin/python" log="$dir/celery-$v/pytest.log" marks=() xdist=() stack start rc
    if [ "$first" -eq 0 ] && [ "${COMPAT_EVERY_TEST:-0}" != 1 ]; then
        marks=(-m "not celery_independent")
    fi
    if [ "$workers" -gt 0 ]; then
        "$py" -c 'import xdist' 2>/dev/null || "$py" -m pip install -q 'pytest-xdist>=3.5'
        xdist=(-n "$workers" --dist loadfile)
    fi
    stack="$("$py" -c 'import celery, kombu, redis, sqlalchemy; print(f"celery {celery.__version__}, kombu {kombu.__version__}, redis-py {redis.__version__}, SQLAlchemy {sqlalchemy.__version__}")')"
    echo "== test-compat: $stack"
    start=$SECONDS
    if [ "$jobs" -gt 1 ]; then
        "$py" -m pytest -q -p no:cacheprovider "${xdist[@]}" "${marks[@]}" "$@" >"$log" 2>&1
        rc=$?
        echo "== test-compat: celery $v finished (pytest exit $rc); its log:"
        cat "$log"
    else
        "$py" -m pytest -q -p no:cacheprovider "${xdist[@]}" "${marks[@]}" "$@" 2>&1 | tee "$log"
        rc=${PIPESTATUS[0]}
    fi
    local took=$((SECONDS - start)) status
    local summary
    summary="$(grep -E '^(=+ )?[0-9]+ [a-z]+.* in [0-9.]+s' "$log" | tail -n 1 | sed -E 's/^=+ //; s/ =+$//')"
    if [ "$rc" -eq 0 ]; then status=passed; else status="FAILED (pytest exit $rc)"; fi
    printf 'celery %-6s %-9s %4d s  %s  [%s]\n' "$v" "$status" "$took" "$summary" "$stack" \
        >"$dir/celery-$v/report"
    echo "$rc" >"$dir/celery-$v/rc"
    return "$rc"
}

# COMPAT_JOBS=N runs up to N versions at once (each test isolates itself by key prefix, queue,
# table rows and private servers on free ports, as when several suites share one machine).
first=1
pids=()
for v in $versions; do
    rm -f "$dir/celery-$v/report" "$dir/celery-$v/rc"
    if [ "$jobs" -gt 1 ]; then
        while [ "$(jobs -rp | wc -l)" -ge "$jobs" ]; do wait -n || true; done
        run_one "$v" "$first" "$@" &
        pids+=($!)
    else
        run_one "$v" "$first" "$@" || true
    fi
    first=0
done
for pid in "${pids[@]}"; do wait "$pid" || true; done

echo "== test-compat summary"
for v in $versions; do
    if [ -f "$dir/celery-$v/report" ]; then
        cat "$dir/celery-$v/report"
        [ "$(cat "$dir/celery-$v/rc" 2>/dev/null)" = 0 ] || failed=1
    else
        echo "celery $v   no report (the run did not finish)"; failed=1
    fi
done
exit "$failed"
