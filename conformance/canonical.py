"""Canonical text for the goldens, and the judge's own reading of op namespaces.

The canonical text of a graph (SPEC CF-5) is refimpl's output format (its compile
backend writes it, E2E-5): `refimpl/canonical.py` defines it, and this module re-exports
it for the cases. What the judge *decides* from an op's namespace (is it a functional
collective? a symmetric-memory kernel?) it reads with its own tuples and its own
`op_name`, never refimpl's catalogue (refimpl/comm_ops.py): a judge that read the
implementation's tables could not fail them (conformance/README.md, "Who owns which").
"""

from __future__ import annotations

from refimpl.canonical import canonical_graph, folded_op_name, group_label, tensor_label

__all__ = ["canonical_graph", "group_label", "tensor_label", "op_name",
           "COLLECTIVE_NAMESPACES", "SYMM_MEM_NAMESPACES"]

# Namespaces of functional collectives (refimpl's, upstream's and its autograd wrappers),
# and of symmetric-memory ops, as the judge reads them.
COLLECTIVE_NAMESPACES = ("refimpl_c10d", "_c10d_functional", "_c10d_functional_autograd")
SYMM_MEM_NAMESPACES = ("refimpl_symm_mem", "symm_mem")


def op_name(target) -> str:
    """`funcol.all_reduce` for any backend's collective, `aten.add.Tensor` for the rest
    (the names canonical text prints, folded by the judge's own namespaces)."""
    return folded_op_name(target, COLLECTIVE_NAMESPACES, SYMM_MEM_NAMESPACES)
