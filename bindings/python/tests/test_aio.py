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
    assert names == ["Hello", "BeginCall", "Acquire", "Report", "Acquire", "Report", "EndCall",
                     "ForceOpen", "ForceClose", "Reset"]
    assert [f["request"]["Report"]["outcome"] for f in fake.requests("Report")] == [
        {"Failure": {"kind": "ServerError"}}, {"RateLimited": {"retry_after_s": None}}]


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
    fake.wait_for(lambda: fake.requests("EndCall"))
    names = [_variant(f["request"]) for f in fake.requests()]
    assert names[-3:] == ["Report", "EndCall", "Ping"]
    assert fake.requests("Report")[0]["request"]["Report"] == {"permit": permit.id, "outcome": "Cancelled"}


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
            await asyncio.get_event_loop().run_in_executor(
                None, fake.wait_for, lambda: fake.requests("EndCall"))
            assert await client.ping() >= 0
    run(main())
    acq = fake.requests("Acquire")[0]
    assert fake.requests("Cancel")[0]["request"] == {"Cancel": {"target": acq["id"]}}
    names = [_variant(f["request"]) for f in fake.requests()]
    assert names.index("Cancel") < names.index("EndCall")
    assert fake.held_count() == 0


def test_wait_for_timeout_cancels(fake):
    fake.on_acquire = lambda conn, rid, call: HOLD

    async def main():
        async with await polygate.aio.connect(fake.path) as client:
            async with client.call("chat") as call:
                with pytest.raises(asyncio.TimeoutError):
                    await asyncio.wait_for(call.acquire(), 0.2)
            await client.ping()
    run(main())
    assert len(fake.requests("Cancel")) == 1 and len(fake.requests("EndCall")) == 1


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
    for v in ("BeginCall", "Acquire", "Report", "EndCall"):
        assert len(fake.requests(v)) == n, v
    ids = [f["id"] for f in fake.requests()]
    assert len(set(ids)) == len(ids)
    assert sorted(f["request"]["Report"]["outcome"]["Success"]["tokens"] for f in fake.requests("Report")) == list(range(n))


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
        assert client.closed
        with pytest.raises(polygate.SidecarError):
            await client.ping()
        await client.close()
    run(main())


def test_late_grant_after_cancel_is_released(fake):
    fake.on_acquire = lambda conn, rid, call: HOLD
    fake.on_cancel = lambda conn, rid, target: conn.release_held(
        target, fake.grant(conn, target, conn.held[target]["call"]))

    async def main():
        async with await polygate.aio.connect(fake.path) as client:
            call = await client.call("chat").begin()
            task = asyncio.ensure_future(call.acquire())
            await asyncio.get_event_loop().run_in_executor(None, fake.wait_held, 1)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await asyncio.get_event_loop().run_in_executor(
                None, fake.wait_for, lambda: fake.requests("Report"))
            await call.end()
    run(main())
    assert fake.requests("Report")[0]["request"]["Report"]["outcome"] == "Cancelled"
