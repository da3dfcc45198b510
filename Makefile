# celery-idem: every set-up step is here, so a fresh machine needs only `make demo` / `make test`.

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
DOCS_STAMP := $(VENV)/.docs-installed
DEMO_STAMP := $(VENV)/.demo-installed
DEMO_ARGS  ?=

export PIP_DISABLE_PIP_VERSION_CHECK := 1
export PIP_NO_INPUT := 1

.DEFAULT_GOAL := help
.PHONY: help install demo demo-mcp test test-compat lint docs bench celery-suite celery-suite-ci clean

help:  ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | sed -E 's/:.*## /\t/'

# The virtualenv and the editable install, redone only when pyproject.toml changes.
$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -e '.[dev]'
	@touch $@

install: $(STAMP)  ## create .venv and install the package with its dev extras

# The demo needs the runtime only: the package with its [sql] extra (the embedded SQLite
# broker, backend and store go through SQLAlchemy). Not the dev set (browsers' drivers, linters).
$(DEMO_STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -e '.[sql]'
	@touch $@

demo: $(DEMO_STAMP)  ## run the example app's demo (embedded SQLite default, no server needed)
	$(PY) -m example_app.demo $(DEMO_ARGS)

demo-mcp: $(STAMP)  ## the example's tools over MCP: an MCP client's repeated calls, one charge
	$(PY) -m example_app.mcp_demo

# The docs toolchain too: tests/docs builds the site and opens it offline in Chromium.
test: $(STAMP) $(DOCS_STAMP)  ## make sure the servers answer, then run the whole suite, ruff and mypy
	bash scripts/services.sh
	bash scripts/browser.sh
	rc=0; $(PY) -m pytest -q || rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make test: pytest collected no tests; that is a failure" >&2; fi; \
	exit $$rc
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy

# Supported Celery minors (pyproject.toml: celery>=5.4): the latest patch of each, with the kombu
# of the same minor. Each gets its own venv under .compat/ (git-ignored), made from the checkout.
COMPAT_CELERY ?= 5.4.0 5.5.3 5.6.3 5.7.0
COMPAT_DIR    := .compat
# The unit and store tests, and the real-worker integration tests (Redis and SQL stores, canvas,
# crash redelivery, enqueue check, result writes, events): a few minutes per version on a shared
# 2-CPU machine. test_recovery.py times the broker, not the library (and waits ~100 s for the
# restore scan of kombu < 5.7), so it runs in `make test` only.
COMPAT_TESTS  ?= tests/unit tests/stores tests/integration \
	--ignore=tests/integration/test_recovery.py
minor = $(word 1,$(subst ., ,$(1))).$(word 2,$(subst ., ,$(1)))

$(COMPAT_DIR)/celery-%/.installed: pyproject.toml
	@test -x $(@D)/bin/python || $(PYTHON) -m venv $(@D)
	$(@D)/bin/python -m pip install -q 'celery[redis,sqlalchemy]==$*' 'kombu==$(call minor,$*).*'
	@# second step: pip keeps the redis-py that this kombu allows (one resolve of both backtracks)
	$(@D)/bin/python -m pip install -q -e '.[redis,sql]' 'psycopg[binary]>=3.1' 'pymysql>=1.1' \
	    'pytest>=8' 'pytest-timeout>=2.3' 'pydantic>=2'
	$(@D)/bin/python -m pip check
	@touch $@

test-compat: $(foreach v,$(COMPAT_CELERY),$(COMPAT_DIR)/celery-$(v)/.installed)  ## unit, store and worker tests on each supported Celery minor
	bash scripts/services.sh
	bash scripts/compat.sh $(COMPAT_DIR) '$(COMPAT_CELERY)' $(COMPAT_TESTS)

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

clean:  ## remove the built site and the install stamps (keeps .venv and .compat/)
	rm -rf site $(STAMP) $(DOCS_STAMP) $(DEMO_STAMP) $(COMPAT_DIR)/*/.installed
