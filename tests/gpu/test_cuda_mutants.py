"""The CUDA mutants (tests/mutants.py `CUDA_MUTANTS`): each slip in kernels/cuda/symm_mem.cu
must fail the conformance section SM run on the GPU (`--device cuda`).

Each test copies the checkout, applies one mutant and runs `python -m conformance --section
SM --device cuda --first <its catching case> --first <its rule> -x -n 0` there, as
tests/test_mutants.py does for the CPU's mutants. Skipped without CUDA.

A mutated kernel is compiled on first use in the copy (tens of seconds of nvcc each). On a
machine with nvcc and no GPU, `python tests/gpu/test_cuda_mutants.py --build` compiles every
mutant's library into this checkout's build/refimpl-kernels/ under its source hash, which a
copy finds there: tests/gpu/run_on_device.sh carries them to the GPU machine.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent.parent), str(HERE.parent)]

from mutants import (  # noqa: E402
    CUDA_MUTANTS,
    KERNEL_BUILDS,
    ROOT,
    Mutant,
    copy_checkout,
)

CASE_TIMEOUT_S = 90


def _run_section(root: Path, mutant: Mutant, report: Path) -> subprocess.CompletedProcess:
    # The copy first, then what the caller had (run_on_device.sh puts the carried wheels,
    # expecttest among them, there: without it every golden case module fails to import).
    path = os.pathsep.join([str(root), *filter(None, [os.environ.get("PYTHONPATH")])])
    env = {**os.environ, "PYTHONPATH": path}
    env.pop("EXPECTTEST_ACCEPT", None)
    args = ["--backend", "refimpl", "--device", "cuda", "--section", "SM", "--first", mutant.catch,
            "--first", mutant.rule, "-x", "-n", "0", "--case-timeout", str(CASE_TIMEOUT_S),
            "--json", str(report)]
    return subprocess.run([sys.executable, "-m", "conformance", *args], cwd=root, env=env,
                          capture_output=True, text=True, timeout=600)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("mutant", CUDA_MUTANTS, ids=lambda m: m.name)
def test_conformance_on_cuda_fails_the_mutant(mutant, tmp_path):
    root = copy_checkout(tmp_path / "checkout")
    mutant.apply(root)
    report = tmp_path / "report.json"
    proc = _run_section(root, mutant, report)
    output = f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    assert report.exists(), f"mutant {mutant.name}: the runner wrote no report:\n{output}"
    cases = json.loads(report.read_text())["cases"]
    unloadable = [c["id"] for c in cases if c["outcome"] == "failed" and not c["spec_ids"]]
    assert not unloadable, f"case modules failed to load, not the mutant: {unloadable}\n{output}"
    failed = [c["id"] for c in cases if c["outcome"] == "failed"
              and any(i.startswith("SM-") for i in c["spec_ids"])]
    assert failed, f"mutant {mutant.name} survived the SM section on cuda:\n{output}"
    log = os.environ.get("REFIMPL_CUDA_MUTANT_LOG")
    if log:  # which case caught it, for the report (pytest-xdist keeps print() to itself)
        with open(log, "a") as f:
            f.write(f"CUDA mutant {mutant.name} ({mutant.rule}): caught by {failed[0]}\n")


def build_mutant_libraries() -> list[Path]:
    """Compile each mutant's CUDA library into this checkout's build/refimpl-kernels/."""
    from refimpl import _native

    built = []
    for mutant in CUDA_MUTANTS:
        if not mutant.path.endswith(".cu"):
            continue
        with tempfile.TemporaryDirectory() as tmp:
            root = Path(tmp)
            (root / "kernels").mkdir()
            source = root / mutant.path
            source.parent.mkdir(parents=True, exist_ok=True)
            source.write_text((ROOT / mutant.path).read_text())
            mutant.apply(root)
            digest = _native.source_hash(source, _native.nvcc_flags())
            target = ROOT / KERNEL_BUILDS / f"libsymm_mem_cuda-{digest}.so"
            if not target.exists():
                _native.compile_cuda_library(source, target)
            built.append(target)
            print(f"{mutant.name}: {target.name}")
    return built


if __name__ == "__main__" and sys.argv[1:] == ["--build"]:
    build_mutant_libraries()
