"""Deliberately broken backends: the conformance suite must fail each on the right case.

Each is refimpl with one plausible bug. `tests/test_mutants.py` runs the suite against
every one (as `--backend mutants:NAME`) and checks that the named case fails.
"""

from __future__ import annotations

import types

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_map_only

import refimpl.functional_collectives as fc
from conformance.backends import Backend

API = ["all_reduce", "all_gather_tensor", "reduce_scatter_tensor", "all_to_all_single",
       "broadcast", "all_reduce_coalesced", "all_gather_into_tensor_coalesced",
       "reduce_scatter_tensor_coalesced", "wait_tensor", "AsyncCollectiveTensor", "ops",
       "work_registry_size", "resolve_group_name"]


def _mutant(name: str, **overrides) -> Backend:
    namespace = types.SimpleNamespace(**{n: getattr(fc, n) for n in API})
    for key, value in overrides.items():
        setattr(namespace, key, value)
    return Backend(f"mutant-{name}", {"functional_collectives": namespace})


def _all_reduce_returns_input(self, reduceOp, group, tag=""):
    return fc.AsyncCollectiveTensor(self.clone())


class _NeverWaits(fc.AsyncCollectiveTensor):
    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        unwrap = lambda t: t.elem  # uses the buffer without waiting for the collective
        return func(*tree_map_only(fc.AsyncCollectiveTensor, unwrap, args),
                    **tree_map_only(fc.AsyncCollectiveTensor, unwrap, kwargs or {}))

    def trigger_wait(self):
        return self.elem


def _all_reduce_never_waits(self, reduceOp, group, tag=""):
    return _NeverWaits(fc.ops.all_reduce(self, reduceOp, fc.resolve_group_name(group)))


def _reduce_scatter_chunk_by_global_rank(self, reduceOp, scatter_dim, group, tag=""):
    n = fc.group_size(fc.resolve_group_name(group))
    total = fc.all_reduce(self, reduceOp, group).wait()
    return torch.chunk(total, n, dim=scatter_dim)[dist.get_rank() % n].contiguous()


def _all_gather_reversed(self, gather_dim, group, tag=""):
    gathered = fc.all_gather_tensor(self, gather_dim, group).wait()
    n = fc.group_size(fc.resolve_group_name(group))
    return torch.cat(list(reversed(torch.chunk(gathered, n, dim=gather_dim))), dim=gather_dim)


def _broadcast_global_src(self, src, group, tag=""):
    name = fc.resolve_group_name(group)
    ranks = fc.group_ranks(name)
    group_src = ranks.index(src) if src in ranks else src
    return fc.broadcast(self, group_src, group)


def _wait_tensor_does_not_wait(tensor):
    return tensor


def _all_reduce_without_traced_wait(self, reduceOp, group, tag=""):
    result = fc.ops.all_reduce(self, reduceOp, fc.resolve_group_name(group))
    return result if fc._are_we_tracing() else fc._wrap(result)


all_reduce_returns_input = _mutant("all_reduce_returns_input",
                                   all_reduce=_all_reduce_returns_input)
never_waits = _mutant("never_waits", all_reduce=_all_reduce_never_waits)
reduce_scatter_wrong_chunk = _mutant("reduce_scatter_wrong_chunk",
                                     reduce_scatter_tensor=_reduce_scatter_chunk_by_global_rank)
all_gather_reversed = _mutant("all_gather_reversed", all_gather_tensor=_all_gather_reversed)
broadcast_global_src = _mutant("broadcast_global_src", broadcast=_broadcast_global_src)
wait_tensor_does_not_wait = _mutant("wait_tensor_does_not_wait",
                                    wait_tensor=_wait_tensor_does_not_wait)
traced_all_reduce_without_wait = _mutant("traced_all_reduce_without_wait",
                                         all_reduce=_all_reduce_without_traced_wait)
