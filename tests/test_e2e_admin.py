"""End-to-end: the HTTP admin listener of the real daemon (/live, /ready, /metrics)."""

from __future__ import annotations

import urllib.error
import urllib.request

from .polygate_e2e import free_port, scope


def _get(port: int, path: str):
    try:
        with urllib.request.urlopen("http://127.0.0.1:%d%s" % (port, path), timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_metrics_live_ready_on_the_admin_listener(sidecar):
    port = free_port()
    sidecar.write_config({"chat": scope("a", "b")}, admin_listen="127.0.0.1:%d" % port)
    sidecar.start()
    client = sidecar.client()
    with client.call("chat") as call:
        call.acquire().failure("server_error")
        call.acquire().success(tokens=5)
    assert _get(port, "/live") == (200, "live\n")
    assert _get(port, "/ready")[0] == 200
    status, text = _get(port, "/metrics")
    assert status == 200
    lines = set(text.splitlines())
    for expected in [
        'polygate_grants_total{source="a"} 1',
        'polygate_grants_total{source="b"} 1',
        'polygate_reports_total{source="a",outcome="failure"} 1',
        'polygate_reports_total{source="b",outcome="success"} 1',
        'polygate_breaker_state{source="a",state="closed"} 1',
        'polygate_scope_calls{scope="chat"} 0',
    ]:
        assert expected in lines, "%s missing from:\n%s" % (expected, text)
    assert _get(port, "/other")[0] == 404
