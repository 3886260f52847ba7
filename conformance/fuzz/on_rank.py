"""What every stage's rank function shares, on a rank: the program built against the
backend's ops and this rank's inputs (`load_program`), traced (`trace_program`), run and
compared with eager's run (`observe`, `differences_from_eager`, `side_by_side`), meta
vals judged (`untrue_meta`, true_meta), a bad option's refusal judged (`refusal_problems`:
CL-16, RO-1), and the ranks warmed before a stage is timed (`ranks_ready`).
"""

from __future__ import annotations

import functools
import re

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from torch.fx.experimental.proxy_tensor import make_fx

from conformance import reorder_programs as rp
from conformance.fuzz.stage_options import BAD_RULE
from conformance.fuzz.vocabulary import DTYPES, GROUPS
from conformance.oracle import rank_input


def _groups_on_rank(fc, world_size: int) -> dict[str, str]:
    """G: group key -> this rank's group name; every rank makes the groups together."""
    from conformance.bucketing_programs import group_of

    return {key: fc.resolve_group_name(dist.group.WORLD if rows is None else group_of(rows))
            for key, rows in GROUPS[world_size].items()}


def _peers_on_rank(world_size: int) -> dict[str, tuple[int, int]]:
    """P: group key -> (the group rank after this rank's, the one before): a ring's."""
    rank, peers = dist.get_rank(), {}
    for key, rows in GROUPS[world_size].items():
        row = list(range(world_size)) if rows is None else next(r for r in rows if rank in r)
        me, n = row.index(rank), len(row)
        peers[key] = ((me + 1) % n, (me - 1) % n)
    return peers


def load_program(spec: str, source: str, inputs):
    """(backend, fn(*inputs) against the backend's ops, this rank's inputs, G)."""
    from conformance.harness import backend_in_rank

    backend = backend_in_rank(spec)
    fc = backend.require("functional_collectives")
    groups = _groups_on_rank(fc, dist.get_world_size())
    namespace = {"torch": torch, "G": groups, "P": _peers_on_rank(dist.get_world_size())}
    exec(compile(source, "<fuzz program>", "exec"), namespace)
    rank = dist.get_rank()
    xs = [rank_input(rank, shape, DTYPES[dt], salt=i) for i, (shape, dt) in enumerate(inputs)]
    return backend, functools.partial(namespace["program"], fc.ops), xs, groups


def trace_program(fn, xs) -> torch.fx.GraphModule:
    """`fn` traced by make_fx on fake tensors (clones of `xs`)."""
    return make_fx(fn, tracing_mode="fake")(*[x.clone() for x in xs])


def cap_callback(caps_bytes, asked: list | None = None):
    """Caps in MiB by bucket index (the last one for every later index); the indices asked
    go to `asked`."""
    caps = [b / 2**20 for b in caps_bytes]

    def cap(i):
        if asked is not None:
            asked.append(i)
        return caps[min(i, len(caps) - 1)]
    return cap


def side_by_side(want, got, sort_logs=False) -> str:
    """rp.differences of two (outputs, record_ log) runs; logs compared as multisets when
    the pass may move a side effect along its data edges (BK-7: a functional graph)."""
    if sort_logs:
        want, got = (want[0], sorted(want[1])), (got[0], sorted(got[1]))
    return rp.differences(want, got)


def untrue_meta(rule: str, traced, checker) -> list[str]:
    """The nodes whose meta val `checker` found untrue, less those the traced program itself
    gets wrong (an upstream op's fake kernel can: `_c10d_functional.all_reduce_coalesced`
    says a transposed input's strides, its kernel returns a contiguous tensor): the
    tracer's slip is not the pass's."""
    known = set(traced.untrue)
    untrue = [u for u in checker.untrue if u not in known]
    return [f"{rule}: untrue meta val: {'; '.join(untrue)}"] if untrue else []


def differences_from_eager(want, got, what: str, value_rule: str,
                           shape_rule: str) -> list[str]:
    """A transformed program's run (`got`, from observe) against eager's (`want`): its
    values exactly, record_'s log, and the container it returns."""
    problems = []
    try:
        torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)
    except AssertionError as exc:
        problems.append(f"{value_rule}: {what} values differ from eager: {exc}")
    if got[1] != want[1]:
        problems.append(f"{value_rule}: record_ saw {want[1]} eagerly, {got[1]} {what}")
    if got[2] != want[2]:
        problems.append(f"{shape_rule}: the {what} program returns {got[2]}, eager {want[2]}")
    return problems


def observe(run) -> tuple[list[torch.Tensor], list[float], str]:
    """What `run()` returns, as plain tensors, what record_ saw meanwhile, and the shape of
    the returned container (a dict stays a dict: RO-1, CL-1 keep the code generator)."""
    rp.RECORDED.clear()
    out = run()
    # FX's graphs return their immutable_list / immutable_dict: the same shape for a caller
    structure = re.sub(r"\bimmutable_(list|dict)\b", r"\1", str(pytree.tree_structure(out)))
    return [t.clone() for t in rp.flat_tensors(out)], list(rp.RECORDED), structure


def refusal_problems(stage: str, bad, make) -> list[str]:
    """`make()` with one bad option: the problems if it is not refused as BAD_OPTIONS says."""
    name, value, error = bad
    try:
        make()
    except Exception as exc:  # the type is what is checked
        if type(exc).__name__ == error and name in str(exc):
            return []
        return [f"{BAD_RULE[stage]}: {name}={value!r} raised {type(exc).__name__}: "
                f"{shortened(str(exc), 2)} (expected {error} naming {name})"]
    return [f"{BAD_RULE[stage]}: {name}={value!r} was not refused (expected {error})"]


def ranks_ready(spec: str) -> bool:
    """On a rank: the backend loaded, the groups made and make_fx used once (its first
    trace costs seconds), before any stage is timed."""
    from conformance import memory_programs, reorder_rules, true_meta  # noqa: F401
    from conformance.harness import backend_in_rank

    _groups_on_rank(backend_in_rank(spec).require("functional_collectives"),
                    dist.get_world_size())
    trace_program(lambda x: torch.relu(x * 2), [torch.ones(2)])
    return True


def shortened(text: str, lines: int = 25) -> str:
    """`text` cut to `lines` lines: its first five, "...", and its last ones."""
    kept = text.splitlines()
    return "\n".join(kept if len(kept) <= lines else kept[:5] + ["..."] + kept[-(lines - 6):])
