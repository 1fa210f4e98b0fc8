"""Packaging (issue 14): `python -m build` makes a wheel and an sdist from a clean
copy of the binding, the version is the one in polygate/_version.py, the README is
the long description, and the wheel installs into a fresh venv and works there."""

import email
import os
import shutil
import subprocess
import sys
import tarfile
import zipfile

import pytest

import polygate

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(polygate.__file__)))


def _have_build():
    try:
        import build  # noqa: F401
        import setuptools  # noqa: F401
        import wheel  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.mark.timeout(240)
def test_wheel_and_sdist_build_install_and_import(tmp_path):
    if not _have_build():
        if os.environ.get("CI") == "true":
            pytest.fail("build / wheel / setuptools missing from the test venv (scripts/test.sh installs them)")
        pytest.skip("needs `pip install build wheel` (scripts/test.sh installs them)")
    version = polygate.__version__
    src = tmp_path / "src"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns("build", "dist", "*.egg-info", "__pycache__"))
    dist = tmp_path / "dist"
    # --no-isolation: the test venv's setuptools builds it, no download during the test
    r = subprocess.run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(dist), str(src)],
                       capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    wheel_path = dist / ("polygate-%s-py3-none-any.whl" % version)
    sdist_path = dist / ("polygate-%s.tar.gz" % version)
    assert sorted(p.name for p in dist.iterdir()) == sorted([wheel_path.name, sdist_path.name])

    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        readme = f.read()
    with zipfile.ZipFile(wheel_path) as z:
        names = set(z.namelist())
        meta = email.message_from_string(z.read("polygate-%s.dist-info/METADATA" % version).decode("utf-8"))
    for need in ("polygate/__init__.py", "polygate/aio.py", "polygate/py.typed", "polygate/_frames.py",
                 "polygate/_core/run.py", "polygate/_version.py"):
        assert need in names, need
    assert not any(n.startswith("tests/") for n in names)
    assert meta["Version"] == version and meta["Name"] == "polygate"
    assert meta["Requires-Python"] == ">=3.9"
    assert meta.get_all("Requires-Dist") is None, "the binding has no runtime dependencies"
    assert meta["Description-Content-Type"] == "text/markdown"
    assert meta.get_payload().strip() == readme.strip(), "the README is the long description"

    with tarfile.open(sdist_path) as t:
        members = {m.name.split("/", 1)[1] for m in t.getmembers() if "/" in m.name}
    for need in ("README.md", "pyproject.toml", "polygate/py.typed", "polygate/_core/run.py"):
        assert need in members, need
    assert not any(m.startswith("tests") for m in members), "tests need the repository: not in the sdist"

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    py = str(venv / "bin" / "python")
    r = subprocess.run([py, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps",
                        "--disable-pip-version-check", str(wheel_path)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    code = ("import os, polygate, polygate.aio\n"
            "from polygate import _core\n"
            "print(polygate.__version__)\n"
            "print(os.path.dirname(polygate.__file__))\n"
            "print(os.path.exists(os.path.join(os.path.dirname(polygate.__file__), 'py.typed')))\n"
            "print(_core.DEFAULT_CLIENT_NAME)\n")
    r = subprocess.run([py, "-c", code], capture_output=True, text=True, timeout=60, cwd=str(tmp_path),
                       env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert r.returncode == 0, r.stderr
    got_version, where, typed, client_name = r.stdout.split()
    assert got_version == version and where.startswith(str(venv)) and typed == "True"
    assert client_name == "polygate-python/" + version
