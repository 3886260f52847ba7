"""Generated-program conformance (`python -m conformance --fuzz N`): hypothesis draws programs.

A *program* is a list of statements (`Stmt`) that renders to Python source
`def program(ops, *inputs): ...`, written against a functional-collectives op namespace
(`ops`: the backend's `functional_collectives.ops`) and a table `G` of group names. The
generator writes FSDP- and TP-like sequences: collectives of several groups
(WORLD and subgroups: a non-contiguous `[[0, 2], [1, 3]]` of 4 ranks, or on 2 ranks a
second group of the same ranks), plain, coalesced, in place (`all_reduce_`) and into an
`out=` buffer, each waited somewhere later; pipeline stages' exchanges (a receive from
the group rank before and a send to the one after, single or in one batch: a table `P`
of peers per group, FC-52); casts to bf16 or f16 before an all_gather, views,
compute of several shapes and dtypes, in-place ops and `out=` ops on buffers after their
wait, one-shot candidates with chains of pointwise steps around them (CL-10, CL-17), and
`refimpl_conformance::record_` (conformance/reorder_programs.py) as a barrier.
Every value is a small integer and the generator keeps each one below the size its dtype
holds exactly (a bound per value), so every reduction is exact in any order (CF-9) and any
difference is a real error. Stage options are drawn with the program.

Each program is checked per stage on real gloo ranks (2, or 4 for a program of 4-rank
groups), by a module-level rank function that takes the program's source
(`bucketing_on_rank`, `lowering_on_rank`, `reorder_on_rank`, `memory_on_rank`,
`e2e_on_rank`); the expectations come from the unoptimized program and from the judges of
this package (true_meta, bucket_model, lowering_model, reorder_rules,
memory_programs.measure_run), never from refimpl's passes.

Program `i` of `--seed S` is the program of seed `S + i`: the first example hypothesis
draws with that seed after the simplest one (which is the same for every seed). A stage
that fails is shrunk by hypothesis (a bounded number of reruns, `SHRINK_RUNS`) and its
record carries the shrunk program's source, its stage options and the command that
reruns it (`--fuzz 1 --seed S+i --section X`). Rank processes are started and warmed
before a stage is timed, and a stage run past its time limit is tried once more on fresh
ranks: on a machine other jobs load, starting them can take that long.

The modules, in the order they depend on each other:
- vocabulary.py: groups, dtypes, shapes, collectives, the stages (`STAGES`) and the
  program model (`Stmt`, `Program`, `Value`, `Pending`, `Case`);
- generator.py: the generator (`_Builder`) and the strategy `programs`;
- stage_options.py: the options of every stage, drawn with the program (`cases`), the bad
  options every rank must refuse (`BAD_OPTIONS`, `BAD_CAPS`) and `CL_VARIANTS`;
- on_rank.py: what the rank functions share (the program loaded and traced on a rank, runs
  compared, meta and refusals judged) and `ranks_ready`;
- bucketing_stage.py, lowering_stage.py, reorder_stage.py, memory_stage.py,
  e2e_stage.py: one stage's rank function each (BK, CL, RO, MEM, E2E) and its checks;
- runner.py: the run (`run`, its records, `load_error_record`), the hunt and shrinking of
  one stage on one program (`Fuzzer`), `program_of_seed` and `reproducer`.
"""

from conformance.fuzz.bucketing_stage import bucketing_on_rank
from conformance.fuzz.e2e_stage import e2e_on_rank
from conformance.fuzz.generator import programs
from conformance.fuzz.lowering_stage import lowering_on_rank
from conformance.fuzz.memory_stage import memory_on_rank
from conformance.fuzz.on_rank import ranks_ready
from conformance.fuzz.reorder_stage import reorder_on_rank, split_blocks
from conformance.fuzz.runner import (
    RANK_FUNCTIONS,
    SHRINK_RUNS,
    STAGE_TIMEOUT_S,
    START_TIMEOUT_S,
    Fuzzer,
    expected_rules,
    load_error_record,
    program_of_seed,
    reproducer,
    run,
)
from conformance.fuzz.stage_options import BAD_OPTIONS, CL_VARIANTS, cases
from conformance.fuzz.vocabulary import (
    DEFAULT_STAGES,
    DTYPES,
    GROUPS,
    STAGES,
    Case,
    Program,
    Stage,
    Stmt,
)

__all__ = [
    "BAD_OPTIONS", "CL_VARIANTS", "DEFAULT_STAGES", "DTYPES", "GROUPS", "RANK_FUNCTIONS",
    "SHRINK_RUNS", "STAGES", "STAGE_TIMEOUT_S", "START_TIMEOUT_S", "Case", "Fuzzer",
    "Program", "Stage", "Stmt", "bucketing_on_rank", "cases", "e2e_on_rank",
    "expected_rules", "load_error_record", "lowering_on_rank", "memory_on_rank",
    "program_of_seed", "programs", "ranks_ready", "reorder_on_rank", "reproducer", "run",
    "split_blocks",
]
