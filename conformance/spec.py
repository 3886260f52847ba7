"""SPEC.md read as data: its sections and the IDs of its rules.

The runner's report, the check that every rule is named by a case (CF-10), the mutation
check and the scoreboard all take their list of sections and rules from SPEC.md itself,
so a section or a rule added there is picked up without touching them (as array-api-tests
derives its tests from the standard's text).

- A section is a heading `## N. Title (PREFIX)`; it is known as `"N. Title"`.
- A rule is a list item that opens with its bold ID and its level:
  `- **PREFIX-n** [core] ...` (or `[strict]`, `[extension]`; CF-14).
- A case has the level of its most demanding rule (core < strict < extension), and a
  profile is the set of levels a run judges (CF-15).
- The op table is the appendix's `### Ops` table, one row per op, and its ops left out
  the `### Ops left out` table with the reasons listed under it (`op_table`,
  `ops_left_out`; conformance/ops.py reads them for the judge).

Implements the parsing behind CF-7, CF-10, CF-14 and CF-15 (SPEC.md section 7).
"""

from __future__ import annotations

import hashlib
import re
from functools import cache
from pathlib import Path

__all__ = ["SPEC_PATH", "LEVELS", "PROFILES", "sections", "rule_ids", "rule_levels",
           "rules_of_levels", "section_prefix", "section_title", "case_level",
           "profile_levels", "spec_sha256", "op_table", "ops_left_out"]

# SPEC.md sits at the repository root; an installed package without it knows no titles.
SPEC_PATH = Path(__file__).resolve().parent.parent / "SPEC.md"
_SECTION = re.compile(r"^## (\d+\. .+?) \(([A-Z][A-Z0-9]*)\)\s*$", re.MULTILINE)
# A rule's bold ID, then its level when written (CF-14).
_RULE = re.compile(r"^- \*\*([A-Z][A-Z0-9]*-\d+)\*\*(?: \[([a-z]+)\])?", re.MULTILINE)
# The levels in the order a profile adds them (CF-14): what upstream's contract demands,
# what refimpl guarantees on top of it, what upstream has no counterpart of.
LEVELS = ("core", "strict", "extension")
# A profile judges the rules of its levels (CF-15); `core-vN` profiles are frozen lists of
# cases (conformance/levels/core-vN.txt) and judge the core rules.
PROFILES = {"core": ("core",), "strict": ("core", "strict"), "full": LEVELS}


@cache
def _text(path: Path = SPEC_PATH) -> str:
    return path.read_text() if path.exists() else ""


def sections(path: Path = SPEC_PATH) -> dict[str, str]:
    """{prefix: title} in the order of SPEC.md, e.g. {"FC": "1. Functional collectives"}."""
    return {prefix: title for title, prefix in _SECTION.findall(_text(path))}


def rule_ids(path: Path = SPEC_PATH) -> dict[str, list[str]]:
    """{prefix: [rule IDs in the order written]} for every section (empty ones included)."""
    ids = {prefix: [] for prefix in sections(path)}
    for rule, _ in _RULE.findall(_text(path)):
        ids.setdefault(section_prefix(rule), []).append(rule)
    return ids


def rule_levels(path: Path = SPEC_PATH) -> dict[str, str | None]:
    """{rule ID: its level} in SPEC.md's order; None for a rule written without one, or
    with a word that is not a level (a test fails for either: CF-14)."""
    return {rule: (level if level in LEVELS else None)
            for rule, level in _RULE.findall(_text(path))}


def rules_of_levels(levels, path: Path = SPEC_PATH) -> dict[str, list[str]]:
    """rule_ids() keeping the rules whose level is one of `levels`; a rule written without
    a level counts as an extension (as in case_level)."""
    of_rule = rule_levels(path)
    return {prefix: [i for i in ids if (of_rule.get(i) or LEVELS[-1]) in levels]
            for prefix, ids in rule_ids(path).items()}


def case_level(spec_ids, levels: dict[str, str | None] | None = None) -> str:
    """The level of a case naming `spec_ids`: that of its most demanding rule (CF-14). A
    rule SPEC.md does not level counts as the most demanding, so that it is never judged
    as core by accident."""
    levels = rule_levels() if levels is None else levels
    rank = [LEVELS.index(levels[i]) if levels.get(i) in LEVELS else len(LEVELS) - 1
            for i in spec_ids]
    return LEVELS[max(rank, default=0)]


def profile_levels(profile: str) -> tuple[str, ...]:
    """The levels `--profile` judges: PROFILES's, and core for a frozen `core-vN` list."""
    if profile in PROFILES:
        return PROFILES[profile]
    if re.fullmatch(r"core-v\d+", profile):
        return ("core",)
    raise ValueError(f"--profile {profile!r}: expected one of {', '.join(PROFILES)} or "
                     f"core-vN (a frozen list of conformance/levels/) [CF-15]")


def spec_sha256(path: Path = SPEC_PATH) -> str:
    """The SHA-256 of SPEC.md's bytes: which text a report judged by (CF-7)."""
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.exists() else ""


def section_prefix(spec_id: str) -> str:
    """The section prefix of a SPEC ID: 'FC' for 'FC-12'."""
    return spec_id.rsplit("-", 1)[0]


def section_title(prefix: str, path: Path = SPEC_PATH) -> str:
    """'1. Functional collectives' for 'FC'; the prefix itself if SPEC.md has no such section."""
    return sections(path).get(prefix, prefix)


# --------------------------------------------------------------------------------------
# The op table (SPEC.md's appendix): what every communication op is
# --------------------------------------------------------------------------------------
_APPENDIX = "## Appendix: the op table"
_REASON = re.compile(r"^- \*([^*]+)\*: (.+?)(?=^- |\Z)", re.MULTILINE | re.DOTALL)


def _subsection(heading: str, path: Path) -> str:
    """The text under the appendix's `heading` line, up to the next heading."""
    text = _text(path)
    start = text.find(_APPENDIX)
    if start < 0:
        return ""
    lines, inside, found = text[start:].splitlines(), False, []
    for line in lines[1:]:
        if line.startswith("#"):
            if inside:
                break
            inside = line.strip() == heading
        elif inside:
            found.append(line)
    return "\n".join(found)


def _cell(text: str) -> str:
    text = text.strip().replace("`", "")
    return "" if text == "—" else text


def _table(text: str) -> list[dict[str, str]]:
    """The first markdown table of `text`: a dict per row, by lower-case column header."""
    rows = [line.strip().strip("|").split("|") for line in text.splitlines()
            if line.startswith("|")]
    if not rows:
        return []
    header = [_cell(c).lower() for c in rows[0]]
    return [dict(zip(header, map(_cell, row), strict=True)) for row in rows[2:]]


def op_table(path: Path = SPEC_PATH) -> list[dict[str, str]]:
    """The rows of the op table (the appendix's `### Ops`) in SPEC.md's order: a dict per
    op from each column's header in lower case (`namespace`, `op`, `family`,
    `completion`, `form`, `in flight`, `cost bytes`, `algorithm`, `lowering`) to its
    cell, code marks dropped and `—` read as ""."""
    return _table(_subsection("### Ops", path))


def ops_left_out(path: Path = SPEC_PATH) -> dict[tuple[str, str], str]:
    """{(namespace, op): reason} of the ops the table leaves out (`### Ops left out`): each
    row's reason word (`- *word*: ...` under the table) written out, less its full stop.
    A word the list does not define raises ValueError naming the op."""
    text = _subsection("### Ops left out", path)
    reasons = {word: " ".join(reason.split()).removesuffix(".")
               for word, reason in _REASON.findall(text)}
    left_out = {}
    for row in _table(text):
        if row["reason"] not in reasons:
            raise ValueError(f"SPEC.md's ops left out: {row['namespace']}::{row['op']} has "
                             f"the reason {row['reason']!r}, which the list under the table "
                             f"does not define (it has {sorted(reasons)})")
        left_out[row["namespace"], row["op"]] = reasons[row["reason"]]
    return left_out
