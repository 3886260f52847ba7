"""How many mutants of tests/mutants.py the fuzzer alone catches (issue 27's measure).

Each mutant of the chosen sections is applied to a fresh copy of the checkout and the copy
runs `python -m conformance --fuzz N --seed S --section <its section> -x --json R`. A
mutant counts as caught only when a generated program's stage *failed on a rule* (a
problem naming a SPEC ID, or a rank refusing bad options as the rule wants it refused):
a backend that fails to load, or a run that ends without a report, is listed apart as
"broken", not caught.

    python benchmarks/fuzz_catch.py [--sections BK CL RO MEM] [--programs 20] [--seed 1000]
        [--sample K] [--jobs 2] [--only NAME ...]

Prints one line per mutant, then a table per section in the form of
benchmarks/results/fuzz.md.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.mutants import MUTANTS, copy_checkout  # noqa: E402


def run_one(mutant, programs: int, seed: int, timeout_s: float) -> tuple[str, str]:
    """(outcome, detail): caught, survived, broken or timeout."""
    with tempfile.TemporaryDirectory(prefix=f"fuzzcatch-{mutant.name}-") as tmp:
        root = copy_checkout(Path(tmp) / "checkout")
        mutant.apply(root)
        report = Path(tmp) / "report.json"
        command = [sys.executable, "-m", "conformance", "--fuzz", str(programs), "--seed",
                   str(seed), "--section", mutant.section, "-x", "--json", str(report)]
        try:
            done = subprocess.run(command, cwd=root, capture_output=True, text=True,
                                  timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return "timeout", f"no report in {timeout_s:.0f} s"
        if not report.exists():
            return "broken", (done.stderr or done.stdout).strip().splitlines()[-1:]
        records = json.loads(report.read_text())["cases"]
        for record in records:
            if record["outcome"] != "failed":
                continue
            if record["reason"].startswith("the backend failed to load"):
                return "broken", record["reason"].splitlines()[0][:160]
            return "caught", record["id"] + ": " + record["reason"].splitlines()[0][:160]
        return "survived", f"{len(records)} programs passed"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sections", nargs="+", default=["BK", "CL", "RO", "MEM"])
    parser.add_argument("--programs", type=int, default=20)
    parser.add_argument("--seed", type=int, default=1000)
    parser.add_argument("--sample", type=int, default=0,
                        help="draw this many mutants with random.Random(2026) (0: all)")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--only", nargs="*", default=[])
    parser.add_argument("--timeout", type=float, default=600.0)
    args = parser.parse_args(argv)
    pool = [m for m in MUTANTS if m.section in args.sections]
    if args.only:
        pool = [m for m in pool if m.name in args.only]
    if args.sample:
        pool = random.Random(2026).sample(pool, min(args.sample, len(pool)))
    started = time.monotonic()
    outcomes: dict[str, Counter] = {}

    def one(mutant):
        outcome, detail = run_one(mutant, args.programs, args.seed, args.timeout)
        print(f"[{time.monotonic() - started:5.0f} s] {mutant.section:4} {outcome:8} "
              f"{mutant.name}: {detail}", flush=True)
        return mutant, outcome

    with ThreadPoolExecutor(args.jobs) as executor:
        for mutant, outcome in executor.map(one, pool):
            outcomes.setdefault(mutant.section, Counter())[outcome] += 1
    total = Counter()
    print("\n| section | mutants | caught by the fuzzer alone | survived | broken or timeout |")
    print("|---|---:|---:|---:|---:|")
    for section in args.sections:
        c = outcomes.get(section, Counter())
        total.update(c)
        print(f"| {section} | {sum(c.values())} | {c['caught']} | {c['survived']} | "
              f"{c['broken'] + c['timeout']} |")
    n = sum(total.values())
    print(f"| **total** | **{n}** | **{total['caught']} ({100 * total['caught'] // max(n, 1)}%)**"
          f" | {total['survived']} | {total['broken'] + total['timeout']} |")
    print(f"\n--programs {args.programs} --seed {args.seed}, {time.monotonic() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
