"""Conformance: point-to-point ops (SPEC FC-52, FC-53; FC-34's methods).

`isend`, `irecv` and `batch_p2p_ops` between the members of a group, on every rank: the
values each receives (every dtype family, 0-d, empty, NaN; a subgroup whose group ranks
are not its global ranks), sends issued before receives and after them, the batch form
against the single ops; the argument of a receive left alone; bad arguments refused in
eager and at trace time; a pair that does not match named on both of its ranks, never a
hang. Each case makes a group of its own: the pairs of one case never meet another's.
"""

from __future__ import annotations

import datetime
import os

import pytest
import torch
import torch.distributed as dist
from torch.fx.experimental.proxy_tensor import make_fx

from conformance import oracle
from conformance.backends import NotImplementedConcept
from conformance.funcol_cases import funcol_api, waited
from conformance.harness import run

P2P_DTYPES = [torch.float64, torch.float32, torch.bfloat16, torch.int64, torch.complex64]
P2P_SHAPES = {"2x3": (2, 3), "0-d": (), "empty": (0, 4)}
# The ranks of each group form in a world of 4: all of them, and [1, 2, 3], whose group
# rank i is global rank i + 1 (a peer named by its global rank reaches the wrong member).
GROUPS = {"world": [0, 1, 2, 3], "subgroup": [1, 2, 3]}


def _require_p2p(backend):
    fc = backend.require("functional_collectives")
    if not hasattr(fc.ops, "batch_p2p_ops"):
        pytest.skip(f"torch {torch.__version__} has no functional isend / irecv")


def _sent(global_rank: int, shape, dtype, salt: int) -> torch.Tensor:
    """What `global_rank` sends: small integers, a NaN first where the dtype has one."""
    x = oracle.rank_input(global_rank, shape, dtype, salt=salt)
    if x.numel() and (dtype.is_floating_point or dtype.is_complex):
        x.view(-1)[0] = float("nan")
    return x


def _group(members: list[int], timeout_s: float | None = None):
    """A new group of `members` (every rank of the world takes part) and its name; None
    on a rank outside it."""
    kwargs = {} if timeout_s is None else {"timeout": datetime.timedelta(seconds=timeout_s)}
    group = dist.new_group(members, **kwargs)
    return (group, group.group_name) if dist.get_rank() in members else None


def _token(t: torch.Tensor) -> tuple:
    return tuple(t.shape), t.dtype


# ---- FC-52: values --------------------------------------------------------------------
def _ring(spec, members):
    """Every member sends to the next group rank and receives from the one before, three
    ways per dtype and shape: sends issued first, receives issued first, one batch.
    {label: (received, token of the send)}; None outside the group."""
    ops = funcol_api(spec).ops
    # A ring that deadlocks fails in the group's 30 s, not in the harness's 120.
    made = _group(members, timeout_s=30)
    if made is None:
        return None
    group, name = made
    me, n = group.rank(), group.size()
    after, before = (me + 1) % n, (me - 1) % n
    got = {}
    for dtype in P2P_DTYPES:
        for shape_name, shape in P2P_SHAPES.items():
            label = f"{str(dtype).removeprefix('torch.')}|{shape_name}"
            template = torch.zeros(shape, dtype=dtype)
            x = _sent(dist.get_rank(), shape, dtype, salt=1)
            sent = ops.isend(x, after, 0, name)
            received = ops.irecv(template, before, 0, name)
            got[f"sends_first:{label}"] = (ops.wait_tensor(waited(received)).clone(),
                                           _token(ops.wait_tensor(waited(sent))))
            y = _sent(dist.get_rank(), shape, dtype, salt=2)
            received = ops.irecv(torch.zeros(shape, dtype=dtype), before, 1, name)
            sent = ops.isend(y, after, 1, name)
            got[f"receives_first:{label}"] = (ops.wait_tensor(waited(received)).clone(),
                                              _token(ops.wait_tensor(waited(sent))))
            z = _sent(dist.get_rank(), shape, dtype, salt=3)
            results = ops.batch_p2p_ops(["irecv", "isend"], [before, after], [2, 2],
                                        [torch.zeros(shape, dtype=dtype), z], name)
            results = [ops.wait_tensor(waited(r)) for r in results]
            got[f"batch:{label}"] = (results[0].clone(), _token(results[1]))
    return got


def _same_bits(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Equal, NaN where `want` has NaN."""
    if got.dtype != want.dtype or got.shape != want.shape:
        return False
    if not (want.dtype.is_floating_point or want.dtype.is_complex):
        return torch.equal(got, want)
    return torch.equal(got.isnan(), want.isnan()) and torch.equal(got.nan_to_num(0),
                                                                  want.nan_to_num(0))


@pytest.mark.spec("FC-52", "FC-26")
@pytest.mark.parametrize("form", list(GROUPS))
def test_each_member_receives_what_its_peer_sent(backend, form):
    """A ring over the group: each member receives the tensor of the group rank before it
    (float64, float32, bfloat16, int64, complex64; 2x3, 0-d and empty; a NaN), whether
    the sends or the receives were issued first, and in one batch (FC-26: the batch's
    results are the single ops'); each send's result is a tensor of no elements of the
    sent dtype. Peers are group ranks: on [1, 2, 3], group rank 0 is global rank 1."""
    _require_p2p(backend)
    members = GROUPS[form]
    salts = {"sends_first": 1, "receives_first": 2, "batch": 3}
    for rank, got in enumerate(run(backend, _ring, 4, members, timeout=120)):
        if rank not in members:
            assert got is None, f"rank {rank} is no member of {members}"
            continue
        me = members.index(rank)
        sender = members[(me - 1) % len(members)]
        for label, (received, token) in got.items():
            how, what = label.split(":")
            dtype_name, shape_name = what.split("|")
            dtype = getattr(torch, dtype_name)
            shape = P2P_SHAPES[shape_name]
            want = _sent(sender, shape, dtype, salt=salts[how])
            where = (f"rank {rank} (group rank {me} of {members}), {label}: from group rank "
                     f"{(me - 1) % len(members)} (global rank {sender})")
            assert _same_bits(received, want), f"{where}: got {received}, want {want}"
            assert token == ((0,), dtype), f"{where}: the send's result is {token}"


def _two_groups_in_two_orders(spec):
    """Ranks 0 and 1 share two groups: rank 0 sends on the first, then on the second;
    rank 1 receives on the second, then on the first. Every op is issued before any
    wait: each group's pair matches in that group's order. What rank 1 received, by group."""
    ops = funcol_api(spec).ops
    first_name, second_name = _group([0, 1])[1], _group([0, 1])[1]
    if dist.get_rank() == 0:
        pending = [ops.isend(_sent(0, (3,), torch.float32, salt=s), 1, 0, name)
                   for s, name in ((7, first_name), (8, second_name))]
        for t in pending:
            ops.wait_tensor(waited(t))
        return None
    pending = {name: ops.irecv(torch.zeros(3), 0, 0, name)
               for name in (second_name, first_name)}
    return [ops.wait_tensor(waited(pending[name])).clone() for name in (first_name,
                                                                         second_name)]


@pytest.mark.spec("FC-52")
def test_each_group_matches_its_own_sends_and_receives(backend):
    """Two groups of the same two ranks, used in opposite orders by the two ranks: a send
    matches the receive of its own group, whatever the other group does in between."""
    _require_p2p(backend)
    got = run(backend, _two_groups_in_two_orders, 2)[1]
    for i, (received, salt) in enumerate(zip(got, (7, 8), strict=True)):
        want = _sent(0, (3,), torch.float32, salt=salt)
        assert _same_bits(received, want), f"group {i}: received {received}, want {want}"


def _views_of_results_without_storage(spec):
    """Work left pending after an empty send and an empty receive were each waited
    through a view of their result (the registry keys by storage, FC-6)."""
    fc = funcol_api(spec)
    group, name = _group([0, 1])
    before = fc.work_registry_size()
    peer = 1 - group.rank()
    sent = fc.ops.isend(torch.ones(0, 2), peer, 0, name)
    received = fc.ops.irecv(torch.zeros(0, 2), peer, 0, name)
    fc.ops.wait_tensor(sent.view(0))
    fc.ops.wait_tensor(received.view(2, 0))
    return fc.work_registry_size() - before


@pytest.mark.spec("FC-52", "FC-6", "FC-7")
def test_a_result_without_storage_is_waited_through_a_view(backend):
    """A send's token and an empty receive have no storage address; waiting a view of
    each completes its op, as for any result (FC-6): no work is left pending."""
    _require_p2p(backend)
    if backend.require("functional_collectives").work_registry_size is None:
        raise NotImplementedConcept("the backend does not count its pending work")
    for rank, left in enumerate(run(backend, _views_of_results_without_storage, 2)):
        assert left == 0, f"rank {rank}: {left} ops still pending after their waits"


# ---- FC-53: the argument of a receive, bad arguments ----------------------------------
def _receive_into_a_template(spec):
    """Group rank 1 receives into a template of its own values, once alone and once in a
    batch: (template unchanged, result shares its storage, result) per form."""
    ops = funcol_api(spec).ops
    group, name = _group([0, 1])
    me = group.rank()
    x = oracle.rank_input(0, (3, 2), torch.float32, salt=5)
    facts = {}
    for form in ("single", "batch"):
        if me == 0:
            sent = ops.isend(x, 1, 0, name) if form == "single" else \
                ops.batch_p2p_ops(["isend"], [1], [0], [x], name)[0]
            ops.wait_tensor(waited(sent))
            continue
        template = oracle.rank_input(1, (3, 2), torch.float32, salt=6)
        before = template.clone()
        result = ops.irecv(template, 0, 0, name) if form == "single" else \
            ops.batch_p2p_ops(["irecv"], [0], [0], [template], name)[0]
        result = ops.wait_tensor(waited(result))
        shares = result.untyped_storage().data_ptr() == template.untyped_storage().data_ptr()
        facts[form] = (torch.equal(template, before), shares, result.clone())
    return facts


@pytest.mark.spec("FC-53")
def test_a_receive_leaves_its_argument_alone(backend):
    """irecv's schema declares its argument unwritten: its result is a fresh tensor holding
    what was sent, the argument keeps its values (alone and in a batch)."""
    _require_p2p(backend)
    want = oracle.rank_input(0, (3, 2), torch.float32, salt=5)
    facts = run(backend, _receive_into_a_template, 2)[1]
    for form, (unchanged, shares, result) in facts.items():
        assert torch.equal(result, want), f"rank 1, {form}: received {result}, want {want}"
        assert unchanged, f"rank 1, {form}: irecv wrote into its argument"
        assert not shares, f"rank 1, {form}: irecv's result is its argument's storage"


# name -> (the argument the error must name, a call on (ops, group name, group size));
# every one is refused at trace time too but a meta tensor, which only an eager op refuses
# (FC-30: tracing runs on tensors without data).
EAGER_ONLY = {"isend-meta_tensor"}
BAD_P2P = {
    "isend-dst_is_group_size": ("dst", lambda o, g, n: o.isend(torch.ones(2), n, 0, g)),
    "isend-dst_negative": ("dst", lambda o, g, n: o.isend(torch.ones(2), -1, 0, g)),
    "irecv-src_is_group_size": ("src", lambda o, g, n: o.irecv(torch.ones(2), n, 0, g)),
    "isend-meta_tensor": ("tensor", lambda o, g, n: o.isend(
        torch.ones(2, device="meta"), 1, 0, g)),
    "batch-unknown_op": ("op_list[1]", lambda o, g, n: o.batch_p2p_ops(
        ["isend", "send"], [1, 1], [0, 0], [torch.ones(2), torch.ones(2)], g)),
    "batch-peer_list_too_long": ("peer_list", lambda o, g, n: o.batch_p2p_ops(
        ["isend"], [1, 1], [0], [torch.ones(2)], g)),
    "batch-tag_list_too_short": ("tag_list", lambda o, g, n: o.batch_p2p_ops(
        ["isend", "irecv"], [1, 1], [0], [torch.ones(2), torch.ones(2)], g)),
    "batch-peer_is_group_size": ("peer_list[1]", lambda o, g, n: o.batch_p2p_ops(
        ["isend", "irecv"], [1, n], [0, 0], [torch.ones(2), torch.ones(2)], g)),
}


def _refusals(spec):
    """name -> (eager outcome, traced outcome) on group rank 0 of [0, 1]; each outcome
    (exception type, message) or ('no error', '')."""
    ops = funcol_api(spec).ops
    group, name = _group([0, 1])
    if group.rank() != 0:
        return None  # its peer never comes: a call not refused cannot complete

    def outcome(fn):
        try:
            fn()
        except Exception as exc:
            return type(exc).__name__, str(exc)
        return "no error", ""

    found = {}
    for bad, (_, call) in BAD_P2P.items():
        eager = outcome(lambda c=call: c(ops, name, 2))
        traced = None if bad in EAGER_ONLY else outcome(
            lambda c=call: make_fx(lambda: c(ops, name, 2), tracing_mode="fake")())
        found[bad] = (eager, traced)
    return found


@pytest.mark.spec("FC-53")
def test_bad_point_to_point_arguments_are_refused_before_communicating(backend):
    """On group rank 0 of [0, 1] (its peer never comes): each bad call raises in eager and
    under make_fx's fake tracing, naming its argument, before anything is sent."""
    _require_p2p(backend)
    # refimpl answers in a second; a call not refused may never return (upstream finding 21)
    found = run(backend, _refusals, 2, timeout=30, restart_after=True)[0]
    for bad, (eager, traced) in found.items():
        argument = BAD_P2P[bad][0]
        for when, outcome in (("eager", eager), ("at trace time", traced)):
            if outcome is None:
                continue  # EAGER_ONLY
            exc_type, message = outcome
            assert exc_type != "no error" and argument in message, \
                f"{bad}, {when}: {exc_type}: {message}"


# ---- FC-53 with FC-28's check: a pair that does not match ------------------------------
# name -> (what the error names besides the peer, global rank 1's call, global rank 2's
# call), each a call on (ops, group name) in the group [1, 2] (group rank 0 is global
# rank 1); None: the rank issues nothing.
MISMATCHED_PAIRS = {
    "tag": ("tag", lambda o, g: o.isend(torch.ones(2, 3), 1, 7, g),
            lambda o, g: o.irecv(torch.ones(2, 3), 0, 8, g)),
    "dtype": ("dtype", lambda o, g: o.isend(torch.ones(2, 3), 1, 0, g),
              lambda o, g: o.irecv(torch.ones(2, 3, dtype=torch.int32), 0, 0, g)),
    "shape": ("shape", lambda o, g: o.batch_p2p_ops(["isend"], [1], [0], [torch.ones(2, 3)],
                                                    g)[0],
              lambda o, g: o.irecv(torch.ones(3, 2), 0, 0, g)),
    "no_receive": ("", lambda o, g: o.isend(torch.ones(2, 3), 1, 0, g), None),
}


def _mismatched_pair(spec, name):
    """The outcome of this rank's wait in the pair `name` on the group [1, 2] of 3 ranks
    (made to time out in 5 s), with refimpl's check timing out in 2 s: (exception type,
    message, seconds) or None for a rank that issues nothing."""
    import time

    os.environ["REFIMPL_CHECK_TIMEOUT_S"] = "2"
    ops = funcol_api(spec).ops
    dist.barrier()  # the group's 5 s do not count the imports of a fresh rank
    made = _group([1, 2], timeout_s=5)
    if made is None:
        return None
    group, group_name = made
    call = MISMATCHED_PAIRS[name][1 + group.rank()]
    if call is None:
        return None
    start = time.monotonic()
    try:
        ops.wait_tensor(waited(call(ops, group_name)))
        outcome = ("no error", "")
    except Exception as exc:
        outcome = (type(exc).__name__, str(exc))
    return (*outcome, time.monotonic() - start)


@pytest.mark.spec("FC-53", "FC-28")
@pytest.mark.parametrize("name", list(MISMATCHED_PAIRS))
def test_a_pair_that_does_not_match_is_named_on_both_ranks(backend, name):
    """Global ranks 1 and 2 (group ranks 0 and 1 of [1, 2]) issue a send and a receive
    that do not match (tags, dtypes or shapes differ; or no receive at all): each rank
    that issued one raises at its wait, naming what differs and its peer by its global
    rank, within the check's time, never a hang."""
    _require_p2p(backend)
    what = MISMATCHED_PAIRS[name][0]
    outcomes = run(backend, _mismatched_pair, 3, name, timeout=60, restart_after=True)
    for rank, peer in ((1, 2), (2, 1)):
        if outcomes[rank] is None:
            continue  # issued nothing
        exc_type, message, seconds = outcomes[rank]
        where = f"global rank {rank}, {name}"
        assert exc_type != "no error", f"{where}: the wait returned"
        assert f"rank {peer}" in message and what in message, f"{where}: {exc_type}: {message}"
        assert seconds < 10, f"{where}: raised after {seconds:.1f} s"
