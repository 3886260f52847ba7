"""Traced graphs of refimpl's Python API beyond the shared conformance goldens (FC-12, FC-23).

The forward goldens of make_fx and torch.compile live in
conformance/cases/test_functional_collectives.py; here: every group form traces to the
same graph, and the compiled backward graph (with its gradient collectives) is pinned.
"""

from __future__ import annotations

import expecttest
import torch
import torch.distributed as dist

import refimpl.functional_collectives as fc
from conformance.canonical import canonical_graph
from conformance.cases.test_functional_collectives import program
from conformance.funcol_cases import recording_aot_backend
from refimpl.multiprocess import run_on_ranks


def _make_fx_text(group):
    from torch.fx.experimental.proxy_tensor import make_fx

    gm = make_fx(lambda x: program(fc, x, group))(torch.ones(4, 4))
    return canonical_graph(gm)


def _every_form_traces_alike():
    forms = [dist.group.WORLD, "0", [1, 0], [[0, 1]]]
    return [_make_fx_text(g) for g in forms]


def _compiled_backward_text():
    torch._dynamo.reset()
    graphs = []
    compiled = torch.compile(lambda x: program(fc, x, dist.group.WORLD), fullgraph=True,
                             backend=recording_aot_backend(graphs))
    x = (torch.arange(16.0).view(4, 4) + dist.get_rank()).requires_grad_()
    # FC-5: no refimpl op's result aliases its input, so AOTAutograd's check passes in
    # its strict form (the form CI=1 selects; torch before 2.13 may not have the check).
    strict = ({"error_on_custom_op_aliasing": True}
              if hasattr(torch._functorch.config, "error_on_custom_op_aliasing") else {})
    with torch._functorch.config.patch(**strict):
        compiled(x).sum().backward()
    x_eager = x.detach().clone().requires_grad_()
    program(fc, x_eager, dist.group.WORLD).sum().backward()
    return canonical_graph(graphs[-1]), torch.equal(x.grad, x_eager.grad), \
        fc.work_registry_size()


class TestTracing(expecttest.TestCase):
    def test_every_group_form_traces_to_the_same_graph(self):
        """FC-12, FC-13..FC-15: the group is a trace-time constant, whatever its form."""
        for texts in run_on_ranks(_every_form_traces_alike, 2):
            self.assertEqual(len(set(texts)), 1, texts)
            self.assertIn("ranks[0,1]", texts[0])

    def test_compiled_backward_runs_the_gradient_collectives(self):
        """FC-23, FC-5: compiled gradients equal eager ones under AOTAutograd's strict
        aliasing check; the backward graph holds their ops."""
        results = run_on_ranks(_compiled_backward_text, 2)
        for _, grads_equal, pending in results:
            self.assertTrue(grads_equal)
            self.assertEqual(pending, 0)
        # Rank 0's graph: broadcast's gradient goes to src alone, so ranks differ.
        self.assertExpectedInline(results[0][0], """\
%0 = input : f32[4, 8]
%1 = input : f32[4, 8]
%2 = aten.detach(%0) : f32[4, 8]
%3 = aten.threshold_backward(%1, %2, 0) : f32[4, 8]
%4 = aten.slice.Tensor(%3, 1, 0, 4) : f32[4, 4]
%5 = aten.slice.Tensor(%3, 1, 4, 8) : f32[4, 4]
%6 = aten.cat([%4, %5]) : f32[8, 4]
%7 = funcol.reduce_scatter_tensor(%6, 'sum', 2, ranks[0,1]) : f32[4, 4]
%8 = funcol.wait_tensor(%7) : f32[4, 4]
%9 = funcol.all_reduce(%8, 'sum', ranks[0,1]) : f32[4, 4]
%10 = funcol.wait_tensor(%9) : f32[4, 4]
%11 = funcol.all_to_all_single(%10, [2, 2], [2, 2], ranks[0,1]) : f32[4, 4]
%12 = funcol.wait_tensor(%11) : f32[4, 4]
%13 = funcol.all_gather_into_tensor(%12, 2, ranks[0,1]) : f32[8, 4]
%14 = funcol.wait_tensor(%13) : f32[8, 4]
%15 = aten.div.Tensor(%14, 2) : f32[8, 4]
%16 = funcol.reduce_scatter_tensor(%15, 'sum', 2, ranks[0,1]) : f32[4, 4]
%17 = funcol.wait_tensor(%16) : f32[4, 4]
%18 = aten.mul.Tensor(%17, 2) : f32[4, 4]
%19 = funcol.all_reduce(%18, 'sum', ranks[0,1]) : f32[4, 4]
%20 = funcol.wait_tensor(%19) : f32[4, 4]
return [%20]""")


def test_group_lookups_carry_the_mark_torch_compiler_sets_without_importing_dynamo():
    """The group lookups are marked constant as `torch.compiler.assume_constant_result`
    marks a function (so compiled graphs bake the group name in), and importing refimpl
    does not import torch._dynamo (1.4 s of CPU in every rank worker)."""
    import subprocess
    import sys

    def reference():
        pass

    torch.compiler.assume_constant_result(reference)
    for lookup in (fc._resolve_group_name_constant, fc.group_size):
        marks = {k: v for k, v in vars(lookup).items() if k.startswith("_dynamo")}
        assert marks == {k: v for k, v in vars(reference).items()}, (lookup, marks)
    probe = ("import sys, refimpl.functional_collectives, refimpl.symmetric_memory, "
             "refimpl.multiprocess; print('torch._dynamo' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         check=True, timeout=120).stdout.strip()
    assert out == "False"
