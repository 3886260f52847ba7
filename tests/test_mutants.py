"""The conformance suite catches every mutant of tests/mutants.py (CF-6).

Each mutant is applied to a fresh copy of the checkout, and the conformance suite of
the mutant's own SPEC section runs there against the `refimpl` backend (so it runs the
mutated code, C kernels rebuilt from the mutated source included). The suite must fail.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from mutants import MUTANTS, ROOT, copy_checkout

TIMEOUT_S = 600


def test_mutant_names_are_unique_and_rules_are_spec_ids():
    names = [m.name for m in MUTANTS]
    assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)
    spec = (ROOT / "SPEC.md").read_text()
    for m in MUTANTS:
        assert f"**{m.rule}**" in spec, f"mutant {m.name}: {m.rule} is not a SPEC rule"


@pytest.mark.parametrize("mutant", MUTANTS, ids=lambda m: f"{m.rule}-{m.name}")
def test_conformance_fails_the_mutant(mutant, tmp_path):
    root = copy_checkout(tmp_path / "checkout")
    mutant.apply(root)
    report = tmp_path / "report.json"
    env = {**os.environ, "PYTHONPATH": str(root)}
    env.pop("EXPECTTEST_ACCEPT", None)
    proc = subprocess.run(
        [sys.executable, "-m", "conformance", "--backend", "refimpl", "--section",
         mutant.section, "-x", "-n", "0", "--json", str(report)],
        cwd=root, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert report.exists(), f"no report for mutant {mutant.name}:\n{proc.stdout[-3000:]}" \
                            f"\n{proc.stderr[-3000:]}"
    cases = json.loads(report.read_text())["cases"]
    failed = [c["id"] for c in cases if c["outcome"] == "failed"]
    assert proc.returncode == 1 and failed, (
        f"the {mutant.section} section passed mutant {mutant.name} ({mutant.rule}: "
        f"{mutant.why}):\n{proc.stdout[-3000:]}")
