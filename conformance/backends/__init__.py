"""Backends: what the conformance suite runs against.

The backend protocol (a `name`, `require(concept, *attrs)`, the concepts and what each
namespace provides) is stated once, in conformance/README.md, "The backend protocol".
This module holds its machinery: `Backend`, a named bundle of concept namespaces;
`NotImplementedConcept`, which a case turns into "not implemented" (CF-3); and
`get_backend(spec)`, which resolves `--backend` (CF-1). Worker processes re-create the
backend from its spec string, so a backend must be importable by name.
"""

from __future__ import annotations

import importlib

__all__ = ["Backend", "BackendSpecError", "NotImplementedConcept", "get_backend",
           "REGISTERED"]

REGISTERED = {
    "refimpl": "conformance.backends.refimpl_backend:backend",
    "torch": "conformance.backends.torch_backend:backend",
}


class NotImplementedConcept(Exception):
    """The backend does not implement this concept (or this part of it)."""


class BackendSpecError(ValueError):
    """`--backend` names no backend: an unknown name, or an object that is not one."""


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
        raise BackendSpecError(f"--backend: {spec!r} is neither a registered backend "
                               f"{sorted(REGISTERED)} nor 'package.module:attr' [CF-1]")
    module_name, attr = target.split(":", 1)
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name is None or not (module_name + ".").startswith(exc.name + "."):
            raise  # the backend's own imports are broken: reported by every case
        raise BackendSpecError(f"--backend: {spec!r}: no module named {exc.name!r} "
                               f"[CF-1]") from None
    obj = getattr(module, attr, None)
    if callable(obj) and not isinstance(obj, Backend) and not hasattr(obj, "require"):
        obj = obj()
    if not hasattr(obj, "require") or not hasattr(obj, "name"):
        raise BackendSpecError(f"--backend: {target} is not a backend (needs .name and "
                               f".require) [CF-1]")
    obj.spec = spec
    _cache[spec] = obj
    return obj
