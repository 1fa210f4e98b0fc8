"""polygate.aio against the fake sidecar (or a real one, see conftest)."""

import asyncio
import os

import pytest

import polygate
import polygate.aio
from conftest import SCOPE
from fake_sidecar import HOLD, error


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


def _variant(x):
    return x if isinstance(x, str) else next(iter(x))


def test_same_names():
    for name in ("connect", "Client", "Call", "Permit", "SidecarError", "GatewayUnavailableError",
                 "CircuitOpenError", "AllSourcesExhausted", "PolyGateError", "ReportResult"):
        assert hasattr(polygate.aio, name), name
    assert polygate.aio.CircuitOpenError is polygate.CircuitOpenError


def test_handshake_and_flow(sidecar_path):
    async def main():
        async with await polygate.aio.connect(sidecar_path, client_name="aio-test") as client:
            assert await client.ping() >= 0
            async with client.call(SCOPE, est_tokens=100) as call:
                permit = await call.acquire()
                assert permit.attempt == 1
                res = await permit.success(tokens=90)
                assert res.state in ("closed", "open", "half_open")
            st = await client.status()
            assert SCOPE in st["scopes"]
        assert client.closed
    run(main())


def test_wire_flow(fake):
    async def main():
        client = await polygate.aio.connect(fake.path)
        try:
            async with client.call("chat") as call:
                p = await call.acquire()
                await p.failure("server_error")
                p = await call.acquire()
                with pytest.raises(ValueError, match="bad_result"):
                    await p.failure("nope")
                await p.rate_limited()
                with pytest.raises(RuntimeError):
                    await p.success()
            await client.force_open("src-a", seconds=5)
            await client.force_close("src-a")
            await client.reset("src-a")
        finally:
            await client.close()
    run(main())
    hello = fake.requests("Hello")[0]["request"]["Hello"]
    assert hello["pid"] == os.getpid()
    names = [_variant(f["request"]) for f in fake.requests()]
    assert names == ["Hello", "Start", "Retry", "Finish", "ForceOpen", "ForceClose", "Reset"]
    assert fake.requests("Retry")[0]["request"]["Retry"]["outcome"] == {"Failure": {"kind": "ServerError"}}
    assert fake.requests("Finish")[0]["request"]["Finish"]["outcome"] == {"RateLimited": {"retry_after_s": None}}


def test_missing_socket_names_path(sockdir):
    path = os.path.join(sockdir, "missing.sock")

    async def main():
        with pytest.raises(polygate.SidecarError) as ei:
            await polygate.aio.connect(path)
        assert path in str(ei.value) and ei.value.kind == "connection"
    run(main())


@pytest.mark.parametrize("reply, cls, kind", [
    (error("CircuitOpen", "open", retry_after_s=3.0, reasons=(("src-a", "CircuitOpen"),), scope="chat"),
     polygate.CircuitOpenError, "circuit_open"),
    (error("AllSourcesExhausted", "stalled", exhausted="Stalled", scope="chat"),
     polygate.AllSourcesExhausted, "all_sources_exhausted"),
    (error("BackendUnavailable", "redis down"), polygate.GatewayUnavailableError, "backend_unavailable"),
    (error("ShuttingDown", "bye"), polygate.SidecarError, "shutting_down"),
])
def test_error_mapping(fake, reply, cls, kind):
    fake.on_acquire = lambda conn, rid, call: reply

    async def main():
        async with await polygate.aio.connect(fake.path) as client:
            async with client.call("chat") as call:
                with pytest.raises(polygate.PolyGateError) as ei:
                    await call.acquire()
            assert type(ei.value) is cls and ei.value.kind == kind
            assert str(ei.value) == reply["Error"]["message"]
            if cls is polygate.CircuitOpenError:
                assert ei.value.retry_after_s == 3.0
                assert ei.value.per_source_reasons == {"src-a": "circuit_open"}
                assert ei.value.scope == "chat"
            if cls is polygate.AllSourcesExhausted:
                assert ei.value.reason == "stalled"
    run(main())


def test_block_exception_releases(fake):
    async def main():
        async with await polygate.aio.connect(fake.path) as client:
            with pytest.raises(KeyError):
                async with client.call("chat") as call:
                    permit = await call.acquire()
                    raise KeyError("boom")
            await client.ping()
            return permit
    permit = run(main())
    names = [_variant(f["request"]) for f in fake.requests()]
    # The release is one frame: the call ends and the unreported permit is abandoned
    # (its estimate stays charged, PROTOCOL.md §8), not cancelled.
    assert names == ["Hello", "Start", "EndCall", "Ping"]
    assert permit.reported
    assert not fake.calls and not fake.permits


def test_cancel_pending_acquire_sends_cancel(fake):
    fake.on_acquire = lambda conn, rid, call: HOLD

    async def main():
        async with await polygate.aio.connect(fake.path) as client:
            async def worker():
                async with client.call("chat") as call:
                    await call.acquire()
            task = asyncio.ensure_future(worker())
            await asyncio.get_event_loop().run_in_executor(None, fake.wait_held, 1)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert await client.ping() >= 0
    run(main())
    start = fake.requests("Start")[0]
    assert fake.requests("Cancel")[0]["request"] == {"Cancel": {"target": start["id"]}}
    names = [_variant(f["request"]) for f in fake.requests()]
    assert names == ["Hello", "Start", "Cancel", "Ping"]  # a cancelled Start leaves no call to end
    assert fake.held_count() == 0 and not fake.calls


def test_wait_for_timeout_cancels(fake):
    fake.on_acquire = lambda conn, rid, call: HOLD

    async def main():
        async with await polygate.aio.connect(fake.path) as client:
            async with client.call("chat") as call:
                with pytest.raises(asyncio.TimeoutError):
                    await asyncio.wait_for(call.acquire(), 0.2)
            await client.ping()
    run(main())
    assert len(fake.requests("Cancel")) == 1 and not fake.requests("EndCall") and not fake.calls


def test_500_concurrent_calls_one_connection(fake):
    n = 500
    fake.on_acquire = lambda conn, rid, call: HOLD

    async def main():
        client = await polygate.aio.connect(fake.path)

        async def one(i):
            async with client.call("chat", est_tokens=i + 1) as call:
                p = await call.acquire()
                await p.success(tokens=i)
                return p.source

        tasks = [asyncio.ensure_future(one(i)) for i in range(n)]
        loop = asyncio.get_event_loop()
        await loop.run_in_executor(None, fake.wait_held, n, 20.0)  # all outstanding at once
        await loop.run_in_executor(None, fake.release_all_held, fake.grant)
        sources = await asyncio.gather(*tasks)
        await client.close()
        return sources
    sources = run(main())
    assert sources == ["src-a"] * n
    assert len(fake.conns) == 1
    for v in ("Start", "Finish"):
        assert len(fake.requests(v)) == n, v
    assert len(fake.requests()) == 1 + 2 * n
    ids = [f["id"] for f in fake.requests()]
    assert len(set(ids)) == len(ids)
    assert sorted(f["request"]["Finish"]["outcome"]["Success"]["tokens"] for f in fake.requests("Finish")) == list(range(n))


def test_connection_loss_fails_pending(fake):
    fake.on_acquire = lambda conn, rid, call: HOLD

    async def main():
        client = await polygate.aio.connect(fake.path)

        async def one():
            async with client.call("chat") as call:
                await call.acquire()
        tasks = [asyncio.ensure_future(one()) for _ in range(5)]
        await asyncio.get_event_loop().run_in_executor(None, fake.wait_held, 5)
        fake.drop_all()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        for r in results:
            assert isinstance(r, polygate.SidecarError) and r.kind == "connection", r
            assert fake.path in str(r)
        assert not client.closed  # lost, not closed: the next use reconnects (test_reconnect.py)
        await client.close()
    run(main())


@pytest.mark.parametrize("begun", [False, True])
def test_late_grant_after_cancel_is_released(fake, begun):
    fake.on_acquire = lambda conn, rid, call: HOLD
    fake.on_cancel = lambda conn, rid, target: conn.release_held(
        target, fake.grant(conn, target, conn.held[target]["call"]))

    async def main():
        async with await polygate.aio.connect(fake.path) as client:
            call = client.call("chat")
            if begun:
                await call.begin()
            task = asyncio.ensure_future(call.acquire())
            await asyncio.get_event_loop().run_in_executor(None, fake.wait_held, 1)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await asyncio.get_event_loop().run_in_executor(
                None, fake.wait_for, lambda: fake.requests("Report" if begun else "Finish"))
            await call.end()
            await client.ping()
    run(main())
    if begun:  # a plain Acquire's late grant is reported Cancelled; the call ends with EndCall
        assert fake.requests("Report")[0]["request"]["Report"]["outcome"] == "Cancelled"
        assert fake.requests("EndCall")
    else:  # a Start's late grant is finished: the call is gone in the same frame
        assert fake.requests("Finish")[0]["request"]["Finish"]["outcome"] == "Cancelled"
        assert not fake.requests("EndCall")
    assert not fake.calls and not fake.permits


def test_writes_coalesce_per_tick(fake, monkeypatch):
    """Frames queued in one turn of the event loop leave in one write."""
    writes = []

    async def main():
        async with await polygate.aio.connect(fake.path) as client:
            transport = client._conn._transport
            real = transport.write
            monkeypatch.setattr(transport, "write", lambda data: (writes.append(bytes(data)), real(data)))

            async def one(i):
                async with client.call("chat", est_tokens=i + 1) as call:
                    await (await call.acquire()).success(tokens=i)
            await asyncio.gather(*(one(i) for i in range(50)))
    run(main())
    assert len(fake.requests("Start")) == 50 and len(fake.requests("Finish")) == 50
    # 50 Starts went out in the first tick as one write; far fewer writes than frames overall
    assert writes[0].count(b"\x0b\x00\x00\x00\x04\x00\x00\x00\x00\x00\x00\x00chat") == 50
    assert len(writes) < 50, len(writes)


def test_held_reports_and_usage(fake):
    async def main():
        async with await polygate.aio.connect(fake.path) as client:
            async with client.call("chat", priority=None, est_input_tokens=10) as call:
                p = await call.acquire()
                assert await p.failure("timeout", tokens=3) is None
                p = await call.acquire()
                r = await p.success(input_tokens=7, output_tokens=2)
                assert r == polygate.ReportResult(True, "closed", 0.0) and call.ended
                with pytest.raises(RuntimeError, match="succeeded"):
                    await call.acquire()
            async with client.call("chat") as call:
                await (await call.acquire()).rate_limited(1.5)
            assert (await client.status())["protocol_version"] == 2
    run(main())
    names = [_variant(f["request"]) for f in fake.requests()]
    assert names == ["Hello", "Start", "Retry", "Finish", "Start", "Finish", "StatusJson"]
    assert fake.requests("Start")[0]["request"]["Start"]["est_input_tokens"] == 10
    assert fake.requests("Finish")[1]["request"]["Finish"]["outcome"] == {"RateLimited": {"retry_after_s": 1.5}}


def test_version_1_sidecar_is_a_clear_error(fake):
    fake.protocol_version = 1

    async def main():
        with pytest.raises(polygate.SidecarError) as ei:
            await polygate.aio.connect(fake.path)
        assert "the sidecar speaks protocol 1, this client needs 2: upgrade polygate-sidecar" in str(ei.value)
    run(main())
