"""The `torch` backend: upstream PyTorch of the installed version.

Functional collectives come from `torch.distributed._functional_collectives` and the
`_c10d_functional` ops. The other concepts are adapters in sibling modules
(`torch_bucketing`, `torch_lowering`, `torch_symm_mem`, ...), each optional: a concept
whose adapter is missing is reported "not implemented".
"""

from __future__ import annotations

import importlib
import types

from conformance.backends import Backend


def _adapter(module: str):
    try:
        return importlib.import_module(f"conformance.backends.{module}").concept()
    except ModuleNotFoundError as exc:
        if exc.name != f"conformance.backends.{module}":
            raise
        return None


def _functional_collectives():
    import torch
    import torch.distributed._functional_collectives as ufc

    names = ["all_reduce", "all_gather_tensor", "reduce_scatter_tensor", "all_to_all_single",
             "broadcast", "all_reduce_coalesced", "all_gather_into_tensor_coalesced",
             "reduce_scatter_tensor_coalesced", "wait_tensor", "AsyncCollectiveTensor",
             "all_gather_tensor_autograd", "reduce_scatter_tensor_autograd",
             "all_to_all_single_autograd"]
    # torch 2.15's names (FC-37), where the installed torch has them
    names += [n for n in ("all_gather_single", "reduce_scatter_single",
                          "all_gather_single_coalesced", "reduce_scatter_single_coalesced",
                          "wait_tensors") if hasattr(ufc, n)]
    ns = types.SimpleNamespace(**{n: getattr(ufc, n) for n in names})
    ns.ops = torch.ops._c10d_functional
    ns.resolve_group_name = ufc._resolve_group_name
    # Upstream keeps its work registry in C++ and exposes no count of it.
    ns.work_registry_size = None
    return ns


def _make() -> Backend:
    return Backend("torch", {
        "functional_collectives": _functional_collectives(),
        "bucketing": _adapter("torch_bucketing"),
        "lowering": _adapter("torch_lowering"),
        "reorder": _adapter("torch_reorder"),
        "memory": _adapter("torch_memory"),
        "simulator": None,
        "symmetric_memory": _adapter("torch_symm_mem"),
        "compile_backend": _adapter("torch_compile"),
    }, notes={"simulator": "upstream has no simulator of a given node order: its overlap "
                           "scheduler accounts exposed time only inside its own scheduling "
                           "loop, and comms.py's estimates work on Inductor scheduler nodes",
              "symmetric_memory": "upstream implements it for CUDA only"})


backend = _make()
