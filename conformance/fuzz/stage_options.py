"""The options of every stage, drawn with the program (`cases`: a program and its options).

BK's caps at a bucket's bounds (BK-3), its out-of-place gather (BK-8), gathers of bytes
(BK-12) and a spoiled candidate or cap (BK-16, BK-3: `BAD_CAPS`); CL's config fields and
one-shot threshold (CL-1, CL-10) and the variants every program is also lowered under
(`CL_VARIANTS`); RO's memory budget and in-flight limits; E2E's stages; and now and then
an option every rank MUST refuse (`BAD_OPTIONS`: CL-16, RO-1). The valid options are drawn
before the bad ones, so that a seed's valid options do not depend on them.
"""

from __future__ import annotations

import math

from hypothesis import strategies as st

from conformance.fuzz.generator import programs
from conformance.fuzz.vocabulary import BUCKET_PASSES, Case, Program

# Members gather 32 B to 1 KiB: caps merge all, some, or none (shrinks to merging all).
CAP_BYTES = (2**20, 4096, 1024, 256, 64)

# Bad options, drawn now and then instead of a program's valid ones: each MUST be refused
# on every rank with the error type given, naming the option (CL-16, RO-1).
BAD_OPTIONS = {
    "CL": (("one_shot_all_reduce_threshold_bytes", -1, "ValueError"),
           ("one_shot_all_reduce_threshold_bytes", True, "TypeError"),
           ("auto_select", 1, "TypeError")),
    "RO": (("memory_budget", -0.5, "ValueError"), ("memory_budget", math.nan, "ValueError"),
           ("memory_budget", True, "TypeError"), ("max_in_flight", {"all_gather": 0}, "ValueError"),
           ("max_in_flight", {"all_gather": True}, "TypeError"),
           ("max_in_flight", {"gather": 1}, "ValueError")),
}
BAD_RULE = {"CL": "CL-16", "RO": "RO-1"}
# Each program is also lowered under these (on WORLD's symmetric memory), its structure
# checked against the model and its values against eager's: the one-shot path with SPEC's
# default threshold, without and with fusion, whatever the drawn options are.
CL_VARIANTS = ({"auto_select": True}, {"auto_select": True, "fuse_pointwise": True})
OWN_CL_OPTIONS = ("fuse_pointwise", "force_one_shot_all_reduce")
# CommLoweringConfig's fields the CL stage draws (None in the options: left out).
CL_OPTIONS = ("auto_select", "one_shot_all_reduce_threshold_bytes", "fuse_pointwise",
              "reorder_for_compute_comm_overlap", "force_one_shot_all_reduce")

# BK-3's bad caps: what bucket_cap_mb_by_bucket_idx returns (a number that is no cap, or no
# number), and (last) a cap that is no callable; `which` of a "bad" option picks one.
BAD_CAPS = (True, 0, -1.0, math.inf, math.nan, "1", 1.0)


def _bounds(program: Program, pass_name: str) -> tuple[int, ...]:
    """Caps at a bucket's bounds (BK-3): the bytes of two or three consecutive candidates
    of one key, and a byte less (where the last of them no longer fits)."""
    by_key: dict[tuple, list[int]] = {}
    for name, key, size in program.candidates:
        if name == pass_name:
            by_key.setdefault(key, []).append(size)
    sums = {sum(sizes[i:i + k]) for sizes in by_key.values() for k in (2, 3)
            for i in range(len(sizes) - k + 1)}
    return tuple(sorted(sums | {b - 1 for b in sums}))


def _gather_options(draw, program: Program) -> dict:
    """BK's other options now and then (each pass's default otherwise): the out-of-place
    gather (BK-8), gathers of bytes (BK-12), and a spoiled candidate (BK-16) or cap (BK-3):
    a pass that has candidates, the argument spoiled, which candidate or bad cap."""
    options = {}  # each shrinks to the default (a backend may not implement the option)
    if draw(st.integers(0, 3)) == 3:
        options["use_out_variant"] = False
    if draw(st.integers(0, 3)) == 3:
        options["mixed_dtypes"] = True
    passes = sorted({name for name, _, _ in program.candidates})
    if passes and draw(st.integers(0, 3)) == 3:
        name = draw(st.sampled_from(passes))
        arguments = {"bucket_all_gather": ["group_name", "group_size"],
                     "bucket_reduce_scatter": ["group_name", "group_size", "reduce_op"],
                     "bucket_all_reduce": ["group_name", "reduce_op"]}[name]
        arguments.append("bucket_cap_mb_by_bucket_idx")
        options["bad"] = (name, draw(st.sampled_from(arguments)),
                          draw(st.integers(0, len(BAD_CAPS) - 1)))
    return options


def _threshold(draw, program: Program) -> int | None:
    """CL-10's threshold: SPEC's default (left out), at an all_reduce's bytes or a byte
    under, or one of a few fixed ones; a third each."""
    bounds = sorted({b - d for b in program.one_shot_bytes for d in (0, 1)})
    how = draw(st.sampled_from(("default", "bound", "fixed") if bounds else
                               ("default", "fixed")))
    if how == "default":
        return None
    if how == "bound":
        return draw(st.sampled_from(bounds))
    return draw(st.sampled_from((128 * 1024, 64, 0)))


def _options(draw, program: Program) -> dict:
    caps = {p: tuple(draw(st.lists(st.sampled_from(CAP_BYTES + _bounds(program, p)),
                                   min_size=1, max_size=2)))
            for p in BUCKET_PASSES}
    # A barrier with a collective in flight can make one in flight at a time impossible
    # (RO-6 holds both sides), which SPEC leaves open: such programs get no limit.
    limits = [{}] if program.barrier_in_flight else [{}, {"all_gather": 1}]
    options = {
        "BK": {"caps_bytes": caps, **_gather_options(draw, program)},
        # The one-shot path (CL-10) needs all three: drawn more often, and shrunk to.
        # None: the option left out, so that SPEC's default applies (CL-1); the flags
        # drawn on are refimpl's own (the torch adapter implements neither).
        "CL": {"auto_select": draw(st.sampled_from((True, True, False))),
               "one_shot_all_reduce_threshold_bytes": _threshold(draw, program),
               "symm_mem_world": draw(st.sampled_from((True, True, False))),
               "fuse_pointwise": draw(st.sampled_from((None, None, True))),
               "reorder_for_compute_comm_overlap": draw(st.sampled_from((None, None, True))),
               "force_one_shot_all_reduce": draw(st.sampled_from((None,) * 5 + (True,)))},
        "RO": {"memory_budget": draw(st.sampled_from((math.inf, 0.1, 0.0))),
               "max_in_flight": draw(st.sampled_from(limits)),
               "bucketed_first": draw(st.booleans())},
        "MEM": {},
        "E2E": {"bucket_cap_mb": draw(st.sampled_from((None, 25.0, 0.0002))),
                "lowering": draw(st.sampled_from((None, {}, {"auto_select": True}))),
                "reorder": draw(st.sampled_from((None, {}, {"memory_budget": 0.0})))},
    }
    # Drawn last, so that a seed's valid options do not depend on them; one case in six.
    for stage, bad in BAD_OPTIONS.items():
        options[stage]["bad"] = draw(st.sampled_from((None,) * 5 * len(bad) + bad))
    return options


@st.composite
def cases(draw) -> Case:
    program = draw(programs())
    return Case(program, _options(draw, program))
