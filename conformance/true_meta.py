"""Does a graph's `meta["val"]` say what its nodes compute? Checked by running it.

Passes after the one under test (reorder, memory planning, lowering) read sizes, dtypes
and strides from `meta["val"]`, not from a run: a pass that writes a wrong one passes
every value check and misleads the next pass. `MetaChecker` runs a graph on real
tensors and notes each node whose result's dtype, shape or strides (over dims of size
above 1: a dim of size 1 is never stepped over) differ from its `meta["val"]`, or that
has none. SPEC.md BK-7, CL-1, RO-1.
"""

from __future__ import annotations

import torch
import torch.fx


def layout(t: torch.Tensor) -> tuple:
    strides = tuple(st for st, n in zip(t.stride(), t.shape, strict=True) if n > 1)
    return t.dtype, tuple(t.shape), strides


def layout_text(t: torch.Tensor) -> str:
    return f"{t.dtype}{list(t.shape)} strides {list(t.stride())}"


class MetaChecker(torch.fx.Interpreter):
    """Runs a graph; `untrue` lists the nodes whose meta val is not what they computed."""

    def __init__(self, gm: torch.fx.GraphModule):
        super().__init__(gm)
        self.untrue: list[str] = []

    def run_node(self, node):
        result = super().run_node(node)
        if isinstance(result, torch.Tensor) and node.op != "output":
            val = node.meta.get("val")
            if not isinstance(val, torch.Tensor):
                self.untrue.append(f"{node.name}: no meta val, computed {layout_text(result)}")
            elif layout(val) != layout(result):
                self.untrue.append(f"{node.name}: meta val {layout_text(val)}, computed "
                                   f"{layout_text(result)}")
        return result

    def call(self, *args):
        """The graph's result for `args`, as calling the GraphModule gives it (through its
        code generator: a pytree one takes and returns structures), meta checked."""
        codegen = self.module.graph._codegen
        return codegen.process_outputs(self.run(*codegen.process_inputs(*args)))

    def report(self) -> str:
        return "; ".join(self.untrue)
