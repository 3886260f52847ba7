"""What comm lowering must choose, read from SPEC.md alone (CL-2..CL-5, CL-10, CL-11, CL-14, CL-17).

`plan(gm, options, symm_groups)` reads a traced graph and a lowering config (the options
dict of `CommLoweringConfig`'s fields, SPEC's defaults for those left out) and says, for
each all-reduce of the graph in program order, what its lowered graph must hold in its
place: the one-shot kernel (CL-10, CL-14; with `fuse_pointwise`, the steps fused around
it, CL-17), or the `all_reduce_` kernel on the input itself or on a clone (CL-2..CL-5,
the clone marked `no_fuse` under `reorder_for_compute_comm_overlap`). With
`force_one_shot_all_reduce`, `forced_refusal` names the first condition that fails, which
the refusal must name. `lowered(gm)` reads the same from a lowered graph, so the two lists
compare entry by entry. It shares no code with refimpl.comm_lowering and reads the graph
its own way (a buffer's base through ops whose schema says they return an alias; a step
by its ATen overload and Python number), and what each op is, and what lowering does with
it, from SPEC's op table (conformance/ops.py: its Lowering column).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx

from conformance import ops
from conformance.ops import is_wait as _is_wait
from conformance.ops import op_key as _name

# CommLoweringConfig's fields and defaults (CL-1).
DEFAULTS = {"auto_select": False, "one_shot_all_reduce_threshold_bytes": 128 * 1024,
            "reorder_for_compute_comm_overlap": False, "force_one_shot_all_reduce": False,
            "alloc_id_namespace": "", "fuse_pointwise": False}
ONE_SHOT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.int32, torch.int64)  # SM-14
STEP_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # CL-17
STEP_OPS = ("add", "sub", "mul")  # aten.<op>.Tensor, CL-17
# The word a refusal names for each condition; alternatives split at "|".
NOT_ATEN = "ATen|fresh intermediate"


@dataclass(frozen=True)
class Lowered:
    """What stands for one all-reduce in a lowered graph."""

    kernel: str  # "one-shot" or "all_reduce_"
    inputs: tuple[str, ...] = ()  # all_reduce_: per member, "in place" or "clone"
    # per member: a clone marked meta["no_fuse"] (CL-2); None where no rule says
    no_fuse: tuple[bool | None, ...] = ()
    steps: tuple[str, str] = ("", "")  # one-shot: the prologue and epilogue fused (CL-17)

    def __str__(self) -> str:
        if self.kernel == "one-shot":
            fused = f" fused prologue={self.steps[0]!r} epilogue={self.steps[1]!r}" \
                if any(self.steps) else ""
            return "one-shot" + fused
        marks = [m + (" no_fuse" if f else "") for m, f in zip(self.inputs, self.no_fuse,
                                                               strict=True)]
        return f"all_reduce_({', '.join(marks)})"


# ---- reading a graph ------------------------------------------------------------------
def _all_reduce(node) -> str | None:
    """What lowering does with an all-reduce collective (its row's Lowering: `reinplace`,
    `in place`, `reinplace each` or `in place each`); None for any other node."""
    op = ops.find(node)
    return op.lowering if op is not None and op.kind == "all_reduce" else None


def _returns_alias(target) -> bool:
    return any(r.alias_info is not None for r in target._schema.returns)


def _val(node):
    return node.meta.get("val") if isinstance(node, torch.fx.Node) else None


def _flat(user) -> list:
    leaves: list = []
    torch.fx.node.map_arg((user.args, user.kwargs), leaves.append)
    return leaves


def _reads(node: torch.fx.Node) -> int:
    return sum(leaf is node for user in node.users for leaf in _flat(user))


def _is_fresh(node: torch.fx.Node) -> bool:
    """SPEC's fresh intermediate: computed by an ATen op whose result aliases nothing."""
    name = _name(node)
    return (name is not None and name[0] == "aten" and not _returns_alias(node.target)
            and isinstance(_val(node), torch.Tensor))


def _same_arguments(a, b) -> bool:
    return [(x.name, str(x.type)) for x in a] == [(x.name, str(x.type)) for x in b]


def _has_out_overload(target) -> bool:
    """An overload of the same op whose arguments are the target's plus one `out=`."""
    packet = target.overloadpacket
    for overload_name in packet.overloads():
        arguments = getattr(packet, overload_name)._schema.arguments
        outs = [a for a in arguments if a.kwarg_only and a.name == "out"
                and a.alias_info is not None and a.alias_info.is_write]
        rest = [a for a in arguments if a not in outs]
        if len(outs) == 1 and _same_arguments(rest, target._schema.arguments):
            return True
    return False


def comm_buffer_refusal(node: torch.fx.Node) -> str | None:
    """CL-11: why `node` cannot be realized as a comm buffer (the word the refusal says;
    alternatives split at "|")."""
    if node.op == "placeholder":
        return "graph input"
    val = _val(node)
    if isinstance(val, torch.Tensor) and any(not isinstance(s, int) for s in val.shape):
        return "symbolic"
    name = _name(node)
    if name is None or name[0] != "aten":
        return NOT_ATEN
    if not _is_fresh(node):
        return "alias"
    if not _has_out_overload(node.target):
        return "out="
    return None


def _one_shot_refusal(inp, reduce_op: str, group: str, options: dict,
                      symm_groups: set[str]) -> str | None:
    """CL-10's conditions in SPEC's order: the first that fails, as a word its refusal
    names; None when all hold."""
    val = _val(inp)
    if group not in symm_groups:
        return "symmetric memory"
    if str(reduce_op).lower() != "sum":
        return "reduce_op"
    if val.dtype not in ONE_SHOT_DTYPES:
        return "dtype"
    if any(not isinstance(s, int) for s in val.shape):
        return "symbolic"
    if val.numel() * val.element_size() > options["one_shot_all_reduce_threshold_bytes"]:
        return "one_shot_all_reduce_threshold_bytes"
    return comm_buffer_refusal(inp) or _sent_by_upstream(inp)


def _sent_by_upstream(node: torch.fx.Node) -> str | None:
    """CL-10: "isend" when upstream's isend sends `node`, a view or alias of it (an in-place
    op's result), or a batch's isend member of it (upstream finding 25: it keeps the
    tensor alive past its wait)."""
    readers, seen = [node], set()
    while readers:
        current = readers.pop()
        seen.add(current)
        for user in current.users:
            key = _name(user)
            if key == ("_c10d_functional", "isend") and user.args[0] is current:
                return "isend"
            if key == ("_c10d_functional", "batch_p2p_ops") and any(
                    op == "isend" and t is current for op, t in zip(user.args[0], user.args[3],
                                                                    strict=False)):
                return "isend"
            # a view of it, or an in-place collective's result (all_reduce_ returns its
            # argument): sending that sends the same tensor
            if key is not None and user not in seen and \
                    _returns_alias(user.target) and user.args and user.args[0] is current:
                readers.append(user)
    return None


# ---- pointwise steps (CL-17) -------------------------------------------------------------
def _step(node) -> tuple[torch.fx.Node, str] | None:
    """(its tensor, 'op number') when `node` is a step of CL-17; else None."""
    name = _name(node)
    if name is None or name[0] != "aten" or name[1] not in STEP_OPS \
            or node.target._overloadname != "Tensor" or node.kwargs or len(node.args) != 2:
        return None
    tensor, number = node.args
    if name[1] != "sub" and isinstance(number, torch.fx.Node):
        tensor, number = number, tensor
    if not isinstance(tensor, torch.fx.Node) or isinstance(number, bool) \
            or not isinstance(number, (int, float)):
        return None
    if isinstance(number, int) and int(float(number)) != number:
        return None  # no exact double
    out, source = _val(node), _val(tensor)
    if not (isinstance(out, torch.Tensor) and isinstance(source, torch.Tensor)) \
            or out.dtype != source.dtype or out.dtype not in STEP_DTYPES \
            or tuple(out.shape) != tuple(source.shape):
        return None
    return tensor, f"{name[1]} {float(number)}"


def _base(node):
    """The node whose buffer `node` is: through ops that return an alias of argument 0."""
    while _name(node) is not None and _returns_alias(node.target) and node.args \
            and isinstance(node.args[0], torch.fx.Node):
        node = node.args[0]
    return node


def _writes(node) -> list:
    """The bases of the tensors `node` writes in place (its schema says which)."""
    name = _name(node)
    if name is None:
        return []
    written = []
    for i, a in enumerate(node.target._schema.arguments):
        if a.alias_info is None or not a.alias_info.is_write:
            continue
        value = node.args[i] if i < len(node.args) else node.kwargs.get(a.name)
        leaves: list = []
        torch.fx.node.map_arg(value, leaves.append)
        written += [_base(n) for n in leaves]
    return written


def _written_between(first, last, tensor) -> bool:
    base, nodes = _base(tensor), list(first.graph.nodes)
    between = nodes[nodes.index(first):nodes.index(last)]
    return any(base in _writes(n) for n in between)


def prologue(inp, all_reduce) -> str:
    """The longest chain of steps ending at the all_reduce's input, each read by the next
    only, whose starting tensor nothing writes from its first step to the all_reduce."""
    chain, node = [], inp
    while len(node.users) == 1 and (step := _step(node)) is not None:
        chain.append((node, step))
        node = step[0]
    for length in range(len(chain), 0, -1):
        first, (source, _) = chain[length - 1]
        if not _written_between(first, all_reduce, source):
            return "; ".join(text for _, (_, text) in reversed(chain[:length]))
    return ""


def epilogue(result) -> tuple[torch.fx.Node, str]:
    """The longest chain of steps from the all_reduce's result, each node read by the next
    step only: (its last node, its steps)."""
    steps, node = [], result
    while len(node.users) == 1:
        user = next(iter(node.users))
        step = _step(user)
        if step is None or step[0] is not node:
            break
        steps.append(step[1])
        node = user
    return node, "; ".join(steps)


# ---- the plan ----------------------------------------------------------------------------
def _config(options: dict) -> dict:
    return {**DEFAULTS, **{k: v for k, v in options.items() if k in DEFAULTS}}


def _member(inp, options, fused: set) -> tuple[str, bool]:
    """CL-2/CL-3: the all_reduce_ kernel reads the input itself or a (marked) clone."""
    if inp not in fused and _is_fresh(inp) and _reads(inp) == 1 and _val(inp).is_contiguous():
        return "in place", False
    return "clone", options["reorder_for_compute_comm_overlap"]


def _walk(gm, options: dict, symm_groups: set[str]):
    """(the plan, the refusal under force_one_shot_all_reduce or None). In program order:
    once an epilogue is fused, its last node's readers read the fused kernel's result
    (CL-17), which no ATen op computes, so a later all_reduce of it has no fresh
    intermediate to reduce in place or to realize as a comm buffer."""
    options = _config(options)
    planned, fused = [], set()
    for node in gm.graph.nodes:
        kind = _all_reduce(node)
        if kind is None:
            continue
        if kind in ("reinplace", "in place") and (
                options["auto_select"] or options["force_one_shot_all_reduce"]):
            inp, reduce_op, group = node.args[:3]
            why = NOT_ATEN if inp in fused else \
                _one_shot_refusal(inp, reduce_op, group, options, symm_groups)
            if why is None:
                planned.append(Lowered("one-shot", steps=_fusion(node, kind, options, fused)))
                continue
            if options["force_one_shot_all_reduce"]:
                return planned, (node.name, why)
        if kind == "reinplace":
            place, mark = _member(node.args[0], options, fused)
            planned.append(Lowered("all_reduce_", (place,), (mark,)))
        elif kind == "in place":  # CL-4: in place, or on a clone copied back
            contiguous = _val(node.args[0]).is_contiguous()
            planned.append(Lowered("all_reduce_", ("in place" if contiguous else "clone",),
                                   (False if contiguous else None,)))
        else:  # CL-5: each member as CL-2/CL-3 say (in place ones: on contiguous members)
            members = [_member(m, options, fused) if kind == "reinplace each"
                       else ("in place", False) for m in node.args[0]]
            planned.append(Lowered("all_reduce_", tuple(p for p, _ in members),
                                   tuple(m for _, m in members)))
    return planned, None


def _fusion(node, kind: str, options: dict, fused: set) -> tuple[str, str]:
    """CL-17's chains of a one-shot all_reduce; the epilogue's last node joins `fused`."""
    if kind != "reinplace" or not options["fuse_pointwise"]:
        return "", ""
    waits = [u for u in node.users if _is_wait(u)]
    last, after = (epilogue(waits[0]) if len(node.users) == 1 and len(waits) == 1
                   else (None, ""))
    if after:
        fused.add(last)
    return prologue(node.args[0], node), after


def forced_refusal(gm, options: dict, symm_groups: set[str]) -> tuple[str, str] | None:
    """With force_one_shot_all_reduce on: (the first all_reduce that cannot go one-shot,
    the word naming its first failing condition); None when every one can."""
    return _walk(gm, options, symm_groups)[1]


def plan(gm: torch.fx.GraphModule, options: dict, symm_groups: set[str]) -> list[Lowered]:
    return _walk(gm, options, symm_groups)[0]


def lowered(gm: torch.fx.GraphModule) -> list[Lowered]:
    """What a lowered graph holds for each all-reduce, in program order."""
    found = []
    for node in gm.graph.nodes:
        op = ops.find(node)
        if op is None:
            continue
        if op.lowering == "one-shot":
            found.append(Lowered("one-shot"))
        elif op.lowering == "fused one-shot":
            args = [*node.args, *[""] * (6 - len(node.args))]
            steps = tuple("; ".join(s.strip() for s in str(chain).split(";") if s.strip())
                          for chain in (node.kwargs.get("prologue", args[4]),
                                        node.kwargs.get("epilogue", args[5])))
            found.append(Lowered("one-shot", steps=steps))
        elif op.kind == "all_reduce" and op.in_place:  # the all_reduce_ kernels
            members = node.args[0] if op.coalesced else [node.args[0]]
            read = [("clone", bool(m.meta.get("no_fuse", False)))
                    if _name(m) == ("aten", "clone") else ("in place", False) for m in members]
            found.append(Lowered("all_reduce_", tuple(p for p, _ in read),
                                 tuple(m for _, m in read)))
    return found


def _agrees(want: Lowered, got: Lowered) -> bool:
    """Equal, a mark of None (no rule says one) matching either."""
    if want.no_fuse and len(want.no_fuse) == len(got.no_fuse):
        marks = tuple(g if w is None else w for w, g in zip(want.no_fuse, got.no_fuse,
                                                              strict=True))
        want = Lowered(want.kernel, want.inputs, marks, want.steps)
    return want == got


def differences(planned: list[Lowered], found: list[Lowered]) -> list[str]:
    """Problems, each naming the rule the first different entry breaks."""
    if len(planned) != len(found):
        return [f"CL-10: the lowered graph holds {len(found)} all-reduce kernels "
                f"({', '.join(map(str, found))}); SPEC's lowering holds {len(planned)} "
                f"({', '.join(map(str, planned))})"]
    for i, (want, got) in enumerate(zip(planned, found, strict=True)):
        if _agrees(want, got):
            continue
        if want.kernel != got.kernel:
            rule = "CL-10"
        elif want.kernel == "one-shot":
            rule = "CL-17"
        elif want.inputs != got.inputs:
            rule = "CL-3"
        else:
            rule = "CL-2"
        return [f"{rule}: all-reduce {i} of the graph lowered to {got}; SPEC says {want} "
                f"(in order, SPEC's: {', '.join(map(str, planned))})"]
    return []
