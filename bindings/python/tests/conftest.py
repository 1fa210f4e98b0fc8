import os
import sys
import tempfile

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # the package, when not pip-installed
sys.path.insert(0, HERE)

from fake_sidecar import FakeSidecar  # noqa: E402

# Set POLYGATE_TEST_SOCKET to run the behavioural tests against a real sidecar
# (its config must have the scope $POLYGATE_TEST_SCOPE, default "chat").
# Tests that script or inspect the fake are skipped then.
REAL_SOCKET = os.environ.get("POLYGATE_TEST_SOCKET")
SCOPE = os.environ.get("POLYGATE_TEST_SCOPE", "chat")


@pytest.fixture
def sockdir():
    # Unix socket paths are limited to ~108 bytes: keep them short.
    d = tempfile.mkdtemp(prefix="pg-", dir="/tmp")
    yield d
    for f in os.listdir(d):
        try:
            os.unlink(os.path.join(d, f))
        except OSError:
            pass
    os.rmdir(d)


@pytest.fixture
def fake(sockdir):
    """A scriptable fake sidecar (skipped when testing against a real one)."""
    if REAL_SOCKET:
        pytest.skip("needs the scriptable fake sidecar")
    f = FakeSidecar(os.path.join(sockdir, "s.sock")).start()
    yield f
    f.stop()


@pytest.fixture
def sidecar_path(sockdir):
    """Socket path of a sidecar: the real one if configured, else a fake."""
    if REAL_SOCKET:
        yield REAL_SOCKET
        return
    f = FakeSidecar(os.path.join(sockdir, "s.sock")).start()
    yield f.path
    f.stop()
