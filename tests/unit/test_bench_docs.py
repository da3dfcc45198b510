"""``python -m bench --write-docs`` keeps the section ``python -m bench.dbbackend`` measured."""

from __future__ import annotations

import pytest

from bench import cli

# No Celery, kombu or redis-py code runs here: make test-compat runs it on its first Celery only.
pytestmark = pytest.mark.celery_independent

PAGE = """# Benchmarks

## End to end: unique no-op tasks (500 per batch, 5 repetitions)

| a | b |

## End to end: PostgreSQL store against plain Celery with the database backend

| row | system | tasks/s (median) | ratio vs its plain base |
| x | IdempotentTask, result row folded into the record | 32 | **0.97** (0.91-1.04) |

## Targets

| target |
"""


def test_the_db_backend_section_is_carried_over_whole() -> None:
    kept = cli.kept_sections(PAGE)
    assert list(kept) == [cli.KEPT_SECTIONS[0]]
    section = kept[cli.KEPT_SECTIONS[0]]
    assert section.startswith("## End to end: PostgreSQL store")
    assert "**0.97** (0.91-1.04)" in section and "## Targets" not in section


def test_its_folded_ratio_becomes_a_target_row() -> None:
    row = cli._db_backend_row(cli.kept_sections(PAGE)[cli.KEPT_SECTIONS[0]])
    assert row is not None and row[1:] == [">= 0.95", "0.97 (0.91-1.04)", "met"]
    missed = cli._db_backend_row("| **0.62** (0.55-0.70) |")
    assert missed is not None and missed[-1] == "**MISSED**"
    assert cli._db_backend_row("no figures") is None
    assert cli.kept_sections("# nothing kept\n") == {}


def test_a_dated_section_is_kept_by_the_start_of_its_heading() -> None:
    page = PAGE.replace("## Targets", "## Accelerations on and off (measured 2026-12-05)\n\n"
                        "| unique | **0.62** (0.55-0.70) |\n\n## Targets")
    kept = cli.kept_sections(page)
    assert list(kept) == [cli.KEPT_SECTIONS[0], "Accelerations on and off ("]
    section = kept["Accelerations on and off ("]
    assert section.startswith("## Accelerations on and off (measured") and "0.62" in section
