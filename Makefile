# celery-idem: every set-up step is here, so a fresh machine needs only `make demo` / `make test`.

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
DOCS_STAMP := $(VENV)/.docs-installed
DEMO_STAMP := $(VENV)/.demo-installed
FAST_STAMP := $(VENV)/.fast-installed
DEMO_ARGS  ?=

export PIP_DISABLE_PIP_VERSION_CHECK := 1
export PIP_NO_INPUT := 1

.DEFAULT_GOAL := help
.PHONY: help install demo demo-mcp test test-fast test-plain test-compat test-pythons lint docs bench celery-suite celery-suite-ci clean

help:  ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | sed -E 's/:.*## /\t/'

# The virtualenv and the editable install, redone only when pyproject.toml changes.
$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -e '.[dev]'
	@touch $@

install: $(STAMP)  ## create .venv and install the package with its dev extras

# The demo needs the runtime only: the package with its [sql] extra (the embedded SQLite
# broker, backend and store go through SQLAlchemy) and its [tools] extra (the agent's tools).
# Not the dev set (browsers' drivers, linters).
$(DEMO_STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -e '.[sql,tools]'
	@touch $@

demo: $(DEMO_STAMP)  ## run the example app's demo (embedded SQLite default, no server needed)
	$(PY) -m example_app.demo $(DEMO_ARGS)

demo-mcp: $(STAMP)  ## the example's tools over MCP: an MCP client's repeated calls, one charge
	$(PY) -m example_app.mcp_demo

# The docs toolchain too: tests/docs builds the site and opens it offline in Chromium.
# TEST_JOBS pytest-xdist workers, each test file whole on one of them (--dist loadfile: a file's
# module fixtures, servers and apps are set up once). Most tests wait on real workers, servers,
# leases and subprocesses rather than compute, so 3 workers on 2 CPUs still shorten the run;
# every test isolates itself (own prefix, queue, table, free port) as on a shared machine.
# TEST_JOBS=0 runs it in one process.
TEST_JOBS ?= 3
test: $(STAMP) $(DOCS_STAMP)  ## make sure the servers answer, then run the whole suite, ruff and mypy
	bash scripts/services.sh
	bash scripts/browser.sh
	@# --durations: the 30 slowest steps in the log, to keep CI's wall time in view (docs/contributing.md)
	rc=0; $(PY) -m pytest -q -n $(TEST_JOBS) --dist loadfile --durations=30 || rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make test: pytest collected no tests; that is a failure" >&2; fi; \
	exit $$rc
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy

# The fast tier: the unit tests and the store tests on the in-process stores (memory, SQLite).
# No server is started or needed: tests marked `server` (tests/conftest.py marks every test whose
# fixtures reach Redis, PostgreSQL, MariaDB, RabbitMQ or a private redis-server) are deselected,
# not skipped, and so are real workers and the slow groups. Under 30 s; `make test` stays the
# whole suite. Each path of FAST_TESTS is its own pytest process, all at once: the store tests
# mostly wait (leases and TTLs running out), the unit tests mostly compute, so on 2 cores the
# tier takes as long as its longer half (23-25 s instead of 29-31 s in one process, measured at a
# load average near 1 on 2 cores).
# Temporary files (the SQLite databases) go to tmpfs when there is one: a commit's fsync on a
# busy disk costs more than the test. The logs are printed when all are done, in order.
FAST_TESTS ?= tests/unit tests/stores
FAST_MARKS ?= not server and not worker and not slow
# The venv for it: the package's [test] extra only (no agent framework, browser driver or linter),
# unless `make install` put the whole [dev] set there already. --no-compile: the tests import a
# small part of what is installed, and Python compiles that on first import (pip's compile of
# every file took a third of the install).
$(FAST_STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@if [ $(STAMP) -nt pyproject.toml ]; then :; else $(PY) -m pip install -q --no-compile -e '.[test]'; fi
	@touch $@

test-fast: $(FAST_STAMP)  ## unit + in-process store tests (memory, SQLite): no servers, about 40 s (1 min with the venv's set-up)
	@base=$$( [ -d /dev/shm ] && [ -w /dev/shm ] && echo /dev/shm || echo "$${TMPDIR:-/tmp}" ); \
	tmp=$$(mktemp -d "$$base/celery-idem-fast.XXXXXX"); pids=""; i=0; \
	for t in $(FAST_TESTS); do \
	    i=$$((i + 1)); \
	    $(PY) -m pytest -q -p no:cacheprovider --basetemp="$$tmp/$$i" -m '$(FAST_MARKS)' "$$t" \
	        >"$$tmp/$$i.log" 2>&1 & pids="$$pids $$!"; \
	done; \
	rc=0; for p in $$pids; do wait $$p || rc=1; done; \
	for n in $$(seq 1 $$i); do echo "== pytest $$(echo $(FAST_TESTS) | cut -d' ' -f$$n)"; cat "$$tmp/$$n.log"; done; \
	rm -rf "$$tmp"; exit $$rc

# Every acceleration off (CELERY_IDEM_ACCELERATE=0, see celery_idem/paths.py): each store through its
# plain path only (redis-py's scripts, SQLAlchemy's Connection, the enqueue check read first) must
# pass the same tests. test-fast's unit tests, and the store tests on every server (Redis,
# PostgreSQL, MariaDB: no `not server` filter), not the slow groups; the two pytest runs at once,
# as in test-fast. The accelerations' own tests (tests/stores/test_redis_wire.py,
# test_sql_psycopg.py) skip.
PLAIN_MARKS ?= not worker and not slow
test-plain: $(STAMP)  ## the fast tier and the store tests on the servers, with every acceleration off
	bash scripts/services.sh
	@tmp=$$(mktemp -d "$${TMPDIR:-/tmp}/celery-idem-plain.XXXXXX"); \
	CELERY_IDEM_ACCELERATE=0 $(PY) -m pytest -q -p no:cacheprovider --basetemp="$$tmp/unit" \
	    -m '$(FAST_MARKS)' tests/unit >"$$tmp/unit.log" 2>&1 & unit=$$!; \
	CELERY_IDEM_ACCELERATE=0 $(PY) -m pytest -q -p no:cacheprovider --basetemp="$$tmp/stores" \
	    -m '$(PLAIN_MARKS)' tests/stores >"$$tmp/stores.log" 2>&1 & stores=$$!; \
	rc=0; wait $$unit || rc=1; wait $$stores || rc=1; \
	echo "== pytest tests/unit (CELERY_IDEM_ACCELERATE=0)"; cat "$$tmp/unit.log"; \
	echo "== pytest tests/stores (CELERY_IDEM_ACCELERATE=0)"; cat "$$tmp/stores.log"; \
	rm -rf "$$tmp"; exit $$rc

# Supported Celery minors (pyproject.toml: celery>=5.4): the latest patch of each, with the kombu
# of the same minor. Each gets its own venv under .compat/ (git-ignored), made from the checkout.
COMPAT_CELERY ?= 5.4.0 5.5.3 5.6.3 5.7.0
COMPAT_DIR    := .compat
# The unit and store tests, and the real-worker integration tests (Redis and SQL stores, canvas,
# crash redelivery, enqueue check, result writes, events): a few minutes per version on a shared
# 2-CPU machine. test_recovery.py times the broker, not the library (and waits ~100 s for the
# restore scan of kombu < 5.7), so it runs in `make test` only. The tests marked
# `celery_independent` (SQL and in-process store tests, and the unit tests that read only the
# package's source or its pure functions) run on the first version listed only (scripts/compat.sh;
# COMPAT_EVERY_TEST=1 runs them on all). COMPAT_JOBS=N runs N versions at once.
# COMPAT_WORKERS=N runs each version in N pytest-xdist workers (--dist loadfile, as `make test`);
# 0, the default, in one process. The integration tests are four fifths of a version's test time
# and mostly wait on workers, time limits and relay polls (one process uses a third of a CPU):
# two workers split 5.4.0's 1,078 s of test time 531 s / 548 s, and the three older minors at
# once (COMPAT_JOBS=3) take about 1.5 min less, but the time-limit tests, whose limits are a few
# seconds, then run on a busier machine.
COMPAT_JOBS    ?= 1
COMPAT_WORKERS ?= 0
COMPAT_TESTS  ?= tests/unit tests/stores tests/integration \
	--ignore=tests/integration/test_recovery.py
minor = $(word 1,$(subst ., ,$(1))).$(word 2,$(subst ., ,$(1)))

# --no-compile, as for test-fast's venv: the tests import a small part of what is installed
# (7 of 27 s of pip's CPU time for 5.5.3's venv went to compiling the rest).
$(COMPAT_DIR)/celery-%/.installed: pyproject.toml
	@test -x $(@D)/bin/python || $(PYTHON) -m venv $(@D)
	$(@D)/bin/python -m pip install -q --no-compile 'celery[redis,sqlalchemy]==$*' 'kombu==$(call minor,$*).*'
	@# second step: pip keeps the redis-py that this kombu allows (one resolve of both backtracks)
	$(@D)/bin/python -m pip install -q --no-compile -e '.[redis,sql]' 'psycopg[binary]>=3.1' 'pymysql>=1.1' \
	    'pytest>=8' 'pytest-timeout>=2.3' 'pytest-xdist>=3.5' 'pydantic>=2'
	$(@D)/bin/python -m pip check
	@touch $@

test-compat: $(foreach v,$(COMPAT_CELERY),$(COMPAT_DIR)/celery-$(v)/.installed)  ## unit, store and worker tests on each supported Celery minor
	bash scripts/services.sh
	COMPAT_JOBS=$(COMPAT_JOBS) COMPAT_WORKERS=$(COMPAT_WORKERS) bash scripts/compat.sh $(COMPAT_DIR) '$(COMPAT_CELERY)' $(COMPAT_TESTS)

# Supported Python versions (requires-python >= 3.10) besides the main venv's 3.11: on each,
# test-fast's selection (FAST_TESTS, FAST_MARKS) and one real-worker smoke test (PYVER_SMOKE, a
# worker on the shared Redis), in a venv per version under .pyver/ (git-ignored) with the extras
# those tests need, after a check that `.[dev]` resolves on that version (pip --dry-run; the
# parts that need a newer Python carry environment markers). The interpreter is pyenv's newest
# X.Y.* ($$PYENV_ROOT, default ~/.pyenv), else pythonX.Y on PATH. Measured on a 2-CPU machine
# (pip's cache warm): 24-37 s of venv, install and [dev] check per version, 17-23 s of tests;
# 2.5 min for the three from a fresh clone, about 1.5 min with the venvs there.
PYVERS      ?= 3.10 3.12 3.13
PYVER_DIR   := .pyver
PYVER_SMOKE ?= tests/integration/test_worker_redis.py::test_first_attempt_claims_runs_once_and_records
test-pythons:  ## test-fast's selection and a real-worker smoke test on Python 3.10, 3.12 and 3.13
	bash scripts/services.sh
	FAST_TESTS='$(FAST_TESTS)' FAST_MARKS='$(FAST_MARKS)' PYVER_SMOKE='$(PYVER_SMOKE)' \
	    bash scripts/pythons.sh $(PYVER_DIR) '$(PYVERS)'

lint: $(STAMP)  ## ruff and mypy only
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy

$(DOCS_STAMP): docs/requirements.txt $(STAMP)
	$(PY) -m pip install -r docs/requirements.txt
	@touch $@

docs: $(DOCS_STAMP)  ## build the documentation site into site/ (strict: warnings fail)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

bench: $(STAMP)  ## run the benchmarks
	$(PY) -m bench

celery-suite: $(STAMP)  ## conformance run: Celery's test_tasks.py + test_canvas.py, plain Task vs IdempotentTask
	$(PY) scripts/celery_suite.py

celery-suite-ci: $(STAMP)  ## the conformance subset (tests/conformance/subset.txt); fails on an unlisted difference
	$(PY) scripts/celery_suite.py --subset

clean:  ## remove the built site and the install stamps (keeps .venv, .compat/ and .pyver/)
	rm -rf site $(STAMP) $(DOCS_STAMP) $(DEMO_STAMP) $(FAST_STAMP) $(COMPAT_DIR)/*/.installed $(PYVER_DIR)/*/.installed
