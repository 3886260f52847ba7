"""pytest wiring of the conformance suite: --backend, SPEC IDs, expected failures.

- `--backend NAME` (or REFIMPL_BACKEND) selects the backend; the `backend` fixture gives it.
- `@pytest.mark.spec("FC-1", ...)` names the SPEC rules a case checks; every case must.
- A case that hits `NotImplementedConcept` is reported "not implemented" (a skip whose
  reason starts with that phrase), never passed.
- `conformance/expected_failures/<backend>.txt`: `case-id  reason` per line; listed cases
  are strict expected failures (an unexpected pass fails the run); an entry matching no
  case warns.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import pytest

from conformance import harness
from conformance.backends import NotImplementedConcept, get_backend

NOT_IMPLEMENTED = "not implemented"
XFAIL_DIR = Path(__file__).resolve().parent.parent / "expected_failures"


def pytest_addoption(parser):
    parser.addoption("--backend", default=None,
                     help="conformance backend: a registered name or package.module:attr")
    parser.addoption("--section", action="append", default=None,
                     help="only cases that check a rule of this SPEC section (FC, SM, ...)")


def backend_spec(config) -> str:
    return config.getoption("--backend") or os.environ.get("REFIMPL_BACKEND") or "refimpl"


def pytest_configure(config):
    config.addinivalue_line("markers", "spec(*ids): the SPEC.md rules a conformance case checks")


@pytest.fixture(scope="session")
def backend(request):
    return get_backend(backend_spec(request.config))


def case_id(item) -> str:
    """The id used in expected-failure files: `file.py::test_name[params]`."""
    return strip_xdist_group(item.nodeid.split("/")[-1])


def strip_xdist_group(nodeid: str) -> str:
    """pytest-xdist's loadgroup appends `@group` to node ids; case ids never carry it."""
    return nodeid.split("@", 1)[0]


def expected_failures_path(backend) -> Path:
    """A backend's own list if it names one, else expected_failures/<name>.txt."""
    own = getattr(backend, "expected_failures", None)
    return Path(own) if own else XFAIL_DIR / f"{backend.name}.txt"


def read_expected_failures(path: Path) -> dict[str, str]:
    entries: dict[str, str] = {}
    if not path.exists():
        return entries
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        cid, _, reason = line.partition(" ")
        entries[cid] = reason.strip() or "no reason given"
    return entries


@pytest.hookimpl(tryfirst=True)  # before -k deselects: stale entries are judged on all cases
def pytest_collection_modifyitems(config, items):
    path = expected_failures_path(get_backend(backend_spec(config)))
    expected = read_expected_failures(path)
    seen = set()
    here = Path(__file__).resolve().parent
    for item in items:
        if here not in Path(item.path).resolve().parents:
            continue  # refimpl's own tests, collected in the same run
        if item.get_closest_marker("spec") is None:
            raise pytest.UsageError(f"{item.nodeid}: a conformance case must name its SPEC "
                                    f"IDs with @pytest.mark.spec [CF-2]")
        item.user_properties.append(("spec_ids", list(item.get_closest_marker("spec").args)))
        cid = case_id(item)
        if cid in expected:
            seen.add(cid)
            item.add_marker(pytest.mark.xfail(reason=expected[cid], strict=True))
    for cid in sorted(set(expected) - seen):
        warnings.warn(f"{path.name}: {cid!r} matches no case [CF-4]", stacklevel=1)
    _select_sections(config, items)


def spec_section(spec_id: str) -> str:
    """The section prefix of a SPEC ID: 'FC' for 'FC-12'."""
    return spec_id.rsplit("-", 1)[0]


def _select_sections(config, items):
    sections = set(config.getoption("--section") or ())
    if not sections:
        return
    keep, drop = [], []
    for item in items:
        marker = item.get_closest_marker("spec")
        ids = marker.args if marker is not None else ()
        (keep if any(spec_section(i) in sections for i in ids) else drop).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


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
    if call.excinfo is not None and call.excinfo.errisinstance(NotImplementedConcept):
        report.outcome = "skipped"
        report.longrepr = (str(item.path), item.location[1] or 0,
                           f"{NOT_IMPLEMENTED}: {call.excinfo.value}")
        if hasattr(report, "wasxfail"):
            del report.wasxfail
