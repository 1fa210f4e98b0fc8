"""End-to-end: the Python clients outlive a sidecar restart. The real daemon is
killed (SIGKILL, or stopped with SIGTERM) and started again on the same socket;
the same client object keeps working, and what was in flight when it died fails
with ``SidecarError(kind="connection")``."""

from __future__ import annotations

import asyncio
import signal
import threading

import pytest

import polygate
import polygate.aio
from .polygate_e2e import scope


def restart(sidecar, how: str) -> None:
    """Kill (``"kill"``: SIGKILL, the socket file stays behind) or stop
    (``"term"``: SIGTERM, a clean shutdown) the daemon, then start it again on
    the same socket, leaving its clients open."""
    proc = sidecar.proc
    if how == "kill":
        proc.kill()
    else:
        proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=10) is not None
    sidecar._stderr.close()
    sidecar.start()


def one_call(client) -> str:
    with client.call("chat", est_tokens=10) as call:
        permit = call.acquire()
        assert permit.success(tokens=12).applied
        return permit.source


@pytest.mark.parametrize("how", ["kill", "term"])
def test_sync_client_survives_a_sidecar_restart(sidecar, how):
    sidecar.write_config({"chat": scope("a", "b")})
    sidecar.start()
    client = sidecar.client(client_name="reconnect-e2e")
    assert one_call(client) == "a"
    before = client.status()["scopes"]["chat"]["sources"]["a"]["window_successes"]
    assert before == 1

    sidecar.proc.kill() if how == "kill" else sidecar.proc.send_signal(signal.SIGTERM)
    sidecar.proc.wait(timeout=10)
    # down: every use is a clear error naming the socket (the client stays usable)
    with pytest.raises(polygate.SidecarError) as ei:
        client.ping()
    assert ei.value.kind == "connection" and sidecar.socket in str(ei.value)
    sidecar._stderr.close()
    sidecar.start()

    assert not client.closed
    assert one_call(client) == "a"
    assert client.run("chat", lambda permit: permit.source) == "a"
    st = client.status()["scopes"]["chat"]["sources"]["a"]
    assert st["window_successes"] == 2, "a fresh daemon (memory backend) saw the two calls since"
    assert st["in_flight"] == 0
    client.force_open("b", seconds=5)
    assert client.status()["scopes"]["chat"]["sources"]["b"]["state"] == "open"

    # a second restart, straight into the next call (no failed use in between)
    restart(sidecar, how)
    assert one_call(client) == "a"


def test_sync_waiting_acquire_fails_with_the_connection_then_new_calls_work(sidecar):
    sidecar.write_config({"chat": scope("a", circuit_open="wait", stall_window="30s")})
    sidecar.start()
    client = sidecar.client()
    client.force_open("a", seconds=60)
    got = []

    def waiter():
        try:
            with client.call("chat") as call:
                call.acquire()
        except BaseException as e:  # noqa: BLE001
            got.append(e)
    t = threading.Thread(target=waiter)
    t.start()
    admin = polygate.connect(sidecar.socket)
    try:
        for _ in range(200):  # until the sidecar holds the wait
            if admin.status()["scopes"]["chat"]["waiters"] == 1:
                break
            t.join(0.02)
        assert admin.status()["scopes"]["chat"]["waiters"] == 1
    finally:
        admin.close()
    restart(sidecar, "kill")
    t.join(10)
    assert not t.is_alive() and len(got) == 1
    e = got[0]
    assert type(e) is polygate.SidecarError and e.kind == "connection", repr(e)
    # the new daemon knows nothing of the old force_open (memory backend): a new call is granted
    assert one_call(client) == "a"


@pytest.mark.parametrize("how", ["kill", "term"])
def test_aio_client_survives_a_sidecar_restart(sidecar, how):
    sidecar.write_config({"chat": scope("a", "b")})
    sidecar.start()

    async def call(client) -> str:
        async with client.call("chat", est_tokens=10) as c:
            permit = await c.acquire()
            assert (await permit.success(tokens=12)).applied
            return permit.source

    async def main():
        client = await polygate.aio.connect(sidecar.socket)
        try:
            assert await call(client) == "a"
            loop = asyncio.get_running_loop()
            await loop.run_in_executor(None, restart, sidecar, how)
            assert not client.closed
            results = await asyncio.gather(*(call(client) for _ in range(20)))
            assert len(results) == 20 and set(results) <= {"a", "b"}  # the pacer spreads them
            st = (await client.status())["scopes"]["chat"]["sources"]
            assert st["a"]["window_successes"] + st["b"]["window_successes"] == 20
            assert st["a"]["in_flight"] == st["b"]["in_flight"] == 0
        finally:
            await client.close()
        with pytest.raises(polygate.SidecarError, match=r"close\(\)"):
            await client.ping()

    asyncio.run(asyncio.wait_for(main(), 30))
