"""A process group written in Python that records which of its methods each collective
reaches (SPEC FC-34, FC-50, FC-51): what a vendor's or a library's Python process group (torchft's,
say) must implement for the functional collectives to work over it.

`RecordingProcessGroup` subclasses `torch.distributed.ProcessGroup` and registers no
device backend: c10d reaches it only through the methods a Python subclass overrides.
Each override checks that it got its options argument, appends its name to `calls` and
hands the call to a gloo group of the same ranks, so values stay right and the record
alone tells the path. A collective that
goes another way fails ("No backend type associated with device type cpu"), as it does
on such a group in the field.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from conformance.backend_process_group import PythonGroup

NAME = "refimpl_recording"
# The methods of torch.distributed.ProcessGroup a collective may reach, and how many
# arguments each takes, its options included: upstream's kernels always pass them, and a
# Python group may require them (torchft's do).
METHODS = {"allreduce": 2, "allreduce_coalesced": 2, "allgather": 3,
           "allgather_into_tensor_coalesced": 3, "_allgather_base": 3, "reduce_scatter": 3,
           "reduce_scatter_tensor_coalesced": 3, "_reduce_scatter_base": 3,
           "alltoall_base": 5, "broadcast": 2, "barrier": 1, "send": 3, "recv": 3}


class RecordingProcessGroup(PythonGroup):
    backend_name = NAME

    def __init__(self, store, rank: int, size: int, timeout):
        super().__init__(rank, size)
        # The delegate: a plain c10d group over gloo (it has every method above).
        self.gloo = dist.ProcessGroup(store, rank, size)
        self.gloo._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
        self.gloo._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO,
                                    dist.ProcessGroupGloo(store, rank, size, timeout))
        self.calls: list[str] = []
        self.dtypes: list[list[str]] = []  # per call: the dtypes of its first argument


def _recorded(method: str, arity: int):
    def call(self, *args):
        if len(args) != arity:
            raise TypeError(f"{method}() takes {arity} arguments, its options included "
                            f"(as torchft's groups require), got {len(args)} [FC-34]")
        self.calls.append(method)
        first = args[0] if isinstance(args[0], list) else [args[0]]
        self.dtypes.append([str(t.dtype).removeprefix("torch.") for t in first
                            if isinstance(t, torch.Tensor)])
        return getattr(self.gloo, method)(*args)

    call.__name__ = method
    return call


for _method, _arity in METHODS.items():
    setattr(RecordingProcessGroup, _method, _recorded(_method, _arity))


class RecordingProcessGroupWithBackend(RecordingProcessGroup):
    """The same group with a gloo backend registered for the CPU, as a vendor's group that
    overrides some methods and leaves the others to c10d's base class has: its overrides
    must still be the ones reached (FC-34, FC-51)."""

    def __init__(self, store, rank: int, size: int, timeout):
        super().__init__(store, rank, size, timeout)
        self.serve_the_cpu_from(dist.ProcessGroupGloo(
            dist.PrefixStore("registered/", store), rank, size, timeout))


class PartlyRecordingProcessGroup(RecordingProcessGroupWithBackend):
    """The group with a backend that overrides half of the methods, leaving the others
    (LEFT_TO_THE_BACKEND) to c10d's base class: those must be served by its backend, the
    others by its overrides (FC-51)."""


# send and recv go together: an override's delegate is another gloo group than the
# backend, and a send on one never meets a receive on the other.
LEFT_TO_THE_BACKEND = ("allreduce", "allgather_into_tensor_coalesced", "alltoall_base", "send",
                       "recv")
for _method in LEFT_TO_THE_BACKEND:
    setattr(PartlyRecordingProcessGroup, _method, getattr(dist.ProcessGroup, _method))

NAME_WITH_BACKEND = "refimpl_recording_with_backend"
NAME_PARTLY = "refimpl_recording_partly"


# What `register` is told -> the backend's name and its group's class (c10d calls it as
# the creator: `(store, rank, size, timeout)`).
KINDS = {"no_backend": (NAME, RecordingProcessGroup),
         "every_method_overridden": (NAME_WITH_BACKEND, RecordingProcessGroupWithBackend),
         "half_overridden": (NAME_PARTLY, PartlyRecordingProcessGroup)}


def register(kind: str = "no_backend") -> str:
    """Register the group of `kind` (a key of KINDS: whether it registers gloo for the
    CPU, and which methods it overrides) once per process and return its name."""
    name, create = KINDS[kind]
    if name not in dist.Backend.backend_list:
        dist.Backend.register_backend(name, create, devices=["cpu"])
    return name
