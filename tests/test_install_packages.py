"""Install like a library (DESIGN §20, issue 31): scripts/package.sh builds the
platform wheel and the npm tarballs; the wheel goes into a fresh venv and the
tarballs into a fresh directory outside the repository, and from there
``polygate-sidecar --version`` runs and a gated openai call through the transport
autostarts a sidecar and reaches a local fake upstream — in Python, then in Node.

Needs the Node binding's dev dependencies (``npm ci`` in bindings/node: tsc, and
openai-node in the npm cache), so scripts/test.sh runs it as its own step after the
Node.js one. It packages the release binary when it is newer than every Rust source
(a no-op rebuild), else the debug build the tests already have (stripped: the
packaging is what is tested; docs/benchmarks.md has the release figures). The
figures it prints (``-s``) are for docs/benchmarks.md; none is asserted.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
import zipfile
from pathlib import Path
from typing import Dict, List

import pytest

from .fake_upstream import FakeUpstream, Reply
from .polygate_e2e import REPO, sidecar_bin

NODE_DIR = REPO / "bindings" / "node"
OPENAI_NODE = "https://registry.npmjs.org/openai/-/openai-6.49.0.tgz"  # bindings/node's lockfile pin

COMPLETION = {
    "id": "chatcmpl-1", "object": "chat.completion", "created": 0, "model": "gpt-4o",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "hello from upstream"},
                 "finish_reason": "stop"}],
    "usage": {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8},
}


def _newest_source_mtime() -> float:
    newest = (REPO / "Cargo.lock").stat().st_mtime
    for top in ("sidecar", "ipc-protocol", "examples"):
        for dirpath, _, files in os.walk(REPO / top):
            if "target" in dirpath:
                continue
            for f in files:
                newest = max(newest, os.stat(os.path.join(dirpath, f)).st_mtime)
    return newest


def _binary_to_package() -> Path:
    release = REPO / "target" / "release" / "polygate-sidecar"
    if release.exists() and release.stat().st_mtime >= _newest_source_mtime():
        return release
    return sidecar_bin()


def _clean_env(**extra: str) -> Dict[str, str]:
    """No repository on any path, no PolyGate or config override inherited."""
    env = {k: v for k, v in os.environ.items()
           if "__" not in k and not k.startswith(("POLYGATE_", "PYTHON", "VIRTUAL_ENV", "NODE_", "npm_"))}
    env["PATH"] = "/usr/local/bin:/usr/bin:/bin"
    env.update(extra)
    return env


def _sidecars_on(sock: Path) -> List[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                env = Path("/proc", entry, "environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"SIDECAR__SOCKET=" + os.fsencode(sock) in env:
                pids.append(int(entry))
    return pids


def _run(cmd: List[str], what: str, timeout: float = 120, **kw) -> subprocess.CompletedProcess:
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)
    assert r.returncode == 0, "%s failed (%d):\n%s\n%s" % (what, r.returncode, r.stdout[-3000:], r.stderr[-3000:])
    return r


@pytest.mark.timeout(420)
def test_packages_install_and_autostart_outside_the_repository(tmp_path):
    if not (NODE_DIR / "node_modules" / ".bin" / "tsc").exists() or shutil.which("npm") is None:
        if os.environ.get("CI") == "true":
            pytest.fail("bindings/node has no node_modules: scripts/test.sh runs this after `npm ci` there")
        pytest.skip("needs npm and `npm ci` in bindings/node (scripts/test.sh runs this after the Node.js step)")
    figures: Dict[str, float] = {}
    dist = tmp_path / "dist"
    binary = _binary_to_package()
    t = time.monotonic()
    _run(["bash", str(REPO / "scripts" / "package.sh")], "scripts/package.sh", timeout=300,
         env=dict(os.environ, DIST=str(dist), PYTHON=sys.executable, POLYGATE_PACKAGE_BIN=str(binary)))
    figures["package.sh (s)"] = time.monotonic() - t
    version = re.search(r'__version__ = "([^"]+)"',
                        (REPO / "bindings" / "python" / "polygate" / "_version.py").read_text()).group(1)
    wheels = sorted(p.name for p in dist.glob("polygate-%s-py3-none-*.whl" % version))
    assert len(wheels) == 2 and "polygate-%s-py3-none-any.whl" % version in wheels, wheels
    platform_wheel = dist / next(w for w in wheels if not w.endswith("-any.whl"))
    assert "manylinux_2_" in platform_wheel.name or "linux_" in platform_wheel.name
    figures["platform wheel (MB)"] = platform_wheel.stat().st_size / 1e6
    with zipfile.ZipFile(platform_wheel) as z:
        info = z.getinfo("polygate-%s.data/scripts/polygate-sidecar" % version)
        assert (info.external_attr >> 16) & 0o111, "the binary is executable in the wheel"
        wheel_meta = z.read("polygate-%s.dist-info/WHEEL" % version).decode()
        assert "Root-Is-Purelib: false" in wheel_meta and "Tag: py3-none-" + platform_wheel.name.split("-none-")[1][:-4] in wheel_meta
    main_tgz = dist / ("polygate-%s.tgz" % version)
    platform_tgzs = list(dist.glob("polygate-sidecar-*-%s.tgz" % version))
    assert main_tgz.exists() and len(platform_tgzs) == 1, sorted(os.listdir(dist))

    with FakeUpstream() as up:
        short = Path(tempfile.mkdtemp(prefix="pg-pkg-"))
        try:
            _python_part(tmp_path, short, platform_wheel, up, version, figures)
            _node_part(tmp_path, short, main_tgz, platform_tgzs[0], up, version, figures)
        finally:
            for sock in (short / "py" / "s.sock", short / "node" / "s.sock"):
                for pid in _sidecars_on(sock):
                    os.kill(pid, signal.SIGKILL)
            shutil.rmtree(short, ignore_errors=True)
    print("\ninstall figures: " + json.dumps({k: round(v, 2) for k, v in figures.items()}))


PY_CALL = """
import os, sys, time
t0 = time.monotonic()
import openai, polygate, polygate.httpx
assert polygate.__file__.startswith(sys.prefix), polygate.__file__
assert not any(p.startswith(%(repo)r + "/bindings") or p == %(repo)r for p in sys.path), sys.path
client = openai.OpenAI(api_key="sk-test", base_url=%(url)r + "/v1", http_client=polygate.httpx.client("chat"))
reply = client.chat.completions.create(model="gpt-4o", max_tokens=20,
                                       messages=[{"role": "user", "content": "hi"}])
print(reply.choices[0].message.content)
print(polygate.sidecar_path())
print("%%.3f" %% (time.monotonic() - t0))
"""


def _python_part(tmp_path: Path, short: Path, wheel: Path, up: FakeUpstream, version: str,
                 figures: Dict[str, float]) -> None:
    venv = tmp_path / "fresh-venv"
    t = time.monotonic()
    _run([sys.executable, "-m", "venv", str(venv)], "python -m venv")
    py = venv / "bin" / "python"
    _run([str(py), "-m", "pip", "install", "--quiet", "--no-index", "--no-deps", "--disable-pip-version-check",
          str(wheel)], "pip install the platform wheel")
    figures["venv + pip install (s)"] = time.monotonic() - t
    # openai and its dependencies come from the test venv (no registry here): a path
    # entry only, so nothing else of that venv (its editable polygate) is activated.
    site = Path(sysconfig.get_path("purelib", vars={"base": str(venv), "platbase": str(venv)}))
    (site / "zz-test-deps.pth").write_text(sysconfig.get_path("purelib") + "\n")

    exe = venv / "bin" / "polygate-sidecar"
    r = _run([str(exe), "--version"], "polygate-sidecar --version", env=_clean_env(), cwd=str(tmp_path))
    assert r.stdout.startswith("polygate-sidecar %s" % version), r.stdout

    up.queue(Reply.json(COMPLETION))
    sock = short / "py" / "s.sock"
    t = time.monotonic()
    r = _run([str(py), "-c", PY_CALL % {"repo": str(REPO), "url": up.url}], "the gated openai call",
             env=_clean_env(POLYGATE_AUTOSTART="1", POLYGATE_SOCKET=str(sock), SIDECAR__IDLE_EXIT="30s"),
             cwd=str(tmp_path), timeout=60)
    figures["python: autostart + first gated call (s)"] = time.monotonic() - t
    content, found, _ = r.stdout.split("\n", 2)
    assert content == "hello from upstream"
    assert found == str(exe), "sidecar_path() finds the wheel's binary: %s" % found
    assert up.hits == 1
    assert len(_sidecars_on(sock)) == 1, "one autostarted sidecar serves the socket"
    figures["empty venv to first gated call (s)"] = figures["venv + pip install (s)"] + \
        figures["python: autostart + first gated call (s)"]


NODE_CALL = """
import OpenAI from "openai";
import * as polygate from "polygate";
const t0 = Date.now();
const openai = new OpenAI({ apiKey: "sk-test", baseURL: process.argv[2] + "/v1", fetch: polygate.fetch({ scope: "chat" }) });
const reply = await openai.chat.completions.create({ model: "gpt-4o", max_tokens: 20, messages: [{ role: "user", content: "hi" }] });
console.log(reply.choices[0].message.content);
console.log(await polygate.sidecarPath());
console.log(((Date.now() - t0) / 1000).toFixed(3));
process.exit(0);
"""


def _node_part(tmp_path: Path, short: Path, main_tgz: Path, platform_tgz: Path, up: FakeUpstream,
               version: str, figures: Dict[str, float]) -> None:
    proj = tmp_path / "fresh-npm"
    proj.mkdir()
    (proj / "package.json").write_text('{"name": "fresh", "private": true, "type": "module"}\n')
    env = _clean_env(HOME=os.environ.get("HOME", "/root"))
    t = time.monotonic()
    _run(["npm", "install", "--offline", "--no-audit", "--no-fund", "--loglevel=error", str(main_tgz),
          str(platform_tgz), OPENAI_NODE], "npm install the tarballs", cwd=str(proj), env=env, timeout=180)
    figures["npm install (s)"] = time.monotonic() - t
    r = _run([str(proj / "node_modules" / ".bin" / "polygate-sidecar"), "--version"], "the npm bin shim",
             cwd=str(proj), env=env)
    assert r.stdout.startswith("polygate-sidecar %s" % version), r.stdout

    (proj / "call.mjs").write_text(NODE_CALL)
    up.queue(Reply.json(COMPLETION))
    sock = short / "node" / "s.sock"
    t = time.monotonic()
    r = _run(["node", "call.mjs", up.url], "the gated openai-node call", cwd=str(proj), timeout=60,
             env=dict(env, POLYGATE_AUTOSTART="1", POLYGATE_SOCKET=str(sock), SIDECAR__IDLE_EXIT="30s"))
    figures["node: autostart + first gated call (s)"] = time.monotonic() - t
    content, found, _ = r.stdout.split("\n", 2)
    assert content == "hello from upstream"
    assert found.startswith(str(proj / "node_modules" / "@polygate")), "the platform package's binary: %s" % found
    assert up.hits == 2
    assert len(_sidecars_on(sock)) == 1
