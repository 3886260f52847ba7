"""The conformance suite catches every mutant of tests/mutants.py (CF-6).

Each mutant is applied to a fresh copy of the checkout, and the conformance suite runs
there against the `refimpl` backend (so it runs the mutated code, C kernels rebuilt from
the mutated source included). A case must fail in the run's report; a run that crashes
without one does not count. Two tiers:

- the first (the default `pytest` run): the mutants of `FIRST_TIER`, one of every SPEC
  rule that has one, each against its catching case alone (`Mutant.catch`, `python -m
  conformance --section S --case CATCH`), which must fail;
- the second (`pytest -m slow`): every mutant against its whole section, its catching
  case first, then the cases that name its rule, then the rest, stopping at the first
  failure (`--first CATCH --first RULE -x`); the case that fails must be its catching case
  (so `catch` stays true for the first tier), else the test names the case that did.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from mutants import (
    CUDA_MUTANTS,
    FIRST_TIER,
    HARNESS_MUTANTS,
    KERNEL_BUILDS,
    MUTANTS,
    ROOT,
    Mutant,
    copy_checkout,
    section_lists,
)

from conformance.cases.conftest import torch_version_matches
from conformance.spec import rule_ids

TIMEOUT_S = 600


@pytest.fixture(scope="session")
def built_kernels():
    """Build (or find) this checkout's kernel library once, so every copy reuses it."""
    from refimpl._native import load_kernel_library

    load_kernel_library("symm_mem")


@pytest.fixture(scope="session")
def precompiled_torch_headers():
    """torch's headers precompiled once, which every C++ mutant's library build includes
    (each copy's kernels/cpu/*.cpp differs, so each builds its own library): 15 s of CPU
    once, then about 4 s a build instead of 10. Only the second tier, which builds every
    C++ mutant, pays for it."""
    from refimpl._native import TORCH_OP_HEADER_VARIABLE, build_torch_op_header

    os.environ[TORCH_OP_HEADER_VARIABLE] = str(build_torch_op_header("symm_mem_ops"))


def run_section(root, mutant: Mutant, report, zygote=None, only_catch=False):
    """`python -m conformance` in the copy at `root`: the mutant's section, its catching
    case and its rule first; with `only_catch`, its catching case alone.

    With `zygote` (the fixture below) the run is a fork of a Python that has torch
    imported already (tests/conformance_zygote.py), which saves CI about 3 s of CPU per
    mutant; without, a fresh interpreter."""
    # The suite needs no third-party pytest plugin but xdist, which the runner then names
    # itself: not importing the others saves about a second a mutant.
    env = {**os.environ, "PYTHONPATH": str(root), "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}
    env.pop("EXPECTTEST_ACCEPT", None)
    if only_catch:
        chosen = ["--case", mutant.catch]
    else:
        chosen = [arg for first in mutant.first for arg in ("--first", first)] + ["-x"]
    args = ["--backend", "refimpl", "--section", mutant.section, *chosen,
            "-n", "0", "--json", str(report)]
    if zygote is not None:
        return zygote.run(root, args, env)
    return subprocess.run([sys.executable, "-m", "conformance", *args], cwd=root, env=env,
                          capture_output=True, text=True, timeout=TIMEOUT_S)


class Zygote:
    """One tests/conformance_zygote.py process per test worker, serving runs in order."""

    def __init__(self, folder: Path, env: dict | None = None):
        self.folder = folder
        self.process = subprocess.Popen(
            [sys.executable, str(Path(__file__).parent / "conformance_zygote.py")],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=folder, env=env)
        self.runs = 0

    def run(self, root: Path, args: list[str], env: dict) -> subprocess.CompletedProcess:
        self.runs += 1
        out, err = self.folder / f"{self.runs}.out", self.folder / f"{self.runs}.err"
        request = {"cwd": str(root), "args": args, "env": env, "stdout": str(out),
                   "stderr": str(err), "timeout_s": TIMEOUT_S}
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        reply = self.process.stdout.readline()
        assert reply, f"the conformance zygote died (exit {self.process.poll()})"
        code = json.loads(reply)["returncode"]
        return subprocess.CompletedProcess(["conformance", *args], code, out.read_text(),
                                           err.read_text())

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait(timeout=60)


@pytest.fixture(scope="session")
def zygote(tmp_path_factory):
    server = Zygote(tmp_path_factory.mktemp("zygote"))
    yield server
    server.close()


def failed_cases(proc, report, mutant) -> list[dict]:
    """The failed cases of the run's report; no report, or no case, is a crash."""
    output = f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    assert report.exists(), f"mutant {mutant.name}: the runner wrote no report:\n{output}"
    cases = json.loads(report.read_text())["cases"]
    assert cases, f"mutant {mutant.name}: no case ran:\n{output}"
    return [c for c in cases if c["outcome"] == "failed"]


def test_mutants_are_named_once_and_break_a_rule_of_their_own_section():
    names = [m.name for m in MUTANTS]
    assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)
    ids = {i for section in rule_ids().values() for i in section}
    for prefix, mutants in section_lists().items():
        for m in mutants:
            assert m.rule in ids, f"mutant {m.name}: {m.rule} is not a rule of SPEC.md"
            assert m.section == prefix, f"mutant {m.name} ({m.rule}) is in the {prefix} list"


def test_every_list_of_mutants_is_gathered():
    """A list named for a section SPEC.md's headings do not parse would be left out."""
    import mutants

    lists = {name for name, value in vars(mutants).items()
             if isinstance(value, list) and value and all(isinstance(m, Mutant) for m in value)
             and name not in ("MUTANTS", "EQUIVALENTS", "CUDA_MUTANTS", "HARNESS_MUTANTS")}
    assert lists <= set(section_lists()), sorted(lists - set(section_lists()))


def test_each_catching_case_is_a_case_of_its_mutants_section(tmp_path):
    """Every mutant names the case that catches it (the first tier runs that case alone);
    one naming a case that no longer exists, or a case of another section, would catch
    nothing there."""
    listing = tmp_path / "cases.json"
    subprocess.run([sys.executable, "-m", "conformance", "--list", "--json", str(listing)],
                   cwd=ROOT, check=True, capture_output=True, timeout=300)
    cases = json.loads(listing.read_text())["cases"]
    sections = {c["id"].split("::", 1)[1]: {i.rsplit("-", 1)[0] for i in c["spec_ids"]}
                for c in cases}
    for m in MUTANTS + CUDA_MUTANTS:
        assert m.catch, f"mutant {m.name} names no catching case"
        assert m.section in sections.get(m.catch, ()), \
            f"mutant {m.name}: {m.catch!r} is no case of section {m.section}"


def test_equivalents_still_apply_and_are_no_mutants():
    """A slip judged equivalent stays written down only while it still names code."""
    from mutants import EQUIVALENTS

    names = {m.name for m in MUTANTS}
    for slip in EQUIVALENTS:
        assert slip.name not in names, f"{slip.name} is both a mutant and an equivalent"
        assert slip.why, f"equivalent {slip.name} says not why"
        count = (ROOT / slip.path).read_text().count(slip.old)
        assert count == 1, f"equivalent {slip.name}: `old` occurs {count} times in {slip.path}"


def test_cuda_mutants_are_named_once_each():
    """The GPU's mutants (tests/gpu/test_cuda_mutants.py runs them) are checked here too."""
    names = [m.name for m in CUDA_MUTANTS]
    assert len(set(names)) == len(names) and not set(names) & {m.name for m in MUTANTS}
    assert all(m.rule.startswith("SM-") and m.why for m in CUDA_MUTANTS)


def test_harness_mutants_are_named_once_each_and_name_a_test():
    """The CF-13 machinery's mutants are caught by a test of tests/, named by node id."""
    names = [m.name for m in HARNESS_MUTANTS]
    assert len(set(names)) == len(names)
    assert not set(names) & {m.name for m in MUTANTS + CUDA_MUTANTS}
    for m in HARNESS_MUTANTS:
        path, _, test = m.catch.partition("::")
        assert m.why and path.startswith("tests/") and test, m.name
        assert f"def {test.split('[')[0]}(" in (ROOT / path).read_text(), \
            f"mutant {m.name}: no test {m.catch}"


@pytest.mark.parametrize("mutant", MUTANTS + CUDA_MUTANTS + HARNESS_MUTANTS,
                         ids=lambda m: m.name)
def test_the_mutant_still_applies(mutant):
    """Fast: `old` still occurs exactly once in this checkout (code moves on)."""
    count = (ROOT / mutant.path).read_text().count(mutant.old)
    assert count == 1, f"mutant {mutant.name}: `old` occurs {count} times in {mutant.path}"


def _run_mutant(mutant: Mutant, tmp_path: Path, zygote, only_catch: bool):
    """The mutant applied to a fresh copy and its run there: (process, failed cases).
    Skipped on a torch release where the slip breaks nothing."""
    if mutant.torch is not None and not torch_version_matches(mutant.torch, torch.__version__):
        pytest.skip(f"torch {torch.__version__}: {mutant.unbroken_because}")
    root = copy_checkout(tmp_path / "checkout")
    mutant.apply(root)
    report = tmp_path / "report.json"
    proc = run_section(root, mutant, report, zygote, only_catch=only_catch)
    return proc, failed_cases(proc, report, mutant)


def test_the_first_tier_holds_a_mutant_of_every_rule_that_has_one():
    assert FIRST_TIER <= {m.name for m in MUTANTS}, sorted(FIRST_TIER - {m.name for m in
                                                                          MUTANTS})
    missing = {m.rule for m in MUTANTS} - {m.rule for m in MUTANTS if m.name in FIRST_TIER}
    assert not missing, f"no mutant of {sorted(missing)} in FIRST_TIER (tests/mutants.py)"


@pytest.mark.parametrize("mutant", [m for m in MUTANTS if m.name in FIRST_TIER],
                         ids=lambda m: f"{m.rule}-{m.name}")
def test_the_catching_case_fails_the_mutant(mutant, tmp_path, built_kernels, zygote):
    """First tier: the mutant's catching case, run alone, fails."""
    proc, failed = _run_mutant(mutant, tmp_path, zygote, only_catch=True)
    assert proc.returncode == 1 and failed, (
        f"{mutant.catch} passed mutant {mutant.name} ({mutant.rule}: {mutant.why}); "
        f"`pytest -m slow -k {mutant.name} tests/test_mutants.py` says whether another "
        f"case of {mutant.section} still catches it:\n{proc.stdout[-3000:]}")


@pytest.mark.slow
@pytest.mark.parametrize("mutant", MUTANTS, ids=lambda m: f"{m.rule}-{m.name}")
def test_conformance_fails_the_mutant(mutant, tmp_path, built_kernels, zygote,
                                      precompiled_torch_headers):
    """Second tier: the mutant's whole section, stopping at its first failure."""
    proc, failed = _run_mutant(mutant, tmp_path, zygote, only_catch=False)
    assert proc.returncode == 1 and failed, (
        f"the {mutant.section} section passed mutant {mutant.name} ({mutant.rule}: "
        f"{mutant.why}):\n{proc.stdout[-3000:]}")
    caught_by = failed[0]["id"].split("::", 1)[1]
    # A slip of timing (a barrier left out) shows on one world size or another, as the
    # ranks happen to run: another parameter set of the catching test counts.
    assert caught_by.split("[")[0] == mutant.catch.split("[")[0], (
        f"mutant {mutant.name} was caught by {caught_by}, not by its catch "
        f"{mutant.catch}: set catch={caught_by!r} in tests/mutants.py")


@pytest.mark.slow
@pytest.mark.parametrize("mutant", HARNESS_MUTANTS, ids=lambda m: m.name)
def test_the_harness_test_fails_the_mutant(mutant, tmp_path, built_kernels):
    """Second tier: a CF-13 mutant's catching test, run in a copy of the checkout (its
    tests included) with the slip applied, fails."""
    root = copy_checkout(tmp_path / "checkout")
    for folder in ("tests", "examples"):  # the tests and the process groups they start
        shutil.copytree(ROOT / folder, root / folder,
                        ignore=shutil.ignore_patterns("__pycache__"))
    mutant.apply(root)
    env = {**os.environ, "PYTHONPATH": str(root)}
    proc = subprocess.run([sys.executable, "-m", "pytest", mutant.catch, "-q", "-n", "0",
                           "-m", "slow or not slow"], cwd=root, env=env, capture_output=True,
                          text=True, timeout=TIMEOUT_S)
    assert proc.returncode == 1 and re.search(r"^1 failed\b", proc.stdout, re.M), (
        f"{mutant.catch} did not fail mutant {mutant.name} ({mutant.why}):\n"
        f"{proc.stdout[-3000:]}")


def test_a_mutant_that_breaks_an_import_is_caught_by_failing_cases(tmp_path, built_kernels):
    """The runner survives a refimpl module that does not import: every case fails with
    the error and the report says so, rather than the run crashing with no report."""
    broken = Mutant("syntax_error", "FC-22", "refimpl/functional_collectives.py",
                    "def _check_src(src, size: int, group_name: str) -> int:",
                    "def _check_src(src, size: int, group_name: str)")
    root = copy_checkout(tmp_path / "checkout")
    broken.apply(root)
    report = tmp_path / "report.json"
    proc = run_section(root, broken, report)
    failed = failed_cases(proc, report, broken)
    assert proc.returncode == 1 and len(failed) == 1  # -x: the first case, then stop
    assert "SyntaxError" in failed[0]["reason"], failed[0]
    assert "failed to load" in proc.stdout


def test_a_copy_reuses_the_kernel_library_unless_its_source_changed(tmp_path, built_kernels):
    """The copy loads the library built for this checkout (no compiler run); a mutated
    kernel source gets a library of its own."""
    root = copy_checkout(tmp_path / "checkout")
    load = [sys.executable, "-c", "from refimpl._native import load_kernel_library as load; "
            "print(load('symm_mem')._name)"]
    env = {**os.environ, "PYTHONPATH": str(root)}
    before = set((root / KERNEL_BUILDS).glob("*.so"))
    path = subprocess.run(load, cwd=root, env=env, capture_output=True, text=True,
                          check=True, timeout=120).stdout.strip()
    assert root in Path(path).parents and set((root / KERNEL_BUILDS).glob("*.so")) == before
    source = root / "kernels/cpu/symm_mem.c"
    source.write_text(source.read_text() + "\n/* mutated */\n")
    mutated = subprocess.run(load, cwd=root, env=env, capture_output=True, text=True,
                             check=True, timeout=120).stdout.strip()
    assert mutated != path and root / KERNEL_BUILDS in Path(mutated).parents


def test_a_run_in_the_zygote_leaves_nothing_in_the_temp_folder(tmp_path):
    """A forked run ends with os._exit, which skips multiprocessing's clean-up of its
    forkserver's `pymp-*` folder: the zygote gives each run a temp folder of its own and
    removes it. Here the zygote's own temp folder is an empty one, a case that starts
    rank workers (so a forkserver) runs in it, and the folder holds nothing of the run's
    afterwards."""
    # A short path: the forkserver's socket lies in it, and a socket's path is at most
    # 107 bytes long.
    temp = Path(tempfile.mkdtemp(prefix="zygote-"))
    server = Zygote(tmp_path, env={**os.environ, "TMPDIR": str(temp)})
    try:
        report = tmp_path / "report.json"
        env = {**os.environ, "PYTHONPATH": str(ROOT), "TMPDIR": str(temp)}
        proc = server.run(ROOT, ["--section", "FC", "--case", "test_async_collective_tensor",
                                 "-n", "0", "--json", str(report)], env)
        data = json.loads(report.read_text())
        assert proc.returncode == 0 and [c["outcome"] for c in data["cases"]] == ["passed"], \
            proc.stdout[-3000:] + proc.stderr[-3000:]
        assert data["world_sizes"], "the case started no rank workers"
    finally:
        server.close()
    # torch's own caches (torchinductor_<user>) are meant to stay, and are shared by runs.
    left = sorted(p.name for p in temp.iterdir() if not p.name.startswith("torchinductor_"))
    shutil.rmtree(temp)
    assert left == []
