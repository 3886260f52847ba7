"""A process-group backend registered from Python, with one deliberate bug.

A vendor's process group is judged the way this one is: register it, then run the suite
over it (README, "Running on a cluster"):

    torchrun --nproc-per-node 2 -m conformance --section FC \\
        --process-group examples.max_as_sum_process_group:register

`MaxAsSumProcessGroup` wraps gloo and passes every collective through unchanged, except
one slip: an all-reduce asked for `max` sums instead. The report fails the cases of the
rules whose values that changes (all_reduce with `max`), naming them, and passes the rest
(a coalesced all-reduce reaches the group's `allreduce_coalesced`, SPEC FC-34, which this
group leaves to gloo: its `max` cases pass).

A method the group leaves to c10d's base class, refimpl serves from the gloo backend the
group registered (SPEC FC-51): through the group's own method, c10d's trampoline keeps the
GIL into gloo's queue lock and the ranks deadlock now and then (upstream finding 18,
torch 2.11 to 2.15), so upstream's kernels hang on this group where refimpl's do not.

How it plugs in (torch.distributed's extension point for third-party backends):
`Backend.register_backend(name, create)` makes `name` a backend `init_process_group` and
`new_group` accept; `create(store, rank, size, timeout)` returns the group. The group is a
Python `ProcessGroup` whose `allreduce` c10d calls for every all-reduce (the functional
collectives' included); the other collectives go to the gloo backend registered for the
CPU on it, as they would for any wrapper that only changes one op.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

NAME = "max_as_sum"


class MaxAsSumProcessGroup(dist.ProcessGroup):
    def __init__(self, store, rank: int, size: int, timeout):
        super().__init__(rank, size)
        self.gloo = dist.ProcessGroupGloo(store, rank, size, timeout)
        self._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO,
                               self.gloo)
        # The group's own name and the flight recorder (torch 2.15 attaches it to every
        # group with a device backend) are read from its default backend.
        self._set_default_backend(dist.ProcessGroup.BackendType.GLOO)

    def allreduce(self, tensors, opts=None):
        opts = opts if opts is not None else dist.AllreduceOptions()
        if opts.reduceOp == dist.ReduceOp.MAX:  # the bug
            opts = dist.AllreduceOptions()
            opts.reduceOp = dist.ReduceOp.SUM
        return self.gloo.allreduce(tensors, opts)

    def size(self) -> int:
        return self.gloo.size()

    def rank(self) -> int:
        return self.gloo.rank()

    def getBackendName(self) -> str:
        return NAME

    @property
    def group_name(self) -> str:
        # A Python group's name is the one c10d registered it under.
        return dist.distributed_c10d._world.pg_names[self]


def _create(store, rank, size, timeout):
    return MaxAsSumProcessGroup(store, rank, size, timeout)


def register() -> str:
    """Register the backend (once per process) and return its name."""
    if NAME not in dist.Backend.backend_list:
        dist.Backend.register_backend(NAME, _create, devices=["cpu"])
    return NAME
