"""End-to-end, DESIGN §18 (limits learned from the provider), through the Python
binding against the real daemon and a fake upstream (stdlib ``http.server``) that
answers with each provider's rate-limit headers: ``run()`` picks them up from the
response (or the 429's exception) and the sidecar lowers its buckets; by hand with
``permit.limits``; an ``"auto"`` capacity learned; and two sidecars on one Redis,
where a header seen by one host lowers the level the other sees."""

from __future__ import annotations

import email.utils
import json
import threading
import time
import urllib.request
from datetime import datetime, timedelta, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Dict, Iterator

import pytest

import polygate
from .polygate_e2e import scope

pytestmark = pytest.mark.timeout(60)


def _headers(provider: str, tokens_left: int, requests_left: int) -> Dict[str, str]:
    """What each provider says when `tokens_left` tokens and `requests_left`
    requests are left (reset in 20 s)."""
    now = datetime.now(timezone.utc).replace(microsecond=0)
    if provider == "openai":
        return {"x-ratelimit-limit-tokens": "6000", "x-ratelimit-remaining-tokens": str(tokens_left),
                "x-ratelimit-reset-tokens": "20s", "x-ratelimit-limit-requests": "60",
                "x-ratelimit-remaining-requests": str(requests_left), "x-ratelimit-reset-requests": "20s"}
    if provider == "anthropic":
        reset = (now + timedelta(seconds=20)).isoformat().replace("+00:00", "Z")
        return {"date": email.utils.format_datetime(now, usegmt=True),
                "anthropic-ratelimit-tokens-limit": "6000", "anthropic-ratelimit-tokens-remaining": str(tokens_left),
                "anthropic-ratelimit-tokens-reset": reset, "anthropic-ratelimit-requests-limit": "60",
                "anthropic-ratelimit-requests-remaining": str(requests_left),
                "anthropic-ratelimit-requests-reset": reset}
    return {"x-ratelimit-remaining-tokens": str(tokens_left), "x-ratelimit-remaining-requests": str(requests_left)}


class Upstream:
    """A fake provider: every request answers `status` with `headers`."""

    def __init__(self) -> None:
        self.status = 200
        self.headers: Dict[str, str] = {}
        self.hits = 0
        up = self

        class H(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802
                up.hits += 1
                body = json.dumps({"ok": up.status == 200}).encode()
                self.send_response(up.status)
                for k, v in up.headers.items():
                    self.send_header(k, v)
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *a: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.url = "http://127.0.0.1:%d/v1/chat" % self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def call(self, permit: polygate.Permit):
        with urllib.request.urlopen(self.url, timeout=5) as r:
            r.read()
            return r


@pytest.fixture
def upstream() -> Iterator[Upstream]:
    u = Upstream()
    yield u
    u.server.shutdown()
    u.server.server_close()


def _bucket(status, name):
    for b in status["buckets"]:
        if b["bucket"] == name:
            return b
    raise KeyError(name)


def _near(level: float, expected: float, since: float, per_s: float) -> bool:
    """`level` is `expected`, plus at most what refilled (`per_s`) since `since`."""
    return expected - 1 <= level <= expected + per_s * (time.monotonic() - since + 0.05) + 1


SOURCE = {"name": "llm", "timeout": "5s", "tpm": 6000, "rpm": 60, "est_tokens": 10, "observe_limits": "on"}


@pytest.mark.parametrize("provider", ["openai", "anthropic", "azure"])
def test_run_reads_each_providers_headers_and_lowers_the_buckets(sidecar, upstream, provider):
    sidecar.write_config({"chat": scope(SOURCE)})
    sidecar.start()
    c = sidecar.client()
    upstream.headers = _headers(provider, tokens_left=1000, requests_left=10)
    t0 = time.monotonic()
    c.run("chat", upstream.call)
    st = sidecar.source_status(c, "llm")
    tpm, rpm = _bucket(st, "tpm"), _bucket(st, "rpm")
    assert _near(tpm["level"], 1000, t0, 100), tpm  # 5990 before; the provider says 1000
    assert _near(rpm["level"], 10, t0, 1), rpm
    assert tpm["observed"]["remaining"] == 1000 and rpm["observed"]["remaining"] == 10, st
    assert tpm["observed"]["removed"] >= 4980, tpm
    assert tpm["observed"]["limit"] == (None if provider == "azure" else 6000), tpm
    # More left than PolyGate thinks: nothing is raised (beyond the refill of the
    # time between the two readings: 100 tokens and one request per second).
    t1, tpm1, rpm1 = time.monotonic(), tpm["level"], rpm["level"]
    upstream.headers = _headers(provider, tokens_left=6000, requests_left=60)
    c.run("chat", upstream.call)
    st = sidecar.source_status(c, "llm")
    dt = time.monotonic() - t1 + 0.05
    assert _bucket(st, "tpm")["level"] <= tpm1 + 100 * dt, (st, dt)
    assert _bucket(st, "rpm")["level"] <= rpm1 + dt, (st, dt)


def test_a_429_with_nothing_left_blocks_the_source_until_the_reset(sidecar, upstream):
    sidecar.write_config({"chat": scope(SOURCE, max_attempts=1, quota_full="fail_fast")})
    sidecar.start()
    c = sidecar.client()
    upstream.status = 429
    upstream.headers = dict(_headers("openai", tokens_left=0, requests_left=5), **{"retry-after": "1"})
    with pytest.raises(polygate.PolyGateError):
        c.run("chat", upstream.call)
    st = sidecar.source_status(c, "llm")
    # retry-after 1 s, but no token left for 20 s: the reset wins.
    assert 18 < st["quota_blocked_s"] <= 20.1, st
    assert _bucket(st, "tpm")["observed"]["remaining"] == 0


def test_permit_limits_set_by_hand_and_ignored_without_observe(sidecars, upstream):
    for observe, expect in (("on", 200), ("off", 5990)):
        s = sidecars.new("obs-" + observe)
        s.write_config({"chat": scope(dict(SOURCE, observe_limits=observe))})
        s.start()
        c = s.client()
        t0 = time.monotonic()
        with c.call("chat") as call:
            p = call.acquire()
            p.limits = polygate.parse_headers({"x-ratelimit-remaining-tokens": "200"})[0]
            p.success(10)
        level = _bucket(s.source_status(c, "llm"), "tpm")["level"]
        assert _near(level, expect, t0, 100), (observe, level)


def test_permit_limits_take_a_mapping_of_the_limits_shape(sidecar):
    """Issue 29.2: ``permit.limits = {...}`` (the keys of polygate.Limits) reaches the
    sidecar like a Limits (it raised AttributeError inside the report before)."""
    sidecar.write_config({"chat": scope(SOURCE)})
    sidecar.start()
    c = sidecar.client()
    t0 = time.monotonic()
    with c.call("chat") as call:
        p = call.acquire()
        p.limits = {"tokens": {"limit": 6000, "remaining": 200, "reset_s": 20}, "requests": {"remaining": 5},
                    "age_s": 0}
        p.success(10)
        assert p.limits == polygate.Limits(requests=polygate.Limit(None, 5, None),
                                           tokens=polygate.Limit(6000, 200, 20.0))
    st = sidecar.source_status(c, "llm")
    tpm, rpm = _bucket(st, "tpm"), _bucket(st, "rpm")
    assert _near(tpm["level"], 200, t0, 100) and tpm["observed"]["remaining"] == 200, tpm
    assert _near(rpm["level"], 5, t0, 1) and rpm["observed"]["remaining"] == 5, rpm


@pytest.mark.parametrize("bad,error,needle", [
    (5, TypeError, "must be a polygate.Limits"),
    ([("tokens", {"remaining": 1})], TypeError, "must be a polygate.Limits"),
    ({"token": {"remaining": 1}}, TypeError, "unknown key.*'token'.*polygate.Limits has"),
    ({"tokens": 200}, TypeError, r"permit.limits\['tokens'\] must be a polygate.Limit"),
    ({"tokens": {"left": 1}}, TypeError, "unknown key.*'left'"),
    ({"tokens": {"remaining": -1}}, ValueError, "remaining"),
    ({"tokens": {"remaining": "5"}}, ValueError, "remaining"),
    ({"tokens": {"reset_s": "20s"}}, TypeError, "reset_s"),
    ({"age_s": "0.5"}, TypeError, "age_s"),
])
def test_permit_limits_of_a_wrong_type_fail_at_the_assignment(sidecar, bad, error, needle):
    sidecar.write_config({"chat": scope(SOURCE)})
    sidecar.start()
    c = sidecar.client()
    with c.call("chat") as call:
        p = call.acquire()
        with pytest.raises(error, match=needle):
            p.limits = bad
        assert p.limits is None  # nothing half-set: the report goes without limits
        p.success(10)
    assert sidecar.source_status(c, "llm")["in_flight"] == 0


def test_auto_capacity_is_learned_from_the_first_response(sidecar, upstream):
    src = {"name": "llm", "timeout": "5s", "tpm": "auto", "est_tokens": 10}
    sidecar.write_config({"chat": scope(src, quota_full="fail_fast")})
    sidecar.start()
    c = sidecar.client()
    st = sidecar.source_status(c, "llm")
    assert st["buckets"] == [], "nothing learned yet"
    # One call at a time until the first answer: a second call is refused.
    with c.call("chat") as held:
        p = held.acquire()
        with pytest.raises(polygate.AllSourcesExhausted):
            with c.call("chat") as other:
                other.acquire()
        upstream.headers = _headers("openai", tokens_left=4000, requests_left=59)
        p.limits = polygate.parse_headers(upstream.headers)[0]
        p.success(10)
    st = sidecar.source_status(c, "llm")
    tpm = _bucket(st, "tpm")
    assert tpm["auto"] is True and tpm["capacity"] == 6000, tpm
    assert tpm["level"] <= 4000 + 100 * 2, tpm  # 4000 left, refilling 100/s since
    c.run("chat", upstream.call)  # learned: admitted at once


def test_a_header_seen_by_one_host_lowers_the_level_the_other_sees(sidecars, redis_server, upstream):
    hosts = []
    for name in ("host-a", "host-b"):
        s = sidecars.new(name)
        s.write_config({"chat": scope(SOURCE)}, backend="redis", redis_url=redis_server.url,
                       key_prefix="pg-e2e-obs", redis_timeout="500ms")
        s.start()
        hosts.append((s, s.client()))
    (a, ca), (b, cb) = hosts
    upstream.headers = _headers("anthropic", tokens_left=500, requests_left=7)
    t0 = time.monotonic()
    ca.run("chat", upstream.call)
    st = b.source_status(cb, "llm")
    assert _near(_bucket(st, "tpm")["level"], 500, t0, 100), st
    assert _near(_bucket(st, "rpm")["level"], 7, t0, 1), st
    assert _bucket(st, "tpm")["observed"]["remaining"] == 500, st
    # A call in flight on B is subtracted from what A's next header says.
    with cb.call("chat", est_tokens=100) as call:
        call.acquire()
        upstream.headers = _headers("anthropic", tokens_left=400, requests_left=6)
        t0 = time.monotonic()
        ca.run("chat", upstream.call)
        st = a.source_status(ca, "llm")
        assert _near(_bucket(st, "tpm")["level"], 300, t0, 100), st  # 400 - B's 100 in flight
