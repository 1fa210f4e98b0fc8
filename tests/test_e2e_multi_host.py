"""End-to-end, Redis backend (issue "Redis backend"): two daemons ("hosts") on one
redis-server with the same key_prefix share breaker and quota state."""

from __future__ import annotations

import threading
import time

import pytest

import polygate
from .polygate_e2e import scope, wait_until


@pytest.fixture
def two_hosts(sidecars, redis_server):
    """Start hosts A and B with the same scopes; returns a starter."""

    def start(scopes, **sidecar_keys):
        hosts = []
        for name in ("host-a", "host-b"):
            s = sidecars.new(name)
            keys = dict(backend="redis", redis_url=redis_server.url, key_prefix="pg-e2e",
                        redis_timeout="500ms")
            keys.update(sidecar_keys)
            s.write_config(scopes, **keys)
            s.start()
            hosts.append(s)
        a, b = hosts
        return a, a.client(), b, b.client()

    return start


def test_breaker_opened_on_a_is_open_on_b_with_remaining_cooldown(two_hosts):
    a, ca, b, cb = two_hosts({"chat": scope("s1", breaker={"failure_threshold": 2, "cooldown": "4s",
                                                            "max_cooldown": "1m"})})
    with ca.call("chat") as call:
        call.acquire().failure("server_error")
        permit = call.acquire()
        permit.failure("server_error")
    last = permit.result  # the failure went out with the block's end (Finish), answered Reported
    opened_at = time.monotonic()
    assert last.applied and last.state == "open", last
    assert 3.5 < last.retry_after_s <= 4.0, last
    time.sleep(0.5)
    with cb.call("chat") as call:
        with pytest.raises(polygate.CircuitOpenError) as ei:
            call.acquire()
    remaining = 4.0 - (time.monotonic() - opened_at)
    assert ei.value.per_source_reasons == {"s1": "circuit_open"}
    assert abs(ei.value.retry_after_s - remaining) < 0.4, (ei.value.retry_after_s, remaining)
    st = b.source_status(cb, "s1")
    assert st["state"] == "open", st
    assert 2.5 < st["retry_after_s"] <= 3.6, st
    assert st["degraded"] is False


def test_only_one_probe_across_hosts(two_hosts):
    a, ca, b, cb = two_hosts({"chat": scope("s1", breaker={"failure_threshold": 1, "cooldown": "300ms"})})
    with ca.call("chat") as call:
        permit = call.acquire()
        permit.failure("server_error")
    r = permit.result
    assert r.state == "open"
    time.sleep(0.45)

    # Both hosts race for the probe at the same moment.
    barrier = threading.Barrier(2)
    results = {}
    calls = {}

    def contend(name, client):
        call = client.call("chat").begin()
        calls[name] = call
        barrier.wait()
        try:
            results[name] = call.acquire()
        except polygate.PolyGateError as e:
            results[name] = e

    threads = [threading.Thread(target=contend, args=(n, c)) for n, c in (("a", ca), ("b", cb))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    try:
        granted = {n: r for n, r in results.items() if isinstance(r, polygate.Permit)}
        refused = {n: r for n, r in results.items() if not isinstance(r, polygate.Permit)}
        assert len(granted) == 1, "exactly one probe across both hosts, got %r" % results
        ((gname, permit),) = granted.items()
        ((rname, err),) = refused.items()
        assert permit.is_probe
        assert isinstance(err, polygate.CircuitOpenError), err
        assert err.retry_after_s == 0.0, "HALF_OPEN reports retry_after 0, got %r" % err.retry_after_s
        # The refused host sees HALF_OPEN too, and a further attempt there is still refused.
        other = cb if rname == "b" else ca
        other_host = b if rname == "b" else a
        st = other_host.source_status(other, "s1")
        assert st["state"] == "half_open", st
        assert st["retry_after_s"] == 0.0
        with other.call("chat") as call:
            with pytest.raises(polygate.CircuitOpenError) as ei:
                call.acquire()
        assert ei.value.retry_after_s == 0.0
        # Probe succeeds: both hosts can call at once (no lease in the memo).
        assert permit.success().state == "closed"
        for c in (ca, cb):
            with c.call("chat") as call:
                assert call.acquire().success().applied
    finally:
        for c in calls.values():
            c.end()


def test_token_quota_exhausted_on_a_refuses_on_b(two_hosts):
    src = {"name": "s1", "tpm": 1000, "timeout": "5s"}
    a, ca, b, cb = two_hosts({"chat": scope(src, quota_full="fail_fast")})
    with ca.call("chat", est_tokens=900) as call:
        p = call.acquire()
        assert p.est_tokens == 900
        p.success(tokens=900)
    with cb.call("chat", est_tokens=900) as call:
        with pytest.raises(polygate.AllSourcesExhausted) as ei:
            call.acquire()
    assert ei.value.reason == "quota_exhausted"
    assert ei.value.per_source_reasons == {"s1": "rate_limited"}
    tokens_b = b.source_status(cb, "s1")["tokens_available"]
    assert tokens_b is not None and tokens_b < 200, tokens_b


@pytest.mark.parametrize("admin", ["force_open", "force_open_then_close"])
def test_stale_outcome_is_fenced_across_hosts(two_hosts, admin):
    a, ca, b, cb = two_hosts({"chat": scope("s1", breaker={"failure_threshold": 1})})
    epoch0 = a.source_status(ca, "s1")["epoch"]
    with ca.call("chat") as call:
        permit = call.acquire()
        cb.force_open("s1", seconds=30)
        if admin == "force_open_then_close":
            cb.force_close("s1")
        permit.failure("server_error")
    r = permit.result  # sent as Finish when the block ended
    assert r.applied is False, "an outcome granted under an older epoch must be fenced out: %r" % (r,)
    if admin == "force_open":
        assert r.state == "open" and 28 < r.retry_after_s <= 30, r
    else:
        assert r.state == "closed" and r.retry_after_s == 0.0, r
    st = a.source_status(ca, "s1")
    assert st["epoch"] > epoch0
    assert st["window_failures"] == 0 and st["streak"] == 0, "fenced failure must not count: %r" % st
    if admin == "force_open_then_close":
        assert st["state"] == "closed"


def test_force_close_on_b_clears_memo_on_a(two_hosts):
    a, ca, b, cb = two_hosts({"chat": scope("s1")})
    cb.force_open("s1", seconds=300)
    with ca.call("chat") as call:
        with pytest.raises(polygate.CircuitOpenError) as ei:
            call.acquire()
    assert ei.value.retry_after_s > 290
    assert a.source_status(ca, "s1")["memo_remaining_s"] > 290, "A's refusal should have written the memo"
    cb.force_close("s1")
    t0 = time.monotonic()

    def a_can_call():
        with ca.call("chat") as call:
            try:
                p = call.acquire()
            except polygate.CircuitOpenError:
                return False
            p.success()
            return True

    wait_until(a_can_call, timeout=1.0, interval=0.01, what="host A to call after B's force_close")
    assert time.monotonic() - t0 < 1.0
    assert a.source_status(ca, "s1")["memo_remaining_s"] == 0.0


def test_rate_limited_retry_after_blocks_quota_on_every_host(two_hosts):
    src = {"name": "s1", "rpm": 600, "timeout": "5s"}
    a, ca, b, cb = two_hosts({"chat": scope(src, quota_full="fail_fast")})
    with ca.call("chat") as call:
        permit = call.acquire()
        permit.rate_limited(retry_after_s=5)
    assert permit.result.applied
    with cb.call("chat") as call:
        with pytest.raises(polygate.AllSourcesExhausted) as ei:
            call.acquire()
    assert ei.value.reason == "quota_exhausted"
    assert ei.value.per_source_reasons == {"s1": "rate_limited"}
    assert 4.0 < b.source_status(cb, "s1")["quota_blocked_s"] <= 5.0
    # 429 is backpressure, not failure
    st = b.source_status(cb, "s1")
    assert st["state"] == "closed" and st["window_failures"] == 0 and st["streak"] == 0, st


def test_killed_worker_probe_released_across_hosts(two_hosts, tmp_path):
    import os
    import signal
    import subprocess
    import sys

    a, ca, b, cb = two_hosts({"chat": scope({"name": "s1", "timeout": "60s"})})
    cb.force_open("s1", seconds=0.2)
    time.sleep(0.3)
    script = tmp_path / "worker.py"
    script.write_text(
        "import sys, time, polygate\n"
        "c = polygate.connect(sys.argv[1])\n"
        "call = c.call('chat').begin()\n"
        "p = call.acquire()\n"
        "print('PERMIT', int(p.is_probe), flush=True)\n"
        "time.sleep(3600)\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    w = subprocess.Popen([sys.executable, str(script), a.socket], stdout=subprocess.PIPE, env=env)
    try:
        assert w.stdout.readline().split() == [b"PERMIT", b"1"]
        with cb.call("chat") as call:
            with pytest.raises(polygate.CircuitOpenError) as ei:
                call.acquire()
        assert ei.value.retry_after_s == 0.0
    finally:
        w.send_signal(signal.SIGKILL)
        w.wait(5)

    def b_probes():
        with cb.call("chat") as call:
            try:
                p = call.acquire()
            except polygate.CircuitOpenError:
                return False
            ok = p.is_probe
            p.success()
            return ok or "not a probe"

    assert wait_until(b_probes, timeout=2.0, what="host B to get the probe after A's worker died") is True
    assert a.source_status(ca, "s1")["in_flight"] == 0
