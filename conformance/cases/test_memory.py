"""Conformance section "memory" (SPEC.md section 5, MEM).

Each case plans one program of conformance/memory_programs.py with the backend's
`plan_memory` and compares, against an inline golden, every alloc / free event (the
buffer named by the node that allocates it, its bytes) and the live bytes after each
node, which the case sums from the events itself; the backend's `peak_bytes` must equal
that high-water mark. The goldens were derived by hand from the rules they name (the
comment above each says how). Graphs are traced on a fake process group of 2.

`test_plan_matches_a_real_run` is the independent check of the rules against reality:
on 2 gloo ranks it runs every program, traced with the backend's own ops, node by node,
watches every storage (conformance/memory_programs.py's `measure_run`, which shares no
code with refimpl), and requires the measured allocations and frees to be the planned
ones at the same nodes.
"""

from __future__ import annotations

import pytest
import torch
from expecttest import assert_expected_inline
from torch.fx.experimental.proxy_tensor import make_fx

from conformance import harness
from conformance import memory_programs as mp


@pytest.fixture
def fake_world():
    """A fake process group of 2 in this process for tracing."""
    with mp.fake_world(2):
        yield


def plan_text(backend, gm, order=None) -> str:
    ns = backend.require("memory", "plan_memory")
    plan = ns.plan_memory(gm, order) if order is not None else ns.plan_memory(gm)
    text = mp.memory_text(gm, plan)
    high, at = text.rsplit("high-water ", 1)[1].split(" at ")
    assert plan.peak_bytes == int(high), f"peak_bytes {plan.peak_bytes} != high-water {high}"
    peak_node = mp.node_labels(gm)[plan.peak_node].split()[0] if plan.peak_node else "-"
    assert peak_node == at, f"peak_node {peak_node}, the first node at the high-water is {at}"
    assert list(plan.live_bytes) == mp.live_after_each_node(plan), (
        "live_bytes is not the running sum of the plan's events after each node of its order")
    return text


# Inputs are counted from the start and never freed (MEM-6). The gather's input is held
# until its wait (MEM-5); refimpl's wait copies (MEM-4): +96. The copy-outs are views
# plus clones; the gathered buffer dies at its last alias's last use (MEM-3), the clone
# that feeds `w2 * 2`; outputs stay (MEM-7).
@pytest.mark.spec("MEM-1", "MEM-3", "MEM-4", "MEM-5", "MEM-6", "MEM-7", "MEM-9")
def test_all_gather_copy_out(backend, fake_world):
    gm = mp.traced("all_gather_copy_out")
    assert_expected_inline(plan_text(backend, gm), """\
%0 input                           +48 %0                       live 48
%1 funcol.all_gather_into_tensor   +96 %1                       live 144
%2 funcol.wait_tensor              +96 %2 -96 %1                live 144
%5 aten.clone                      +64 %5                       live 208
%7 aten.clone                      +32 %7 -96 %2                live 144
%8 aten.mul.Tensor                 +64 %8 -64 %5                live 144
%9 aten.mul.Tensor                 +32 %9 -32 %7                live 144
high-water 240 at %2""")


# The pad is a new buffer (64 B), held by the reduce_scatter until its wait (MEM-5); the
# result is copied by the wait; the output is a view of the copy (MEM-2, MEM-7).
@pytest.mark.spec("MEM-2", "MEM-4", "MEM-5", "MEM-7")
def test_reduce_scatter_with_padding(backend, fake_world):
    gm = mp.traced("reduce_scatter_padded")
    assert_expected_inline(plan_text(backend, gm), """\
%0 input                           +48 %0                       live 48
%1 aten.constant_pad_nd            +64 %1                       live 112
%2 funcol.reduce_scatter_tensor    +32 %2                       live 144
%3 funcol.wait_tensor              +32 %3 -32 %2 -64 %1         live 80
%5 aten.mul.Tensor                 +32 %5 -32 %3                live 80
high-water 176 at %3""")


# all_reduce_ renames its argument (MEM-2): no allocation; the wait's copy is read by
# nobody, so it is allocated and freed at the wait (MEM-9); `y + 1` reads y after the
# wait, so y lives until then.
@pytest.mark.spec("MEM-2", "MEM-3", "MEM-4", "MEM-9")
def test_all_reduce_in_place_on_an_intermediate(backend, fake_world):
    gm = mp.traced("all_reduce_inplace")
    assert_expected_inline(plan_text(backend, gm), """\
%0 input                           +16 %0                       live 16
%1 aten.mul.Tensor                 +16 %1                       live 32
%3 funcol.wait_tensor              +16 %3 -16 %3                live 32
%4 aten.add.Tensor                 +16 %4 -16 %1                live 32
high-water 48 at %3""")


# Two non-overlapping views of one buffer, both mutated (the seed's case): one buffer of
# 32 B, counted once, freed after the last use of its last alias (MEM-2, MEM-3).
@pytest.mark.spec("MEM-2", "MEM-3")
def test_mutated_views_of_one_buffer(backend, fake_world):
    gm = mp.traced("mutated_views")
    assert_expected_inline(plan_text(backend, gm), """\
%0 input                           +32 %0                       live 32
%1 aten.mul.Tensor                 +32 %1                       live 64
%6 funcol.wait_tensor              +16 %6 -16 %6                live 64
%7 aten.mul.Tensor                 +16 %7 -32 %1                live 48
high-water 80 at %6""")


# The gathered buffer is read after the wait: it lives until `sum`, not until the wait.
@pytest.mark.spec("MEM-3", "MEM-4", "MEM-5")
def test_wait_input_read_after_the_wait(backend, fake_world):
    gm = mp.traced("read_after_wait")
    assert_expected_inline(plan_text(backend, gm), """\
%0 input                           +16 %0                       live 16
%1 funcol.all_gather_into_tensor   +32 %1                       live 48
%2 funcol.wait_tensor              +32 %2                       live 80
%3 aten.add.Tensor                 +32 %3 -32 %2                live 80
%4 aten.sum                        +4 %4 -32 %1                 live 52
high-water 112 at %3""")


# The input is mutated and returned, also as a view: one input buffer, never freed,
# never counted twice (MEM-6, MEM-7). The out-of-place all_reduce copies at issue.
@pytest.mark.spec("MEM-2", "MEM-6", "MEM-7")
def test_output_aliases_an_input(backend, fake_world):
    gm = mp.traced("output_aliases_input")
    assert_expected_inline(plan_text(backend, gm), """\
%0 input                           +16 %0                       live 16
%3 funcol.all_reduce               +16 %3                       live 32
%4 funcol.wait_tensor              +16 %4 -16 %3                live 32
high-water 48 at %4""")


# `mul.out` renames `out` (a keyword argument), and so does its view `t`: the empty
# buffer lives until the all_reduce, which copies at issue (MEM-2, MEM-3). Every node
# whose value lives in a buffer is one of its aliases, the allocating node first (MEM-1).
@pytest.mark.spec("MEM-1", "MEM-2", "MEM-3")
def test_an_out_variant_renames_its_out_argument(backend, fake_world):
    gm = mp.traced("out_variant")
    assert_expected_inline(plan_text(backend, gm), """\
%0 input                           +48 %0                       live 48
%1 aten.empty.memory_format        +48 %1                       live 96
%4 funcol.all_reduce               +48 %4 -48 %1                live 96
%5 funcol.wait_tensor              +48 %5 -48 %4                live 96
%6 aten.sum                        +4 %6                        live 100
%7 aten.add.Tensor                 +48 %7 -48 %5 -4 %6          live 96
high-water 148 at %7""")
    ns = backend.require("memory", "plan_memory")
    for name, want in (("out_variant", {"%0": ["%0"], "%1": ["%1", "%2", "%3"]}),
                       ("output_aliases_input", {"%0": ["%0", "%1", "%2"]})):
        graph = mp.traced(name)
        labels = {node: label.split()[0] for node, label in mp.node_labels(graph).items()}
        aliases = {labels[b.alloc_node]: [labels[a] for a in b.aliases]
                   for b in ns.plan_memory(graph).buffers}
        assert {k: aliases[k] for k in want} == want, (name, aliases)


# Traced with symbolic sizes, x of 6 f32 in the example: every byte size is a symbol's
# expression, counted as its value there (MEM-1): x 24, its first half `x[:3] * 2` 12, the
# sum 4. The size arithmetic (sym_size, floordiv) and the slice allocate nothing.
@pytest.mark.spec("MEM-1")
def test_symbolic_sizes_count_as_in_the_example(backend, fake_world):
    gm = mp.traced("symbolic_halves", tracing_mode="symbolic")
    assert_expected_inline(plan_text(backend, gm), """\
%0 input                           +24 %0                       live 24
%4 aten.mul.Tensor                 +12 %4                       live 36
%5 funcol.all_reduce               +12 %5 -12 %4                live 36
%6 funcol.wait_tensor              +12 %6 -12 %5                live 36
%7 aten.sum                        +4 %7                        live 40
%8 aten.add.Tensor                 +12 %8 -12 %6 -4 %7          live 36
high-water 52 at %8""")


# Per member of a coalesced all_gather, its input is held until its own wait (MEM-5).
@pytest.mark.spec("MEM-5")
def test_coalesced_members_are_held_until_their_own_wait(backend, fake_world):
    gm = mp.traced("coalesced_members")
    assert_expected_inline(plan_text(backend, gm), """\
%0 input                           +8 %0                        live 8
%1 input                           +12 %1                       live 20
%2 aten.mul.Tensor                 +8 %2                        live 28
%3 aten.mul.Tensor                 +12 %3                       live 40
%4 funcol.all_gather_into_tensor_coalesced +16 %4 +24 %4                live 80
%7 funcol.wait_tensor              +16 %7 -16 %4 -8 %2          live 72
%8 aten.add.Tensor                 +16 %8 -16 %7                live 72
%9 funcol.wait_tensor              +24 %9 -24 %4 -12 %3         live 60
%10 aten.add.Tensor                +24 %10 -24 %9               live 60
high-water 96 at %7""")


# The coalesced reduce_scatter as the gather: member i's input is held until result i's
# wait, though gloo copied it at issue (MEM-5, FC-36).
@pytest.mark.spec("MEM-5", "FC-36")
def test_coalesced_reduce_scatter_members_are_held_until_their_own_wait(backend, fake_world):
    gm = mp.traced("reduce_scatter_coalesced_members")
    assert_expected_inline(plan_text(backend, gm), """\
%0 input                           +16 %0                       live 16
%1 input                           +24 %1                       live 40
%2 aten.mul.Tensor                 +16 %2                       live 56
%3 aten.mul.Tensor                 +24 %3                       live 80
%4 funcol.reduce_scatter_tensor_coalesced +8 %4 +12 %4                 live 100
%7 funcol.wait_tensor              +8 %7 -8 %4 -16 %2           live 84
%8 aten.add.Tensor                 +8 %8 -8 %7                  live 84
%9 funcol.wait_tensor              +12 %9 -12 %4 -24 %3         live 60
%10 aten.add.Tensor                +12 %10 -12 %9               live 60
high-water 108 at %7""")


# The out-of-place coalesced all_reduce copies its inputs at issue, as all_reduce does:
# its members' inputs are freed at the op, only their results wait (MEM-5, FC-2).
@pytest.mark.spec("MEM-5", "FC-2")
def test_coalesced_all_reduce_frees_its_inputs_at_issue(backend, fake_world):
    gm = mp.traced("all_reduce_coalesced_members")
    assert_expected_inline(plan_text(backend, gm), """\
%0 input                           +16 %0                       live 16
%1 input                           +24 %1                       live 40
%2 aten.mul.Tensor                 +16 %2                       live 56
%3 aten.mul.Tensor                 +24 %3                       live 80
%4 funcol.all_reduce_coalesced     +16 %4 +24 %4 -16 %2 -24 %3  live 80
%7 funcol.wait_tensor              +16 %7 -16 %4                live 80
%8 aten.add.Tensor                 +16 %8 -16 %7                live 80
%9 funcol.wait_tensor              +24 %9 -24 %4                live 80
%10 aten.add.Tensor                +24 %10 -24 %9               live 80
high-water 120 at %4""")


# torch 2.15's one wait of a coalesced all_gather (`wait_tensors`, FC-35): it completes
# both members, so both inputs are freed there (MEM-5), one wait later for the first
# member than with a wait each (test_coalesced_members_are_held_until_their_own_wait);
# it returns the gathered buffers themselves (a rename, MEM-2: nothing allocated), each
# freed after its own reader (MEM-3).
@pytest.mark.spec("MEM-5", "MEM-2", "FC-35")
def test_a_wait_of_a_list_completes_every_member(backend, fake_world):
    gm = mp.traced("waited_together")
    assert_expected_inline(plan_text(backend, gm), """\
%0 input                           +8 %0                        live 8
%1 input                           +12 %1                       live 20
%2 aten.mul.Tensor                 +8 %2                        live 28
%3 aten.mul.Tensor                 +12 %3                       live 40
%4 funcol.all_gather_into_tensor_coalesced +16 %4 +24 %4                live 80
%7 funcol.wait_tensors             -8 %2 -12 %3                 live 60
%10 aten.add.Tensor                +16 %10 -16 %4               live 60
%11 aten.add.Tensor                +24 %11 -24 %4               live 60
high-water 84 at %11""")


# all_to_all holds its input until the wait; broadcast (out of place) does not (MEM-5).
@pytest.mark.spec("MEM-5")
def test_all_to_all_holds_its_input_broadcast_does_not(backend, fake_world):
    gm = mp.traced("all_to_all_and_broadcast")
    assert_expected_inline(plan_text(backend, gm), """\
%0 input                           +16 %0                       live 16
%1 aten.mul.Tensor                 +16 %1                       live 32
%2 funcol.all_to_all_single        +16 %2                       live 48
%3 funcol.wait_tensor              +16 %3 -16 %2 -16 %1         live 32
%4 aten.add.Tensor                 +16 %4 -16 %3                live 32
%5 funcol.broadcast                +16 %5 -16 %4                live 32
%6 funcol.wait_tensor              +16 %6 -16 %5                live 32
%7 aten.mul.Tensor                 +16 %7 -16 %6                live 32
high-water 64 at %3""")


# Point-to-point ops (FC-52), each rank's pair with the other: isend holds its input
# (%2) and its token of no elements until its wait (MEM-5: inputs); refimpl's irecv holds
# only its result, its argument (%4) is a template freed at the op (FC-53: result); the
# batch holds each member as its op does: the irecv member's template (%9) is freed at
# the batch, the isend member's input (%10) at its token's wait (MEM-5: per member).
@pytest.mark.spec("MEM-5", "FC-52", "FC-53")
def test_point_to_point_ops_hold_what_each_member_sends(backend, fake_world):
    gm = mp.traced("point_to_point")
    assert_expected_inline(plan_text(backend, gm), """\
%0 input                           +16 %0                       live 16
%1 input                           +24 %1                       live 40
%2 aten.mul.Tensor                 +16 %2                       live 56
%3 funcol.isend                    +0 %3                        live 56
%4 aten.empty_like                 +16 %4                       live 72
%5 funcol.irecv                    +16 %5 -16 %4                live 72
%6 funcol.wait_tensor              +16 %6 -16 %5                live 72
%7 aten.add.Tensor                 +16 %7 -16 %6                live 72
%8 funcol.wait_tensor              +0 %8 -0 %8 -0 %3 -16 %2     live 56
%9 aten.empty_like                 +24 %9                       live 80
%10 aten.mul.Tensor                +24 %10                      live 104
%11 funcol.batch_p2p_ops           +24 %11 +0 %11 -24 %9        live 104
%14 funcol.wait_tensor             +24 %14 -24 %11              live 104
%15 aten.add.Tensor                +24 %15 -24 %14              live 104
%16 funcol.wait_tensor             +0 %16 -0 %16 -0 %11 -24 %10 live 80
high-water 128 at %11""")


# A value nobody reads is freed at the node that allocates it (MEM-3, MEM-9).
# Live bytes reach 48 at %2, %3 and %4: `peak_node` is the first of them (MEM-1).
@pytest.mark.spec("MEM-3", "MEM-9", "MEM-1")
def test_dead_value(backend, fake_world):
    gm = mp.traced("dead_value")
    assert_expected_inline(plan_text(backend, gm), """\
%0 input                           +16 %0                       live 16
%1 aten.add.Tensor                 +16 %1                       live 32
%2 aten.mul.Tensor                 +16 %2 -16 %2                live 32
%3 funcol.all_reduce               +16 %3 -16 %1                live 32
%4 funcol.wait_tensor              +16 %4 -16 %3                live 32
high-water 48 at %2""")


# The bucketed FSDP block: one flat bf16 buffer written by the copy-in, gathered with
# all_gather_into_tensor_out into it (a rename, MEM-2), held until the wait (MEM-5).
@pytest.mark.spec("MEM-2", "MEM-4", "MEM-5", "BK-8")
def test_bucketed_fsdp_block(backend, fake_world):
    gm = mp.bucketed_fsdp_block()
    assert_expected_inline(plan_text(backend, gm), """\
%0 input                           +32 %0                       live 32
%1 input                           +48 %1                       live 80
%2 input                           +64 %2                       live 144
%3 aten.empty.memory_format        +80 %3                       live 224
%7 aten.cat                        +80 %7                       live 304
%8 aten.copy_                      -80 %7                       live 224
%10 funcol.wait_tensor             +80 %10 -80 %3               live 224
%15 aten.clone                     +32 %15                      live 256
%17 aten.clone                     +48 %17 -80 %10              live 224
%19 aten._to_copy                  +64 %19 -32 %15              live 256
%20 aten.mm                        +64 %20 -64 %19              live 256
%21 aten._to_copy                  +96 %21 -48 %17              live 304
%22 aten.mm                        +96 %22 -96 %21              live 304
high-water 400 at %22""")


# Lowered one-shot: the comm buffer is allocated, written by the producer's out= (a
# rename) and never freed (MEM-8); the blocking kernel's result is an ordinary buffer.
@pytest.mark.spec("MEM-8", "CL-11")
def test_comm_buffer_is_persistent(backend, fake_world):
    gm = mp.lowered_one_shot()
    assert_expected_inline(plan_text(backend, gm), """\
%0 input                           +16 %0                       live 16
%1 symm_mem.empty_strided_p2p      +16 %1                       live 32
%3 symm_mem.one_shot_all_reduce    +16 %3                       live 48
%4 aten.add.Tensor                 +16 %4 -16 %3                live 48
high-water 64 at %4""")


# The lowered program's waits complete in place (FC-35): no copy, a wait costs nothing.
@pytest.mark.spec("MEM-4", "FC-35", "CL-20")
def test_lowered_wait_costs_no_memory(backend, fake_world):
    gm = mp.lowered_waits()
    assert_expected_inline(plan_text(backend, gm), """\
%0 input                           +48 %0                       live 48
%1 funcol.all_gather_into_tensor   +96 %1                       live 144
%5 aten.clone                      +64 %5                       live 208
%7 aten.clone                      +32 %7 -96 %1                live 144
%8 aten.mul.Tensor                 +64 %8 -64 %5                live 144
%9 aten.mul.Tensor                 +32 %9 -32 %7                live 144
high-water 240 at %7""")


# The same program run for real on 2 gloo ranks: each wait_tensor_ returns its argument
# itself, so the run allocates what the plan says and nothing more (FC-35).
@pytest.mark.spec("FC-35", "MEM-12")
def test_lowered_waits_allocate_nothing_when_run(backend):
    for rank, mismatches in enumerate(harness.run(backend, mp.measure_lowered_waits, 2)):
        assert not mismatches, f"rank {rank}:\n" + "\n".join(mismatches)


# Upstream's wait returns its input (MEM-4): a rename, unlike refimpl's traced wait.
@pytest.mark.spec("MEM-4")
def test_upstream_wait_is_a_rename(backend, fake_world):
    import torch

    gm = mp.traced("all_gather_copy_out", ops=torch.ops._c10d_functional)
    assert_expected_inline(plan_text(backend, gm), """\
%0 input                           +48 %0                       live 48
%1 funcol.all_gather_into_tensor   +96 %1                       live 144
%5 aten.clone                      +64 %5                       live 208
%7 aten.clone                      +32 %7 -96 %1                live 144
%8 aten.mul.Tensor                 +64 %8 -64 %5                live 144
%9 aten.mul.Tensor                 +32 %9 -32 %7                live 144
high-water 240 at %7""")


# Upstream's differentiable wrappers (`_c10d_functional_autograd`) are collectives too:
# the pad stays held until the wait (MEM-5); the wait, upstream's, is a rename (MEM-4).
@pytest.mark.spec("MEM-5", "MEM-4")
def test_upstream_autograd_collective_holds_its_input(backend, fake_world):
    import types

    import torch

    ops = types.SimpleNamespace(
        reduce_scatter_tensor=torch.ops._c10d_functional_autograd.reduce_scatter_tensor,
        wait_tensor=torch.ops._c10d_functional.wait_tensor)
    gm = mp.traced("reduce_scatter_padded", ops=ops)
    assert_expected_inline(plan_text(backend, gm), """\
%0 input                           +48 %0                       live 48
%1 aten.constant_pad_nd            +64 %1                       live 112
%2 funcol.reduce_scatter_tensor    +32 %2                       live 144
%3 funcol.wait_tensor              -64 %1                       live 80
%5 aten.mul.Tensor                 +32 %5 -32 %2                live 80
high-water 144 at %2""")


def _raised_second_gather(gm):
    """two_layers with the second all_gather issued before the first matmul."""
    nodes = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output")]
    second = [n for n in nodes if "all_gather" in str(n.target)][1]
    first_mm = next(n for n in nodes if "mm" in str(n.target))
    rest = [n for n in nodes if n is not second]
    at = rest.index(first_mm)
    return rest[:at] + [second] + rest[at:]


# Program order, then the second gather raised above the first matmul: its input and
# output are in flight across the matmul, which raises the high-water mark (MEM-5, MEM-10).
@pytest.mark.spec("MEM-5", "MEM-10", "MEM-11")
def test_raising_an_all_gather_costs_memory(backend, fake_world):
    import torch

    gm = mp.traced("two_layers", ops=torch.ops._c10d_functional)  # waits are renames
    assert_expected_inline(plan_text(backend, gm), """\
%0 input                           +32 %0                       live 32
%1 input                           +32 %1                       live 64
%2 input                           +32 %2                       live 96
%3 funcol.all_gather_into_tensor   +64 %3                       live 160
%6 aten.mm                         +32 %6 -64 %3                live 128
%7 funcol.all_gather_into_tensor   +64 %7                       live 192
%10 aten.mm                        +32 %10 -32 %6 -64 %7        live 128
high-water 224 at %10""")
    assert_expected_inline(plan_text(backend, gm, _raised_second_gather(gm)), """\
%0 input                           +32 %0                       live 32
%1 input                           +32 %1                       live 64
%2 input                           +32 %2                       live 96
%3 funcol.all_gather_into_tensor   +64 %3                       live 160
%7 funcol.all_gather_into_tensor   +64 %7                       live 224
%6 aten.mm                         +32 %6 -64 %3                live 192
%10 aten.mm                        +32 %10 -32 %6 -64 %7        live 128
high-water 256 at %6""")


# Two gathers write one `out` before its wait: the wait completes both, so each input
# (a, b: 16 B) is held until it, then freed (MEM-5). The buffer `out` is an output.
@pytest.mark.spec("MEM-5")
def test_a_wait_completes_every_collective_in_flight_on_its_buffer(backend, fake_world):
    ops = mp.refimpl_ops()

    def program(x):
        a, b, out = x + 1, x + 2, x.new_empty([8])
        ops.all_gather_into_tensor_out(a, 2, mp.G, out=out)
        ops.all_gather_into_tensor_out(b, 2, mp.G, out=out)
        return ops.wait_tensor_(out)

    gm = make_fx(program, tracing_mode="fake")(torch.ones(4))
    assert_expected_inline(plan_text(backend, gm), """\
%0 input                           +16 %0                       live 16
%1 aten.add.Tensor                 +16 %1                       live 32
%2 aten.add.Tensor                 +16 %2                       live 48
%3 aten.new_empty                  +32 %3                       live 80
%6 funcol.wait_tensor_             -16 %1 -16 %2                live 48
high-water 80 at %3""")


# The output is a view of an intermediate: the intermediate's buffer is the output's, kept
# to the end (MEM-7), whichever alias the output names.
@pytest.mark.spec("MEM-7", "MEM-1")
def test_an_output_that_views_an_intermediate_keeps_its_buffer(backend, fake_world):
    ns = backend.require("memory", "plan_memory")
    gm = make_fx(lambda x: ((x + 1).view(-1), x * 2), tracing_mode="fake")(torch.ones(2, 2))
    assert_expected_inline(plan_text(backend, gm), """\
%0 input                           +16 %0                       live 16
%1 aten.add.Tensor                 +16 %1                       live 32
%3 aten.mul.Tensor                 +16 %3                       live 48
high-water 48 at %3""")
    plan = ns.plan_memory(gm)
    add = next(b for b in plan.buffers if "add" in b.alloc_node.name)
    assert (add.kind, add.free_node) == ("output", None), (add.kind, add.free_node)


class _Scaled(torch.nn.Module):
    """A buffer of the module: traced, a `get_attr` constant."""

    def __init__(self):
        super().__init__()
        self.register_buffer("scale", torch.arange(4.0))

    def forward(self, a, b):
        return (a + b) * self.scale


def _traced_scaled() -> torch.fx.GraphModule:
    """Inputs `a`, `b`: the two halves of one storage of 8 floats (32 B)."""
    base = torch.arange(8.0)
    return make_fx(_Scaled(), tracing_mode="fake", _allow_non_fake_inputs=True)(
        base[:4], base[4:])


# Two inputs that are views of one storage are one buffer of its 32 B; the module's
# buffer, a get_attr, is an input too: counted before the first node, never freed (MEM-2,
# MEM-6). Only the sum is an intermediate.
@pytest.mark.spec("MEM-2", "MEM-6")
def test_a_constant_and_inputs_sharing_a_storage(backend, fake_world):
    gm = _traced_scaled()
    assert_expected_inline(plan_text(backend, gm), """\
%0 input                           +32 %0                       live 32
%3 get_attr                        +16 %3                       live 48
%2 aten.add.Tensor                 +16 %2                       live 64
%4 aten.mul.Tensor                 +16 %4 -16 %2                live 64
high-water 80 at %4""")


# A node that others read but that carries no value cannot be planned: refused naming gm
# and the node, whether it is an input or an op (MEM-1).
@pytest.mark.spec("MEM-1")
@pytest.mark.parametrize("target", ["placeholder", "call_function"])
def test_a_read_node_without_a_value_is_refused_naming_it(backend, fake_world, target):
    ns = backend.require("memory", "plan_memory")
    gm = _traced_scaled()
    node = next(n for n in gm.graph.nodes if n.op == target)
    del node.meta["val"]
    with pytest.raises(ValueError, match=f"gm.*{node.name}|{node.name}.*gm"):
        ns.plan_memory(gm)
    with pytest.raises(TypeError, match="gm"):
        ns.plan_memory(gm.graph)


# A node nobody reads may carry no value (an assertion, a call kept for its effect, as a
# barrier or _assert_scalar): it holds no buffer and the plan goes on (MEM-1).
@pytest.mark.spec("MEM-1")
def test_an_unread_node_without_a_value_holds_no_buffer(backend, fake_world):
    ns = backend.require("memory", "plan_memory")
    gm = _traced_scaled()
    want = ns.plan_memory(gm)
    add = next(n for n in gm.graph.nodes if n.op == "call_function")
    with gm.graph.inserting_after(add):
        unread = gm.graph.call_function(torch.ops.aten._assert_async.msg,
                                        (add, "an assertion, read by nobody"))
    gm.recompile()
    plan = ns.plan_memory(gm)
    assert unread in plan.order
    assert not any(unread in b.aliases for b in plan.buffers)
    assert (plan.peak_bytes, len(plan.buffers)) == (want.peak_bytes, len(want.buffers))


@pytest.mark.spec("MEM-11")
def test_an_invalid_order_is_refused(backend, fake_world):
    ns = backend.require("memory", "plan_memory")
    gm = mp.traced("two_layers")
    nodes = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output")]
    for bad in (list(reversed(nodes)), nodes[:-1], nodes + nodes[-1:]):
        with pytest.raises(ValueError, match="order"):
            ns.plan_memory(gm, bad)


@pytest.mark.spec("MEM-1")
def test_buffer_kinds(backend, fake_world):
    ns = backend.require("memory", "plan_memory")
    for gm, want in [(mp.lowered_one_shot(), ["input", "comm_buffer", "intermediate",
                                              "output"]),
                     (mp.traced("output_aliases_input"), ["input", "intermediate",
                                                          "output"])]:
        plan = ns.plan_memory(gm)
        kinds = [b.kind for b in sorted(plan.buffers, key=lambda b: _index(gm, b.alloc_node))]
        assert kinds == want, kinds


def _index(gm, node):
    return list(gm.graph.nodes).index(node)


@pytest.mark.spec("MEM-3", "MEM-5", "MEM-9", "MEM-12", "FC-36")
def test_plan_matches_a_real_run(backend):
    """On 2 gloo ranks, every program's measured allocations and frees are the planned."""
    results = harness.run(backend, mp.measure_programs, 2, sorted(mp.PROGRAMS))
    for rank, mismatches in enumerate(results):
        assert not mismatches, f"rank {rank}:\n" + "\n".join(mismatches)


@pytest.mark.spec("MEM-12")
def test_lifecycle_verifier(backend):
    """The backend's verifier passes on every plan and refuses one with a free one node
    late or a buffer one byte larger, naming the buffer, and one whose peak is one byte
    more than it measures."""
    backend.require("memory", "plan_memory", "verify_memory_lifecycle")
    results = harness.run(backend, mp.verify_with_backend, 2, sorted(mp.PROGRAMS))
    for rank, problems in enumerate(results):
        assert not problems, f"rank {rank}:\n" + "\n".join(problems)
