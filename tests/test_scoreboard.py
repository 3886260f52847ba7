"""benchmarks/scoreboard.py turns conformance reports into per-section tables and lists
every case whose outcome differs between two upstream versions, with the reasons."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _report(backend: str, version: str, outcomes: dict[str, tuple[str, str]]) -> dict:
    cases = [{"id": f"test_x.py::{cid}", "spec_ids": ["FC-1"], "outcome": outcome,
              "reason": reason, "world_sizes": [2], "seconds": 0.1}
             for cid, (outcome, reason) in outcomes.items()]
    return {"backend": backend, "backend_spec": backend, "torch_version": version,
            "python": "3.11.7", "world_sizes": [2], "seconds": 12.0, "cases": cases}


def test_tables_count_outcomes_per_rule_and_differences_carry_both_reasons(tmp_path):
    reports = {
        "refimpl": _report("refimpl", "2.13.0+cpu", {"a": ("passed", ""), "b": ("passed", ""),
                                                     "c": ("skipped", "needs a GPU")}),
        "old": _report("torch", "2.13.0+cpu", {"a": ("passed", ""),
                                               "b": ("xfailed", "no gradient for avg"),
                                               "c": ("not_implemented", "no concept")}),
        "new": _report("torch", "2.14.1", {"a": ("failed", "AssertionError: 3 != 4"),
                                           "b": ("passed", ""),
                                           "c": ("not_implemented", "no concept")}),
    }
    paths = []
    for name, report in reports.items():
        paths.append(tmp_path / f"{name}.json")
        paths[-1].write_text(json.dumps(report))
    out = tmp_path / "board.md"
    subprocess.run([sys.executable, "benchmarks/scoreboard.py", "make", *map(str, paths),
                    "-o", str(out)], cwd=ROOT, check=True, capture_output=True, timeout=120)
    text = out.read_text()
    assert "| refimpl (torch 2.13.0+cpu) | 3 | 2 | 0 | 0 | 1 | 0 | 12 |" in text
    assert "| FC-1 | 2/3 (1 skip) | 1/3 (1 n/i, 1 xfail) | 1/3 (1 fail, 1 n/i) |" in text
    differences = text.split("## Differences between torch 2.13.0+cpu and torch 2.14.1")[1]
    assert "`test_x.py::a`: passed on torch 2.13.0+cpu, failed on torch 2.14.1." in differences
    assert "AssertionError: 3 != 4" in differences
    assert "`test_x.py::b`: xfailed on torch 2.13.0+cpu, passed" in differences
    assert "no gradient for avg" in differences
    assert "test_x.py::c" not in differences  # the same outcome on both
