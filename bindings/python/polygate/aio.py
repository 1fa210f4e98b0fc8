"""asyncio PolyGate client: the same names as :mod:`polygate`, awaitable.

One connection multiplexes every concurrent call of the event loop: a reader
task resolves futures keyed by request id::

    client = await polygate.aio.connect()
    async with client.call("chat", est_tokens=1200) as call:
        permit = await call.acquire()
        ...
        await permit.success(tokens=1234)

Cancelling a task blocked in ``await call.acquire()`` sends ``Cancel`` for
that request and re-raises ``CancelledError``; leaving the ``async with``
block (normally, by exception or by cancellation) releases what the call
holds. When the connection dies, every pending await fails with
:class:`SidecarError`.
"""

from __future__ import annotations

import asyncio
import itertools
import struct
import time
from typing import Any, Dict, Optional

from . import _core, _wire
from ._core import ReportResult
from .errors import (
    AllSourcesExhausted,
    CircuitOpenError,
    GatewayUnavailableError,
    PolyGateError,
    SidecarError,
)

__all__ = [
    "connect",
    "Client",
    "Call",
    "Permit",
    "ReportResult",
    "PolyGateError",
    "SidecarError",
    "GatewayUnavailableError",
    "CircuitOpenError",
    "AllSourcesExhausted",
]

_BE32 = struct.Struct(">I")


class _Connection:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, path: str) -> None:
        self.path = path
        self.max_frame = _wire.DEFAULT_MAX_FRAME
        self._reader = reader
        self._writer = writer
        self._ids = itertools.count(1)
        # id -> future of a waiting requester, or None for a reply nobody awaits
        # (fire-and-forget, abandoned): such replies only get cleaned up.
        self._pending: Dict[int, Optional[asyncio.Future]] = {}
        self._dead: Optional[SidecarError] = None
        self._fatal: Optional[PolyGateError] = None
        self._drain_lock = asyncio.Lock()
        self._task = asyncio.ensure_future(self._read_loop())

    # ------------------------------------------------------------ sending

    def _write(self, request: Any) -> int:
        if self._dead is not None:
            raise self._dead
        rid = next(self._ids)
        payload = _wire.encode_client_frame({"id": rid, "request": request})
        if len(payload) > self.max_frame:
            raise SidecarError(
                "request of %d bytes exceeds the sidecar's max_frame %d" % (len(payload), self.max_frame),
                kind="frame_too_large",
            )
        self._writer.write(_wire.frame(payload))  # one write per frame: never interleaved
        return rid

    async def request(self, request: Any, *, cancel_on_cancel: bool = False) -> Any:
        """Send ``request`` and await its reply value. If the awaiting task is
        cancelled, the request is abandoned (``Cancel`` sent when
        ``cancel_on_cancel``; whatever a late reply creates is released)."""
        rid = self._write(request)
        fut = asyncio.get_running_loop().create_future()
        self._pending[rid] = fut
        try:
            async with self._drain_lock:
                await self._writer.drain()
            return await fut
        except asyncio.CancelledError:
            self._abandon(rid, fut, cancel_on_cancel)
            raise
        except (ConnectionError, OSError) as e:
            err = SidecarError("connection to the sidecar at %s lost: %s" % (self.path, e), kind="connection")
            self._die(err)
            raise err from e

    def post(self, request: Any) -> None:
        """Fire and forget (synchronous write; the reply is discarded)."""
        try:
            rid = self._write(request)
        except (SidecarError, _wire.WireError, ConnectionError, OSError, RuntimeError):
            return
        self._pending[rid] = None

    def _abandon(self, rid: int, fut: asyncio.Future, cancel: bool) -> None:
        if fut.done() and not fut.cancelled():
            if fut.exception() is None:  # the reply beat the cancellation
                self._cleanup_late(fut.result())
            return
        if self._dead is not None:
            return
        self._pending[rid] = None
        if cancel:
            self.post(_core.cancel(rid))

    def _cleanup_late(self, reply: Any) -> None:
        req = _core.late_cleanup(reply)
        if req is not None:
            self.post(req)

    # ------------------------------------------------------------ reading

    async def _read_loop(self) -> None:
        reason: Optional[SidecarError] = None
        try:
            while True:
                head = await self._reader.readexactly(4)
                (n,) = _BE32.unpack(head)
                if n > _core.MAX_INCOMING_FRAME:
                    raise _wire.WireError("incoming frame of %d bytes exceeds %d" % (n, _core.MAX_INCOMING_FRAME))
                payload = await self._reader.readexactly(n)
                self._dispatch(_wire.decode_server_frame(payload))
        except asyncio.IncompleteReadError:
            pass
        except _wire.WireError as e:
            reason = SidecarError("undecodable frame from the sidecar: %s" % e, kind="protocol")
        except (ConnectionError, OSError) as e:
            reason = SidecarError("connection to the sidecar at %s lost: %s" % (self.path, e), kind="connection")
        except asyncio.CancelledError:
            reason = SidecarError("the client closed its connection to %s" % self.path, kind="connection")
        except Exception as e:  # noqa: BLE001 - a bug must not leave waiters hanging
            reason = SidecarError("reader failed: %r" % (e,), kind="protocol")
        if reason is None:
            reason = _core.closed_error(self.path, self._fatal)
        self._die(reason)

    def _dispatch(self, frame: Dict[str, Any]) -> None:
        rid, reply = frame["id"], frame["reply"]
        if rid not in self._pending:
            if rid == 0:
                self._fatal = _core.connection_error(reply) or self._fatal
            return
        fut = self._pending.pop(rid)
        if fut is None or fut.done():
            self._cleanup_late(reply)
        else:
            fut.set_result(reply)

    def _die(self, err: SidecarError) -> None:
        if self._dead is None:
            self._dead = err
        pending, self._pending = self._pending, {}
        for fut in pending.values():
            if fut is not None and not fut.done():
                fut.set_exception(self._dead)
        try:
            self._writer.close()
        except Exception:  # noqa: BLE001
            pass

    @property
    def closed(self) -> bool:
        return self._dead is not None

    async def close(self) -> None:
        self._die(_core.client_closed_error(self.path))
        if not self._task.done():
            self._task.cancel()
        try:
            await self._task
        except BaseException:  # noqa: BLE001
            pass
        try:
            await self._writer.wait_closed()
        except Exception:  # noqa: BLE001
            pass


class Permit(_core.PermitBase):
    """Permission to make one attempt on ``source``. Report exactly once (awaitable)."""

    @property
    def reported(self) -> bool:
        return self._reported

    async def _report(self, outcome: Any) -> ReportResult:
        if self._reported:
            raise RuntimeError("permit %d (source %r) was already reported" % (self.id, self.source))
        self._reported = True
        if self._call._permit is self:
            self._call._permit = None
        self.result = _core.report_result(await self._call._conn.request(_core.report(self.id, outcome)))
        return self.result

    async def success(self, tokens: Optional[int] = None, count_attempt: bool = True) -> ReportResult:
        """The upstream answered usefully (see :meth:`polygate.Permit.success`)."""
        return await self._report(_core.outcome_success(tokens, count_attempt))

    async def failure(self, kind: str) -> ReportResult:
        """kind: timeout, server_error, connection, bad_result or error."""
        outcome = _core.outcome_failure(kind)  # ValueError before marking reported
        return await self._report(outcome)

    async def rate_limited(self, retry_after_s: Optional[float] = None) -> ReportResult:
        """The upstream answered 429 (backpressure, not failure)."""
        return await self._report(_core.outcome_rate_limited(retry_after_s))

    async def cancel(self) -> ReportResult:
        """The attempt was given up before (or while) sending."""
        return await self._report(_core.OUTCOME_CANCELLED)

    def __repr__(self) -> str:
        return _core.fmt_permit(self)


class Call:
    """One logical request in a scope; ``async with client.call(...) as call``."""

    def __init__(self, client: "Client", scope: str, est_tokens: Optional[int]) -> None:
        _core.begin_call(scope, est_tokens)
        self._client = client
        self._conn = client._conn
        self.scope = scope
        self.est_tokens = est_tokens
        self.id: Optional[int] = None
        self._permit: Optional[Permit] = None
        self._ended = False

    async def begin(self) -> "Call":
        if self._ended:
            raise RuntimeError("call in scope %r has ended" % self.scope)
        if self.id is None:
            reply = await self._conn.request(_core.begin_call(self.scope, self.est_tokens))
            self.id = _core.expect(reply, "CallBegun")["call"]
        return self

    async def acquire(self) -> Permit:
        """Await a permit. Raises CircuitOpenError, AllSourcesExhausted,
        GatewayUnavailableError or SidecarError. Cancelling the awaiting task
        sends ``Cancel`` and re-raises CancelledError."""
        await self.begin()
        reply = await self._conn.request(_core.acquire(self.id), cancel_on_cancel=True)
        permit = Permit(self, _core.expect(reply, "Granted"))
        self._permit = permit
        return permit

    @property
    def permit(self) -> Optional[Permit]:
        return self._permit

    def _release_now(self) -> None:
        """Synchronously queue Report(Cancelled) + EndCall (never awaits)."""
        permit, self._permit = self._permit, None
        if self.id is None or self._conn.closed:
            return
        if permit is not None and not permit.reported:
            permit._reported = True
            self._conn.post(_core.report(permit.id, _core.OUTCOME_CANCELLED))
        self._conn.post(_core.end_call(self.id))

    async def end(self) -> None:
        """Release what the call holds and forget it (idempotent)."""
        if self._ended:
            return
        self._ended = True
        permit, self._permit = self._permit, None
        if self.id is None or self._conn.closed:
            return
        end_sent = False
        try:
            if permit is not None and not permit.reported:
                try:
                    await permit.cancel()
                except PolyGateError:
                    pass  # e.g. the lease was reclaimed; EndCall releases anyway
            end_sent = True
            _core.expect(await self._conn.request(_core.end_call(self.id)), "Ok")
        except asyncio.CancelledError:
            if not end_sent:
                self._conn.post(_core.end_call(self.id))
            raise
        except SidecarError as e:
            if e.kind not in ("connection", "unknown_call"):
                raise

    async def __aenter__(self) -> "Call":
        return await self.begin()

    async def __aexit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            await self.end()
        elif not self._ended:
            self._ended = True
            self._release_now()

    def __repr__(self) -> str:
        return "<aio.Call %s scope=%r>" % (self.id, self.scope)


class Client:
    """An asyncio connection to the sidecar, shared by every task of the loop."""

    def __init__(self, conn: _Connection, welcome: Dict[str, Any]) -> None:
        self._conn = conn
        self.path = conn.path
        self.protocol_version: int = welcome["protocol_version"]
        self.sidecar_version: str = welcome["sidecar_version"]
        self.max_frame: int = welcome["max_frame"]

    def call(self, scope: str, est_tokens: Optional[int] = None) -> Call:
        return Call(self, scope, est_tokens)

    async def status(self) -> Dict[str, Any]:
        return _core.status_dict(await self._conn.request(_core.STATUS))

    async def force_open(self, source: str, seconds: float = 30) -> None:
        _core.expect(await self._conn.request(_core.force_open(source, seconds)), "Ok")

    async def force_close(self, source: str) -> None:
        _core.expect(await self._conn.request(_core.force_close(source)), "Ok")

    async def reset(self, source: str) -> None:
        _core.expect(await self._conn.request(_core.reset(source)), "Ok")

    async def ping(self) -> float:
        t0 = time.monotonic()
        _core.expect(await self._conn.request(_core.PING), "Pong")
        return time.monotonic() - t0

    @property
    def closed(self) -> bool:
        return self._conn.closed

    async def close(self) -> None:
        await self._conn.close()

    async def __aenter__(self) -> "Client":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    def __repr__(self) -> str:
        return "<polygate.aio.Client %s sidecar=%s%s>" % (
            self.path, self.sidecar_version, " closed" if self.closed else "")


async def connect(path: Optional[str] = None, *, client_name: Optional[str] = None,
                  timeout: Optional[float] = 10.0) -> Client:
    """Connect and handshake; see :func:`polygate.connect`."""
    path = _core.resolve_path(path)
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_unix_connection(path), timeout)
    except asyncio.TimeoutError:
        raise SidecarError("cannot connect to the PolyGate sidecar at %s: timed out" % path,
                           kind="connection") from None
    except OSError as e:
        raise _core.connect_error(path, e) from None
    conn = _Connection(reader, writer, path)
    try:
        reply = await asyncio.wait_for(conn.request(_core.hello(client_name)), timeout)
        welcome = _core.check_welcome(reply)
    except asyncio.TimeoutError:
        await conn.close()
        raise SidecarError("no Welcome from the sidecar at %s within %ss" % (path, timeout),
                           kind="connection") from None
    except BaseException:
        await conn.close()
        raise
    conn.max_frame = welcome["max_frame"]
    return Client(conn, welcome)
