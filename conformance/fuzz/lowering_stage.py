"""The CL stage on a rank (`lowering_on_rank`): the lowered program computes what eager
does (CL-15, CL-1) and makes SPEC's choices (conformance/lowering_model.py: CL-2..CL-5,
CL-10, CL-14, CL-17), under the drawn options and each of CL_VARIANTS; blocking kernels'
waits removed (CL-9), comm buffers' alloc_ids (CL-12), outputs kept by the caller
(CL-13), a forced one-shot refused (CL-10) and a bad option refused (CL-16).
"""

from __future__ import annotations

import functools

import torch

from conformance import lowering_model
from conformance import lowering_programs as lp
from conformance import reorder_programs as rp
from conformance.backends import NotImplementedConcept
from conformance.fuzz.on_rank import (
    differences_from_eager,
    load_program,
    observe,
    refusal_problems,
    shortened,
    trace_program,
    untrue_meta,
)
from conformance.fuzz.stage_options import CL_OPTIONS, CL_VARIANTS, OWN_CL_OPTIONS
from conformance.fuzz.vocabulary import STAGES


def lowering_on_rank(spec: str, source: str, inputs, options) -> dict:
    """CL: the lowered program computes what the eager program does (and says so in
    meta), and makes SPEC's choices (lowering_model)."""
    backend, fn, xs, groups = load_program(spec, source, inputs)
    ns = backend.require("lowering", *STAGES["CL"].attrs)
    config = {k: options[k] for k in CL_OPTIONS if options.get(k) is not None}
    if options["symm_mem_world"]:
        config["enable_symm_mem_for"] = [groups["world"]]
    if options.get("bad"):  # CL-16: refused, naming the option
        config[options["bad"][0]] = options["bad"][1]
        return {"problems": refusal_problems("CL", options["bad"], lambda: ns.run_lowered(
            fn, [x.clone() for x in xs], dict(config)))}
    try:
        return _lowering_checks(backend, ns, fn, xs, groups, config)
    except NotImplementedConcept:
        # refimpl's own flags (CL-10's force, CL-17's fusion): a backend without them is
        # checked under the rest of the options
        rest = {k: v for k, v in config.items() if k not in OWN_CL_OPTIONS}
        if rest == config:
            raise
        return _lowering_checks(backend, ns, fn, xs, groups, rest)


def _lowering_checks(backend, ns, fn, xs, groups: dict, config: dict) -> dict:
    from conformance.true_meta import MetaChecker

    enabled = _symm_mem_groups(backend, groups, config)
    traced_graph = functools.cache(lambda: trace_program(fn, xs))  # the model's input, traced once
    if config.get("force_one_shot_all_reduce") and enabled is not None:
        refusal = lowering_model.forced_refusal(traced_graph(), config, enabled)
        if refusal is not None:  # CL-10: refused, naming the first condition that fails
            return {"problems": _forced_refused(refusal, lambda: ns.run_lowered(
                fn, [x.clone() for x in xs], dict(config)))}
    want = observe(lambda: fn(*[x.clone() for x in xs]))
    checker = None
    if getattr(ns, "lowered_graph", None) is not None:
        checker = MetaChecker(ns.lowered_graph(fn, [x.clone() for x in xs], dict(config)))
        got = observe(lambda: checker.call(*[x.clone() for x in xs]))
    else:
        got = observe(lambda: ns.run_lowered(fn, [x.clone() for x in xs], dict(config)))
    problems = differences_from_eager(want, got, "lowered", "CL-15", "CL-1")
    if checker is not None and checker.untrue:
        traced = MetaChecker(trace_program(fn, xs))
        traced.call(*[x.clone() for x in xs])
        problems += untrue_meta("CL-1", traced, checker)
    alloc_ids: list = []
    if checker is not None and not problems:
        problems += _kept_by_the_caller(checker.module, xs, want[0])
        problems += _blocking_waits_removed(checker.module)
        if enabled is not None:  # CL-2..CL-5, CL-10, CL-14, CL-17: SPEC's choices
            problems += lowering_model.differences(
                lowering_model.plan(traced_graph(), config, enabled),
                lowering_model.lowered(checker.module))
            for variant in CL_VARIANTS:
                if not problems:
                    problems += _variant_problems(ns, fn, xs, traced_graph(), variant, want,
                                                  groups, enabled)
        alloc_ids = lp.alloc_ids(checker.module)
        problems += _alloc_ids_problems(ns, fn, xs, config, alloc_ids)
    return {"problems": problems, "alloc_ids": alloc_ids}


def _variant_problems(ns, fn, xs, traced, variant: dict, want, groups: dict,
                      enabled: set[str]) -> list[str]:
    """The program lowered again under one of CL_VARIANTS (symmetric memory on WORLD):
    SPEC's choices, eager's values, no blocking kernel's wait kept (CL-9) and a second
    call leaving the first one's outputs (CL-13)."""
    config = {**variant, "enable_symm_mem_for": [groups["world"]]}
    lowered = ns.lowered_graph(fn, [x.clone() for x in xs], dict(config))
    shown = f" (lowered again with {variant})"
    problems = lowering_model.differences(
        lowering_model.plan(traced, config, enabled | {groups["world"]}),
        lowering_model.lowered(lowered))
    if not problems:
        got = observe(lambda: lowered(*[x.clone() for x in xs]))
        problems = differences_from_eager(want, got, "lowered", "CL-15", "CL-1")
    if not problems:
        problems = _blocking_waits_removed(lowered) + _kept_by_the_caller(lowered, xs, want[0])
    return [p + shown for p in problems]


def _symm_mem_groups(backend, groups: dict, config: dict) -> set[str] | None:
    """The program's groups symmetric memory is enabled for when it is lowered (enabling
    lasts in a rank process: an earlier program's counts), or None if the backend cannot
    say."""
    try:
        sm = backend.require("symmetric_memory", "is_symm_mem_enabled_for_group")
    except NotImplementedConcept:
        return None
    return ({name for name in groups.values() if sm.is_symm_mem_enabled_for_group(name)}
            | set(config.get("enable_symm_mem_for", ())))


def _forced_refused(refusal: tuple[str, str], make) -> list[str]:
    """CL-10: with force_one_shot_all_reduce, an all_reduce that cannot go one-shot is
    refused with a CommBufferError (a ValueError) naming the first condition that fails."""
    node, word = refusal
    try:
        make()
    except NotImplementedConcept:
        raise
    except ValueError as exc:
        if any(w in str(exc) for w in word.split("|")):
            return []
        return [f"CL-10: force_one_shot_all_reduce: the all_reduce {node} was refused with "
                f"{type(exc).__name__}: {shortened(str(exc), 2)} (expected the first condition "
                f"that fails named: {word!r})"]
    except Exception as exc:  # the type is what is checked
        return [f"CL-10: force_one_shot_all_reduce: the all_reduce {node} raised "
                f"{type(exc).__name__}: {shortened(str(exc), 2)} (expected a CommBufferError "
                f"naming {word!r})"]
    return [f"CL-10: force_one_shot_all_reduce: the all_reduce {node} cannot go one-shot "
            f"({word}) and was not refused"]


def _blocking_waits_removed(gm) -> list[str]:
    """CL-9: the wait of a collective lowered to a blocking kernel is removed."""
    from conformance.ops import is_blocking, is_wait

    kept = [n.name for n in gm.graph.nodes if is_wait(n) and
            isinstance(n.args[0], torch.fx.Node) and is_blocking(n.args[0])]
    return [f"CL-9: waits {kept} of blocking kernels kept in the lowered graph"] if kept else []


def _alloc_ids_problems(ns, fn, xs, config, ids: list) -> list[str]:
    """CL-12: ids in [0, 2**63), distinct within the graph, the same in another lowering
    of the same graph, different under another alloc_id_namespace (and, across ranks,
    the same: runner.py's _across_ranks)."""
    if not ids:
        return []
    problems = []
    if not all(isinstance(i, int) and 0 <= i < 2**63 for i in ids):
        problems.append(f"CL-12: alloc_ids {ids} are not all ints in [0, 2**63)")
    if len(set(ids)) != len(ids):
        problems.append(f"CL-12: comm buffers of one graph share alloc_ids: {ids}")
    again = lp.alloc_ids(ns.lowered_graph(fn, [x.clone() for x in xs], dict(config)))
    if again != ids:
        problems.append(f"CL-12: two lowerings of one graph gave alloc_ids {ids} and {again}")
    try:
        other = lp.alloc_ids(ns.lowered_graph(fn, [x.clone() for x in xs],
                                            {**config, "alloc_id_namespace": "fuzz-other"}))
    except NotImplementedConcept:
        return problems
    if set(other) & set(ids):
        problems.append(f"CL-12: alloc_id_namespace 'fuzz-other' gave alloc_ids {other}, "
                        f"sharing some with the default namespace's {ids}")
    return problems


def _kept_by_the_caller(gm, xs, want: list[torch.Tensor]) -> list[str]:
    """CL-13: what one call of the lowered program returns is the caller's: a second call,
    on other inputs, leaves it as it was (a comm buffer returned would be written again,
    since the next call takes the same alloc_id, SM-4)."""
    first = rp.flat_tensors(gm(*[x.clone() for x in xs]))
    gm(*[-x for x in xs])
    try:
        torch.testing.assert_close(first, want, rtol=0, atol=0)
    except AssertionError as exc:
        return [f"CL-13: a second call of the lowered program changed what the first "
                f"returned: {exc}"]
    return []
