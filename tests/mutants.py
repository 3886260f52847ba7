"""Mutants: plausible one-line slips in refimpl, each breaking one SPEC rule (CF-6).

A mutant is a textual patch of one file of the checkout (Python or C): `old` must occur
exactly once in `path`, and is replaced by `new`. Each is the kind of slip a real
implementation makes at a rule's boundary (an off-by-one at a bound, a key computed
from the wrong property, a check or a synchronisation step left out) and names the rule
it breaks. `tests/test_mutants.py` applies each one to a copy of the checkout and runs
`python -m conformance --section <its section> --first <its rule> -x -n 0` there: the
conformance suite alone must fail every mutant, on a case that fails (a run that crashes
without a report does not count).

One list per SPEC section, named by the section's prefix (`FC`, `CL`, `MEM`, ...), so that
each section's owner adds to its own list; `MUTANTS` gathers the lists of every section
SPEC.md has. Run one: `pytest -n 0 tests/test_mutants.py -k <name>`.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

from conformance.spec import sections

ROOT = Path(__file__).resolve().parent.parent
# What a copy of the checkout needs to run the conformance suite on its own.
COPIED = ["refimpl", "conformance", "kernels", "pyproject.toml", "conftest.py", "setup.py",
          "SPEC.md"]
# Kernel libraries built earlier (refimpl/_native.py): found by the hash of their source,
# so the copy reuses an unchanged kernel's library and compiles a mutated kernel afresh.
KERNEL_BUILDS = "build/refimpl-kernels"


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
    """A copy of what the suite needs, kernel libraries included, without caches."""
    # Built libraries (*.so) are kept: refimpl/_native.py loads one only if it was built
    # from the very source the copy holds.
    ignore = shutil.ignore_patterns("__pycache__", "build", "*.egg-info")
    for name in COPIED:
        src = ROOT / name
        if src.is_dir():
            shutil.copytree(src, dest / name, ignore=ignore)
        elif src.exists():
            shutil.copy2(src, dest / name)
    if (ROOT / KERNEL_BUILDS).is_dir():
        shutil.copytree(ROOT / KERNEL_BUILDS, dest / KERNEL_BUILDS,
                        ignore=shutil.ignore_patterns("*.tmp"))
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
# 4. Scheduler reorder (RO)
# --------------------------------------------------------------------------------------
_RO = "refimpl/reorder.py"
RO = [
    Mutant("ro_wait_is_no_write", "RO-4", _RO,
           "                writes.update(model.completes[node])\n", "",
           "the wait only reads its argument: a reader of the in-place collective's buffer "
           "(which reads the collective's node, FC-5) is sunk past it, before the wait"),
    Mutant("ro_wait_ends_no_in_flight_read", "RO-4", _RO,
           "                reads.update(b for _, held in done for b in held)",
           "                reads.update(())",
           "a collective's input is read only at its issue: it is mutated while in flight"),
    Mutant("ro_mutation_before_reader", "RO-4", _RO,
           "                self.preds[i].update(readers)  # after every reader",
           "                self.preds[i].update(readers[:0])  # after every reader",
           "a write waits only for the write before it, not for that version's readers"),
    Mutant("ro_group_order_not_enforced", "RO-5", _RO,
           "                    self.preds[i].add(last[group])",
           "                    self.preds[i].discard(last[group])",
           "collectives of one group may pass each other (upstream's unsafe reorder)"),
    Mutant("ro_group_order_per_kind", "RO-5", _RO,
           'group = str(_fx.arguments(node, "RO-5")["group_name"])',
           'group = str(_fx.arguments(node, "RO-5")["group_name"]) + str(collective_kind(node))',
           "issue order kept per (group, kind), the in-flight key: a reduce_scatter passes "
           "an all_gather of its group"),
    Mutant("ro_custom_op_not_a_barrier", "RO-6", _RO,
           '    if namespace in ("aten", "prims"):\n',
           '    if namespace not in COMMUNICATING_NAMESPACES:\n',
           "only ops of communicating namespaces are barriers: a side-effecting custom op "
           "is moved across"),
    Mutant("ro_prologue_left_behind", "RO-7", _RO,
           "                members = self._prologue(i, block_of) + [i]",
           "                members = [i]",
           "a collective raised without its cast / clone: it waits for its prologue"),
    Mutant("ro_tagged_blocks_ignored", "RO-7", _RO,
           "            tag = node.meta.get(BLOCK_META)",
           '            tag = node.meta.get("refimpl_bucket")',
           "blocks read from the wrong meta key: bucketing's blocks are torn apart"),
    Mutant("ro_in_flight_off_by_one", "RO-8", _RO,
           "self.in_flight.get(block.flight, 0) < limit",
           "self.in_flight.get(block.flight, 0) <= limit",
           "the in-flight limit compared with <=: one collective more than the limit"),
    Mutant("ro_memory_bound_strict", "RO-9", _RO,
           "return self.later_high[cur] + ahead <= self.limit",
           "return self.later_high[cur] + ahead < self.limit",
           "the memory bound compared with <: a move that reaches the limit exactly is "
           "refused"),
    Mutant("ro_memory_bound_of_the_handed_in_order", "RO-9", _RO,
           "        original_peak = sweep.peak_bytes",
           "        original_peak = p.model.plan().peak_bytes",
           "the budget measured against the order handed in: a second pass spends it again"),
    Mutant("ro_stall_ignored", "RO-12", _RO,
           "        if stall_end <= self.clock:",
           "        if True:",
           "compute chosen by original position alone: a block that waits on a running "
           "collective stalls the stream while independent compute is ready"),
    Mutant("ro_ties_broken_by_name", "RO-12", _RO,
           "        return block.pos\n", "        return self.p.body[block.pos].name\n",
           "ties broken by node name instead of original position"),
]

# --------------------------------------------------------------------------------------
# 6. Symmetric memory (SM), C kernels included
# --------------------------------------------------------------------------------------
SM: list[Mutant] = []


def section_lists() -> dict[str, list[Mutant]]:
    """{prefix: that section's list above}, for every section of SPEC.md, in its order."""
    return {prefix: globals().get(prefix, []) for prefix in sections()}


MUTANTS: list[Mutant] = [m for section in section_lists().values() for m in section]
