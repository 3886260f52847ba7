"""Verdicts by rule: what a run says of each SPEC rule it judged (CF-15).

A run reports cases; an implementer acts on rules. Each rule a profile judges gets one
verdict from the cases that count for it:

- a case counts for a rule it names when the case's level is the rule's own (a case has
  the level of its most demanding rule, CF-14): a strict case that also names a core rule
  says nothing of that core rule, so a core verdict never hangs on a strict check;
- `differs`: one of those cases failed, or failed as expected under a `bug` or `choice`
  entry (a known difference is still a difference); `not_implemented`: none differs and
  one is not implemented by the backend, or failed as expected under a `missing` entry
  (the backend says it lacks the concept); `conforms`: the others passed; `not_run`: no
  case that counts for it ran (skipped, deselected by --section, -k, a frozen profile).

The rules of SUITE_SECTIONS govern the suite itself and are judged by the project's
tests, not by a backend's run.

Implements SPEC.md section 7: CF-15 (the verdicts and the report's `rules`).
"""

from __future__ import annotations

from collections import Counter

from conformance.spec import LEVELS, rule_levels, rules_of_levels

__all__ = ["VERDICTS", "SUITE_SECTIONS", "rule_verdicts", "count_conforming"]

VERDICTS = ("conforms", "differs", "not_implemented", "not_run")
# Sections whose rules govern the suite itself: refimpl's tests name them, not cases (CF-10).
SUITE_SECTIONS = frozenset({"CF"})
_RAN = {"passed", "xpassed", "failed", "xfailed", "not_implemented"}


def judged_rules(levels: tuple[str, ...], prefixes=None) -> list[tuple[str, str]]:
    """[(rule ID, level)] a run of `levels` judges, in SPEC.md's order; only the sections
    `prefixes` when given."""
    of_rule = rule_levels()
    return [(rule, of_rule[rule] or LEVELS[-1])
            for prefix, ids in rules_of_levels(levels).items()
            if prefix not in SUITE_SECTIONS and (not prefixes or prefix in prefixes)
            for rule in ids]


def _reading(case: dict) -> str:
    """What one case says of its rules: differs, not_implemented, conforms or not_run."""
    outcome = case["outcome"]
    if outcome == "xfailed":
        entry = case.get("expected_failure") or {}
        return "not_implemented" if entry.get("class") == "missing" else "differs"
    if outcome == "failed":
        return "differs"
    if outcome == "not_implemented":
        return "not_implemented"
    return "conforms" if outcome in _RAN else "not_run"


def _verdict(readings: set[str]) -> str:
    return next((v for v in ("differs", "not_implemented", "conforms") if v in readings),
                "not_run")


def rule_verdicts(cases: list[dict], levels: tuple[str, ...], prefixes=None) -> list[dict]:
    """One record per judged rule: {"id", "level", "verdict", "cases"} (`cases`: its
    counting cases by outcome), and for a rule that differs or is not implemented, its
    first such case and that case's reason (with the expected-failure class, if any)."""
    counting: dict[str, list[dict]] = {}
    for case in cases:
        for rule in case.get("spec_ids", []):
            counting.setdefault(rule, []).append(case)
    records = []
    for rule, level in judged_rules(levels, prefixes):
        own = [c for c in counting.get(rule, []) if c.get("level", level) == level]
        outcomes = Counter(c["outcome"] for c in own)
        verdict = _verdict({_reading(c) for c in own})
        record = {"id": rule, "level": level, "verdict": verdict,
                  "cases": dict(sorted(outcomes.items()))}
        if verdict == "differs":
            record["differing_cases"] = sum(_reading(c) == "differs" for c in own)
        first = _first_case_for(verdict, own)
        if first is not None:
            record["first_case"] = first["id"]
            record["reason"] = first.get("reason", "")
            entry = first.get("expected_failure")
            if entry:
                record["expected_failure"] = entry
        records.append(record)
    return records


def _first_case_for(verdict: str, cases: list[dict]) -> dict | None:
    """The case a verdict other than `conforms` is explained by: for `not_run`, a skipped
    case (why it was skipped: a CUDA case on a machine without a GPU, say)."""
    if verdict == "not_run":
        return next((c for c in sorted(cases, key=lambda c: c["id"])
                     if c["outcome"] == "skipped"), None)
    if verdict not in ("differs", "not_implemented"):
        return None
    # A failure before an expected one: the unknown difference is the news.
    ordered = sorted((c for c in cases if _reading(c) == verdict),
                     key=lambda c: (c["outcome"] != "failed", c["id"]))
    return ordered[0] if ordered else None


def count_conforming(records: list[dict]) -> dict[str, tuple[int, int]]:
    """{level: (rules that conform, rules judged)} over `records`."""
    counts = {}
    for level in LEVELS:
        of_level = [r for r in records if r["level"] == level]
        if of_level:
            counts[level] = (sum(r["verdict"] == "conforms" for r in of_level), len(of_level))
    return counts
