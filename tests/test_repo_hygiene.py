"""Repository hygiene (issue 24): nothing large or built is committed, and every
package's license field names the license in LICENSE, so a user reading any one of
them learns the same thing."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib", reason="reading TOML needs Python >= 3.11 (tomllib)")

ROOT = Path(__file__).resolve().parent.parent
MAX_BYTES = 1_000_000


def _tracked_sizes() -> dict[str, int]:
    """Every path in git's index with the size of its staged blob (what a commit
    holds, whether or not the file is still on disk)."""
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    staged = subprocess.run(
        ["git", "ls-files", "-s", "-z"], cwd=ROOT, capture_output=True, check=True, timeout=30
    ).stdout.decode()
    paths: dict[str, str] = {}
    for entry in filter(None, staged.split("\0")):
        meta, path = entry.split("\t", 1)
        mode, blob, _stage = meta.split()
        if mode != "160000":  # a submodule's commit is no blob
            paths[path] = blob
    sizes = subprocess.run(
        ["git", "cat-file", "--batch-check=%(objectname) %(objectsize)"],
        cwd=ROOT,
        input="\n".join(paths.values()) + "\n",
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    ).stdout.split("\n")
    by_blob = dict(line.split() for line in sizes if line)
    return {path: int(by_blob[blob]) for path, blob in paths.items()}


def test_no_tracked_file_over_one_megabyte() -> None:
    sizes = _tracked_sizes()
    assert "LICENSE" in sizes
    big = [f"{p} ({n} bytes)" for p, n in sizes.items() if n > MAX_BYTES]
    assert big == [], f"tracked files over 1 MB (build outputs?): {big}"


def _license_id() -> str:
    text = (ROOT / "LICENSE").read_text()
    if re.search(r"Apache License\s+Version 2\.0", text):
        return "Apache-2.0"
    raise AssertionError("LICENSE is not a license this test knows (Apache-2.0)")


def test_every_package_license_matches_license_file() -> None:
    expected = _license_id()
    found: dict[str, str] = {}
    cargo = tomllib.loads((ROOT / "Cargo.toml").read_text())
    found["Cargo.toml [workspace.package]"] = cargo["workspace"]["package"]["license"]
    for member in cargo["workspace"]["members"]:
        pkg = tomllib.loads((ROOT / member / "Cargo.toml").read_text())["package"]
        lic = pkg.get("license")
        if isinstance(lic, dict):  # license.workspace = true
            assert lic.get("workspace") is True, f"{member}: {lic}"
            lic = found["Cargo.toml [workspace.package]"]
        found[f"{member}/Cargo.toml"] = str(lic)
    py = tomllib.loads((ROOT / "bindings/python/pyproject.toml").read_text())["project"]
    lic = py["license"]
    found["bindings/python/pyproject.toml"] = lic["text"] if isinstance(lic, dict) else lic
    node = json.loads((ROOT / "bindings/node/package.json").read_text())
    found["bindings/node/package.json"] = node["license"]
    lock = json.loads((ROOT / "bindings/node/package-lock.json").read_text())
    found["bindings/node/package-lock.json (root)"] = lock["packages"][""]["license"]
    wrong = {k: v for k, v in found.items() if v != expected}
    assert wrong == {}, f"LICENSE says {expected}; these disagree: {wrong}"


def _version(v: str) -> tuple[int, ...]:
    return tuple(int(x) for x in v.split("."))


def test_rust_version_is_at_least_what_the_locked_dependencies_need() -> None:
    """Cargo.toml's rust-version is a promise: a toolchain that old builds the
    workspace. Every locked dependency's own rust-version must fit under it."""
    import shutil

    if shutil.which("cargo") is None:
        pytest.skip("cargo not on PATH")
    ours = tomllib.loads((ROOT / "Cargo.toml").read_text())["workspace"]["package"]["rust-version"]
    host = subprocess.run(
        ["rustc", "-vV"], capture_output=True, text=True, check=True, timeout=60
    ).stdout.split("host: ", 1)[1].split()[0]
    # --filter-platform: without it cargo wants every target's crates (windows-sys
    # and friends), which a build for this host never downloaded, so --offline
    # fails on a clean machine. The host's graph is what the promise is about here.
    cmd = ["cargo", "metadata", "--format-version", "1", "--locked", "--filter-platform", host]
    run = subprocess.run(cmd + ["--offline"], cwd=ROOT, capture_output=True, timeout=120)
    if run.returncode != 0:  # a crate the build did not fetch: ask the registry once
        run = subprocess.run(cmd, cwd=ROOT, capture_output=True, timeout=300)
    assert run.returncode == 0, run.stderr.decode(errors="replace")[-2000:]
    out = run.stdout
    needs = [
        (p["rust_version"], "%s %s" % (p["name"], p["version"]))
        for p in json.loads(out)["packages"]
        if p.get("rust_version")
    ]
    too_new = [n for v, n in needs if _version(v) > _version(ours)]
    assert too_new == [], "rust-version %s, but these need more: %s" % (ours, too_new)
