"""The default socket (DESIGN §12): the same rule as the sidecar's — root
``/run/polygate/sidecar.sock``, anyone else ``$XDG_RUNTIME_DIR/polygate/sidecar.sock``
— and ``connect()`` looks at ``path=``, then ``$POLYGATE_SOCKET``, then that."""

from __future__ import annotations


import pytest

import polygate
from polygate import _core


def test_root_uses_run_polygate() -> None:
    assert _core.default_socket(0, "/run/user/0") == "/run/polygate/sidecar.sock"
    assert _core.default_socket(0, None) == "/run/polygate/sidecar.sock"


def test_other_users_use_xdg_runtime_dir() -> None:
    assert _core.default_socket(1000, "/run/user/1000") == "/run/user/1000/polygate/sidecar.sock"
    assert _core.default_socket(1000, "/run/user/1000/") == "/run/user/1000/polygate/sidecar.sock"


@pytest.mark.parametrize("xdg", ["", "relative"])
def test_no_xdg_runtime_dir_names_what_to_set(xdg: str) -> None:
    with pytest.raises(polygate.SidecarError) as ei:
        _core.default_socket(1000, xdg)
    msg = str(ei.value)
    assert "uid 1000" in msg and "XDG_RUNTIME_DIR" in msg and "POLYGATE_SOCKET" in msg


def test_unset_xdg_runtime_dir_is_read_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_RUNTIME_DIR", "/run/user/4242")
    assert _core.default_socket(4242) == "/run/user/4242/polygate/sidecar.sock"
    monkeypatch.delenv("XDG_RUNTIME_DIR")
    with pytest.raises(polygate.SidecarError, match="XDG_RUNTIME_DIR"):
        _core.default_socket(4242)


def test_resolution_order(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("POLYGATE_SOCKET", "/env.sock")
    assert _core.resolve_path("/arg.sock") == "/arg.sock"
    assert _core.resolve_path(None) == "/env.sock"
    monkeypatch.delenv("POLYGATE_SOCKET")
    monkeypatch.setenv("XDG_RUNTIME_DIR", "/run/user/77")
    assert _core.resolve_path(None) == _core.default_socket()


def test_permission_error_names_the_setting() -> None:
    e = _core.connect_error("/x.sock", PermissionError(13, "Permission denied"))
    assert "Permission denied" in str(e) and "POLYGATE_SOCKET" in str(e)
    assert e.kind == "connection"
    # Not every error gets the hint.
    assert "POLYGATE_SOCKET" not in str(_core.connect_error("/x.sock", OSError(5, "I/O error")))
