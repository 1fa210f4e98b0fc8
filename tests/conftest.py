"""Fixtures for the end-to-end tests against the real `polygate-sidecar` binary.

* ``sidecar_bin``   – the daemon binary (`$POLYGATE_SIDECAR_BIN`, else target/debug).
* ``sidecars``      – a factory: ``sidecars.new(name)`` → a :class:`Sidecar` to
                      ``write_config(...)`` and ``start()``; every daemon is stopped
                      (SIGTERM, then SIGKILL) at teardown, and a failing test gets
                      the daemons' stderr appended to its report.
* ``redis_server``  – a throwaway redis-server on a free port (``kill()``,
                      ``restart()``, ``cli()``, ``commandstats()``); with CI=true a
                      Redis that cannot start fails the test, otherwise it skips.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from .polygate_e2e import RedisServer, Sidecar, sidecar_bin as _find_bin  # noqa: E402

try:  # the binding must be importable (installed in .venv, or from the checkout)
    import polygate  # noqa: F401
except ImportError:  # pragma: no cover
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bindings" / "python"))


@pytest.fixture(scope="session")
def sidecar_bin() -> Path:
    return _find_bin()


class _Sidecars:
    def __init__(self, binary: Path, tmp: Path) -> None:
        self.binary = binary
        self.tmp = tmp
        self.all = []

    def new(self, name: str = "sidecar") -> Sidecar:
        s = Sidecar(self.binary, self.tmp, name)
        self.all.append(s)
        return s

    def stop_all(self) -> None:
        for s in self.all:
            s.stop()


@pytest.fixture
def sidecars(sidecar_bin, tmp_path, request):
    # Short socket paths: AF_UNIX paths are limited to 108 bytes.
    import tempfile

    d = Path(tempfile.mkdtemp(prefix="pg-e2e-"))
    f = _Sidecars(sidecar_bin, d)
    yield f
    f.stop_all()
    rep = getattr(request.node, "rep_call", None)
    if rep is not None and rep.failed:
        for s in f.all:
            sys.stderr.write("\n----- stderr of %s -----\n%s\n" % (s.name, s.stderr()[-6000:]))
    import shutil

    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def sidecar(sidecars) -> Sidecar:
    """One daemon, not yet configured/started."""
    return sidecars.new("sidecar")


@pytest.fixture
def redis_server(tmp_path):
    srv = RedisServer(tmp_path / "redis")
    srv.start()
    yield srv
    srv.kill()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    if rep.when == "call":
        item.rep_call = rep
