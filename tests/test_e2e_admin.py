"""End-to-end: the HTTP admin listener of the real daemon (/live, /ready, /metrics)."""

from __future__ import annotations

import re
import socket
import time
import urllib.error
import urllib.request

import pytest

from .polygate_e2e import free_port, scope, wait_until


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


# ------------------------------------------------------------------ issue 10.4, issue 14

_SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(?:[a-zA-Z_][a-zA-Z0-9_]*="(?:[^"\\\n]|\\[\\"n])*",?)*\})? (\S+)$')
_SUFFIXES = {"counter": ("_total", "_created"), "gauge": ("",), "info": ("_info",),
             "histogram": ("_bucket", "_sum", "_count", "_created")}


def parse_openmetrics(text: str):
    """Strict enough: `# EOF` last, every sample inside the family declared just before
    it with a suffix its TYPE allows, families declared once, values numbers. Returns
    {sample line without value: value}."""
    lines = text.split("\n")
    assert lines[-1] == "" and lines[-2] == "# EOF", "no # EOF at the end:\n%s" % text[-200:]
    families, current, ty, samples = set(), None, None, {}
    for line in lines[:-2]:
        if line.startswith("# "):
            kind, name = line.split(" ")[1:3]
            assert kind in ("HELP", "TYPE", "UNIT"), line
            if name != current:
                assert name not in families, "family %s declared twice" % name
                families.add(name)
                current, ty = name, None
            if kind == "TYPE":
                ty = line.split(" ")[3]
                assert ty in _SUFFIXES, line
            if kind == "UNIT":
                assert name.endswith("_" + line.split(" ")[3]), line
            continue
        m = _SAMPLE.match(line)
        assert m, "malformed sample line: %r" % line
        assert current and ty, "sample outside a typed family: %r" % line
        suffix = m.group(1)[len(current):] if m.group(1).startswith(current) else None
        assert suffix in _SUFFIXES[ty], "%r is not a %s sample of %s" % (line, ty, current)
        value = m.group(3)
        samples[line[: len(line) - len(value) - 1]] = float(value.replace("+Inf", "inf"))
    return samples


def test_idle_connections_cannot_fail_a_probe(sidecar):
    """Issue 10.4: 200 idle TCP connections (and 20 with half a request head) do not
    turn /live or /ready into 503 or a hang."""
    port = free_port()
    sidecar.write_config({"chat": scope("a")}, admin_listen="127.0.0.1:%d" % port)
    sidecar.start()
    idle = []
    try:
        for i in range(220):
            s = socket.create_connection(("127.0.0.1", port), timeout=5)
            if i % 11 == 0:
                s.sendall(b"GET /live HTTP/1.1\r\nHost: x\r\n")
            idle.append(s)
        t0 = time.monotonic()
        for path in ("/live", "/ready", "/metrics", "/live"):
            assert _get(port, path)[0] == 200, path
        assert time.monotonic() - t0 < 2.0
    finally:
        for s in idle:
            s.close()


@pytest.mark.timeout(90)
def test_scrapes_cost_redis_nothing_and_histograms_move(sidecar, redis_server):
    """Issue 10.4 / DESIGN §12: N scrapes of /metrics send Redis 0 commands (counted
    in INFO commandstats); the scrape parses as OpenMetrics; the histograms count the
    calls made."""
    port = free_port()
    s1 = {"name": "s1", "timeout": "5s", "tpm": 1000000, "rpm": 10000}
    sidecar.write_config({"chat": scope(s1, "s2"), "emb": scope(s1)},
                         backend="redis", redis_url=redis_server.url, key_prefix="pg-scrape",
                         redis_timeout="500ms", admin_listen="127.0.0.1:%d" % port,
                         metrics_refresh="1h")
    sidecar.start()
    client = sidecar.client()
    # The first refresh (at start) is the only one within the hour.
    wait_until(lambda: 'polygate_breaker_epoch{source="s1"}' in _get(port, "/metrics")[1],
               timeout=10, what="the first background refresh")
    samples = parse_openmetrics(_get(port, "/metrics")[1])
    key = 'polygate_acquire_wait_seconds_count{scope="chat"}'
    waits0 = samples[key]
    N = 200
    before = redis_server.commandstats()
    for _ in range(N):
        status, text = _get(port, "/metrics")
        assert status == 200
    after = redis_server.commandstats()
    delta = {k: after.get(k, 0) - before.get(k, 0) for k in after
             if after.get(k, 0) != before.get(k, 0) and k != "info"
             and k not in redis_server.HEARTBEAT_COMMANDS}  # once a second, not per scrape
    assert delta == {}, "%d scrapes sent Redis commands: %r" % (N, delta)
    parse_openmetrics(text)

    for _ in range(5):
        with client.call("chat") as call:
            call.acquire().success(tokens=5)
    samples = parse_openmetrics(_get(port, "/metrics")[1])
    assert samples[key] == waits0 + 5, samples[key]
    requests = sum(v for k, v in samples.items()
                   if k.startswith("polygate_request_duration_seconds_count{"))
    # At least two requests per call (protocol 2: Start + Finish; version 1 uses four).
    assert requests >= 5 * 2, "requests of 5 calls: %r" % requests
    assert samples['polygate_grants_total{source="s1"}'] == 5
    check_dashboard_names(samples)


def check_dashboard_names(samples) -> None:
    """examples/grafana-polygate.json only queries sample names a real scrape has."""
    import json
    from .polygate_e2e import REPO

    dash = json.loads((REPO / "examples" / "grafana-polygate.json").read_text())
    scraped = {k.split("{")[0] for k in samples}
    used = set()
    for panel in dash["panels"]:
        for t in panel.get("targets", []):
            assert t["refId"] and t["datasource"]["type"] == "prometheus", panel["title"]
            used |= set(re.findall(r"polygate_[a-z_]+", t["expr"]))
    assert len(used) >= 20, used
    assert used <= scraped, "the dashboard queries names /metrics lacks: %s" % sorted(used - scraped)


def test_metrics_follow_the_shared_backend_at_the_refresh_cadence(sidecar, redis_server):
    """The background refresh (not the scrape) brings another host's breaker change
    into /metrics within one period; its age is exported."""
    port = free_port()
    sidecar.write_config({"chat": scope("s1")}, backend="redis", redis_url=redis_server.url,
                         key_prefix="pg-refresh", redis_timeout="500ms",
                         admin_listen="127.0.0.1:%d" % port, metrics_refresh="200ms")
    sidecar.start()
    client = sidecar.client()
    client.force_open("s1", seconds=300)
    open_line = 'polygate_breaker_state{source="s1",state="open"}'
    wait_until(lambda: parse_openmetrics(_get(port, "/metrics")[1]).get(open_line) == 1.0,
               timeout=5, what="the open breaker in /metrics")
    samples = parse_openmetrics(_get(port, "/metrics")[1])
    assert 0 <= samples["polygate_shared_state_age_seconds"] < 1.0
    assert 290 < samples['polygate_breaker_retry_after_seconds{source="s1"}'] <= 300
