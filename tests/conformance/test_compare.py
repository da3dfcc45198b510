"""The conformance compare step (tests/conformance/compare.py) and its checked-in lists."""

from __future__ import annotations

import json
from pathlib import Path

from tests.conformance import compare

HERE = Path(__file__).resolve().parent


def _run(tests: dict[str, str]) -> dict[str, object]:
    return {"seconds": 1.0, "task_cls": "x", "tests": {
        t: {"outcome": o, "message": f"msg {t}", "duration": 0.1} for t, o in tests.items()}}


def test_classifies_each_difference(tmp_path: Path) -> None:
    plain = _run({"a::same": "passed", "a::designed": "passed", "a::bug": "passed",
                  "a::new": "passed", "a::fixed": "passed", "a::gone": "failed",
                  "a::flaky": "timeout"})
    idem = _run({"a::same": "passed", "a::designed": "failed", "a::bug": "timeout",
                 "a::new": "error", "a::fixed": "passed",
                 "a::flaky": "failed"})
    diff = compare.compare(plain, idem, {"a::designed": "counts runs"},
                           {"a::bug": "bug, being fixed: x", "a::fixed": "bug: y"})
    got = {t: (d["plain"], d["idem"], d["classification"]) for t, d in diff["differences"].items()}
    assert got == {
        "a::designed": ("passed", "failed", "by design"),
        "a::bug": ("passed", "timeout", "bug"),
        "a::new": ("passed", "error", "unclassified"),
    }
    assert set(diff["not_run"]) == {"a::gone"}
    assert diff["known_bugs_no_longer_differing"] == ["a::fixed"]
    assert set(diff["both_fail"]) == {"a::flaky"}  # timeout vs failed: failing in both
    assert "| `a::designed` | passed | failed | by design | counts runs |" in compare.markdown(diff)

    (tmp_path / "p.json").write_text(json.dumps(plain))
    (tmp_path / "i.json").write_text(json.dumps(idem))
    (tmp_path / "bd.txt").write_text("a::designed  # counts runs\n")
    (tmp_path / "kb.txt").write_text("a::bug  # bug\n")
    argv = [str(tmp_path / "p.json"), str(tmp_path / "i.json"), "--by-design", str(tmp_path / "bd.txt"),
            "--known-bugs", str(tmp_path / "kb.txt"), "--json", str(tmp_path / "d.json"), "--check"]
    assert compare.main(argv) == 1  # a::new is unclassified, a::gone did not run
    assert compare.main([*argv, "--only", "a::designed", "a::bug"]) == 0
    assert set(json.loads((tmp_path / "d.json").read_text())["differences"]) == {"a::designed", "a::bug"}


def test_lists_are_well_formed() -> None:
    """Every line of the allow-lists names a Celery test and gives a reason; no id is in two lists."""
    lists = {name: compare.read_list(HERE / name) for name in ("by_design.txt", "known_bugs.txt")}
    for name, entries in lists.items():
        for test_id, reason in entries.items():
            assert test_id.startswith("t/integration/test_") and "::" in test_id, (name, test_id)
            assert reason, f"{name}: {test_id} has no reason"
    assert not set(lists["by_design.txt"]) & set(lists["known_bugs.txt"])
    subset = compare.read_list(HERE / "subset.txt")
    assert subset, "subset.txt is empty"


def test_a_test_without_an_outcome_counts_as_an_error(tmp_path: Path) -> None:
    """pytest's INTERNALERROR leaves a test with no report (outcome null): still comparable."""
    plain = _run({"a::x": "passed"})
    idem = _run({"a::x": "passed"})
    idem["tests"]["a::x"]["outcome"] = None  # type: ignore[index]
    (tmp_path / "p.json").write_text(json.dumps(plain))
    (tmp_path / "i.json").write_text(json.dumps(idem))
    argv = [str(tmp_path / "p.json"), str(tmp_path / "i.json"), "--json", str(tmp_path / "d.json")]
    assert compare.main(argv) == 0
    assert json.loads((tmp_path / "d.json").read_text())["differences"]["a::x"]["idem"] == "error"
