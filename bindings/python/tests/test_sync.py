"""The synchronous client against the fake sidecar (or a real one, see conftest)."""

import os
import signal
import threading
import time

import pytest

import polygate
from conftest import SCOPE
from fake_sidecar import HOLD, error


def _variant(x):
    return x if isinstance(x, str) else next(iter(x))


# ---------------------------------------------------------------- connect / handshake

def test_handshake(fake):
    with polygate.connect(fake.path) as client:
        assert client.sidecar_version == "0.1.0-fake"
        assert client.protocol_version == 1 and client.max_frame == 65536
        (hello,) = fake.requests("Hello")
        assert hello["request"]["Hello"] == {
            "protocol_version": 1,
            "client_name": "polygate-python/%s" % polygate.__version__,
            "pid": os.getpid(),
        }
        assert fake.requests()[0] is hello  # first frame of the connection
    assert client.closed


def test_client_name_and_env_path(fake, monkeypatch):
    monkeypatch.setenv("POLYGATE_SOCKET", fake.path)
    client = polygate.connect(client_name="worker-7")
    try:
        assert fake.requests("Hello")[0]["request"]["Hello"]["client_name"] == "worker-7"
    finally:
        client.close()


def test_missing_socket_names_path(sockdir, monkeypatch):
    path = os.path.join(sockdir, "nope.sock")
    with pytest.raises(polygate.SidecarError) as ei:
        polygate.connect(path)
    assert path in str(ei.value) and ei.value.kind == "connection"
    monkeypatch.setenv("POLYGATE_SOCKET", path + "2")
    with pytest.raises(polygate.SidecarError, match=path + "2"):
        polygate.connect()
    monkeypatch.delenv("POLYGATE_SOCKET")
    if not os.path.exists("/run/polygate/sidecar.sock"):
        with pytest.raises(polygate.SidecarError, match="/run/polygate/sidecar.sock"):
            polygate.connect()


def test_protocol_version_mismatch(fake):
    fake.protocol_version = 2
    with pytest.raises(polygate.SidecarError) as ei:
        polygate.connect(fake.path)
    assert ei.value.kind == "protocol_violation" and "version 2" in str(ei.value)


def test_ping_status_admin(sidecar_path):
    with polygate.connect(sidecar_path) as client:
        assert client.ping() >= 0
        st = client.status()
        assert set(st) == {"sidecar_version", "backend", "scopes"}
        assert SCOPE in st["scopes"]
        sc = st["scopes"][SCOPE]
        assert set(sc) == {"circuit_open", "quota_full", "waiters", "calls", "sources"}
        for src in sc["sources"].values():
            assert set(src) == {
                "state", "epoch", "retry_after_s", "cooldown_level", "window_successes",
                "window_failures", "streak", "memo_remaining_s", "pacer_ceiling", "in_flight",
                "tokens_available", "requests_available", "quota_blocked_s", "degraded"}
            assert src["state"] in ("closed", "open", "half_open")


def test_status_values_and_admin_wire(fake):
    with polygate.connect(fake.path) as client:
        st = client.status()
        assert st["backend"] == "memory"
        assert st["scopes"]["chat"]["sources"]["src-b"]["state"] == "half_open"
        assert st["scopes"]["chat"]["sources"]["src-a"]["tokens_available"] == 29000.5
        assert st["scopes"]["chat"]["sources"]["src-a"]["requests_available"] is None
        client.force_open("src-a")
        client.force_open("src-a", seconds=0.5)
        client.force_close("src-a")
        client.reset("src-b")
        assert [f["request"] for f in fake.requests() if _variant(f["request"]) in ("ForceOpen", "ForceClose", "Reset")] == [
            {"ForceOpen": {"source": "src-a", "seconds": 30.0}},
            {"ForceOpen": {"source": "src-a", "seconds": 0.5}},
            {"ForceClose": {"source": "src-a"}},
            {"Reset": {"source": "src-b"}},
        ]
        with pytest.raises(ValueError):
            client.force_open("src-a", seconds=0)


def test_admin_permission_denied(fake):
    fake.on_admin = lambda conn, rid, req: error("PermissionDenied", "uid 1000 is not in admin_uids")
    with polygate.connect(fake.path) as client:
        with pytest.raises(polygate.SidecarError) as ei:
            client.force_close("src-a")
        assert ei.value.kind == "permission_denied"
        assert str(ei.value) == "uid 1000 is not in admin_uids"
        assert not isinstance(ei.value, polygate.GatewayUnavailableError)


# ---------------------------------------------------------------- call flow

def test_grant_success_flow(sidecar_path):
    with polygate.connect(sidecar_path) as client:
        with client.call(SCOPE, est_tokens=1200) as call:
            permit = call.acquire()
            assert isinstance(permit.source, str) and permit.attempt == 1
            assert isinstance(permit.is_probe, bool) and isinstance(permit.est_tokens, int)
            res = permit.success(tokens=1234)
            assert res.applied in (True, False) and res.state in ("closed", "open", "half_open")
            assert call.permit is None


def test_grant_success_wire(fake):
    with polygate.connect(fake.path) as client:
        with client.call("chat", est_tokens=1200) as call:
            permit = call.acquire()
            assert (permit.source, permit.attempt, permit.is_probe, permit.est_tokens) == ("src-a", 1, False, 1000)
            assert permit.success(tokens=1234) == polygate.ReportResult(True, "closed", 0.0)
        reqs = [f["request"] for f in fake.requests()][1:]
    cid = fake.requests("Acquire")[0]["request"]["Acquire"]["call"]
    assert reqs == [
        {"BeginCall": {"scope": "chat", "est_tokens": 1200}},
        {"Acquire": {"call": cid}},
        {"Report": {"permit": permit.id, "outcome": {"Success": {"tokens": 1234, "count_attempt": True}}}},
        {"EndCall": {"call": cid}},
    ]


def test_failure_then_retry_and_outcomes(fake):
    with polygate.connect(fake.path) as client:
        with client.call("chat") as call:
            p1 = call.acquire()
            p1.failure("timeout")
            p2 = call.acquire()
            assert p2.attempt == 2
            p2.rate_limited(retry_after_s=2.5)
            p3 = call.acquire()
            p3.success(count_attempt=False)
            p4 = call.acquire()
            p4.cancel()
    outcomes = [f["request"]["Report"]["outcome"] for f in fake.requests("Report")]
    assert outcomes == [
        {"Failure": {"kind": "Timeout"}},
        {"RateLimited": {"retry_after_s": 2.5}},
        {"Success": {"tokens": None, "count_attempt": False}},
        "Cancelled",
    ]


def test_failure_kinds(fake):
    wire = {"timeout": "Timeout", "server_error": "ServerError", "connection": "Connection",
            "bad_result": "BadResult", "error": "Error"}
    with polygate.connect(fake.path) as client:
        with client.call("chat") as call:
            for kind in wire:
                call.acquire().failure(kind)
            permit = call.acquire()
            with pytest.raises(ValueError) as ei:
                permit.failure("oops")
            for kind in wire:
                assert kind in str(ei.value)
            assert "oops" in str(ei.value)
            assert not permit.reported  # a rejected kind does not consume the permit
            permit.failure("server_error")
    assert [f["request"]["Report"]["outcome"]["Failure"]["kind"] for f in fake.requests("Report")] == \
        list(wire.values()) + ["ServerError"]


def test_report_twice_raises(fake):
    with polygate.connect(fake.path) as client:
        with client.call("chat") as call:
            permit = call.acquire()
            permit.success()
            for again in (permit.success, permit.cancel, lambda: permit.failure("timeout"),
                          permit.rate_limited):
                with pytest.raises(RuntimeError, match="already reported"):
                    again()
    assert len(fake.requests("Report")) == 1


def test_block_exception_releases(fake):
    with polygate.connect(fake.path) as client:
        with pytest.raises(ZeroDivisionError):
            with client.call("chat") as call:
                permit = call.acquire()
                1 / 0
        fake.wait_for(lambda: len(fake.requests("EndCall")) == 1)
        assert [_variant(f["request"]) for f in fake.requests()][-2:] == ["Report", "EndCall"]
        assert fake.requests("Report")[0]["request"]["Report"] == {"permit": permit.id, "outcome": "Cancelled"}
        assert client.ping() >= 0  # connection still fine


def test_block_normal_exit_with_unreported_permit(fake):
    with polygate.connect(fake.path) as client:
        with client.call("chat") as call:
            permit = call.acquire()
        assert permit.reported
        assert [_variant(f["request"]) for f in fake.requests()][-2:] == ["Report", "EndCall"]
        assert fake.requests("Report")[0]["request"]["Report"]["outcome"] == "Cancelled"


# ---------------------------------------------------------------- error mapping

REASONS = (("src-a", "CircuitOpen"), ("src-b", "Paced"), ("src-c", "RateLimited"), ("src-d", "BackendUnavailable"))
SNAKE_REASONS = {"src-a": "circuit_open", "src-b": "paced", "src-c": "rate_limited", "src-d": "backend_unavailable"}


@pytest.mark.parametrize("reply, cls, attrs", [
    (error("CircuitOpen", "every source of scope chat has an open circuit", retry_after_s=12.75,
           reasons=REASONS, scope="chat"),
     polygate.CircuitOpenError,
     dict(kind="circuit_open", retry_after_s=12.75, per_source_reasons=SNAKE_REASONS, scope="chat")),
    (error("AllSourcesExhausted", "call stalled", exhausted="Stalled", scope="chat", reasons=REASONS[:1]),
     polygate.AllSourcesExhausted,
     dict(kind="all_sources_exhausted", reason="stalled", per_source_reasons={"src-a": "circuit_open"})),
    (error("AllSourcesExhausted", "quota", exhausted="QuotaExhausted", scope="chat"),
     polygate.AllSourcesExhausted, dict(reason="quota_exhausted", retry_after_s=0.0, per_source_reasons={})),
    (error("AllSourcesExhausted", "3 of 3", exhausted="RetryExhausted", scope="chat"),
     polygate.AllSourcesExhausted, dict(reason="retry_exhausted")),
    (error("BackendUnavailable", "redis unreachable", scope="chat", retry_after_s=1.0),
     polygate.GatewayUnavailableError, dict(kind="backend_unavailable", retry_after_s=1.0, scope="chat")),
    (error("ShuttingDown", "the sidecar is shutting down"), polygate.SidecarError, dict(kind="shutting_down")),
    (error("Busy", "busy"), polygate.SidecarError, dict(kind="busy")),
    (error("Internal", "bug"), polygate.SidecarError, dict(kind="internal")),
    (error("UnknownCall", "no call"), polygate.SidecarError, dict(kind="unknown_call")),
])
def test_error_mapping(fake, reply, cls, attrs):
    fake.on_acquire = lambda conn, rid, call: reply
    with polygate.connect(fake.path) as client:
        with client.call("chat") as call:
            with pytest.raises(polygate.PolyGateError) as ei:
                call.acquire()
    e = ei.value
    assert type(e) is cls
    assert str(e) == reply["Error"]["message"]
    for k, v in attrs.items():
        assert getattr(e, k) == v, k
    if isinstance(e, polygate.GatewayUnavailableError):
        assert not isinstance(e, polygate.SidecarError)
    else:
        assert not isinstance(e, polygate.GatewayUnavailableError)


def test_unknown_scope(sidecar_path):
    with polygate.connect(sidecar_path) as client:
        with pytest.raises(polygate.SidecarError) as ei:
            with client.call("no-such-scope-xyz"):
                pass
        assert ei.value.kind == "unknown_scope"
        assert "no-such-scope-xyz" in str(ei.value)
        assert client.ping() >= 0


# ---------------------------------------------------------------- waits, threads, interrupts

@pytest.fixture
def sigint_raises():
    """SIGINT raises KeyboardInterrupt in this test, whatever the environment did
    to it: a shell that starts the run in the background leaves SIGINT ignored,
    and then a pthread_kill(SIGINT) would never interrupt the wait."""
    assert threading.current_thread() is threading.main_thread(), "signal-based test must run on the main thread"
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield threading.main_thread().ident
    finally:
        signal.signal(signal.SIGINT, previous)


def test_keyboard_interrupt_cancels_waiting_acquire(fake, sigint_raises):
    fake.on_acquire = lambda conn, rid, call: HOLD
    main = sigint_raises
    with polygate.connect(fake.path) as client:
        def interrupt():
            try:
                fake.wait_held(1)
            finally:  # interrupt even if the Acquire never arrived: the asserts then fail
                signal.pthread_kill(main, signal.SIGINT)
        threading.Thread(target=interrupt, daemon=True).start()
        with pytest.raises(KeyboardInterrupt):
            with client.call("chat") as call:
                call.acquire()
        fake.wait_for(lambda: fake.requests("EndCall"))
        acq = fake.requests("Acquire")[0]
        (cancel,) = fake.requests("Cancel")
        assert cancel["request"] == {"Cancel": {"target": acq["id"]}}
        assert [_variant(f["request"]) for f in fake.requests()][-2:] == ["Cancel", "EndCall"]
        assert fake.held_count() == 0
        assert client.ping() >= 0


def test_late_grant_after_interrupt_is_released(fake, sigint_raises):
    """The sidecar granted before it saw the Cancel: the client reports Cancelled."""
    fake.on_acquire = lambda conn, rid, call: HOLD
    fake.on_cancel = lambda conn, rid, target: conn.release_held(
        target, fake.grant(conn, target, conn.held[target]["call"]))
    main = sigint_raises
    with polygate.connect(fake.path) as client:
        call = client.call("chat").begin()

        def interrupt():
            try:
                fake.wait_held(1)
            finally:  # interrupt even if the Acquire never arrived: the asserts then fail
                signal.pthread_kill(main, signal.SIGINT)
        threading.Thread(target=interrupt, daemon=True).start()
        with pytest.raises(KeyboardInterrupt):
            call.acquire()
        fake.wait_for(lambda: fake.requests("Report"))
        assert fake.requests("Report")[0]["request"]["Report"]["outcome"] == "Cancelled"
        call.end()


def test_threads_share_one_connection(fake):
    n = 16
    fake.on_acquire = lambda conn, rid, call: HOLD
    results, errors = [], []
    with polygate.connect(fake.path) as client:
        def worker(i):
            try:
                with client.call("chat", est_tokens=i) as call:
                    p = call.acquire()
                    p.success(tokens=i)
                    results.append((i, p.source))
            except BaseException as e:  # noqa: BLE001
                errors.append(e)
        threads = [threading.Thread(target=worker, args=(i,)) for i in range(n)]
        for t in threads:
            t.start()
        fake.wait_held(n)  # all n Acquires outstanding at once on one connection
        fake.release_all_held(fake.grant)
        for t in threads:
            t.join(10)
    assert not errors and len(results) == n
    assert len(fake.conns) == 1
    assert sorted(f["request"]["Report"]["outcome"]["Success"]["tokens"] for f in fake.requests("Report")) == list(range(n))


def test_connection_loss_fails_pending_waits(fake):
    fake.on_acquire = lambda conn, rid, call: HOLD
    errors = []
    with polygate.connect(fake.path) as client:
        def worker():
            try:
                with client.call("chat") as call:
                    call.acquire()
            except BaseException as e:  # noqa: BLE001
                errors.append(e)
        threads = [threading.Thread(target=worker) for _ in range(3)]
        for t in threads:
            t.start()
        fake.wait_held(3)
        fake.drop_all()
        for t in threads:
            t.join(5)
        assert len(errors) == 3
        for e in errors:
            assert isinstance(e, polygate.SidecarError) and e.kind == "connection"
            assert fake.path in str(e)
        assert client.closed
        with pytest.raises(polygate.SidecarError):
            client.ping()


def test_fatal_id0_error_explains_close(fake):
    fake.on_acquire = lambda conn, rid, call: HOLD
    with polygate.connect(fake.path) as client:
        with client.call("chat") as call:
            def kill():
                fake.wait_held(1)
                conn = fake.conns[0]
                conn.send(0, error("Malformed", "cannot decode message"))
                conn.close()
            threading.Thread(target=kill, daemon=True).start()
            with pytest.raises(polygate.SidecarError) as ei:
                call.acquire()
    assert ei.value.kind == "malformed" and "cannot decode message" in str(ei.value)


def test_undecodable_reply_is_protocol_error(fake):
    fake.on_acquire = lambda conn, rid, call: HOLD
    with polygate.connect(fake.path) as client:
        with client.call("chat") as call:
            def garbage():
                fake.wait_held(1)
                fake.conns[0].send_raw(b"\0\0\0\x03abc")
            threading.Thread(target=garbage, daemon=True).start()
            with pytest.raises(polygate.SidecarError) as ei:
                call.acquire()
    assert ei.value.kind == "protocol" and "undecodable" in str(ei.value)


def test_oversize_request_rejected_locally(fake):
    fake.max_frame = 64
    with polygate.connect(fake.path) as client:
        with pytest.raises(polygate.SidecarError) as ei:
            client.call("x" * 100).begin()
        assert ei.value.kind == "frame_too_large"
        assert client.ping() >= 0
