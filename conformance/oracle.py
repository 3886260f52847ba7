"""Single-process oracles: what a collective must return, computed from every rank's input.

Inputs are deterministic functions of (rank, shape, dtype, salt), so the process that
checks the results can rebuild every rank's input and compute the expected outputs in
float64 / int64 without any communication. Values are small integers, so sums, averages
over 2 or 4 ranks and products are exact in every dtype, bfloat16 included.
"""

from __future__ import annotations

import torch


def rank_input(rank: int, shape, dtype=torch.float32, salt: int = 0) -> torch.Tensor:
    """The input that `rank` contributes: small integers in [-3, 3], fixed by the seed."""
    gen = torch.Generator().manual_seed(7919 * salt + 104729 * len(shape) + rank)
    values = torch.randint(-3, 4, tuple(shape), generator=gen, device="cpu")
    values = values > 0 if dtype == torch.bool else values.to(dtype)
    # Drawn on the CPU, where the oracle recomputes it; made on the default device, which
    # a rank function of a --device cuda run has set to its GPU (CF-13).
    return values.to(torch.get_default_device())


def spread_input(rank: int, shape, dtype=torch.float32, salt: int = 0) -> torch.Tensor:
    """An input whose sums round differently in another order: normal draws scaled by
    10**k, k in [-3, 3], in `dtype` (float32, bfloat16). Where a rule promises a value
    bit for bit, these tell a change of summation order; small integers cannot."""
    gen = torch.Generator().manual_seed(7919 * salt + 104729 * len(shape) + rank + 31)
    values = torch.randn(tuple(shape), generator=gen, dtype=torch.float64) * \
        10.0 ** torch.randint(-3, 4, tuple(shape), generator=gen)
    return values.to(dtype).to(torch.get_default_device())


def _wide(t: torch.Tensor) -> torch.Tensor:
    if t.dtype.is_floating_point:
        return t.to(torch.float64)
    return t.to(torch.int64)


def reduce(tensors: list[torch.Tensor], reduce_op: str) -> torch.Tensor:
    """The reduction of equally shaped tensors in a wide dtype, cast back."""
    dtype = tensors[0].dtype
    stacked = torch.stack([_wide(t) for t in tensors])
    op = reduce_op.lower()
    if op == "sum":
        out = stacked.sum(0)
    elif op == "avg":
        out = stacked.sum(0) / len(tensors)
    elif op == "product":
        out = stacked.prod(0)
    elif op == "min":
        out = stacked.min(0).values
    elif op == "max":
        out = stacked.max(0).values
    elif op in ("band", "bor", "bxor"):
        fn = {"band": torch.bitwise_and, "bor": torch.bitwise_or, "bxor": torch.bitwise_xor}[op]
        out = stacked[0]
        for t in stacked[1:]:
            out = fn(out, t)
    else:
        raise ValueError(f"oracle: unknown reduce_op {reduce_op!r}")
    return out.to(dtype)


def all_gather(tensors: list[torch.Tensor], dim: int = 0) -> torch.Tensor:
    return torch.cat(tensors, dim=dim)


def reduce_scatter(tensors: list[torch.Tensor], reduce_op: str, index: int,
                   dim: int = 0) -> torch.Tensor:
    return torch.chunk(reduce(tensors, reduce_op), len(tensors), dim=dim)[index]


def all_to_all_single(tensors: list[torch.Tensor], index: int,
                      input_splits: list[list[int]] | None = None) -> torch.Tensor:
    """Group rank `index` receives split `index` of every rank's dim 0, in rank order."""
    n = len(tensors)
    pieces = []
    for rank, t in enumerate(tensors):
        splits = input_splits[rank] if input_splits else [t.shape[0] // n] * n
        pieces.append(torch.split(t, splits, dim=0)[index])
    return torch.cat(pieces, dim=0)
