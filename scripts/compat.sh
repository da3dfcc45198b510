#!/usr/bin/env bash
# Run a test subset once per supported Celery version, each in its own venv (made by
# `make test-compat` under DIR/celery-<version>/), and print one line per version:
# the celery/kombu/redis versions installed, the pytest summary and the wall time.
#
# Usage: bash scripts/compat.sh DIR "5.4.0 5.5.3 ..." TEST_PATH...
# Exit status 0 only when every version passes (pytest's "no tests collected" is a failure).
set -uo pipefail

dir="$1"; versions="$2"; shift 2
report="$(mktemp)"
trap 'rm -f "$report"' EXIT
failed=0

for v in $versions; do
    py="$dir/celery-$v/bin/python"
    stack="$("$py" -c 'import celery, kombu, redis, sqlalchemy; print(f"celery {celery.__version__}, kombu {kombu.__version__}, redis-py {redis.__version__}, SQLAlchemy {sqlalchemy.__version__}")')"
    echo "== test-compat: $stack"
    log="$dir/celery-$v/pytest.log"
    start=$SECONDS
    "$py" -m pytest -q -p no:cacheprovider "$@" 2>&1 | tee "$log"
    rc=${PIPESTATUS[0]}
    took=$((SECONDS - start))
    summary="$(grep -E '^(=+ )?[0-9]+ [a-z]+.* in [0-9.]+s' "$log" | tail -n 1 | sed -E 's/^=+ //; s/ =+$//')"
    if [ "$rc" -eq 0 ]; then status=passed; else status="FAILED (pytest exit $rc)"; failed=1; fi
    printf 'celery %-6s %-9s %4d s  %s  [%s]\n' "$v" "$status" "$took" "$summary" "$stack" >>"$report"
done

echo "== test-compat summary"
cat "$report"
exit "$failed"
