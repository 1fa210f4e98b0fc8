"""End-to-end: the Python binding's two-round-trip call (protocol version 2,
DESIGN §11a) against the real daemon — what the frames do, seen from status."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

import polygate
import polygate.aio
from .polygate_e2e import scope


def _calls(client, name="chat"):
    return client.status()["scopes"][name]["calls"]


def test_speaks_version_3_and_status_json(sidecar):
    sidecar.write_config({"chat": scope({"name": "a", "tpm": 6000})})
    sidecar.start()
    client = sidecar.client()
    assert client.protocol_version == 3
    st = client.status()
    assert st["protocol_version"] == 3 and st["backend"] == "memory"
    a = st["scopes"]["chat"]["sources"]["a"]
    assert a["state"] == "closed" and a["tokens_available"] == pytest.approx(6000, abs=5)
    assert "name" not in a


def test_success_is_start_and_finish_leaving_nothing(sidecar):
    sidecar.write_config({"chat": scope("a")})
    sidecar.start()
    client = sidecar.client()
    with client.call("chat") as call:
        assert _calls(client) == 0, "entering the block sends nothing"
        permit = call.acquire()
        assert _calls(client) == 1 and sidecar.source_status(client, "a")["in_flight"] == 1
        assert permit.success().applied
        assert _calls(client) == 0, "a counted success ends the call at once"
        with pytest.raises(RuntimeError, match="succeeded"):
            call.acquire()
    st = sidecar.source_status(client, "a")
    assert st["in_flight"] == 0 and st["window_successes"] == 1


def test_held_failure_is_applied_by_the_retry(sidecar):
    sidecar.write_config({"chat": scope("a", "b", breaker={"failure_threshold": 1})})
    sidecar.start()
    client = sidecar.client()
    with client.call("chat") as call:
        call.acquire().failure("server_error")
        assert sidecar.source_status(client, "a")["state"] == "closed", "held until the next acquire"
        p2 = call.acquire()
        assert p2.source == "b" and p2.attempt == 2
        assert sidecar.source_status(client, "a")["state"] == "open"
        p2.success()
    assert _calls(client) == 0


@pytest.mark.parametrize("how", ["exception", "unreported", "held_failure"])
def test_leaving_the_block_releases_everything(sidecar, how):
    sidecar.write_config({"chat": scope({"name": "a", "tpm": 6000, "timeout": "60s"})})
    sidecar.start()
    client = sidecar.client()
    full = sidecar.source_status(client, "a")["tokens_available"]
    with pytest.raises(KeyError) if how == "exception" else contextlib.nullcontext():
        with client.call("chat", est_tokens=3000) as call:
            p = call.acquire()
            if how == "held_failure":
                p.failure("timeout")
            if how == "exception":
                raise KeyError("boom")
    # the exception path posts its Finish without waiting: a ping orders after it
    client.ping()
    st = sidecar.source_status(client, "a")
    assert _calls(client) == 0 and st["in_flight"] == 0, st
    if how == "held_failure":
        assert st["tokens_available"] > full - 200, "a held timeout is transient: refunded"
    else:
        # never reported: abandoned, the estimate stays charged (PROTOCOL.md §8)
        assert full - 3200 < st["tokens_available"] < full - 2500, st


def test_retry_exhaustion_ends_the_call_without_end_call(sidecar):
    sidecar.write_config({"chat": scope("a", max_attempts=2)})
    sidecar.start()
    client = sidecar.client()
    with client.call("chat") as call:
        call.acquire().failure("timeout")
        call.acquire().failure("timeout")
        with pytest.raises(polygate.AllSourcesExhausted) as ei:
            call.acquire()
        assert ei.value.reason == "retry_exhausted" and call.ended
    assert _calls(client) == 0


def test_priority_is_carried_and_refused_until_classes_exist(sidecar):
    sidecar.write_config({"chat": scope("a")})
    sidecar.start()
    client = sidecar.client()
    with pytest.raises(polygate.SidecarError) as ei:
        with client.call("chat", priority="interactive") as call:
            call.acquire()
    assert ei.value.kind == "invalid_argument" and "chat" in str(ei.value) and "priorit" in str(ei.value)
    with client.call("chat", priority="") as call:  # empty = the default class
        call.acquire().success()
    assert _calls(client) == 0


def test_usage_split_is_charged(sidecar):
    sidecar.write_config({"chat": scope({"name": "a", "tpm": 6000, "timeout": "5s"})})
    sidecar.start()
    client = sidecar.client()
    full = sidecar.source_status(client, "a")["tokens_available"]
    with client.call("chat", est_input_tokens=100, est_output_tokens=50) as call:
        p = call.acquire()
        assert p.est_tokens == 150, "est_tokens defaults to the split's sum"
        p.success(input_tokens=1200, output_tokens=300)
    left = sidecar.source_status(client, "a")["tokens_available"]
    assert full - 1600 < left < full - 1400, (full, left)
    with pytest.raises(ValueError):
        client.call("chat", est_tokens=10**9 + 1)


def test_asyncio_cancelled_start_leaves_no_call(sidecar):
    sidecar.write_config({"chat": scope("a", circuit_open="wait", stall_window="30s", poll_interval="20ms")})
    sidecar.start()
    admin = sidecar.client()
    admin.force_open("a", seconds=30)

    async def main():
        client = await polygate.aio.connect(sidecar.socket)
        try:
            async def waiter():
                async with client.call("chat") as call:
                    await call.acquire()
            task = asyncio.ensure_future(waiter())
            for _ in range(200):
                if (await client.status())["scopes"]["chat"]["waiters"] == 1:
                    break
                await asyncio.sleep(0.01)
            else:
                raise AssertionError("the Start never waited")
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await client.ping()
            st = (await client.status())["scopes"]["chat"]
            assert st["waiters"] == 0 and st["calls"] == 0, st
        finally:
            await client.close()
    asyncio.run(asyncio.wait_for(main(), 30))
