#!/usr/bin/env bash
# The supported Python versions besides the main venv's: for each, a venv of its own under DIR
# (DIR/<X.Y>/, git-ignored), the package installed with the extras the tests below need, a check
# that `[dev]` resolves on that version (pip --dry-run), then `make test-fast`'s selection (the
# unit and in-process store tests, FAST_TESTS and FAST_MARKS, each path its own pytest process
# at once) and one real-worker smoke test (PYVER_SMOKE: a worker on the shared Redis). One line
# per version at the end: the interpreter, the install and test times, the pytest summaries.
#
# Usage: bash scripts/pythons.sh DIR "3.10 3.12 3.13"
# The interpreter for X.Y: pyenv's newest X.Y.* ($PYENV_ROOT, default ~/.pyenv), else pythonX.Y
# on PATH. A version with no interpreter fails in CI (CI=true) and is skipped elsewhere.
# A venv is reinstalled when pyproject.toml is newer than its stamp. PYVER_DEV_CHECK=0 leaves out
# the [dev] resolution (it asks the package index, 5-25 s a version).
# Exit status 0 only when every version passes (pytest's "no tests collected" is a failure).
set -uo pipefail

dir="$1"; versions="$2"
fast_tests="${FAST_TESTS:-tests/unit tests/stores}"
fast_marks="${FAST_MARKS:-not server and not worker and not slow}"
smoke="${PYVER_SMOKE:-tests/integration/test_worker_redis.py::test_first_attempt_claims_runs_once_and_records}"
root="${PYENV_ROOT:-$HOME/.pyenv}"
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1

# What the selected tests import: the Redis and SQL stores and their drivers, the Django store of
# the contract tests, pydantic for the codec tests; not the whole [dev] set (agent frameworks,
# browsers' drivers, linters), which only the resolution check below looks at.
install_args=(-e '.[redis,sql,django]' 'psycopg[binary]>=3.1' 'pymysql>=1.1' 'pytest>=8'
              'pytest-timeout>=2.3' 'pydantic>=2')

in_ci() { case "${CI:-}" in 1 | true | TRUE | True | yes) return 0 ;; *) return 1 ;; esac; }

find_python() {
    local v="$1" p
    p="$(ls -d "$root"/versions/"$v".*/bin/python 2>/dev/null \
        | grep -E "/versions/$v\.[0-9]+/bin/python$" | sort -V | tail -n 1)"
    if [ -z "$p" ]; then p="$(command -v "python$v" 2>/dev/null || true)"; fi
    if [ -n "$p" ] && [ "$("$p" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null)" = "$v" ]; then
        echo "$p"
    fi
}

summary_of() {  # the pytest summary line of a log, without its ===
    grep -E '^(=+ )?[0-9]+ [a-z]+.* in [0-9.]+s' "$1" | tail -n 1 | sed -E 's/^=+ //; s/ =+$//'
}

# One version: its report line in DIR/<v>/report, its exit status in DIR/<v>/rc.
run_one() {
    local v="$1" venv="$dir/$1" base python py t0 t_install t_tests rc=0 i pids=() n status
    local report="$dir/$v/report"
    mkdir -p "$venv"
    python="$(find_python "$v")"
    if [ -z "$python" ]; then
        if in_ci; then
            echo "python $v  FAILED: no interpreter (pyenv $root/versions/$v.*, or python$v on PATH)" >"$report"
            echo 1 >"$venv/rc"
        else
            echo "python $v  skipped: no interpreter (pyenv $root/versions/$v.*, or python$v on PATH)" >"$report"
            echo 0 >"$venv/rc"
        fi
        return
    fi
    py="$venv/bin/python"
    echo "== test-pythons: $v ($python)"
    t0=$SECONDS
    if [ ! -f "$venv/.installed" ] || [ pyproject.toml -nt "$venv/.installed" ] || ! "$py" -c '' 2>/dev/null; then
        rm -rf "$venv"
        "$python" -m venv "$venv" && "$py" -m pip install -q "${install_args[@]}" || {
            echo "python $v  FAILED: install (see above)" >"$report"; echo 1 >"$venv/rc"; return; }
        touch "$venv/.installed"
    fi
    if [ "${PYVER_DEV_CHECK:-1}" != 0 ]; then
        # [dev] must install on every supported version: the parts that need a newer Python
        # carry an environment marker (pyproject.toml).
        if ! "$py" -m pip install -q --dry-run -e '.[dev]' >"$venv/dev-check.log" 2>&1; then
            grep -v '^WARNING: Location' "$venv/dev-check.log" | tail -n 5
            echo "python $v  FAILED: '.[dev]' does not resolve on $v" >"$report"; echo 1 >"$venv/rc"; return
        fi
    fi
    t_install=$((SECONDS - t0))
    t0=$SECONDS
    # The fast tier as `make test-fast` runs it: each path its own pytest process, all at once,
    # temporary files on tmpfs when there is one; then the smoke test.
    base=$( [ -d /dev/shm ] && [ -w /dev/shm ] && echo /dev/shm || echo "${TMPDIR:-/tmp}" )
    tmp="$(mktemp -d "$base/celery-idem-py$v.XXXXXX")"
    i=0
    for t in $fast_tests; do
        i=$((i + 1))
        "$py" -m pytest -q -p no:cacheprovider --basetemp="$tmp/$i" -m "$fast_marks" "$t" \
            >"$venv/pytest-$i.log" 2>&1 &
        pids+=($!)
    done
    for p in "${pids[@]}"; do wait "$p" || rc=1; done
    "$py" -m pytest -q -p no:cacheprovider --basetemp="$tmp/smoke" "$smoke" >"$venv/pytest-smoke.log" 2>&1 || rc=1
    rm -rf "$tmp"
    t_tests=$((SECONDS - t0))
    n=0
    for t in $fast_tests smoke; do
        n=$((n + 1))
        log="$venv/pytest-$n.log"; [ "$t" = smoke ] && log="$venv/pytest-smoke.log"
        echo "== test-pythons $v: pytest $t"
        cat "$log"
    done
    if [ "$rc" -eq 0 ]; then status=passed; else status=FAILED; fi
    {
        printf 'python %-5s %-7s install %3d s, tests %3d s  [%s]\n' "$v" "$status" "$t_install" "$t_tests" \
            "$("$py" -c 'import sys, celery; print(f"Python {sys.version.split()[0]}, celery {celery.__version__}")')"
        i=0
        for t in $fast_tests; do
            i=$((i + 1)); printf '    %-16s %s\n' "$t" "$(summary_of "$venv/pytest-$i.log")"
        done
        printf '    %-16s %s\n' "smoke" "$(summary_of "$venv/pytest-smoke.log")"
    } >"$report"
    echo "$rc" >"$venv/rc"
}

failed=0
for v in $versions; do
    rm -f "$dir/$v/report" "$dir/$v/rc"
    run_one "$v"
done

echo "== test-pythons summary"
for v in $versions; do
    if [ -f "$dir/$v/report" ]; then
        cat "$dir/$v/report"
        [ "$(cat "$dir/$v/rc" 2>/dev/null)" = 0 ] || failed=1
    else
        echo "python $v  no report (the run did not finish)"; failed=1
    fi
done
exit "$failed"
