"""pytest wiring of the conformance suite: --backend, SPEC IDs, expected failures.

- `--backend NAME` (or REFIMPL_BACKEND) selects the backend; the `backend` fixture gives it.
  An unknown name stops the run (CF-1); a backend whose import raises fails every case
  with that error, so the run still reports case by case (CF-7).
- `@pytest.mark.spec("FC-1", ...)` names the SPEC rules a case checks; every case must
  (CF-2). A case belongs to the section of its first ID.
- A case that hits `NotImplementedConcept` is reported "not implemented" (a skip whose
  reason starts with that phrase), never passed (CF-3).
- `conformance/expected_failures/<backend>.txt`: `case-id  [torch<2.14] reason` per line,
  the bracketed torch-version condition optional; listed cases that apply to the running
  torch are strict expected failures (an unexpected pass fails the run); an entry
  matching no case warns (CF-4).
- `--case-timeout SECONDS` (or REFIMPL_CASE_TIMEOUT; default 600, 0: none): a case still
  running after that long fails, naming the limit, instead of hanging the run (CF-11).
- `--section ID` keeps the cases naming a rule of that section; `--case NAME` keeps the
  case of that name (with its parameters, or without for all of them); `--first X` runs the
  cases that X names (a SPEC ID, or a case's name with or without its parameters) before
  the others; given again, the next X's cases come next (with `-x`, a targeted failure
  ends the run early: the mutation check uses it).
"""

from __future__ import annotations

import hashlib
import os
import re
import signal
import threading
import warnings
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pytest

from conformance import harness
from conformance.backends import BackendSpecError, NotImplementedConcept, get_backend
from conformance.spec import PROFILES, case_level, profile_levels, rule_levels, section_prefix
from refimpl import launched

NOT_IMPLEMENTED = "not implemented"
# Far above any case: the whole suite takes about a minute against refimpl on 2 workers.
DEFAULT_CASE_TIMEOUT_S = 600.0
XFAIL_DIR = Path(__file__).resolve().parent.parent / "expected_failures"
LEVELS_DIR = Path(__file__).resolve().parent.parent / "levels"
CASES_DIR = Path(__file__).resolve().parent
_LOADED = pytest.StashKey[tuple]()
_CASE_TIMEOUT = pytest.StashKey[float]()


def pytest_addoption(parser):
    parser.addoption("--backend", default=None,
                     help="conformance backend: a registered name or package.module:attr")
    parser.addoption("--section", action="append", default=None,
                     help="only cases that check a rule of this SPEC section (FC, SM, ...)")
    parser.addoption("--first", metavar="ID_OR_CASE", action="append", default=None,
                     help="run the cases naming this SPEC ID, or the case of this name, "
                          "before the others (repeatable: in the order given)")
    parser.addoption("--case", metavar="NAME", action="append", default=None,
                     help="only the case of this name (with its parameters, or without for "
                          "all of them); repeatable")
    parser.addoption("--profile", default=None, metavar="PROFILE",
                     help="the levels judged: core, strict (core + strict), full (default; "
                          "every level), or core-vN, a frozen list of core cases [CF-15]")
    parser.addoption("--case-timeout", type=float, default=None, metavar="SECONDS",
                     help="fail a case still running after this many seconds (default: "
                          f"$REFIMPL_CASE_TIMEOUT, else {DEFAULT_CASE_TIMEOUT_S:g}; 0: none)")


def backend_spec(config) -> str:
    return config.getoption("--backend") or os.environ.get("REFIMPL_BACKEND") or "refimpl"


def pytest_configure(config):
    config.addinivalue_line("markers", "spec(*ids): the SPEC.md rules a conformance case checks")
    config.stash[_CASE_TIMEOUT] = case_timeout(config)  # refused before any case runs


def loaded_backend(config):
    """(backend, None), or (None, the exception its import raised); an unknown name or an
    object that is not a backend stops the run instead [CF-1]."""
    if _LOADED not in config.stash:
        try:
            config.stash[_LOADED] = (get_backend(backend_spec(config)), None)
        except BackendSpecError as exc:
            raise pytest.UsageError(str(exc)) from None
        except Exception as exc:  # the backend's own code is broken: every case fails with it
            config.stash[_LOADED] = (None, exc)
    return config.stash[_LOADED]


class BackendLoadError(RuntimeError):
    """The selected backend could not be imported or built."""


@pytest.fixture(scope="session")
def backend(request):
    loaded, error = loaded_backend(request.config)
    if error is not None:
        raise BackendLoadError(f"--backend {backend_spec(request.config)!r} failed to load: "
                               f"{type(error).__name__}: {error}") from error
    return loaded


def case_id(item) -> str:
    """The id used in expected-failure files: `file.py::test_name[params]`."""
    return strip_xdist_group(item.nodeid.split("/")[-1])


def strip_xdist_group(nodeid: str) -> str:
    """pytest-xdist's loadgroup appends `@group` to node ids; case ids never carry it."""
    return nodeid.split("@", 1)[0]


def section_of(spec_ids) -> str:
    """The section prefix a case is reported under: that of its first SPEC ID."""
    return section_prefix(spec_ids[0]) if spec_ids else "?"


# --- expected failures (CF-4) ----------------------------------------------------------

_CONDITION = re.compile(r"\[torch\s*([^\]]*)\]\s*")
_CLAUSE = re.compile(r"^(<=|>=|==|!=|<|>)\s*(\d+(?:\.\d+)*)$")


def torch_release(version) -> tuple[int, ...]:
    """(2, 14, 1) for '2.14.1+cu130' or '2.14.1a0'."""
    return tuple(int(p) for p in re.match(r"\d+(?:\.\d+)*", str(version)).group().split("."))


def torch_version_matches(condition: str, version) -> bool:
    """Whether `version` satisfies `condition` ('<2.14', '>=2.13,<2.15'): release numbers
    compared, the shorter padded with zeros (so '2.14' means 2.14.0)."""
    have = torch_release(version)
    for clause in condition.split(","):
        match = _CLAUSE.match(clause.strip())
        if match is None:
            raise ValueError(f"torch version condition {clause.strip()!r}: expected an "
                             f"operator (<, <=, >, >=, ==, !=) and a version like 2.14")
        op, want = match.group(1), torch_release(match.group(2))
        width = max(len(have), len(want))
        a, b = have + (0,) * (width - len(have)), want + (0,) * (width - len(want))
        if not {"<": a < b, "<=": a <= b, ">": a > b, ">=": a >= b,
                "==": a == b, "!=": a != b}[op]:
            return False
    return True


@dataclass(frozen=True)
class ExpectedFailure:
    """One entry of an expected-failures file (CF-4): its class, what it names, its reason."""

    case: str
    kind: str  # one of ENTRY_CLASSES
    reason: str  # opens with the rules it concerns: "FC-18: upstream ..."
    finding: int | None = None  # bug: the number of its upstream_findings.md finding
    issue: int | None = None  # bug: the upstream issue, where one exists
    where: str = ""  # file:line, for errors

    def __str__(self) -> str:
        named = "" if self.finding is None else f"(finding {self.finding}" + (
            f", pytorch#{self.issue})" if self.issue else ")")
        return f"{self.kind}{named} {self.reason}"


# bug: upstream breaks a rule it claims (a finding); choice: upstream's documented
# behaviour differs from a strict or extension rule; missing: a concept not implemented.
ENTRY_CLASSES = ("bug", "choice", "missing")
_CLASS = re.compile(r"(bug|choice|missing)(?:\(([^)]*)\))?(?=\s|$)\s*")
_BUG_NAMES = re.compile(r"finding (\d+)(?:,\s*pytorch#(\d+))?$")
FINDINGS_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / \
    "upstream_findings.md"


def finding_numbers(path: Path = FINDINGS_PATH) -> set[int]:
    """The numbers of upstream_findings.md's findings (`## N. title`)."""
    text = path.read_text() if path.exists() else ""
    return {int(n) for n in re.findall(r"^## (\d+)\. ", text, re.MULTILINE)}


def parse_entry(cid: str, text: str, where: str, findings: set[int] | None,
                findings_name: str = FINDINGS_PATH.name) -> ExpectedFailure:
    """An entry's class and reason (what follows its torch condition); a missing class,
    a bug naming no known finding, or an empty reason is refused, naming the line [CF-4]."""
    match = _CLASS.match(text)
    if match is None:
        raise pytest.UsageError(
            f"{where}: {cid}: the entry has no class: write `bug(finding N) reason`, "
            f"`choice reason` or `missing reason` after the case id (and its torch "
            f"condition) [CF-4]")
    kind, named, reason = match.group(1), match.group(2), text[match.end():].strip()
    finding = issue = None
    if kind == "bug":
        names = _BUG_NAMES.match((named or "").strip())
        if names is None:
            raise pytest.UsageError(
                f"{where}: {cid}: a bug entry names its finding of upstream_findings.md: "
                f"`bug(finding N)` or `bug(finding N, pytorch#ISSUE)` [CF-4]")
        finding, issue = int(names.group(1)), names.group(2) and int(names.group(2))
        if findings is not None and finding not in findings:
            raise pytest.UsageError(f"{where}: {cid}: bug(finding {finding}): "
                                    f"{findings_name} has no finding {finding} [CF-4]")
    elif named is not None:
        raise pytest.UsageError(f"{where}: {cid}: only a bug entry names a finding [CF-4]")
    if not reason:
        raise pytest.UsageError(f"{where}: {cid}: the {kind} entry gives no reason: say "
                                f"what the implementation does instead [CF-4]")
    return ExpectedFailure(cid, kind, reason, finding, issue, where)


_FINDINGS_LINE = re.compile(r"^#\s*findings:\s*(\S+)\s*$", re.MULTILINE)


def findings_file_of(path: Path, text: str) -> Path:
    """The list of findings that `bug(finding N)` entries of `path` (whose `text` this is)
    name: the file a `# findings: PATH` line names (relative to `path`'s folder), else
    upstream's (an outside implementation keeps its own findings, CF-4)."""
    named = _FINDINGS_LINE.search(text)
    return (path.parent / named.group(1)).resolve() if named else FINDINGS_PATH


def read_expected_failures(path: Path, torch_version=None
                           ) -> tuple[dict[str, ExpectedFailure], dict[str, list]]:
    """({case id: entry} of the entries that apply to `torch_version` (all when None),
    {case id: every entry the file lists for it}). Every entry is checked, applying or
    not (CF-4)."""
    applying: dict[str, ExpectedFailure] = {}
    listed: dict[str, list[ExpectedFailure]] = {}
    if not path.exists():
        return applying, listed
    text = path.read_text()
    findings_path = findings_file_of(path, text)
    findings = finding_numbers(findings_path) if findings_path.exists() else None
    for number, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        cid, _, rest = line.partition(" ")
        rest = rest.strip()
        condition = _CONDITION.match(rest)
        applies = True
        if condition is not None:
            rest = rest[condition.end():]
            try:
                applies = torch_version is None or torch_version_matches(condition.group(1),
                                                                         torch_version)
            except ValueError as exc:
                raise pytest.UsageError(f"{path}:{number}: {exc} [CF-4]") from None
        entry = parse_entry(cid, rest, f"{path}:{number}", findings, findings_path.name)
        listed.setdefault(cid, []).append(entry)
        if not applies:
            continue
        if cid in applying and torch_version is not None:  # None: every entry, any version
            raise pytest.UsageError(f"{path}:{number}: {cid} is listed twice for this torch "
                                    f"version [CF-4]")
        applying[cid] = entry
    return applying, listed


def refuse_choice_on_core(listed: dict[str, list], levels_of_cases: dict[str, str]) -> None:
    """A `choice` entry may only excuse a strict or extension case: upstream's contract
    is what a core rule states, so a core difference is a bug or a SPEC mistake [CF-4]."""
    for cid, entries in listed.items():
        for entry in entries:
            if entry.kind == "choice" and levels_of_cases.get(cid) == "core":
                raise pytest.UsageError(
                    f"{entry.where}: {cid}: a choice entry on a core case (its rules are "
                    f"all core): a difference from a core rule is an upstream bug "
                    f"(`bug(finding N)`) or a mistake in SPEC.md, not a choice [CF-4]")


def expected_failures_file(backend) -> Path:
    """The backend's own list if it names one, else expected_failures/<name>.txt."""
    own = getattr(backend, "expected_failures", None)
    return Path(own) if own else XFAIL_DIR / f"{backend.name}.txt"


def expected_failures_path(config) -> Path | None:
    """The loaded backend's expected failures; none when the backend failed to load
    (every case fails then)."""
    loaded, _ = loaded_backend(config)
    return None if loaded is None else expected_failures_file(loaded)


def _conformance_items(items):
    return [item for item in items if CASES_DIR in Path(item.path).resolve().parents]


@pytest.hookimpl(tryfirst=True)  # before -k deselects: stale entries are judged on all cases
def pytest_collection_modifyitems(config, items):
    import torch

    path = expected_failures_path(config)
    expected, listed = read_expected_failures(path, torch.__version__) if path else ({}, {})
    levels = rule_levels()
    case_levels = {}
    for item in _conformance_items(items):
        marker = item.get_closest_marker("spec")
        if marker is None:
            raise pytest.UsageError(f"{item.nodeid}: a conformance case must name its SPEC "
                                    f"IDs with @pytest.mark.spec [CF-2]")
        cid = case_id(item)
        level = case_levels[cid] = case_level(marker.args, levels)
        item.user_properties += [("spec_ids", list(marker.args)), ("level", level)]
        if cid in expected:
            entry = expected[cid]
            item.user_properties += [("expected_failure", _entry_record(entry))]
            item.add_marker(pytest.mark.xfail(reason=str(entry), strict=True))
    refuse_choice_on_core(listed, case_levels)
    collected = {Path(item.path).name for item in _conformance_items(items)}
    left_out = {p.name for p in CASES_DIR.glob("test_*.py")} - collected
    for cid in sorted(set(listed) - set(case_levels)):
        if cid.split("::")[0] not in left_out:  # a run of some case files judges only those
            warnings.warn(f"{path.name}: {cid!r} matches no case [CF-4]", stacklevel=1)
    _select_profile(config, items, set(case_levels), left_out)
    _select_sections(config, items)
    _select_cases(config, items)
    _run_first(config, items)


def _entry_record(entry) -> dict:
    """What a case's report record says of the expected-failure entry that applied."""
    record = {"class": entry.kind, "reason": entry.reason}
    if entry.finding is not None:
        record["finding"] = entry.finding
    if entry.issue:
        record["upstream_issue"] = entry.issue
    return record


# --- profiles (CF-15) ------------------------------------------------------------------

def frozen_profile_path(profile: str) -> Path:
    """conformance/levels/<profile>.txt: the case ids a `core-vN` profile runs."""
    return LEVELS_DIR / f"{profile}.txt"


def read_frozen_profile(profile: str) -> list[str]:
    path = frozen_profile_path(profile)
    if not path.exists():
        known = sorted(p.stem for p in LEVELS_DIR.glob("core-v*.txt"))
        raise pytest.UsageError(f"--profile {profile}: no such frozen list ({path}); known: "
                                f"{', '.join(known) or 'none'} [CF-16]")
    return [line.strip() for line in path.read_text().splitlines()
            if line.strip() and not line.startswith("#")]


def _select_profile(config, items, collected_ids, left_out) -> None:
    """--profile core|strict|full keeps the cases of its levels; core-vN keeps exactly the
    cases of its frozen list, every one of which must still exist."""
    profile = config.getoption("--profile") or "full"
    try:
        wanted_levels = profile_levels(profile)
    except ValueError as exc:
        raise pytest.UsageError(str(exc)) from None
    if profile in PROFILES:
        _keep_only(config, items, lambda item: dict(item.user_properties).get("level",
                                                                               "core")
                   in wanted_levels)
        return
    keep = frozen_cases(profile, collected_ids, left_out)
    _keep_only(config, items, lambda item: case_id(item) in keep)


def frozen_cases(profile: str, collected_ids, left_out=()) -> set[str]:
    """The case ids of a frozen profile, every one of which must still be collected (or
    sit in a case file this run leaves out) [CF-16]."""
    frozen = read_frozen_profile(profile)
    gone = [cid for cid in frozen if cid not in collected_ids
            and cid.split("::")[0] not in left_out]
    if gone:
        raise pytest.UsageError(
            f"--profile {profile}: {len(gone)} cases of {frozen_profile_path(profile).name} "
            f"no longer exist (first: {gone[0]}); a frozen list never changes: cut a new "
            f"version instead [CF-16]")
    return set(frozen)


def _spec_ids(item) -> tuple:
    marker = item.get_closest_marker("spec")
    return marker.args if marker is not None else ()


def _keep_only(config, items, wanted) -> None:
    """Deselect (as pytest reports it) every item for which `wanted(item)` is false."""
    keep, drop = [], []
    for item in items:
        (keep if wanted(item) else drop).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


def _select_sections(config, items):
    sections = set(config.getoption("--section") or ())
    if sections:
        _keep_only(config, items, lambda item: any(section_prefix(i) in sections
                                                    for i in _spec_ids(item)))


def _select_cases(config, items):
    cases = set(config.getoption("--case") or ())
    if cases:
        _keep_only(config, items, lambda item: bool(
            {item.name, getattr(item, "originalname", item.name)} & cases))


def _run_first(config, items):
    firsts = config.getoption("--first") or []

    def rank(item) -> int:
        """The position of the first `--first` value naming the item; after all if none."""
        names = (*_spec_ids(item), item.name, getattr(item, "originalname", item.name))
        return next((i for i, first in enumerate(firsts) if first in names), len(firsts))

    if firsts:
        items.sort(key=rank)  # stable: the suite's order within each rank


def pytest_collection_finish(session):
    """Each case carries its section's number of selected cases, so that the runner can
    say when a section is complete (also under xdist, where only workers collect). In a
    launched world every rank must have collected the same cases in the same order
    (CF-13): checked here, before any case runs."""
    items = _conformance_items(session.items)
    world = launched.current()
    if world is not None:
        ids = [case_id(item) for item in items]
        try:
            world.agree({"selected cases": hashlib.sha256("\n".join(ids).encode()).hexdigest()
                         + f" ({len(ids)} cases)"})
        except launched.MismatchedRanks as exc:
            raise pytest.UsageError(str(exc)) from None
    totals = Counter(section_of(_spec_ids(item)) for item in items)
    for item in items:
        item.user_properties.append(("section_total", totals[section_of(_spec_ids(item))]))


@pytest.fixture(autouse=True)
def _record_world_sizes(request):
    """Which world sizes a case ran on, for the report."""
    harness.WORLD_SIZES_USED.clear()
    yield
    request.node.user_properties.append(("world_sizes", sorted(harness.WORLD_SIZES_USED)))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if call.excinfo is None:
        return
    if call.excinfo.errisinstance(NotImplementedConcept):
        reason = f"{NOT_IMPLEMENTED}: {call.excinfo.value}"
    elif call.excinfo.errisinstance(launched.NotOnThisWorld):  # CF-13: never a pass
        reason = f"launched world: {call.excinfo.value}"
        if call.excinfo.value.needs_ranks is not None:  # the report's "needs_ranks"
            report.user_properties.append(("needs_ranks", call.excinfo.value.needs_ranks))
    else:
        return
    report.outcome = "skipped"
    report.longrepr = (str(item.path), item.location[1] or 0, reason)
    if hasattr(report, "wasxfail"):
        del report.wasxfail


# --------------------------------------------------------------------------------------
# CF-11: a case that never returns fails, the run goes on
# --------------------------------------------------------------------------------------
class CaseTimeout(Exception):
    """A case ran past --case-timeout (CF-11)."""


def case_timeout(config) -> float:
    """--case-timeout, else $REFIMPL_CASE_TIMEOUT, else the default; a negative one stops
    the run."""
    limit = config.getoption("--case-timeout")
    if limit is None:
        limit = float(os.environ.get("REFIMPL_CASE_TIMEOUT", DEFAULT_CASE_TIMEOUT_S))
    if limit < 0:
        raise pytest.UsageError(f"--case-timeout: expected seconds >= 0, got {limit:g}")
    return limit


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    """The case's call under a timer: a backend's pass that loops forever is a failure
    naming the limit, and the next case runs. (A SIGALRM interrupts Python code; native
    code that never returns to Python is not interrupted, which refimpl's C waits avoid
    by their own deadlines, SM-11.)"""
    limit = item.config.stash[_CASE_TIMEOUT]
    if not limit or threading.current_thread() is not threading.main_thread() or \
            not hasattr(signal, "setitimer"):
        yield
        return

    def expire(signum, frame):
        raise CaseTimeout(f"the case ran past --case-timeout {limit:g} s: a hang, or a "
                          f"pass that never returns [CF-11]")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, limit)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
