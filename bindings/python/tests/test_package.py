"""The package's shape: one version, a sans-I/O core, Python 3.9 syntax, typed."""

import ast
import os
import re
import sys

import polygate
import polygate.aio
from polygate import _core

PKG = os.path.dirname(os.path.abspath(polygate.__file__))
ROOT = os.path.dirname(PKG)
SOURCES = sorted(
    os.path.join(d, f) for d, _, fs in os.walk(PKG) for f in fs if f.endswith(".py")
)


def test_version_lives_in_one_place():
    from polygate._version import __version__

    assert re.fullmatch(r"\d+\.\d+\.\d+([.-]?\w+)?", __version__), __version__
    assert polygate.__version__ == __version__
    assert _core.DEFAULT_CLIENT_NAME == "polygate-python/" + __version__
    with open(os.path.join(ROOT, "pyproject.toml"), encoding="utf-8") as f:
        pyproject = f.read()
    assert 'dynamic = ["version"]' in pyproject
    assert 'version = { attr = "polygate._version.__version__" }' in pyproject
    assert not re.search(r'^version\s*=\s*"', pyproject, re.M), "a second, literal version in pyproject.toml"
    # no other module spells the version out
    for path in SOURCES:
        if not path.endswith("_version.py"):
            with open(path, encoding="utf-8") as f:
                assert '"%s"' % __version__ not in f.read(), path


def test_sources_parse_as_python_39():
    for path in SOURCES:
        with open(path, encoding="utf-8") as f:
            ast.parse(f.read(), path, feature_version=(3, 9))


def _imports(path):
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.module.split(".")[0]


def test_core_and_wire_do_no_io():
    io_modules = {"socket", "asyncio", "select", "selectors", "subprocess"}
    core = [p for p in SOURCES if os.sep + "_core" + os.sep in p or p.endswith("_wire.py")]
    assert len(core) >= 5, core
    for path in core:
        assert not (set(_imports(path)) & io_modules), "%s imports %s" % (path, set(_imports(path)) & io_modules)


# The optional HTTP transports (DESIGN §17): each library is imported by its own
# module only, which a user imports only if they use that library.
OPTIONAL = {"httpx": "httpx.py", "httpx2": "httpx2.py"}


def test_no_runtime_dependencies():
    stdlib = set(sys.stdlib_module_names) if hasattr(sys, "stdlib_module_names") else None
    for path in SOURCES:
        for mod in _imports(path):
            if mod in ("polygate", "__future__"):
                continue
            if mod in OPTIONAL:
                assert path == os.path.join(PKG, OPTIONAL[mod]), "%s imports %s" % (path, mod)
                continue
            if stdlib is not None:
                assert mod in stdlib, "%s imports %s, not in the standard library" % (path, mod)


def test_sync_and_aio_share_the_bases():
    assert issubclass(polygate.Permit, _core.PermitBase) and issubclass(polygate.aio.Permit, _core.PermitBase)
    assert issubclass(polygate.Call, _core.CallBase) and issubclass(polygate.aio.Call, _core.CallBase)


def test_ships_py_typed():
    assert os.path.exists(os.path.join(PKG, "py.typed"))
    hints = polygate.Client.status.__annotations__
    assert "Status" in str(hints.get("return")), hints


def _python_blocks(text):
    blocks = []
    while "```python\n" in text:
        text = text[text.index("```python\n") + len("```python\n"):]
        blocks.append(text[:text.index("```")])
        text = text[text.index("```") + 3:]
    return blocks


def test_readme_quick_start_is_the_examples():
    """The root README's Python quick start leads with the transport (DESIGN §17):
    its first block is in examples/transport_openai.py, its second (run()) in
    examples/worker.py; e2e tests run both against the real daemon, so the quick
    start runs as written."""
    repo = os.path.dirname(os.path.dirname(ROOT))
    with open(os.path.join(repo, "README.md"), encoding="utf-8") as f:
        readme = f.read()
    section = readme[readme.index("## Python quick start"):]
    section = section[:section.index("\n## ")]
    blocks = _python_blocks(section)
    assert len(blocks) >= 2, blocks
    for block, example, needle in ((blocks[0], "transport_openai.py", "polygate.httpx.client("),
                                   (blocks[1], "worker.py", "client.run(")):
        with open(os.path.join(repo, "examples", example), encoding="utf-8") as f:
            text = f.read()
        assert block.strip() and _dedent_in(block, text), example
        assert needle in block


def _dedent_in(block, text):
    """``block`` appears in ``text``, possibly indented as a whole."""
    import textwrap

    lines = block.strip("\n").splitlines()
    for indent in range(0, 13, 4):
        if textwrap.indent("\n".join(lines), " " * indent) in text:
            return True
    return False
