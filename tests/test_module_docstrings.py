"""Each module of refimpl opens with a docstring that states its concept and the SPEC rules
it implements; what that line says must be what SPEC.md has.

A module that implements a whole section says so as `Implements SPEC.md section "Title":
P-1 .. P-n.`: the range must run from the section's first rule to its last, so a rule
added to SPEC.md without its module's docstring catching up fails here. Every rule ID an
"Implements" sentence names must exist.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from conformance.spec import rule_ids, sections

ROOT = Path(__file__).resolve().parent.parent
MODULES = sorted(p for p in (ROOT / "refimpl").glob("*.py") if p.name != "__init__.py")
SECTION_RANGE = re.compile(
    r'Implements SPEC\.md section "(?:\d+\. )?([^"]+)": ([A-Z0-9]+)-(\d+) \.\. ([A-Z0-9]+)-(\d+)')
RULE = re.compile(r"\b([A-Z][A-Z0-9]*-\d+)\b")


def _docstring(path: Path) -> str:
    return ast.get_docstring(ast.parse(path.read_text())) or ""


def _implements_sentence(doc: str) -> str:
    """From "Implements" to the end of its paragraph."""
    start = doc.find("Implements")
    return doc[start:].split("\n\n", 1)[0] if start >= 0 else ""


@pytest.mark.parametrize("path", MODULES, ids=lambda p: p.name)
def test_the_module_says_what_it_implements_and_spec_has_it(path):
    doc = _docstring(path)
    assert doc, f"{path.name} has no docstring"
    sentence = _implements_sentence(doc)
    if not sentence:
        # Helpers (the harness, the native loader, ...) implement no rule of their own.
        assert not RULE.search(doc.split("\n\n", 1)[0]), \
            f"{path.name}: names SPEC rules but says not which it implements"
        return
    known = {rule for ids in rule_ids().values() for rule in ids}
    named = set(RULE.findall(sentence))
    assert named, f"{path.name}: 'Implements ...' names no rule: {sentence!r}"
    assert named <= known, f"{path.name}: names rules SPEC.md lacks: {sorted(named - known)}"
    whole = SECTION_RANGE.search(sentence)
    if whole is None:
        return
    title, first_prefix, first, last_prefix, last = whole.groups()
    titles = {prefix: t.split(". ", 1)[1] for prefix, t in sections().items()}
    assert titles.get(first_prefix) == title == titles.get(last_prefix), \
        f"{path.name}: section {title!r} is not the section of {first_prefix}"
    numbers = sorted(int(rule.rsplit("-", 1)[1]) for rule in rule_ids()[first_prefix])
    want = f"{first_prefix}-{numbers[0]} .. {first_prefix}-{numbers[-1]}"
    assert f"{first_prefix}-{first} .. {last_prefix}-{last}" == want, \
        f"{path.name} says it implements {first_prefix}-{first} .. {last_prefix}-{last}; " \
        f"SPEC.md's section {title!r} has {want}"
