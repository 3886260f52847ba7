"""Generated-program conformance (SPEC CF-12: `python -m conformance --fuzz N`,
conformance/fuzz/).

A small budget passes on refimpl; a backend whose all_gather bucketing copies its
members into the bucket in the wrong order is caught, with a reproducer that reruns the
failure; a seed gives the same programs in any process; --fuzz refuses what it cannot
run. The rank processes import this module by name (`test_fuzz:...`) to rebuild the
wrong backend, so it stays cheap to import.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BROKEN = "test_fuzz:broken_bucketing_backend"
# The programs from this seed on merge two all_gathers of distinct values within a few
# (the swap shows only there); the test takes the first that fails.
BROKEN_SEED = 9


def broken_bucketing_backend():
    """refimpl, but a merged all_gather concatenates its members in reverse order while
    the copy-outs still split them in program order: each member gets another's values."""
    import refimpl.bucketing as bucketing
    from conformance.backends import Backend
    from conformance.backends.refimpl_backend import backend as refimpl

    def bucket_all_gather(gm, cap_fn, **options):
        bucketing.bucket_all_gather(gm, cap_fn, **options)
        for node in gm.graph.nodes:
            tag = node.meta.get("refimpl_block")
            if node.target is _aten_cat() and tag and tag[0] == "all_gather":
                node.args = (list(reversed(node.args[0])), *node.args[1:])
        gm.recompile()

    concepts = {c: refimpl.require(c) for c in ("functional_collectives", "lowering",
                                                "reorder", "memory")}
    concepts["bucketing"] = types.SimpleNamespace(
        bucket_all_gather=bucket_all_gather,
        bucket_reduce_scatter=bucketing.bucket_reduce_scatter,
        bucket_all_reduce=bucketing.bucket_all_reduce)
    return Backend("broken-bucketing", concepts)


def _aten_cat():
    import torch

    return torch.ops.aten.cat.default


def _main(*argv) -> int:
    from conformance.__main__ import main

    return main(list(argv))


def test_a_small_budget_passes_on_refimpl(tmp_path, capsys):
    """3 programs through every stage: one line each, the report, a JSON record per
    (program, stage) in the schema of the normal report. (Seeds 0..2 draw programs of 2
    ranks: starting 4 more rank processes would double the test's time.)"""
    report = tmp_path / "fuzz.json"
    assert _main("--fuzz", "3", "--seed", "0", "-n", "0", "--json", str(report)) == 0
    out = capsys.readouterr().out
    assert len(re.findall(r"^\[ *\d+ s\] program \d \(seed \d+", out, re.M)) == 3, out
    data = json.loads(report.read_text())
    assert data["fuzz"] == {"programs": 3, "seed": 0, "sections": ["BK", "CL", "RO", "MEM"]}
    records = data["cases"]
    assert [r["id"] for r in records] == [f"fuzz::{s}::0::{i}" for i in range(3)
                                          for s in ("BK", "CL", "RO", "MEM")]
    assert {r["outcome"] for r in records} == {"passed"}, [r["reason"] for r in records]
    assert set(records[0]) == {"id", "section", "spec_ids", "outcome", "reason",
                               "world_sizes", "seconds"}
    assert records[0]["section"] == "3. Bucketing" and records[0]["spec_ids"][0] == "BK-2"


@pytest.mark.slow
def test_a_longer_budget_passes_on_refimpl(tmp_path):
    """Second tier: 40 programs (2 and 4 ranks) through every default stage, on a seed of
    its own (the first tier's smoke run draws seeds 0..2)."""
    report = tmp_path / "fuzz.json"
    code = _main("--fuzz", "40", "--seed", "1000", "-n", "0", "--json", str(report))
    records = json.loads(report.read_text())["cases"]
    failed = [(r["id"], r["reason"][:2000]) for r in records if r["outcome"] != "passed"]
    assert code == 0 and len(records) == 40 * 4 and not failed, failed


@pytest.mark.slow
def test_wrong_bucketing_is_caught_with_a_reproducer(tmp_path):
    """Second tier (shrinking reruns the stage some 20 times: about 90 s on 2 busy cores).
    The failure names BK-8, carries the shrunk program's source, its options and the
    command; that command's seed and section fail again; listed by rule in the backend's
    expected failures, it is expected (CF-12)."""
    from conformance import fuzz
    from conformance.backends import get_backend

    backend = get_backend(BROKEN)
    records = fuzz.run(backend, BROKEN, 8, BROKEN_SEED, ["BK"], exitfirst=True,
                       shrink_runs=6, write=lambda line: None)
    assert records[-1]["outcome"] == "failed", records
    failing_seed = BROKEN_SEED + len(records) - 1
    reason = records[-1]["reason"]
    assert re.search(r"BK-8: (bucketed )?values differ", reason), reason
    assert "def program(ops, *inputs):" in reason and "all_gather_into_tensor" in reason
    assert "options: {'caps_bytes':" in reason
    command = re.search(r"rerun: (python -m conformance .*)", reason).group(1)
    assert command == (f"python -m conformance --fuzz 1 --seed {failing_seed} --section BK "
                       f"--backend {BROKEN}")
    again = fuzz.run(backend, BROKEN, 1, failing_seed, ["BK"], shrink_runs=6,
                     write=lambda line: None)
    assert again[0]["reason"] == reason  # the same program, shrunk the same way
    # A backend whose expected failures name BK-8 (as upstream's name their known
    # differences) gets the same failure as `xfailed`, matched by rule; one that lists
    # another rule, as a finding (`failed`).
    listed = tmp_path / "expected.txt"
    backend.expected_failures = str(listed)
    outcomes = []
    for rule in ("BK-3", "BK-8"):
        listed.write_text(f"test_bucketing.py::test_some_case  missing {rule}: known to differ\n")
        known = fuzz.run(backend, BROKEN, 1, failing_seed, ["BK"], shrink_runs=0,
                         write=lambda line: None)[0]
        outcomes.append(known["outcome"])
    assert outcomes == ["failed", "xfailed"]
    assert known["reason"].startswith("an expected difference by rule BK-8: test_bucketing.py"
                                      "::test_some_case: missing BK-8: known to differ\n"), known
    assert "rerun: python -m conformance --fuzz 1" in known["reason"]


def test_a_stage_the_backend_lacks_is_not_implemented():
    """No stage passes without its concept (CF-3); nothing runs on ranks for it."""
    import refimpl.functional_collectives as fc
    from conformance import fuzz
    from conformance.backends import Backend

    bare = Backend("bare", {"functional_collectives": fc,
                            "bucketing": types.SimpleNamespace(bucket_all_gather=len)})
    records = fuzz.run(bare, "bare", 2, 0, list(fuzz.STAGES), write=lambda line: None)
    assert {r["outcome"] for r in records} == {"not_implemented"}
    assert "bucket_reduce_scatter" in records[0]["reason"]


def test_a_seed_gives_the_same_programs_in_any_process():
    from conformance import fuzz

    sources = [fuzz.program_of_seed(s).program.source() for s in (11, 12)]
    assert sources[0] != sources[1]
    env = {**os.environ, "PYTHONHASHSEED": "123"}
    again = subprocess.run(
        [sys.executable, "-c", "from conformance import fuzz; "
         "print(fuzz.program_of_seed(11).program.source(), end='')"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert again.stdout == sources[0], again.stderr


@pytest.mark.parametrize("argv, named", [
    (["--fuzz", "0"], "--fuzz"),
    (["--fuzz", "-2"], "--fuzz"),
    (["--seed", "3"], "--seed"),
    (["--fuzz", "1", "--section", "FC"], "--section FC"),
    (["--fuzz", "1", "-k", "bucket"], "-k"),
])
def test_what_fuzz_cannot_run_is_refused(argv, named, capsys):
    with pytest.raises(SystemExit) as stop:
        _main(*argv)
    assert stop.value.code == 2
    assert named in capsys.readouterr().err
