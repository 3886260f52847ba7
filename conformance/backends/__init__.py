"""Backends: what the conformance suite runs against.

A backend is an object with a `name` and a `require(concept)` method that returns the
namespace implementing one concept of SPEC.md, or raises `NotImplementedConcept` when
the backend does not implement it (its cases then report "not implemented", never pass).
`get_backend(spec)` takes a registered name (`refimpl`, `torch`) or `package.module:attr`
naming such an object (or a zero-argument callable returning one). Worker processes
re-create the backend from its spec string, so a backend must be importable by name.

Concepts and what their namespace exposes (upstream's names; see conformance/README.md):
- "functional_collectives": all_reduce, all_gather_tensor, reduce_scatter_tensor,
  all_to_all_single, broadcast, all_reduce_coalesced, all_gather_into_tensor_coalesced,
  reduce_scatter_tensor_coalesced, wait_tensor, AsyncCollectiveTensor, ops (the op
  namespace), work_registry_size (optional: cases that need it report not implemented).
- "bucketing": bucket_all_gather(gm, cap_fn), bucket_reduce_scatter(gm, cap_fn),
  bucket_all_reduce(gm, cap_fn) (optional).
- "lowering": lowered_comm_trace(fn, example_inputs, options) -> list[CommEvent] (traced
  in this process, which needs a default group, e.g. the fake one); run_lowered(fn,
  example_inputs, options) -> outputs (inside a rank: it communicates); optional for
  backends that produce FX: lowered_graph(fn, example_inputs, options) -> GraphModule and
  lower(gm, config). `fn(*inputs)` uses the backend's own functional collectives;
  `options` is a dict: auto_select, one_shot_all_reduce_threshold_bytes,
  reorder_for_compute_comm_overlap, enable_symm_mem_for (group names).
- "memory": plan_memory(gm, order=None) -> a plan with events, buffers, peak_bytes, order;
  optionally verify_memory_lifecycle(gm, *args, plan=...) (inside a rank).
- "simulator": simulate(gm, cost_model=None, order=None) -> a timeline; CostModel,
  HardwareProfile, LinkCost, H100_NVLINK_8.
- "reorder": reorder(gm, ...), not specified yet.
- "symmetric_memory": the symmetric-memory API with upstream's names.
"""

from __future__ import annotations

import importlib

__all__ = ["Backend", "NotImplementedConcept", "get_backend", "REGISTERED"]

REGISTERED = {
    "refimpl": "conformance.backends.refimpl_backend:backend",
    "torch": "conformance.backends.torch_backend:backend",
}


class NotImplementedConcept(Exception):
    """The backend does not implement this concept (or this part of it)."""


class Backend:
    """A named bundle of concept namespaces; absent concepts are 'not implemented'."""

    def __init__(self, name: str, concepts: dict, notes: dict | None = None,
                 expected_failures: str | None = None):
        self.name = name
        self._concepts = dict(concepts)
        self.notes = dict(notes or {})
        # A file of `case-id  reason` lines; default conformance/expected_failures/<name>.txt
        self.expected_failures = expected_failures

    def implements(self, concept: str) -> bool:
        return self._concepts.get(concept) is not None

    def require(self, concept: str, *attrs: str):
        """The namespace of `concept`; each of `attrs` must be on it too."""
        namespace = self._concepts.get(concept)
        if namespace is None:
            why = self.notes.get(concept, "the backend does not declare it")
            raise NotImplementedConcept(f"{self.name}: {concept}: {why}")
        for attr in attrs:
            if getattr(namespace, attr, None) is None:
                raise NotImplementedConcept(f"{self.name}: {concept}.{attr} is not provided")
        return namespace

    def __repr__(self):
        done = sorted(k for k in self._concepts if self.implements(k))
        return f"Backend({self.name!r}, implements={done})"


_cache: dict[str, Backend] = {}


def get_backend(spec: str) -> Backend:
    """The backend named `spec`: a registered name or `package.module:attr`."""
    if spec in _cache:
        return _cache[spec]
    target = REGISTERED.get(spec, spec)
    if ":" not in target:
        raise ValueError(f"--backend: {spec!r} is neither a registered backend "
                         f"{sorted(REGISTERED)} nor 'package.module:attr' [CF-1]")
    module_name, attr = target.split(":", 1)
    obj = getattr(importlib.import_module(module_name), attr)
    if callable(obj) and not isinstance(obj, Backend) and not hasattr(obj, "require"):
        obj = obj()
    if not hasattr(obj, "require") or not hasattr(obj, "name"):
        raise TypeError(f"--backend: {target} is not a backend (needs .name and .require) [CF-1]")
    obj.spec = spec
    _cache[spec] = obj
    return obj
