"""A process-group backend that cannot start (tests/test_launched.py): its creator
raises, as a vendor's does when its fabric or driver is missing."""

from __future__ import annotations

import torch.distributed as dist

NAME = "cannot_start"


def _create(store, rank, size, timeout):
    raise RuntimeError("no fabric on this host")


def register() -> str:
    if NAME not in dist.Backend.backend_list:
        dist.Backend.register_backend(NAME, _create, devices=["cpu"])
    return NAME
