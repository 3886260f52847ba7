"""The conformance scoreboard: refimpl and upstream PyTorch versions, section by section.

    python benchmarks/scoreboard.py run [--release X.Y.Z]... [--upstream PYTHON]... [-o OUT]
    python benchmarks/scoreboard.py make REPORT.json... [-o OUT]

`run` runs `python -m conformance` against `refimpl` (with this Python) and against
`torch` with each `--upstream` Python (default: this one; a virtual environment holding
another torch version, this checkout on its PYTHONPATH) and with each `--release`, whose
venv it builds first under build/scoreboard/venvs/ when it is missing (`venv_for`: the
release from pip as configured here, else torch 2.14.1's dependencies, which this
machine serves, and the release itself from the registry), writes each JSON report to
`build/scoreboard/`, then does what `make` does. `make` turns JSON reports (`--json` of
`python -m conformance`) into a markdown scoreboard (default benchmarks/results/
scoreboard.md): a table per SPEC section with, per rule, the cases naming it that
passed on each backend, then every case whose outcome differs between two upstream
versions with the reason each run gives (the expected-failure entry that applies to it,
or the failure). Sections and rules are SPEC.md's.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from conformance.cases.conftest import section_of, torch_release  # noqa: E402
from conformance.spec import LEVELS, case_level, rule_ids, rule_levels, section_title  # noqa: E402
from conformance.verdicts import rule_verdicts  # noqa: E402

REPORTS_DIR = ROOT / "build" / "scoreboard"
DEFAULT_OUT = ROOT / "benchmarks" / "results" / "scoreboard.md"
SHORT = {"failed": "fail", "xfailed": "xfail", "xpassed": "XPASS",
         "not_implemented": "n/i", "skipped": "skip"}


VENVS_DIR = REPORTS_DIR / "venvs"
TOOLS = ["pytest", "pytest-xdist", "expecttest", "hypothesis", "numpy"]
# What a release needs besides torch 2.14.1's dependencies (its CUDA libraries, which load
# on a CPU host): torch 2.15.0 links a newer NVSHMEM.
EXTRAS = {"2.15.0": ["nvidia-nvshmem-cu13==3.7.2"]}


def venv_for(release: str) -> str:
    """The Python of a venv holding torch `release` (built when missing); never this one.

    pip here serves 2.13.0 (the CPU wheel) and 2.14.1 from local disk and is capped at
    2.14.1 by its configuration; another release is installed over 2.14.1's dependencies
    from the registry (PIP_CONFIG_FILE=/dev/null for that one command)."""
    home = VENVS_DIR / f"torch-{release}"
    python = home / "bin" / "python"
    if python.exists():
        return str(python)
    subprocess.run([sys.executable, "-m", "venv", str(home)], check=True)
    pip = [str(python), "-m", "pip", "install", "-q"]
    if subprocess.run(pip + [f"torch=={release}", *TOOLS]).returncode != 0:
        subprocess.run(pip + ["torch==2.14.1", *TOOLS], check=True)
        registry = {**os.environ, "PIP_CONFIG_FILE": os.devnull}
        subprocess.run(pip + ["--no-deps", "--force-reinstall", f"torch=={release}",
                              *EXTRAS.get(release, [])], env=registry, check=True)
    return str(python)


def run_suite(python: str, backend: str) -> Path:
    """One conformance run; returns its JSON report (written even when cases fail)."""
    version = subprocess.run([python, "-c", "import torch; print(torch.__version__)"],
                             capture_output=True, text=True, check=True).stdout.strip()
    report = REPORTS_DIR / f"{backend}-torch-{version.split('+')[0]}.json"
    report.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    print(f"== {backend} on torch {version} ({python})", flush=True)
    proc = subprocess.run([python, "-m", "conformance", "--backend", backend, "--json",
                           str(report)], cwd=ROOT, env=env)
    print(f"== exit status {proc.returncode}", flush=True)
    return report


def label(report: dict) -> str:
    if report["backend"] == "torch":
        return f"torch {report['torch_version']}"
    return f"{report['backend']} (torch {report['torch_version']})"


def cell(cases: list[dict]) -> str:
    """'12/12', or '10/12 (2 xfail)': passed of all, then what the others were."""
    if not cases:
        return "-"
    counts = Counter(c["outcome"] for c in cases)
    others = ", ".join(f"{n} {SHORT[o]}" for o, n in sorted(counts.items()) if o != "passed")
    return f"{counts['passed']}/{len(cases)}" + (f" ({others})" if others else "")


def _by_rule(report: dict) -> dict[str, list[dict]]:
    rules: dict[str, list[dict]] = {}
    for case in report["cases"]:
        for spec_id in case["spec_ids"]:
            rules.setdefault(spec_id, []).append(case)
    return rules


def _by_section(report: dict) -> dict[str, list[dict]]:
    sections: dict[str, list[dict]] = {}
    for case in report["cases"]:
        sections.setdefault(section_of(case["spec_ids"]), []).append(case)
    return sections


def section_table(prefix: str, ids: list[str], reports: list[dict]) -> list[str]:
    lines = [f"## {section_title(prefix)} ({prefix})", ""]
    lines.append("| rule | " + " | ".join(label(r) for r in reports) + " |")
    lines.append("|---|" + "---|" * len(reports))
    sections = [_by_section(r) for r in reports]
    lines.append("| all cases | " + " | ".join(cell(s.get(prefix, [])) for s in sections)
                 + " |")
    rules = [_by_rule(r) for r in reports]
    for spec_id in ids:
        lines.append(f"| {spec_id} | " + " | ".join(cell(r.get(spec_id, [])) for r in rules)
                     + " |")
    return lines + [""]


def differences(old: dict, new: dict) -> list[str]:
    """Every case whose outcome differs between two reports, with both runs' reasons."""
    before = {c["id"]: c for c in old["cases"]}
    after = {c["id"]: c for c in new["cases"]}
    lines = []
    for cid in sorted(set(before) | set(after)):
        a, b = before.get(cid), after.get(cid)
        if a and b and a["outcome"] == b["outcome"]:
            continue
        lines.append(f"- `{cid}`: {_outcome(a)} on {label(old)}, {_outcome(b)} on "
                     f"{label(new)}.")
        for report, case in ((old, a), (new, b)):
            if case and case["reason"]:
                reason = " ".join(case["reason"].split())  # one line in the table's list
                lines.append(f"  - {label(report)}: {reason[:400]}")
    return lines


def _outcome(case) -> str:
    return case["outcome"] if case else "absent"


COMMANDS = """\
Remade, from the repository root, by one command (each release's venv is built under
build/scoreboard/venvs/ when missing, never the project's; the JSON reports land in
build/scoreboard/):

```bash
python benchmarks/scoreboard.py run --release 2.11.0 --release 2.12.1 --release 2.13.0 \\
    --release 2.14.1 --release 2.15.0
# or this file alone, from reports made earlier:
python benchmarks/scoreboard.py make build/scoreboard/*.json
```
"""


def make(reports: list[dict], note: str = "") -> str:
    lines = ["# Conformance scoreboard", "", COMMANDS]
    lines += [f"Machine: {os.cpu_count()} cores, Python {reports[0]['python']}"
              + (f"; {note}" if note else "") + ".", ""]
    with_cases = {section_of(c["spec_ids"]) for r in reports for c in r["cases"]}
    without = [p for p in rule_ids() if p not in with_cases and p != "CF"]
    lines += [f"Sections with cases in these runs: "
              f"{', '.join(p for p in rule_ids() if p in with_cases)}"
              + (f"; none yet in {', '.join(without)}." if without else "."), ""]
    lines += ["A cell is the number of cases that passed, of the cases naming the rule, then "
              "what the others were: `xfail` a listed expected failure "
              "(conformance/expected_failures/; its reason is given below where two upstream "
              "versions differ), `n/i` a concept the backend does not implement, `fail` / "
              "`XPASS` unexpected results, `skip` a case skipped for want of hardware (the CUDA "
              "cases of symmetric memory on a machine without a GPU). A case naming several "
              "rules counts for each.", ""]
    lines += _runs(reports)
    lines += verdicts_by_level(reports)
    for prefix, ids in rule_ids().items():
        if prefix == "CF":  # the suite's own rules: checked by refimpl's tests, not cases
            continue
        lines += section_table(prefix, ids, reports)
    upstream = [r for r in reports if r["backend"] == "torch"]
    for old, new in zip(upstream, upstream[1:], strict=False):
        lines += [f"## Differences between {label(old)} and {label(new)}", ""]
        diff = differences(old, new)
        lines += diff or ["None: every case has the same outcome on both."]
        lines.append("")
    return "\n".join(lines)


def verdicts_by_level(reports: list[dict]) -> list[str]:
    """Per run and level, the rules that conform of those judged (profile full), then each
    core rule that does not with its verdict and the finding or class its entries give
    (CF-15); strict and extension rules that do not conform follow as lists."""
    lines = ["## Verdicts by rule and level", "",
             "A rule conforms when every case of its own level that names it passed (SPEC.md "
             "CF-14, CF-15); `python -m conformance --backend torch --profile core` gives the "
             "core column of a release.", "",
             "| run | " + " | ".join(f"{level} rules that conform" for level in LEVELS) + " |",
             "|---|" + "---|" * len(LEVELS)]
    verdicts = [_verdicts(r) for r in reports]
    for report, records in zip(reports, verdicts, strict=True):
        cells = []
        for level in LEVELS:
            of_level = [v for v in records if v["level"] == level]
            done = sum(v["verdict"] == "conforms" for v in of_level)
            cells.append(f"{done} of {len(of_level)}")
        lines.append(f"| {label(report)} | " + " | ".join(cells) + " |")
    lines.append("")
    for report, records in zip(reports, verdicts, strict=True):
        lines += [f"### {label(report)}", ""]
        for level in LEVELS:
            failing = [v for v in records if v["level"] == level and v["verdict"] != "conforms"]
            lines.append(f"- {level}: " + (", ".join(_why(v) for v in failing) if failing
                                          else "every rule conforms") + ".")
        lines.append("")
    return lines


def _verdicts(report: dict) -> list[dict]:
    """The report's own verdicts, or (a report older than CF-15) computed from its cases
    with today's levels."""
    if report.get("rules") and report.get("profile", "full") == "full":
        return report["rules"]
    levels = rule_levels()
    cases = [{**c, "level": c.get("level") or case_level(c["spec_ids"], levels)}
             for c in report["cases"]]
    return rule_verdicts(cases, LEVELS)


def _why(verdict: dict) -> str:
    """'FC-12 (differs: bug, finding 2)', 'FC-15 (differs: missing)'."""
    word = verdict["verdict"].replace("_", " ")
    entry = verdict.get("expected_failure")
    if verdict["verdict"] == "differs" and entry:
        word += f": {entry['class']}" + (f", finding {entry['finding']}" if "finding" in entry
                                         else "")
    elif verdict["verdict"] == "differs":
        word += ": unexpected"
    return f"{verdict['id']} ({word})"


def _runs(reports: list[dict]) -> list[str]:
    lines = ["| run | cases | passed | xfailed | not implemented | skipped | unexpected | "
             "seconds |", "|---|---|---|---|---|---|---|---|"]
    for r in reports:
        counts = Counter(c["outcome"] for c in r["cases"])
        lines.append(f"| {label(r)} | {len(r['cases'])} | {counts['passed']} | "
                     f"{counts['xfailed']} | {counts['not_implemented']} | "
                     f"{counts['skipped']} | {counts['failed'] + counts['xpassed']} | "
                     f"{r['seconds']:.0f} |")
    return lines + [""]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="benchmarks/scoreboard.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run the suite on each backend, then make the table")
    run.add_argument("--upstream", action="append", metavar="PYTHON",
                     help="a Python whose torch is the upstream to score (repeatable)")
    run.add_argument("--release", action="append", metavar="X.Y.Z", default=[],
                     help="an upstream release to score in a venv of its own, built when "
                          "missing (repeatable)")
    mk = sub.add_parser("make", help="make the table from JSON reports")
    mk.add_argument("reports", nargs="+")
    for command in (run, mk):
        command.add_argument("-o", "--out", default=str(DEFAULT_OUT))
        command.add_argument("--note", default="", help="the machine's load, say")
    args = parser.parse_args(argv)
    if args.command == "run":
        paths = [run_suite(sys.executable, "refimpl")]
        pythons = (args.upstream or ([] if args.release else [sys.executable]))
        pythons += [venv_for(release) for release in args.release]
        paths += [run_suite(python, "torch") for python in pythons]
    else:
        paths = [Path(p) for p in args.reports]
    reports = sorted((json.loads(Path(p).read_text()) for p in paths),
                     key=lambda r: (r["backend"] != "refimpl", r["backend"],
                                    torch_release(r["torch_version"])))
    Path(args.out).write_text(make(reports, args.note) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
