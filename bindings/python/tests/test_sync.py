"""The synchronous client against the fake sidecar (or a real one, see conftest)."""

import os
import re
import signal
import threading
import time

import pytest

import polygate
from polygate import _core
from conftest import SCOPE
from fake_sidecar import HOLD, error


def _variant(x):
    return x if isinstance(x, str) else next(iter(x))


# ---------------------------------------------------------------- connect / handshake

def test_handshake(fake):
    with polygate.connect(fake.path) as client:
        assert client.sidecar_version == "0.1.0-fake"
        assert client.protocol_version == 3 and client.max_frame == 65536
        (hello,) = fake.requests("Hello")
        assert hello["request"]["Hello"] == {
            "protocol_version": 3,
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
    # The default for this uid: /run/polygate for root, $XDG_RUNTIME_DIR otherwise.
    monkeypatch.setenv("XDG_RUNTIME_DIR", sockdir)
    default = _core.default_socket()
    if not os.path.exists(default):
        with pytest.raises(polygate.SidecarError, match=re.escape(default)):
            polygate.connect()


def test_version_1_sidecar_is_a_clear_error(fake):
    fake.protocol_version = 1  # refuses Hello 2 the way a version-1 sidecar does
    with pytest.raises(polygate.SidecarError) as ei:
        polygate.connect(fake.path)
    assert ei.value.kind == "protocol_violation"
    assert "the sidecar speaks protocol 1, this client needs 2: upgrade polygate-sidecar" in str(ei.value)


def test_ping_status_admin(sidecar_path):
    with polygate.connect(sidecar_path) as client:
        assert client.ping() >= 0
        st = client.status()
        assert {"sidecar_version", "backend", "scopes"} <= set(st)  # plus keys as they are added
        assert SCOPE in st["scopes"]
        sc = st["scopes"][SCOPE]
        assert {"circuit_open", "quota_full", "waiters", "calls", "sources"} <= set(sc)
        for src in sc["sources"].values():
            assert set(src) >= {
                "state", "epoch", "retry_after_s", "cooldown_level", "window_successes",
                "window_failures", "streak", "memo_remaining_s", "pacer_ceiling", "in_flight",
                "tokens_available", "requests_available", "quota_blocked_s", "degraded"}
            assert src["state"] in ("closed", "open", "half_open")


def test_status_values_and_admin_wire(fake):
    with polygate.connect(fake.path) as client:
        st = client.status()
        assert fake.requests("StatusJson") and not fake.requests("Status")
        assert st["backend"] == "memory" and st["protocol_version"] == 2
        assert st["future_key"] == {"ignored": True}  # unknown keys pass through
        assert list(st["scopes"]) == ["chat", "embedding"] and list(st["scopes"]["chat"]["sources"]) == ["src-a", "src-b"]
        assert "name" not in st["scopes"]["chat"] and "name" not in st["scopes"]["chat"]["sources"]["src-a"]
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


def _reqs(fake):
    return [f["request"] for f in fake.requests() if _variant(f["request"]) != "Hello"]


def test_grant_success_wire(fake):
    """A call that succeeds first time is two frames: Start, Finish."""
    with polygate.connect(fake.path) as client:
        with client.call("chat", est_tokens=1200) as call:
            assert fake.requests("Hello") and not _reqs(fake), "entering the block sends nothing"
            permit = call.acquire()
            assert (permit.source, permit.attempt, permit.is_probe, permit.est_tokens) == ("src-a", 1, False, 1000)
            assert call.id == 100
            assert permit.success(tokens=1234) == polygate.ReportResult(True, "closed", 0.0)
            assert permit.result == polygate.ReportResult(True, "closed", 0.0)
            assert call.ended
            with pytest.raises(RuntimeError, match="succeeded"):
                call.acquire()
    assert _reqs(fake) == [
        {"Start": {"scope": "chat", "est_tokens": 1200, "priority": None, "est_input_tokens": None,
                   "est_output_tokens": None}},
        {"Finish": {"permit": permit.id, "outcome": {"Success": {"tokens": 1234, "count_attempt": True}}}},
    ]


def test_call_spec_and_usage_on_the_wire(fake):
    with polygate.connect(fake.path) as client:
        with client.call("chat", est_tokens=None, est_input_tokens=900, est_output_tokens=300) as call:
            call.acquire().failure("bad_result", tokens=740)
            call.acquire().success(input_tokens=1200, output_tokens=334)
        with client.call("chat", priority="") as call:  # empty = the scope's default
            call.acquire().success(tokens=5, count_attempt=True)
        with pytest.raises(polygate.SidecarError) as ei:
            with client.call("chat", priority="interactive") as call:
                call.acquire()
        assert ei.value.kind == "invalid_argument" and "priority" in str(ei.value)
    r = _reqs(fake)
    assert r[0] == {"Start": {"scope": "chat", "est_tokens": None, "priority": None, "est_input_tokens": 900,
                              "est_output_tokens": 300}}
    assert r[1]["Retry"]["outcome"] == {"FailureUsage": {"kind": "BadResult", "usage": {
        "tokens": 740, "input_tokens": None, "output_tokens": None}}}
    assert r[2]["Finish"]["outcome"] == {"SuccessUsage": {"usage": {
        "tokens": None, "input_tokens": 1200, "output_tokens": 334}, "count_attempt": True}}
    assert r[3]["Start"]["priority"] is None
    assert r[5]["Start"]["priority"] == "interactive"
    assert len(r) == 6, r  # the refused Start leaves no call: nothing sent at the block's end


def test_failure_then_retry_and_outcomes(fake):
    """Held reports travel with the next acquire (Retry) or the end (Finish)."""
    with polygate.connect(fake.path) as client:
        with client.call("chat") as call:
            p1 = call.acquire()
            assert p1.failure("timeout") is None and p1.reported and p1.result is None
            assert call.permit is None
            p2 = call.acquire()
            assert p2.attempt == 2
            p2.rate_limited(retry_after_s=2.5)
            p3 = call.acquire()
            assert p3.success(count_attempt=False) is None  # unusable: the call goes on
            p4 = call.acquire()
            p4.cancel()
        assert p4.result == polygate.ReportResult(True, "closed", 0.0)  # the Finish at the end answered
    permits = [p1.id, p2.id, p3.id, p4.id]
    assert [_variant(r) for r in _reqs(fake)] == ["Start", "Retry", "Retry", "Retry", "Finish"]
    assert [(r[_variant(r)].get("permit"), r[_variant(r)].get("outcome")) for r in _reqs(fake)][1:] == [
        (permits[0], {"Failure": {"kind": "Timeout"}}),
        (permits[1], {"RateLimited": {"retry_after_s": 2.5}}),
        (permits[2], {"Success": {"tokens": None, "count_attempt": False}}),
        (permits[3], "Cancelled"),
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
    assert [f["request"]["Retry"]["outcome"]["Failure"]["kind"] for f in fake.requests("Retry")] == list(wire.values())
    assert fake.requests("Finish")[0]["request"]["Finish"]["outcome"] == {"Failure": {"kind": "ServerError"}}


@pytest.mark.parametrize("bad", [
    lambda p: p.success(tokens=10**9 + 1),
    lambda p: p.success(tokens=-1),
    lambda p: p.success(input_tokens=6 * 10**8, output_tokens=6 * 10**8),
    lambda p: p.success(tokens=True),
    lambda p: p.failure("timeout", tokens=2**64),
    lambda p: p.rate_limited(retry_after_s=-1),
    lambda p: p.rate_limited(retry_after_s=float("inf")),
    lambda p: p.rate_limited(retry_after_s=float("nan")),
])
def test_bad_report_values_are_refused_here(fake, bad):
    with polygate.connect(fake.path) as client:
        with client.call("chat") as call:
            permit = call.acquire()
            with pytest.raises(ValueError):
                bad(permit)
            assert not permit.reported and call.permit is permit
            permit.success()
    assert [_variant(r) for r in _reqs(fake)] == ["Start", "Finish"]


@pytest.mark.parametrize("kw", [dict(est_tokens=10**9 + 1), dict(est_input_tokens=-1), dict(priority=3),
                                dict(est_output_tokens=1.5), dict(est_tokens=True), dict(est_tokens=1.0)])
def test_bad_call_values_are_refused_before_sending(fake, kw):
    with polygate.connect(fake.path) as client:
        client.call("chat", est_tokens=1, est_input_tokens=1, est_output_tokens=1)  # cached specs: no shortcut
        with pytest.raises(ValueError):
            client.call("chat", **kw)
        with pytest.raises(ValueError):
            client.call("")
    assert not _reqs(fake)


def test_acquire_with_an_unreported_permit_is_a_clear_error(fake):
    with polygate.connect(fake.path) as client:
        with client.call("chat") as call:
            permit = call.acquire()
            with pytest.raises(RuntimeError, match="permit %d of this call is not reported" % permit.id):
                call.acquire()
    assert [_variant(r) for r in _reqs(fake)] == ["Start", "EndCall"]  # the exit abandoned it


def test_report_twice_raises(fake):
    with polygate.connect(fake.path) as client:
        with client.call("chat") as call:
            permit = call.acquire()
            permit.success()
            for again in (permit.success, permit.cancel, lambda: permit.failure("timeout"),
                          permit.rate_limited):
                with pytest.raises(RuntimeError, match="already reported"):
                    again()
    assert len(fake.requests("Finish")) == 1 and not fake.requests("EndCall")


def test_block_exception_releases_in_one_frame(fake):
    with polygate.connect(fake.path) as client:
        with pytest.raises(ZeroDivisionError):
            with client.call("chat") as call:
                permit = call.acquire()
                1 / 0
        fake.wait_for(lambda: fake.requests("EndCall"))
        # one frame: the call ends and the unreported permit is abandoned (PROTOCOL.md §8)
        assert [_variant(r) for r in _reqs(fake)] == ["Start", "EndCall"]
        assert permit.reported
        assert client.ping() >= 0  # connection still fine
        assert not fake.calls and not fake.permits  # nothing left on the "sidecar"


def test_block_exception_after_failure_finishes_with_it(fake):
    with polygate.connect(fake.path) as client:
        with pytest.raises(KeyError):
            with client.call("chat") as call:
                call.acquire().failure("timeout")
                raise KeyError("gave up")
        fake.wait_for(lambda: fake.requests("Finish"))
        assert client.ping() >= 0
    assert [_variant(r) for r in _reqs(fake)][:2] == ["Start", "Finish"]
    assert fake.requests("Finish")[0]["request"]["Finish"]["outcome"] == {"Failure": {"kind": "Timeout"}}


def test_block_normal_exit_with_unreported_permit(fake):
    with polygate.connect(fake.path) as client:
        with client.call("chat") as call:
            permit = call.acquire()
        assert permit.reported
        # Abandoned, not cancelled: the request may have been sent (PROTOCOL.md §8).
        assert [_variant(r) for r in _reqs(fake)] == ["Start", "EndCall"]


def test_block_without_acquire_sends_nothing(fake):
    with polygate.connect(fake.path) as client:
        with client.call("chat"):
            pass
        with client.call("chat").begin() as call:  # begin(): Begin now, then a plain Acquire
            call.acquire().failure("timeout")
            call.acquire().success()
        with client.call("chat").begin():
            pass
    assert [_variant(r) for r in _reqs(fake)] == ["Begin", "Acquire", "Retry", "Finish", "Begin", "EndCall"]
    assert not fake.calls


def test_retry_final_error_ends_the_call(fake):
    replies = iter([None, error("AllSourcesExhausted", "3 of 3 attempts", exhausted="RetryExhausted", scope="chat")])

    def on_acquire(conn, rid, call):
        r = next(replies)
        return fake.grant(conn, rid, call) if r is None else r
    fake.on_acquire = on_acquire
    with polygate.connect(fake.path) as client:
        with client.call("chat") as call:
            call.acquire().failure("server_error")
            with pytest.raises(polygate.AllSourcesExhausted) as ei:
                call.acquire()
            assert ei.value.reason == "retry_exhausted" and call.ended
            with pytest.raises(RuntimeError, match="has ended: 3 of 3 attempts"):
                call.acquire()
    assert [_variant(r) for r in _reqs(fake)] == ["Start", "Retry"]  # the call is gone: nothing at the end


def test_retry_of_a_reclaimed_permit_keeps_the_call(fake):
    with polygate.connect(fake.path) as client:
        with client.call("chat") as call:
            call.acquire().failure("timeout")
            fake.permits.clear()  # the lease expired on the sidecar
            with pytest.raises(polygate.SidecarError) as ei:
                call.acquire()
            assert ei.value.kind == "unknown_permit" and not call.ended
            p = call.acquire()  # the call is still open: a plain Acquire
            assert p.attempt == 2
            p.success()
    assert [_variant(r) for r in _reqs(fake)] == ["Start", "Retry", "Acquire", "Finish"]


def test_finish_of_a_reclaimed_permit_at_exit_ends_the_call(fake):
    with polygate.connect(fake.path) as client:
        with client.call("chat") as call:
            call.acquire().failure("timeout")
            fake.permits.clear()
        fake.wait_for(lambda: fake.requests("EndCall"))
        assert not fake.calls
    assert [_variant(r) for r in _reqs(fake)] == ["Start", "Finish", "EndCall"]


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
            with client.call("no-such-scope-xyz") as call:
                call.acquire()
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
        fake.wait_for(lambda: fake.requests("Cancel"))
        start = fake.requests("Start")[0]
        (cancel,) = fake.requests("Cancel")
        assert cancel["request"] == {"Cancel": {"target": start["id"]}}
        assert client.ping() >= 0
        # a cancelled Start leaves no call: nothing else was sent, nothing is held
        assert [_variant(r) for r in _reqs(fake)] == ["Start", "Cancel", "Ping"]
        assert fake.held_count() == 0 and not fake.calls
        assert call.ended


@pytest.mark.parametrize("begun", [False, True])
def test_late_grant_after_interrupt_is_released(fake, sigint_raises, begun):
    """The sidecar granted before it saw the Cancel: the client releases the grant
    (Finish Cancelled after a Start, Report Cancelled after a plain Acquire)."""
    fake.on_acquire = lambda conn, rid, call: HOLD
    fake.on_cancel = lambda conn, rid, target: conn.release_held(
        target, fake.grant(conn, target, conn.held[target]["call"]))
    main = sigint_raises
    with polygate.connect(fake.path) as client:
        call = client.call("chat")
        if begun:
            call.begin()

        def interrupt():
            try:
                fake.wait_held(1)
            finally:
                signal.pthread_kill(main, signal.SIGINT)
        threading.Thread(target=interrupt, daemon=True).start()
        with pytest.raises(KeyboardInterrupt):
            call.acquire()
        call.end()
        if begun:
            fake.wait_for(lambda: fake.requests("Report") and fake.requests("EndCall"))
            assert fake.requests("Report")[0]["request"]["Report"]["outcome"] == "Cancelled"
        else:
            fake.wait_for(lambda: fake.requests("Finish"))
            assert fake.requests("Finish")[0]["request"]["Finish"]["outcome"] == "Cancelled"
            assert not fake.requests("EndCall")
        assert client.ping() >= 0
        assert not fake.calls and not fake.permits


def test_interrupts_racing_replies_never_cut_the_stream(fake, sigint_raises):
    """SIGINT sent the moment the sidecar sees the request — so it lands while the
    main thread is still in send, or reading the reply — is deferred to a safe
    point: KeyboardInterrupt is raised, the connection stays usable and whatever
    the request created is released."""
    main = sigint_raises

    def on_acquire(conn, rid, call):
        signal.pthread_kill(main, signal.SIGINT)
        return fake.grant(conn, rid, call)
    fake.on_acquire = on_acquire
    with polygate.connect(fake.path) as client:
        interrupted = 0
        for _ in range(30):
            try:
                with client.call("chat") as call:
                    call.acquire().success()
            except KeyboardInterrupt:
                interrupted += 1
            assert not client.closed
        assert interrupted == 30
        assert client.ping() >= 0
        fake.wait_for(lambda: not fake.calls and not fake.permits)


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
    assert sorted(f["request"]["Finish"]["outcome"]["Success"]["tokens"] for f in fake.requests("Finish")) == list(range(n))


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
        assert not client.closed  # lost, not closed: the next use reconnects (test_reconnect.py)


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


def test_no_helper_threads(fake):
    """The request path has no thread hop: the calling threads write and read."""
    def ours():  # threads other than the fake sidecar's
        return {t for t in threading.enumerate() if t.name != "fake-sidecar"}
    before = ours()
    with polygate.connect(fake.path) as client:
        with client.call("chat") as call:
            call.acquire().success()
        assert ours() == before
        errors = []

        def worker():
            try:
                for _ in range(50):
                    with client.call("chat") as c:
                        c.acquire().success()
            except BaseException as e:  # noqa: BLE001
                errors.append(e)
        threads = [threading.Thread(target=worker) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(20)
        assert not errors and ours() == before
    assert len(fake.requests("Finish")) == 201


def test_handshake_timeout(sockdir):
    """A sidecar that accepts but never answers Hello: connect() gives up in time."""
    import socket
    path = os.path.join(sockdir, "mute.sock")
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    srv.listen(1)
    try:
        t0 = time.monotonic()
        with pytest.raises(polygate.SidecarError, match="within 0.3s"):
            polygate.connect(path, timeout=0.3)
        assert time.monotonic() - t0 < 3
    finally:
        srv.close()
