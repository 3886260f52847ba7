"""Comm lowering: a graph of functional collectives becomes the explicit program to run.

`lower(gm, config)` takes a traced FX graph (every node carries `meta["val"]`) and
returns a new, still executable GraphModule in which every collective is the kernel a
backend would launch: out-of-place collectives that return a fresh buffer stay as they
are; all_reduce and broadcast become an explicit contiguous clone plus the in-place
kernel on it, unless the input is an intermediate nobody else reads, which is then
reduced in place (CL-2..CL-8). Every wait is kept, except the wait of a collective
lowered to a blocking kernel (CL-9). With `auto_select`, a small sum all_reduce on a
group with symmetric memory becomes a one-shot all-reduce whose input producer writes
straight into a comm buffer; comm buffers carry an `alloc_id` that is the same on every
rank and in every call, distinct between buffers and graphs, and they never take part in
ordinary buffer reuse (CL-10..CL-14). The lowered graph computes the same values as the
original (CL-15). Bad configs and collectives on unknown groups are refused (CL-16). With
`fuse_pointwise`, the add/sub/mul-by-a-number chains that feed a one-shot all-reduce and
that read its result run inside its kernel (`one_shot_all_reduce_pointwise`, CL-17).
Calling the lowered module runs its generated code directly while no hook or tracer
needs nn.Module's call path (`_fx.call_straight`): that path costs about what a one-shot
all-reduce of 4 KiB does.

Implements SPEC.md section "Comm lowering": CL-1 .. CL-21.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch
import torch.fx
from torch._guards import detect_fake_mode

from refimpl import _fx, comm_ops
from refimpl._errors import refuse, require_type

__all__ = [
    "CommLoweringConfig", "CommBufferError", "lower", "comm_buffer_refusal",
    "realize_as_comm_buffer", "comm_buffers", "graph_fingerprint", "COMM_BUFFER_META",
    "pointwise_step",
]

# node.meta key of a comm buffer: {"group_name", "alloc_id", "type"} (CL-11, CL-13).
COMM_BUFFER_META = "comm_buffer"
# node.meta key set on the clone feeding an in-place all_reduce under overlap reordering.
NO_FUSE_META = "no_fuse"
aten = torch.ops.aten


@dataclass(frozen=True)
class CommLoweringConfig:
    """What `lower` may choose (CL-1, CL-10).

    auto_select: let the lowering pick specialized kernels (one-shot all-reduce).
    one_shot_all_reduce_threshold_bytes: the largest all_reduce that goes one-shot.
    reorder_for_compute_comm_overlap: a reorder pass follows; mark clones not to fuse.
    force_one_shot_all_reduce: every all_reduce MUST go one-shot; one that cannot is
        refused with an error that says why (the explicit request of CL-11).
    alloc_id_namespace: mixed into every alloc_id, to keep apart two structurally
        identical graphs whose comm buffers are alive at the same time (CL-12).
    fuse_pointwise: a one-shot all-reduce takes the chains of add/sub/mul by a number
        that compute its input and that read its result into its kernel (CL-17).
    """

    auto_select: bool = False
    one_shot_all_reduce_threshold_bytes: int = 128 * 1024
    reorder_for_compute_comm_overlap: bool = False
    force_one_shot_all_reduce: bool = False
    alloc_id_namespace: str = ""
    fuse_pointwise: bool = False

    def __post_init__(self):
        """Refuse a field of the wrong type or range when the config is made (CL-16)."""
        for name in ("auto_select", "reorder_for_compute_comm_overlap",
                     "force_one_shot_all_reduce", "fuse_pointwise"):
            _require_type(name, getattr(self, name), bool)
        _require_type("alloc_id_namespace", self.alloc_id_namespace, str)
        threshold = self.one_shot_all_reduce_threshold_bytes
        _require_type("one_shot_all_reduce_threshold_bytes", threshold, int)
        if threshold < 0:
            raise ValueError(f"one_shot_all_reduce_threshold_bytes: expected a byte count "
                             f">= 0, got {threshold} [CL-16]")


def _require_type(name: str, value, expected: type) -> None:
    # bool is an int to isinstance; a flag passed as a threshold (or 1 as a flag) is a slip.
    if not isinstance(value, expected) or (expected is int and isinstance(value, bool)):
        refuse(name, expected.__name__, f"{type(value).__name__} {value!r}", "CL-16", TypeError)


class CommBufferError(ValueError):
    """A buffer that was asked to be a comm buffer (or one-shot input) cannot be one."""


# --------------------------------------------------------------------------------------
# Small graph helpers
# --------------------------------------------------------------------------------------
def _ops_of(node: torch.fx.Node):
    """The op namespace of a collective node: lowered kernels stay in it."""
    return getattr(torch.ops, node.target.namespace)


def _val(arg):
    """The fake value of a node argument (CL-1); any other argument as it is."""
    return _fx.fake_value(arg, "CL-1") if isinstance(arg, torch.fx.Node) else arg


def _is_contiguous(node: torch.fx.Node) -> bool:
    return _val(node).is_contiguous()


def _returns_alias(target) -> bool:
    schema = getattr(target, "_schema", None)
    return schema is None or any(r.alias_info is not None for r in schema.returns)


def _is_fresh_intermediate(node: torch.fx.Node) -> bool:
    """Produced in the graph by an ATen op into storage that nothing else owns. Not by a
    collective, a wait or a kernel this pass made (a one-shot all-reduce whose epilogue
    was fused, CL-17, stands where an ATen step stood): SPEC's definition, which a
    judge can read off the traced graph."""
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return False
    if node.target.namespace != "aten" or _returns_alias(node.target):
        return False  # a view, an in-place result or a wait aliases another buffer
    return isinstance(node.meta.get("val"), torch.Tensor)


class _FakeKernelBuilder:
    """Inserts nodes before an anchor; each gets its fake value by running the op's fake
    kernel (bucketing's builder, by contrast, makes its few shapes by hand)."""

    def __init__(self, graph: torch.fx.Graph):
        self.graph = graph
        # Every value of one traced graph lives in the same fake mode: one tensor tells.
        first = next((n.meta["val"] for n in graph.nodes
                      if isinstance(n.meta.get("val"), torch.Tensor)), None)
        self.fake_mode = detect_fake_mode([first]) if first is not None else None
        if self.fake_mode is None:  # real values (make_fx "real"): derive fake ones
            from torch._subclasses.fake_tensor import FakeTensorMode

            self.fake_mode = FakeTensorMode(allow_non_fake_inputs=True)

    def call(self, target, args, kwargs=None, *, before: torch.fx.Node, val=None):
        with self.graph.inserting_before(before):
            node = self.graph.call_function(target, tuple(args), dict(kwargs or {}))
        node.meta["val"] = self.run_fake(target, args, kwargs) if val is None else val
        return node

    def run_fake(self, target, args, kwargs):
        fake_args = torch.fx.node.map_arg(tuple(args), _val)
        fake_kwargs = torch.fx.node.map_arg(dict(kwargs or {}), _val)
        with self.fake_mode:
            return target(*fake_args, **fake_kwargs)

    def contiguous_clone(self, node, *, before):
        return self.call(aten.clone.default, [node], {"memory_format": torch.contiguous_format},
                         before=before)


def _read_count(node: torch.fx.Node) -> int:
    """How many arguments of the graph read `node`: a user that names it twice (the list
    of a coalesced collective) reads it twice (CL-3, CL-5)."""
    return sum(arg is node for user in node.users
               for arg in _fx.node_args((user.args, user.kwargs)))


def _waits_of(node: torch.fx.Node) -> list[torch.fx.Node]:
    return [u for u in node.users if _fx.is_wait(u)]


def _replace(old: torch.fx.Node, new: torch.fx.Node) -> None:
    old.replace_all_uses_with(new)
    old.graph.erase_node(old)


# --------------------------------------------------------------------------------------
# Comm buffers and persistent allocation (CL-11 .. CL-13)
# --------------------------------------------------------------------------------------
def graph_fingerprint(gm: torch.fx.GraphModule, constants: bool = True) -> str:
    """A digest of the graph's structure: ops, wiring, shapes, dtypes, constants (unless
    `constants` is False: then each is written "_", as reorder's agreement needs, RO-16,
    for a bucketed gather's copy-in offset differs between the ranks, BK-8).

    It depends on nothing that varies between ranks, runs or processes (no node names,
    no addresses, no group names: a sub group's name differs between the ranks of
    different rows, so each group is written as the order of its first use; no peers of
    point-to-point ops: a ring's differ between ranks, so each is written as its offset
    from this rank's group rank), so every rank that lowers the same graph gets the same
    digest (CL-12).
    """
    index = {n: i for i, n in enumerate(gm.graph.nodes)}
    groups: dict[str, str] = {}

    def group(name):
        if isinstance(name, str):
            name = groups.setdefault(name, f"group #{len(groups)}")
        return name

    def arguments(node):
        if not isinstance(node.target, torch._ops.OpOverload):
            return node.args, node.kwargs
        names = [a.name for a in node.target._schema.arguments]
        # A broadcast's `src` is its root, the same on every rank: only point-to-point
        # ops name peers.
        p2p = comm_ops.collective_family(node) == "point_to_point"
        group_name = _fx.arguments(node, "CL-12")["group_name"] if p2p else None

        def written(name, value):
            if name == "group_name":
                return group(value)
            if p2p and name in _PEERS:
                return _peer_offsets(value, group_name)
            return value

        args = tuple(written(names[i] if i < len(names) else "", a)
                     for i, a in enumerate(node.args))
        return args, {k: written(k, v) for k, v in node.kwargs.items()}

    def text(arg):
        if isinstance(arg, torch.fx.Node):
            return f"%{index[arg]}"
        if isinstance(arg, (list, tuple)):
            return "[" + ",".join(text(a) for a in arg) + "]"
        if isinstance(arg, dict):
            return "{" + ",".join(f"{k}:{text(v)}" for k, v in arg.items()) + "}"
        return repr(arg) if constants else "_"

    digest = hashlib.sha256()
    for node in gm.graph.nodes:
        val = node.meta.get("val")
        shape = (f"{val.dtype}{list(val.shape)}" if isinstance(val, torch.Tensor)
                 else type(val).__name__)
        target = node.target if isinstance(node.target, str) else getattr(
            node.target, "__qualname__", None) or str(node.target)
        if isinstance(node.target, torch._ops.OpOverload):
            target = str(node.target)
        args, kwargs = arguments(node)
        digest.update(f"{node.op} {target} {text(args)} {text(kwargs)} {shape}\n".encode())
    return digest.hexdigest()


# The arguments of point-to-point ops that name a peer by its group rank (FC-52).
_PEERS = frozenset({"dst", "src", "peer_list"})


def _peer_offsets(peers, group_name):
    """A peer (or list of them) as its offset from this rank's group rank, modulo the
    group's size: equal on every rank of a ring, whose peers are not."""
    try:
        pg = torch.distributed.distributed_c10d._resolve_process_group(group_name)
        me, size = pg.rank(), pg.size()
    except (RuntimeError, ValueError, TypeError, KeyError):
        return "a peer of a group this process does not know"
    if isinstance(peers, (list, tuple)):
        return [f"+{(p - me) % size}" for p in peers]
    return f"+{(peers - me) % size}"


def _alloc_id(fingerprint: str, namespace: str, index: int, group_name: str,
              val: torch.Tensor) -> int:
    """A 63-bit id from (graph, namespace, buffer index, the buffer's size and dtype, its
    group, whose name its ranks share): equal on all ranks of the group (CL-12). The size
    is in it because the buffer at an index depends on the config too: the same graph
    lowered with another threshold must not ask a persistent allocation for other bytes
    (SM-4)."""
    key = f"{namespace}/{fingerprint}/{index}/{val.dtype}{list(val.shape)}/{group_name}"
    raw = hashlib.sha256(key.encode()).digest()
    return int.from_bytes(raw[:8], "big") >> 1


def _in_a_comm_buffer(node: torch.fx.Node) -> bool:
    """Whether `node`'s value lives in a comm buffer: the buffer itself, or a view of it,
    a getitem of a split of it or an in-place result on it, through any chain (CL-13)."""
    import operator

    from refimpl.memory import aliasing_of

    index = 0  # the piece a getitem took of the next node's results
    while isinstance(node, torch.fx.Node):
        if COMM_BUFFER_META in node.meta:
            return True
        if node.op != "call_function":
            return False
        if node.target is operator.getitem:
            node, index = node.args
            continue
        if not isinstance(node.target, torch._ops.OpOverload):
            return False
        sources = aliasing_of(node.target)
        source = sources[0] if len(sources) == 1 else \
            (sources[index] if index < len(sources) else None)
        if source is None:
            return False
        node, index = (node.args[source] if isinstance(source, int)
                       else node.kwargs.get(source)), 0
    return False


def _out_overload(target: torch._ops.OpOverload):
    """The `out=` overload of an ATen op with the same arguments, or None."""
    args = [a.name for a in target._schema.arguments]
    packet = target.overloadpacket
    for name in packet.overloads():
        overload = getattr(packet, name)
        schema = overload._schema
        outs = [a for a in schema.arguments if a.kwarg_only and a.alias_info is not None
                and a.alias_info.is_write]
        rest = [a.name for a in schema.arguments if a not in outs]
        if len(outs) == 1 and outs[0].name == "out" and rest == args:
            return overload
    return None


def comm_buffer_refusal(node: torch.fx.Node) -> str | None:
    """Why `node`'s result cannot be realized as a comm buffer, or None if it can (CL-11)."""
    if node.op == "placeholder":
        return (f"{node.name!r} is a graph input: its memory is allocated by the caller, "
                f"not by the graph")
    if node.op != "call_function":
        return f"{node.name!r} is not computed by the graph ({node.op})"
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        return f"{node.name!r} is not a single tensor"
    if COMM_BUFFER_META in node.meta:
        return None
    if any(not isinstance(s, int) for s in val.shape):
        return f"{node.name!r} has a symbolic size {list(val.shape)}"
    if not isinstance(node.target, torch._ops.OpOverload) or node.target.namespace != "aten":
        return (f"{node.name!r} is produced by {node.target}, which is not an ATen op (a "
                f"collective's, a wait's or a kernel's result is no fresh intermediate)")
    if not _is_fresh_intermediate(node):
        return (f"{node.name!r} is produced by {node.target}, which returns a view or alias "
                f"of another buffer")
    if _out_overload(node.target) is None:
        return (f"{node.name!r} is produced by {node.target}, which has no out= overload "
                f"to write into the comm buffer")
    return None


def realize_as_comm_buffer(node: torch.fx.Node, group_name: str, alloc_id: int) -> None:
    """Make `node`'s producer write into a symmetric-memory comm buffer (CL-11).

    Inserts `empty_strided_p2p(size, stride, dtype, device, group_name, alloc_id)` before
    the producer and rewrites the producer to its `out=` overload writing there. Raises
    CommBufferError saying why when the buffer cannot be a comm buffer.
    """
    why = comm_buffer_refusal(node)
    if why is not None:
        raise CommBufferError(f"input: cannot realize as a comm buffer: {why} [CL-11]")
    if COMM_BUFFER_META in node.meta:
        return
    buffer = _new_comm_buffer(node.meta["val"], group_name, alloc_id, before=node)
    node.target = _out_overload(node.target)
    node.kwargs = {**node.kwargs, "out": buffer}
    node.meta["val"] = buffer.meta["val"]
    node.meta[COMM_BUFFER_META] = buffer.meta[COMM_BUFFER_META]


def _new_comm_buffer(val: torch.Tensor, group_name: str, alloc_id: int, *,
                     before: torch.fx.Node) -> torch.fx.Node:
    """`empty_strided_p2p(size, contiguous stride, ...)` for a tensor like `val` (CL-11)."""
    from refimpl.symmetric_memory import empty_strided_p2p

    stride = torch._prims_common.make_contiguous_strides_for(val.shape)
    builder = _FakeKernelBuilder(before.graph)
    with builder.fake_mode:
        buf_val = torch.empty_strided(val.shape, stride, dtype=val.dtype, device=val.device)
    buffer = builder.call(
        empty_strided_p2p, [tuple(val.shape), tuple(stride), val.dtype, val.device,
                            group_name, alloc_id], before=before, val=buf_val)
    buffer.meta[COMM_BUFFER_META] = {"group_name": group_name, "alloc_id": alloc_id,
                                     "type": "symm_mem"}
    return buffer


def comm_buffers(gm: torch.fx.GraphModule) -> list[dict]:
    """The comm buffers a lowered graph allocates, in order: their meta records (CL-13)."""
    return [dict(n.meta[COMM_BUFFER_META]) for n in gm.graph.nodes
            if COMM_BUFFER_META in n.meta and "out" not in n.kwargs]


# --------------------------------------------------------------------------------------
# One-shot all-reduce selection (CL-10)
# --------------------------------------------------------------------------------------
def _symm_mem_enabled(group_name: str) -> bool:
    try:
        from refimpl.symmetric_memory import is_symm_mem_enabled_for_group
    except ModuleNotFoundError:
        return False
    return bool(is_symm_mem_enabled_for_group(group_name))


def one_shot_refusal(inp: torch.fx.Node, reduce_op: str, group_name: str,
                     config: CommLoweringConfig) -> str | None:
    """Why this all_reduce cannot be lowered one-shot, or None if it can (CL-10)."""
    if not _symm_mem_enabled(group_name):
        return f"symmetric memory is not enabled for group {group_name!r}"
    if reduce_op.lower() != "sum":
        return f"reduce_op is {reduce_op!r}; one-shot all-reduce only sums"
    val = _val(inp)
    from refimpl.symmetric_memory import SUPPORTED_DTYPES

    if val.dtype not in SUPPORTED_DTYPES:
        return (f"{inp.name!r} has dtype {val.dtype}, which the one-shot kernel does not "
                f"support ({', '.join(str(d) for d in SUPPORTED_DTYPES)})")
    if any(not isinstance(s, int) for s in val.shape):
        return f"{inp.name!r} has a symbolic size {list(val.shape)}"
    size = val.numel() * val.element_size()
    if size > config.one_shot_all_reduce_threshold_bytes:
        return (f"{inp.name!r} has {size} bytes, over one_shot_all_reduce_threshold_bytes "
                f"= {config.one_shot_all_reduce_threshold_bytes}")
    return comm_buffer_refusal(inp) or _sent_by_upstream(inp)


def _upstream_sends(node: torch.fx.Node) -> list:
    """The tensors `node` sends if it is one of upstream's sends (isend, or a batch's
    isend members), which keep what they send alive after their wait (upstream finding
    25); [] for any other node."""
    row = comm_ops.node_op(node)
    if row is None or row.namespace != "_c10d_functional":
        return []
    if row.name == "isend":
        return [node.args[0]]
    if row.name == "batch_p2p_ops":
        return [t for op, t in zip(node.args[0], node.args[3], strict=False) if op == "isend"]
    return []


def _sent_by_upstream(node: torch.fx.Node) -> str | None:
    """Why `node` must not be a comm buffer because upstream's isend sends it (or a view
    of it, or a batch's isend member), or None (CL-10)."""
    from refimpl.memory import aliasing_of

    pending, seen = [node], set()
    while pending:
        current = pending.pop()
        if current in seen:
            continue
        seen.add(current)
        for user in current.users:
            if not isinstance(user.target, torch._ops.OpOverload):
                continue
            if any(sent is current for sent in _upstream_sends(user)):
                return (f"{node.name!r} is sent by {user.target._schema.name}, which keeps "
                        f"what it sends alive after its wait (upstream finding 25): a comm "
                        f"buffer there would outlive the call")
            if aliasing_of(user.target)[:1] == [0] and user.args and user.args[0] is current:
                pending.append(user)  # a view of it: sending that sends the buffer
    return None


# --------------------------------------------------------------------------------------
# Pointwise chains fused into the one-shot kernel (CL-17)
# --------------------------------------------------------------------------------------
_COMMUTATIVE = ("add", "mul")


def pointwise_step(node: torch.fx.Node) -> tuple[torch.fx.Node, str, int | float] | None:
    """(tensor operand, op, number) when `node` is a step the one-shot kernel can apply
    (SM-24): add, sub or mul of a tensor and a Python number with an exact double, no
    keyword argument, its result of the tensor's floating dtype and shape; else None."""
    # The kernel's own vocabulary: the lowering never fuses what the op would refuse.
    from refimpl.symmetric_memory import POINTWISE_DTYPES, POINTWISE_STEPS

    if node.op != "call_function":
        return None
    op = next((name for name, packet in POINTWISE_STEPS.items()
               if node.target is packet.Tensor), None)
    if op is None or node.kwargs or len(node.args) != 2:
        return None
    tensor, number = node.args
    if op in _COMMUTATIVE and isinstance(number, torch.fx.Node):
        tensor, number = number, tensor
    if (not isinstance(tensor, torch.fx.Node) or isinstance(number, bool)
            or not isinstance(number, (int, float))
            or (isinstance(number, int) and float(number) != number)):
        return None
    val, source = node.meta.get("val"), tensor.meta.get("val")
    if not (isinstance(val, torch.Tensor) and isinstance(source, torch.Tensor)):
        return None
    if val.dtype != source.dtype or val.dtype not in POINTWISE_DTYPES \
            or val.shape != source.shape:
        return None
    return tensor, op, number


def _base(node: torch.fx.Node) -> torch.fx.Node:
    """The buffer a view (or an in-place result) of a node belongs to."""
    while (node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload)
           and _returns_alias(node.target) and node.args
           and isinstance(node.args[0], torch.fx.Node)):
        node = node.args[0]
    return node


def _written_arguments(node: torch.fx.Node, rule: str) -> list[list[torch.fx.Node]]:
    """Per argument that `node` writes in place (its schema marks it written), the buffers
    (base nodes) of the tensors it holds: one for a tensor, several for a list."""
    schema = getattr(node.target, "_schema", None)
    if schema is None or not schema.is_mutable:
        return []
    bound = _fx.arguments(node, rule)
    return [[_base(n) for n in _fx.node_args(bound[a.name])] for a in schema.arguments
            if a.alias_info is not None and a.alias_info.is_write]


def _written_between(first: torch.fx.Node, last: torch.fx.Node, source: torch.fx.Node) -> bool:
    """Whether a node from `first` up to `last` writes into `source`'s buffer."""
    base, node = _base(source), first
    while node is not last:
        if any(any(b is base for b in bases) for bases in _written_arguments(node, "CL-17")):
            return True
        node = node.next
    return False


class _Lowering:
    """One run of `lower`: the graph being rewritten and the comm buffers handed out."""

    def __init__(self, gm: torch.fx.GraphModule, config: CommLoweringConfig):
        self.config = config
        self.fingerprint = graph_fingerprint(gm)
        self.graph = gm.graph
        self.build = _FakeKernelBuilder(self.graph)
        self.next_buffer = 0

    # ---- selection ------------------------------------------------------------------
    def wants_one_shot(self, inp, reduce_op, group_name) -> bool:
        if not (self.config.auto_select or self.config.force_one_shot_all_reduce):
            return False
        why = one_shot_refusal(inp, reduce_op, group_name, self.config)
        if why is not None and self.config.force_one_shot_all_reduce:
            raise CommBufferError(f"input: force_one_shot_all_reduce: cannot lower the "
                                  f"all_reduce of {inp.name!r} one-shot: {why} [CL-21]")
        return why is None

    def next_alloc_id(self, group_name: str, val: torch.Tensor) -> int:
        """The alloc_id of the graph's next comm buffer, on `group_name` (CL-12)."""
        alloc_id = _alloc_id(self.fingerprint, self.config.alloc_id_namespace,
                             self.next_buffer, group_name, val)
        self.next_buffer += 1
        return alloc_id

    def comm_buffer(self, inp, group_name) -> None:
        if COMM_BUFFER_META not in inp.meta:
            realize_as_comm_buffer(inp, group_name, self.next_alloc_id(group_name, _val(inp)))

    def one_shot(self, node, inp, group_name):
        """A blocking one-shot all-reduce of `inp`, realized as a comm buffer."""
        self.comm_buffer(inp, group_name)
        symm = torch.ops.refimpl_symm_mem
        return self.build.call(symm.one_shot_all_reduce.default, [inp, "sum", group_name],
                               before=node)

    def prologue(self, inp, anchor):
        """The chain of steps computing `inp` that the kernel can take over: (the tensor it
        starts from, its steps in order, its nodes). Every node of it is read by the next
        only, and nothing up to `anchor` writes into the tensor it starts from."""
        steps, chain, current = [], [], inp
        while len(current.users) == 1 and (step := pointwise_step(current)) is not None:
            source, op, number = step
            if _written_between(current, anchor, source):
                break
            steps.append((op, number))
            chain.append(current)
            current = source
        return current, steps[::-1], chain

    @staticmethod
    def epilogue(result):
        """The chain of steps reading `result` that the kernel can take over: (its last
        node, its steps in order, its nodes), each node read by the next only."""
        steps, chain, current = [], [], result
        while len(current.users) == 1:
            user = next(iter(current.users))
            step = pointwise_step(user)
            if step is None or step[0] is not current:
                break
            steps.append(step[1:])
            chain.append(user)
            current = user
        return current, steps, chain

    def one_shot_fused(self, node, inp, group_name):
        """The one-shot all-reduce of `inp` in place of `node`, with the chains around it
        in its kernel (CL-17); the plain kernel (CL-10) when neither chain has a step."""
        from refimpl.symmetric_memory import pointwise_steps

        source, before, prologue_nodes = self.prologue(inp, node)
        if before:
            buffer = _new_comm_buffer(_val(inp), group_name,
                                      self.next_alloc_id(group_name, _val(inp)),
                                      before=node)
        else:
            self.comm_buffer(inp, group_name)
            buffer = source = inp
        symm = torch.ops.refimpl_symm_mem
        fused = self.build.call(symm.one_shot_all_reduce_pointwise.default,
                                [buffer, source, "sum", group_name, pointwise_steps(before), ""],
                                before=node)
        self.skip_waits(node, fused)
        _replace(node, fused)
        for chain_node in prologue_nodes:  # the all_reduce read the first; each the next
            self.graph.erase_node(chain_node)
        last, after, epilogue_nodes = self.epilogue(fused)
        if after:
            fused.args = (*fused.args[:5], pointwise_steps(after))
            last.replace_all_uses_with(fused)
            for chain_node in reversed(epilogue_nodes):
                self.graph.erase_node(chain_node)
        if not before and not after:  # nothing to fuse: the plain kernel (CL-10)
            plain = self.build.call(symm.one_shot_all_reduce.default, [inp, "sum", group_name],
                                    before=fused)
            _replace(fused, plain)

    def skip_waits(self, node, result):
        """A blocking kernel leaves the waits of its collective nothing to do (CL-9)."""
        for wait in _waits_of(node):
            _replace(wait, result)

    # ---- rules ----------------------------------------------------------------------
    def in_place_input(self, inp, anchor):
        """The buffer an in-place collective may write: `inp` itself or a clone (CL-2, CL-3)."""
        if _is_fresh_intermediate(inp) and _read_count(inp) == 1 and _is_contiguous(inp):
            return inp  # nothing else reads it: reduce it in place, as re-inplacing does
        clone = self.build.contiguous_clone(inp, before=anchor)
        if self.config.reorder_for_compute_comm_overlap:
            # Fusing this clone with its neighbours would hold the collective back until
            # they run; issuing the collective early is almost always worth more.
            clone.meta[NO_FUSE_META] = True
        return clone

    def all_reduce(self, node):
        inp, reduce_op, group_name = node.args
        if self.wants_one_shot(inp, reduce_op, group_name):
            if self.config.fuse_pointwise:
                return self.one_shot_fused(node, inp, group_name)
            result = self.one_shot(node, inp, group_name)
            self.skip_waits(node, result)
            return _replace(node, result)
        buffer = self.in_place_input(inp, node)
        ops = _ops_of(node)
        _replace(node, self.build.call(ops.all_reduce_.default, [buffer, reduce_op,
                                                                  group_name], before=node))

    def all_reduce_(self, node):
        inp, reduce_op, group_name = node.args
        if self.wants_one_shot(inp, reduce_op, group_name):
            result = self.one_shot(node, inp, group_name)
            written = self.build.call(aten.copy_.default, [inp, result], before=node)
            self.skip_waits(node, written)
            return _replace(node, written)
        if _is_contiguous(inp):
            return None  # already the kernel: in place on a contiguous buffer (CL-4)
        self.in_place_on_contiguous_copy(node, inp)

    def in_place_on_contiguous_copy(self, node, inp):
        """A non-contiguous in-place target: reduce a contiguous copy, copy back at the wait."""
        waits = _waits_of(node)
        if not waits:
            raise ValueError(f"input: {node.target} on the non-contiguous {inp.name!r} needs "
                             f"its wait_tensor in the graph to copy the result back [CL-4]")
        clone = self.build.contiguous_clone(inp, before=node)
        kernel = self.build.call(node.target, [clone, *node.args[1:]], before=node)
        for wait in waits:
            done = self.build.call(wait.target, [kernel], before=wait)
            _replace(wait, self.build.call(aten.copy_.default, [inp, done], before=wait))
        _replace(node, kernel)

    def all_reduce_coalesced(self, node):
        inputs, reduce_op, group_name = node.args
        buffers = [self.in_place_input(inp, node) for inp in inputs]
        kernel = _ops_of(node).all_reduce_coalesced_.default
        _replace(node, self.build.call(kernel, [buffers, reduce_op, group_name], before=node))

    def all_reduce_coalesced_(self, node):
        bad = [inp.name for inp in node.args[0] if not _is_contiguous(inp)]
        if bad:
            raise ValueError(f"inputs: all_reduce_coalesced_ needs contiguous tensors; "
                             f"{bad} are not [CL-5]")

    def out_of_place(self, node):
        """Out-of-place kernels read contiguous inputs (CL-6)."""
        def contiguous(arg):
            if isinstance(arg, torch.fx.Node) and not _is_contiguous(arg):
                return self.build.contiguous_clone(arg, before=node)
            return arg

        first = node.args[0]
        inputs = [contiguous(a) for a in first] if isinstance(first, (list, tuple)) \
            else contiguous(first)
        node.args = (inputs, *node.args[1:])

    def broadcast(self, node):
        inp, src, group_name = node.args
        clone = self.build.contiguous_clone(inp, before=node)
        kernel = _ops_of(node).broadcast_.default
        _replace(node, self.build.call(kernel, [clone, src, group_name], before=node))

    def broadcast_(self, node):
        if not _is_contiguous(node.args[0]):
            self.in_place_on_contiguous_copy(node, node.args[0])

    def keep_outputs_out_of_comm_buffers(self):
        """A comm buffer never escapes the graph: outputs get an ordinary copy (CL-13)."""
        output = next(n for n in self.graph.nodes if n.op == "output")

        def ordinary(arg):
            if isinstance(arg, torch.fx.Node) and _in_a_comm_buffer(arg):
                return self.build.call(aten.clone.default, [arg], before=output)
            return arg

        output.args = torch.fx.node.map_aggregate(output.args, ordinary)

    # The rule of each functional collective, by its row (comm_ops): all_reduce and
    # broadcast by (in_place, coalesced) (CL-2 .. CL-5, CL-14); the families that
    # allocate their results in the op itself read contiguous inputs (CL-6); point to
    # point is left as traced (no CL rule models it).
    OUT_OF_PLACE_FAMILIES = ("all_gather", "reduce_scatter", "all_to_all")
    RULES = {
        ("all_reduce", False, False): all_reduce, ("all_reduce", True, False): all_reduce_,
        ("all_reduce", False, True): all_reduce_coalesced,
        ("all_reduce", True, True): all_reduce_coalesced_,
        ("broadcast", False, False): broadcast, ("broadcast", True, False): broadcast_,
    }

    def rule_of(self, node):
        row = comm_ops.node_op(node)
        if row is None or not row.is_collective:
            return None
        if row.family in self.OUT_OF_PLACE_FAMILIES:
            return _Lowering.out_of_place
        return self.RULES.get((row.family, row.in_place, row.coalesced))

    def complete_in_place(self):
        """refimpl's waits become `wait_tensor_`, which completes its argument in place
        (FC-35): the lowered program pays no copy per wait (CL-9). Upstream's wait
        already returns its argument. A wait whose result or argument a later node writes
        in place keeps its copy: in place, that write would reach the other one too."""
        written_later: set[torch.fx.Node] = set()
        for node in reversed(self.graph.nodes):  # one pass: what is written after a node
            # By its row, not by identity: `torch.ops.refimpl_c10d.wait_tensor` exists
            # only once refimpl.functional_collectives was imported, which a graph
            # without refimpl's ops does not need.
            row = comm_ops.node_op(node)
            if (row is not None and row.family == "wait" and row.namespace == "refimpl_c10d"
                    and not row.in_place
                    and not {node, _base(node.args[0])} & written_later):
                node.target = torch.ops.refimpl_c10d.wait_tensor_.default
                node.meta["val"] = _val(node.args[0])
            written_later.update(b for bases in _written_arguments(node, "CL-9") for b in bases)

    def run(self):
        for node in list(self.graph.nodes):
            rule = self.rule_of(node)
            if rule is not None:
                rule(self, node)
        self.complete_in_place()
        self.keep_outputs_out_of_comm_buffers()


def _check_group(node: torch.fx.Node) -> None:
    """A collective's group must be a process group of this process (CL-16)."""
    from refimpl.functional_collectives import group_ranks

    args = _fx.arguments(node, "CL-16")
    if "group_name" not in args:
        return  # a wait
    try:
        group_ranks(args["group_name"])
    except (ValueError, TypeError):
        raise ValueError(f"gm: node {node.name!r} ({node.target}): group_name "
                         f"{args['group_name']!r} names no process group of this process "
                         f"[CL-16]") from None


def _check_traced(gm: torch.fx.GraphModule) -> None:
    """Collectives must be op overloads whose tensor arguments carry fake values (CL-1),
    on groups this process knows (CL-16)."""
    for node in gm.graph.nodes:
        target = node.target
        if (isinstance(target, torch._ops.OpOverloadPacket)
                and target._qualified_op_name.split("::")[0] in _fx.COLLECTIVE_NAMESPACES):
            raise ValueError(f"gm: node {node.name!r} calls the packet {target} with no "
                             f"overload and no meta['val']; lower needs a graph traced with "
                             f"fake values (make_fx, torch.compile) [CL-1]")
        if _fx.collective_name(node) is not None:
            _val(node)
            torch.fx.node.map_arg(node.args, _val)
            _check_group(node)


def _copy(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    graph = _fx.empty_graph_like(gm)
    outputs = graph.graph_copy(gm.graph, {})
    graph.output(outputs)
    return torch.fx.GraphModule(gm, graph)


def lower(gm: torch.fx.GraphModule, config: CommLoweringConfig | None = None
          ) -> torch.fx.GraphModule:
    """The lowered, executable copy of `gm`; `gm` itself is left unchanged (CL-1)."""
    require_type(gm, torch.fx.GraphModule, "gm", "a torch.fx.GraphModule", "CL-1")
    config = CommLoweringConfig() if config is None else config
    require_type(config, CommLoweringConfig, "config", "a CommLoweringConfig", "CL-1")
    _check_traced(gm)
    lowered = _copy(gm)
    _Lowering(lowered, config).run()
    lowered.graph.lint()
    lowered.recompile()
    return _fx.call_straight(lowered)  # a blocking one-shot costs about what a module call does

