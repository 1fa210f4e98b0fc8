"""Protocol 3, tenants (DESIGN §19, PROTOCOL.md §15), against the fake sidecar:
StartTenant / BeginTenant on the wire, the TenantLimited refusal as
TenantLimitExceeded, run() raising it at once, the fallback to version 2 with a
tenant refused client-side, the 128-byte limit, SuccessCached, tenant_status."""

import asyncio
import json
import os

import pytest

import polygate
import polygate.aio
from polygate import _wire
from fake_sidecar import tenant_limited

VECTORS = {v["name"]: v for v in json.load(open(os.path.join(
    os.path.dirname(os.path.abspath(__file__)), "..", "..", "vectors", "frames.json"), encoding="utf-8"))["vectors"]}


def arun(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


def _variant(x):
    return x if isinstance(x, str) else next(iter(x))


def _names(fake):
    return [_variant(f["request"]) for f in fake.requests()]


def _body_bytes(vector_name):
    """A vector's request bytes after the frame's length and id."""
    return bytes.fromhex(VECTORS[vector_name]["frame_hex"])[12:]


REFUSAL = tenant_limited("acme", "usd_per_day", retry_after_s=5400.0, scope="chat",
                         reasons=(("src-a", "TenantLimited"), ("src-b", "CircuitOpen")),
                         message='tenant "acme" of scope "chat" is over its usd_per_day budget')


def _check_refusal(e):
    assert isinstance(e, polygate.TenantLimitExceeded)
    assert isinstance(e, polygate.GatewayUnavailableError)
    assert e.tenant == "acme" and e.limit == "usd_per_day" and e.kind == "tenant_limited"
    assert e.retry_after_s == 5400.0 and e.scope == "chat"
    assert e.per_source_reasons == {"src-a": "tenant_limited", "src-b": "circuit_open"}
    assert str(e) == 'tenant "acme" of scope "chat" is over its usd_per_day budget'


# ---------------------------------------------------------------- the wire

def test_start_tenant_bytes_match_the_vector(fake):
    with polygate.connect(fake.path) as client:
        with client.call("chat", est_input_tokens=800, est_output_tokens=200, tenant="acme") as call:
            call.acquire().success(tokens=5)
        with client.call("chat", 1200, tenant="équipe-東京") as call:
            call.begin()
            call.acquire().success()
    assert _names(fake) == ["Hello", "StartTenant", "Finish", "BeginTenant", "Acquire", "Finish"]
    assert fake.payloads[1][8:] == _body_bytes("start_tenant")
    begin = fake.requests("BeginTenant")[0]["request"]["BeginTenant"]
    assert begin == {"spec": {"scope": "chat", "est_tokens": 1200, "priority": None, "est_input_tokens": None,
                              "est_output_tokens": None}, "tenant": "équipe-東京"}


def test_no_tenant_or_empty_is_a_plain_start_byte_for_byte(fake):
    with polygate.connect(fake.path) as client:
        for tenant in (None, ""):
            with client.call("chat", est_input_tokens=800, est_output_tokens=200, tenant=tenant) as call:
                assert call.tenant is None
                call.acquire().success(tokens=5)
        with client.call("chat", est_input_tokens=800, est_output_tokens=200) as call:
            call.acquire().success(tokens=5)
    assert _names(fake) == ["Hello"] + ["Start", "Finish"] * 3
    starts = [p[8:] for p in fake.payloads if p[8:12] == (11).to_bytes(4, "little")]
    assert len(starts) == 3 and len(set(starts)) == 1
    assert starts[0] == _wire.encode(_wire.REQUEST, {"Start": {"scope": "chat", "est_input_tokens": 800,
                                                               "est_output_tokens": 200}})


def test_tenant_id_limit_is_checked_at_the_call(fake):
    with polygate.connect(fake.path) as client:
        for bad in ("a" * 129, "東" * 43):  # 129 bytes of UTF-8 both
            with pytest.raises(ValueError, match="129 bytes of UTF-8; the limit is 128 bytes"):
                client.call("chat", tenant=bad)
            with pytest.raises(ValueError, match="the limit is 128 bytes"):
                client.run("chat", lambda p: None, tenant=bad)
        with pytest.raises(ValueError, match="tenant must be a string"):
            client.call("chat", tenant=7)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="UTF-8"):
            client.call("chat", tenant="\udc80")
        with client.call("chat", tenant="東" * 42 + "ab") as call:  # exactly 128 bytes
            call.acquire().success()
    assert _names(fake) == ["Hello", "StartTenant", "Finish"]


# ---------------------------------------------------------------- the refusal

def test_tenant_limited_reply_is_tenant_limit_exceeded_and_ends_the_call(fake):
    seen = []
    fake.on_tenant = lambda conn, rid, spec, tenant: seen.append(tenant) or REFUSAL
    with polygate.connect(fake.path) as client:
        with client.call("chat", tenant="acme") as call:
            with pytest.raises(polygate.TenantLimitExceeded) as ei:
                call.acquire()
            assert call.ended
            with pytest.raises(RuntimeError, match="over its usd_per_day budget"):
                call.acquire()
        _check_refusal(ei.value)
        assert client.ping() >= 0
    assert seen == ["acme"]
    assert _names(fake) == ["Hello", "StartTenant", "Ping"]  # nothing to end after a refused StartTenant


def test_run_raises_tenant_limit_at_once(fake):
    fake.on_tenant = lambda conn, rid, spec, tenant: REFUSAL
    calls = []
    with polygate.connect(fake.path) as client:
        with pytest.raises(polygate.TenantLimitExceeded) as ei:
            client.run("chat", calls.append, tenant="acme")
    _check_refusal(ei.value)
    assert calls == [] and _names(fake) == ["Hello", "StartTenant"]


def test_run_does_not_fail_over_after_a_tenant_refused_retry(fake):
    """A retryable failure, then the Retry is refused by the tenant: run() raises
    the refusal (from the attempt's exception) with no further attempt."""
    answers = iter([None, REFUSAL])

    def on_acquire(conn, rid, call):
        a = next(answers)
        return fake.grant(conn, rid, call) if a is None else a
    fake.on_acquire = on_acquire
    attempts = []

    def fn(permit):
        attempts.append(permit.source)
        raise TimeoutError("upstream timed out")
    with polygate.connect(fake.path) as client:
        with pytest.raises(polygate.TenantLimitExceeded) as ei:
            client.run("chat", fn, tenant="acme")
    _check_refusal(ei.value)
    assert isinstance(ei.value.__cause__, TimeoutError)
    assert attempts == ["src-a"] and _names(fake) == ["Hello", "StartTenant", "Retry"]


def test_gated_takes_a_tenant(fake):
    with polygate.connect(fake.path) as client:
        @client.gated("chat", tenant="acme")
        def ask(permit, q):
            return {"q": q, "usage": {"input_tokens": 3, "output_tokens": 4}}
        assert ask("hi")["q"] == "hi"
    assert fake.requests("StartTenant")[0]["request"]["StartTenant"]["tenant"] == "acme"


# ---------------------------------------------------------------- version 2 sidecars

def test_v2_sidecar_falls_back_and_refuses_tenant_calls(fake):
    fake.protocol_version = 2  # refuses Hello 3 as a version-2 sidecar does, and closes
    with polygate.connect(fake.path) as client:
        assert client.protocol_version == 2
        assert [h["request"]["Hello"]["protocol_version"] for h in fake.requests("Hello")] == [3, 2]
        for attempt in (lambda: client.call("chat", tenant="acme").acquire(),
                        lambda: client.call("chat", tenant="acme").begin(),
                        lambda: client.run("chat", lambda p: None, tenant="acme"),
                        lambda: client.tenant_status("acme")):
            with pytest.raises(polygate.SidecarError) as ei:
                attempt()
            assert "the sidecar speaks protocol 2; tenants need 3: upgrade polygate-sidecar" in str(ei.value)
            assert ei.value.kind == "protocol_violation"
        with client.call("chat") as call:  # an anonymous call works as ever
            call.acquire().success(tokens=3, cached_input_tokens=10)
    assert _names(fake) == ["Hello", "Hello", "Start", "Finish"]  # no tenant frame ever left
    assert fake.requests("Finish")[0]["request"]["Finish"]["outcome"] == {
        "Success": {"tokens": 3, "count_attempt": True}}


def test_v2_fallback_on_reconnect(fake):
    with polygate.connect(fake.path) as client:
        assert client.protocol_version == 3
        fake.protocol_version = 2
        fake.drop_all()
        fake.wait_for(lambda: all(c.closed for c in fake.conns))
        with pytest.raises(polygate.SidecarError, match="tenants need 3"):
            client.call("chat", tenant="acme").acquire()  # the reconnect found a version-2 sidecar
        assert client.protocol_version == 2
    assert "StartTenant" not in _names(fake)


def test_v1_sidecar_is_still_a_clear_error(fake):
    fake.protocol_version = 1
    with pytest.raises(polygate.SidecarError, match="speaks protocol 1, this client needs 2"):
        polygate.connect(fake.path)
    assert [h["request"]["Hello"]["protocol_version"] for h in fake.requests("Hello")] == [3]


# ---------------------------------------------------------------- SuccessCached, tenant_status

@pytest.mark.parametrize("version", [3, 2])
def test_cached_input_tokens_are_sent_as_success_cached_on_v3(fake, version):
    fake.protocol_version = version
    with polygate.connect(fake.path) as client:
        with client.call("chat") as call:
            call.acquire().success(input_tokens=512, output_tokens=300, cached_input_tokens=2048)
        with client.call("chat") as call:  # zero cached: SuccessUsage on either version
            call.acquire().success(input_tokens=5, output_tokens=6, cached_input_tokens=0)
        with client.call("chat") as call:
            with pytest.raises(ValueError, match="cached_input_tokens"):
                call.acquire().success(cached_input_tokens=-1)
    outcomes = [f["request"]["Finish"]["outcome"] for f in fake.requests("Finish")]
    usage = {"tokens": None, "input_tokens": 512, "output_tokens": 300}
    if version == 3:
        assert outcomes[0] == {"SuccessCached": {"usage": usage, "cached_input_tokens": 2048, "count_attempt": True}}
        finish = [p for p in fake.payloads if p[8:12] == (13).to_bytes(4, "little")][0]
        assert finish[16:] == _body_bytes("finish_success_cached")[8:]  # after the permit id
    else:
        assert outcomes[0] == {"SuccessUsage": {"usage": usage, "count_attempt": True}}
    assert outcomes[1] == {"SuccessUsage": {"usage": {"tokens": None, "input_tokens": 5, "output_tokens": 6},
                                            "count_attempt": True}}
    assert len(outcomes) == 2 and _names(fake)[-1] == "EndCall"  # the bad count sent nothing


def test_tenant_status(fake):
    with polygate.connect(fake.path) as client:
        with client.call("chat", tenant="acme") as call:
            call.acquire()
            doc = client.tenant_status("acme")
            assert doc["tenant"] == "acme" and list(doc["scopes"]) == ["chat", "embedding"]
            assert doc["scopes"]["chat"]["in_flight"] == 1
        one = client.tenant_status("", scope="embedding")
        assert one == {"tenant": "", "scopes": {"embedding": {"limits": {"tpm": 1000}, "in_flight": 0,
                                                              "waiting": 0, "spend_usd": {"day": 0.5}}}}
        with pytest.raises(ValueError, match="limit is 128 bytes"):
            client.tenant_status("x" * 200)
    assert [f["request"]["TenantStatus"] for f in fake.requests("TenantStatus")] == [
        {"scope": None, "tenant": "acme"}, {"scope": "embedding", "tenant": ""}]


# ---------------------------------------------------------------- polygate.aio

def test_aio_tenants(fake):
    fake.on_tenant = lambda conn, rid, spec, tenant: REFUSAL if tenant == "broke" else None

    async def main():
        async with await polygate.aio.connect(fake.path) as client:
            assert client.protocol_version == 3
            async with client.call("chat", est_input_tokens=800, est_output_tokens=200, tenant="acme") as call:
                await (await call.acquire()).success(input_tokens=512, output_tokens=300, cached_input_tokens=2048)
            calls = []
            with pytest.raises(polygate.aio.TenantLimitExceeded) as ei:
                await client.run("chat", lambda p: calls.append(p), tenant="broke")  # type: ignore[arg-type]
            _check_refusal(ei.value)
            assert calls == []

            @client.gated("chat", tenant="acme")
            async def ask(permit):
                return {"usage": {"prompt_tokens": 9, "completion_tokens": 1,
                                  "prompt_tokens_details": {"cached_tokens": 4}}}
            await ask()
            assert (await client.tenant_status("acme", scope="chat"))["scopes"]["chat"]["in_flight"] == 0
            with pytest.raises(ValueError, match="limit is 128 bytes"):
                client.call("chat", tenant="y" * 129)
    arun(main())
    assert _names(fake) == ["Hello", "StartTenant", "Finish", "StartTenant", "StartTenant", "Finish", "TenantStatus"]
    assert fake.payloads[1][8:] == _body_bytes("start_tenant")
    assert fake.requests("Finish")[1]["request"]["Finish"]["outcome"] == {"SuccessCached": {
        "usage": {"tokens": None, "input_tokens": 5, "output_tokens": 1}, "cached_input_tokens": 4,
        "count_attempt": True}}


def test_aio_v2_fallback_refuses_tenants(fake):
    fake.protocol_version = 2

    async def main():
        async with await polygate.aio.connect(fake.path) as client:
            assert client.protocol_version == 2
            with pytest.raises(polygate.SidecarError, match="speaks protocol 2; tenants need 3: upgrade"):
                await client.call("chat", tenant="acme").acquire()
            with pytest.raises(polygate.SidecarError, match="speaks protocol 2; tenants need 3: upgrade"):
                await client.tenant_status("acme")
            async with client.call("chat") as call:
                await (await call.acquire()).success(input_tokens=1, output_tokens=2, cached_input_tokens=3)
    arun(main())
    assert _names(fake) == ["Hello", "Hello", "Start", "Finish"]
    assert fake.requests("Finish")[0]["request"]["Finish"]["outcome"] == {"SuccessUsage": {
        "usage": {"tokens": None, "input_tokens": 1, "output_tokens": 2}, "count_attempt": True}}


@pytest.mark.parametrize("said, fallback, named", [
    ('protocol version mismatch: client "x" speaks version 3, this sidecar speaks versions 1 to 2', True, None),
    ('protocol version mismatch: client "x" speaks version 3, this sidecar speaks version 1', False, "1"),
    ("protocol version 3 not supported; this sidecar speaks 1", False, "1"),
    ("protocol version 3 not supported", True, None),  # names no version: try 2, whose refusal is then final
])
def test_the_refusal_is_read_for_the_sidecar_s_versions(said, fallback, named):
    from polygate import _core
    reply = {"Error": {"kind": "ProtocolViolation", "message": said, "retry_after_s": 0.0,
                       "per_source_reasons": [], "exhausted": None, "scope": None}}
    if fallback:
        with pytest.raises(_core.VersionFallback) as fb:
            _core.check_welcome(reply, 3)
        assert fb.value.version == 2
    else:
        with pytest.raises(polygate.SidecarError, match="speaks protocol %s, this client needs 2" % named):
            _core.check_welcome(reply, 3)
    with pytest.raises(polygate.SidecarError, match="this client needs 2: upgrade"):  # saying 2 already: final
        _core.check_welcome(reply, 2)
