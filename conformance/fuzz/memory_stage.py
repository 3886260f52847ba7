"""The MEM stage on a rank (`memory_on_rank`): the backend's memory plan of a generated
program against what a real run allocates and frees (conformance/memory_programs.py:
MEM-1, MEM-2, MEM-3, MEM-5, MEM-9).
"""

from __future__ import annotations

from conformance.fuzz.on_rank import load_program, trace_program
from conformance.fuzz.vocabulary import STAGES, UPSTREAM_OPS


def memory_on_rank(spec: str, source: str, inputs, options) -> dict:
    """MEM: the backend's plan of the traced program is what a real run allocates and
    frees, node by node (memory_programs.measure_run). On the backend's own ops: a real
    run of upstream's eager collectives frees what they communicate at its last reader,
    where MEM-5 holds it to the wait (SPEC names the difference), so a program drawn on
    upstream's ops runs here on the backend's."""
    from conformance.memory_programs import measure_run

    source = source.replace(f"\n    {UPSTREAM_OPS}\n", "\n")
    backend, fn, xs, _ = load_program(spec, source, inputs)
    memory = backend.require("memory", *STAGES["MEM"].attrs)
    gm = trace_program(fn, xs)
    return {"problems": measure_run(gm, xs, memory.plan_memory(gm))}  # each names its rule
