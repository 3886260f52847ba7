"""`run_on_ranks` under torchrun (tests/test_launched.py): every launched rank runs main(),
making the same calls; each writes what it saw to OUT/rank<r>.json for the test to compare.

Run: torchrun --nproc-per-node 3 tests/launched_rank.py OUT
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from refimpl import launched  # noqa: E402
from refimpl.multiprocess import RankError, run_on_ranks, shutdown  # noqa: E402


def where() -> tuple:
    """Inside a rank function: its rank and world, its process, and a real all_reduce."""
    x = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(x)
    return dist.get_rank(), dist.get_world_size(), os.getpid(), x.item()


def fails_on_rank_1() -> str:
    if dist.get_rank() == 1:
        raise ValueError("rank 1 refuses")
    return "fine"


def exits_on_rank_1() -> str:
    if dist.get_rank() == 1:
        os._exit(3)
    return "fine"


def sets_a_variable() -> str:
    os.environ["REFIMPL_LAUNCHED_TEST"] = "set by the rank"
    return os.environ.get("REFIMPL_ONLY_CALLER", "unset")


def outcome(fn, n: int):
    """What run_on_ranks gave: ("ok", results), ("RankError", rank, type), or the
    NotOnThisWorld reason."""
    try:
        return ["ok", run_on_ranks(fn, n)]
    except RankError as err:
        return ["RankError", err.rank, err.exc_type]
    except launched.NotOnThisWorld as exc:
        return ["NotOnThisWorld", str(exc)]


def main(out: Path) -> None:
    seen = {"launched": launched.current() is not None,
            "default group in the launched process": dist.is_initialized()}
    seen["two"] = outcome(where, 2)
    seen["three"] = outcome(where, 3)
    seen["two again"] = outcome(where, 2)  # the same worker processes as the first call
    seen["four"] = outcome(where, 4)
    seen["error"] = outcome(fails_on_rank_1, 3)
    seen["exit"] = outcome(exits_on_rank_1, 2)
    seen["after the exit"] = outcome(where, 2)  # fresh workers of size 2
    shutdown(3)
    seen["after shutdown"] = outcome(where, 3)
    os.environ["REFIMPL_ONLY_CALLER"] = "the caller's"
    seen["variable"] = outcome(sets_a_variable, 2)
    seen["variable left"] = os.environ.get("REFIMPL_LAUNCHED_TEST", "not here")
    seen["default group after"] = dist.is_initialized()
    (out / f"rank{launched.current().rank}.json").write_text(json.dumps(seen))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
