"""The symmetric-memory concept of the `torch` backend: `torch.distributed._symmetric_memory`.

Upstream implements symmetric memory for CUDA only, so on a machine without CUDA the
concept is absent and its cases report "not implemented". With CUDA, ranks allocate on
`cuda:<rank mod device count>` (several processes may share one GPU through IPC).
"""

from __future__ import annotations

import types


def concept():
    import torch

    if not torch.cuda.is_available():
        return None
    import torch.distributed._symmetric_memory as usm
    from torch._C._distributed_c10d import _SymmetricMemory

    return types.SimpleNamespace(
        enable_symm_mem_for_group=usm.enable_symm_mem_for_group,
        is_symm_mem_enabled_for_group=usm.is_symm_mem_enabled_for_group,
        empty=usm.empty,
        empty_strided_p2p=_SymmetricMemory.empty_strided_p2p,
        rendezvous=usm.rendezvous,
        ops=torch.ops.symm_mem,
        device_for_rank=lambda rank: torch.device("cuda", rank % torch.cuda.device_count()),
    )
