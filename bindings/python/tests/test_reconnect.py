"""Reconnection, both clients, against the fake sidecar: a lost connection (the
sidecar closed it — idle timeout, restart) fails what was in flight on it, and the
next use opens a new one; a client closed by its user stays closed."""

import asyncio
import os
import socket
import sys
import threading
import time

import pytest

import polygate
import polygate.aio
from fake_sidecar import HOLD, FakeSidecar


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


def _variant(x):
    return x if isinstance(x, str) else next(iter(x))


def frames_on(fake, index, variant=None):
    """What connection ``index`` (0 = the first the fake accepted) received."""
    with fake.lock:
        frames = [f for i, f in fake.received if i == index]
    return [f for f in frames if variant is None or _variant(f["request"]) == variant]


def one_call(client):
    with client.call("chat", est_tokens=7) as call:
        permit = call.acquire()
        assert permit.success(tokens=7).applied
        return permit


def lose(fake):
    """The sidecar closes every connection (idle timeout, restart) and the fake
    has seen them close."""
    fake.drop_all()
    fake.wait_for(lambda: all(c.closed for c in fake.conns))


def wait_threads_in(threads, func_name, timeout=10.0):
    """Until every thread in ``threads`` is inside a function named ``func_name``."""
    ids = {t.ident for t in threads}
    deadline = time.monotonic() + timeout
    while True:
        frames = sys._current_frames()
        inside = 0
        for ident in ids:
            f = frames.get(ident)
            while f is not None and f.f_code.co_name != func_name:
                f = f.f_back
            inside += f is not None
        if inside == len(ids):
            return
        assert time.monotonic() < deadline, "%d of %d threads reached %s" % (inside, len(ids), func_name)
        time.sleep(0.005)


# ---------------------------------------------------------------- sync


def test_sync_next_call_after_sidecar_closed_connection_reconnects(fake):
    with polygate.connect(fake.path, client_name="worker-9") as client:
        one_call(client)
        lose(fake)
        assert not client.closed
        # Nobody reads an idle socket: the Start's write finds the connection dead,
        # that frame never left, so it goes out on the new connection.
        permit = one_call(client)
        assert permit.source == "src-a"
        assert len(fake.conns) == 2
        hello = frames_on(fake, 1)[0]["request"]
        assert _variant(hello) == "Hello" and hello["Hello"]["client_name"] == "worker-9"
        assert len(frames_on(fake, 1, "Start")) == 1 and len(frames_on(fake, 1, "Finish")) == 1
        assert len(frames_on(fake, 0, "Start")) == 1  # only the call before the loss
        # and the connection stays: the next calls use it
        one_call(client)
        assert client.ping() >= 0 and len(fake.conns) == 2


@pytest.mark.parametrize("op", ["ping", "status", "force_open", "run"])
def test_sync_every_request_reconnects(fake, op):
    with polygate.connect(fake.path) as client:
        assert client.ping() >= 0
        lose(fake)
        if op == "ping":
            assert client.ping() >= 0
        elif op == "status":
            assert "chat" in client.status()["scopes"]
        elif op == "force_open":
            client.force_open("src-a", seconds=5)
            assert len(frames_on(fake, 1, "ForceOpen")) == 1
        else:
            assert client.run("chat", lambda permit: permit.source) == "src-a"
        assert len(fake.conns) == 2 and client.sidecar_version == "0.1.0-fake"


def test_sync_loss_found_by_a_reader_reconnects_before_sending(fake):
    """A loss the client already saw (a waiting thread read EOF): the next call
    dials before it writes anything."""
    fake.on_acquire = lambda conn, rid, call: HOLD
    with polygate.connect(fake.path) as client:
        with client.call("chat") as call:
            t = threading.Thread(target=lambda: pytest.raises(polygate.SidecarError, call.acquire))
            t.start()
            fake.wait_held(1)
            lose(fake)
            t.join(5)
        assert client._conn.closed  # noticed
        fake.on_acquire = fake.grant
        one_call(client)
        assert len(fake.conns) == 2


def test_sync_in_flight_requests_fail_and_are_never_replayed(fake):
    fake.on_acquire = lambda conn, rid, call: HOLD
    errors = []
    with polygate.connect(fake.path) as client:
        def waiter():
            try:
                with client.call("chat") as call:
                    call.acquire()
            except BaseException as e:  # noqa: BLE001
                errors.append(e)
        threads = [threading.Thread(target=waiter) for _ in range(3)]
        for t in threads:
            t.start()
        fake.wait_held(3)
        lose(fake)
        for t in threads:
            t.join(5)
        assert len(errors) == 3
        for e in errors:
            assert type(e) is polygate.SidecarError and e.kind == "connection" and fake.path in str(e)
        fake.on_acquire = fake.grant
        one_call(client)
        # the three Starts that were in flight were not sent again
        assert len(frames_on(fake, 1, "Start")) == 1


def test_sync_calls_started_on_a_lost_connection_fail(fake):
    with polygate.connect(fake.path) as client:
        granted = client.call("chat")
        permit = granted.acquire()  # Start on connection 0: the call lives there
        failed = client.call("chat")
        failed.acquire().failure("timeout")  # held: would go out as Retry
        begun = client.call("chat").begin()  # Begin on connection 0
        lose(fake)
        with pytest.raises(polygate.SidecarError) as ei:
            permit.success(tokens=3)
        assert type(ei.value) is polygate.SidecarError and ei.value.kind == "connection"
        with pytest.raises(polygate.SidecarError) as ei:
            failed.acquire()
        assert type(ei.value) is polygate.SidecarError and ei.value.kind == "connection"
        with pytest.raises(polygate.SidecarError) as ei:
            begun.acquire()
        assert type(ei.value) is polygate.SidecarError and ei.value.kind == "connection"
        for call in (granted, failed, begun):
            call.end()  # nothing to release: the sidecar dropped it with the connection
        assert len(fake.conns) == 1, "a call of the lost connection must not reconnect"
        one_call(client)  # a new call does
        assert len(fake.conns) == 2
        assert [_variant(f["request"]) for f in frames_on(fake, 1)] == ["Hello", "Start", "Finish"]


@pytest.mark.parametrize("begin", [False, True])
def test_sync_call_made_before_the_loss_uses_the_new_connection(fake, begin):
    with polygate.connect(fake.path) as client:
        assert client.ping() >= 0
        call = client.call("chat", est_tokens=5)  # nothing sent yet
        lose(fake)
        with call:
            if begin:
                call.begin()
            assert call.acquire().success(tokens=5).applied
        first = "Begin" if begin else "Start"
        assert len(frames_on(fake, 1, first)) == 1 and len(frames_on(fake, 0, first)) == 0


def test_sync_user_closed_client_stays_closed(fake):
    client = polygate.connect(fake.path)
    call = client.call("chat")
    client.close()
    assert client.closed
    for use in (client.ping, client.status, lambda: client.force_close("src-a"),
                lambda: client.run("chat", lambda p: None), call.acquire):
        with pytest.raises(polygate.SidecarError) as ei:
            use()
        assert ei.value.kind == "connection" and "close()" in str(ei.value) and fake.path in str(ei.value)
    assert len(fake.conns) == 1
    client.close()  # idempotent


def test_sync_close_during_a_reconnect_wins(fake):
    with polygate.connect(fake.path) as client:
        lose(fake)
        fake.hello_gate = threading.Event()
        errors = []

        def use():
            try:
                client.ping()
            except BaseException as e:  # noqa: BLE001
                errors.append(e)
        t = threading.Thread(target=use)
        t.start()
        fake.wait_for(lambda: len(fake.conns) == 2)  # dialing, waiting for Welcome
        client.close()  # ends the handshake at once: it does not wait for Welcome (or the timeout)
        t.join(5)
        alive = t.is_alive()
        fake.hello_gate.set()
        t.join(10)
        assert not alive, "close() did not stop the reconnect's handshake"
        assert len(errors) == 1 and "close()" in str(errors[0])
        fake.wait_for(lambda: fake.conns[1].closed)  # the new connection was not kept
        assert client.closed


def test_sync_concurrent_threads_reconnect_once(fake):
    n = 12
    with polygate.connect(fake.path) as client:
        one_call(client)
        lose(fake)
        fake.hello_gate = threading.Event()  # hold the new handshake until every thread wants it
        results, errors = [], []

        def worker():
            try:
                results.append(one_call(client).source)
            except BaseException as e:  # noqa: BLE001
                errors.append(e)
        threads = [threading.Thread(target=worker) for _ in range(n)]
        for t in threads:
            t.start()
        wait_threads_in(threads, "_reconnect")
        fake.hello_gate.set()
        for t in threads:
            t.join(10)
        assert not errors and results == ["src-a"] * n
        assert len(fake.conns) == 2 and len(fake.requests("Hello")) == 2
        assert len(frames_on(fake, 1, "Finish")) == n


def test_sync_sidecar_gone_is_a_clear_error_then_back(fake):
    with polygate.connect(fake.path) as client:
        one_call(client)
        fake.stop()  # the socket is gone
        with pytest.raises(polygate.SidecarError) as ei:
            client.ping()
        assert ei.value.kind == "connection" and fake.path in str(ei.value)
        assert "cannot connect" in str(ei.value)
        with pytest.raises(polygate.SidecarError, match="cannot connect"):
            one_call(client)  # every use tries again
        again = FakeSidecar(fake.path).start()  # the sidecar is back, same socket
        try:
            permit = one_call(client)
            assert permit.source == "src-a" and len(again.conns) == 1
        finally:
            again.stop()


def test_sync_threads_waiting_for_a_failed_dial_share_its_error(fake):
    n = 8
    with polygate.connect(fake.path) as client:
        lose(fake)
        fake.protocol_version = 1  # the new handshake fails (an old sidecar came up)
        fake.hello_gate = threading.Event()
        errors = []

        def worker():
            try:
                client.ping()
            except BaseException as e:  # noqa: BLE001
                errors.append(e)
        threads = [threading.Thread(target=worker) for _ in range(n)]
        for t in threads:
            t.start()
        wait_threads_in(threads, "_reconnect")
        fake.hello_gate.set()
        for t in threads:
            t.join(10)
        assert len(errors) == n and all("upgrade polygate-sidecar" in str(e) for e in errors)
        assert len(fake.requests("Hello")) == 2  # one dial for all of them
        fake.protocol_version = 3
        assert client.ping() >= 0  # a later use dials again
        assert len(fake.requests("Hello")) == 3


def test_sync_waiters_of_an_interrupted_dial_dial_again(fake, monkeypatch):
    """A dial that ends by KeyboardInterrupt has no error to share: a thread that
    waited for it dials itself, rather than getting an older dial's error."""
    from polygate import _sync
    with polygate.connect(fake.path) as client:
        fake.stop()
        with pytest.raises(polygate.SidecarError, match="cannot connect"):
            client.ping()  # a failed dial: its error is remembered
        again = FakeSidecar(fake.path).start()
        gate = threading.Event()
        real_open = _sync._open
        opens = []

        def interrupted_open(*args):
            opens.append(args)
            if len(opens) == 1:
                gate.wait(10)
                raise KeyboardInterrupt
            return real_open(*args)
        monkeypatch.setattr(_sync, "_open", interrupted_open)
        got = {}

        def use(name):
            try:
                got[name] = client.ping()
            except BaseException as e:  # noqa: BLE001
                got[name] = e
        first = threading.Thread(target=use, args=("first",))
        first.start()
        wait_threads_in([first], "interrupted_open")
        second = threading.Thread(target=use, args=("second",))
        second.start()
        wait_threads_in([second], "_reconnect")  # waiting for the first one's dial
        gate.set()
        first.join(10)
        second.join(10)
        try:
            assert isinstance(got["first"], KeyboardInterrupt)
            assert isinstance(got["second"], float), got["second"]
            assert len(opens) == 2 and len(again.conns) == 1
        finally:
            again.stop()


def test_sync_reconnect_is_bounded_by_the_connect_timeout(fake, sockdir):
    with polygate.connect(fake.path, timeout=0.3) as client:
        fake.stop()
        mute = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)  # accepts, never answers Hello
        mute.bind(fake.path)
        mute.listen(4)
        try:
            t0 = time.monotonic()
            with pytest.raises(polygate.SidecarError, match="within 0.3s") as ei:
                client.ping()
            assert time.monotonic() - t0 < 3 and ei.value.kind == "connection"
        finally:
            mute.close()
            os.unlink(fake.path)


# ---------------------------------------------------------------- asyncio


async def _one_call(client):
    async with client.call("chat", est_tokens=7) as call:
        permit = await call.acquire()
        assert (await permit.success(tokens=7)).applied
        return permit


async def _lose(fake, client):
    await asyncio.get_running_loop().run_in_executor(None, lose, fake)
    for _ in range(500):  # the loop sees the close (connection_lost)
        if client._conn.closed:
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the client did not notice the closed connection")


def test_aio_next_call_after_sidecar_closed_connection_reconnects(fake):
    async def main():
        async with await polygate.aio.connect(fake.path, client_name="aio-3") as client:
            await _one_call(client)
            await _lose(fake, client)
            assert not client.closed
            assert (await _one_call(client)).source == "src-a"
            assert len(fake.conns) == 2
            assert frames_on(fake, 1)[0]["request"]["Hello"]["client_name"] == "aio-3"
            assert await client.ping() >= 0
            assert "chat" in (await client.status())["scopes"]
            assert len(fake.conns) == 2
    run(main())


@pytest.mark.parametrize("op", ["ping", "status", "reset", "run"])
def test_aio_every_request_reconnects(fake, op):
    async def main():
        async with await polygate.aio.connect(fake.path) as client:
            await _lose(fake, client)
            if op == "ping":
                assert await client.ping() >= 0
            elif op == "status":
                assert "chat" in (await client.status())["scopes"]
            elif op == "reset":
                await client.reset("src-a")
                assert len(frames_on(fake, 1, "Reset")) == 1
            else:
                async def fn(permit):
                    return permit.source
                assert await client.run("chat", fn) == "src-a"
            assert len(fake.conns) == 2
    run(main())


def test_aio_frame_queued_when_the_connection_died_goes_out_on_the_new_one(fake):
    async def main():
        async with await polygate.aio.connect(fake.path) as client:
            old = client._conn
            task = asyncio.ensure_future(_one_call(client))
            await asyncio.sleep(0)  # the task queued its Start; the tick's write has not run yet
            assert old._out, "the Start should still be queued"
            old.connection_lost(ConnectionResetError("reset under us"))
            assert (await task).source == "src-a"
            assert client._conn is not old and len(fake.conns) == 2
            assert len(frames_on(fake, 0, "Start")) == 0 and len(frames_on(fake, 1, "Start")) == 1
    run(main())


def test_aio_in_flight_requests_fail_and_calls_of_the_lost_connection_too(fake):
    fake.on_acquire = lambda conn, rid, call: HOLD

    async def main():
        async with await polygate.aio.connect(fake.path) as client:
            async def waiter():
                async with client.call("chat") as call:
                    await call.acquire()
            tasks = [asyncio.ensure_future(waiter()) for _ in range(4)]
            await asyncio.get_running_loop().run_in_executor(None, fake.wait_held, 4)
            fake.on_acquire = fake.grant
            call = client.call("chat")
            await call.begin()  # begun on the connection about to be lost
            granted = client.call("chat")
            permit = await granted.acquire()
            failed = client.call("chat")
            await (await failed.acquire()).failure("timeout")  # held: would go out as Retry
            await _lose(fake, client)
            for r in await asyncio.gather(*tasks, return_exceptions=True):
                assert type(r) is polygate.SidecarError and r.kind == "connection" and fake.path in str(r)
            for use in (call.acquire, lambda: permit.success(tokens=3), failed.acquire):
                with pytest.raises(polygate.SidecarError) as ei:
                    await use()
                assert type(ei.value) is polygate.SidecarError and ei.value.kind == "connection"
            for c in (call, granted, failed):
                await c.end()  # nothing to release: the sidecar dropped it with the connection
            assert len(fake.conns) == 1
            await _one_call(client)
            assert [_variant(f["request"]) for f in frames_on(fake, 1)] == ["Hello", "Start", "Finish"]
    run(main())


def test_aio_call_made_before_the_loss_uses_the_new_connection(fake):
    async def main():
        async with await polygate.aio.connect(fake.path) as client:
            call = client.call("chat", est_tokens=5)
            await _lose(fake, client)
            async with call:
                permit = await call.acquire()
                await permit.success(tokens=5)
            assert len(frames_on(fake, 1, "Start")) == 1 and len(frames_on(fake, 0, "Start")) == 0
    run(main())


def test_aio_user_closed_client_stays_closed(fake):
    async def main():
        client = await polygate.aio.connect(fake.path)
        call = client.call("chat")
        await client.close()
        assert client.closed
        async def fn(permit):
            return None
        for use in (client.ping, client.status, lambda: client.force_open("src-a"),
                    lambda: client.run("chat", fn), call.acquire):
            with pytest.raises(polygate.SidecarError) as ei:
                await use()
            assert ei.value.kind == "connection" and "close()" in str(ei.value)
        assert len(fake.conns) == 1
        await client.close()
    run(main())


def test_aio_concurrent_tasks_reconnect_once(fake):
    n = 50

    async def main():
        async with await polygate.aio.connect(fake.path) as client:
            await _lose(fake, client)
            results = await asyncio.gather(*(_one_call(client) for _ in range(n)))
            assert [p.source for p in results] == ["src-a"] * n
            assert len(fake.conns) == 2 and len(fake.requests("Hello")) == 2
    run(main())


def test_aio_cancelled_waiter_leaves_the_dial_to_the_others(fake):
    async def main():
        async with await polygate.aio.connect(fake.path) as client:
            await _lose(fake, client)
            fake.hello_gate = threading.Event()
            first = asyncio.ensure_future(client.ping())
            second = asyncio.ensure_future(client.ping())
            await asyncio.get_running_loop().run_in_executor(None, fake.wait_for, lambda: len(fake.conns) == 2)
            first.cancel()
            with pytest.raises(asyncio.CancelledError):
                await first
            fake.hello_gate.set()
            assert await second >= 0
            assert len(fake.conns) == 2
    run(main())


def test_aio_sidecar_gone_then_back_and_failed_dial_shared(fake):
    async def main():
        async with await polygate.aio.connect(fake.path) as client:
            await _one_call(client)
            await asyncio.get_running_loop().run_in_executor(None, fake.stop)
            for _ in range(500):
                if client._conn.closed:
                    break
                await asyncio.sleep(0.01)
            results = await asyncio.gather(*(client.ping() for _ in range(5)), return_exceptions=True)
            for r in results:
                assert isinstance(r, polygate.SidecarError) and r.kind == "connection"
                assert "cannot connect" in str(r) and fake.path in str(r)
            again = FakeSidecar(fake.path).start()
            try:
                assert (await _one_call(client)).source == "src-a"
                assert len(again.conns) == 1
            finally:
                again.stop()
    run(main())


def test_aio_close_during_a_reconnect(fake):
    async def main():
        client = await polygate.aio.connect(fake.path)
        await _lose(fake, client)
        fake.hello_gate = threading.Event()
        ping = asyncio.ensure_future(client.ping())
        await asyncio.get_running_loop().run_in_executor(None, fake.wait_for, lambda: len(fake.conns) == 2)
        t0 = time.monotonic()
        await client.close()  # stops the dial: it does not wait for the handshake's timeout
        assert time.monotonic() - t0 < 3
        fake.hello_gate.set()
        with pytest.raises(polygate.SidecarError, match=r"close\(\)"):
            await ping
        assert client._dialing is None
        await asyncio.get_running_loop().run_in_executor(None, fake.wait_for, lambda: fake.conns[1].closed)
    run(main())


def _open_fds():
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc/self/fd")
def test_reconnects_leak_no_thread_task_or_fd(fake):
    with polygate.connect(fake.path) as client:
        one_call(client)
        threads, fds = threading.active_count(), _open_fds()
        olds = []  # kept alive, so only an explicit close frees their fds (not refcounting)
        for _ in range(20):
            olds.append(client._conn)
            lose(fake)
            one_call(client)
        fake.wait_for(lambda: sum(c.sock.fileno() != -1 for c in fake.conns) == 1)  # the fake's side
        assert len(fake.conns) == 21
        assert threading.active_count() <= threads and _open_fds() <= fds

    async def main():
        async with await polygate.aio.connect(fake.path) as client:
            await _one_call(client)
            tasks, fds = len(asyncio.all_tasks()), _open_fds()
            olds = []  # kept alive, as above
            for _ in range(20):
                olds.append(client._conn)
                await _lose(fake, client)
                await _one_call(client)
            await asyncio.sleep(0)  # the dial task's done callbacks
            await asyncio.get_running_loop().run_in_executor(
                None, fake.wait_for, lambda: sum(c.sock.fileno() != -1 for c in fake.conns) == 1)
            assert len(asyncio.all_tasks()) <= tasks and _open_fds() <= fds
    run(main())
