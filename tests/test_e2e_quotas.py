"""End-to-end, DESIGN §7a (quotas as each provider counts them), through the Python
binding against the real daemon: `burst = "1s"` fleet-wide from a cold start (two
sidecars on one Redis), `tokens_charged = "estimate"`, ITPM/OTPM settlement (also
from an SDK-like usage object in `run()`), and a per-day limit."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest

import polygate
from .polygate_e2e import scope


def _bucket(status, name):
    for b in status["buckets"]:
        if b["bucket"] == name:
            return b
    raise KeyError(name)


def _max_in_window(times, window):
    """The most admissions inside any window of `window` seconds."""
    times = sorted(times)
    best, j = 0, 0
    for i, t in enumerate(times):
        while times[j] <= t - window:
            j += 1
        best = max(best, i - j + 1)
    return best


def _drive(clients, scope_name, seconds, per_client=3):
    """`per_client` threads per client, each acquiring and succeeding in a loop for
    `seconds`; returns the admission times (this machine's monotonic clock)."""
    times, lock = [], threading.Lock()
    stop_at = time.monotonic() + seconds
    errors = []

    def worker(client):
        try:
            while time.monotonic() < stop_at:
                with client.call(scope_name) as call:
                    p = call.acquire()
                    now = time.monotonic()
                    with lock:
                        times.append(now)
                    p.success(tokens=1)
        except polygate.PolyGateError as e:  # a stall at the end is fine
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(c,), daemon=True)
               for c in clients for _ in range(per_client)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=seconds + 15)
    assert not any(t.is_alive() for t in threads), "a worker hung"
    return times, errors


@pytest.mark.timeout(60)
def test_burst_1s_holds_limit_per_second_fleet_wide_from_a_cold_start(sidecars, redis_server):
    rpm = 120  # limit/60 = 2 per second
    srcs = {
        "paced": scope({"name": "az", "rpm": rpm, "burst": "1s", "timeout": "5s"},
                       stall_window="30s", poll_interval="10ms"),
        "minute": scope({"name": "az-minute", "rpm": rpm, "timeout": "5s"},
                        stall_window="30s", poll_interval="10ms"),
    }
    clients = []
    for name in ("host-a", "host-b"):
        s = sidecars.new(name)
        s.write_config(srcs, backend="redis", redis_url=redis_server.url, key_prefix="pg-burst",
                       redis_timeout="500ms")
        s.start()
        clients.append((s, s.client(), s.client(), s.client()))
    workers = [c for (_, *cs) in clients for c in cs]
    times, _ = _drive(workers, "paced", 3.2, per_client=2)
    # Client-side timestamps carry a few ms of reply jitter, so the window is 0.98 s.
    most = _max_in_window(times, 0.98)
    assert most <= rpm // 60 + 1, (most, sorted(t - times[0] for t in times))
    # Not starved either: 2 at the start, then 2 per second.
    assert len(times) >= 2 + 2 * 2.5, len(times)
    st = clients[0][0].source_status(clients[0][1], "az")
    assert _bucket(st, "rpm")["capacity"] == 2, st
    # The control: the default burst admits a minute's worth at once.
    times, _ = _drive(workers[:2], "minute", 0.6, per_client=2)
    assert _max_in_window(times, 0.98) > rpm // 60 + 1, len(times)


def test_estimate_charging_keeps_the_reservation(sidecar):
    sidecar.write_config({"chat": scope(
        {"name": "azure", "tpm": 600, "tokens_charged": "estimate", "timeout": "5s"},
        {"name": "openai", "tpm": 600, "timeout": "5s"},
        quota_full="fail_fast")})
    sidecar.start()
    client = sidecar.client()
    with client.call("chat", est_tokens=500) as call:
        p = call.acquire()
        assert p.source == "azure"
        p.success(tokens=100)
    left = sidecar.source_status(client, "azure")["tokens_available"]
    assert 95 < left < 140, f"charged the 500 reserved, not the 100 used: {left}"
    # The next call of 500 does not fit azure (100 left): it goes to openai, which
    # settles to the usage.
    with client.call("chat", est_tokens=500) as call:
        p = call.acquire()
        assert p.source == "openai"
        p.success(tokens=100)
    left = sidecar.source_status(client, "openai")["tokens_available"]
    assert 495 < left < 540, f"actual: charged the 100 used: {left}"


def test_input_and_output_limits_settle_the_split(sidecar):
    sidecar.write_config({"chat": scope(
        {"name": "claude", "rpm": 600, "itpm": 6000, "otpm": 6000, "timeout": "5s"})})
    sidecar.start()
    client = sidecar.client()
    st = sidecar.source_status(client, "claude")
    assert _bucket(st, "otpm")["capacity"] == 6000 and _bucket(st, "otpm")["level"] == 6000.0
    with client.call("chat", est_input_tokens=1000, est_output_tokens=200) as call:
        p = call.acquire()
        assert p.est_tokens == 1200
        mid = sidecar.source_status(client, "claude")
        assert 4995 < _bucket(mid, "itpm")["level"] < 5040, mid
        assert 5795 < _bucket(mid, "otpm")["level"] < 5850, mid
        p.success(input_tokens=400, output_tokens=500)
    st = sidecar.source_status(client, "claude")
    assert 5595 < _bucket(st, "itpm")["level"] < 5650, st
    assert 5495 < _bucket(st, "otpm")["level"] < 5560, st
    assert _bucket(st, "otpm")["debt"] == 0.0

    # run() takes the split from an Anthropic-style usage object, cache reads apart.
    def anthropic(permit):
        return SimpleNamespace(usage=SimpleNamespace(
            input_tokens=300, output_tokens=250, cache_read_input_tokens=5000))

    before = sidecar.source_status(client, "claude")
    client.run("chat", anthropic, est_input_tokens=300, est_output_tokens=100)
    after = sidecar.source_status(client, "claude")
    d_out = _bucket(before, "otpm")["level"] - _bucket(after, "otpm")["level"]
    d_in = _bucket(before, "itpm")["level"] - _bucket(after, "itpm")["level"]
    assert 150 < d_out <= 250, (d_out, before, after)  # 250 out, minus refill
    assert 270 < d_in <= 300, (d_in, before, after)  # 300 in, cache reads not counted

    # OpenAI-style usage: prompt_tokens minus cached, completion_tokens.
    def openai(permit):
        return {"usage": {"prompt_tokens": 500, "completion_tokens": 50, "total_tokens": 550,
                          "prompt_tokens_details": {"cached_tokens": 400}}}

    before = sidecar.source_status(client, "claude")
    client.run("chat", openai, est_input_tokens=100, est_output_tokens=100)
    after = sidecar.source_status(client, "claude")
    d_out = _bucket(before, "otpm")["level"] - _bucket(after, "otpm")["level"]
    assert 0 < d_out <= 50, (d_out, before, after)

    # A total alone settles both sides in proportion to the estimates (3 : 1).
    before = sidecar.source_status(client, "claude")
    with client.call("chat", est_input_tokens=300, est_output_tokens=100) as call:
        call.acquire().success(tokens=200)
    after = sidecar.source_status(client, "claude")
    d_out = _bucket(before, "otpm")["level"] - _bucket(after, "otpm")["level"]
    d_in = _bucket(before, "itpm")["level"] - _bucket(after, "itpm")["level"]
    assert 25 < d_out <= 50, (d_out, before, after)
    assert 125 < d_in <= 150, (d_in, before, after)


@pytest.mark.parametrize("backend", ["memory", "redis"])
def test_a_per_day_limit_refuses_with_the_days_wait(sidecars, redis_server, backend):
    s = sidecars.new("day")
    keys = {"backend": backend}
    if backend == "redis":
        keys.update(redis_url=redis_server.url, key_prefix=f"pg-day-{time.time_ns()}")
    s.write_config({"chat": scope({"name": "daily", "rpd": 2, "rpm": 600, "burst": "1s",
                                   "timeout": "5s"}, quota_full="fail_fast")}, **keys)
    s.start()
    client = s.client()
    for _ in range(2):
        with client.call("chat") as call:
            call.acquire().success(tokens=1)
    with client.call("chat") as call:
        with pytest.raises(polygate.AllSourcesExhausted) as ei:
            call.acquire()
    assert ei.value.reason == "quota_exhausted"
    # The longest wait over the buckets: one request of a per-day bucket of 2.
    assert 11.9 * 3600 < ei.value.retry_after_s <= 12 * 3600, ei.value.retry_after_s
    st = s.source_status(client, "daily")
    assert _bucket(st, "rpd")["capacity"] == 2 and _bucket(st, "rpd")["level"] < 0.01, st
