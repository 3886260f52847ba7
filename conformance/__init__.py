"""The conformance suite: runs SPEC.md's cases against any backend (see conformance/README.md)."""

from conformance.upstream_ops import wait_tensors as _wait_tensors

# torch 2.15's `_c10d_functional.wait_tensors` exists in every process of the suite, as it
# does on 2.15, before any backend is imported: a pass that reads the ops of a namespace
# when it is imported (as refimpl's do) sees it on every release (conformance/upstream_ops.py).
_wait_tensors()
