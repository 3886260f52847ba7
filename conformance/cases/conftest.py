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
from pathlib import Path

import pytest

from conformance import harness
from conformance.backends import BackendSpecError, NotImplementedConcept, get_backend
from conformance.spec import section_prefix
from refimpl import launched

NOT_IMPLEMENTED = "not implemented"
# Far above any case: the whole suite takes about a minute against refimpl on 2 workers.
DEFAULT_CASE_TIMEOUT_S = 600.0
XFAIL_DIR = Path(__file__).resolve().parent.parent / "expected_failures"
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


def read_expected_failures(path: Path, torch_version=None) -> tuple[dict[str, str], set[str]]:
    """({case id: reason} of the entries that apply to `torch_version` (all when None),
    every case id the file lists)."""
    applying: dict[str, str] = {}
    listed: set[str] = set()
    if not path.exists():
        return applying, listed
    for number, line in enumerate(path.read_text().splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        cid, _, rest = line.partition(" ")
        rest = rest.strip()
        condition = _CONDITION.match(rest)
        listed.add(cid)
        if condition is not None:
            rest = rest[condition.end():]
            try:
                applies = torch_version is None or torch_version_matches(condition.group(1),
                                                                         torch_version)
            except ValueError as exc:
                raise pytest.UsageError(f"{path}:{number}: {exc} [CF-4]") from None
            if not applies:
                continue
        if cid in applying:
            raise pytest.UsageError(f"{path}:{number}: {cid} is listed twice for this torch "
                                    f"version [CF-4]")
        applying[cid] = rest or "no reason given"
    return applying, listed


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
    expected, listed = read_expected_failures(path, torch.__version__) if path else ({}, set())
    seen = set()
    for item in _conformance_items(items):
        marker = item.get_closest_marker("spec")
        if marker is None:
            raise pytest.UsageError(f"{item.nodeid}: a conformance case must name its SPEC "
                                    f"IDs with @pytest.mark.spec [CF-2]")
        item.user_properties.append(("spec_ids", list(marker.args)))
        cid = case_id(item)
        seen.add(cid)
        if cid in expected:
            item.add_marker(pytest.mark.xfail(reason=expected[cid], strict=True))
    collected = {Path(item.path).name for item in _conformance_items(items)}
    left_out = {p.name for p in CASES_DIR.glob("test_*.py")} - collected
    for cid in sorted(listed - seen):
        if cid.split("::")[0] not in left_out:  # a run of some case files judges only those
            warnings.warn(f"{path.name}: {cid!r} matches no case [CF-4]", stacklevel=1)
    _select_sections(config, items)
    _select_cases(config, items)
    _run_first(config, items)


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
