"""Levels, profiles, verdicts by rule, classed expected failures and the report's schema
(SPEC.md CF-4, CF-14, CF-15, CF-16).

These tests name CF-14, CF-15 and CF-16 for CF-10: the suite's own rules are checked by
the project's tests."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest

from conformance.cases.conftest import (
    finding_numbers,
    frozen_cases,
    parse_entry,
    read_expected_failures,
    read_frozen_profile,
    refuse_choice_on_core,
)
from conformance.spec import LEVELS, case_level, rule_ids, rule_levels
from conformance.verdicts import rule_verdicts

ROOT = Path(__file__).resolve().parent.parent
SCHEMA = json.loads((ROOT / "conformance" / "report.schema.json").read_text())
TORCH_XFAILS = ROOT / "conformance" / "expected_failures" / "torch.txt"


def _conformance(*args, timeout=600, env=None):
    return subprocess.run([sys.executable, "-m", "conformance", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


# --- CF-14: levels -------------------------------------------------------------------

def test_every_rule_has_exactly_one_level():
    """CF-14: a rule written without `[core]`, `[strict]` or `[extension]` after its ID
    fails here, named."""
    levels = rule_levels()
    every = [rule for ids in rule_ids().values() for rule in ids]
    assert list(levels) == every
    unlevelled = [rule for rule, level in levels.items() if level is None]
    assert not unlevelled, f"SPEC.md rules with no level: {unlevelled}"


def test_a_rule_without_a_level_is_found(tmp_path):
    """CF-14: the parser sees a missing or misspelt level (the test above would fail)."""
    spec = tmp_path / "SPEC.md"
    spec.write_text("## 1. Demo (DM)\n\n- **DM-1** [core] MUST.\n- **DM-2** MUST too.\n"
                    "- **DM-3** [cor] MUST three.\n")
    assert rule_levels(spec) == {"DM-1": "core", "DM-2": None, "DM-3": None}


def test_a_case_has_the_level_of_its_most_demanding_rule():
    """CF-14: core < strict < extension; an unlevelled rule is never taken as core."""
    levels = {"A-1": "core", "A-2": "strict", "A-3": "extension", "A-4": None}
    assert case_level(["A-1"], levels) == "core"
    assert case_level(["A-1", "A-2"], levels) == "strict"
    assert case_level(["A-3", "A-1"], levels) == "extension"
    assert case_level(["A-1", "A-4"], levels) == "extension"


# --- CF-15: verdicts by rule ----------------------------------------------------------

def _case(cid, spec_ids, outcome, level, **extra):
    return {"id": cid, "spec_ids": spec_ids, "outcome": outcome, "level": level,
            "reason": extra.pop("reason", ""), **extra}


def test_a_verdict_counts_only_the_cases_of_the_rules_level(monkeypatch):
    """CF-15: a strict case's failure does not make the core rule it also names differ;
    a bug's expected failure is a difference, a missing one not implemented; a rule no
    counting case ran for is `not_run`."""
    import conformance.verdicts as verdicts

    monkeypatch.setattr(verdicts, "judged_rules", lambda levels, prefixes=None: [
        (r, lv) for r, lv in [("A-1", "core"), ("A-2", "strict"), ("A-3", "core"),
                              ("A-4", "extension"), ("A-5", "core")] if lv in levels])
    cases = [_case("c1", ["A-1"], "passed", "core"),
             _case("c2", ["A-1", "A-2"], "failed", "strict", reason="no name"),
             _case("c3", ["A-3"], "xfailed", "core", reason="bug(finding 2) A-3: x",
                   expected_failure={"class": "bug", "finding": 2, "reason": "A-3: x"}),
             _case("c4", ["A-4"], "not_implemented", "extension"),
             _case("c5", ["A-5"], "skipped", "core"),
             _case("c6", ["A-5"], "xfailed", "core", expected_failure={
                 "class": "missing", "reason": "A-5: no such concept"})]
    got = {r["id"]: r for r in rule_verdicts(cases, LEVELS)}
    assert {k: v["verdict"] for k, v in got.items()} == {
        "A-1": "conforms", "A-2": "differs", "A-3": "differs", "A-4": "not_implemented",
        "A-5": "not_implemented"}
    assert got["A-1"]["cases"] == {"passed": 1}
    assert got["A-2"]["first_case"] == "c2" and got["A-2"]["reason"] == "no name"
    assert got["A-3"]["expected_failure"]["finding"] == 2
    assert got["A-3"]["differing_cases"] == 1
    assert [r["id"] for r in rule_verdicts(cases, ("core",))] == ["A-1", "A-3", "A-5"]
    assert rule_verdicts(cases[4:5], ("core",))[2]["verdict"] == "not_run"


def test_a_real_report_validates_against_the_schema(tmp_path):
    """CF-15: `--json` of a run with an expected failure and a profile validates against
    conformance/report.schema.json; its rules and cases carry levels and classes."""
    jsonschema.Draft202012Validator.check_schema(SCHEMA)
    report = tmp_path / "report.json"
    case = _an_expected_failure_of_torch()
    proc = _conformance("--backend", "torch", "-n", "0", "--case", case.split("::")[1],
                        "--profile", "full", "--json", str(report))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads(report.read_text())
    jsonschema.validate(data, SCHEMA, cls=jsonschema.Draft202012Validator)
    assert data["profile"] == "full" and data["backend"] == "torch"
    assert len(data["spec_sha256"]) == 64
    record = next(c for c in data["cases"] if c["id"] == case)
    assert record["outcome"] == "xfailed" and record["expected_failure"]["class"]
    assert record["level"] in LEVELS and record["rules"] == record["spec_ids"]
    assert {r["verdict"] for r in data["rules"]} <= {"conforms", "differs", "not_implemented",
                                                     "not_run"}
    assert "verdicts by rule (profile full)" in proc.stdout
    # Broken on purpose: the schema is a check that can fail.
    broken = {**data, "rules": [{**data["rules"][0], "verdict": "maybe"}]}
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(broken, SCHEMA, cls=jsonschema.Draft202012Validator)


def _an_expected_failure_of_torch() -> str:
    """A cheap case torch.txt lists for every release: a trace-time refusal (FC-3), traced
    in this process, no rank started."""
    return "test_functional_collectives.py::test_bad_arguments_fail_at_trace_time[" \
        "all_gather-0d-FakeTensorMode]"


def test_a_section_without_cases_is_refused(monkeypatch, capsys):
    """CF-15: `--section CF` says its rules are checked by the project's tests and exits
    2 before any case runs."""
    from conformance.__main__ import main

    for name in ("REFIMPL_PROCESS_GROUP", "REFIMPL_DEVICE"):  # main() sets them
        monkeypatch.setenv(name, os.environ.get(name, ""))
    with pytest.raises(SystemExit) as stopped:
        main(["--section", "CF"])
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    assert "has no cases" in err and "tests/test_conformance_suite.py" in err


def test_a_section_run_counts_its_cases_under_it():
    """CF-15: under `--section MEM` a case naming SIM-8 first and MEM-10 counts under MEM,
    and the verdicts judge MEM's rules only."""
    from conformance.__main__ import reported_section

    assert reported_section(["SIM-8", "MEM-10"], ["MEM"]) == "MEM"
    assert reported_section(["SIM-8", "MEM-10"], None) == "SIM"
    assert reported_section(["FC-35", "MEM-12"], ["MEM", "FC"]) == "FC"
    cases = [_case("c1", ["SIM-8", "MEM-10"], "passed", "extension")]
    judged = rule_verdicts(cases, LEVELS, ["MEM"])
    assert {r["id"].split("-")[0] for r in judged} == {"MEM"}
    assert next(r for r in judged if r["id"] == "MEM-10")["verdict"] == "conforms"


# --- CF-4: classed expected failures --------------------------------------------------

@pytest.mark.parametrize("text,message", [
    ("FC-9: no class", "has no class"),
    ("bug FC-9: no finding", "names its finding"),
    ("bug(finding 999) FC-9: x", "has no finding 999"),
    ("missing", "gives no reason"),
    ("choice(finding 2) FC-9: x", "only a bug entry names a finding"),
])
def test_an_entry_without_class_finding_or_reason_is_refused(text, message):
    """CF-4: each refusal names the file:line, the case and the rule."""
    with pytest.raises(pytest.UsageError, match=message) as info:
        parse_entry("f.py::t", text, "torch.txt:7", finding_numbers())
    assert "torch.txt:7: f.py::t" in str(info.value) and "[CF-4]" in str(info.value)


def test_a_bug_entry_names_its_finding_and_issue():
    entry = parse_entry("f.py::t", "bug(finding 5, pytorch#190942) FC-18: assert",
                        "torch.txt:1", {5})
    assert (entry.kind, entry.finding, entry.issue, entry.reason) == (
        "bug", 5, 190942, "FC-18: assert")
    assert str(entry) == "bug(finding 5, pytorch#190942) FC-18: assert"


def test_a_choice_on_a_core_case_is_refused():
    """CF-4: upstream's contract is what a core rule states: a core difference is a bug."""
    entry = parse_entry("f.py::t", "choice FC-1: designed so", "x.txt:3", set())
    refuse_choice_on_core({"f.py::t": [entry]}, {"f.py::t": "strict"})  # allowed
    with pytest.raises(pytest.UsageError, match="choice entry on a core case"):
        refuse_choice_on_core({"f.py::t": [entry]}, {"f.py::t": "core"})


def test_every_torch_entry_is_classed_and_every_bug_names_a_finding():
    """CF-4: torch.txt loads (every entry classed, every bug's finding exists)."""
    _, listed = read_expected_failures(TORCH_XFAILS)
    entries = [e for per_case in listed.values() for e in per_case]
    assert entries and all(e.kind in ("bug", "choice", "missing") for e in entries)
    known = finding_numbers()
    assert all(e.finding in known for e in entries if e.kind == "bug")


def test_update_expected_failures_appends_entries_the_loader_refuses(tmp_path):
    """CF-4: `--update-expected-failures FILE` appends the unexpected failures with their
    class and reason blank, and the loader refuses the file until they are written."""
    backend = tmp_path / "vendor_backend.py"
    backend.write_text(
        "from conformance.backends import Backend\n"
        "class Failing(Backend):\n"
        "    def require(self, concept, *attrs):\n"
        "        raise RuntimeError('always fails')\n"
        f"backend = Failing('vendor', {{}}, expected_failures={str(tmp_path / 'x.txt')!r})\n")
    xfails = tmp_path / "x.txt"
    xfails.write_text("")
    env = {"PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}
    args = ("--backend", "vendor_backend:backend", "-n", "0", "--case",
            "test_all_gather_on_another_dim_is_pending_too")
    proc = _conformance(*args, "--update-expected-failures", str(xfails), env=env)
    assert proc.returncode == 1
    release = __import__("torch").__version__.split("+")[0]
    entry = f"test_functional_collectives.py::test_all_gather_on_another_dim_is_pending_too" \
            f"  [torch=={release}]"
    assert entry in xfails.read_text().splitlines()
    with pytest.raises(pytest.UsageError, match="has no class"):
        read_expected_failures(xfails)


# --- CF-16: frozen must-pass lists ----------------------------------------------------

def test_a_frozen_profile_runs_exactly_its_list(tmp_path):
    """CF-16: `--profile core-vN` runs its listed cases, no other."""
    levels = ROOT / "conformance" / "levels"
    cheap = ["test_functional_collectives.py::test_make_fx_graph",
             "test_functional_collectives.py::test_fake_kernels_give_result_shapes[all_reduce]"]
    listed = [cid for cid in read_frozen_profile("core-v1") if cid in cheap]
    assert sorted(listed) == sorted(cheap)
    trial = levels / "core-v999.txt"
    try:
        trial.write_text("\n".join(listed) + "\n")
        report = tmp_path / "r.json"  # what the run would run: collected, not run
        proc = _conformance("--profile", "core-v999", "--list", "--json", str(report))
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        assert sorted(c["id"] for c in json.loads(report.read_text())["cases"]) == \
            sorted(listed)
    finally:
        trial.unlink(missing_ok=True)


def test_a_frozen_list_whose_case_is_gone_or_unknown_stops_the_run():
    """CF-16: a listed case no longer collected stops the run (unless its file is left out
    of this run); an unknown version is refused, naming the known ones."""
    listed = read_frozen_profile("core-v1")
    assert frozen_cases("core-v1", set(listed)) == set(listed)
    with pytest.raises(pytest.UsageError, match="no longer exist"):
        frozen_cases("core-v1", set(listed[1:]))
    file_of_first = listed[0].split("::")[0]
    assert frozen_cases("core-v1", set(listed[1:]), {file_of_first}) == set(listed)
    with pytest.raises(pytest.UsageError, match="no such frozen list.*core-v1"):
        read_frozen_profile("core-v998")
