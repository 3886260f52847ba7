"""In this process: the run of N programs (`run`), one record per (program, stage) in the
report's schema (CF-7, CF-12), and the hunt of each stage on its program (`Fuzzer`): the
stage's rank function run on warm gloo ranks, a failure shrunk by hypothesis
(`SHRINK_RUNS`), its record carrying the shrunk program, its options and the command that
reruns it (`reproducer`); a failure whose rules the backend's expected failures list is
`xfailed` (CF-4).
"""

from __future__ import annotations

import functools
import json
import re
import time
from dataclasses import dataclass, field

import torch
from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis.reporting import with_reporter

from conformance.backends import NotImplementedConcept
from conformance.fuzz.bucketing_stage import bucketing_on_rank
from conformance.fuzz.e2e_stage import e2e_on_rank
from conformance.fuzz.lowering_stage import lowering_on_rank
from conformance.fuzz.memory_stage import memory_on_rank
from conformance.fuzz.on_rank import ranks_ready, shortened
from conformance.fuzz.reorder_stage import reorder_on_rank
from conformance.fuzz.stage_options import cases
from conformance.fuzz.vocabulary import STAGES, Case
from conformance.spec import section_title

SHRINK_RUNS = 100  # stage runs a failure may spend on shrinking; then it reports
STAGE_TIMEOUT_S = 60.0  # a program's stage takes under a second when warm
START_TIMEOUT_S = 300.0  # starting rank processes, on a machine other jobs load


# Each stage's rank function: module-level, so that a rank process finds it by module path.
RANK_FUNCTIONS = {"BK": bucketing_on_rank, "CL": lowering_on_rank, "RO": reorder_on_rank,
                  "MEM": memory_on_rank, "E2E": e2e_on_rank}


def _across_ranks(stage: str, results: list[dict]) -> list[str]:
    """What every rank must agree on: the same merges (BK-6), the same order (RO-2), the
    same alloc_ids (CL-12)."""
    key = {"BK": "merges", "RO": "order", "CL": "alloc_ids"}.get(stage)
    if key is None or all(r.get(key) == results[0].get(key) for r in results):
        return []
    rule = {"BK": "BK-6: ranks merged differently", "RO": "RO-2: ranks ordered differently",
            "CL": "CL-12: ranks gave their comm buffers different alloc_ids"}
    return [f"{rule[stage]}: " + "; ".join(f"rank {i}: {r.get(key)}" for i, r in
                                           enumerate(results))]


# --------------------------------------------------------------------------------------
# In this process: one stage of one program, found and shrunk by hypothesis
# --------------------------------------------------------------------------------------
class _Failed(Exception):
    """The stage found something wrong (hypothesis shrinks the program)."""


@dataclass
class _Hunt:
    """One stage on one seed's program: what hypothesis has shown it so far."""

    calls: int = 0
    case: Case | None = None
    failures: list = field(default_factory=list)  # (case, problems), the smallest last
    runs: int = 0  # stage runs spent on shrinking
    missing: NotImplementedConcept | None = None


class Fuzzer:
    """Runs stages of generated programs against a backend, on gloo ranks."""

    def __init__(self, backend, shrink_runs: int = SHRINK_RUNS,
                 timeout_s: float = STAGE_TIMEOUT_S):
        self.backend = backend
        self.shrink_runs = shrink_runs
        self.timeout_s = timeout_s
        self.memo: dict[tuple, list[str]] = {}  # (stage, source, options) -> problems
        self.expected: dict[str, str] = {}  # rule -> reason: differences known by rule
        self.started: set[int] = set()  # world sizes whose ranks are up

    def check(self, stage: str, case: Case) -> list[str]:
        """Problems of `stage` on `case` (memoized; NotImplementedConcept passes through).
        A run past the time limit is tried once more on fresh ranks: on a loaded machine
        starting them can take that long, and a stage that hangs hangs twice."""
        from refimpl.multiprocess import RankError, RankTimeout

        key = _key(stage, case)
        if key not in self.memo:
            try:
                try:
                    results = self._run(stage, case)
                except RankTimeout:
                    results = self._run(stage, case)
                problems = [f"rank {i}: {p}" for i, r in enumerate(results)
                            for p in r["problems"]] + _across_ranks(stage, results)
            except (RankError, RankTimeout) as exc:
                problems = [shortened(str(exc))]
            self.memo[key] = problems
        return self.memo[key]

    def _run(self, stage: str, case: Case) -> list[dict]:
        """The stage's rank function on ranks already started (not timed as the stage)."""
        from conformance import harness
        from refimpl.multiprocess import RankError, RankTimeout

        program = case.program
        if program.world_size not in self.started:
            try:
                harness.run(self.backend, ranks_ready, program.world_size,
                            timeout=max(START_TIMEOUT_S, self.timeout_s))
            except (RankError, RankTimeout):
                pass  # the stage's own run says what is wrong
        self.started.add(program.world_size)
        try:
            return harness.run(self.backend, RANK_FUNCTIONS[stage], program.world_size,
                               program.source(), program.inputs, self._options(stage, case),
                               timeout=self.timeout_s)
        except (RankError, RankTimeout):
            self.started.discard(program.world_size)  # the harness starts fresh ranks
            raise

    @staticmethod
    def _options(stage: str, case: Case) -> dict:
        options = dict(case.stage_options(stage))
        if stage == "RO":  # bucketing first (if drawn) with the BK caps of all_gather
            options["caps_bytes"] = case.options["BK"]["caps_bytes"]
        return options

    def hunt(self, stage: str, program_seed: int) -> dict:
        """Run `stage` on the program of `program_seed`; shrink it if it fails.
        {"case", "problems", "shrunk", "runs"}: the program drawn, and on a failure the
        smallest failing case found with its problems."""
        hunt = _Hunt()

        def stage_test(case):
            hunt.calls += 1
            if hunt.calls == 2:
                hunt.case = case  # the program of this seed (the first is the simplest)
            try:
                problems = self._problems(stage, case, hunt)
            except NotImplementedConcept as exc:  # reported as such, never shrunk
                hunt.missing = exc
                return
            if problems:
                hunt.failures.append((case, problems))
                raise _Failed("\n".join(problems))

        test = seed(program_seed)(settings(
            max_examples=2, phases=(Phase.generate, Phase.shrink), database=None,
            deadline=None, suppress_health_check=list(HealthCheck), report_multiple_bugs=False,
            print_blob=False)(given(cases())(stage_test)))
        with with_reporter(lambda text: None):
            try:
                test()
            except Exception:  # _Failed, or hypothesis's own error about it
                if not hunt.failures:
                    raise
        if hunt.missing is not None:
            raise hunt.missing
        if not hunt.failures:
            return {"case": hunt.case, "problems": [], "shrunk": None, "runs": hunt.runs}
        shrunk, problems = hunt.failures[-1]  # hypothesis replays the smallest last
        return {"case": hunt.case or shrunk, "problems": problems, "shrunk": shrunk,
                "runs": hunt.runs}

    def _problems(self, stage: str, case: Case, hunt: _Hunt) -> list[str]:
        """`case`'s problems as the hunt counts them. While shrinking, a candidate counts as
        passing when the runs are spent, when it needs more ranks than the failure
        (starting them costs seconds), or when it fails another way (a run past its time
        limit on a loaded machine, say): shrinking keeps to the failure found."""
        problems = self._known(stage, case)
        if not hunt.failures:
            return problems if problems is not None else self.check(stage, case)
        first_case, first_problems = hunt.failures[0]
        if problems is None:
            if hunt.runs >= self.shrink_runs or \
                    case.program.world_size > first_case.program.world_size:
                return []
            hunt.runs += 1
            problems = self.check(stage, case)
        return problems if _kinds(problems) & _kinds(first_problems) else []

    def _known(self, stage, case) -> list[str] | None:
        return self.memo.get(_key(stage, case))


def _key(stage: str, case: Case) -> tuple:
    """What a stage's outcome depends on: the program's text and the stage's options."""
    options = json.dumps(Fuzzer._options(stage, case), sort_keys=True, default=str)
    return stage, case.program.source(), options


def _kinds(problems: list[str]) -> set[str]:
    """What kind of failure each problem is: the rule it names (`BK-8`, `MEM`), the error a
    rank raised, or a timeout; not its values."""
    kinds = set()
    for problem in problems:
        rule = re.match(r"(?:rank \d+: )?([A-Z]+(?:-\d+)?):", problem)
        error = re.search(r"raised (\w+)", problem)
        kinds.add(rule.group(1) if rule else error.group(1) if error else
                  "timeout" if "did not finish" in problem else problem.split(":")[0])
    return kinds


def program_of_seed(program_seed: int) -> Case:
    """The case of `program_seed`: the second example hypothesis draws with it."""
    drawn: list[Case] = []

    @seed(program_seed)
    @settings(max_examples=2, phases=(Phase.generate,), database=None, deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(cases())
    def collect(case):
        drawn.append(case)

    collect()
    return drawn[-1]


def reproducer(stage: str, program_seed: int, backend_spec: str, case: Case,
               options: dict) -> str:
    """The shrunk program's source, its stage options and the command that reruns it."""
    command = f"python -m conformance --fuzz 1 --seed {program_seed} --section {stage}"
    if backend_spec != "refimpl":
        command += f" --backend {backend_spec}"
    return "\n".join([f"shrunk program ({len(case.program.stmts)} statements):",
                      case.program.source().rstrip(), f"options: {options!r}",
                      f"rerun: {command}"])


# --------------------------------------------------------------------------------------
# The run: N programs, every selected stage of each
# --------------------------------------------------------------------------------------
def expected_rules(backend) -> dict[str, str]:
    """{rule ID: one listed reason} of the backend's expected failures that apply to the
    running torch (conformance/expected_failures/<name>.txt, CF-4). A generated program
    whose every problem names one of these rules shows a difference already known by rule,
    not a new finding."""
    from conformance.cases.conftest import expected_failures_file, read_expected_failures

    applying, _ = read_expected_failures(expected_failures_file(backend), torch.__version__)
    rules: dict[str, str] = {}
    for cid, entry in applying.items():
        head = re.match(r"\s*([A-Z]+-\d+(?:/[A-Z]+-\d+)*)\s*:", entry.reason)  # "MEM-5/MEM-6: .."
        for rule in head.group(1).split("/") if head else []:
            rules.setdefault(rule, f"{cid}: {entry}")
    return rules


def run(backend, backend_spec: str, count: int, first_seed: int, stages, *,
        verbose: bool = False, exitfirst: bool = False, shrink_runs: int = SHRINK_RUNS,
        timeout_s: float = STAGE_TIMEOUT_S,
        write=None) -> list[dict]:
    """One record per (program, stage), in the report's schema; a line per program
    (`write`, default print) as it finishes. A failure whose every problem names a rule the
    backend's expected failures list is `xfailed` (a known difference, matched by rule);
    any other is `failed`: a finding, with its reproducer."""
    write = write or functools.partial(print, flush=True)
    fuzzer = Fuzzer(backend, shrink_runs, timeout_s)
    fuzzer.expected = expected_rules(backend)
    start = time.monotonic()
    records = []
    for index in range(count):
        program_seed = first_seed + index
        case = program_of_seed(program_seed)
        if verbose:
            write(case.program.source())
        done = [_stage_record(fuzzer, stage, first_seed, index, program_seed, backend_spec,
                              case) for stage in stages]
        records += done
        summary = ", ".join(f"{r['id'].split('::')[1]} {r['outcome']}" for r in done)
        write(f"[{time.monotonic() - start:4.0f} s] program {index} (seed {program_seed}, "
              f"{case.program.world_size} ranks, {len(case.program.stmts)} statements): "
              f"{summary}")
        if exitfirst and any(r["outcome"] == "failed" for r in done):
            break
    return records


def _stage_record(fuzzer: Fuzzer, stage: str, first_seed: int, index: int,
                  program_seed: int, backend_spec: str, case: Case) -> dict:
    started = time.monotonic()
    record = {"id": f"fuzz::{stage}::{first_seed}::{index}",
              "section": section_title(stage), "spec_ids": list(STAGES[stage].spec_ids),
              "outcome": "passed", "reason": "", "world_sizes": [case.program.world_size]}
    try:
        fuzzer.backend.require(STAGES[stage].concept, *STAGES[stage].attrs)
        found = fuzzer.hunt(stage, program_seed)
    except NotImplementedConcept as exc:
        record.update(outcome="not_implemented", reason=f"not implemented: {exc}")
    else:
        if found["problems"]:
            shrunk = found["shrunk"]
            kinds = _kinds(found["problems"])
            known = sorted(kinds) if kinds <= set(fuzzer.expected) else []
            lines = [f"an expected difference by rule {', '.join(known)}: "
                     + "; ".join(fuzzer.expected[k] for k in known)] if known else []
            record.update(outcome="xfailed" if known else "failed", reason="\n".join([
                *lines, *found["problems"][:10],
                reproducer(stage, program_seed, backend_spec, shrunk,
                           Fuzzer._options(stage, shrunk))]))
    record["seconds"] = round(time.monotonic() - started, 3)
    return record


def load_error_record(stage: str, first_seed: int, index: int, error: str) -> dict:
    """The record of a (program, stage) when the backend failed to load (CF-7)."""
    return {"id": f"fuzz::{stage}::{first_seed}::{index}", "section": section_title(stage),
            "spec_ids": list(STAGES[stage].spec_ids), "outcome": "failed",
            "reason": f"the backend failed to load: {error}", "world_sizes": [],
            "seconds": 0.0}
