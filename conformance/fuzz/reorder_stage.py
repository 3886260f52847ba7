"""The RO stage on a rank (`reorder_on_rank`): the backend's order judged by
conformance/reorder_rules.py (RO-3..RO-9), its values (RO-13), what it returns and its
meta (RO-1); `split_blocks`: the untagged blocks no order can keep together, which SPEC
leaves open (RO-7).
"""

from __future__ import annotations

from conformance import reorder_programs as rp
from conformance.backends import NotImplementedConcept
from conformance.fuzz.on_rank import (
    cap_callback,
    load_program,
    refusal_problems,
    side_by_side,
    trace_program,
    untrue_meta,
)
from conformance.fuzz.vocabulary import STAGES


def reorder_on_rank(spec: str, source: str, inputs, options) -> dict:
    """RO: the backend's order keeps RO-3..RO-9 (reorder_rules, the judge) and the values;
    with `bucketed_first`, the backend's own all_gather bucketing (BK-17 blocks) runs
    first, as an input of the case."""
    from conformance.reorder_rules import in_flight_violations, order_violations
    from conformance.true_meta import MetaChecker

    backend, fn, xs, _ = load_program(spec, source, inputs)
    ns = backend.require("reorder", *STAGES["RO"].attrs)
    gm = trace_program(fn, xs)
    if options["bucketed_first"]:
        try:
            bucket = backend.require("bucketing", "bucket_all_gather").bucket_all_gather
        except NotImplementedConcept:  # then the traced program alone
            bucket = None
        if bucket is not None:
            bucket(gm, cap_callback(options["caps_bytes"]["bucket_all_gather"]))
    limits = dict(options["max_in_flight"])
    if options.get("bad"):  # RO-1: refused, naming the option
        name, value, _ = options["bad"]
        fields = {"memory_budget": options["memory_budget"], "max_in_flight": limits, name: value}
        return {"problems": refusal_problems("RO", options["bad"],
                                             lambda: ns.ReorderConfig(**fields)),
                "order": []}
    config = ns.ReorderConfig(cost_model=ns.CostModel(pinned=rp.pinned_costs(gm)),
                              memory_budget=options["memory_budget"], max_in_flight=limits)
    new = ns.reorder(gm, config)
    unplaceable = {f"RO-7: block {sorted(b)} is not contiguous" for b in split_blocks(gm)}
    # RO-9's exception: when the original order breaks a limit, the moves it forces may
    # pass the memory bound, and which moves those are is the scheduler's (RO-12): the
    # bound is then not judged.
    forced = bool(in_flight_violations(gm, limits))
    problems = [p for p in order_violations(gm, new, options["memory_budget"], limits)
                if p not in unplaceable and not (forced and p.startswith("RO-9:"))]
    traced, checker = MetaChecker(gm), MetaChecker(new)
    diff = side_by_side(rp.run_graph(gm, xs, traced), rp.run_graph(new, xs, checker))
    problems += [f"RO-13: reordered values differ: {diff}"] if diff else []
    if _returns(new) != _returns(gm):
        problems.append(f"RO-1: the reordered program returns {_returns(new)}, the "
                        f"original {_returns(gm)}")
    problems += untrue_meta("RO-1", traced, checker)
    return {"problems": problems, "order": [n.name for n in new.graph.nodes]}


def _returns(gm) -> str:
    """What calling `gm` returns, as its code generator builds it: a pytree's spec (make_fx
    keeps a program's dict), or the output node's value as it is."""
    info = getattr(gm.graph._codegen, "pytree_info", None)
    spec = getattr(info, "out_spec", None)
    return str(spec) if spec is not None else "the output node's value"


def split_blocks(gm) -> list[list[str]]:
    """The untagged blocks (a collective and its prologue, RO-7) that no order can keep
    together: a node outside one, between its members, follows one of them and precedes
    another (RO-3..RO-6), as a barrier between a prologue's view and its cast does. SPEC
    leaves them open (refimpl places the collective alone), so the judge's RO-7 line about
    them is not held against the backend."""
    from conformance import reorder_rules as rules

    body = rules.body_nodes(gm)  # the judge's own reading of the graph, not refimpl's
    position = {n.name: i for i, n in enumerate(body)}
    preds = _orderings(gm, body)
    split = []
    for block in rules.blocks(gm):
        members = set(block)
        if any(n.meta.get("refimpl_block") is not None for n in body if n.name in members):
            continue  # a tagged block that cannot be placed is refused instead (RO-7)
        after: set[str] = set()  # outside nodes in the block's span that follow a member
        for node in body[min(position[m] for m in members):max(position[m] for m in
                                                               members) + 1]:
            reached = preds[node.name] & (members | after)
            if node.name not in members and reached:
                after.add(node.name)
            elif node.name in members and preds[node.name] & after:
                split.append(block)
                break
    return split


def _orderings(gm, body) -> dict[str, set[str]]:
    """node -> the nodes it must follow in any order: data (RO-3), buffer versions (RO-4,
    from the judge's accesses), each group's issue order (RO-5) and barriers (RO-6)."""
    from conformance import reorder_rules as rules

    preds = {n.name: {a.name for a in n.all_input_nodes if a.op != "placeholder"}
             for n in body}
    last_write: dict = {}
    readers: dict = {}
    for name, reads, writes in rules.buffer_accesses(gm):
        for b in set(reads) | set(writes):
            if b in last_write:
                preds[name].add(last_write[b])
        for b in set(writes):
            preds[name].update(readers.pop(b, ()))
            last_write[b] = name
        for b in set(reads) - set(writes):
            readers.setdefault(b, []).append(name)
    last_of_group: dict = {}
    before: list[str] = []
    barrier = None
    for node in body:
        group = rules.group_of(node)
        if group is not None:
            preds[node.name].update([last_of_group[group]] if group in last_of_group else [])
            last_of_group[group] = node.name
        if barrier is not None:
            preds[node.name].add(barrier)
        if rules.is_barrier(node):
            preds[node.name].update(before)
            barrier = node.name
        before.append(node.name)
    for name in preds:
        preds[name].discard(name)
    return preds
