"""End-to-end: DESIGN §12 "Bounded under abuse" as a Python worker sees it (issue 10).

A sidecar with hundreds of sources answers ``client.status()`` (a status reply is
the one exception to the frame limit: up to 16 MiB), and a long scope name comes
back as ``UnknownScope`` with its echo cut short, never as an internal error.
"""

from __future__ import annotations

import pytest

import polygate

from .polygate_e2e import scope


def _names(n):
    return ["source-%04d-%s" % (i, "n" * 90) for i in range(n)]


def test_status_of_600_sources_and_a_long_unknown_scope(sidecar):
    names = _names(600)
    sidecar.write_config({"chat": scope("a"), "big": scope(*names)})
    sidecar.start()
    client = sidecar.client()
    status = client.status()
    assert list(status["scopes"]["big"]["sources"]) == names
    with pytest.raises(polygate.SidecarError) as e:
        with client.call("x" * 60000) as call:
            call.acquire()
    assert e.value.kind == "unknown_scope", e.value
    assert len(str(e.value)) < 1000
    # The connection is fine afterwards.
    assert client.ping() >= 0
