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
# 6. Symmetric memory (SM), C kernels included
# --------------------------------------------------------------------------------------
SM = [
    # C kernels
    Mutant("one_shot_second_barrier_left_out", "SM-15", "kernels/cpu/symm_mem.c",
           "  rsm_reduce(out, srcs, g->world, numel, dtype, op);\n"
           "  return barrier_until(g, channel, deadline);",
           "  rsm_reduce(out, srcs, g->world, numel, dtype, op);\n  return RSM_OK;",
           "one-shot returns after its own reduction: a peer may still read the input"),
    Mutant("barrier_puts_into_the_peers_own_slot", "SM-10", "kernels/cpu/symm_mem.c",
           "put(slot_of(g->pads[peer], world, channel, rank)",
           "put(slot_of(g->pads[peer], world, channel, peer)",
           "the slot index of a put taken from the receiver instead of the sender"),
    Mutant("reduction_in_reverse_rank_order", "SM-15", "kernels/cpu/symm_mem.c",
           "for (int r = 0; r < g->world; r++) srcs[r] = (char *)g->bufs[r] + offset;",
           "for (int r = 0; r < g->world; r++) srcs[r] = (char *)g->bufs[g->world - 1 - r] "
           "+ offset;",
           "ranks reduced last to first: other rounding, ranks may disagree with the spec"),
    Mutant("two_shot_chunk_rounded_down", "SM-16", "kernels/cpu/symm_mem.c",
           "int64_t chunk = (numel + g->world - 1) / g->world;",
           "int64_t chunk = numel / g->world;",
           "floor instead of ceil: the elements past world * chunk are never reduced"),
    Mutant("timeout_reported_as_success", "SM-11", "kernels/cpu/symm_mem.c",
           "return try_transition(slot, ready, ready_with_sleeper, next, order) ? 0 : 1;",
           "return try_transition(slot, ready, ready_with_sleeper, next, order) ? 1 : 0;",
           "the status of the last try after the deadline inverted"),
    Mutant("avg_divides_by_one_rank_less", "SM-15", "kernels/cpu/symm_mem.c",
           "acc[i] = acc[i] / (ACC_T)nsrc;", "acc[i] = acc[i] / (ACC_T)(nsrc - 1);",
           "avg divides by the number of additions instead of the number of ranks"),
    Mutant("max_drops_a_later_ranks_nan", "SM-15", "kernels/cpu/symm_mem.c",
           "#define FMAX(a, b) (isnan(a) ? (a) : (isnan(b) ? (b) : ((b) > (a) ? (b) : (a))))",
           "#define FMAX(a, b) (isnan(a) ? (a) : ((b) > (a) ? (b) : (a)))",
           "NaN propagates only from the accumulator, not from a later rank's input"),
    Mutant("call_check_skips_the_last_rank", "SM-20", "kernels/cpu/symm_mem.c",
           "for (int r = 1; r < g->world; r++) {\n    const int64_t *d = g->descs[r];",
           "for (int r = 1; r < g->world - 1; r++) {\n    const int64_t *d = g->descs[r];",
           "off by one: the last rank's call is never compared"),
    Mutant("barrier_waits_for_one_peer_less", "SM-10", "kernels/cpu/symm_mem.c",
           "  for (int i = 1; i < world; i++) {\n    int peer = (rank + i) % world;\n"
           "    if (take(",
           "  for (int i = 1; i < world - 1; i++) {\n    int peer = (rank + i) % world;\n"
           "    if (take(",
           "the barrier's wait loop stops one peer short"),
    # C++ op kernels
    Mutant("native_avg_accepted_for_integers", "SM-14", "kernels/cpu/symm_mem_ops.cpp",
           'if (op == "avg") return dtype <= 2 ? 1 : -1;', 'if (op == "avg") return 1;',
           "the fast path forgets that avg needs a floating dtype"),
    # Python
    Mutant("buffer_view_one_element_past_the_end", "SM-8", "refimpl/symmetric_memory.py",
           "        if end > limit:\n", "        if end > limit + element:\n",
           "the bound compares the end with one element of slack"),
    Mutant("one_channel_too_many", "SM-9", "refimpl/symmetric_memory.py",
           "self.channels = SIGNAL_PAD_SIZE // (4 * world_size)",
           "self.channels = SIGNAL_PAD_SIZE // (4 * world_size) + 1",
           "the channel count rounded up: the last channel's slots lie past the pad"),
    Mutant("world_size_of_64_refused", "SM-2", "refimpl/symmetric_memory.py",
           "not 1 <= world_size <= MAX_WORLD_SIZE", "not 1 <= world_size < MAX_WORLD_SIZE",
           "< for <= at the world size bound"),
    Mutant("a_live_view_of_a_persistent_allocation_not_counted", "SM-4",
           "refimpl/symmetric_memory.py",
           "alive = _storage_users(alloc.storage) > 1", "alive = _storage_users(alloc.storage) > 2",
           "the allocator's own tensor counted twice: one live holder goes unnoticed"),
    Mutant("persistent_layout_ignores_the_dtype", "SM-3", "refimpl/symmetric_memory.py",
           "layout = (size, stride, dtype)", "layout = (size, stride)",
           "a request of another dtype and the same shape gets the previous dtype's tensor"),
    Mutant("persistent_reuse_skips_the_byte_size_check", "SM-4", "refimpl/symmetric_memory.py",
           "nbytes = alloc.nbytes if same else _storage_elements(size, stride) * dtype.itemsize",
           "nbytes = alloc.nbytes",
           "the kept byte size compared with itself: a request of another size passes"),
    Mutant("barrier_timeout_not_fail_stop", "SM-19", "refimpl/symmetric_memory.py",
           'if what not in ("put_signal", "wait_signal"):',
           'if what not in ("put_signal", "wait_signal", "barrier"):',
           "a barrier that timed out leaves the handle usable, its stale signals with it"),
    Mutant("largest_alloc_id_refused", "SM-4", "refimpl/symmetric_memory.py",
           "not 0 <= alloc_id <= MAX_ALLOC_ID", "not 0 <= alloc_id < MAX_ALLOC_ID",
           "< for <= at the alloc_id bound"),
    Mutant("pad_offset_past_the_end_reported_as_sizes", "SM-8", "refimpl/symmetric_memory.py",
           "not 0 <= storage_offset <= elements:", "not 0 <= storage_offset <= elements + 1:",
           "the offset bound one element late: the error names sizes, not the offset"),
    Mutant("empty_checks_size_after_strides", "SM-3", "refimpl/symmetric_memory.py",
           "    size, _ = _check_shape(size, ())  # before the strides are derived from it\n",
           "",
           "the size check left to empty_strided_p2p, after the strides failed on it"),
]

# --------------------------------------------------------------------------------------
# 9. End to end (E2E): refimpl/compile.py
# --------------------------------------------------------------------------------------
E2E = [
    Mutant("e2e_cap_from_the_default_config", "E2E-2", "refimpl/compile.py",
           "lambda gm: _bucket_stage(gm, config.bucket_cap_mb)",
           "lambda gm: _bucket_stage(gm, CompileConfig.bucket_cap_mb)",
           "the bucketing stage reads the default cap instead of the config's"),
    Mutant("e2e_reduce_scatters_not_bucketed", "E2E-2", "refimpl/compile.py",
           "    bucket_reduce_scatter(gm, cap, recompile=False)\n", "",
           "the reduce_scatter pass left out: backward graphs keep one collective per "
           "gradient"),
    Mutant("e2e_inference_graph_named_forward", "E2E-5", "refimpl/compile.py",
           '"inference_compiler": "inference"', '"inference_compiler": "forward"',
           "the inference compiler copied from the forward's line: inference graphs are "
           "recorded and written as forward graphs"),
    Mutant("e2e_lowering_config_dropped", "E2E-2", "refimpl/compile.py",
           "lambda gm: _lower_stage(gm, config.lowering)",
           "lambda gm: _lower_stage(gm, CommLoweringConfig())",
           "the lowering stage runs with the default CommLoweringConfig, not the config's"),
    Mutant("e2e_debug_text_before_its_stage", "E2E-5", "refimpl/compile.py",
           "            gm = run(gm)\n            self._observe(record, writer, stage, gm)\n",
           "            self._observe(record, writer, stage, gm)\n            gm = run(gm)\n",
           "a stage's text is written before the stage ran: every file shows the stage "
           "before"),
    Mutant("e2e_waits_counted_as_collectives", "E2E-5", "refimpl/compile.py",
           'if not name.startswith("wait_tensor") and name != "barrier":',
           'if name != "barrier":',
           "the record of a graph's collectives counts its waits too"),
    Mutant("e2e_bool_cap_accepted", "E2E-1", "refimpl/compile.py",
           "if isinstance(cap, bool) or not isinstance(cap, (int, float)):",
           "if not isinstance(cap, (int, float)):",
           "bool is an int: bucket_cap_mb=True passes as a cap of 1 MiB"),
    Mutant("e2e_zero_cap_accepted", "E2E-1", "refimpl/compile.py",
           "if not math.isfinite(cap) or cap <= 0:", "if not math.isfinite(cap) or cap < 0:",
           "a cap of 0 MiB accepted: every bucket would close before its first member"),
]


def section_lists() -> dict[str, list[Mutant]]:
    """{prefix: that section's list above}, for every section of SPEC.md, in its order."""
    return {prefix: globals().get(prefix, []) for prefix in sections()}


MUTANTS: list[Mutant] = [m for section in section_lists().values() for m in section]
