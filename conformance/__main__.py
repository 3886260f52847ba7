"""`python -m conformance`: run the suite against a backend and print the report.

    python -m conformance [--backend NAME|module:attr] [--json FILE] [-k EXPR] [-n N]
                          [--section ID] [-x]

Prints, per SPEC section, how many cases passed, failed, failed as expected (xfailed),
passed unexpectedly (xpassed), are not implemented by the backend, or were skipped;
the backend, the torch version and the world sizes used; then every case that did not
pass, with its reason. Exits 1 on any unexpected result (failed, xpassed, error), 0
otherwise. `--json` writes the run's metadata and one record per case.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path

from conformance.cases.conftest import strip_xdist_group

CASES_DIR = Path(__file__).resolve().parent / "cases"
OUTCOMES = ["passed", "failed", "xfailed", "xpassed", "not_implemented", "skipped"]
SECTIONS = {
    "FC": "1. Functional collectives", "CL": "2. Comm lowering", "BK": "3. Bucketing",
    "RO": "4. Scheduler reorder", "MEM": "5. Memory", "SM": "6. Symmetric memory",
    "CF": "7. Conformance", "SIM": "8. Simulator",
}
UNEXPECTED = {"failed", "xpassed"}


class ReportPlugin:
    """Collects one record per case from pytest's reports (also under xdist)."""

    def __init__(self):
        self.cases: dict[str, dict] = {}

    def pytest_runtest_logreport(self, report):
        cid = strip_xdist_group(report.nodeid.split("/")[-1])
        record = self.cases.setdefault(cid, {"id": cid, "outcome": None, "reason": ""})
        for key, value in report.user_properties:
            record[key] = value
        outcome = _outcome_of(report)
        if outcome is None:
            return
        # setup / call / teardown: the first non-pass wins, a pass only fills a blank.
        if record["outcome"] in (None, "passed") or outcome != "passed":
            if record["outcome"] not in UNEXPECTED:
                record["outcome"] = outcome
                record["reason"] = _reason_of(report, outcome)


def _outcome_of(report) -> str | None:
    if report.when == "call" and report.passed and hasattr(report, "wasxfail"):
        return "xpassed"
    if report.skipped:
        if hasattr(report, "wasxfail"):
            return "xfailed"
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else ""
        return "not_implemented" if reason.startswith("not implemented") else "skipped"
    if report.failed:
        # A strict expected failure that passed is reported by pytest as a failure.
        return "xpassed" if str(report.longrepr).startswith("[XPASS(strict)]") else "failed"
    if report.when == "call":
        return "passed"
    return None


def _reason_of(report, outcome) -> str:
    if outcome == "xfailed":
        return report.wasxfail
    if outcome in ("not_implemented", "skipped") and isinstance(report.longrepr, tuple):
        return report.longrepr[2]
    if outcome == "failed":
        text = str(report.longrepr)
        lines = [ln[2:] for ln in text.splitlines() if ln.startswith("E ")]
        return (lines[0] if lines else text.splitlines()[-1] if text else "")[:300]
    if outcome == "xpassed":
        return "passed, but listed as an expected failure: " + str(report.longrepr)
    return ""


def section_of(spec_ids: list[str]) -> str:
    prefix = spec_ids[0].split("-")[0] if spec_ids else "?"
    return SECTIONS.get(prefix, prefix)


def _pytest_args(args) -> list[str]:
    pytest_args = [str(CASES_DIR), "-q", "-p", "no:cacheprovider", "--backend", args.backend]
    if args.k:
        pytest_args += ["-k", args.k]
    for section in args.section or ():
        pytest_args += ["--section", section]
    if args.exitfirst:
        pytest_args += ["-x"]
    if args.workers:
        pytest_args += ["-n", str(args.workers), "--dist", "loadgroup"]
    else:
        pytest_args += ["-n", "0"]
    return pytest_args + ["--no-header", "-rN"]


def print_report(meta, cases) -> None:
    by_section: dict[str, Counter] = defaultdict(Counter)
    for case in cases:
        by_section[case["section"]][case["outcome"]] += 1
    print()
    print(f"conformance report: backend {meta['backend']}, torch {meta['torch_version']}, "
          f"world sizes {meta['world_sizes'] or '-'}, {meta['seconds']:.0f} s")
    header = f"{'section':28s}" + "".join(f"{o:>16s}" for o in OUTCOMES)
    print(header)
    print("-" * len(header))
    for section in sorted(by_section):
        counts = by_section[section]
        print(f"{section:28s}" + "".join(f"{counts[o]:>16d}" for o in OUTCOMES))
    total = Counter(c["outcome"] for c in cases)
    print(f"{'total':28s}" + "".join(f"{total[o]:>16d}" for o in OUTCOMES))
    notable = [c for c in cases if c["outcome"] != "passed"]
    if notable:
        print("\ncases that did not pass:")
        for c in sorted(notable, key=lambda c: (c["outcome"] not in UNEXPECTED, c["id"])):
            print(f"  {c['outcome']:15s} {c['id']}  [{', '.join(c['spec_ids'])}]")
            if c["reason"]:
                print(f"  {'':15s} {c['reason']}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m conformance", description=__doc__)
    parser.add_argument("--backend", default=os.environ.get("REFIMPL_BACKEND", "refimpl"))
    parser.add_argument("--json", metavar="FILE", help="write the report as JSON")
    parser.add_argument("-k", metavar="EXPR", help="only cases matching this pytest expression")
    parser.add_argument("-n", dest="workers", type=int, default=min(2, os.cpu_count() or 1),
                        help="pytest-xdist workers (0: run in this process); default 2")
    parser.add_argument("--section", action="append", metavar="ID",
                        help="only cases that check a rule of this SPEC section (FC, CL, BK, "
                             "SM, ...); repeatable")
    parser.add_argument("-x", "--exitfirst", action="store_true",
                        help="stop at the first case that fails")
    args = parser.parse_args(argv)

    import pytest
    import torch

    plugin = ReportPlugin()
    start = time.monotonic()
    exit_code = pytest.main(_pytest_args(args), plugins=[plugin])
    cases = [c for c in plugin.cases.values() if c["outcome"] is not None]
    world_sizes = sorted({w for rec in cases for w in rec.get("world_sizes", [])})
    for case in cases:
        case["spec_ids"] = list(case.get("spec_ids", []))
        case["section"] = section_of(case["spec_ids"])
    meta = {"backend": args.backend, "torch_version": torch.__version__,
            "world_sizes": world_sizes, "seconds": time.monotonic() - start,
            "python": sys.version.split()[0], "pytest_exit_code": int(exit_code)}
    print_report(meta, cases)
    if args.json:
        Path(args.json).write_text(json.dumps({**meta, "cases": cases}, indent=1))
    unexpected = [c for c in cases if c["outcome"] in UNEXPECTED]
    if exit_code not in (0, 1, 5) or (exit_code == 1 and not unexpected):
        print(f"pytest exited with code {int(exit_code)}", file=sys.stderr)
        return 1
    if not cases:
        print("no case ran", file=sys.stderr)
        return 1
    return 1 if unexpected else 0


if __name__ == "__main__":
    sys.exit(main())

