"""The sidecar's module layout (ARCHITECTURE.md, issue 29 item 7): no Rust module
under sidecar/src outgrows what one reader holds in mind, and dependencies point down.

Size rule: a module's size is the number of lines of its file before its test
module: every line counts (code, blank lines and comments alike), up to the first
``#[cfg(test)]`` at the start of a line that introduces a ``mod`` (the unit tests,
however many follow). A ``#[cfg(test)]`` on anything else (a test-only helper
function) does not end the count. A module over MAX_LINES is to be split by the
concepts it holds (a directory module ``x/mod.rs`` + submodules, re-exported).

Direction rules (ARCHITECTURE.md, "Dependencies point down only"), checked on the
whole text of each file, comments and doc links included, as a path
(``crate::x``, or ``super::…::x`` reaching the crate root):
- ``gate/`` names nothing of ``backend`` or ``engine``;
- ``engine/`` names nothing of ``metrics`` (the histogram it records into is
  ``crate::histogram``, below both);
- ``admin_http.rs`` and ``server/`` name nothing of ``daemon`` (the connection cap's
  numbers are ``crate::limits``).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Dict, Iterator, List, Tuple

import pytest

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "sidecar" / "src"
MAX_LINES = 650

# `#[cfg(test)]` at the start of a line, then (after blank lines, comments or other
# attributes) a `mod` item: the module's unit tests.
CFG_TEST = "#[cfg(test)]"


def rust_files() -> List[Path]:
    files = sorted(SRC.rglob("*.rs"))
    assert files, f"no Rust sources under {SRC}"
    return files


def lines_before_tests(text: str) -> int:
    """The module's size: every line before its top-level test module."""
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if not line.startswith(CFG_TEST):
            continue
        for nxt in lines[i + 1:]:
            s = nxt.strip()
            if not s or s.startswith("//") or s.startswith("#["):
                continue
            if re.match(r"(pub(\([^)]*\))?\s+)?mod\s", s):
                return i
            break
    return len(lines)


def test_the_size_rule_counts_every_line_up_to_the_test_module_only() -> None:
    text = (
        "//! header\n"
        "\n"
        "fn a() {}\n"
        "#[cfg(test)]\n"
        "fn helper() {}\n"  # not the test module: the count goes on
        "// comment\n"
        "#[cfg(test)]\n"
        "#[allow(dead_code)]\n"
        "mod tests {\n"
        "}\n"
    )
    assert lines_before_tests(text) == 6
    assert lines_before_tests("fn a() {}\n\n// c\n") == 3, "no tests: the whole file"
    assert lines_before_tests("    #[cfg(test)]\n    mod inner {}\n") == 2, (
        "only a top-level test module ends the count"
    )


def test_no_module_is_over_the_bound() -> None:
    sizes: Dict[str, int] = {}
    for p in rust_files():
        sizes[str(p.relative_to(ROOT))] = lines_before_tests(p.read_text(encoding="utf-8"))
    over = sorted(((n, f) for f, n in sizes.items() if n > MAX_LINES), reverse=True)
    assert not over, (
        f"Rust modules over {MAX_LINES} lines before their test module (every line "
        "counts; split each by the concepts it holds, see ARCHITECTURE.md):\n"
        + "\n".join(f"  {f}: {n} lines" for n, f in over)
    )


# (files the rule covers, the crate-level module they must not name, why)
DIRECTION: List[Tuple[str, str, str]] = [
    ("gate", "backend", "gate imports nothing of backend"),
    ("gate", "engine", "gate imports nothing of engine"),
    ("engine", "metrics", "engine imports nothing of metrics (use crate::histogram)"),
    ("server", "daemon", "server imports nothing of daemon (use crate::limits)"),
    ("admin_http.rs", "daemon", "admin_http imports nothing of daemon (use crate::limits)"),
]


def _covered(where: str) -> Iterator[Path]:
    path = SRC / where
    if path.is_file():
        yield path
    else:
        assert path.is_dir(), f"{path} is gone: update DIRECTION in {__file__}"
        yield from sorted(path.rglob("*.rs"))


def _names(text: str, module: str) -> List[Tuple[int, str]]:
    """Lines of `text` naming the crate-level `module` as a path: `crate::module`,
    or `super::`… (in these layers `super` chains only ever reach the crate root,
    none of them has a submodule of that name)."""
    pat = re.compile(rf"\b(?:crate|super)(?:::super)*::{module}\b")
    return [(i + 1, line.strip()) for i, line in enumerate(text.splitlines()) if pat.search(line)]


@pytest.mark.parametrize("where,module,why", DIRECTION, ids=[f"{w}-{m}" for w, m, _ in DIRECTION])
def test_dependencies_point_down(where: str, module: str, why: str) -> None:
    hits = []
    for p in _covered(where):
        for n, line in _names(p.read_text(encoding="utf-8"), module):
            hits.append(f"  {p.relative_to(ROOT)}:{n}: {line}")
    assert not hits, f"{why}, but:\n" + "\n".join(hits)


def test_the_direction_check_finds_an_upward_import() -> None:
    assert _names("use crate::metrics::histogram::Histogram;\n", "metrics") == [
        (1, "use crate::metrics::histogram::Histogram;")
    ]
    assert _names("x\n  max: super::super::daemon::fdlimit::X,\n", "daemon") == [
        (2, "max: super::super::daemon::fdlimit::X,")
    ]
    assert _names("use crate::metrics_extra::X;\nuse crate::histogram::H;\n", "metrics") == []
