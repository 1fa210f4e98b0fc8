"""Every section citation in the repository resolves (docs/design.md §1).

Comments, commit-facing documents and tests cite the design contract as "DESIGN §N"
or a bare "§N", and the wire protocol as "PROTOCOL §N" / "PROTOCOL.md §N". These
tests collect every citation in the repository's tracked source and Markdown files
and check that the cited section exists as a numbered heading: design citations in
docs/design.md (``## 7a. Quotas as ...``), protocol citations in
bindings/PROTOCOL.md (``## 14. ...`` / ``### 14.4 ...``). A new citation of a
section neither document has fails here, naming the file and line.

Which document a citation means is read from the text just before the run of
citations it belongs to ("DESIGN §9, §10" is two design citations; "PROTOCOL.md
§2-§4, §14" four protocol ones): the nearer of "DESIGN" and "PROTOCOL" wins. A bare
citation means the design document, except inside PROTOCOL.md (its own sections);
a bare sub-numbered one (``§14.4``) that the design document lacks may name a
protocol section when its file mentions PROTOCOL.md.
"""

from __future__ import annotations

import os
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Set

import pytest

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parent.parent
DESIGN = ROOT / "docs" / "design.md"
PROTOCOL = ROOT / "bindings" / "PROTOCOL.md"
SELF = Path(__file__).resolve()

# Text files that may carry citations (source, docs, config, scripts, units).
SUFFIXES = {
    ".rs", ".py", ".pyi", ".ts", ".mts", ".cts", ".js", ".mjs", ".cjs", ".go", ".md",
    ".lua", ".toml", ".sh", ".service", ".socket", ".conf", ".yaml", ".yml", ".json",
    ".txt",
}
# Never ours to cite from: dependencies, build outputs, copies of the shared contract.
SKIP_DIRS = {
    ".git", "node_modules", "vendor", "target", ".venv", "venv", "dist", "build",
    "__pycache__", ".mypy_cache", ".pytest_cache", "shared",
}
MAX_BYTES = 2_000_000

# One citation: § (optionally a space) and a section number such as 5, 7a, 14.4.
REF = re.compile(r"§ ?(\d+[a-z]?(?:\.\d+)*)")
# What may separate two citations of one run: punctuation, spaces, comment
# leaders, "and"/"or"/"to" ("§9/§10", "§6–§9", "§1 and §2", "§7,\n//! §7a").
JOIN = re.compile(r"^(?:[\s,;/&+\-–—*#!]|//|--|\band\b|\bor\b|\bto\b)*$")
# How far back from a run's first citation its document's name may stand.
LOOKBACK = 48
# A numbered heading: "## 7a. Title", "### 14.4 Title", "## 11. Title".
HEADING = re.compile(r"^#{1,6}\s+(\d+[a-z]?(?:\.\d+)*)\.?\s", re.MULTILINE)


@dataclass(frozen=True)
class Citation:
    path: str
    line: int
    section: str
    # "design", "protocol", or "bare" (no document named before it).
    target: str


def tracked_files() -> List[Path]:
    """The repository's tracked files (git), else every file under the root."""
    try:
        out = subprocess.run(
            ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True, timeout=30
        ).stdout
        names = [n for n in out.decode("utf-8", "replace").split("\0") if n]
        files = [ROOT / n for n in names]
    except (OSError, subprocess.SubprocessError):
        files = []
        for dirpath, dirnames, filenames in os.walk(ROOT):
            dirnames[:] = [d for d in dirnames if d not in SKIP_DIRS]
            files.extend(Path(dirpath) / f for f in filenames)
    # A new document not yet added to git must be checked too.
    if DESIGN not in files:
        files.append(DESIGN)
    return files


def wanted(path: Path) -> bool:
    if path.resolve() == SELF:
        return False  # this file's examples cite missing sections on purpose
    rel = path.relative_to(ROOT)
    if any(part in SKIP_DIRS for part in rel.parts[:-1]):
        return False
    return path.suffix in SUFFIXES and path.is_file()


def read_text(path: Path) -> Optional[str]:
    try:
        data = path.read_bytes()
    except OSError:
        return None
    if len(data) > MAX_BYTES or b"\0" in data[:8192]:
        return None  # a binary or generated blob, not prose
    return data.decode("utf-8", "replace")


def citations_in(rel: str, text: str) -> Iterator[Citation]:
    """Every citation of ``text``, each tagged with the document it names."""
    matches = list(REF.finditer(text))
    target = "bare"
    prev_end = None
    for m in matches:
        starts_run = prev_end is None or not JOIN.match(text[prev_end:m.start()])
        if starts_run:
            before = text[max(0, m.start() - LOOKBACK):m.start()]
            d, p = before.rfind("DESIGN"), before.rfind("PROTOCOL")
            target = "bare" if d == p == -1 else ("protocol" if p > d else "design")
        prev_end = m.end()
        line = text.count("\n", 0, m.start()) + 1
        yield Citation(rel, line, m.group(1), target)


def headings(path: Path) -> Set[str]:
    return set(HEADING.findall(path.read_text(encoding="utf-8")))


def all_citations() -> List[Citation]:
    found: List[Citation] = []
    for path in tracked_files():
        if not wanted(path):
            continue
        text = read_text(path)
        if text is None or "§" not in text:
            continue
        found.extend(citations_in(path.relative_to(ROOT).as_posix(), text))
    return found


def unresolved(cites: List[Citation]) -> List[str]:
    design = headings(DESIGN)
    protocol = headings(PROTOCOL)
    mentions_protocol: Dict[str, bool] = {}
    bad = []
    for c in cites:
        target = c.target
        if target == "bare" and c.path == "bindings/PROTOCOL.md":
            target = "protocol"  # its own sections
        if target == "protocol":
            ok, where = c.section in protocol, "bindings/PROTOCOL.md"
        elif target == "design":
            ok, where = c.section in design, "docs/design.md"
        else:
            ok, where = c.section in design, "docs/design.md"
            if not ok and "." in c.section:
                if c.path not in mentions_protocol:
                    text = read_text(ROOT / c.path) or ""
                    mentions_protocol[c.path] = "PROTOCOL" in text
                ok = mentions_protocol[c.path] and c.section in protocol
                where = "docs/design.md or bindings/PROTOCOL.md"
        if not ok:
            bad.append(f"{c.path}:{c.line}: §{c.section} has no heading in {where}")
    return bad


# ---------------------------------------------------------------- the collector itself


def test_collector_reads_runs_and_their_document() -> None:
    filler = "x" * LOOKBACK
    text = (
        "see DESIGN §9, §10 and §12a;\n"
        "(bindings/PROTOCOL.md\n * §2–§4, §14)\n"
        f"{filler} the bare §5 here;\n"
        "PROTOCOL §14.4 / §4.8; DESIGN §11, §11a\n"
    )
    got = [(c.section, c.target, c.line) for c in citations_in("x.rs", text)]
    assert got == [
        ("9", "design", 1), ("10", "design", 1), ("12a", "design", 1),
        ("2", "protocol", 3), ("4", "protocol", 3), ("14", "protocol", 3),
        ("5", "bare", 4),
        ("14.4", "protocol", 5), ("4.8", "protocol", 5),
        ("11", "design", 5), ("11a", "design", 5),
    ]


def test_headings_parse_numbers_with_letters_and_subsections(tmp_path: Path) -> None:
    f = tmp_path / "d.md"
    f.write_text("# Title\n## 7a. Quotas\n### 14.4 `StatusJson`\n## 11. Wire\n## Notes\n")
    assert headings(f) == {"7a", "14.4", "11"}


def test_a_missing_section_is_reported_with_its_place() -> None:
    cites = [Citation("sidecar/src/x.rs", 3, "99", "design"),
             Citation("README.md", 7, "99.1", "protocol"),
             Citation("bench/y.rs", 1, "5", "bare")]
    assert unresolved(cites) == [
        "sidecar/src/x.rs:3: §99 has no heading in docs/design.md",
        "README.md:7: §99.1 has no heading in bindings/PROTOCOL.md",
    ]


# ---------------------------------------------------------------- the repository


def test_every_cited_section_has_a_heading() -> None:
    cites = all_citations()
    # The repository cites the contract hundreds of times; finding only a few means
    # the collector is broken, and an empty check would pass vacuously.
    assert len(cites) > 300, f"only {len(cites)} citations found"
    assert {"5", "7a", "11a", "11b", "12a", "15", "16"} <= {c.section for c in cites}
    bad = unresolved(cites)
    assert not bad, "citations without a section:\n" + "\n".join(bad)


def test_design_headings_are_unique_and_in_order() -> None:
    nums = HEADING.findall(DESIGN.read_text(encoding="utf-8"))
    assert len(nums) == len(set(nums)), f"duplicate section numbers: {nums}"

    def key(n: str) -> tuple:
        m = re.match(r"(\d+)([a-z]?)", n)
        assert m is not None
        return (int(m.group(1)), m.group(2))

    assert nums == sorted(nums, key=key), f"sections out of order: {nums}"
    for n in ["1", "2", "3", "4", "5", "6", "7", "7a", "8", "9", "10", "11", "11a",
              "11b", "12", "12a", "13", "14", "15", "16", "17", "18"]:
        assert n in nums, f"docs/design.md lost §{n}"


def test_readers_are_pointed_at_the_design_document() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert "docs/design.md" in readme
    assert "shared/" not in readme, "README still sends readers outside the repository"
    arch = (ROOT / "ARCHITECTURE.md").read_text(encoding="utf-8")
    assert "docs/design.md" in arch
    assert "`DESIGN.md`" not in arch
    design = DESIGN.read_text(encoding="utf-8")
    assert '"DESIGN §N"' in design.split("\n## ", 1)[0], "the note on citations is gone"
