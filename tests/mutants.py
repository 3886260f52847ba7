"""Mutants: plausible one-line slips in refimpl, each breaking one SPEC rule.

A mutant is a textual patch of one file of the checkout (Python or C): `old` must occur
exactly once in `path`, and is replaced by `new`. Each is the kind of slip a real
implementation makes at a rule's boundary (an off-by-one at a bound, a key computed
from the wrong property, a check or a synchronisation step left out) and names the rule
it breaks. `tests/test_mutants.py` applies each one to a copy of the checkout and runs
`python -m conformance --section <its section>` there: the conformance suite alone must
fail every mutant (CF-6).

Mutants are grouped by SPEC section, one list per section, so that each section's owner
adds to its own list.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# What a copy of the checkout needs to run the conformance suite on its own.
COPIED = ["refimpl", "conformance", "kernels", "pyproject.toml", "conftest.py", "setup.py"]


@dataclass(frozen=True)
class Mutant:
    name: str  # unique, short, snake_case
    rule: str  # the SPEC ID it breaks, e.g. "FC-20"
    path: str  # file relative to the repository root
    old: str  # text that occurs exactly once in `path`
    new: str  # what replaces it: a one-line slip
    why: str = ""  # the plausible mistake, in words

    @property
    def section(self) -> str:
        return self.rule.rsplit("-", 1)[0]

    def apply(self, root: Path) -> None:
        """Patch the copy of the checkout at `root` (refuses an ambiguous `old`)."""
        target = root / self.path
        text = target.read_text()
        count = text.count(self.old)
        if count != 1:
            raise ValueError(f"mutant {self.name}: {self.old!r} occurs {count} times in "
                             f"{self.path}, expected exactly once")
        target.write_text(text.replace(self.old, self.new))


def copy_checkout(dest: Path) -> Path:
    """A copy of what the suite needs, without build outputs or caches."""
    ignore = shutil.ignore_patterns("__pycache__", "*.so", "build", "*.egg-info")
    for name in COPIED:
        src = ROOT / name
        if src.is_dir():
            shutil.copytree(src, dest / name, ignore=ignore)
        elif src.exists():
            shutil.copy2(src, dest / name)
    return dest


# --------------------------------------------------------------------------------------
# 1. Functional collectives (FC)
# --------------------------------------------------------------------------------------
FC = [
    Mutant("all_gather_group_size_unchecked", "FC-19", "refimpl/functional_collectives.py",
           "    if group_size != pg.size():\n",
           "    if group_size > pg.size():\n",
           "group_size compared with < instead of !=: a smaller group_size passes"),
]

# --------------------------------------------------------------------------------------
# 2. Comm lowering (CL)
# --------------------------------------------------------------------------------------
CL: list[Mutant] = []

# --------------------------------------------------------------------------------------
# 3. Bucketing (BK)
# --------------------------------------------------------------------------------------
BK: list[Mutant] = []

# --------------------------------------------------------------------------------------
# 6. Symmetric memory (SM), C kernels included
# --------------------------------------------------------------------------------------
SM: list[Mutant] = []

MUTANTS: list[Mutant] = [*FC, *CL, *BK, *SM]
