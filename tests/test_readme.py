"""README's configuration reference lists every `[sidecar]` key the parser accepts
(the keys of `RawSidecar` in sidecar/src/config/raw.rs), so a newcomer finds each
one with its default."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _sidecar_keys() -> list[str]:
    src = (REPO / "sidecar" / "src" / "config" / "raw.rs").read_text()
    body = re.search(r"struct RawSidecar \{(.*?)\n\}", src, re.S)
    assert body is not None, "RawSidecar not found"
    keys = re.findall(r"^\s*pub (\w+): Option<", body.group(1), re.M)
    assert len(keys) > 10, keys
    return keys


def _table_rows() -> list[str]:
    readme = (REPO / "README.md").read_text()
    section = readme.split("## Configuration reference", 1)[1].split("\n## ", 1)[0]
    return [line for line in section.splitlines() if line.startswith("| `sidecar.")]


def test_every_sidecar_key_has_a_row() -> None:
    rows = _table_rows()
    # A row may name two keys: "| `sidecar.allowed_uids` / `allowed_gids` |".
    named = set()
    for row in rows:
        first = row.split("|")[1]
        named.update(re.findall(r"`(?:sidecar\.)?(\w+)`", first))
    missing = [k for k in _sidecar_keys() if k not in named]
    assert missing == [], "README's table lacks [sidecar] keys: %s" % missing
