"""asyncio PolyGate client: the same names as :mod:`polygate`, awaitable.

One connection multiplexes every concurrent call of the event loop::

    client = await polygate.aio.connect()
    async with client.call("chat", est_tokens=1200) as call:
        permit = await call.acquire()
        ...
        await permit.success(tokens=1234)

The connection is an :class:`asyncio.BufferedProtocol`: frames queued during one
turn of the event loop go out in one ``write`` (DESIGN §16); replies are read
into one reused buffer, decoded in ``buffer_updated`` and resolve the futures
waiting for their ids.

Cancelling a task blocked in ``await call.acquire()`` sends ``Cancel`` for that
request and re-raises ``CancelledError``; leaving the ``async with`` block
(normally, by exception or by cancellation) releases what the call holds. When
the connection dies, every pending await fails with :class:`SidecarError`.

Reconnection: the event loop sees a connection the sidecar closes (idle
timeout, restart) at once. What was in flight on it fails, with the calls begun
on it; the next request that needs no state of the old connection (a call's
first frame, status, admin, ping) opens a new one first — one dial, however many
tasks await it (:meth:`Client._reconnect`). A frame still queued when the
connection died never left, so it is sent again on the new connection; nothing
that may have been applied is. Connected, a request pays one attribute check.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import json
import time
from typing import Any, Awaitable, Callable, Dict, List, Optional, TypeVar

from . import _autostart, _core, _frames, _wire
from ._core import Outcome, ReportResult, ScopeStatus, SourceStatus, Status
from .errors import (
    AllSourcesExhausted,
    CircuitOpenError,
    GatewayUnavailableError,
    PolyGateError,
    SidecarError,
    TenantLimitExceeded,
)

T = TypeVar("T")

__all__ = [
    "connect",
    "Outcome",
    "Client",
    "Call",
    "Permit",
    "ReportResult",
    "Status",
    "ScopeStatus",
    "SourceStatus",
    "PolyGateError",
    "SidecarError",
    "GatewayUnavailableError",
    "CircuitOpenError",
    "AllSourcesExhausted",
    "TenantLimitExceeded",
]


class _Slot:
    """One request awaiting its reply (``fut`` None: nobody awaits it)."""

    __slots__ = ("fut", "on_late")

    def __init__(self, fut: "Optional[asyncio.Future[Any]]", on_late: Optional[_core.OnReply]) -> None:
        self.fut = fut
        self.on_late = on_late


_RECV_SIZE = 65536


class _Connection(asyncio.BufferedProtocol):
    def __init__(self, path: str) -> None:
        self.path = path
        self.max_frame = _wire.DEFAULT_MAX_FRAME
        self.welcome: Dict[str, Any] = {}  # the sidecar's Welcome, once the handshake is done
        self._loop = asyncio.get_running_loop()
        self._transport: Optional[asyncio.Transport] = None
        self._ids = itertools.count(1)
        self._pending: Dict[int, _Slot] = {}
        self._out: List[bytes] = []  # frames queued this tick; _flush writes them as one
        self._flush_handle: Optional[asyncio.Handle] = None
        self._paused: "Optional[asyncio.Future[None]]" = None  # set while the transport's buffer is full
        self._decoder = _wire.FrameDecoder(_core.MAX_INCOMING_FRAME)
        # reads land in one reused buffer (a plain Protocol gets a fresh 256 KiB
        # bytes per read: an mmap + munmap for every reply)
        self._rbuf = memoryview(bytearray(_RECV_SIZE))
        self._dead: Optional[SidecarError] = None
        self.gone = False  # _dead says the sidecar closed or reset the connection (not us, not a bad frame)
        self._fatal: Optional[PolyGateError] = None
        self._lost = self._loop.create_future()  # resolved by connection_lost

    # ------------------------------------------------------------ asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._transport = transport

    def get_buffer(self, sizehint: int) -> memoryview:
        return self._rbuf

    def buffer_updated(self, nbytes: int) -> None:
        try:
            for payload in self._decoder.feed(self._rbuf[:nbytes]):
                self._dispatch(_frames.decode_server_frame(payload))
        except _wire.WireError as e:
            self._die(_core.undecodable_error(e))
        except Exception as e:  # noqa: BLE001 - a bug must not leave waiters hanging
            self._die(_core.protocol_error("reader failed: %r" % (e,)))

    def connection_lost(self, exc: Optional[Exception]) -> None:
        if exc is not None:
            self._die(_core.lost_error(self.path, exc), gone=True)
        else:
            self._die(_core.closed_error(self.path, self._fatal), gone=True)
        if not self._lost.done():
            self._lost.set_result(None)

    def pause_writing(self) -> None:
        if self._paused is None:
            self._paused = self._loop.create_future()

    def resume_writing(self) -> None:
        paused, self._paused = self._paused, None
        if paused is not None and not paused.done():
            paused.set_result(None)

    # ------------------------------------------------------------ sending

    def _queue(self, request: Any, slot: _Slot) -> int:
        if self._dead is not None:
            raise _core.NotSent(self._dead)
        rid = next(self._ids)
        self._out.append(_core.frame_request(rid, request, self.max_frame))  # bad input raises here
        self._pending[rid] = slot
        if self._flush_handle is None:
            self._flush_handle = self._loop.call_soon(self._flush)
        return rid

    def _flush(self) -> None:
        self._flush_handle = None
        out, self._out = self._out, []
        if out and self._dead is None and self._transport is not None:
            self._transport.write(out[0] if len(out) == 1 else b"".join(out))

    async def request(self, request: Any, *, cancel_on_cancel: bool = False,
                      on_late: Optional[_core.OnReply] = None, fresh: bool = False) -> Any:
        """Send ``request`` and await its reply value. If the awaiting task is
        cancelled, the request is abandoned (``Cancel`` sent when
        ``cancel_on_cancel``; a late reply goes to ``on_late``, by default
        releasing what it created). A request whose frame never left because
        the connection is lost raises :class:`_core.NotSent` when ``fresh``
        (the caller sends it again on a new connection), else that
        connection's ``SidecarError``."""
        fut: "asyncio.Future[Any]" = self._loop.create_future()
        slot = _Slot(fut, on_late)
        try:
            rid = self._queue(request, slot)
            if self._paused is not None:
                await asyncio.shield(self._paused)
            return await fut
        except asyncio.CancelledError:
            self._abandon(rid, slot, cancel_on_cancel)
            raise
        except _core.NotSent as e:
            if fresh:
                raise
            raise e.error from None

    def post(self, request: Any, on_late: Optional[_core.OnReply] = None) -> None:
        """Fire and forget (queued now, written this tick; the reply goes to ``on_late``)."""
        try:
            self._queue(request, _Slot(None, on_late))
        except (_core.NotSent, _wire.WireError):
            pass

    def _abandon(self, rid: int, slot: _Slot, cancel: bool) -> None:
        fut = slot.fut
        slot.fut = None
        if fut is not None and fut.done() and not fut.cancelled():
            if fut.exception() is None:  # the reply beat the cancellation
                self._late(slot, fut.result())
            return
        if cancel and self._dead is None:
            self.post(_core.cancel(rid))

    def _late(self, slot: _Slot, reply: Any) -> None:
        follow = (slot.on_late or _core.late_cleanup)(reply)
        if follow is not None:
            self.post(follow)

    # ------------------------------------------------------------ reading

    def _dispatch(self, frame: Dict[str, Any]) -> None:
        rid, reply = frame["id"], frame["reply"]
        slot = self._pending.pop(rid, None)
        if slot is None:
            if rid == 0:
                self._fatal = _core.connection_error(reply) or self._fatal
            return
        fut = slot.fut
        if fut is None or fut.done():
            self._late(slot, reply)
        else:
            fut.set_result(reply)

    def _die(self, err: SidecarError, gone: bool = False) -> None:
        if self._dead is None:
            self._dead = err
            self.gone = gone
        pending, self._pending = self._pending, {}
        # frames queued but not yet written never left: their requests were not applied
        unsent = {int.from_bytes(f[4:12], "little") for f in self._out}
        self._out = []
        for rid, slot in pending.items():
            if slot.fut is not None and not slot.fut.done():
                slot.fut.set_exception(_core.NotSent(self._dead) if rid in unsent else self._dead)
        self.resume_writing()
        if self._transport is not None:
            self._transport.close()

    @property
    def closed(self) -> bool:
        return self._dead is not None

    async def close(self) -> None:
        self._die(_core.client_closed_error(self.path))
        try:
            await asyncio.wait_for(asyncio.shield(self._lost), 5)
        except (asyncio.TimeoutError, asyncio.CancelledError):
            pass


class Permit(_core.PermitBase):
    """Permission to make one attempt on ``source``. Report exactly once (awaitable)."""

    _call: "Call"

    async def success(self, tokens: Optional[int] = None, *, input_tokens: Optional[int] = None,
                      output_tokens: Optional[int] = None, cached_input_tokens: Optional[int] = None,
                      count_attempt: bool = True) -> Optional[ReportResult]:
        """The upstream answered usefully; ends the call (see :meth:`polygate.Permit.success`)."""
        call = self._call
        outcome = _core.outcome_success(tokens, count_attempt, input_tokens, output_tokens, cached_input_tokens,
                                        call._protocol_version)
        request = call._report(self, outcome, final=count_attempt)
        if request is None:
            return None
        return call._finished(self, await call._conn.request(request))

    async def failure(self, kind: str, tokens: Optional[int] = None) -> None:
        """kind: timeout, server_error, connection, bad_result or error; held
        for the next ``acquire()`` (see :meth:`polygate.Permit.failure`)."""
        self._call._report(self, _core.outcome_failure(kind, tokens), final=False)

    async def rate_limited(self, retry_after_s: Optional[float] = None) -> None:
        """The upstream answered 429 (backpressure, not failure). Held."""
        self._call._report(self, _core.outcome_rate_limited(retry_after_s), final=False)

    async def cancel(self) -> None:
        """The attempt was given up before (or while) sending. Held."""
        self._call._report(self, _core.OUTCOME_CANCELLED, final=False)


class Call(_core.CallBase[Permit]):
    """One logical request in a scope; ``async with client.call(...) as call``."""

    _permit_class = Permit
    _conn: _Connection  # calls.UNBOUND until the call's first frame binds it (see CallBase)
    _client: "Client"

    async def _resend(self, request: bytes, cancel: bool, on_late: _core.OnReply) -> Any:
        """The call's first frame (``Start`` or ``Begin``) never left the
        connection it was bound to, lost: reconnect, bind the call to the new
        connection and send it there (once)."""
        conn = self._bind(await self._client._reconnect())
        return await conn.request(request, cancel_on_cancel=cancel, on_late=on_late)

    async def begin(self) -> "Call":
        """Optional: send ``Begin`` now (the stall clock starts before the first acquire)."""
        request = self._begin_request()
        if request is not None:
            try:
                reply = await self._conn.request(request, on_late=_core.late_cleanup, fresh=True)
            except _core.NotSent:
                reply = await self._resend(request, False, _core.late_cleanup)
            self._began(reply)
        return self

    async def acquire(self) -> Permit:
        """Await a permit (sending any held report with it). Raises
        CircuitOpenError, AllSourcesExhausted, GatewayUnavailableError (the call
        is over then) or SidecarError. Cancelling the awaiting task sends
        ``Cancel`` and re-raises CancelledError."""
        acq = self._acquisition()
        try:
            # A call lives on the connection its first frame went to: lost, the call is.
            try:
                reply = await self._conn.request(acq.request, cancel_on_cancel=True, on_late=acq.on_late,
                                                 fresh=acq.fresh)
            except _core.NotSent:  # the first frame found its connection lost: a new one
                reply = await self._resend(acq.request, True, acq.on_late)
        except BaseException:
            self._acquire_abandoned(acq)
            raise
        return self._acquired(acq, reply)

    def _release_now(self) -> None:
        """Queue the release without awaiting (the task may be cancelled)."""
        rel = self._release()
        if rel is not None:
            self._conn.post(rel.request, on_late=rel.on_reply)

    async def end(self) -> None:
        """Release what the call holds and forget it (idempotent, best effort)."""
        rel = self._release()
        if rel is None:
            return
        try:
            reply = await self._conn.request(rel.request, on_late=rel.on_reply)
        except SidecarError:
            return  # the connection is gone: the sidecar released everything
        follow = rel.on_reply(reply)
        if follow is not None:
            self._conn.post(follow)

    async def __aenter__(self) -> "Call":
        self._check_open()
        return self

    async def __aexit__(self, exc_type: Optional[type], exc: Optional[BaseException], tb: Any) -> None:
        if exc_type is None:
            await self.end()
        else:
            self._release_now()

    def __repr__(self) -> str:
        return "<aio.Call %s scope=%r>" % (self.id, self.scope)


class Client(_core.WelcomeInfo[_Connection]):
    """An asyncio connection to the sidecar, shared by every task of the loop.

    A lost connection (the sidecar closed it — idle timeout, restart — or it
    failed) fails what was in flight on it; the next use reconnects (same path,
    client name and timeout; a client connected with autostart starts the
    sidecar again when the reconnect finds none). :meth:`close` is final."""

    def __init__(self, conn: _Connection, client_name: Optional[str], timeout: Optional[float],
                 autostart: bool = False) -> None:
        self._conn = conn  # the live connection; replaced (never mutated) by a reconnect
        self.path = conn.path
        self._client_name = client_name
        self._timeout = timeout
        self._autostart = autostart  # every reconnect that finds no sidecar starts one (DESIGN §20)
        self._closed = False  # close() was called: no reconnect, ever
        self._dialing: "Optional[asyncio.Task[_Connection]]" = None  # the reconnect every task awaits
        self._opening: Optional[_Connection] = None  # its connection, before the handshake is done

    async def _reconnect(self) -> _Connection:
        """The live connection, the current one being lost: a new one (socket +
        Hello/Welcome). Tasks that find the loss together await one dial (a
        task cancelled meanwhile leaves it running for the others)."""
        if self._closed:
            raise _core.client_closed_error(self.path)
        conn = self._conn
        if conn._dead is None:
            return conn
        task = self._dialing
        if task is None:
            task = self._dialing = conn._loop.create_task(self._dial())
            task.add_done_callback(_retrieve)
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            if task.cancelled() and self._closed:  # close() stopped the dial, not our cancellation
                raise _core.client_closed_error(self.path) from None
            raise

    async def _dial(self) -> _Connection:
        try:
            new = await _dial(self.path, self._client_name, self._timeout, self._autostart, self._opened)
        finally:
            self._dialing = None  # the next use after a failed dial tries again
            self._opening = None
        if self._closed:  # close() came while we dialed
            await new.close()
            raise _core.client_closed_error(self.path)
        self._conn = new
        return new

    def _opened(self, conn: _Connection) -> None:
        self._opening = conn

    async def _request(self, request: Any, needs_tenants: Optional[str] = None) -> Any:
        """A request that stands alone (status, admin, ping) on the live
        connection; its frame, if it never left a lost one, on a new one.
        ``needs_tenants``: refused on a connection older than version 3."""
        conn = self._conn
        try:
            if needs_tenants is not None and not conn.closed:
                _core.require_tenants(conn.welcome, needs_tenants)
            return await conn.request(request, fresh=True)  # found lost: NotSent, before any write
        except _core.NotSent:
            conn = await self._reconnect()
            if needs_tenants is not None:
                _core.require_tenants(conn.welcome, needs_tenants)
            return await conn.request(request)

    def call(self, scope: str, est_tokens: Optional[int] = None, priority: Optional[str] = None, *,
             est_input_tokens: Optional[int] = None, est_output_tokens: Optional[int] = None,
             tenant: Optional[str] = None) -> Call:
        """A call in ``scope``; ``async with client.call(...) as call:``
        (``tenant``: see :meth:`polygate.Client.call`)."""
        return Call(self, scope, est_tokens, priority, est_input_tokens, est_output_tokens, tenant)

    async def run(self, scope: str, fn: Callable[[Permit], Awaitable[T]], est_tokens: Optional[int] = None,
                  priority: Optional[str] = None, classify: Optional[_core.Classifier] = None, *,
                  est_input_tokens: Optional[int] = None, est_output_tokens: Optional[int] = None,
                  tenant: Optional[str] = None) -> T:
        """``await fn(permit)`` under the sidecar's admission until it succeeds
        (see :meth:`polygate.Client.run`). Cancelling the awaiting task — while
        it waits for a permit or inside ``fn`` — releases everything the call held
        and re-raises ``CancelledError``."""
        last: Optional[BaseException] = None
        async with self.call(scope, est_tokens, priority, est_input_tokens=est_input_tokens,
                             est_output_tokens=est_output_tokens, tenant=tenant) as call:
            while True:
                try:
                    permit = await call.acquire()
                except GatewayUnavailableError as e:
                    if last is None:
                        raise
                    raise e from last
                try:
                    result = await fn(permit)
                except BaseException as exc:
                    if not call._attempt_failed(permit, exc, classify).retry:
                        raise
                    last = exc
                    continue
                if not permit.reported:
                    tokens, input_tokens, output_tokens, cached = _core.usage_of(result, permit.tokens)
                    if permit.limits is None:  # §18: a raw response carries its headers
                        permit.limits = _core.limits_of(result)
                    await permit.success(tokens, input_tokens=input_tokens, output_tokens=output_tokens,
                                         cached_input_tokens=cached)
                return result

    def gated(self, scope: str, est_tokens: Optional[int] = None, priority: Optional[str] = None,
              classify: Optional[_core.Classifier] = None, *, tenant: Optional[str] = None
              ) -> Callable[[Callable[..., Awaitable[T]]], Callable[..., Awaitable[T]]]:
        """Decorator form of :meth:`run` for ``async def fn(permit, *args, **kwargs)``."""
        def wrap(fn: Callable[..., Awaitable[T]]) -> Callable[..., Awaitable[T]]:
            @functools.wraps(fn)
            async def gated_call(*args: Any, **kwargs: Any) -> T:
                return await self.run(scope, lambda permit: fn(permit, *args, **kwargs), est_tokens, priority,
                                      classify, tenant=tenant)
            return gated_call
        return wrap

    async def tenant_status(self, tenant: str, scope: Optional[str] = None) -> Dict[str, Any]:
        """One tenant's ledger (see :meth:`polygate.Client.tenant_status`)."""
        request = _core.tenant_status(tenant, scope)
        body = _core.expect(await self._request(request, "tenant_status(%r)" % (tenant,)), "StatusJson")
        doc: Dict[str, Any] = json.loads(body)
        return doc

    async def status(self) -> Status:
        body = _core.expect(await self._request(_core.STATUS_JSON), "StatusJson")
        return _core.status_from_json(body)

    async def force_open(self, source: str, seconds: float = 30) -> None:
        _core.expect(await self._request(_core.force_open(source, seconds)), "Ok")

    async def force_close(self, source: str) -> None:
        _core.expect(await self._request(_core.force_close(source)), "Ok")

    async def reset(self, source: str) -> None:
        _core.expect(await self._request(_core.reset(source)), "Ok")

    async def ping(self) -> float:
        t0 = time.monotonic()
        _core.expect(await self._request(_core.PING), "Pong")
        return time.monotonic() - t0

    @property
    def closed(self) -> bool:
        """True once :meth:`close` was called (a lost connection is not closed:
        the next use reconnects)."""
        return self._closed

    async def close(self) -> None:
        """Close the connection for good (awaits waiting on it fail; later use is
        a ``SidecarError``); the sidecar releases everything it held."""
        self._closed = True
        task = self._dialing
        if task is not None:  # a reconnect under way: stop it, and let it close what it opened
            task.cancel()
            opening = self._opening
            if opening is not None:  # a cancel that races a finished connect can be lost in wait_for
                opening._die(_core.client_closed_error(self.path))
            await asyncio.wait([task])
        await self._conn.close()

    async def __aenter__(self) -> "Client":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    def __repr__(self) -> str:
        return "<polygate.aio.Client %s sidecar=%s%s>" % (
            self.path, self.sidecar_version, " closed" if self.closed else "")


def _retrieve(task: "asyncio.Task[Any]") -> None:
    """A dial's failure is raised to the tasks awaiting it; when all of them
    were cancelled, nobody retrieves it: do, so asyncio does not log it."""
    if not task.cancelled():
        task.exception()


async def connect(path: Optional[str] = None, *, client_name: Optional[str] = None,
                  timeout: Optional[float] = 10.0, autostart: Optional[bool] = None) -> Client:
    """Connect and handshake; see :func:`polygate.connect` (the client
    reconnects by itself after a lost connection; ``autostart`` as there, the
    start run in a thread, again at any reconnect that finds no sidecar)."""
    path = _core.resolve_path(path)
    auto = _autostart.wanted(autostart)
    return Client(await _dial(path, client_name, timeout, auto), client_name, timeout, auto)


async def _dial(path: str, client_name: Optional[str], timeout: Optional[float], autostart: bool,
                opened: Optional[Callable[[_Connection], None]] = None) -> _Connection:
    """:func:`_open`; with ``autostart``, a connect or handshake that finds no
    sidecar starts one (:func:`polygate._sync._dial`, the start run in a thread)
    and tries again, within ``timeout`` (10 s if None) for the whole."""
    if not autostart:
        return await _open(path, client_name, timeout, opened)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + _autostart.bound(timeout)
    tries = 0
    while True:
        try:
            return await _open(path, client_name, timeout, opened, gone=True)
        except _autostart.Gone as g:
            left = deadline - loop.time()
            if left <= 0:
                raise g.error from None
            if tries:
                await asyncio.sleep(min(left, _autostart.POLL))  # a listener still closing: let it go
            tries += 1
            await loop.run_in_executor(None, _autostart.ensure, path, left)


async def _open(path: str, client_name: Optional[str], timeout: Optional[float],
                opened: Optional[Callable[[_Connection], None]] = None, gone: bool = False) -> _Connection:
    """A new connection with its handshake done (``connect`` and every reconnect);
    ``opened`` learns of the connection as soon as it exists. ``Hello`` says 3;
    a sidecar that refuses it but speaks 2 gets a second connection saying 2."""
    loop = asyncio.get_running_loop()

    def make() -> _Connection:
        conn = _Connection(path)
        if opened is not None:
            opened(conn)
        return conn
    version = _wire.PROTOCOL_VERSION
    while True:
        try:
            _, conn = await asyncio.wait_for(loop.create_unix_connection(make, path), timeout)
        except asyncio.TimeoutError:
            raise SidecarError("cannot connect to the PolyGate sidecar at %s: timed out" % path,
                               kind="connection") from None
        except OSError as e:
            if gone and e.errno in _autostart.GONE:
                raise _autostart.Gone(_core.connect_error(path, e)) from None
            raise _core.connect_error(path, e) from None
        try:
            reply = await asyncio.wait_for(conn.request(_core.hello(client_name, version)), timeout)
            welcome = _core.check_welcome(reply, version)
        except _core.VersionFallback as fallback:
            await conn.close()
            version = fallback.version
            continue
        except asyncio.TimeoutError:
            await conn.close()
            raise SidecarError("no Welcome from the sidecar at %s within %ss" % (path, timeout),
                               kind="connection") from None
        except SidecarError as e:
            await conn.close()
            if gone and conn.gone:
                raise _autostart.Gone(e) from None
            raise
        except BaseException:
            await conn.close()
            raise
        conn.max_frame = welcome["max_frame"]
        conn.welcome = welcome
        return conn
