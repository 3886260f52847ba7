"""Mutants: plausible one-line slips in refimpl, each breaking one SPEC rule.

A mutant is a textual patch of one file of the checkout (Python or C): `old` must occur
exactly once in `path`, and is replaced by `new`. Each is the kind of slip a real
implementation makes at a rule's boundary (an off-by-one at a bound, a key computed
from the wrong property, a check or a synchronisation step left out) and names the rule
it breaks. `tests/test_mutants.py` applies each one to a copy of the checkout and runs
`python -m conformance --section <its section>` there: the conformance suite alone must
fail every mutant (CF-6).

Mutants are grouped by SPEC section, one list per section, so that each section's owner
adds to its own list.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# What a copy of the checkout needs to run the conformance suite on its own.
COPIED = ["refimpl", "conformance", "kernels", "pyproject.toml", "conftest.py", "setup.py"]


@dataclass(frozen=True)
class Mutant:
    name: str  # unique, short, snake_case
    rule: str  # the SPEC ID it breaks, e.g. "FC-20"
    path: str  # file relative to the repository root
    old: str  # text that occurs exactly once in `path`
    new: str  # what replaces it: a one-line slip
    why: str = ""  # the plausible mistake, in words

    @property
    def section(self) -> str:
        return self.rule.rsplit("-", 1)[0]

    def apply(self, root: Path) -> None:
        """Patch the copy of the checkout at `root` (refuses an ambiguous `old`)."""
        target = root / self.path
        text = target.read_text()
        count = text.count(self.old)
        if count != 1:
            raise ValueError(f"mutant {self.name}: {self.old!r} occurs {count} times in "
                             f"{self.path}, expected exactly once")
        target.write_text(text.replace(self.old, self.new))


def copy_checkout(dest: Path) -> Path:
    """A copy of what the suite needs, without build outputs or caches."""
    ignore = shutil.ignore_patterns("__pycache__", "*.so", "build", "*.egg-info")
    for name in COPIED:
        src = ROOT / name
        if src.is_dir():
            shutil.copytree(src, dest / name, ignore=ignore)
        elif src.exists():
            shutil.copy2(src, dest / name)
    return dest


# --------------------------------------------------------------------------------------
# 1. Functional collectives (FC)
# --------------------------------------------------------------------------------------
FC = [
    Mutant("all_gather_group_size_unchecked", "FC-19", "refimpl/functional_collectives.py",
           "    if group_size != pg.size():\n",
           "    if group_size > pg.size():\n",
           "group_size compared with < instead of !=: a smaller group_size passes"),
]

# --------------------------------------------------------------------------------------
# 2. Comm lowering (CL)
# --------------------------------------------------------------------------------------
_CL = "refimpl/comm_lowering.py"
CL = [
    Mutant("one_shot_threshold_exclusive", "CL-10", _CL,
           "    if size > config.one_shot_all_reduce_threshold_bytes:\n",
           "    if size >= config.one_shot_all_reduce_threshold_bytes:\n",
           "the threshold compared with >= : an all_reduce of exactly the threshold misses"),
    Mutant("one_shot_for_avg_too", "CL-10", _CL,
           '    if reduce_op.lower() != "sum":\n',
           '    if reduce_op.lower() not in ("sum", "avg"):\n',
           "avg taken for a sum the one-shot kernel can do"),
    Mutant("one_shot_symm_mem_of_default_group", "CL-10", _CL,
           "    if not _symm_mem_enabled(group_name):\n",
           '    if not _symm_mem_enabled("0"):\n',
           "symmetric memory looked up for the default group, not the collective's"),
    Mutant("one_shot_any_floating_dtype", "CL-10", _CL,
           "    if val.dtype not in SUPPORTED_DTYPES:\n",
           "    if not val.dtype.is_floating_point:\n",
           "dtype support judged by 'floating', which lets float64 through"),
    Mutant("one_shot_without_comm_buffer_check", "CL-10", _CL,
           "    return comm_buffer_refusal(inp)\n",
           "    return None\n",
           "the last condition (realizable as a comm buffer) left out"),
    Mutant("in_place_on_shared_intermediate", "CL-3", _CL,
           "len(inp.users) == 1 and _is_contiguous(inp)",
           "len(inp.users) >= 1 and _is_contiguous(inp)",
           "the only-reader condition weakened: a second reader sees the reduced values"),
    Mutant("in_place_on_non_contiguous_intermediate", "CL-3", _CL,
           "len(inp.users) == 1 and _is_contiguous(inp)",
           "len(inp.users) == 1",
           "contiguity of the intermediate not checked"),
    Mutant("broadcast_reinplaced", "CL-8", _CL,
           "        clone = self.build.contiguous_clone(inp, before=node)\n"
           "        kernel = _ops_of(node).broadcast_.default\n",
           "        clone = self.in_place_input(inp, node)\n"
           "        kernel = _ops_of(node).broadcast_.default\n",
           "broadcast re-inplaced like all_reduce"),
    Mutant("one_shot_wait_kept", "CL-9", _CL,
           "            self.skip_waits(node, result)\n",
           "",
           "the wait of a blocking one-shot kernel kept in the graph"),
    Mutant("alloc_id_without_namespace", "CL-12", _CL,
           'raw = hashlib.sha256(f"{namespace}/{fingerprint}/{index}".encode()).digest()',
           'raw = hashlib.sha256(f"{fingerprint}/{index}".encode()).digest()',
           "alloc_id_namespace not mixed into the id"),
    Mutant("alloc_id_of_the_rank", "CL-12", _CL,
           'raw = hashlib.sha256(f"{namespace}/{fingerprint}/{index}".encode()).digest()',
           'raw = hashlib.sha256(f"{namespace}/{fingerprint}/{index}/'
           '{torch.distributed.get_rank()}".encode()).digest()',
           "a rank-dependent id: ranks rendezvous on different buffers"),
    Mutant("alloc_id_same_for_every_buffer", "CL-12", _CL,
           "            self.next_buffer += 1\n",
           "",
           "the buffer index never advances: every comm buffer of a graph shares one id"),
    Mutant("comm_buffer_escapes", "CL-13", _CL,
           "                return self.build.call(aten.clone.default, [arg], before=output)\n",
           "                return arg\n",
           "a comm buffer returned as the graph's output"),
    Mutant("no_copy_back_to_view", "CL-4", _CL,
           "            _replace(wait, self.build.call(aten.copy_.default, [inp, done], "
           "before=wait))\n",
           "            _replace(wait, done)\n",
           "the in-place result never copied back into the non-contiguous target"),
    Mutant("view_taken_for_a_fresh_intermediate", "CL-3", _CL,
           "_fx.COLLECTIVE_NAMESPACES or _returns_alias(node.target):",
           "_fx.COLLECTIVE_NAMESPACES:",
           "an op returning an alias (a view) taken for a fresh intermediate"),
    Mutant("alloc_id_full_64_bits", "CL-12", _CL,
           'return int.from_bytes(raw[:8], "big") >> 1',
           'return int.from_bytes(raw[:8], "big")',
           "all 64 bits of the digest kept: half the ids fall outside [0, 2**63)"),
    Mutant("fingerprint_without_shapes", "CL-12", _CL,
           'shape = (f"{val.dtype}{list(val.shape)}"',
           'shape = (f"{val.dtype}"',
           "the graph digest leaves shapes out: graphs that differ in a shape share ids"),
    Mutant("negative_threshold_accepted", "CL-16", _CL,
           "        if threshold < 0:\n",
           "        if threshold < 0 and self.auto_select:\n",
           "the threshold checked only when auto_select uses it"),
]

# --------------------------------------------------------------------------------------
# 3. Bucketing (BK)
# --------------------------------------------------------------------------------------
_BK = "refimpl/bucketing.py"
BK = [
    Mutant("cap_exclusive", "BK-3", _BK,
           "bucket.size_bytes + size > bucket.cap_bytes:",
           "bucket.size_bytes + size >= bucket.cap_bytes:",
           "a bucket that would exactly fill its cap is closed"),
    Mutant("cap_of_bucket_zero_for_all", "BK-3", _BK,
           "bucket = self._new_bucket(key, bucket.index + 1)",
           "bucket = self._new_bucket(key, bucket.index)",
           "the next bucket keeps index 0, so cap(0) is asked for every bucket"),
    Mutant("size_is_the_output", "BK-3", _BK,
           "return max(out.numel() * out.element_size(), inp.numel() * inp.element_size())",
           "return out.numel() * out.element_size()",
           "a member counted by its output only (a reduce_scatter's input is larger)"),
    Mutant("key_without_dtype", "BK-2", _BK,
           "    if not mixed_dtypes:\n        key += (_val(node).dtype,)",
           "    if mixed_dtypes:\n        key += (_val(node).dtype,)",
           "the dtype left out of the key (condition inverted)"),
    Mutant("key_without_reduce_op", "BK-2", _BK,
           "    if call.reduce_op is not None:\n",
           "    if call.reduce_op is None:\n",
           "the reduce op left out of the key (condition inverted)"),
    Mutant("key_reduce_op_case_sensitive", "BK-2", _BK,
           "        key += (call.reduce_op.lower(),)",
           "        key += (call.reduce_op,)",
           "'SUM' and 'sum' taken for different reduce ops"),
    Mutant("key_by_group_size", "BK-2", _BK,
           "    key: tuple = (call.group_name,)",
           "    key: tuple = (call.group_size,)",
           "groups told apart by their size, not their name"),
    Mutant("dependency_on_open_bucket_only", "BK-4", _BK,
           "upstream & (bucket.bit | bucket.reaches)",
           "upstream & bucket.bit",
           "dependency checked against the open bucket itself, not what reaches it"),
    Mutant("reach_not_propagated", "BK-4", _BK,
           "                if (other.bit | other.reaches) & upstream:",
           "                if other.bit & upstream:",
           "only buckets feeding the node directly learn that they reach its bucket"),
    Mutant("bucket_at_its_first_member", "BK-7", _BK,
           "return position[unit.members[-1]] if isinstance(unit, Bucket)",
           "return position[unit.members[0]] if isinstance(unit, Bucket)",
           "the merged collective placed where the bucket's first member was"),
    Mutant("slot_at_rank_modulo", "BK-8", _BK,
           "    return call.ranks.index(me)",
           "    return me % len(call.ranks)",
           "this rank's slot from rank % group size instead of its index in the group"),
    Mutant("padding_one_row_too_many", "BK-10", _BK,
           "    return -(-rows // group_size) * group_size",
           "    return (rows // group_size + 1) * group_size",
           "a full extra row of padding, even when the group size divides dim 0"),
    Mutant("unpad_keeps_padding", "BK-10", _BK,
           "    keep = max(0, min(chunk, rows - start))",
           "    keep = max(0, min(chunk, rows))",
           "the last rank's chunk keeps the padding rows"),
    Mutant("single_buckets_rewritten", "BK-5", _BK,
           "    buckets = [b for b in planner.plan(gm.graph) if len(b.members) > 1]",
           "    buckets = [b for b in planner.plan(gm.graph) if len(b.members) >= 1]",
           "a bucket of one is rewritten too"),
    Mutant("cast_with_two_readers_absorbed", "BK-9", _BK,
           "node.target not in _CASTS or len(node.users) != 1:",
           "node.target not in _CASTS or len(node.users) < 1:",
           "a cast that something else reads is absorbed into the copy-in"),
    Mutant("unknown_reduce_op_accepted", "BK-16", _BK,
           "reduce_op.lower() not in _fx.REDUCE_OPS:",
           "reduce_op.lower() not in _fx.REDUCE_OPS + ('median',):",
           "the reduce op checked against a list that is too long"),
    Mutant("group_size_unchecked", "BK-16", _BK,
           "    if size != len(ranks):\n",
           "    if size > len(ranks):\n",
           "group_size compared with > instead of !="),
    Mutant("wait_block_not_opened", "BK-17", _BK,
           '        self.block = (f"{kind}_wait", index)',
           '        self.block = (kind, index)',
           "the wait and copy-outs tagged as the collective's block"),
]

# --------------------------------------------------------------------------------------
# 6. Symmetric memory (SM), C kernels included
# --------------------------------------------------------------------------------------
SM: list[Mutant] = []

MUTANTS: list[Mutant] = [*FC, *CL, *BK, *SM]
