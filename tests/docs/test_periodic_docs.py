"""The periodic-task docs: both tables give the option one text, beginning with its
``#:`` summary, and the Periodic tasks page warns about a no-argument task without
``idempotency_period``."""

from __future__ import annotations

import re

from tests.integration.harness import ROOT

OPTION = "idempotency_period"


def _doc_comment(option: str) -> str:
    """The ``#:`` lines above ``option`` in IdempotentTask, as the tables write them."""
    lines = (ROOT / "celery_idem" / "task.py").read_text().splitlines()
    at = next(i for i, line in enumerate(lines) if line.strip().startswith(f"{option}:"))
    comment: list[str] = []
    for line in reversed(lines[:at]):
        if not line.strip().startswith("#:"):
            break
        comment.insert(0, line.strip().removeprefix("#:").strip())
    return " ".join(comment).replace("``", "`")


def _row(path: str, option: str) -> list[str]:
    text = (ROOT / path).read_text()
    match = re.search(rf"^\| `{option}` \|(.*)\|$", text, re.M)
    assert match, f"{path} has no table row for {option}"
    return [cell.strip() for cell in match.group(1).split("|")]


def test_both_option_tables_agree_and_begin_with_the_options_doc_comment() -> None:
    text = _doc_comment(OPTION)
    assert text.startswith("Seconds of a schedule slot")
    row = _row("docs/configuration.md", OPTION)
    assert row[0] == "`None`" and row[1].startswith(text)
    assert _row("README.md", OPTION) == row


def test_the_periodic_tasks_page_warns_about_a_task_without_the_option() -> None:
    page = (ROOT / "docs" / "periodic.md").read_text()
    warning = page[page.index('!!! danger'):page.index("## `idempotency_period`")]
    assert "runs once per `idempotency_ttl`" in warning
    assert "every later tick is answered from its record" in warning
    for heading in ("## Two beat processes", "## The guarantee, precisely",
                    "## Choosing the period", "## Where the time comes from"):
        assert heading in page
    assert "Periodic tasks: periodic.md" in (ROOT / "mkdocs.yml").read_text()
    assert "(periodic.md#choosing-the-period)" in (ROOT / "docs" / "configuration.md").read_text()
