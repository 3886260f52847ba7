"""The order validator: does a reordered graph keep the rules RO-3..RO-9 of SPEC section 4?

`order_violations(original, reordered, memory_budget, max_in_flight)` judges any backend's
order by the rules, not by a golden: it is written from SPEC.md alone and shares no code
with refimpl.reorder. It returns one line per violation (empty: the order is valid):

- RO-3: the same nodes (names, ops, arguments), inputs first in their order, the output
  last, every node after its inputs;
- RO-4: per buffer (an alias analysis of its own, from the ops' schemas, MEM-2's renames
  and MEM-5's in-flight holds), every access follows as many writes as in the original;
- RO-5: each group's collectives in their original order;
- RO-6: every barrier has the same nodes before it;
- RO-7: every block (BK-17 tag, or an untagged collective with its prologue) contiguous;
- RO-8: never more than `max_in_flight[kind]` collectives of one group and kind issued and
  not yet completed;
- RO-9: the planned peak (refimpl.memory, the definition of MEM) at most
  `floor((1 + memory_budget) * original peak)`.

What an op is (a collective and its kind, a wait, a blocking kernel, what it holds in
flight, whether it returns its argument) it asks conformance/ops.py, SPEC's op table.
"""

from __future__ import annotations

import math
import operator

import torch
import torch.fx

from conformance import ops
from conformance.ops import is_blocking, is_wait, kind_of, op_key

PROLOGUE = ("_to_copy", "convert_element_type", "clone", "copy", "copy_", "cat",
            "constant_pad_nd", "empty", "empty_like", "empty_strided", "new_empty",
            "new_empty_strided")
RNG = "rng state"


def group_of(node) -> str | None:
    """The group a collective or blocking symmetric-memory kernel runs on."""
    if kind_of(node) is None and not is_blocking(node):
        return None
    schema = node.target._schema
    for i, a in enumerate(schema.arguments):
        if a.name == "group_name":
            return str(node.args[i] if i < len(node.args) else node.kwargs[a.name])
    return None


def is_barrier(node) -> bool:
    """SPEC RO-6, read literally."""
    from torch.fx.node import _side_effectful_functions

    if node.op in ("call_module", "call_method"):
        return True
    if node.op != "call_function":
        return False
    target = node.target
    if isinstance(target, torch._ops.HigherOrderOperator):
        return True
    if not isinstance(target, torch._ops.OpOverload):
        module, name = getattr(target, "__module__", ""), getattr(target, "__name__", "")
        if target is operator.setitem:
            return True
        return not (module in ("_operator", "operator", "math")
                    or name == "empty_strided_p2p" or (module == "torch" and
                                                      name.startswith("sym_")))
    if ops.find(target) is not None:  # a collective, a wait or a blocking kernel
        return False
    namespace = target.namespace
    try:
        from torch._higher_order_ops.effects import _get_effect

        effect = _get_effect(target)
    except ImportError:
        effect = None
    if target in _side_effectful_functions or effect is not None:
        return True
    if namespace in ("aten", "prims"):
        return False
    if namespace == "c10d" or namespace in ops.namespaces():  # an op the table leaves out
        return True
    return target._schema.is_mutable or not target._schema.returns


# --------------------------------------------------------------------------------------
# Buffers: which tensor of a node lives in which allocation (MEM-2's renames)
# --------------------------------------------------------------------------------------
def _leaves(value) -> int:
    if isinstance(value, torch.Tensor):
        return 1
    if isinstance(value, (list, tuple)):
        return sum(_leaves(v) for v in value)
    return 0


class _Buffers:
    """roots[node]: per tensor of the node's value (pytree order), the buffer it lives in,
    named by the node that allocates it and the tensor's index there (order-independent)."""

    def __init__(self, gm: torch.fx.GraphModule):
        self.roots: dict[torch.fx.Node, list] = {}
        storages: dict[int, str] = {}
        for node in gm.graph.nodes:
            value = node.meta.get("val")
            if node.op in ("placeholder", "get_attr"):
                ids = []
                for i, t in enumerate([value] if isinstance(value, torch.Tensor) else
                                      [v for v in (value or ()) if isinstance(v, torch.Tensor)]):
                    ids.append(storages.setdefault(t.untyped_storage()._cdata, f"{node.name}#{i}"))
                self.roots[node] = ids
            elif node.op == "call_function":
                self.roots[node] = self._call(node, value)

    def of(self, arg) -> list:
        found: list = []
        torch.fx.node.map_arg(arg, lambda n: found.extend(self.roots.get(n, [])))
        return found

    def _call(self, node, value) -> list:
        if node.target is operator.getitem:
            source, index = node.args
            parts = source.meta.get("val")
            if isinstance(parts, (list, tuple)) and isinstance(index, int):
                start = sum(_leaves(v) for v in parts[:index])
                return self.roots.get(source, [])[start:start + _leaves(parts[index])]
        if op_key(node) is None:
            return [f"{node.name}#{i}" for i in range(_leaves(value))]
        op = ops.find(node)
        if (op is not None and op.returns_argument) or op_key(node) == ("aten", "_unsafe_view"):
            found, n = self.of(node.args[0]), _leaves(value)  # MEM-2's renames
            return found if len(found) == n else found[:1] * n
        schema = node.target._schema
        values = [value] if len(schema.returns) == 1 else list(value or ())
        roots = []
        for ret, v in zip(schema.returns, values, strict=False):
            n = _leaves(v)
            source = self._aliased_argument(node, ret)
            if source is None:
                roots += [f"{node.name}#{len(roots) + i}" for i in range(n)]
            else:
                found = self.of(source)
                roots += found if len(found) == n else found[:1] * n
        return roots

    @staticmethod
    def _aliased_argument(node, ret):
        if ret.alias_info is None or not ret.alias_info.before_set:
            return None
        for i, a in enumerate(node.target._schema.arguments):
            if a.alias_info is not None and a.alias_info.before_set & ret.alias_info.before_set:
                return node.args[i] if i < len(node.args) and not a.kwarg_only else \
                    node.kwargs.get(a.name)
        return None

    def written(self, node) -> list:
        if is_wait(node):
            return self.of(node.args[0])
        if op_key(node) is None:
            return []
        out = []
        for i, a in enumerate(node.target._schema.arguments):
            if a.alias_info is not None and a.alias_info.is_write:
                arg = node.args[i] if i < len(node.args) and not a.kwarg_only else \
                    node.kwargs.get(a.name)
                out += self.of(arg)
        if torch.Tag.nondeterministic_seeded in node.target.tags:
            out.append(RNG)
        return out

    def members(self, node) -> list[tuple[int, list]]:
        """A collective's members: (its result's buffer, the buffers held until its wait)."""
        results = self.roots.get(node, [])
        members = ops.member_list(node)
        known = ops.find(node) is not None

        def holds_inputs(i: int) -> bool:  # else its result only (MEM-5's In flight words)
            return known and ops.member_in_flight(node, i) == "inputs"

        if isinstance(members, (list, tuple)):
            return [(results[i], (self.of(a) if holds_inputs(i) else []) + [results[i]])
                    for i, a in enumerate(members) if i < len(results)]
        if not results:
            return []
        inputs = self.of(node.args) + self.of(node.kwargs) if holds_inputs(0) else []
        return [(results[0], inputs + [results[0]])]


# --------------------------------------------------------------------------------------
# The rules
# --------------------------------------------------------------------------------------
def body_nodes(gm) -> list[torch.fx.Node]:
    """`gm`'s nodes in order, less its inputs, attributes and output."""
    return [n for n in gm.graph.nodes if n.op not in ("placeholder", "get_attr", "output")]


def _same_nodes(original, reordered) -> list[str]:
    a = {n.name: n for n in original.graph.nodes}
    b = {n.name: n for n in reordered.graph.nodes}
    if a.keys() != b.keys():
        return [f"RO-3: nodes differ: missing {sorted(a.keys() - b.keys())[:5]}, added "
                f"{sorted(b.keys() - a.keys())[:5]}"]
    name = lambda n: n.name if isinstance(n, torch.fx.Node) else n
    problems = []
    for key, node in a.items():
        other = b[key]
        if node.op != other.op or node.target != other.target or \
                torch.fx.node.map_arg(node.args, name) != torch.fx.node.map_arg(other.args, name) \
                or torch.fx.node.map_arg(node.kwargs, name) != \
                torch.fx.node.map_arg(other.kwargs, name):
            problems.append(f"RO-3: node {key} changed its op or arguments")
    inputs = lambda gm: [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    nodes = list(reordered.graph.nodes)
    if [n.name for n in nodes if n.op == "placeholder"] != inputs(original) or \
            any(n.op == "placeholder" for n in nodes[len(inputs(original)):]):
        problems.append("RO-3: the inputs are not first, in their order")
    seen = set()
    for node in nodes:
        for arg in node.all_input_nodes:
            if arg.name not in seen:
                problems.append(f"RO-3: {node.name} comes before its input {arg.name}")
        seen.add(node.name)
    return problems


def buffer_accesses(gm) -> list[tuple[str, list, list]]:
    """Per body node: (name, buffers it reads, buffers it writes), waits reading what the
    collectives they complete hold (MEM-5, FC-5)."""
    buffers = _Buffers(gm)
    pending: dict = {}
    out = []
    for node in body_nodes(gm):
        reads = buffers.of(node.all_input_nodes)
        writes = buffers.written(node)
        if kind_of(node) is not None:
            for done, held in buffers.members(node):
                pending.setdefault(done, []).append(held)
        if is_wait(node):
            for b in buffers.of(node.args[0]):
                for held in pending.pop(b, []):
                    reads += held
        out.append((node.name, reads, writes))
    return out


def _version_counts(gm) -> dict[tuple[str, object], int]:
    """(node, buffer) -> how many writes of the buffer come before the node's access."""
    written: dict = {}
    counts = {}
    for name, reads, writes in buffer_accesses(gm):
        for b in set(reads) | set(writes):
            counts[(name, b)] = written.get(b, 0)
        for b in set(writes):
            written[b] = written.get(b, 0) + 1
    return counts


def _versions(original, reordered) -> list[str]:
    before, after = _version_counts(original), _version_counts(reordered)
    return [f"RO-4: {name} sees version {after.get((name, b))} of a buffer, originally "
            f"{count}" for (name, b), count in before.items() if after.get((name, b)) != count]


def _group_orders(gm) -> dict[str, list[str]]:
    orders: dict[str, list[str]] = {}
    for node in body_nodes(gm):
        group = group_of(node)
        if group is not None:
            orders.setdefault(group, []).append(node.name)
    return orders


def _groups(original, reordered) -> list[str]:
    a, b = _group_orders(original), _group_orders(reordered)
    return [f"RO-5: group {g!r} issues {b.get(g)}, originally {order}"
            for g, order in a.items() if b.get(g) != order]


def _barriers(original, reordered) -> list[str]:
    new_position = {n.name: i for i, n in enumerate(body_nodes(reordered))}
    problems, before = [], set()
    for node in body_nodes(original):
        if is_barrier(node):
            now = {n for n, i in new_position.items() if i < new_position[node.name]}
            if now != before:
                problems.append(f"RO-6: barrier {node.name}: {sorted(now ^ before)[:4]} "
                                f"crossed it")
        before.add(node.name)
    return problems


def _prologue_ops(node) -> bool:
    if node.target is operator.getitem:
        return True
    name = op_key(node)
    if name is None or name[0] not in ("aten", "prims"):
        return False
    returns = node.target._schema.returns
    is_view = bool(returns) and all(r.alias_info is not None and not r.alias_info.is_write
                                    for r in returns)
    return name[1] in PROLOGUE or is_view or name[1] == "_unsafe_view"


def blocks(gm) -> list[list[str]]:
    """Tagged blocks (BK-17) and each untagged collective with its prologue (RO-7)."""
    tagged: dict = {}
    for node in body_nodes(gm):
        if node.meta.get("refimpl_block") is not None:
            tagged.setdefault(tuple(node.meta["refimpl_block"]), []).append(node.name)
    found = list(tagged.values())
    for node in body_nodes(gm):
        if kind_of(node) is None or node.meta.get("refimpl_block") is not None:
            continue
        block = {node}
        changed = True
        while changed:  # grow until every member's users are inside
            changed = False
            for member in list(block):
                for arg in member.all_input_nodes:
                    if arg in block or arg.op != "call_function" or not _prologue_ops(arg) or \
                            arg.meta.get("refimpl_block") is not None:
                        continue
                    if all(user in block for user in arg.users):
                        block.add(arg)
                        changed = True
        if len(block) > 1:
            found.append([n.name for n in block])
    return found


def _contiguous(original, reordered) -> list[str]:
    position = {n.name: i for i, n in enumerate(body_nodes(reordered))}
    problems = []
    for block in blocks(original):
        places = sorted(position[name] for name in block)
        if places[-1] - places[0] != len(places) - 1:
            problems.append(f"RO-7: block {sorted(block)} is not contiguous")
    return problems


def _in_flight(reordered, limits: dict) -> list[str]:
    """Scan the new order: a collective is in flight from its issue to its last wait."""
    if not limits:
        return []
    buffers = _Buffers(reordered)
    waiting: dict = {}  # result buffer -> collectives
    left: dict[torch.fx.Node, int] = {}
    count: dict = {}
    problems = []
    for node in body_nodes(reordered):
        kind = kind_of(node)
        if kind is not None:
            key = (group_of(node), kind)
            if kind in limits and count.get(key, 0) >= limits[kind]:
                problems.append(f"RO-8: {node.name} issued with {count[key]} {kind} of its "
                                f"group in flight (limit {limits[kind]})")
            count[key] = count.get(key, 0) + 1
            members = buffers.members(node)
            left[node] = len(members)
            for done, _ in members:
                waiting.setdefault(done, []).append(node)
            if not members:
                count[key] -= 1
        elif is_wait(node):
            for b in buffers.of(node.args[0]):
                for collective in waiting.pop(b, []):
                    left[collective] -= 1
                    if left[collective] == 0:
                        count[(group_of(collective), kind_of(collective))] -= 1
    return problems


def in_flight_violations(gm: torch.fx.GraphModule, max_in_flight: dict) -> list[str]:
    """RO-8 on `gm`'s own order: non-empty when it breaks a limit (for an original order:
    RO-9's exception then lets the moves the limit forces pass the memory bound)."""
    return _in_flight(gm, dict(max_in_flight))


def _memory(original, reordered, budget: float | None) -> list[str]:
    from refimpl.memory import plan_memory

    if budget is None or math.isinf(budget):  # None: no bound (RO-1)
        return []
    before, after = plan_memory(original).peak_bytes, plan_memory(reordered).peak_bytes
    limit = math.floor((1 + budget) * before)
    if after > limit:
        return [f"RO-9: planned peak {after} B, more than {limit} B ((1 + {budget}) times "
                f"the original order's {before} B)"]
    return []


def order_violations(original: torch.fx.GraphModule, reordered: torch.fx.GraphModule,
                     memory_budget: float = 0.1, max_in_flight: dict | None = None
                     ) -> list[str]:
    """Every way `reordered` breaks RO-3..RO-9 against `original`; empty when valid."""
    problems = _same_nodes(original, reordered)
    if problems:
        return problems
    return (_versions(original, reordered) + _groups(original, reordered)
            + _barriers(original, reordered) + _contiguous(original, reordered)
            + _in_flight(reordered, dict(max_in_flight or {}))
            + _memory(original, reordered, memory_budget))
