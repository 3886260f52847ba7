"""The exact memory test of a move: does placing some blocks now keep RO-9's peak bound?

Before each move, reorder's list scheduler (refimpl/reorder.py) asks whether the planned
peak (MEM-1) of the move's *continuation* stays within RO-9's limit (RO-10). The
continuation is the nodes placed so far, then the move, then every other node in the
original order. `MemoryBound` answers without planning the continuation. For each position
not placed yet it keeps a *key*: what the continuation has live there, the live bytes
before it plus its allocations (MEM-9). The keys live in `MaxTree`, a segment tree with
range add and range max; placed positions hold `PLACED`, which is below any sum of byte
counts. Placing a node ahead of the first unplaced position changes keys on ranges only:
- a buffer it allocates is live from now on, not from its position;
- a buffer whose last release it places is freed at the release now left last in the
  original order, or now. A release is the buffer's reader (MEM-3) or the wait that ends
  a collective's hold on it (MEM-5).
- a buffer never freed (an input, an output, a comm buffer, a hold no wait ends:
  MEM-5 .. MEM-8) changes nothing.
So a test is a few range maxima over the pieces a move changes and a commit a few range
adds: O(log N) each, never a plan per candidate. The graph is analysed once, by
`refimpl.memory.MemoryModel` (MEM-10). The test is exact: it reads every key the move
changes, so a move that raises no planned peak always passes. Placing the original
order's next node changes no key, so the bound always holds.

Implements SPEC.md RO-10's memory test against RO-9's limit, on the planned peak of
MEM-1, MEM-3 and MEM-5 .. MEM-9 as `MemoryModel` analyses a graph (MEM-10).
"""

from __future__ import annotations

import torch.fx

from refimpl.memory import MemoryModel

__all__ = ["PLACED", "MaxTree", "MemoryBound"]

PLACED = -(1 << 62)  # the key of a placed position: below any sum of byte counts


class MaxTree:
    """Range add and range max over positions 0..n-1: a segment tree with lazy adds,
    iterative, each call O(log n). `t[p]` is the largest value under node p with the adds
    of p and its descendants (`d`), not those of its ancestors: reads add those up."""

    def __init__(self, values: list[int]):
        size = 1
        while size < max(len(values), 1):
            size *= 2
        self.size = size
        t = self.t = [PLACED] * (2 * size)
        t[size:size + len(values)] = values
        self.d = [0] * (2 * size)  # adds pending over a node's subtree; 0 at leaves
        for p in range(size - 1, 0, -1):
            t[p] = max(t[2 * p], t[2 * p + 1])

    def add(self, lo: int, hi: int, value: int) -> None:
        """Add `value` to positions lo..hi-1."""
        if lo >= hi:
            return
        t, d, size = self.t, self.d, self.size
        lo += size
        hi += size
        left, right = lo, hi - 1
        while lo < hi:
            if lo & 1:
                t[lo] += value
                if lo < size:
                    d[lo] += value
                lo += 1
            if hi & 1:
                hi -= 1
                t[hi] += value
                if hi < size:
                    d[hi] += value
            lo >>= 1
            hi >>= 1
        # Recompute the ancestors of both ends (once where their paths meet).
        while left > 1:
            left >>= 1
            right >>= 1
            a, b = t[2 * left], t[2 * left + 1]
            t[left] = (a if a > b else b) + d[left]
            if right != left:
                a, b = t[2 * right], t[2 * right + 1]
                t[right] = (a if a > b else b) + d[right]

    def last_above(self, lo: int, hi: int, bound: int) -> int:
        """The last position of lo..hi-1 whose value exceeds `bound` (lo - 1 for none):
        the range's nodes from the right, then down the first one above `bound`."""
        t, d, size = self.t, self.d, self.size
        left, right, nodes = lo + size, hi + size, []
        tail = []
        while left < right:
            if left & 1:
                nodes.append(left)
                left += 1
            if right & 1:
                right -= 1
                tail.append(right)
            left >>= 1
            right >>= 1
        for p in reversed(nodes + tail[::-1]):
            above, q = 0, p >> 1  # the adds pending above p
            while q:
                above += d[q]
                q >>= 1
            if t[p] + above > bound:
                while p < size:
                    above += d[p]
                    p = 2 * p + 1 if t[2 * p + 1] + above > bound else 2 * p
                return p - size
        return lo - 1

    def max(self, lo: int, hi: int) -> int:
        """The largest value of positions lo..hi-1 (PLACED for none), reading only: the
        range's nodes bottom-up, each side's best raised by the adds pending above it."""
        if lo >= hi:
            return PLACED
        t, d, size = self.t, self.d, self.size
        lo += size
        hi += size
        left = right = PLACED
        while lo < hi:
            if lo & 1:
                if t[lo] > left:
                    left = t[lo]
                lo += 1
            if hi & 1:
                hi -= 1
                if t[hi] > right:
                    right = t[hi]
            lo >>= 1
            hi >>= 1
            # Every node taken on the left lies under lo - 1, on the right under hi.
            left += d[lo - 1]
            right += d[hi]
        lo -= 1
        while lo != hi:  # up to where the two sides meet, then once for both
            lo >>= 1
            hi >>= 1
            left += d[lo]
            right += d[hi]
        best = left if left > right else right
        lo >>= 1
        while lo:
            best += d[lo]
            lo >>= 1
        return best


class MemoryBound:
    """RO-10's memory test: the exact planned peak of placing a move now and the rest
    of the program in the original order, against RO-9's limit.

    `key[j]`, for each position j not placed, is what that continuation (the nodes placed
    so far, then every other node in original order) has live at j: its live bytes
    before j plus j's allocations (MEM-9). Placing a node ahead of the first unplaced
    position changes keys on ranges only: a buffer it allocates is live from now on, not
    from its position; a buffer whose last release it is (a reader, or the wait that ends
    a collective's hold on the buffer, MEM-5) is freed at the release left last in the
    original order, or now. A tree of keys (range add, range max) holds them.
    """

    def __init__(self, model: MemoryModel, body: list[torch.fx.Node],
                 output: list[torch.fx.Node], high: list[int], limit: float):
        """`body`: the nodes but inputs and output, in original order (positions index
        it); `high[j]`: the original order's key at j; `limit`: RO-9's, finite."""
        self.limit = limit
        self.model, self.body, self.n = model, body, len(body)
        self.output = output
        self.bytes = [b.nbytes for b in model.buffers]
        self.alloc_at = [-1] * len(model.buffers)  # -1: an input's, placed first
        self.forever = [bool(p) for p in model.pinned]  # never freed
        self._find_releases()
        self.last = [len(r) - 1 for r in self.releases]  # its last release not placed
        self.placed = [False] * self.n
        self.tree = MaxTree(list(high))
        self.version = 0  # moves committed ahead of the first unplaced position
        # A move refused at a later position stays refused while no move ahead changes a
        # key and the first unplaced position has not passed that one: moves retried after
        # every placement (RO-10) cost one lookup then.
        self.refused: dict[tuple[int, ...], tuple[int, int]] = {}

    def _find_releases(self) -> None:
        """Per buffer, the positions that release it, ascending: its readers, and the wait
        that ends a collective's hold on it (MEM-5's pairing in the original order); per
        position, the buffers it releases. One pass over the original order."""
        model = self.model
        releases: list[list[int]] = [[] for _ in model.buffers]
        released_by: list[tuple[int, ...]] = []
        pending: dict[int, list[tuple[int, ...]]] = {}
        for i, node in enumerate(self.body):
            for b in model.allocs.get(node, ()):
                self.alloc_at[b] = i
            used, ended = model.uses.get(node, ()), []
            for b in used:
                releases[b].append(i)
            for done, held in model.in_flight.get(node, ()):
                pending.setdefault(done, []).append(held)
            for done in model.completes.get(node, ()):
                for held in pending.pop(done, ()):
                    for b in held:
                        if not releases[b] or releases[b][-1] != i:
                            releases[b].append(i)
                            ended.append(b)
            released_by.append(used + tuple(ended) if ended else used)
        for sets in pending.values():  # holds that no wait ends: to the end
            for held in sets:
                for b in held:
                    self.forever[b] = True
        for output in self.output:
            for b in model.uses.get(output, ()):
                self.forever[b] = True  # the output reads it
        self.releases, self.released_by = releases, released_by

    def _end(self, b: int, moving: set[int]) -> int | None:
        """The last position at which `b` is live if the rest follows the original order
        (its last release neither placed nor in `moving`); None when it is freed."""
        if self.forever[b]:
            return self.n - 1
        releases, k, placed = self.releases[b], self.last[b], self.placed
        while k >= 0 and placed[releases[k]]:
            k -= 1
        self.last[b] = k  # placed releases stay placed: skipped once
        while k >= 0 and (releases[k] in moving or placed[releases[k]]):
            k -= 1
        return releases[k] if k >= 0 else None

    def _events(self, members: list[int], cur: int) -> list[tuple[int, int, int]]:
        """The key changes (lo, hi, bytes) of placing `members`, in order, now; `cur` is
        the first position not placed before them. Positions below the first unplaced
        one after them are never read again, so ranges may start at `cur`."""
        events, moving = [], set()
        for k in members:
            moving.add(k)
            if k == cur:  # the original order's own next node changes no later key
                while cur < self.n and (self.placed[cur] or cur in moving):
                    cur += 1
                continue
            events.append((k, k + 1, PLACED))
            for b in self.model.allocs.get(self.body[k], ()):
                if self._end(b, moving) is not None:
                    events.append((cur, k, self.bytes[b]))  # live from now, not from k
            for b in self.released_by[k]:
                if self.forever[b] or self._end(b, moving - {k}) != k:
                    continue  # a later release is left: the free stays where it was
                after = self._end(b, moving)
                a = self.alloc_at[b]
                start = cur if a < cur or self.placed[a] or a in moving else a + 1
                lo = max(start, after + 1) if after is not None else start
                events.append((lo, k + 1, -self.bytes[b]))
        return events

    @staticmethod
    def _pieces(events, start: int, stop: int):
        """(lo, hi, change) for each piece of start..stop-1 between the ends of `events`,
        in order: the sum of the events covering it, `PLACED` where one marks a placed
        position. One sweep over the ends."""
        delta = {start: 0, stop: 0}
        for lo, hi, value in events:
            lo, hi = max(lo, start), min(hi, stop)
            if lo < hi:
                delta[lo] = delta.get(lo, 0) + value
                delta[hi] = delta.get(hi, 0) - value
        ends = sorted(delta)
        change = 0
        for lo, hi in zip(ends, ends[1:], strict=False):
            change += delta[lo]
            yield lo, hi, (PLACED if change < PLACED // 2 else change)

    def _apply(self, events) -> None:
        """Add the events to the tree, one range add per run of equal change."""
        if len(events) == 1:
            self.tree.add(*events[0])
            return
        start = min(lo for lo, _, _ in events)
        run_lo, run_hi, run_value = start, start, 0
        for lo, hi, value in self._pieces(events, start, max(hi for _, hi, _ in events)):
            if value != run_value:
                if run_value:
                    self.tree.add(run_lo, lo, run_value)
                run_lo, run_value = lo, value
            run_hi = hi
        if run_value:
            self.tree.add(run_lo, run_hi, run_value)

    def _stable(self, members: list[int]) -> bool:
        """Whether the move's own changes stay as they are while only the original
        order's next nodes are placed: it ends no buffer that a release after it keeps
        alive anyway (else placing that buffer's other releases could make it end it)."""
        last = max(members)
        return all(self.forever[b] or self.releases[b][-1] > last
                   for k in members for b in self.released_by[k])

    def refused_before(self, members: list[int], cur: int) -> bool:
        """Whether the same move was refused at a later position that still stands."""
        seen = self.refused.get(tuple(members))
        return seen is not None and seen[0] == self.version and cur <= seen[1]

    def fits(self, peak_of_move: int, members: list[int], cur: int, cur_after: int,
             allocated: int) -> bool:
        """Whether the move's own peak and every later key stay within the limit
        (`allocated`: at least what the move allocates).

        The move changes keys below its last member only; there its changes are constant
        between their ends, so each such piece is one range max of the tree as it is."""
        if peak_of_move > self.limit:
            return False
        tree, last = self.tree, max(members) + 1  # (from `last` on nothing changes, and
        if tree.max(cur_after, last) + allocated <= self.limit:  # the continuation is
            return True                                          # within the limit)
        for lo, hi, change in self._pieces(self._events(members, cur), cur_after, last):
            if change != PLACED and tree.max(lo, hi) + change > self.limit:
                # Refused while the first unplaced position has not passed the last
                # position of the piece over the limit (and no move ahead changes keys).
                if self._stable(members):
                    at = tree.last_above(lo, hi, self.limit - change)
                    self.refused[tuple(members)] = (self.version, at)
                return False
        return True

    def place(self, members: list[int], cur: int) -> None:
        """Commit a move (`cur` as for its test)."""
        if members[-1] != cur or len(members) > 1:  # a node at `cur` changes no key
            events = self._events(members, cur)
            if events:
                self._apply(events)
                self.version += 1
        for k in members:
            self.placed[k] = True
