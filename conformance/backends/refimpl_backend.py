"""The `refimpl` backend: this project's modules, concept by concept."""

from __future__ import annotations

import importlib

from conformance.backends import Backend


def _optional(module: str):
    """A refimpl module that may not exist yet in this checkout."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name != module:
            raise
        return None


def _lowering():
    """The lowering concept: refimpl.comm_lowering behind the cases' questions."""
    if _optional("refimpl.comm_lowering") is None:
        return None
    from conformance.backends import refimpl_lowering

    return refimpl_lowering.concept()


def _compile_backend():
    """The compile_backend concept: refimpl.compile behind the E2E cases' options."""
    if _optional("refimpl.compile") is None:
        return None
    from conformance.backends import refimpl_compile

    return refimpl_compile.concept()


def _make() -> Backend:
    import refimpl.functional_collectives as fc

    return Backend("refimpl", {
        "functional_collectives": fc,
        "bucketing": _optional("refimpl.bucketing"),
        "lowering": _lowering(),
        "reorder": _optional("refimpl.reorder"),
        "memory": _optional("refimpl.memory"),
        "simulator": _optional("refimpl.simulator"),
        "symmetric_memory": _optional("refimpl.symmetric_memory"),
        "compile_backend": _compile_backend(),
    })


backend = _make()
