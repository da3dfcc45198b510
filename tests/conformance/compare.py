"""Compare a plain run of Celery's integration tests with an IdempotentTask run.

    python tests/conformance/compare.py plain.json idem.json --json diff.json --markdown diff.md
        [--check] [--only ID_PREFIX ...]

Inputs are the files ``celery_suite_plugin.py`` writes (test id -> outcome, message, duration).
A test differs when its outcome (passed, failed, skipped, xfailed, xpassed) is not the same in
both runs (a test missing from one run, as after an interrupted run, is listed under ``not_run``
and not compared; ``--check`` fails on it); failed, timeout and error count as one outcome (a test that
fails in both runs says nothing about IdempotentTask; such pairs are listed apart, under
``both_fail``). Each difference is classified from two
lists checked into the repository:

* ``by_design.txt``: the test observes something IdempotentTask changes on purpose (the reason
  follows ``#`` on the line);
* ``known_bugs.txt``: a library bug, being fixed (the cause follows ``#``); such a line goes
  once the fix lands, and ``--check`` says so when the test no longer differs.

Anything else is ``unclassified``. ``--check`` exits 1 when an unclassified difference exists.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
MISSING = "missing"
FAILING = frozenset({"failed", "timeout", "error"})


def same(a: str, b: str) -> bool:
    """Whether two outcomes count as the same (failed, timeout and error are one outcome)."""
    return a == b or (a in FAILING and b in FAILING)


def read_list(path: Path) -> dict[str, str]:
    """``test id  # reason`` lines (blank lines and ``#`` comments skipped)."""
    entries: dict[str, str] = {}
    if not path.exists():
        return entries
    for raw in path.read_text().splitlines():
        test_id, _, reason = raw.partition("#")
        test_id = test_id.strip()
        if test_id:
            entries[test_id] = reason.strip()
    return entries


def load(path: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(path.read_text())
    for entry in data.get("tests", {}).values():
        # A test that pytest stopped at with an INTERNALERROR has no report: count it an error.
        entry["outcome"] = entry.get("outcome") or "error"
    return data


def compare(plain: dict[str, Any], idem: dict[str, Any], by_design: dict[str, str],
            known_bugs: dict[str, str], only: list[str] | None = None) -> dict[str, Any]:
    """The machine-readable diff: every test whose outcome differs, classified."""
    p_tests, i_tests = plain["tests"], idem["tests"]
    ids = sorted(set(p_tests) | set(i_tests))
    if only:
        ids = [t for t in ids if any(t == o or t.startswith(o.rstrip(":") + "::") or
                                     t.startswith(o + "[") for o in only)]
    differences: dict[str, dict[str, Any]] = {}
    both_fail: dict[str, dict[str, str]] = {}
    not_run: dict[str, dict[str, str]] = {}
    for test_id in ids:
        p = p_tests.get(test_id, {"outcome": MISSING, "message": ""})
        i = i_tests.get(test_id, {"outcome": MISSING, "message": ""})
        if MISSING in (p["outcome"], i["outcome"]):
            not_run[test_id] = {"plain": p["outcome"], "idem": i["outcome"]}
            continue
        if same(p["outcome"], i["outcome"]):
            if p["outcome"] in FAILING:
                both_fail[test_id] = {"plain": p["outcome"], "idem": i["outcome"],
                                      "plain_message": p.get("message", ""),
                                      "idem_message": i.get("message", "")}
            continue
        if test_id in by_design:
            classification, reason = "by design", by_design[test_id]
        elif test_id in known_bugs:
            classification, reason = "bug", known_bugs[test_id]
        else:
            classification, reason = "unclassified", ""
        differences[test_id] = {
            "plain": p["outcome"], "idem": i["outcome"],
            "classification": classification, "reason": reason,
            "plain_message": p.get("message", ""), "idem_message": i.get("message", ""),
        }
    outcomes = ("passed", "failed", "timeout", "error", "skipped", "xfailed", "xpassed")

    def counts(tests: dict[str, Any]) -> dict[str, int]:
        c = {o: 0 for o in outcomes}
        for t in ids:
            if t in tests:
                c[tests[t]["outcome"]] = c.get(tests[t]["outcome"], 0) + 1
        return c

    fixed = sorted(t for t in known_bugs if t in ids and t not in differences)
    return {
        "celery_tests": len(ids),
        "plain": {"seconds": plain.get("seconds"), "counts": counts(p_tests),
                  "task_cls": plain.get("task_cls")},
        "idem": {"seconds": idem.get("seconds"), "counts": counts(i_tests),
                 "task_cls": idem.get("task_cls")},
        "differences": differences,
        "both_fail": both_fail,
        "not_run": not_run,
        "known_bugs_no_longer_differing": fixed,
        "by_design_no_longer_differing": sorted(t for t in by_design
                                                if t in ids and t not in differences),
    }


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def markdown(diff: dict[str, Any], celery: str | None = None) -> str:
    lines = [f"# Conformance run{f': Celery {celery}' if celery else ''}", ""]
    for mode in ("plain", "idem"):
        c = {k: v for k, v in diff[mode]["counts"].items() if v}
        lines.append(f"- **{mode}** ({diff[mode]['task_cls']}): {diff[mode]['seconds']} s, "
                     + ", ".join(f"{v} {k}" for k, v in c.items()))
    compared = diff["celery_tests"] - len(diff["not_run"])
    lines += ["", f"{len(diff['differences'])} of {compared} compared tests differ"
              f" ({len(diff['not_run'])} not run in both).", "",
              "| test | plain | idem | classification | reason |", "|---|---|---|---|---|"]
    for test_id, d in diff["differences"].items():
        reason = d["reason"] or f"idem: {d['idem_message']}"
        lines.append(f"| `{test_id.removeprefix('t/integration/')}` | {d['plain']} | {d['idem']} | "
                     f"{d['classification']} | {_cell(reason)} |")
    if diff["both_fail"]:
        lines += ["", "Failing in both runs (not a difference):", "",
                  "| test | plain | idem | plain says |", "|---|---|---|---|"]
        for test_id, d in diff["both_fail"].items():
            lines.append(f"| `{test_id.removeprefix('t/integration/')}` | {d['plain']} | {d['idem']} | "
                         f"{_cell(d['plain_message'][:160])} |")
    if diff["known_bugs_no_longer_differing"]:
        lines += ["", "Known bugs that no longer differ (remove them from known_bugs.txt):", ""]
        lines += [f"- `{t}`" for t in diff["known_bugs_no_longer_differing"]]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("plain", type=Path)
    ap.add_argument("idem", type=Path)
    ap.add_argument("--json", type=Path, help="write the machine-readable diff here")
    ap.add_argument("--markdown", type=Path, help="write the markdown table here")
    ap.add_argument("--by-design", type=Path, default=HERE / "by_design.txt")
    ap.add_argument("--known-bugs", type=Path, default=HERE / "known_bugs.txt")
    ap.add_argument("--celery", help="Celery version, for the markdown title")
    ap.add_argument("--check", action="store_true", help="exit 1 on an unclassified difference")
    ap.add_argument("--only", nargs="*", help="compare only these test ids (or id prefixes)")
    args = ap.parse_args(argv)

    diff = compare(load(args.plain), load(args.idem), read_list(args.by_design),
                   read_list(args.known_bugs), args.only)
    if args.json:
        args.json.write_text(json.dumps(diff, indent=1, sort_keys=True) + "\n")
    text = markdown(diff, args.celery)
    if args.markdown:
        args.markdown.write_text(text)
    print(text)
    unclassified = [t for t, d in diff["differences"].items() if d["classification"] == "unclassified"]
    for t in diff["known_bugs_no_longer_differing"]:
        print(f"NOTE: {t} is in known_bugs.txt but no longer differs: delete its line")
    if diff["not_run"]:
        print(f"{len(diff['not_run'])} test(s) did not run in both runs (an interrupted run?), "
              f"not compared: {', '.join(list(diff['not_run'])[:5])}...")
    if args.check and diff["not_run"]:
        print("FAIL: a test of the subset did not run in both runs", file=sys.stderr)
        return 1
    if args.check and unclassified:
        print(f"FAIL: {len(unclassified)} difference(s) outside by_design.txt and known_bugs.txt:",
              file=sys.stderr)
        for t in unclassified:
            d = diff["differences"][t]
            print(f"  {t}: plain {d['plain']}, idem {d['idem']}: {d['idem_message']}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
