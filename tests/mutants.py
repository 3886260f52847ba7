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

# --------------------------------------------------------------------------------------
# 5. Memory (MEM)
# --------------------------------------------------------------------------------------
MEMORY = "refimpl/memory.py"
MEM = [
    Mutant("mem_free_after_first_alias", "MEM-3", MEMORY,
           "                used.extend(b.index for b in self.node_buffers.get(arg, ()))\n",
           "                used.extend(b.index for b in self.node_buffers.get(arg, ())\n"
           "                            if b.alloc_node is arg)\n",
           "only readers of the allocating node count: a buffer is freed after the last use "
           "of its first alias, not of its last"),
    Mutant("mem_view_counted", "MEM-2", MEMORY,
           "                buffers.extend(sources[0] for _ in tensors)  # views of one buffer\n",
           "                buffers.extend(self._new_buffer(node, t) for t in tensors)\n",
           "a view is counted as a buffer of its own"),
    Mutant("mem_collective_input_freed_before_wait", "MEM-5", MEMORY,
           "            held = [done] if result_only else \\\n",
           "            held = [done] if True else \\\n",
           "only a collective's result is held in flight: its input is freed at its last reader"),
    Mutant("mem_free_before_alloc", "MEM-9", MEMORY,
           "        allocated = self._allocate(node)  # a node's outputs before its frees (MEM-9)\n"
           "        self._free(node, allocated)\n",
           "        self._free(node, self.model.allocs.get(node, ()))\n"
           "        allocated = self._allocate(node)\n",
           "alloc/free order at a node flipped: a node's dying inputs are freed before its "
           "outputs are allocated"),
    Mutant("mem_comm_buffer_freed", "MEM-8", MEMORY,
           "        self.pinned = [b.kind != INTERMEDIATE for b in self.buffers]\n",
           "        self.pinned = [b.kind in (INPUT, OUTPUT) for b in self.buffers]\n",
           "a comm buffer is freed at its last use like an intermediate"),
    Mutant("mem_input_freed", "MEM-6", MEMORY,
           "        self.pinned = [b.kind != INTERMEDIATE for b in self.buffers]\n",
           "        self.pinned = [b.kind in (OUTPUT, COMM_BUFFER) for b in self.buffers]\n",
           "graph inputs are freed at their last reader"),
    Mutant("mem_output_freed", "MEM-7", MEMORY,
           "                    if buffer.kind == INTERMEDIATE:\n"
           "                        buffer.kind = OUTPUT\n",
           "                    if buffer.kind == INPUT:\n"
           "                        buffer.kind = OUTPUT\n",
           "outputs are not marked: a returned intermediate is freed at its last reader"),
    Mutant("mem_wait_namespace", "MEM-4", MEMORY,
           'UNANNOTATED_RENAMES = {("_c10d_functional", "wait_tensor"), ("aten", "_unsafe_view")}',
           'UNANNOTATED_RENAMES = {("refimpl_c10d", "wait_tensor"), ("aten", "_unsafe_view")}',
           "the rename table names refimpl's wait instead of upstream's: refimpl's copy is "
           "not counted and upstream's rename is"),
    Mutant("mem_coalesced_holds_every_input", "MEM-5", MEMORY,
           "        return [([a], i) for i, a in enumerate(args)]\n",
           "        return [(args, i) for i, a in enumerate(args)]\n",
           "each member of a coalesced collective holds every member's input"),
    Mutant("mem_dead_value_kept", "MEM-3", MEMORY,
           "        dying = [b for b in allocated if self.remaining[b] == 0]  # read by nobody\n",
           "        dying = []\n",
           "a buffer nobody reads is never freed"),
    Mutant("mem_wait_completes_nothing", "MEM-5", MEMORY,
           "                    b.index for a in _tensor_args(node.args[:1])\n",
           "                    b.index for a in _tensor_args(node.args[1:])\n",
           "a wait's argument is looked up at the wrong index: nothing in flight is released"),
    Mutant("mem_duplicate_in_order", "MEM-11", MEMORY,
           "            if node in position:\n",
           "            if node in position and node.op == \"placeholder\":\n",
           "a node listed twice in an order is not refused"),
    Mutant("mem_verifier_size", "MEM-12", MEMORY,
           "        if nbytes != buffer.nbytes:\n",
           "        if nbytes > buffer.nbytes:\n",
           "the verifier only refuses a storage larger than planned"),
    Mutant("mem_verifier_unpredicted_free", "MEM-12", MEMORY,
           "        for b in expected - freed.keys():\n",
           "        for b in expected - freed.keys() - expected:\n",
           "the verifier does not check that a predicted free happened"),
]

# --------------------------------------------------------------------------------------
# 8. Simulator (SIM)
# --------------------------------------------------------------------------------------
SIMULATOR = "refimpl/simulator.py"
SIM = [
    Mutant("sim_ring_steps", "SIM-2", SIMULATOR,
           "    return (n - 1) * link.alpha_us + (n - 1) / n * nbytes / link.beta_bytes_per_us\n",
           "    return n * link.alpha_us + (n - 1) / n * nbytes / link.beta_bytes_per_us\n",
           "ring latency off by one: n steps instead of n-1"),
    Mutant("sim_ring_bytes", "SIM-2", SIMULATOR,
           "    return (n - 1) * link.alpha_us + (n - 1) / n * nbytes / link.beta_bytes_per_us\n",
           "    return (n - 1) * link.alpha_us + nbytes / link.beta_bytes_per_us\n",
           "ring bandwidth term without the (n-1)/n factor"),
    Mutant("sim_all_reduce_one_ring", "SIM-2", SIMULATOR,
           '    "all_reduce": (_input_bytes, _TWICE_RING),\n',
           '    "all_reduce": (_input_bytes, _RING),\n',
           "all_reduce costed as one ring pass instead of a reduce-scatter plus an all-gather"),
    Mutant("sim_wait_not_blocking", "SIM-7", SIMULATOR,
           "                compute = max(compute, ready) + d\n",
           "                compute = compute + d\n",
           "a wait does not block the compute stream"),
    Mutant("sim_one_comm_stream", "SIM-6", SIMULATOR,
           "                start = max(compute, stream_free.get(stream, 0.0))"
           "  # issued, then queued\n",
           "                start = max(compute, *stream_free.values())  # issued, then queued\n",
           "one comm stream for all groups: a collective waits for every group's previous one"),
    Mutant("sim_group_not_serialized", "SIM-6", SIMULATOR,
           "                start = max(compute, stream_free.get(stream, 0.0))"
           "  # issued, then queued\n",
           "                start = compute  # issued, then queued\n",
           "collectives of one group run concurrently"),
    Mutant("sim_view_costs", "SIM-4", SIMULATOR,
           "        if is_wait(node) or _is_view(node.target):\n",
           "        if is_wait(node):\n",
           "views are costed as compute (bytes moved)"),
    Mutant("sim_pinned_typo_accepted", "SIM-1", SIMULATOR,
           "        unknown = sorted(set(self.pinned) - names)\n",
           "        unknown = sorted(set(self.pinned) - names - set(self.pinned))\n",
           "a pinned name that names no node is silently ignored"),
    Mutant("sim_overlap_inverted", "SIM-8", SIMULATOR,
           "        overlap = (comm - exposed) / comm if comm > 0 else 1.0\n",
           "        overlap = exposed / comm if comm > 0 else 1.0\n",
           "overlap reports the exposed fraction instead of the hidden one"),
    Mutant("sim_mm_flops_halved", "SIM-3", SIMULATOR,
           "    a, b = _val(node.args[0]), _val(node.args[1])\n"
           "    return 2 * a.shape[0] * a.shape[1] * b.shape[1]\n",
           "    a, b = _val(node.args[0]), _val(node.args[1])\n"
           "    return a.shape[0] * a.shape[1] * b.shape[1]\n",
           "a multiply-add counted as one FLOP"),
    Mutant("sim_roofline_sum", "SIM-3", SIMULATOR,
           "        return self.profile.op_overhead_us + max(flops / rate,\n",
           "        return self.profile.op_overhead_us + flops / rate + max(0,\n",
           "compute and memory time added instead of the slower of the two"),
    Mutant("sim_blocking_not_exposed", "SIM-7", SIMULATOR,
           "                exposed += end - compute\n",
           "                exposed += 0.0\n",
           "a blocking one-shot all-reduce is not counted as exposed communication"),
    Mutant("sim_peak_of_program_order", "SIM-8", SIMULATOR,
           "        plan = self.memory.plan(full)\n",
           "        plan = self.memory.plan()\n",
           "peak memory of the program order, not of the simulated one"),
    Mutant("sim_trace_duration", "SIM-9", SIMULATOR,
           '"ts": e.start_us, "dur": e.end_us - e.start_us,',
           '"ts": e.start_us, "dur": e.end_us,',
           "the trace's duration is the event's end time"),
    Mutant("sim_link_default_first", "SIM-11", SIMULATOR,
           "        link = self.links.get(group_size, self.links.get(0))\n",
           "        link = self.links.get(0, self.links.get(group_size))\n",
           "the default link shadows a group size's own"),
]

MUTANTS: list[Mutant] = [*FC, *CL, *BK, *MEM, *SM, *SIM]
