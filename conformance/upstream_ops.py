"""torch 2.15's `_c10d_functional.wait_tensors`, for the cases, on every release.

torch 2.15 traces the wait of a coalesced collective as one node,
`_c10d_functional.wait_tensors(Tensor[] tensors) -> Tensor[]`, which waits for every tensor
of the list and returns them (FC-35). The cases that carry such a graph through each stage
(comm trace, lowering, bucketing, reorder, memory, simulator) must run on every release
the package admits, and releases before 2.15 have no such op. `wait_tensors()` gives the
running torch's own op where it has one; before 2.15 it defines a stand-in in the same
namespace, with 2.15's schema and behaviour (eager: upstream's `wait_tensor` of each
tensor, returning them; fake: the tensors themselves, as 2.15's meta kernel; a side
effect, so FX keeps it), so the graphs the cases build are the graphs 2.15 traces.

A backend's passes on a release before 2.15 meet the stand-in as they would meet 2.15's
op: upstream's own passes of those releases do not know it, which their entries in
`conformance/expected_failures/torch.txt` say (`[torch<2.15]`).
"""

from __future__ import annotations

import torch

__all__ = ["wait_tensors", "is_stand_in"]

_stand_in = []  # the Library holding the stand-in, kept alive, once defined


def is_stand_in() -> bool:
    """True when this process runs the stand-in rather than torch's own op."""
    return bool(_stand_in)


def wait_tensors():
    """The `_c10d_functional.wait_tensors` op packet: torch's, or the stand-in."""
    import torch.distributed._functional_collectives  # noqa: F401  (registers the namespace)

    ops = torch.ops._c10d_functional
    if not _stand_in and not _has(ops, "wait_tensors"):
        _define_stand_in()
    return ops.wait_tensors


def _has(namespace, name: str) -> bool:
    try:
        getattr(namespace, name)
    except AttributeError:
        return False
    return True


def _wait_each(tensors):
    if not tensors:
        raise RuntimeError("wait_tensors requires at least one tensor")
    return [torch.ops._c10d_functional.wait_tensor(t) for t in tensors]


def _the_tensors(tensors):
    torch._check(len(tensors) > 0, lambda: "wait_tensors requires at least one tensor")
    return list(tensors)


def _define_stand_in() -> None:
    library = torch.library.Library("_c10d_functional", "FRAGMENT")
    library.define("wait_tensors(Tensor[] tensors) -> Tensor[]")
    library.impl("wait_tensors", _wait_each, "CompositeExplicitAutograd")
    library.impl("wait_tensors", _the_tensors, "Meta")
    _stand_in.append(library)
    op = torch.ops._c10d_functional.wait_tensors
    torch.fx.node.has_side_effect(op.default)
    torch.fx.node.has_side_effect(op)
