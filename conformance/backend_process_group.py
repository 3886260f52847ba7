"""A process group written in Python that leaves every collective to the gloo backend it
registers for the CPU (SPEC FC-51): the shape of a vendor's group that changes one method
and lets c10d's base class serve the rest, as examples/max_as_sum_process_group.py does.

`BackendProcessGroup` subclasses `torch.distributed.ProcessGroup`, overrides no
collective and registers a gloo backend for the CPU device, so c10d's base class serves
every collective from it. Through c10d's own methods, such a group deadlocks its ranks
now and then within a few hundred collectives on torch 2.11 to 2.15 (upstream finding 18):
every group here records in `base_methods_reached` each read of a collective method it
leaves to c10d's base class, which is how a call takes that way, so a case sees the way
at its first call, deadlock or not.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

NAME = "refimpl_backend_only"
# FC-34's methods, under every name c10d looks a Python subclass's override up by (torch
# 2.13's new names too).
COLLECTIVE_METHODS = frozenset({
    "allreduce", "allreduce_coalesced", "allgather", "allgather_into_tensor_coalesced",
    "all_gather_single_coalesced", "_allgather_base", "reduce_scatter",
    "reduce_scatter_tensor_coalesced", "reduce_scatter_single_coalesced",
    "_reduce_scatter_base", "alltoall_base", "all_to_all_single", "broadcast", "send",
    "recv"})


class PythonGroup(dist.ProcessGroup):
    """What every process group written in Python here has: its rank and size are its
    delegate's (`self.gloo`), its name the one c10d registered it under."""

    backend_name = NAME

    def __getattribute__(self, name: str):
        # A collective method the group leaves to c10d's base class is read off the group
        # only on the way into that base class: by a Python caller, or by c10d's
        # trampoline looking for an override (once per class and name in a process). FC-51
        # forbids that way, which deadlocks only now and then: the read shows it at once.
        if name in COLLECTIVE_METHODS and _left_to_the_base_class(type(self), name):
            object.__getattribute__(self, "__dict__").setdefault(
                "base_methods_reached", []).append(name)
        return super().__getattribute__(name)

    def size(self) -> int:
        return self.gloo.size()

    def rank(self) -> int:
        return self.gloo.rank()

    def getBackendName(self) -> str:
        return self.backend_name

    @property
    def group_name(self) -> str:
        # Kept once read: c10d reads it again while it destroys the group, after it
        # dropped the entry.
        if "_name" not in self.__dict__:
            self._name = dist.distributed_c10d._world.pg_names[self]
        return self._name

    def serve_the_cpu_from(self, gloo: dist.ProcessGroupGloo) -> None:
        """Register `gloo` as the backend c10d's base class serves the CPU from."""
        self._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, gloo)
        # The group's own name and torch 2.15's flight recorder read its default backend.
        self._set_default_backend(dist.ProcessGroup.BackendType.GLOO)


def _left_to_the_base_class(cls: type, name: str) -> bool:
    return getattr(cls, name, None) is getattr(dist.ProcessGroup, name, None)


class BackendProcessGroup(PythonGroup):
    def __init__(self, store, rank: int, size: int, timeout):
        super().__init__(rank, size)
        self.gloo = dist.ProcessGroupGloo(store, rank, size, timeout)
        self.serve_the_cpu_from(self.gloo)


def register() -> str:
    """Register the backend (once per process) and return its name. c10d calls the class
    as the group's creator: `(store, rank, size, timeout)`."""
    if NAME not in dist.Backend.backend_list:
        dist.Backend.register_backend(NAME, BackendProcessGroup, devices=["cpu"])
    return NAME
