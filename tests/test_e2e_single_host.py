"""End-to-end, memory backend (issue "single-host product"): the real daemon,
the Python binding, raw sockets, the CLI."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import struct
import subprocess
import sys
import textwrap
import time

import pytest

import polygate
import polygate.aio
from polygate import _core, _wire
from .polygate_e2e import EXAMPLE_CONFIG, scope, wait_until

# ------------------------------------------------------------------ basics


def test_call_succeeds(sidecar):
    sidecar.write_config({"chat": scope("a", "b")})
    sidecar.start()
    client = sidecar.client()
    with client.call("chat", est_tokens=10) as call:
        permit = call.acquire()
        assert permit.source == "a"
        assert permit.attempt == 1
        assert not permit.is_probe
        res = permit.success(tokens=12)
    assert res.applied is True
    assert res.state == "closed"
    assert res.retry_after_s == 0
    st = sidecar.source_status(client, "a")
    assert st["window_successes"] == 1
    assert st["in_flight"] == 0


def test_failover_to_next_source_after_failure(sidecar):
    sidecar.write_config({"chat": scope("a", "b", breaker={"failure_threshold": 5})})
    sidecar.start()
    client = sidecar.client()
    with client.call("chat") as call:
        p1 = call.acquire()
        assert p1.source == "a"
        p1.failure("server_error")  # travels with the next acquire (Retry)
        p2 = call.acquire()
        assert p2.source == "b", "the failed source must be demoted within the call"
        assert p2.attempt == 2
        assert p2.success().applied
    st = client.status()["scopes"]["chat"]["sources"]
    assert st["a"]["window_failures"] == 1 and st["a"]["streak"] == 1
    assert st["b"]["window_successes"] == 1


def test_fail_fast_circuit_open_reports_retry_after_and_reasons(sidecar):
    sidecar.write_config({"chat": scope("a", "b", circuit_open="fail_fast")})
    sidecar.start()
    client = sidecar.client()
    client.force_open("a", seconds=30)
    client.force_open("b", seconds=20)
    t0 = time.monotonic()
    with client.call("chat") as call:
        with pytest.raises(polygate.CircuitOpenError) as ei:
            call.acquire()
    assert time.monotonic() - t0 < 1.0, "fail_fast must not wait"
    e = ei.value
    # retry_after(all sources) = min over the sources = b's remaining ~20 s
    assert 18.0 < e.retry_after_s <= 20.0, e.retry_after_s
    assert e.per_source_reasons == {"a": "circuit_open", "b": "circuit_open"}
    assert e.scope in (None, "chat")
    st = client.status()["scopes"]["chat"]["sources"]
    assert st["a"]["state"] == "open" and 28.0 < st["a"]["retry_after_s"] <= 30.0


def test_wait_mode_blocks_until_probe_then_succeeds(sidecar):
    sidecar.write_config({"chat": scope("a", circuit_open="wait", stall_window="10s")})
    sidecar.start()
    client = sidecar.client()
    client.force_open("a", seconds=0.6)
    t0 = time.monotonic()
    with client.call("chat") as call:
        permit = call.acquire()
        waited = time.monotonic() - t0
        assert permit.source == "a"
        assert permit.is_probe, "the first grant after a cooldown is the probe"
        r = permit.success()
    assert 0.45 <= waited < 3.0, "acquire should block about the cooldown (0.6 s), took %.3f" % waited
    assert r.applied and r.state == "closed"
    assert sidecar.source_status(client, "a")["state"] == "closed"


# ------------------------------------------------------------------ exhaustion


def test_exhausted_stalled(sidecar):
    sidecar.write_config({"chat": scope("a", circuit_open="wait", stall_window="300ms",
                                        poll_interval="50ms")})
    sidecar.start()
    client = sidecar.client()
    client.force_open("a", seconds=60)
    t0 = time.monotonic()
    with client.call("chat") as call:
        with pytest.raises(polygate.AllSourcesExhausted) as ei:
            call.acquire()
    took = time.monotonic() - t0
    assert ei.value.reason == "stalled"
    assert ei.value.per_source_reasons == {"a": "circuit_open"}
    # total ≤ stall_window + poll_interval (+ scheduling)
    assert 0.25 <= took < 0.35 + 0.5, took


def test_exhausted_quota_fail_fast(sidecar):
    sidecar.write_config({"chat": scope({"name": "a", "rpm": 1, "timeout": "5s"}, quota_full="fail_fast")})
    sidecar.start()
    client = sidecar.client()
    with client.call("chat") as call:
        call.acquire().success()
    t0 = time.monotonic()
    with client.call("chat") as call:
        with pytest.raises(polygate.AllSourcesExhausted) as ei:
            call.acquire()
    assert time.monotonic() - t0 < 1.0
    assert ei.value.reason == "quota_exhausted"
    assert ei.value.per_source_reasons == {"a": "rate_limited"}


def test_exhausted_retry(sidecar):
    sidecar.write_config({"chat": scope("a", "b", max_attempts=2, breaker={"failure_threshold": 10})})
    sidecar.start()
    client = sidecar.client()
    with client.call("chat") as call:
        call.acquire().failure("timeout")
        call.acquire().failure("server_error")
        with pytest.raises(polygate.AllSourcesExhausted) as ei:
            call.acquire()
    assert ei.value.reason == "retry_exhausted"


# ------------------------------------------------------------------ dead worker

WORKER = textwrap.dedent(
    """
    import sys, time
    import polygate
    client = polygate.connect(sys.argv[1])
    call = client.call("chat").begin()
    p = call.acquire()
    print("PERMIT", p.source, int(p.is_probe), flush=True)
    time.sleep(3600)
    """
)


def test_sigkilled_worker_holding_probe_does_not_wedge_source(sidecar, tmp_path):
    # A long source timeout: the probe lease (2 x timeout) would keep the source
    # wedged for 2 minutes, unless the connection's close releases it.
    sidecar.write_config({"chat": scope({"name": "a", "timeout": "60s"}, circuit_open="fail_fast")})
    sidecar.start()
    client = sidecar.client()
    client.force_open("a", seconds=0.2)
    time.sleep(0.3)

    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    worker = subprocess.Popen([sys.executable, str(script), sidecar.socket], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, env=env)
    try:
        line = worker.stdout.readline().decode().split()
        assert line[:3] == ["PERMIT", "a", "1"], (line, worker.stderr.read1(4096) if not line else "")
        st = sidecar.source_status(client, "a")
        assert st["state"] == "half_open" and st["in_flight"] == 1, st
        # While the probe is out, another worker is refused with retry_after 0.
        with client.call("chat") as call:
            with pytest.raises(polygate.CircuitOpenError) as ei:
                call.acquire()
        assert ei.value.retry_after_s == 0.0
    finally:
        worker.send_signal(signal.SIGKILL)
        worker.wait(timeout=5)
    killed_at = time.monotonic()

    def probe_again():
        with client.call("chat") as call:
            try:
                p = call.acquire()
            except polygate.CircuitOpenError:
                return None
            ok = p.is_probe and p.source == "a"
            p.success()
            return ok or "granted but not a probe: %r" % p

    got = wait_until(probe_again, timeout=2.0, what="a probe after the worker was killed")
    assert got is True, got
    assert time.monotonic() - killed_at < 2.0
    st = sidecar.source_status(client, "a")
    assert st["in_flight"] == 0 and st["state"] == "closed", st


# ------------------------------------------------------------------ asyncio fan-in


def test_500_concurrent_asyncio_calls_on_one_connection(sidecar):
    sidecar.write_config({"chat": scope("a", "b", poll_interval="10ms", stall_window="60s",
                                        pacer={"initial": 64, "min": 1, "max": 256})})
    sidecar.start()
    N = 500

    async def main():
        client = await polygate.aio.connect(sidecar.socket)
        try:
            async def one(i):
                async with client.call("chat", est_tokens=1) as call:
                    permit = await call.acquire()
                    await asyncio.sleep(0.005)
                    res = await permit.success(tokens=1)
                    return permit.source, res.applied

            results = await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(N))), timeout=60)
            status = await client.status()
            return results, status
        finally:
            await client.close()

    t0 = time.monotonic()
    results, status = asyncio.run(main())
    assert len(results) == N
    assert all(applied for _, applied in results)
    chat = status["scopes"]["chat"]
    assert chat["waiters"] == 0
    assert all(s["in_flight"] == 0 for s in chat["sources"].values()), chat
    assert sum(s["window_successes"] for s in chat["sources"].values()) == N
    assert time.monotonic() - t0 < 60


# ------------------------------------------------------------------ raw sockets


def _raw_connect(path):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(5)
    s.connect(path)
    hello = _wire.encode_client_frame({"id": 1, "request": _core.hello("raw-test", 2)})
    s.sendall(_wire.frame(hello))
    frames = _read_frames(s, want=1)
    assert frames and "Welcome" in frames[0]["reply"], frames
    return s


def _read_frames(s, want=None):
    """Frames until EOF (or ``want`` frames); a list of decoded server frames."""
    dec = _wire.FrameDecoder(1 << 24)
    out = []
    while want is None or len(out) < want:
        try:
            data = s.recv(65536)
        except (ConnectionResetError, socket.timeout):
            break
        if not data:
            break
        out += [_wire.decode_server_frame(p) for p in dec.feed(data)]
    return out


def _reply_error_kind(frames):
    kinds = [f["reply"]["Error"]["kind"] for f in frames if isinstance(f["reply"], dict) and "Error" in f["reply"]]
    return kinds


@pytest.mark.parametrize("bad", ["garbage", "oversize"])
def test_bad_frame_closes_only_its_connection(sidecar, bad):
    sidecar.write_config({"chat": scope("a")}, max_frame=4096)
    sidecar.start()
    other = sidecar.client()
    assert other.ping() < 1
    raw = _raw_connect(sidecar.socket)
    if bad == "garbage":
        raw.sendall(_wire.frame(b"\xff\xfe\xfd\xfc\x00\x01garbage-not-bincode"))
        want = {"Malformed", "ProtocolViolation"}
    else:
        raw.sendall(struct.pack(">I", 1_000_000) + b"x" * 8192)
        want = {"FrameTooLarge"}
    frames = _read_frames(raw)  # until the sidecar closes it
    raw.close()
    kinds = _reply_error_kind(frames)
    assert kinds and kinds[0] in want, "expected an error reply %s before the close, got %r" % (want, frames)
    # The other connection keeps working, and new ones are accepted.
    assert other.ping() < 1
    with other.call("chat") as call:
        assert call.acquire().success().applied
    assert sidecar.client().ping() < 1
    assert sidecar.alive()


def test_unknown_scope_and_unknown_permit_are_named(sidecar):
    sidecar.write_config({"chat": scope("a")})
    sidecar.start()
    client = sidecar.client()
    with pytest.raises(polygate.SidecarError) as ei:
        with client.call("no-such-scope") as call:
            call.acquire()
    assert ei.value.kind == "unknown_scope"
    assert "no-such-scope" in str(ei.value)

    bogus = 987654321
    with pytest.raises(polygate.SidecarError) as ei:
        _core.expect(client._conn.request(_core.report(bogus, _core.OUTCOME_CANCELLED)), "Reported")
    assert ei.value.kind == "unknown_permit"
    assert str(bogus) in str(ei.value)
    assert client.ping() < 1  # the connection survives both


# ------------------------------------------------------------------ startup, CLI


def test_invalid_env_override_stops_startup(sidecar):
    cfg = sidecar.write_config({"chat": scope("a")})
    env = dict(os.environ, CHAT__CIRCUIT_OPEN="sometimes")
    out = subprocess.run([str(sidecar.binary), "--config", str(cfg)], env=env, capture_output=True,
                         timeout=20, stdin=subprocess.DEVNULL)
    err = out.stderr.decode(errors="replace") + out.stdout.decode(errors="replace")
    assert out.returncode != 0, err
    assert "CHAT__CIRCUIT_OPEN" in err, err
    assert "sometimes" in err and "wait" in err and "fail_fast" in err, "should name the allowed values: " + err
    assert not os.path.exists(sidecar.socket)


def test_status_cli_prints_every_source(sidecar):
    sidecar.write_config({"chat": scope("src-one", "src-two"), "ocr": scope("src-three")})
    sidecar.start()
    client = sidecar.client()
    client.force_open("src-two", seconds=30)
    out = subprocess.run([str(sidecar.binary), "status", "--socket", sidecar.socket], capture_output=True,
                         timeout=20, stdin=subprocess.DEVNULL)
    text = out.stdout.decode(errors="replace")
    assert out.returncode == 0, out.stderr.decode(errors="replace")
    for name in ("chat", "ocr", "src-one", "src-two", "src-three"):
        assert name in text, "%s missing from status output:\n%s" % (name, text)
    assert "open" in text.lower()


def test_check_config_example(sidecar_bin):
    env = {k: v for k, v in os.environ.items() if "__" not in k}
    out = subprocess.run([str(sidecar_bin), "--config", str(EXAMPLE_CONFIG), "--check-config"],
                         capture_output=True, timeout=20, env=env, stdin=subprocess.DEVNULL)
    assert out.returncode == 0, out.stderr.decode(errors="replace")
    assert "OK" in out.stdout.decode()


# ------------------------------------------------------------------ more contract checks


@pytest.mark.parametrize("var,value,allowed", [
    ("CHAT__QUOTA_FULL", "later", ["wait", "fail_fast"]),
    ("CHAT__MAX_ATTEMPTS", "many", []),
    ("CHAT__POLL_INTERVAL", "fast", []),
    ("CHAT__BREAKER__COOLDOWN", "-1s", []),
    ("SIDECAR__ON_BACKEND_ERROR", "maybe", ["local", "fail_closed"]),
    ("SIDECAR__BACKEND", "etcd", ["memory", "redis"]),
])
def test_more_invalid_env_overrides_stop_startup(sidecar, var, value, allowed):
    cfg = sidecar.write_config({"chat": scope("a")})
    env = dict(os.environ, **{var: value})
    out = subprocess.run([str(sidecar.binary), "--config", str(cfg)], env=env, capture_output=True,
                         timeout=20, stdin=subprocess.DEVNULL)
    err = out.stderr.decode(errors="replace")
    assert out.returncode != 0, err
    assert var in err, err
    for a in allowed:
        assert a in err, "allowed value %r not named: %s" % (a, err)
    # --check-config rejects it the same way
    out = subprocess.run([str(sidecar.binary), "--config", str(cfg), "--check-config"], env=env,
                         capture_output=True, timeout=20, stdin=subprocess.DEVNULL)
    assert out.returncode != 0 and var in out.stderr.decode(errors="replace")


def test_valid_env_override_applies(sidecar):
    sidecar.write_config({"chat": scope("a", circuit_open="fail_fast", stall_window="10s")})
    sidecar.start(env={"CHAT__CIRCUIT_OPEN": "wait", "CHAT__STALL_WINDOW": "200ms"})
    client = sidecar.client()
    assert client.status()["scopes"]["chat"]["circuit_open"] == "wait"
    client.force_open("a", seconds=30)
    with client.call("chat") as call:
        with pytest.raises(polygate.AllSourcesExhausted) as ei:
            call.acquire()
    assert ei.value.reason == "stalled"


def test_socket_mode_and_second_daemon_refused(sidecars):
    first = sidecars.new("one")
    first.write_config({"chat": scope("a")}, socket_mode="0660")
    first.start()
    assert os.stat(first.socket).st_mode & 0o777 == 0o660
    second = sidecars.new("two")
    second.write_config({"chat": scope("a")}, socket=first.socket)
    out = subprocess.run([str(second.binary), "--config", str(second.config_path)], capture_output=True,
                         timeout=20, stdin=subprocess.DEVNULL)
    assert out.returncode != 0
    assert first.socket in out.stderr.decode(errors="replace")
    assert first.client().ping() < 1, "the first daemon must keep its socket"


def test_stale_socket_file_is_replaced(sidecar):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(sidecar.socket)
    s.close()  # a socket file nobody listens on
    sidecar.write_config({"chat": scope("a")})
    sidecar.start()
    assert sidecar.client().ping() < 1


def test_status_cli_without_daemon_names_socket(sidecar_bin, tmp_path):
    path = str(tmp_path / "nothing.sock")
    out = subprocess.run([str(sidecar_bin), "status", "--socket", path], capture_output=True, timeout=20,
                         stdin=subprocess.DEVNULL)
    assert out.returncode != 0
    assert path in out.stderr.decode(errors="replace")


def test_protocol_version_mismatch_and_missing_hello(sidecar):
    sidecar.write_config({"chat": scope("a")})
    sidecar.start()
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(5)
    s.connect(sidecar.socket)
    hello = {"Hello": {"protocol_version": 99, "client_name": "from-the-future", "pid": 1}}
    s.sendall(_wire.frame(_wire.encode_client_frame({"id": 7, "request": hello})))
    frames = _read_frames(s)
    s.close()
    assert frames and frames[0]["id"] == 7, frames
    err = frames[0]["reply"]["Error"]
    assert "version" in err["message"] and "99" in err["message"], err

    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(5)
    s.connect(sidecar.socket)
    s.sendall(_wire.frame(_wire.encode_client_frame({"id": 3, "request": "Ping"})))
    frames = _read_frames(s)
    s.close()
    assert frames and "Hello" in frames[0]["reply"]["Error"]["message"], frames
    assert sidecar.client().ping() < 1


def test_probe_failure_reopens_with_doubled_cooldown(sidecar):
    sidecar.write_config({"chat": scope("a", breaker={"failure_threshold": 1, "cooldown": "200ms",
                                                      "max_cooldown": "10s"})})
    sidecar.start()
    client = sidecar.client()
    with client.call("chat") as call:
        p = call.acquire()
        p.failure("server_error")
    r = p.result  # the block's end sent it (Finish) and got Reported
    assert r.state == "open" and 0.1 < r.retry_after_s <= 0.2, r  # streak open: k stays 0
    time.sleep(0.25)
    with client.call("chat") as call:
        p = call.acquire()
        assert p.is_probe
        p.failure("server_error")
    r = p.result
    assert r.state == "open" and 0.3 < r.retry_after_s <= 0.4, "probe-failure reopen doubles: %r" % (r,)
    assert sidecar.source_status(client, "a")["cooldown_level"] == 1


def test_rate_limited_probe_releases_lease(sidecar):
    sidecar.write_config({"chat": scope({"name": "a", "timeout": "60s"},
                                        breaker={"failure_threshold": 1})})
    sidecar.start()
    client = sidecar.client()
    client.force_open("a", seconds=0.1)
    time.sleep(0.15)
    with client.call("chat") as call:
        p = call.acquire()
        assert p.is_probe
        p.rate_limited()
    r = p.result
    assert r.state == "half_open", r
    st = sidecar.source_status(client, "a")
    assert st["in_flight"] == 0 and st["window_failures"] == 0 and st["streak"] == 0, st
    # the next caller may probe at once (the lease was released, not held 2 x 60 s)
    with client.call("chat") as call:
        p = call.acquire()
        assert p.is_probe
        assert p.success().state == "closed"


def test_est_tokens_derived_from_quota_and_settlement(sidecar):
    sidecar.write_config({"chat": scope({"name": "a", "tpm": 6000, "rpm": 60, "timeout": "5s"}),
                          "emb": scope({"name": "b", "tpm": 6000, "timeout": "5s"}),
                          "ocr": scope({"name": "c", "tpm": 6000, "rpm": 60, "est_tokens": 7, "timeout": "5s"})})
    sidecar.start()
    client = sidecar.client()
    for scope_name, want in (("chat", 100), ("emb", 100), ("ocr", 7)):
        with client.call(scope_name) as call:
            p = call.acquire()
            assert p.est_tokens == want, (scope_name, p)
            p.cancel()
    with client.call("chat", est_tokens=1000) as call:
        assert call.acquire().est_tokens == 1000

    def tokens():
        return sidecar.source_status(client, "b")["tokens_available"]

    # refill is 100 tokens/s: compare with a tolerance
    full = tokens()
    assert full > 5800, full
    with client.call("emb", est_tokens=3000) as call:
        p = call.acquire()
        assert tokens() < full - 2500
        p.cancel()  # cancelled before sending: refund
    assert tokens() > full - 200
    with client.call("emb", est_tokens=3000) as call:
        call.acquire().failure("server_error")  # transient failure: refund the tokens ...
        p = call.acquire()  # ... applied by this Retry, which reserves the next attempt's 3000
        assert full - 3300 < tokens() < full - 2700, "one reservation outstanding, the failed one refunded"
        p.success(tokens=1000)  # charge the actual usage
    assert full - 1300 < tokens() < full - 700, (full, tokens())


def test_waiting_worker_killed_leaves_nothing_waiting(sidecar, tmp_path):
    sidecar.write_config({"chat": scope("a", circuit_open="wait", stall_window="60s", poll_interval="20ms")})
    sidecar.start()
    client = sidecar.client()
    client.force_open("a", seconds=60)
    script = tmp_path / "waiter.py"
    script.write_text(textwrap.dedent(
        """
        import sys, polygate
        client = polygate.connect(sys.argv[1])
        call = client.call("chat").begin()
        print("WAITING", flush=True)
        call.acquire()
        print("UNEXPECTED GRANT", flush=True)
        """))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    workers = [subprocess.Popen([sys.executable, str(script), sidecar.socket], stdout=subprocess.PIPE,
                                env=env) for _ in range(3)]
    try:
        for w in workers:
            assert w.stdout.readline().strip() == b"WAITING"
        wait_until(lambda: client.status()["scopes"]["chat"]["waiters"] == 3, timeout=3, what="3 waiters")
    finally:
        for w in workers:
            w.kill()
            w.wait(5)
    deadline = time.monotonic() + 1.0
    while True:
        chat = client.status()["scopes"]["chat"]
        if (chat["waiters"], chat["calls"]) == (0, 0) or time.monotonic() > deadline:
            break
        time.sleep(0.02)
    assert (chat["waiters"], chat["calls"]) == (0, 0), \
        "1 s after the waiting workers died: waiters=%d calls=%d" % (chat["waiters"], chat["calls"])


def test_sigterm_ends_waits_with_shutting_down_and_exits_zero(sidecar):
    sidecar.write_config({"chat": scope("a", circuit_open="wait", stall_window="60s")}, shutdown_grace="1s")
    sidecar.start()
    client = sidecar.client()
    client.force_open("a", seconds=60)
    errors = []

    def waiter():
        try:
            with client.call("chat") as call:
                call.acquire()
        except polygate.PolyGateError as e:
            errors.append(e)

    import threading

    t = threading.Thread(target=waiter)
    t.start()
    wait_until(lambda: client.status()["scopes"]["chat"]["waiters"] == 1, timeout=3, what="a waiter")
    t0 = time.monotonic()
    sidecar.proc.send_signal(signal.SIGTERM)
    t.join(10)
    rc = sidecar.proc.wait(timeout=10)
    took = time.monotonic() - t0
    assert rc == 0, sidecar.stderr()
    assert took < 1.0 + 2.0 + 1.0, took
    assert errors and errors[0].kind == "shutting_down", errors
    assert not os.path.exists(sidecar.socket), "the socket file should be removed on exit"


def test_all_open_with_wait_and_quota_fail_fast_waits(sidecar):
    """§5 dispatch: circuit_open=wait + quota_full=fail_fast and every source open
    must wait (here until the probe), never report quota_exhausted."""
    sidecar.write_config({"chat": scope("a", "b", circuit_open="wait", quota_full="fail_fast")})
    sidecar.start()
    client = sidecar.client()
    client.force_open("a", seconds=0.3)
    client.force_open("b", seconds=0.3)
    t0 = time.monotonic()
    with client.call("chat") as call:
        p = call.acquire()
        assert p.is_probe
        p.success()
    assert time.monotonic() - t0 >= 0.2


def test_mixed_reasons_take_the_quota_branch(sidecar):
    sidecar.write_config({"chat": scope("a", {"name": "b", "rpm": 1, "timeout": "5s"},
                                        circuit_open="fail_fast", quota_full="fail_fast")})
    sidecar.start()
    client = sidecar.client()
    client.force_open("a", seconds=30)
    with client.call("chat") as call:
        p = call.acquire()
        assert p.source == "b"
        p.success()
    with client.call("chat") as call:
        with pytest.raises(polygate.AllSourcesExhausted) as ei:
            call.acquire()
    assert ei.value.reason == "quota_exhausted"
    assert ei.value.per_source_reasons == {"a": "circuit_open", "b": "rate_limited"}
    # DESIGN §6 call-ending errors: min over the sources of when each certainly
    # passes — a's forced OPEN ends in 30 s, b's next request refills in 60 s.
    assert 29.0 < ei.value.retry_after_s <= 30.0, ei.value.retry_after_s


def test_cancelled_asyncio_wait_leaves_nothing_waiting(sidecar):
    sidecar.write_config({"chat": scope("a", circuit_open="wait", stall_window="60s")})
    sidecar.start()

    async def main():
        client = await polygate.aio.connect(sidecar.socket)
        try:
            await client.force_open("a", seconds=60)

            async def waiter():
                async with client.call("chat") as call:
                    await call.acquire()

            tasks = [asyncio.ensure_future(waiter()) for _ in range(5)]
            for _ in range(100):
                if (await client.status())["scopes"]["chat"]["waiters"] == 5:
                    break
                await asyncio.sleep(0.02)
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for _ in range(50):
                chat = (await client.status())["scopes"]["chat"]
                if chat["waiters"] == 0 and chat["calls"] == 0:
                    break
                await asyncio.sleep(0.02)
            return chat
        finally:
            await client.close()

    chat = asyncio.run(main())
    assert chat["waiters"] == 0 and chat["calls"] == 0, chat


def test_unreported_probe_reclaimed_after_lease(sidecar):
    # lease = 2 x timeout = 200 ms
    sidecar.write_config({"chat": scope({"name": "a", "timeout": "100ms"})})
    sidecar.start()
    holder = sidecar.client()
    other = sidecar.client()
    holder.force_open("a", seconds=0.05)
    time.sleep(0.1)
    call = holder.call("chat").begin()
    p = call.acquire()  # never reported, connection stays open
    assert p.is_probe
    with other.call("chat") as c2:
        with pytest.raises(polygate.CircuitOpenError):
            c2.acquire()
    time.sleep(0.35)

    with other.call("chat") as c2:
        p2 = c2.acquire()
        assert p2.is_probe, "the expired probe lease must be handed to the next caller"
        assert p2.success().state == "closed"
    st = sidecar.source_status(other, "a")
    assert st["in_flight"] == 0, "the reclaimed permit still counts in flight: %r" % st
