# celery-idem: every set-up step is here, so a fresh machine needs only `make demo` / `make test`.

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
DOCS_STAMP := $(VENV)/.docs-installed

export PIP_DISABLE_PIP_VERSION_CHECK := 1
export PIP_NO_INPUT := 1

.DEFAULT_GOAL := help
.PHONY: help install demo test lint docs bench celery-suite celery-suite-ci clean

help:  ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | sed -E 's/:.*## /\t/'

# The virtualenv and the editable install, redone only when pyproject.toml changes.
$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -e '.[dev]'
	@touch $@

install: $(STAMP)  ## create .venv and install the package with its dev extras

demo: $(STAMP)  ## run the example app's demo (embedded SQLite default, no server needed)
	$(PY) -m example_app.demo

test: $(STAMP)  ## make sure the servers answer, then run the whole suite, ruff and mypy
	bash scripts/services.sh
	bash scripts/browser.sh
	rc=0; $(PY) -m pytest -q || rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make test: pytest collected no tests; that is a failure" >&2; fi; \
	exit $$rc
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy

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

clean:  ## remove the built site and the install stamps (keeps .venv)
	rm -rf site $(STAMP) $(DOCS_STAMP)
