"""End-to-end: Redis dies and comes back under steady traffic."""

from __future__ import annotations

import threading
import time

import pytest

import polygate
from .polygate_e2e import scope, wait_until

REDIS_TIMEOUT = 0.2


def _start(sidecars, redis_server, name, on_backend_error, **scope_keys):
    s = sidecars.new(name)
    s.write_config({"chat": scope("s1", **scope_keys)}, backend="redis", redis_url=redis_server.url,
                   key_prefix="pg-faults", on_backend_error=on_backend_error,
                   redis_timeout="%dms" % int(REDIS_TIMEOUT * 1000))
    return s.start()


class Traffic:
    """A thread making calls (acquire + success) back to back; records each call's
    latency and any error."""

    def __init__(self, client):
        self.client = client
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.log = []  # (t_end, latency, error or None)
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self):
        while not self.stop.is_set():
            t0 = time.monotonic()
            err = None
            try:
                with self.client.call("chat") as call:
                    call.acquire().success()
            except polygate.PolyGateError as e:
                err = e
            t1 = time.monotonic()
            with self.lock:
                self.log.append((t1, t1 - t0, err))
            time.sleep(0.005)

    def since(self, t):
        with self.lock:
            return [x for x in self.log if x[0] >= t]

    def finish(self):
        self.stop.set()
        self.thread.join(10)


def test_local_mode_survives_redis_death_and_resyncs(sidecars, redis_server):
    a = _start(sidecars, redis_server, "host-a", "local")
    b = _start(sidecars, redis_server, "host-b", "local")
    ca, cb = a.client(), b.client()
    assert a.source_status(ca, "s1")["degraded"] is False
    traffic = Traffic(ca)
    try:
        time.sleep(0.2)
        assert traffic.since(0) and all(e is None for _, _, e in traffic.since(0))

        redis_server.kill()
        killed = time.monotonic()
        time.sleep(1.5)
        during = traffic.since(killed)
        assert a.alive(), a.stderr()
        errors = [e for _, _, e in during if e is not None]
        assert not errors, "on_backend_error=local must keep admitting: %r" % errors[:3]
        assert len(during) >= 3, "traffic stalled while Redis was down: %d calls in 1.5 s" % len(during)
        # one call = acquire + report, each bounded by redis_timeout (plus slack)
        worst = max(lat for _, lat, _ in during)
        assert worst < 2 * REDIS_TIMEOUT + 0.6, "a call took %.3f s with Redis down (redis_timeout %.1f s)" % (
            worst, REDIS_TIMEOUT)
        st = a.source_status(ca, "s1")
        assert st["degraded"] is True, st

        redis_server.restart()
        wait_until(lambda: a.source_status(ca, "s1")["degraded"] is False, timeout=5.0,
                   what="host A to leave degraded mode after Redis came back")
        # Shared state is used again: an admin op through B is seen by A.
        cb.force_open("s1", seconds=30)

        def a_sees_open():
            return a.source_status(ca, "s1")["state"] == "open"

        wait_until(a_sees_open, timeout=3.0, what="host A to see B's force_open after the restart")
        with ca.call("chat") as call:
            with pytest.raises(polygate.CircuitOpenError) as ei:
                call.acquire()
        assert 25 < ei.value.retry_after_s <= 30
        assert a.alive() and b.alive()
    finally:
        traffic.finish()


def test_fail_closed_refuses_fast_with_clear_error(sidecars, redis_server):
    a = _start(sidecars, redis_server, "host-a", "fail_closed")
    ca = a.client()
    with ca.call("chat") as call:
        call.acquire().success()
    redis_server.kill()
    for _ in range(3):
        t0 = time.monotonic()
        with ca.call("chat") as call:
            with pytest.raises(polygate.GatewayUnavailableError) as ei:
                call.acquire()
        took = time.monotonic() - t0
        e = ei.value
        assert not isinstance(e, (polygate.CircuitOpenError, polygate.AllSourcesExhausted)), repr(e)
        assert e.kind == "backend_unavailable", e.kind
        msg = str(e).lower()
        assert "redis" in msg or "backend" in msg, str(e)
        assert any(w in msg for w in ("unreachable", "unavailable", "down", "connect", "timed out", "timeout")), str(e)
        assert took < 2 * REDIS_TIMEOUT + 0.6, "fail_closed must fail fast, took %.3f s" % took
    assert a.alive()
    assert ca.ping() < 1
    # ... and recovers once Redis is back.
    redis_server.restart()

    def admits():
        with ca.call("chat") as call:
            try:
                call.acquire().success()
                return True
            except polygate.GatewayUnavailableError:
                return False

    wait_until(admits, timeout=5.0, interval=0.05, what="admission after Redis came back (fail_closed)")


def test_paused_redis_bounded_by_env_redis_timeout(sidecars, redis_server):
    """A Redis that accepts but never answers (SIGSTOP): each admission gives up
    after redis_timeout — here set by SIDECAR__REDIS_TIMEOUT over a config value
    of 5 s — and degrades to local state."""
    import os
    import signal

    s = sidecars.new("host-a")
    s.write_config({"chat": scope("s1")}, backend="redis", redis_url=redis_server.url,
                   key_prefix="pg-pause", on_backend_error="local", redis_timeout="5s")
    s.start(env={"SIDECAR__REDIS_TIMEOUT": "200ms"})
    c = s.client()
    with c.call("chat") as call:
        call.acquire().success()
    os.kill(redis_server.proc.pid, signal.SIGSTOP)
    try:
        worst = 0.0
        for _ in range(4):
            t0 = time.monotonic()
            with c.call("chat") as call:
                call.acquire().success()
            worst = max(worst, time.monotonic() - t0)
        assert worst < 2 * REDIS_TIMEOUT + 0.6, "a call took %.3f s with Redis paused" % worst
        assert s.source_status(c, "s1")["degraded"] is True
    finally:
        os.kill(redis_server.proc.pid, signal.SIGCONT)
    wait_until(lambda: (c.call("chat").begin().end() or True) and
               s.source_status(c, "s1")["degraded"] is False, timeout=5.0,
               what="leaving degraded mode after SIGCONT")


def test_fail_closed_message_does_not_repeat_itself(sidecars, redis_server):
    a = _start(sidecars, redis_server, "host-a", "fail_closed")
    ca = a.client()
    redis_server.kill()
    with ca.call("chat") as call:
        with pytest.raises(polygate.GatewayUnavailableError) as ei:
            call.acquire()
    msg = str(ei.value)
    assert msg.count("shared backend unreachable") <= 1, "duplicated prefix in the error message: %r" % msg


def _sigstop(redis_server):
    import os
    import signal

    os.kill(redis_server.proc.pid, signal.SIGSTOP)


def _sigcont(redis_server):
    import os
    import signal

    os.kill(redis_server.proc.pid, signal.SIGCONT)


@pytest.mark.timeout(60)
def test_paused_redis_keeps_an_open_source_refused_through_reload_and_shutdown(sidecars, redis_server):
    """§10, issue 21 item 1: with Redis paused (SIGSTOP), a source the host last saw
    OPEN — force-opened for an hour, or opened by its own breaker — stays refused:
    no call is granted on it, not by a fail-fast call, not to a waiter woken by a
    SIGHUP reload, not during SIGTERM's drain. Before the fix the blank local
    fallback admitted them all (194 of 194 calls, 50 waiters on SIGHUP, 1 of 200 on
    SIGTERM)."""
    import os
    import signal

    s = sidecars.new("host-a")
    s.write_config(
        {
            "forced": scope("s1"),
            "waiting": scope("s1", circuit_open="wait", stall_window="20s"),
            "opened": scope({"name": "s2", "timeout": "5s"},
                            breaker={"failure_threshold": 2, "cooldown": "60s", "max_cooldown": "10m"}),
        },
        backend="redis", redis_url=redis_server.url, key_prefix="pg-remember",
        on_backend_error="local", redis_timeout="200ms", shutdown_grace="2s")
    s.start()
    c = s.client()
    c.force_open("s1", seconds=3600)
    for _ in range(2):
        with c.call("opened") as call:
            call.acquire().failure("server_error")
    assert s.source_status(c, "s2")["state"] == "open"

    granted = []
    errors = []
    lock = threading.Lock()

    def waiter():
        cw = s.client()
        try:
            with cw.call("waiting") as call:
                permit = call.acquire()
                with lock:
                    granted.append("waiter")
                permit.success()
        except polygate.PolyGateError as e:
            with lock:
                errors.append(e)
        except OSError as e:  # the daemon went away mid-wait
            with lock:
                errors.append(e)

    _sigstop(redis_server)
    try:
        threads = [threading.Thread(target=waiter, daemon=True) for _ in range(30)]
        for t in threads:
            t.start()
        # Fail-fast calls on both sources, for longer than the memo's re-check
        # (1 s): it reads the degraded state, which must still say OPEN.
        until = time.monotonic() + 2.5
        calls = 0
        while time.monotonic() < until:
            for sc in ("forced", "opened"):
                with c.call(sc) as call:
                    try:
                        permit = call.acquire()
                        granted.append(sc)
                        permit.success()
                    except polygate.CircuitOpenError as e:
                        assert e.retry_after_s > 30, (sc, e.retry_after_s)
                calls += 1
            time.sleep(0.01)
        assert calls > 50
        assert granted == [], "granted on a source last seen OPEN while Redis is paused: %r" % granted
        st = s.source_status(c, "s1")
        assert st["degraded"] is True and st["state"] == "open", st
        # A reload wakes every waiter: none may be let through.
        os.kill(s.proc.pid, signal.SIGHUP)
        time.sleep(1.5)
        assert granted == [], "SIGHUP released waiters onto an OPEN source: %r" % granted
        assert s.alive()
        # Shutdown ends the waits; none with a grant.
        os.kill(s.proc.pid, signal.SIGTERM)
        for t in threads:
            t.join(15)
        assert not any(t.is_alive() for t in threads), "a waiter outlived SIGTERM"
        assert granted == [], "SIGTERM granted an OPEN source to a waiter: %r" % granted
        assert len(errors) == 30, errors
    finally:
        _sigcont(redis_server)


@pytest.mark.timeout(60)
def test_two_degraded_sidecars_together_admit_the_limit_not_twice_it(sidecars, redis_server):
    """§10, issue 25: each sidecar keeps a heartbeat in Redis; while Redis is paused
    each uses only its share of every shared quota (auto: 1 / the 2 live hosts), so
    together they admit at most the limit plus one call each — not the whole limit
    each, as before. Status shows the share in force."""
    hosts = []
    for name in ("host-a", "host-b"):
        s = sidecars.new(name)
        s.write_config({"chat": scope({"name": "s1", "timeout": "5s", "rpm": 10}, quota_full="fail_fast")},
                       backend="redis", redis_url=redis_server.url, key_prefix="pg-share",
                       on_backend_error="local", redis_timeout="200ms")
        s.start()
        hosts.append((s, s.client()))

    def both_counted():
        return all(c.status().get("degraded_share", {}).get("live_hosts") == 2 for _, c in hosts)

    wait_until(both_counted, timeout=5.0, what="both heartbeats counted")
    for _, c in hosts:
        share = c.status()["degraded_share"]
        assert share["setting"] == "auto" and share["share"] == 0.5, share

    _sigstop(redis_server)
    try:
        admitted = {}
        for s, c in hosts:
            n = 0
            for _ in range(30):
                with c.call("chat") as call:
                    try:
                        call.acquire().success()
                        n += 1
                    except polygate.AllSourcesExhausted:
                        pass
            admitted[s.name] = n
            assert s.source_status(c, "s1")["degraded"] is True
        total = sum(admitted.values())
        assert total <= 10 + 2, "two degraded hosts admitted %r of a 10 rpm limit" % admitted
        assert all(n >= 1 for n in admitted.values()), admitted
    finally:
        _sigcont(redis_server)
