"""`python -m conformance`: run the suite against a backend and print the report (CF-7).

Prints a line as each SPEC section's cases are done, then the verdicts by rule (CF-15):
per section, how many of the rules the profile judges conform, and each that does not
(`differs`, with its count of cases and first reason; `not implemented`; `not run`).
Then, per section, how many cases
passed, failed, failed as expected (xfailed), passed unexpectedly (xpassed), are not
implemented by the backend, or were skipped; the backend, the torch version and the
world sizes used; every unexpected result with its reason, and the expected failures and
not-implemented cases as counts per section (every one with its reason under -v). Exits 1
on any unexpected result (failed, xpassed, a case module that fails to import), 0
otherwise. `--profile core|strict|full|core-vN` chooses the levels judged (CF-14, CF-15).
`--json FILE` writes the report of conformance/report.schema.json: the run's metadata,
the verdict of every judged rule and one record per case. `--update-expected-failures
FILE` appends an entry, reason left blank, for each case that failed unexpectedly (CF-4).
`--list`
collects without running: the cases per section and the SPEC IDs that no case names.
`--fuzz N [--seed S]` runs N generated programs (conformance/fuzz/) through the stages
of BK, CL, RO and MEM instead of the cases, with the same report.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import random
import re
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path

from conformance.backends import REGISTERED, BackendSpecError, get_backend
from conformance.cases.conftest import DEFAULT_CASE_TIMEOUT_S, section_of, strip_xdist_group
from conformance.spec import (
    profile_levels,
    rules_of_levels,
    section_prefix,
    section_title,
    sections,
    spec_sha256,
)
from conformance.verdicts import SUITE_SECTIONS, count_conforming, rule_verdicts
from refimpl._rank_process import chosen_device, chosen_process_group

CASES_DIR = Path(__file__).resolve().parent / "cases"
OUTCOMES = ["passed", "failed", "xfailed", "xpassed", "not_implemented", "skipped"]
UNEXPECTED = {"failed", "xpassed"}
# The version of the JSON report's layout (conformance/report.schema.json).
SCHEMA_VERSION = 1

BACKEND_HELP = (
    f"the implementation to test: a registered name ({', '.join(sorted(REGISTERED))}), or "
    "package.module:attr naming a backend object (or a zero-argument callable returning "
    "one) importable from PYTHONPATH; default: $REFIMPL_BACKEND, else refimpl. The "
    "protocol a backend follows is in conformance/README.md")


class ReportPlugin:
    """Collects one record per case from pytest's reports (also under xdist) and prints a
    line when a section's cases are all done."""

    def __init__(self, start: float):
        self.cases: dict[str, dict] = {}
        self.start = start
        self.done: Counter = Counter()
        self.config = None

    def pytest_configure(self, config):
        self.config = config

    def pytest_collectreport(self, report):
        """A case module that fails to import fails the run, in the report too."""
        if report.failed:
            cid = report.nodeid.split("/")[-1] or report.nodeid
            self.cases[cid] = {"id": cid, "outcome": "failed", "spec_ids": [],
                               "reason": _first_error_line(str(report.longrepr))}

    def pytest_runtest_logreport(self, report):
        cid = strip_xdist_group(report.nodeid.split("/")[-1])
        record = self.cases.setdefault(cid, {"id": cid, "outcome": None, "reason": "",
                                             "seconds": 0.0})
        record["seconds"] = round(record["seconds"] + report.duration, 3)  # all three phases
        for key, value in report.user_properties:
            record[key] = value
        outcome = _outcome_of(report)
        # setup / call / teardown: the first non-pass wins, a pass only fills a blank.
        if outcome is not None and (record["outcome"] in (None, "passed")
                                    or outcome != "passed"):
            if record["outcome"] not in UNEXPECTED:
                record["outcome"] = outcome
                record["reason"] = _reason_of(report, outcome)
        if report.when == "teardown" and "section_total" in record:
            self._count_done(record)

    def _count_done(self, record):
        section = section_of(record.get("spec_ids", []))
        self.done[section] += 1
        if self.done[section] != record["section_total"]:
            return
        counts = Counter(c["outcome"] for c in self.cases.values()
                         if c.get("section_total") and section_of(c.get("spec_ids", []))
                         == section)
        summary = ", ".join(f"{counts[o]} {o}" for o in OUTCOMES if counts[o])
        line = (f"[{time.monotonic() - self.start:4.0f} s] {section_title(section)} "
                f"({section}) done: {record['section_total']} cases, {summary}")
        terminal = self.config.pluginmanager.get_plugin("terminalreporter")
        if terminal is None:
            print(line, flush=True)
            return
        # pytest's -q dots leave the cursor mid-line without telling write_line.
        if getattr(getattr(terminal, "_tw", None), "width_of_current_line", 0):
            terminal.write("\n")
        terminal.write_line(line)


class ListPlugin:
    """`--list`: the selected cases with their SPEC IDs, collected but not run."""

    def __init__(self):
        self.cases: list[dict] = []

    def pytest_collection_finish(self, session):
        for item in session.items:
            marker = item.get_closest_marker("spec")
            self.cases.append({"id": strip_xdist_group(item.nodeid.split("/")[-1]),
                               "spec_ids": list(marker.args) if marker else [],
                               "level": dict(item.user_properties).get("level")})


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


def _first_error_line(text: str) -> str:
    lines = [ln[2:] for ln in text.splitlines() if ln.startswith("E ")]
    return (lines[0] if lines else text.splitlines()[-1] if text else "")[:300]


def _reason_of(report, outcome) -> str:
    if outcome == "xfailed":
        return report.wasxfail
    if outcome in ("not_implemented", "skipped") and isinstance(report.longrepr, tuple):
        return report.longrepr[2]
    if outcome == "failed":
        crash = getattr(report.longrepr, "reprcrash", None)  # the exception that ended it
        return crash.message[:1000] if crash else _first_error_line(str(report.longrepr))
    if outcome == "xpassed":
        return "passed, but listed as an expected failure: " + str(report.longrepr)
    return ""


def case_files(sections, cases=None) -> list[str]:
    """The case files that hold a case naming a rule of one of `sections` (their
    `@pytest.mark.spec` IDs, read as text) and, with `cases`, defining one of those case
    functions: a run of some sections (or cases) collects only those, about a second less
    per run than collecting every file."""
    functions = {re.escape(case.split("[", 1)[0]) for case in cases or ()}
    defines = re.compile(rf"^def ({'|'.join(functions)})\(", re.MULTILINE) if functions \
        else None
    files = []
    for path in sorted(CASES_DIR.glob("test_*.py")):
        text = path.read_text()
        marks = re.findall(r"mark\.spec\(([^)]*)\)", text)
        named = {prefix for args in marks for prefix in re.findall(r'"([A-Z0-9]+)-\d+"', args)}
        if named & set(sections) and (defines is None or defines.search(text)):
            files.append(str(path))
    return files


def _pytest_args(args) -> list[str]:
    chosen = args.section or (list(sections()) if args.case else None)
    where = case_files(chosen, args.case) if chosen and not args.list else []
    pytest_args = [*(where or [str(CASES_DIR)]), "-q", "-p", "no:cacheprovider",
                   "--backend", args.backend, "--profile", args.profile]
    if os.environ.get("PYTEST_DISABLE_PLUGIN_AUTOLOAD"):
        pytest_args += ["-p", "xdist"]  # the one plugin the suite needs (-n, --dist)
    if args.k:
        pytest_args += ["-k", args.k]
    for section in args.section or ():
        pytest_args += ["--section", section]
    for first in args.first or ():
        pytest_args += ["--first", first]
    for case in args.case or ():
        pytest_args += ["--case", case]
    if args.exitfirst:
        pytest_args += ["-x"]
    if args.case_timeout is not None:
        pytest_args += ["--case-timeout", str(args.case_timeout)]
    if args.list:
        pytest_args += ["--collect-only", "-q"]  # -qq: counts per file, not every case
    if args.workers and not args.list:
        pytest_args += ["-n", str(args.workers), "--dist", "loadgroup"]
    else:
        pytest_args += ["-n", "0"]
    # The report gives each failure's reason; pytest's own tracebacks stay short.
    return pytest_args + ["--no-header", "-rN", "--tb=short"]


def print_report(meta, cases, verbose=False, rules=None) -> None:
    by_section: dict[str, Counter] = defaultdict(Counter)
    for case in cases:
        by_section[case["section"]][case["outcome"]] += 1
    print()
    print(f"conformance report: backend {_backend_label(meta)}, torch {meta['torch_version']}, "
          f"profile {meta.get('profile', 'full')}, world sizes {meta['world_sizes'] or '-'}, "
          f"{meta['seconds']:.0f} s")
    print(_where(meta))
    if rules is not None:
        print_verdicts(rules, meta.get("profile", "full"))
        print("\ncases:")
    header = f"{'section':28s}" + "".join(f"{o:>16s}" for o in OUTCOMES)
    print(header)
    print("-" * len(header))
    order = list(sections().values())  # SPEC.md's order; unknown sections after it
    for section in sorted(by_section, key=lambda s: (order.index(s) if s in order else
                                                     len(order), s)):
        counts = by_section[section]
        print(f"{section:28s}" + "".join(f"{counts[o]:>16d}" for o in OUTCOMES))
    total = Counter(c["outcome"] for c in cases)
    print(f"{'total':28s}" + "".join(f"{total[o]:>16d}" for o in OUTCOMES))
    listed = [c for c in cases if c["outcome"] in UNEXPECTED or
              (verbose and c["outcome"] != "passed")]
    if listed:
        print("\ncases that did not pass:" if verbose else "\nunexpected results:")
        for c in sorted(listed, key=lambda c: (c["outcome"] not in UNEXPECTED, c["id"])):
            print(f"  {c['outcome']:15s} {c['id']}  [{', '.join(c['spec_ids'])}]")
            for line in c["reason"].splitlines():
                print(f"  {'':15s} {line}")
    if not verbose:
        _print_counts_per_section(cases)


VERDICT_WORDS = {"differs": "differs", "not_implemented": "not implemented",
                 "not_run": "not run"}


def print_verdicts(rules, profile) -> None:
    """The report's first screen (CF-15): per section, the rules that conform of those
    judged, then every rule that does not, with its count of cases and first reason."""
    counts = count_conforming(rules)
    overall = ", ".join(f"{level} {done} of {total}" for level, (done, total) in counts.items())
    print(f"\nverdicts by rule (profile {profile}): rules that conform: {overall or 'none judged'}")
    by_prefix: dict[str, list[dict]] = defaultdict(list)
    for rule in rules:
        by_prefix[section_prefix(rule["id"])].append(rule)
    for prefix, records in by_prefix.items():
        conforming = sum(r["verdict"] == "conforms" for r in records)
        print(f"  {section_title(prefix)} ({prefix}): {conforming} of {len(records)} rules "
              f"conform")
        for rule in records:
            if rule["verdict"] in ("differs", "not_implemented"):
                print("    " + _verdict_line(rule))
        _print_not_run([r for r in records if r["verdict"] == "not_run"])


def _print_not_run(records) -> None:
    """Rules no case of their level ran for, on one line (a run of a few cases leaves
    many); each with the reason of a skip where one was skipped (no GPU, say)."""
    if not records:
        return
    print("    not run: " + ", ".join(
        rule["id"] + (f" ({rule['reason'].splitlines()[0][:100]})" if rule.get("reason")
                      else "") for rule in records))


def _verdict_line(rule) -> str:
    word = VERDICT_WORDS[rule["verdict"]]
    line = f"{rule['id']:8s} [{rule['level']}] {word}"
    if rule["verdict"] == "differs":
        differing = rule.get("differing_cases", 0)
        line += f": {differing} case{'s' * (differing != 1)}"
    reason = rule.get("reason", "")
    entry = rule.get("expected_failure")
    if entry:
        named = f"(finding {entry['finding']})" if "finding" in entry else ""
        reason = f"{entry['class']}{named} {entry['reason']}"
    if reason:
        line += f"; {rule.get('first_case', '')}: {reason.splitlines()[0][:160]}"
    return line


def _where(meta) -> str:
    """The ranks the cases ran on: refimpl's own workers, or the launched world."""
    world = meta.get("launched")
    if world:
        return (f"ranks: a launched world of {world['world_size']} processes (torchrun), "
                f"process group {world['process_group']}, device {world['device']}")
    return (f"ranks: refimpl's worker processes on this machine, process group "
            f"{meta.get('process_group', 'gloo')}, device {meta.get('device', 'cpu')}")


def _backend_label(meta) -> str:
    name, spec = meta["backend"], meta["backend_spec"]
    label = name if name == spec else f"{name} ({spec})"
    return label + (f" [failed to load: {meta['backend_error']}]" if meta.get("backend_error")
                    else "")


def _print_counts_per_section(cases) -> None:
    """Expected failures, not-implemented and skipped cases as counts (reasons: -v)."""
    for outcome in ("xfailed", "not_implemented", "skipped"):
        counts = Counter(c["section"] for c in cases if c["outcome"] == outcome)
        if counts:
            per_section = ", ".join(f"{s} {n}" for s, n in sorted(counts.items()))
            print(f"\n{outcome}: {per_section} (each with its reason: -v)")


def print_listing(cases, sections, profile="full") -> None:
    """`--list`: cases per section and the SPEC IDs of the section (of the profile's
    levels) that no case names."""
    named = {i for c in cases for i in c["spec_ids"]}
    by_section = Counter(c["section"] for c in cases)
    for prefix, ids in _rules_of_profile(profile).items():
        if sections and prefix not in sections:
            continue
        title = section_title(prefix)
        if prefix in SUITE_SECTIONS:
            print(f"{title} ({prefix}): rules of the suite itself, checked by "
                  f"tests/test_conformance_suite.py")
            continue
        missing = [i for i in ids if i not in named]
        if not ids:
            none = "no rules yet" if profile == "full" else f"no rules of profile {profile}"
            print(f"{title} ({prefix}): {by_section[title]} cases, {none}")
            continue
        print(f"{title} ({prefix}): {by_section[title]} cases{_files_of(cases, title)}, "
              f"{len(ids) - len(missing)} of {len(ids)} rules named"
              + (f"; named by no case: {', '.join(missing)}" if missing else ""))
    print("(a case counts under the section of its first rule, whichever file holds it)")


def _files_of(cases, title) -> str:
    """' (file a 10, file b 1)' when a section's cases sit in more than one file."""
    files = Counter(c["id"].split("::")[0] for c in cases if c["section"] == title)
    if len(files) < 2:
        return f" in {next(iter(files))}" if files else ""
    return " (" + ", ".join(f"{n} in {f}" for f, n in files.most_common()) + ")"


def unnamed_rules(cases, sections=(), profile="full") -> dict[str, list[str]]:
    """{prefix: SPEC IDs named by no case} for the sections checked by cases (CF-10)."""
    named = {i for c in cases for i in c["spec_ids"]}
    return {prefix: [i for i in ids if i not in named]
            for prefix, ids in _rules_of_profile(profile).items()
            if prefix not in SUITE_SECTIONS and (not sections or prefix in sections)}


def _rules_of_profile(profile) -> dict[str, list[str]]:
    """rule_ids() keeping the rules of the profile's levels (CF-15)."""
    return rules_of_levels(profile_levels(profile))


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m conformance", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", default=os.environ.get("REFIMPL_BACKEND", "refimpl"),
                        metavar="NAME|module:attr", help=BACKEND_HELP)
    parser.add_argument("--json", metavar="FILE", help="write the report as JSON")
    parser.add_argument("-k", metavar="EXPR", help="only cases matching this pytest expression")
    parser.add_argument("-n", dest="workers", type=int, default=min(2, os.cpu_count() or 1),
                        help="pytest-xdist workers (0: run in this process); default 2")
    parser.add_argument("--section", action="append", metavar="ID",
                        help="only cases that check a rule of this SPEC section ("
                             f"{', '.join(sections()) or 'FC, CL, ...'}: the prefixes of "
                             "SPEC.md's sections); repeatable")
    parser.add_argument("--first", metavar="ID_OR_CASE", action="append",
                        help="run the cases naming this SPEC ID (e.g. FC-19), or the case of "
                             "this name (with or without its parameters), first; repeatable")
    parser.add_argument("--case", metavar="NAME", action="append",
                        help="only the case of this name (with its parameters, as the report "
                             "names it, e.g. test_gradient[2-all_reduce_sum]; or without, "
                             "for all of them); repeatable")
    parser.add_argument("-x", "--exitfirst", action="store_true",
                        help="stop at the first case that fails")
    parser.add_argument("--case-timeout", type=float, metavar="SECONDS",
                        help="fail a case still running after this many seconds (default: "
                             f"$REFIMPL_CASE_TIMEOUT, else {DEFAULT_CASE_TIMEOUT_S:g}; 0: none)")
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="list every case that did not pass with its reason (expected "
                             "failures, not implemented, skipped), not only counts")
    parser.add_argument("--profile", default="full", metavar="PROFILE",
                        help="the rules judged, by level (SPEC.md CF-14): core (upstream's "
                             "contract), strict (core + refimpl's added guarantees), full "
                             "(default: every level, extensions too), or core-vN (a frozen "
                             "list of core cases, conformance/levels/core-vN.txt)")
    parser.add_argument("--update-expected-failures", metavar="FILE",
                        help="append to FILE an entry for each case that failed "
                             "unexpectedly, its class and reason left for you to write (the "
                             "loader refuses it until you do; CF-4)")
    parser.add_argument("--list", action="store_true",
                        help="collect only: cases per section and the SPEC IDs no case names")
    parser.add_argument("--fuzz", type=int, metavar="N",
                        help="run N generated programs instead of the hand-written cases, "
                             "each through every stage of BK, CL, RO, MEM the backend "
                             "implements (--section: some of them); a failure is shrunk and "
                             "printed with its reproducer. See conformance/README.md, "
                             "'Generated programs'")
    parser.add_argument("--device", default=chosen_device(),
                        metavar="DEVICE",
                        help="where the ranks of numeric cases make their tensors: cpu "
                             "(default; $REFIMPL_DEVICE), cuda (each rank its own GPU), ...; "
                             "the oracle stays on the CPU")
    parser.add_argument("--process-group", default=chosen_process_group(),
                        metavar="NAME|module:attr",
                        help="the torch.distributed backend the ranks talk over: gloo "
                             "(default; $REFIMPL_PROCESS_GROUP), nccl, a name registered "
                             "with Backend.register_backend, or module:attr of a function "
                             "that registers one and returns its name")
    parser.add_argument("--seed", type=int, metavar="S",
                        help="with --fuzz: program i is the program of seed S + i, so a run "
                             "repeats with its seed (default: a random seed, printed)")
    return parser


def _load_backend(spec: str) -> tuple[str, str]:
    """(the backend's own name, the load error or ''); an unknown spec exits (CF-1)."""
    try:
        return get_backend(spec).name, ""
    except BackendSpecError as exc:
        print(f"python -m conformance: {exc}", file=sys.stderr)
        sys.exit(2)
    except Exception as exc:  # its cases fail with the error: the run still reports
        return spec, f"{type(exc).__name__}: {exc}"


# Options every rank of a launched world must be started with alike (CF-13); --json and
# -v only shape what rank 0 writes.
AGREED_OPTIONS = {"backend": "--backend", "k": "-k", "section": "--section",
                  "first": "--first", "case": "--case", "exitfirst": "-x",
                  "case_timeout": "--case-timeout", "list": "--list", "device": "--device",
                  "profile": "--profile",
                  "process_group": "--process-group"}


def _join_world(parser, args):
    """The launched world this run is a rank of (torchrun), None for a run on refimpl's
    own worker processes. Either way the process group and device are checked before
    any case runs, on every rank, naming the option (CF-13)."""
    from refimpl import launched

    try:
        if not launched.launched_by_env():
            launched.check_device(args.device, launched.resolve_process_group(
                args.process_group))
            return None
        if args.fuzz is not None:
            parser.error("--fuzz: generated programs run in one process; run it without "
                         "torchrun")
        world = launched.attach(args.process_group, args.device)
        world.agree({flag: getattr(args, dest) for dest, flag in AGREED_OPTIONS.items()})
        return world
    except (ValueError, RuntimeError) as exc:
        print(f"python -m conformance: {exc}", file=sys.stderr, flush=True)
        world = launched.joined()
        if world is not None:  # torchrun stops the others once one exits: all say it first
            world.finish()
        sys.exit(2)


def main(argv=None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    world = _join_world(parser, args)
    code = _main(parser, args, world)
    if world is not None:  # torchrun stops every rank once one exits non-zero: rank 0
        world.finish()     # must have written its report by then
    return code


def _main(parser, args, world) -> int:
    # The workers of refimpl's harness read both (REFIMPL_* variables follow every task).
    os.environ["REFIMPL_PROCESS_GROUP"] = args.process_group
    os.environ["REFIMPL_DEVICE"] = args.device
    _check_selection(parser, args)
    if args.fuzz is not None or args.seed is not None:
        return fuzz_main(parser, args)
    import pytest
    import torch

    start = time.monotonic()
    name, error = _load_backend(args.backend)
    # Everything imported so far (torch's are some million objects) lives for the whole
    # run: out of the collector's sight, the full collections pytest makes at the end
    # cost milliseconds, not a second.
    gc.freeze()
    plugin = ListPlugin() if args.list else ReportPlugin(start)
    if world is not None:
        args.workers = 0  # the launched processes are the ranks: one pytest per rank
    quiet = world is not None and world.rank != 0  # every rank checks; rank 0 reports
    with open(os.devnull, "w") if quiet else contextlib.nullcontext() as sink, \
            contextlib.redirect_stdout(sink) if quiet else contextlib.nullcontext():
        exit_code = pytest.main(_pytest_args(args), plugins=[plugin])
    meta = {"backend": name, "backend_spec": args.backend, "torch_version": torch.__version__,
            "python": sys.version.split()[0], "pytest_exit_code": int(exit_code),
            "process_group": args.process_group, "device": args.device,
            "profile": args.profile}
    if world is not None:
        meta["launched"] = {"world_size": world.world_size, "rank": world.rank,
                            "process_group": world.process_group, "device": str(world.device)}
    if error:
        meta["backend_error"] = error
    if quiet:
        return _rank_exit_code(args, plugin, exit_code, world)
    if args.list:
        return _finish_listing(args, meta, plugin.cases, exit_code)
    cases = [c for c in plugin.cases.values() if c["outcome"] is not None]
    for case in cases:
        case["spec_ids"] = list(case.get("spec_ids", []))
        case["rules"] = case["spec_ids"]
        case["section"] = section_title(reported_section(case["spec_ids"], args.section))
        case.pop("section_total", None)
    meta["world_sizes"] = sorted({w for rec in cases for w in rec.get("world_sizes", [])})
    meta["seconds"] = time.monotonic() - start
    rules = rule_verdicts(cases, profile_levels(args.profile), args.section)
    print_report(meta, cases, args.verbose, rules)
    if args.json:
        write_json_report(args.json, meta, args.profile, rules, cases)
    if args.update_expected_failures:
        append_expected_failures(args.update_expected_failures, cases, torch.__version__)
    return _exit_status(exit_code, cases, world, explain=True)


def reported_section(spec_ids, selected) -> str:
    """The section a case is counted under: the first of its rules' sections that
    `--section` selected, else that of its first rule."""
    for rule in spec_ids:
        if not selected or section_prefix(rule) in selected:
            return section_prefix(rule)
    return section_of(spec_ids)


def _check_selection(parser, args) -> None:
    """Refused before anything runs: an unknown profile, a section no case checks."""
    try:
        profile_levels(args.profile)
    except ValueError as exc:
        parser.error(str(exc))
    for prefix in args.section or ():
        if prefix in SUITE_SECTIONS:
            print(f"python -m conformance: --section {prefix}: {section_title(prefix)} has no "
                  f"cases: its rules govern the suite itself and are checked by the "
                  f"project's tests (tests/test_conformance_suite.py, tests/test_mutants.py, "
                  f"tests/test_fuzz.py, tests/test_launched.py, tests/test_verdicts.py), not "
                  f"by a backend's run",
                  file=sys.stderr)
            sys.exit(2)
        if prefix not in sections():
            parser.error(f"--section {prefix}: SPEC.md has no such section; its sections are "
                         f"{', '.join(p for p in sections() if p not in SUITE_SECTIONS)}")


def report_header(meta, profile) -> dict:
    """The fields every JSON report opens with (conformance/report.schema.json)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        suite_version = version("refimpl")
    except PackageNotFoundError:  # a checkout on PYTHONPATH, not installed
        suite_version = "unknown"
    return {"schema_version": SCHEMA_VERSION, "suite_version": suite_version,
            "spec_sha256": spec_sha256(), "profile": profile, "backend": meta["backend"],
            "torch_version": meta["torch_version"],
            "process_group": meta.get("process_group", "gloo"),
            "device": meta.get("device", "cpu")}


def write_json_report(path, meta, profile, rules, cases) -> None:
    document = {**report_header(meta, profile), **meta, "rules": rules, "cases": cases}
    Path(path).write_text(json.dumps(document, indent=1))


def append_expected_failures(path, cases, torch_version) -> None:
    """`--update-expected-failures FILE` (CF-4): an entry for each case that failed
    unexpectedly, for the running torch release, with its class and reason blank (the
    loader refuses it until someone writes them, as WPT's metadata update leaves its
    bug links to people). A case that passed unexpectedly is named, not removed."""
    release = torch_version.split("+")[0]
    failed = sorted(c["id"] for c in cases if c["outcome"] == "failed")
    if failed:
        with open(path, "a") as out:
            out.write(f"# added by --update-expected-failures (torch {release}): write each "
                      f"one's class (bug(finding N), choice, missing) and reason\n")
            out.writelines(f"{cid}  [torch=={release}]\n" for cid in failed)
    passed = sorted(c["id"] for c in cases if c["outcome"] == "xpassed")
    print(f"\n--update-expected-failures {path}: {len(failed)} entries appended, reasons to "
          f"write" + "".join(f"\n  passes, remove or condition its entry: {cid}"
                             for cid in passed))


def _exit_status(exit_code, cases, world, explain: bool) -> int:
    """The run's exit status, the same on every rank: 1 on an unexpected result, a pytest
    error or no case run, 2 for a launched world too small for every case, else 0.
    `explain`: say why on stderr (rank 0; the too-small world is said on every rank)."""
    unexpected = any(c["outcome"] in UNEXPECTED for c in cases)
    if exit_code not in (0, 1, 2, 5) or (exit_code in (1, 2) and not unexpected):
        if explain:
            print(f"pytest exited with code {int(exit_code)}", file=sys.stderr)
        return 1
    if not cases:
        if explain:
            print("no case ran", file=sys.stderr)
        return 1
    small = _world_too_small(world, cases)
    if small:
        print(f"python -m conformance: {small}", file=sys.stderr)
        return 2
    return 1 if unexpected else 0


def _world_too_small(world, cases) -> str | None:
    """A launched world smaller than every selected case needs (each skipped before any
    rank ran it) is a bad launch, not a passing run (CF-13)."""
    needs = [c.get("needs_ranks") for c in cases]
    if world is None or None in needs:
        return None
    least = min(needs)
    return (f"--nproc-per-node: the launched world of {world.world_size} ranks is too small "
            f"for every selected case (each needs {least} ranks or more): launch at least "
            f"{least} [CF-13]")


def _rank_exit_code(args, plugin, exit_code, world) -> int:
    """A rank other than 0 of a launched world: no report, the exit status rank 0 gives
    (every rank checked the same assertions)."""
    if args.list:
        return 0 if exit_code in (0, 5) else 1
    cases = [c for c in plugin.cases.values() if c["outcome"] is not None]
    return _exit_status(exit_code, cases, world, explain=False)


def fuzz_main(parser, args) -> int:
    """`--fuzz N`: generated programs instead of the cases (conformance/fuzz/); the same
    report, one record per (program, stage)."""
    from conformance import fuzz

    sections = _fuzz_sections(parser, args, fuzz.STAGES)
    import torch

    start = time.monotonic()
    name, error = _load_backend(args.backend)
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(2**31)
    print(f"generated programs: {args.fuzz} from --seed {seed}, sections {' '.join(sections)}, "
          f"backend {args.backend}", flush=True)
    timeout = args.case_timeout if args.case_timeout is not None else fuzz.STAGE_TIMEOUT_S
    if error:  # every record fails with the load error (CF-7)
        records = [fuzz.load_error_record(stage, seed, i, error)
                   for i in range(args.fuzz) for stage in sections]
    else:
        records = fuzz.run(get_backend(args.backend), args.backend, args.fuzz, seed, sections,
                           verbose=args.verbose, exitfirst=args.exitfirst,
                           timeout_s=timeout or 10.0**6)
    meta = {"backend": name, "backend_spec": args.backend, "torch_version": torch.__version__,
            "python": sys.version.split()[0],
            "fuzz": {"programs": args.fuzz, "seed": seed, "sections": sections},
            "world_sizes": sorted({w for r in records for w in r["world_sizes"]}),
            "seconds": time.monotonic() - start}
    if error:
        meta["backend_error"] = error
    meta.update(process_group=args.process_group, device=args.device, profile=args.profile)
    rules = rule_verdicts(records, profile_levels(args.profile), sections)
    print_report(meta, records, args.verbose, rules)
    if args.json:
        write_json_report(args.json, meta, args.profile, rules, records)
    return 1 if any(r["outcome"] in UNEXPECTED for r in records) else 0


def _fuzz_sections(parser, args, stages) -> list[str]:
    """The sections a --fuzz run checks; what --fuzz cannot do is refused (exit 2)."""
    if args.fuzz is None:
        parser.error("--seed: only with --fuzz N")
    if args.fuzz < 1:
        parser.error(f"--fuzz: N must be a number of programs, 1 or more; got {args.fuzz}")
    for flag, given in (("-k", args.k), ("--first", args.first), ("--case", args.case),
                        ("--list", args.list)):
        if given:
            parser.error(f"--fuzz: {flag} selects hand-written cases; not with --fuzz")
    from conformance.fuzz import DEFAULT_STAGES

    sections = list(dict.fromkeys(args.section or DEFAULT_STAGES))
    for section in sections:
        if section not in stages:
            parser.error(f"--fuzz: --section {section}: programs are generated for "
                         f"{', '.join(stages)} only")
    return sections


def _finish_listing(args, meta, cases, exit_code) -> int:
    for case in cases:
        case["section"] = section_title(section_of(case["spec_ids"]))
    sections = set(args.section or ())
    print()
    print_listing(cases, sections, args.profile)
    if args.json:
        unnamed = unnamed_rules(cases, sections, args.profile)
        Path(args.json).write_text(json.dumps({**meta, "cases": cases, "unnamed": unnamed},
                                              indent=1))
    return 0 if exit_code in (0, 5) else 1


if __name__ == "__main__":
    sys.exit(main())
