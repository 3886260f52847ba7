"""The conformance machinery: third-party backends, strict expected failures, not implemented,
canonical text and comm traces, the report, and the check that every SPEC rule is named by a
case. SPEC section 7's rules govern the suite itself, so these tests, not conformance
cases, are what name them (CF-10); CF-6 is tests/test_mutants.py's."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import expecttest
import pytest
import torch
import torch.fx

from conformance.canonical import canonical_graph
from conformance.cases.conftest import read_frozen_profile, torch_version_matches
from conformance.comm_trace import comm_trace_of_graph, format_comm_trace
from conformance.spec import rule_ids, rule_levels, sections
from conformance.verdicts import SUITE_SECTIONS

ROOT = Path(__file__).resolve().parent.parent
CASE = "test_functional_collectives.py::test_make_fx_graph"
CASE2 = "test_functional_collectives.py::test_async_collective_tensor"
NAME, NAME2 = CASE.split("::")[1], CASE2.split("::")[1]  # -k selects exactly these

THIRD_PARTY = '''
"""A backend that lives outside the refimpl repository."""
from pathlib import Path

import refimpl.functional_collectives as implementation  # stands in for your own library
from conformance.backends import Backend

backend = Backend(
    "acme",
    {"functional_collectives": implementation},
    notes={"bucketing": "acme does not bucket"},
    expected_failures=str(Path(__file__).with_name("acme_expected_failures.txt")),
)
nothing = Backend("nothing", {})


class Failing(Backend):
    """Every case that asks it for a concept fails (an error, not 'not implemented')."""

    def require(self, concept, *attrs):
        raise RuntimeError(f"{concept}: this backend always fails")


failing = Failing("failing", {},
                  expected_failures=str(Path(__file__).with_name("acme_expected_failures.txt")))


class Hanging(Backend):
    """Every case that asks it for a concept waits forever (a pass that never returns)."""

    def require(self, concept, *attrs):
        while True:
            pass


hanging = Hanging("hanging", {})
'''


def _run_suite(tmp_path, backend, expr, xfail_lines=(), *extra):
    (tmp_path / "acme_backend.py").write_text(textwrap.dedent(THIRD_PARTY))
    (tmp_path / "acme_expected_failures.txt").write_text("\n".join(xfail_lines) + "\n")
    report = tmp_path / "report.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}
    env.pop("EXPECTTEST_ACCEPT", None)
    proc = subprocess.run(
        [sys.executable, "-m", "conformance", "--backend", backend, "-n", "0", "-k", expr,
         "--json", str(report), *extra], cwd=tmp_path, env=env, capture_output=True, text=True,
        timeout=300)
    data = json.loads(report.read_text()) if report.exists() else {"cases": []}
    return proc, {c["id"]: c["outcome"] for c in data["cases"]}, data


def test_a_backend_outside_the_repo_runs_through_module_attr(tmp_path):
    """CF-1, CF-7: `--backend module:attr`, the report (by the backend's own name, a line
    per section as it completes) and its JSON."""
    proc, outcomes, data = _run_suite(tmp_path, "acme_backend:backend",
                                      "test_make_fx_graph or test_bucketing.py")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert outcomes[CASE] == "passed"
    assert data["backend"] == "acme" and data["backend_spec"] == "acme_backend:backend"
    assert data["world_sizes"] == [2] and data["torch_version"] == torch.__version__
    case = next(c for c in data["cases"] if c["id"] == CASE)
    assert case["spec_ids"] == ["FC-38", "FC-12", "FC-45"] and \
        case["section"].endswith("collectives")
    assert "conformance report: backend acme (acme_backend:backend)," in proc.stdout
    done = sorted(ln.split("] ", 1)[1] for ln in proc.stdout.splitlines() if ") done: " in ln)
    assert len(done) == 2, proc.stdout  # FC's case, and BK's: not implemented by acme
    assert done[0] == "1. Functional collectives (FC) done: 1 cases, 1 passed", done
    assert done[1].startswith("3. Bucketing (BK) done: ") and "not_implemented" in done[1]


def test_expected_failures_are_counted_per_section_and_listed_with_v(tmp_path):
    """CF-4, CF-7: expected failures apply by torch version; the report counts them per
    section and gives each reason only with -v."""
    lines = [f"{CASE}  [torch>=2.0] missing FC-12: listed for every torch this project runs",
             f"{CASE2}  [torch<2.0,>=1.0] missing FC-9: listed for torch 1 only"]
    proc, outcomes, _ = _run_suite(tmp_path, "acme_backend:failing", f"{NAME} or {NAME2}",
                                   lines)
    assert outcomes == {CASE: "xfailed", CASE2: "failed"}, proc.stdout[-3000:]
    assert proc.returncode == 1
    assert "xfailed: 1. Functional collectives 1 (each with its reason: -v)" in proc.stdout
    assert "cases that did not pass" not in proc.stdout  # the case list: -v only
    proc, outcomes, _ = _run_suite(tmp_path, "acme_backend:failing", NAME, lines, "-v")
    assert outcomes == {CASE: "xfailed"} and proc.returncode == 0
    assert "FC-12: listed for every torch this project runs" in proc.stdout


def test_torch_version_conditions():
    """CF-4: release numbers compared, the shorter padded with zeros."""
    assert torch_version_matches("<2.14", "2.13.0+cpu")
    assert not torch_version_matches("<2.14", "2.14.1+cu130")
    assert torch_version_matches(">=2.14", "2.14.1+cu130")
    assert torch_version_matches(">=2.13,<2.14", "2.13.0")
    assert not torch_version_matches("==2.14", "2.14.1")
    assert torch_version_matches("!=2.14.1", "2.14.0a0")
    with pytest.raises(ValueError, match="expected an operator"):
        torch_version_matches("~2.14", "2.14.1")


def test_help_says_what_backend_accepts():
    """CF-1."""
    proc = subprocess.run([sys.executable, "-m", "conformance", "--help"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0
    text = " ".join(proc.stdout.split())
    for phrase in ("refimpl, torch", "package.module:attr", "$REFIMPL_BACKEND"):
        assert phrase in text, text


@pytest.mark.slow  # second tier: four and two listings of the suite, each a fresh interpreter
def test_first_orders_named_cases_then_rules_then_the_rest(tmp_path):
    """`--first` takes a case's name (with or without its parameters) or a SPEC ID, and
    repeated orders by the first value that names a case; the suite's order otherwise."""
    ids = {}

    def listed(*firsts):
        report = tmp_path / "list.json"
        args = [a for f in firsts for a in ("--first", f)]
        subprocess.run([sys.executable, "-m", "conformance", "--section", "SM", "--list",
                        "--json", str(report), *args], cwd=ROOT, check=True,
                       capture_output=True, timeout=120)
        cases = json.loads(report.read_text())["cases"]
        ids.update({c["id"].split("::")[1]: c["spec_ids"] for c in cases})
        return [c["id"].split("::")[1] for c in cases]

    suite = listed()
    last, rule = suite[-1], "SM-10"
    naming = [c for c in suite if rule in ids[c] and c != last]
    assert naming and len(naming) < len(suite) - 1, f"{rule} must name some cases, not all"
    rest = [c for c in suite if c != last and c not in naming]
    assert listed(last, rule) == [last, *naming, *rest]
    assert listed(rule) == [c for c in suite if rule in ids[c]] + \
        [c for c in suite if rule not in ids[c]]
    function = next(c for c in reversed(suite) if "[" in c).split("[")[0]
    params = [c for c in suite if c.split("[")[0] == function]
    assert len(params) > 1 and suite[:len(params)] != params
    assert listed(function) == params + [c for c in suite if c not in params]


@pytest.mark.slow  # second tier: four and two listings of the suite, each a fresh interpreter
def test_case_selects_a_case_by_its_name_with_or_without_parameters(tmp_path):
    """`--case NAME[params]` keeps that one case, `--case NAME` every parametrization of
    it (what the first tier of the mutation tests runs); nothing else is collected."""
    def listed(*cases):
        report = tmp_path / "list.json"
        args = [a for c in cases for a in ("--case", c)]
        subprocess.run([sys.executable, "-m", "conformance", "--list", "--json", str(report),
                        *args], cwd=ROOT, check=True, capture_output=True, timeout=120)
        return [c["id"] for c in json.loads(report.read_text())["cases"]]

    one = "test_every_channel_up_to_the_last_works_and_one_more_is_refused"
    every = listed(one)
    assert len(every) == 2 and all(f"::{one}[" in c for c in every), every
    first = every[0].split("::", 1)[1]
    assert sorted(listed(first, "test_work_registry")) == sorted(
        [every[0], "test_functional_collectives.py::test_work_registry"])


def test_expected_failures_are_strict_and_stale_entries_warn(tmp_path):
    """CF-4: a listed case that passes fails the run; an entry matching no case warns."""
    proc, outcomes, _ = _run_suite(
        tmp_path, "acme_backend:backend", "make_fx",
        [f"{CASE}  missing listed although it passes",
         "test_nothing.py::test_gone  missing stale"])
    assert proc.returncode == 1
    assert outcomes[CASE] == "xpassed"
    assert "'test_nothing.py::test_gone' matches no case [CF-4]" in proc.stdout + proc.stderr


def test_a_concept_not_implemented_never_passes(tmp_path):
    """CF-3: a backend that declares nothing gets 'not implemented' for every case."""
    proc, outcomes, _ = _run_suite(tmp_path, "acme_backend:nothing",
                                   "make_fx or async_collective")
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert outcomes and set(outcomes.values()) == {"not_implemented"}


def test_a_case_that_never_returns_fails_naming_the_limit(tmp_path):
    """CF-11: a backend that loops forever fails each case after --case-timeout, with the
    limit in the reason, and the next case runs; the run reports."""
    start = time.monotonic()
    proc, outcomes, data = _run_suite(tmp_path, "acme_backend:hanging", f"{NAME} or {NAME2}",
                                      (), "--case-timeout", "1")
    assert proc.returncode == 1, proc.stdout[-3000:]
    assert outcomes == {CASE: "failed", CASE2: "failed"}
    assert all("--case-timeout 1 s" in c["reason"] and "[CF-11]" in c["reason"]
               for c in data["cases"]), data["cases"]
    assert time.monotonic() - start < 120


def test_an_unknown_backend_is_refused(tmp_path):
    """CF-1: an unknown name and a module that does not exist are refused up front."""
    proc, _, _ = _run_suite(tmp_path, "no_such_backend", "make_fx")
    assert proc.returncode == 2
    assert "--backend: 'no_such_backend' is neither a registered backend" in proc.stderr
    proc, _, _ = _run_suite(tmp_path, "no_such_module:backend", "make_fx")
    assert proc.returncode == 2 and "no module named 'no_such_module'" in proc.stderr


def _graph_with(namespace: str) -> torch.fx.GraphModule:
    """all_reduce + wait, then an in-place all_reduce_ on a clone, from one op namespace."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    ops = getattr(torch.ops, namespace)
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    a = graph.call_function(ops.all_reduce.default, (x, "sum", "0"))
    w = graph.call_function(ops.wait_tensor.default, (a,))
    c = graph.call_function(torch.ops.aten.clone.default, (w,))
    b = graph.call_function(ops.all_reduce_.default, (c, "avg", "0"))
    w2 = graph.call_function(ops.wait_tensor.default, (b,))
    graph.output(w2)
    gm = torch.fx.GraphModule({}, graph)
    with FakeTensorMode() as mode:
        val = mode.from_tensor(torch.ones(2, 3))
        for node in gm.graph.nodes:
            node.meta["val"] = val
    return gm


class TestCanonicalText(expecttest.TestCase):
    def test_namespaces_fold_and_print_alike(self):
        """CF-5: refimpl_c10d.X and _c10d_functional.X print the same canonical text."""
        import refimpl.functional_collectives  # noqa: F401  (registers refimpl_c10d)

        ours, upstream = _graph_with("refimpl_c10d"), _graph_with("_c10d_functional")
        self.assertEqual(canonical_graph(ours), canonical_graph(upstream))
        self.assertExpectedInline(canonical_graph(ours), """\
%0 = input : f32[2, 3]
%1 = funcol.all_reduce(%0, 'sum', group<unknown>) : f32[2, 3]
%2 = funcol.wait_tensor(%1) : f32[2, 3]
%3 = aten.clone(%2) : f32[2, 3]
%4 = funcol.all_reduce_(%3, 'avg', group<unknown>) : f32[2, 3]
%5 = funcol.wait_tensor(%4) : f32[2, 3]
return %5""")

    def test_symmetric_memory_ops_fold_and_print_alike(self):
        """CF-5: refimpl_symm_mem.X and upstream's symm_mem.X print alike, and a function's
        `group_name` argument prints as a group, as an op's does."""
        import refimpl.symmetric_memory as symm

        def graph_with(namespace):
            graph = torch.fx.Graph()
            x = graph.placeholder("x")
            buf = graph.call_function(symm.empty_strided_p2p,
                                      ((4,), (1,), torch.float32, torch.device("cpu"), "0", 7))
            graph.call_function(torch.ops.aten.copy_.default, (buf, x))
            out = graph.call_function(getattr(torch.ops, namespace).one_shot_all_reduce.default,
                                      (buf, "sum", "0"))
            graph.output(out)
            return canonical_graph(torch.fx.GraphModule({}, graph))

        self.assertEqual(graph_with("refimpl_symm_mem"), graph_with("symm_mem"))
        self.assertExpectedInline(graph_with("symm_mem"), """\
%0 = input : none
%1 = symm_mem.empty_strided_p2p([4], [1], f32, device(cpu), group<unknown>, 7) : none
%2 = aten.copy_(%1, %0) : none
%3 = symm_mem.one_shot_all_reduce(%1, 'sum', group<unknown>) : none
return %3""")

    def test_comm_trace_names_buffers_and_in_place(self):
        """CF-8: collectives and waits in order, buffers by identity, in-place visible."""
        import refimpl.functional_collectives  # noqa: F401

        self.assertExpectedInline(
            format_comm_trace(comm_trace_of_graph(_graph_with("refimpl_c10d"))), """\
all_reduce out-of-place group<unknown> sum in=b0:f32[2, 3]=input out=b1:f32[2, 3]
wait b1
all_reduce_ in-place group<unknown> avg in=b2:f32[2, 3]=copy(b1)
wait b2""")


def test_a_case_without_spec_ids_stops_the_collection(tmp_path):
    """CF-2."""
    cases = tmp_path / "cases"
    cases.mkdir()
    (cases / "conftest.py").write_text((ROOT / "conformance/cases/conftest.py").read_text())
    (cases / "test_unmarked.py").write_text("def test_unmarked(backend):\n    pass\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "0", "-p",
                           "no:cacheprovider", str(cases)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "must name its SPEC IDs" in proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def torch_listing(tmp_path_factory):
    """`python -m conformance --list --backend torch`: every case with its SPEC IDs, and
    the warnings of the torch expected-failure list."""
    report = tmp_path_factory.mktemp("listing") / "list.json"
    proc = subprocess.run(
        [sys.executable, "-m", "conformance", "--list", "--backend", "torch", "--json",
         str(report)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return proc, json.loads(report.read_text())


def test_every_spec_rule_is_named_by_a_case(torch_listing):
    """CF-10: every ID of SPEC.md is named by a conformance case's spec marker (the
    sections come from SPEC.md itself); CF's are named by these tests instead."""
    _, listing = torch_listing
    named = {i for case in listing["cases"] for i in case["spec_ids"]}
    missing = {prefix: [i for i in ids if i not in named]
               for prefix, ids in rule_ids().items() if prefix != "CF"}
    missing = {prefix: ids for prefix, ids in missing.items() if ids}
    assert listing["unnamed"] == {p: missing.get(p, []) for p in rule_ids() if p != "CF"}
    assert not missing, "SPEC rules named by no conformance case:\n" + "\n".join(
        f"  {sections()[prefix]} ({prefix}): {', '.join(ids)}" for prefix, ids in missing.items())


def test_every_rule_is_named_by_a_case_of_its_own_level(torch_listing):
    """CF-14: a rule's verdict comes from cases of its level; a rule that only a case of a
    more demanding level names would never be judged at its own."""
    levels = rule_levels()
    own = {rule for case in torch_listing[1]["cases"] for rule in case["spec_ids"]
           if case["level"] == levels.get(rule)}
    lacking = [rule for prefix, ids in rule_ids().items() if prefix not in SUITE_SECTIONS
               for rule in ids if rule not in own]
    assert not lacking, f"rules no case of their own level names: {lacking}"


def test_core_v1_names_existing_core_cases(torch_listing):
    """CF-16: core-v1 lists core cases that exist (a renamed case would stop its runs)."""
    frozen = read_frozen_profile("core-v1")
    levels = {c["id"]: c["level"] for c in torch_listing[1]["cases"]}
    assert frozen and len(frozen) == len(set(frozen))
    assert [cid for cid in frozen if cid not in levels] == []
    assert {levels[cid] for cid in frozen} == {"core"}


def test_every_conformance_rule_is_named_by_a_test(torch_listing):
    """CF-10: SPEC section 7's rules are named by tests of the machinery (or a case)."""
    text = "".join((ROOT / "tests" / name).read_text()
                   for name in ("test_conformance_suite.py", "test_mutants.py",
                                "test_fuzz.py", "test_launched.py", "test_verdicts.py"))
    named = {i for case in torch_listing[1]["cases"] for i in case["spec_ids"]}
    missing = [i for i in rule_ids()["CF"]
               if i not in named and not re.search(rf"\b{i}\b", text)]
    assert not missing, f"CF rules named by no test: {missing}"


def test_every_torch_expected_failure_names_a_case(torch_listing):
    """CF-4: the upstream list stays in step with the cases (stale entries warn)."""
    proc, _ = torch_listing
    assert "matches no case" not in proc.stdout + proc.stderr, proc.stdout[-3000:]
    lines = (ROOT / "conformance/expected_failures/torch.txt").read_text().splitlines()
    entries = [ln for ln in lines if ln.strip() and not ln.startswith("#")]
    assert entries and all("  " in ln and ln.split("  ", 1)[1].strip() for ln in entries), \
        "every entry gives a reason"


def test_meta_checker_names_untrue_and_missing_vals_only():
    """MetaChecker (BK-7, CL-1, RO-1) flags a meta val of the wrong shape, dtype or stride
    and a missing one, but not a stride over a dim of size 1 (never stepped over)."""
    from torch._subclasses import FakeTensorMode

    from conformance.true_meta import MetaChecker

    mode = FakeTensorMode()
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    x.meta["val"] = mode.from_tensor(torch.empty(2, 3))
    t = graph.call_function(torch.ops.aten.t.default, (x,))
    t.meta["val"] = mode.from_tensor(torch.empty(3, 2))  # contiguous: the transpose is not
    row = graph.call_function(torch.ops.aten.slice.Tensor, (x, 0, 0, 1))
    row.meta["val"] = mode.from_tensor(torch.empty(1, 3).as_strided((1, 3), (7, 1)))
    half = graph.call_function(torch.ops.aten.mul.Tensor, (x, 0.5))
    half.meta["val"] = mode.from_tensor(torch.empty(2, 3, dtype=torch.float16))
    bare = graph.call_function(torch.ops.aten.neg.default, (x,))
    graph.output((t, row, half, bare))
    checker = MetaChecker(torch.fx.GraphModule(torch.nn.Module(), graph))
    checker.run(torch.ones(2, 3))
    assert [line.split(":")[0] for line in checker.untrue] == [t.name, half.name, bare.name]
    assert "strides [1, 3]" in checker.untrue[0] and "no meta val" in checker.untrue[2]
