"""The BK stage on a rank (`bucketing_on_rank`): the backend's bucketing passes on a
generated program, judged by conformance/bucket_model.py (BK-2..BK-8, BK-10, BK-11,
BK-15..BK-17), a spoiled candidate or cap refused (BK-16, BK-3), and the all_gather pass
run again on its own result (BK-17).
"""

from __future__ import annotations

import logging
import re
from collections import Counter

import torch

from conformance import bucket_model, ops
from conformance import reorder_programs as rp
from conformance.fuzz.on_rank import (
    cap_callback,
    load_program,
    side_by_side,
    trace_program,
    untrue_meta,
)
from conformance.fuzz.stage_options import BAD_CAPS
from conformance.fuzz.vocabulary import BUCKET_PASSES, STAGES


def _collective_keys(gm, label: dict[str, str]) -> Counter:
    """(kind, group key, dtype) -> how many collectives the graph issues."""
    return Counter(signature[:3] for signature in bucket_model.observed(gm, label))


def bucketing_on_rank(spec: str, source: str, inputs, options) -> dict:
    """BK: the backend's passes on the traced program give its values bit for bit, true
    meta, and the collectives conformance.bucket_model plans from SPEC (which merge, where
    each stands, which caps are asked); each pass logs its numbers (BK-15), tags its blocks
    (BK-17) and, with nothing to merge, changes nothing (BK-5); a spoiled candidate is
    refused (BK-16)."""
    from conformance.true_meta import MetaChecker

    backend, fn, xs, groups = load_program(spec, source, inputs)
    bucketing = backend.require("bucketing", *STAGES["BK"].attrs)
    label = {name: key for key, name in groups.items()}
    original, bucketed = trace_program(fn, xs), trace_program(fn, xs)
    passes = [(name, getattr(bucketing, name)) for name in BUCKET_PASSES
              if hasattr(bucketing, name)]  # bucket_all_reduce is optional
    model = [(name.removeprefix("bucket_"), cap_callback(options["caps_bytes"][name]))
             for name, _ in passes]
    gather_options = {k: options[k] for k in ("use_out_variant", "mixed_dtypes") if k in options}
    mixed = gather_options.get("mixed_dtypes", False)
    want = bucket_model.predict(original, model, label, mixed_dtypes=mixed)
    if options.get("bad") and want.candidates[options["bad"][0].removeprefix("bucket_")]:
        return {"problems": _spoiled_candidate_refused(bucketed, passes, options, want),
                "merges": []}
    problems = []
    for name, bucket in passes:
        problems += _one_pass(bucketed, name, bucket, options,
                              gather_options if name == "bucket_all_gather" else {}, want)
    problems += _bucket_differences(original, model, label, want,
                                    bucket_model.observed(bucketed, label), mixed)
    traced, checker = MetaChecker(original), MetaChecker(bucketed)
    want_values = rp.run_graph(original, xs, traced)
    diff = side_by_side(want_values, rp.run_graph(bucketed, xs, checker), sort_logs=True)
    problems += [f"BK-8: bucketed values differ: {diff}"] if diff else []
    problems += untrue_meta("BK-7", traced, checker)
    merges = sorted(_collective_keys(bucketed, label).items())
    if not problems and passes[0][0] == "bucket_all_gather":
        problems += _second_gather_pass(bucketed, passes[0][1], options, gather_options, label,
                                        xs, want_values)
    return {"problems": problems, "merges": merges}


def _second_gather_pass(gm, bucket, options, kwargs, label, xs, want_values) -> list[str]:
    """The all_gather pass once more on its own result (BK-17: a later call numbers its
    buckets on from the largest index there, and a block whose collective it merges joins
    the new block); what it merges (gathers it left alone, out-of-place merged ones) is
    judged as the first call's, on the graph it was given. Its cap takes every candidate
    left (1 MiB), so it merges whatever the first call's caps kept apart."""
    options = {**options, "caps_bytes": {**options["caps_bytes"], "bucket_all_gather": (2**20,)}}
    cap = cap_callback(options["caps_bytes"]["bucket_all_gather"])
    before = gm.graph.__class__()
    before.graph_copy(gm.graph, {})
    given = torch.fx.GraphModule(gm, before)
    want = bucket_model.predict(given, [("all_gather", cap)], label,
                                mixed_dtypes=kwargs.get("mixed_dtypes", False))
    indices = [tag[1] for n in gm.graph.nodes
               if (tag := n.meta.get("refimpl_block")) and tag[0].startswith("all_gather")]
    first = max(indices) + 1 if indices else 0
    problems = [p.replace("bucket_all_gather", "bucket_all_gather (called again)") for p in
                _one_pass(gm, "bucket_all_gather", bucket, options, kwargs, want, first)]
    problems += _bucket_differences(given, [("all_gather", cap)], label, want,
                                    bucket_model.observed(gm, label),
                                    kwargs.get("mixed_dtypes", False))
    tags = {n.meta.get("refimpl_block") for n in gm.graph.nodes}
    issued = {n.meta.get("refimpl_block") for n in gm.graph.nodes
              if ops.kind_of(n) == "all_gather"}
    orphans = sorted(t for t in tags if t and t[0] in ("all_gather", "all_gather_wait") and
                     ("all_gather", t[1]) not in issued)
    if orphans:
        problems.append(f"BK-17: blocks {orphans} kept after bucket_all_gather (called again) "
                        f"merged their collective; they join the new block")
    diff = side_by_side(want_values, rp.run_graph(gm, xs), sort_logs=True)
    return problems + ([f"BK-8: values differ after bucket_all_gather ran again: {diff}"]
                       if diff else [])


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record):
        if record.levelno == logging.INFO:
            self.lines.append(record.getMessage())


def _one_pass(gm, name: str, bucket, options, kwargs, want, first: int = 0) -> list[str]:
    """Run one pass on `gm`; what it did against the model, besides the collectives: the
    cap indices asked (BK-3), no change without a merge (BK-5), its INFO line (BK-15), the
    tags of its merged collectives and waits (BK-17)."""
    kind, asked, code = name.removeprefix("bucket_"), [], gm.code
    before = {n.name for n in gm.graph.nodes}
    logger, lines = logging.getLogger("refimpl.bucketing"), _Lines()  # named by BK-15
    level = logger.level
    logger.addHandler(lines)
    logger.setLevel(logging.INFO)
    try:
        bucket(gm, cap_callback(options["caps_bytes"][name], asked), **kwargs)
    finally:
        logger.removeHandler(lines)
        logger.setLevel(level)
    problems = []
    if Counter(asked) != want.asks[kind]:
        problems.append(f"BK-3: {name} asked bucket_cap_mb_by_bucket_idx for indices "
                        f"{sorted(asked)}; its buckets open {sorted(want.asks[kind].elements())}")
    if not want.merged[kind] and gm.code != code:
        problems.append(f"BK-5: {name} had nothing to merge but changed the graph")
    numbers = [tuple(int(n) for n in re.findall(r"\d+", line)[:4]) for line in lines.lines]
    if numbers != [want.counts[kind]]:
        problems.append(f"BK-15: {name} logged {lines.lines} at INFO; one line with "
                        f"{want.counts[kind]} (candidates, merged, buckets, left alone) expected")
    merged = [n for n in gm.graph.nodes if n.name not in before and
              ops.kind_of(n) == kind]
    tags = [(n.meta.get("refimpl_block"), [u.meta.get("refimpl_block") for u in n.users])
            for n in merged]
    expected = [((kind, i), [(f"{kind}_wait", i)]) for i in range(first, first + len(merged))]
    if tags != expected:
        problems.append(f"BK-17: {name}'s merged collectives and their waits are tagged {tags}, "
                        f"in program order {expected} expected")
    return problems


def _spoiled_candidate_refused(gm, passes, options, want) -> list[str]:
    """BK-16: one candidate given an argument the op would refuse (`options["bad"]`: the
    pass, the argument, which candidate); its pass MUST raise ValueError naming gm, the
    node, the argument and the rule, before it rewrites anything. BK-3: a pass whose cap
    callback returns no cap MUST raise ValueError naming it (TypeError for a cap that is
    no callable)."""
    pass_name, argument, which = options["bad"]
    kind = pass_name.removeprefix("bucket_")
    if argument == "bucket_cap_mb_by_bucket_idx":
        bad = BAD_CAPS[which % len(BAD_CAPS)]
        what, words = f"a cap of {bad!r}", [argument, "BK-3"]
        error = TypeError if which % len(BAD_CAPS) == len(BAD_CAPS) - 1 else ValueError
        caps = {pass_name: bad if error is TypeError else lambda i: bad}
    else:
        names = want.candidates[kind]
        node = next(n for n in gm.graph.nodes if n.name == names[which % len(names)])
        size = bucket_model.argument_of(node, "group_size")
        bad = {"group_name": "no-such-group", "reduce_op": "median",
               "group_size": (2 * size if which % 2 else size - 1) if size else None}[argument]
        _set_argument(node, argument, bad)
        gm.recompile()
        what, words, error, caps = (f"{node.name} with {argument}={bad!r}",
                                    ["gm", node.name, argument, "BK-16"], ValueError, {})
    rule = words[-1]
    for name, bucket in passes:
        code = gm.code
        try:
            bucket(gm, caps.get(name, cap_callback(options["caps_bytes"][name])))
        except Exception as exc:
            if name != pass_name or type(exc) is not error:
                return [f"{rule}: {name} raised {type(exc).__name__} given {what}"
                        f"{'' if name == pass_name else ' (in another pass)'}: {exc}"]
            missing = [w for w in words if w not in str(exc)]
            return ([f"{rule}: {name}'s refusal of {what} does not name {missing}: {exc}"]
                    if missing else []) + \
                ([f"{rule}: {name} rewrote the graph before refusing {what}"]
                 if gm.code != code else [])
        if name == pass_name:
            return [f"{rule}: {name} accepted {what}"]
    return []


def _set_argument(node, argument: str, value) -> None:
    index = [a.name for a in node.target._schema.arguments].index(argument)
    if index < len(node.args):
        node.args = (*node.args[:index], value, *node.args[index + 1:])
    else:
        node.kwargs = {**node.kwargs, argument: value}


def _bucket_differences(original, model, label, want, got: list[tuple],
                        mixed: bool) -> list[str]:
    """The bucketed graph's collectives against the model's: which merged (named by the
    rule of the reading that explains them, bucket_model.diagnose), then their order."""
    if Counter(got) != Counter(want.signatures):
        rules = bucket_model.diagnose(original, model, label, got, mixed) or ["BK-3"]
        missing = Counter(want.signatures) - Counter(got)
        extra = Counter(got) - Counter(want.signatures)
        return [f"{rule}: the bucketed graph issues {sorted(extra.elements())} where SPEC's "
                f"buckets issue {sorted(missing.elements())} (kind, group, dtype, elements)"
                for rule in rules]
    if got != want.signatures:
        return [f"BK-7: collectives in the order {got}; SPEC's order (each merged one where "
                f"its last member was) is {want.signatures}"]
    return []
