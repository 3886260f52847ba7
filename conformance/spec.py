"""SPEC.md read as data: its sections and the IDs of its rules.

The runner's report, the check that every rule is named by a case (CF-10), the mutation
check and the scoreboard all take their list of sections and rules from SPEC.md itself,
so a section or a rule added there is picked up without touching them (as array-api-tests
derives its tests from the standard's text).

- A section is a heading `## N. Title (PREFIX)`; it is known as `"N. Title"`.
- A rule is a list item that opens with its bold ID: `- **PREFIX-n** ...`.

Implements the parsing behind CF-7 and CF-10 (SPEC.md section 7).
"""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path

__all__ = ["SPEC_PATH", "sections", "rule_ids", "section_prefix", "section_title"]

# SPEC.md sits at the repository root; an installed package without it knows no titles.
SPEC_PATH = Path(__file__).resolve().parent.parent / "SPEC.md"
_SECTION = re.compile(r"^## (\d+\. .+?) \(([A-Z][A-Z0-9]*)\)\s*$", re.MULTILINE)
_RULE = re.compile(r"^- \*\*([A-Z][A-Z0-9]*-\d+)\*\*", re.MULTILINE)


@cache
def _text(path: Path = SPEC_PATH) -> str:
    return path.read_text() if path.exists() else ""


def sections(path: Path = SPEC_PATH) -> dict[str, str]:
    """{prefix: title} in the order of SPEC.md, e.g. {"FC": "1. Functional collectives"}."""
    return {prefix: title for title, prefix in _SECTION.findall(_text(path))}


def rule_ids(path: Path = SPEC_PATH) -> dict[str, list[str]]:
    """{prefix: [rule IDs in the order written]} for every section (empty ones included)."""
    ids = {prefix: [] for prefix in sections(path)}
    for rule in _RULE.findall(_text(path)):
        ids.setdefault(section_prefix(rule), []).append(rule)
    return ids


def section_prefix(spec_id: str) -> str:
    """The section prefix of a SPEC ID: 'FC' for 'FC-12'."""
    return spec_id.rsplit("-", 1)[0]


def section_title(prefix: str, path: Path = SPEC_PATH) -> str:
    """'1. Functional collectives' for 'FC'; the prefix itself if SPEC.md has no such section."""
    return sections(path).get(prefix, prefix)
