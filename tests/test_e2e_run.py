"""End-to-end: client.run (sync and asyncio) against the real daemon (DESIGN §13/§14)."""

from __future__ import annotations

import asyncio

import pytest

import polygate
import polygate.aio
from .polygate_e2e import scope


class _Response:
    def __init__(self, status_code, headers):
        self.status_code = status_code
        self.headers = headers


class UpstreamHTTPError(Exception):
    """Shaped like the openai SDK's APIStatusError: status_code and response.headers."""

    def __init__(self, status, headers=None):
        super().__init__("upstream answered %d" % status)
        self.status_code = status
        self.response = _Response(status, headers or {})


class Usage:
    def __init__(self, **kw):
        self.__dict__.update(kw)


class Completion:
    def __init__(self, text, **usage):
        self.text = text
        self.usage = Usage(**usage)


def test_run_success_charges_the_results_usage(sidecar):
    sidecar.write_config({"chat": scope({"name": "a", "tpm": 60000, "timeout": "5s"})})
    sidecar.start()
    client = sidecar.client()
    full = sidecar.source_status(client, "a")["tokens_available"]
    reply = client.run("chat", lambda p: Completion("hi from " + p.source, prompt_tokens=2500,
                                                    completion_tokens=500, total_tokens=3000), est_tokens=100)
    assert reply.text == "hi from a"
    left = sidecar.source_status(client, "a")["tokens_available"]
    assert full - 3200 < left < full - 2800, (full, left)  # charged the actual 3000, not the estimate
    assert client.status()["scopes"]["chat"]["calls"] == 0


def test_run_fails_over_on_timeout(sidecar):
    sidecar.write_config({"chat": scope("a", "b", breaker={"failure_threshold": 5})})
    sidecar.start()
    client = sidecar.client()

    def fn(permit):
        if permit.source == "a":
            raise TimeoutError("a is slow")
        return permit.source
    assert client.run("chat", fn) == "b"
    st = client.status()["scopes"]["chat"]["sources"]
    assert st["a"]["window_failures"] == 1 and st["b"]["window_successes"] == 1


def test_run_429_is_backpressure_not_failure(sidecar):
    sidecar.write_config({"chat": scope({"name": "a", "tpm": 60000, "timeout": "5s"}, "b",
                                        breaker={"failure_threshold": 1})})
    sidecar.start()
    client = sidecar.client()

    def fn(permit):
        if permit.source == "a":
            raise UpstreamHTTPError(429, {"retry-after": "30"})
        return "ok"
    assert client.run("chat", fn) == "ok"
    a = sidecar.source_status(client, "a")
    assert a["state"] == "closed", "a 429 must not open the breaker (failure_threshold = 1)"
    assert a["window_failures"] == 0 and a["streak"] == 0, a
    assert 25 < a["quota_blocked_s"] <= 30, "the Retry-After blocks the source's quota: %r" % (a,)


def test_run_final_circuit_open_is_raised_from_the_upstream_error(sidecar):
    sidecar.write_config({"chat": scope("a", breaker={"failure_threshold": 1}, circuit_open="fail_fast")})
    sidecar.start()
    client = sidecar.client()
    last = UpstreamHTTPError(503)

    def fn(permit):
        raise last
    with pytest.raises(polygate.CircuitOpenError) as ei:
        client.run("chat", fn)
    assert ei.value.__cause__ is last and ei.value.per_source_reasons == {"a": "circuit_open"}
    assert sidecar.source_status(client, "a")["state"] == "open"
    assert client.status()["scopes"]["chat"]["calls"] == 0


def test_run_does_not_retry_a_400_nor_blame_the_source(sidecar):
    sidecar.write_config({"chat": scope("a", "b", breaker={"failure_threshold": 1})})
    sidecar.start()
    client = sidecar.client()
    seen = []

    def fn(permit):
        seen.append(permit.source)
        raise UpstreamHTTPError(400)
    with pytest.raises(UpstreamHTTPError):
        client.run("chat", fn)
    client.ping()
    assert seen == ["a"]
    a = sidecar.source_status(client, "a")
    assert a["state"] == "closed" and a["window_failures"] == 0 and a["in_flight"] == 0, a


def test_aio_run_and_cancellation_release_everything(sidecar):
    sidecar.write_config({"chat": scope("a", "b")})
    sidecar.start()

    async def main():
        client = await polygate.aio.connect(sidecar.socket)
        try:
            async def flaky(permit):
                if permit.attempt == 1:
                    raise asyncio.TimeoutError()
                return permit.source
            assert await client.run("chat", flaky) == "b"

            started = asyncio.Event()

            async def slow(permit):
                started.set()
                await asyncio.sleep(3600)
            task = asyncio.ensure_future(client.run("chat", slow))
            await started.wait()
            st = (await client.status())["scopes"]["chat"]
            assert st["calls"] == 1
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            # The release is posted (fire and forget) and the sidecar may answer a
            # later request first: wait for it, boundedly.
            for _ in range(100):
                st = (await client.status())["scopes"]["chat"]
                if st["calls"] == 0 and all(s["in_flight"] == 0 for s in st["sources"].values()):
                    break
                await asyncio.sleep(0.02)
            assert st["calls"] == 0 and all(s["in_flight"] == 0 for s in st["sources"].values()), st
        finally:
            await client.close()
    asyncio.run(asyncio.wait_for(main(), 30))
