"""End-to-end, issue 9 ("one retry_after meaning, bounded cooldown level, backends
that agree, honest token charges, health that forgets"): one test per item, through
the Python binding against the real daemon, on the backend(s) the item concerns.
Each test names the DESIGN rule it holds."""

from __future__ import annotations

import signal
import time

import pytest

import polygate
from .polygate_e2e import scope, wait_until

TEST_TIMEOUT_S = 60


@pytest.fixture(autouse=True)
def _timeout():
    """Every test here ends within TEST_TIMEOUT_S (SIGALRM in the main thread)."""

    def expired(signum, frame):
        raise TimeoutError("test exceeded %ss" % TEST_TIMEOUT_S)

    old = signal.signal(signal.SIGALRM, expired)
    signal.alarm(TEST_TIMEOUT_S)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


@pytest.fixture(params=["memory", "redis"])
def start(request, sidecars, tmp_path):
    """Start one sidecar on the parametrised backend; returns (sidecar, client)."""

    def go(scopes, **keys):
        s = sidecars.new("semantics")
        if request.param == "redis":
            from .polygate_e2e import RedisServer

            srv = RedisServer(tmp_path / "redis")
            srv.start()
            request.addfinalizer(srv.kill)
            keys = dict(backend="redis", redis_url=srv.url, key_prefix="pg-sem",
                        redis_timeout="500ms", **keys)
        s.write_config(scopes, **keys)
        s.start()
        return s, s.client()

    go.backend = request.param
    return go


def src(sidecar, client, name="s1"):
    return sidecar.source_status(client, name)


# ---------------------------------------------------------------- item 1


def test_quota_refusals_report_when_the_quota_certainly_passes(start):
    """DESIGN §6, call-ending errors: quota_exhausted reports the time until the
    refusing gate certainly passes — a 429's block, or a token bucket's refill of
    debt plus the estimate — and a worker honouring it is not sent back into it."""
    s, c = start({"chat": scope("s1", quota_full="fail_fast"),
                  "tpm": scope({"name": "t1", "timeout": "5s", "tpm": 60, "est_tokens": 10},
                               quota_full="fail_fast")})
    with c.call("chat") as call:
        call.acquire().rate_limited(retry_after_s=1.0)
    with c.call("chat") as call:
        with pytest.raises(polygate.AllSourcesExhausted) as ei:
            call.acquire()
    e = ei.value
    assert e.reason == "quota_exhausted" and e.per_source_reasons == {"s1": "rate_limited"}, e
    assert 0.8 < e.retry_after_s <= 1.0, e.retry_after_s
    time.sleep(e.retry_after_s)
    with c.call("chat") as call:
        assert call.acquire().source == "s1", "honouring retry_after_s finds the block over"

    # One token per second: 100 used of a 10-token estimate leaves −40, so the next
    # estimate of 10 fits in 50 s.
    with c.call("tpm") as call:
        call.acquire().success(tokens=100)
    with c.call("tpm") as call:
        with pytest.raises(polygate.AllSourcesExhausted) as ei:
            call.acquire()
    assert ei.value.reason == "quota_exhausted"
    assert 49.0 < ei.value.retry_after_s <= 50.0, ei.value.retry_after_s


# ---------------------------------------------------------------- item 2


def test_cooldown_level_stops_at_k_max(start):
    """DESIGN §6: k never exceeds k_max, the smallest level with cooldown × 2^k ≥
    max_cooldown (100 ms × 2^2 = 400 ms here), however often the probe fails."""
    s, c = start({"chat": scope("s1", circuit_open="wait", max_attempts=6,
                                breaker={"failure_threshold": 1, "cooldown": "100ms",
                                         "max_cooldown": "400ms"})})
    with c.call("chat") as call:
        for attempt in range(1, 6):
            p = call.acquire()  # waits out each cooldown for the probe
            assert p.attempt == attempt and p.is_probe == (attempt > 1), p
            p.failure("server_error")  # sent with the next acquire, or the call's end
    st = src(s, c)
    assert (st["state"], st["cooldown_level"]) == ("open", 2), st
    assert 0.2 < st["retry_after_s"] <= 0.4, st


# ---------------------------------------------------------------- item 3


def test_an_idle_redis_breaker_keeps_the_level_memory_decays_to(sidecars, redis_server):
    """DESIGN §6 "on every backend alike": while CLOSED the level decays one step per
    max_cooldown on memory and on Redis the same way, and the Redis hash expires only
    once it reads as fresh (level 0), coming back at epoch 0."""
    cfg = {"chat": scope({"name": "s1", "timeout": "20ms"}, circuit_open="wait", max_attempts=6,
                         stall_window="10s",
                         breaker={"failure_threshold": 1, "cooldown": "20ms", "max_cooldown": "160ms",
                                  "window": "40ms"})}
    hosts = {}
    for backend in ("memory", "redis"):
        sc = sidecars.new(backend)
        keys = {"backend": backend}
        if backend == "redis":
            keys.update(redis_url=redis_server.url, key_prefix="pg-idle", redis_timeout="500ms")
        sc.write_config(cfg, **keys)
        sc.start()
        hosts[backend] = (sc, sc.client())
    closed_at, levels = {}, {}
    for backend, (sc, c) in hosts.items():
        with c.call("chat") as call:
            p = call.acquire()
            p.failure("server_error")
            for _ in range(3):  # three probe failures: k = 3 = k_max (20 ms × 8 = 160 ms)
                p = call.acquire()
                assert p.is_probe
                p.failure("server_error")
            p = call.acquire()
            r = p.success()
            closed_at[backend] = time.monotonic()
            assert r.state == "closed", r
        assert src(sc, c)["cooldown_level"] == 3, backend
        # One whole max_cooldown (160 ms) closed, not two: level 2.
        time.sleep(max(0.0, closed_at[backend] + 0.24 - time.monotonic()))
        levels[backend] = src(sc, c)["cooldown_level"]
        assert time.monotonic() - closed_at[backend] < 0.32, "too slow to sample"
    assert levels == {"memory": 2, "redis": 2}, levels
    # Decayed (480 ms) and idle past the basis: Redis let the hash go, memory kept it.
    key = "{pg-idle:s1}:b"
    wait_until(lambda: redis_server.cli("EXISTS", key).strip() == "0", timeout=5.0,
               what="the idle breaker hash to expire")
    assert time.monotonic() - closed_at["redis"] >= 0.48 + 0.64, "expired before decay + basis"
    for backend, (sc, c) in hosts.items():
        st = src(sc, c)
        assert (st["state"], st["cooldown_level"], st["streak"]) == ("closed", 0, 0), (backend, st)
    assert src(*hosts["redis"])["epoch"] == 0
    assert src(*hosts["memory"])["epoch"] > 0


# ---------------------------------------------------------------- item 4


def test_failures_are_charged_by_kind(sidecar):
    """DESIGN §7: a non-transient failure (bad_result, error: the upstream answered)
    is charged its reported tokens (`permit.failure(kind, tokens=)`, the protocol-2
    `FailureUsage` outcome), else the estimate; a transient one (timeout,
    connection, server_error) is refunded whatever it reports."""
    sidecar.write_config({"chat": scope({"name": "s1", "timeout": "5s", "tpm": 60_000},
                                        breaker={"failure_threshold": 100})})
    sidecar.start()
    c = sidecar.client()

    def level():
        return src(sidecar, c)["tokens_available"]

    # 1000 tokens per second refill; each step reads the level right after its call.
    expected = 60_000.0
    for kind, tokens, charged in [("bad_result", 300, 300), ("error", None, 1000),
                                  ("timeout", 300, 0), ("connection", None, 0),
                                  ("server_error", 5000, 0), ("error", 0, 0)]:
        with c.call("chat", est_tokens=1000) as call:
            p = call.acquire()
            assert p.source == "s1"
            p.failure(kind, tokens=tokens)
        expected -= charged
        got = level()
        # Never above what the charges leave (up to a little refill in between).
        assert expected - 1 <= got <= min(expected + 60, 60_000.0), (kind, tokens, got, expected)
        expected = got


# ---------------------------------------------------------------- item 5


def test_an_unusable_success_counts_as_a_failure_for_health(sidecar):
    """DESIGN §4/§8: a count_attempt=false success counts as a failure for the
    health selector (and the retry goes elsewhere), does not grow the pacer, and
    stays out of the breaker window."""
    sidecar.write_config({"chat": scope("a", "b", selector="health")})
    sidecar.start()
    c = sidecar.client()
    ceiling = src(sidecar, c, "a")["pacer_ceiling"]
    with c.call("chat") as call:
        p = call.acquire()
        assert p.source == "a", "equal health: config order"
        p.success(count_attempt=False)
        p = call.acquire()
        assert p.source == "b", "the retry is demoted away from the unusable source"
        p.success()
    a = src(sidecar, c, "a")
    assert a["pacer_ceiling"] == ceiling, a
    assert (a["window_successes"], a["window_failures"], a["streak"]) == (0, 0, 0), a
    for _ in range(3):
        with c.call("chat") as call:
            p = call.acquire()
            assert p.source == "b", "a ranks below b now"
            p.success()


# ---------------------------------------------------------------- item 6


def test_health_forgets_a_failure(sidecar):
    """DESIGN §4: success rate and latency decay with a half-life of the breaker
    window (500 ms here): a source that failed once is first again once the failure
    has aged, although the selector sent it nothing meanwhile."""
    sidecar.write_config({"chat": scope("a", "b", selector="health", breaker={"window": "500ms"})})
    sidecar.start()
    c = sidecar.client()
    with c.call("chat") as call:
        p = call.acquire()
        assert p.source == "a"
        p.failure("server_error")
    failed_at = time.monotonic()
    with c.call("chat") as call:
        p = call.acquire()
        assert p.source == "b", "a failed a moment ago"
        p.success()

    def first():
        with c.call("chat") as call:
            p = call.acquire()
            p.success()
            return p.source

    assert wait_until(lambda: first() == "a", timeout=10.0, interval=0.25, what="a to be first again")
    # Ten half-lives at most (rank buckets of 1 %), and not at once.
    assert 2.0 < time.monotonic() - failed_at < 6.0


# ---------------------------------------------------------------- item 7


def test_state_loss_drops_the_memo_on_every_host(sidecars, redis_server):
    """DESIGN §10: after FLUSHALL the shared breaker is CLOSED at epoch 0; a host
    that was memo-skipping the source notices the epoch went backwards (its memo
    re-check, at most once a second) and uses the source again long before the memo
    deadline (60 s here)."""
    cfg = {"chat": scope("s1", "s2", breaker={"failure_threshold": 1, "cooldown": "60s",
                                               "max_cooldown": "10m"})}
    hosts = []
    for name in ("host-a", "host-b"):
        sc = sidecars.new(name)
        sc.write_config(cfg, backend="redis", redis_url=redis_server.url, key_prefix="pg-loss",
                        redis_timeout="500ms")
        sc.start()
        hosts.append((sc, sc.client()))
    (a, ca), (b, cb) = hosts
    with ca.call("chat") as call:
        call.acquire().failure("server_error")
    assert src(a, ca, "s1")["state"] == "open"
    with cb.call("chat") as call:
        p = call.acquire()
        assert p.source == "s2", "B refused s1 (OPEN) and remembers it"
        p.success()
    st = src(b, cb, "s1")
    assert st["state"] == "open" and st["memo_remaining_s"] > 55, st
    assert "OK" in redis_server.cli("FLUSHALL")

    def b_uses_s1():
        with cb.call("chat") as call:
            p = call.acquire()
            p.success()
            return p.source == "s1"

    t0 = time.monotonic()
    wait_until(b_uses_s1, timeout=5.0, interval=0.1, what="host B to use s1 again")
    assert time.monotonic() - t0 < 3.0
    st = src(b, cb, "s1")
    assert (st["state"], st["memo_remaining_s"]) == ("closed", 0.0), st
    assert st["epoch"] < 3, "a fresh breaker after the loss: %r" % st
    assert "epoch went backwards" in b.stderr()


# ---------------------------------------------------------------- item 8


def test_a_429_block_is_capped_by_max_rate_limit_block(sidecars, redis_server):
    """DESIGN §7: a 429's retry_after blocks the source for every host for at most
    max_rate_limit_block (default 10 min); longer values are accepted and cut to
    it. The key is set here through its environment override."""
    cfg = {"chat": scope("s1", quota_full="fail_fast")}
    hosts = []
    for name, env in (("default", {}), ("capped", {"SIDECAR__MAX_RATE_LIMIT_BLOCK": "1s"})):
        sc = sidecars.new(name)
        sc.write_config(cfg, backend="redis", redis_url=redis_server.url, key_prefix="pg-" + name,
                        redis_timeout="500ms")
        sc.start(env=env)
        hosts.append((sc, sc.client()))
    (d, cd), (k, ck) = hosts
    with cd.call("chat") as call:
        call.acquire().rate_limited(retry_after_s=10 * 86_400.0)  # accepted, not refused
    st = src(d, cd)
    assert 590 < st["quota_blocked_s"] <= 600, "10 min, not 10 days: %r" % st
    with cd.call("chat") as call:
        with pytest.raises(polygate.AllSourcesExhausted) as ei:
            call.acquire()
    assert 590 < ei.value.retry_after_s <= 600, ei.value.retry_after_s

    with ck.call("chat") as call:
        call.acquire().rate_limited(retry_after_s=86_400.0)
    assert src(k, ck)["quota_blocked_s"] <= 1.0
    time.sleep(1.05)
    with ck.call("chat") as call:
        assert call.acquire().source == "s1", "the capped block is over"
    with pytest.raises(ValueError):
        with ck.call("chat") as call:
            call.acquire().rate_limited(retry_after_s=float("nan"))
