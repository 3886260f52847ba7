"""The E2E stage on a rank (`e2e_on_rank`): a generated program compiled by torch.compile
with the backend's compile backend computes what eager does (E2E-3), or refuses an
aliasing collective naming it (E2E-7).
"""

from __future__ import annotations

import re

import torch

from conformance import ops
from conformance.fuzz.on_rank import differences_from_eager, load_program, observe, shortened
from conformance.fuzz.vocabulary import STAGES


def aliasing_collective(source: str) -> re.Match | None:
    """The first call in `source` of a collective that returns an alias of an argument (in
    place or `out=`, by the op table's Form): its compile may fail (E2E-7)."""
    names = sorted({op.name for op in ops.rows().values()
                    if op.is_collective and (op.in_place or op.out)})
    return re.search(rf"ops\.({'|'.join(map(re.escape, names))})\(", source)


def e2e_on_rank(spec: str, source: str, inputs, options) -> dict:
    """E2E: the program compiled by torch.compile with the backend's compile backend, its
    stages under the drawn options, computes what the eager program does (E2E-3: exactly,
    the values being small integers) and runs record_ as often with the same values; a
    program with an in-place or out= collective may instead be refused, naming it (E2E-7)."""
    backend, fn, xs, _ = load_program(spec, source, inputs)
    concept = backend.require("compile_backend", *STAGES["E2E"].attrs)
    want = observe(lambda: fn(*[x.clone() for x in xs]))
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend=concept.make(dict(options)))
    aliasing = aliasing_collective(source)
    try:
        got = observe(lambda: compiled(*[x.clone() for x in xs]))
    except Exception as exc:  # what torch.compile raises is its own class
        if aliasing is None:
            raise
        named = aliasing.group(1) in str(exc)
        return {"problems": [] if named else [
            f"E2E-7: compiling {aliasing.group(1)} failed without naming it: "
            f"{shortened(str(exc), 3)}"]}
    return {"problems": differences_from_eager(want, got, "compiled", "E2E-3", "E2E-3")}
