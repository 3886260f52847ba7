"""Agreement among the ranks of a world: how a pass that decides from inputs of each
rank's own (a cost model, a cap function) makes its decision alike on every rank.

Ranks that reorder or bucket one graph differently issue their collectives in different
orders or shapes, which NCCL does not survive (a hang, not an error). A pass that reads
per-rank inputs posts them, with its graph's fingerprint, to the default store and reads
every rank's: the world's ranks then decide from the same data (RO-16, BK-24). Every wait
is bounded and names the ranks that never came (FC-28); ranks whose graphs differ are
refused on every rank, since nothing can be decided alike for them.

Private to refimpl: the rules that use it say what each pass agrees on.
"""

from __future__ import annotations

import collections
import itertools
import json

import torch.distributed as dist

__all__ = ["real_world", "Agreement"]

# Each topic's exchanges made by this process, counted: the key of each. Every rank runs
# the same passes on the same graphs in the same order, so the n-th of a topic meets.
_COUNTS: dict[str, itertools.count] = collections.defaultdict(lambda: itertools.count(1))


def real_world() -> tuple[int, ...]:
    """Every global rank of the world when real ranks run (the world, not the ranks of
    this rank's own groups: rows of subgroups differ from rank to rank, and an order or
    a layout across groups chains them all); () without one, or in a fake world, which
    only traces."""
    if not dist.is_initialized() or dist.get_world_size() < 2 or dist.get_backend() == "fake":
        return ()
    return tuple(range(dist.get_world_size()))


class Agreement:
    """One decision of `topic` taken alike by `ranks`: rounds in which every rank posts a
    JSON payload and reads every rank's. `remedy` ends each error: what a caller whose
    ranks must decide apart passes instead."""

    def __init__(self, topic: str, ranks: tuple[int, ...], rule: str, remedy: str):
        self.store = dist.distributed_c10d._get_default_store()
        self.me, self.ranks, self.rule, self.remedy = dist.get_rank(), ranks, rule, remedy
        count = next(_COUNTS[topic])
        self.base = f"refimpl-{topic}/{count}"
        self.what = f"{topic}'s call #{count} among global ranks {list(ranks)}"
        self.rounds = 0

    def round(self, payload: dict) -> dict[int, dict]:
        """Post `payload`; every rank's payload of this round, by global rank."""
        from refimpl.functional_collectives import PeerTimeout, _missing_peers, _peer_timeout_s

        self.rounds += 1
        keys = {r: f"{self.base}/{self.rounds}/{r}" for r in self.ranks}
        self.store.set(keys[self.me], json.dumps(payload))
        timeout_s = _peer_timeout_s()
        missing = _missing_peers(self.store, keys, timeout_s)
        if missing:
            raise PeerTimeout(
                f"gm: {self.what}, round {self.rounds}: global rank {self.me} waited "
                f"{timeout_s:g} s for global ranks {missing} to post theirs, in vain: they "
                f"run this pass on fewer graphs, or on none; {self.remedy} [{self.rule}]")
        return {r: json.loads(self.store.get(key)) for r, key in keys.items()}

    def refuse_other_graphs(self, posts: dict[int, dict], graph: str, verb: str) -> None:
        """ValueError on every rank when a rank posted another graph than this one's."""
        other = [r for r in self.ranks if posts[r]["graph"] != graph]
        if other:
            raise ValueError(
                f"gm: {self.what}: global ranks {other} {verb} another graph than global "
                f"rank {self.me} (ops, wiring, shapes or dtypes differ): their decisions "
                f"cannot be made alike; {self.remedy} [{self.rule}]")
