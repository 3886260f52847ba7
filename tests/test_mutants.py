"""The conformance suite catches bugs: each mutant backend fails on the expected case (CF-6)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
F = "test_functional_collectives.py::"

# mutant -> (-k expression that selects the cases to run, a case that must fail)
MUTANTS = {
    "all_reduce_returns_input": ("eager_values and 2-name-f32-all_reduce",
                                 F + "test_eager_values[2-name-f32-all_reduce:sum]"),
    "never_waits": ("work_registry", F + "test_work_registry"),
    "reduce_scatter_wrong_chunk": ("eager_values and 4-rows-f32-reduce_scatter",
                                   F + "test_eager_values[4-rows-f32-reduce_scatter:sum:0]"),
    "all_gather_reversed": ("eager_values and 2-pg-i64-all_gather",
                            F + "test_eager_values[2-pg-i64-all_gather:0]"),
    "broadcast_global_src": ("eager_values and 4-noncontig-f32-broadcast",
                             F + "test_eager_values[4-noncontig-f32-broadcast:1]"),
    "wait_tensor_does_not_wait": ("work_registry", F + "test_work_registry"),
    "traced_all_reduce_without_wait": ("make_fx", F + "test_make_fx_graph"),
}


@pytest.mark.parametrize("mutant", list(MUTANTS))
def test_conformance_catches_mutant(mutant, tmp_path):
    expr, must_fail = MUTANTS[mutant]
    report = tmp_path / "report.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "tests"), str(ROOT)])}
    env.pop("EXPECTTEST_ACCEPT", None)
    proc = subprocess.run(
        [sys.executable, "-m", "conformance", "--backend", f"mutants:{mutant}", "-n", "0",
         "-k", expr, "--json", str(report)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, f"the suite passed mutant {mutant}:\n{proc.stdout[-3000:]}"
    outcomes = {c["id"]: c["outcome"] for c in json.loads(report.read_text())["cases"]}
    assert outcomes.get(must_fail) == "failed", (mutant, outcomes)
