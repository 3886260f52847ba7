"""Traced graphs of the Python API: each collective followed by its wait (FC-3, FC-12).

Graphs are traced on real gloo ranks (tracing does not communicate) and printed in
canonical form, so the goldens hold no group names, node names or other run-varying text.
"""

from __future__ import annotations

import expecttest
import torch
import torch.distributed as dist

import refimpl.functional_collectives as fc
from conformance.canonical import canonical_graph
from refimpl.multiprocess import run_on_ranks


def program(x, group):
    a = fc.all_reduce(x, "sum", group)
    b = fc.all_gather_tensor(a * 2, 1, group)
    c = fc.reduce_scatter_tensor(b, "avg", 1, group)
    d = fc.all_to_all_single(c, None, None, group)
    e = fc.broadcast(d, 0, group)
    return e.relu()


def _make_fx_graph(group_form):
    from torch.fx.experimental.proxy_tensor import make_fx

    group = dist.group.WORLD if group_form == "world" else [0, 1]
    gm = make_fx(lambda x: program(x, group))(torch.ones(4, 4))
    return canonical_graph(gm)


def _recording_backend(graphs):
    from torch._dynamo.backends.common import aot_autograd

    def record(gm, example_inputs):
        graphs.append(gm)
        return gm

    return aot_autograd(fw_compiler=record, bw_compiler=record)


def _compiled_graph_and_grads():
    torch._dynamo.reset()
    graphs = []
    compiled = torch.compile(lambda x: program(x, dist.group.WORLD), fullgraph=True,
                             backend=_recording_backend(graphs))
    x = (torch.arange(16.0).view(4, 4) + dist.get_rank()).requires_grad_()
    compiled(x).sum().backward()
    x_eager = x.detach().clone().requires_grad_()
    program(x_eager, dist.group.WORLD).sum().backward()
    return ([canonical_graph(g) for g in graphs], torch.equal(x.grad, x_eager.grad),
            fc.work_registry_size())


class TestTracing(expecttest.TestCase):
    def test_make_fx_emits_op_then_wait(self):
        """FC-3, FC-12: ops and their waits, shapes from the fake kernels."""
        world, ranks = run_on_ranks(_make_fx_graph, 2, "world")[0], \
            run_on_ranks(_make_fx_graph, 2, "ranks")
        self.assertEqual(ranks[0], ranks[1])
        self.assertEqual(world, ranks[0], "a rank list and the world group trace alike")
        self.assertExpectedInline(world, """\
%0 = input : f32[4, 4]
%1 = funcol.all_reduce(%0, 'sum', ranks[0,1]) : f32[4, 4]
%2 = funcol.wait_tensor(%1) : f32[4, 4]
%3 = aten.mul.Tensor(%2, 2) : f32[4, 4]
%4 = funcol.all_gather_into_tensor(%3, 2, ranks[0,1]) : f32[8, 4]
%5 = funcol.wait_tensor(%4) : f32[8, 4]
%6 = aten.split.Tensor(%5, 4) : (f32[4, 4], f32[4, 4])
%7 = getitem(%6, 0) : f32[4, 4]
%8 = getitem(%6, 1) : f32[4, 4]
%9 = aten.cat([%7, %8], 1) : f32[4, 8]
%10 = aten.split.Tensor(%9, 4, 1) : (f32[4, 4], f32[4, 4])
%11 = getitem(%10, 0) : f32[4, 4]
%12 = getitem(%10, 1) : f32[4, 4]
%13 = aten.cat([%11, %12]) : f32[8, 4]
%14 = funcol.reduce_scatter_tensor(%13, 'avg', 2, ranks[0,1]) : f32[4, 4]
%15 = funcol.wait_tensor(%14) : f32[4, 4]
%16 = funcol.all_to_all_single(%15, [2, 2], [2, 2], ranks[0,1]) : f32[4, 4]
%17 = funcol.wait_tensor(%16) : f32[4, 4]
%18 = funcol.broadcast(%17, 0, ranks[0,1]) : f32[4, 4]
%19 = funcol.wait_tensor(%18) : f32[4, 4]
%20 = aten.relu(%19) : f32[4, 4]
return %20""")

    def test_torch_compile_fullgraph_traces_and_differentiates(self):
        """FC-12, FC-23: fullgraph compile; compiled gradients equal eager ones."""
        results = run_on_ranks(_compiled_graph_and_grads, 2)
        for _graphs, grads_equal, pending in results:
            self.assertTrue(grads_equal)
            self.assertEqual(pending, 0)
        # Forward graphs are identical on every rank; backward graphs are not, since
        # broadcast's gradient goes to src alone (rank 0's is the golden).
        self.assertEqual(results[0][0][0], results[1][0][0])
        forward, backward = results[0][0]
        self.assertExpectedInline(forward, """\
%0 = input : f32[4, 4]
%1 = funcol.all_reduce(%0, 'sum', ranks[0,1]) : f32[4, 4]
%2 = funcol.wait_tensor(%1) : f32[4, 4]
%3 = aten.mul.Tensor(%2, 2) : f32[4, 4]
%4 = funcol.all_gather_into_tensor(%3, 2, ranks[0,1]) : f32[8, 4]
%5 = funcol.wait_tensor(%4) : f32[8, 4]
%6 = aten.split.Tensor(%5, 4) : (f32[4, 4], f32[4, 4])
%7 = getitem(%6, 0) : f32[4, 4]
%8 = getitem(%6, 1) : f32[4, 4]
%9 = aten.cat([%7, %8], 1) : f32[4, 8]
%10 = aten.split.Tensor(%9, 4, 1) : (f32[4, 4], f32[4, 4])
%11 = getitem(%10, 0) : f32[4, 4]
%12 = getitem(%10, 1) : f32[4, 4]
%13 = aten.cat([%11, %12]) : f32[8, 4]
%14 = funcol.reduce_scatter_tensor(%13, 'avg', 2, ranks[0,1]) : f32[4, 4]
%15 = funcol.wait_tensor(%14) : f32[4, 4]
%16 = funcol.all_to_all_single(%15, [2, 2], [2, 2], ranks[0,1]) : f32[4, 4]
%17 = funcol.wait_tensor(%16) : f32[4, 4]
%18 = funcol.broadcast(%17, 0, ranks[0,1]) : f32[4, 4]
%19 = funcol.wait_tensor(%18) : f32[4, 4]
%20 = aten.relu(%19) : f32[4, 4]
%21 = aten.detach(%20) : f32[4, 4]
return [%20, %21]""")
        self.assertExpectedInline(backward, """\
%0 = input : f32[4, 4]
%1 = input : f32[4, 4]
%2 = aten.detach(%0) : f32[4, 4]
%3 = aten.threshold_backward(%1, %2, 0) : f32[4, 4]
%4 = funcol.all_reduce(%3, 'sum', ranks[0,1]) : f32[4, 4]
%5 = funcol.wait_tensor(%4) : f32[4, 4]
%6 = funcol.all_to_all_single(%5, [2, 2], [2, 2], ranks[0,1]) : f32[4, 4]
%7 = funcol.wait_tensor(%6) : f32[4, 4]
%8 = funcol.all_gather_into_tensor(%7, 2, ranks[0,1]) : f32[8, 4]
%9 = funcol.wait_tensor(%8) : f32[8, 4]
%10 = aten.div.Tensor(%9, 2) : f32[8, 4]
%11 = aten.slice.Tensor(%10, 0, 0, 4) : f32[4, 4]
%12 = aten.slice.Tensor(%10, 0, 4, 8) : f32[4, 4]
%13 = aten.cat([%11, %12], 1) : f32[4, 8]
%14 = aten.slice.Tensor(%13, 1, 0, 4) : f32[4, 4]
%15 = aten.slice.Tensor(%13, 1, 4, 8) : f32[4, 4]
%16 = aten.cat([%14, %15]) : f32[8, 4]
%17 = funcol.reduce_scatter_tensor(%16, 'sum', 2, ranks[0,1]) : f32[4, 4]
%18 = funcol.wait_tensor(%17) : f32[4, 4]
%19 = aten.mul.Tensor(%18, 2) : f32[4, 4]
%20 = funcol.all_reduce(%19, 'sum', ranks[0,1]) : f32[4, 4]
%21 = funcol.wait_tensor(%20) : f32[4, 4]
return [%21]""")
