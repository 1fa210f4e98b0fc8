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

class _Connection:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, path: str) -> None:
        self.path = path
        self.max_frame = _wire.DEFAULT_MAX_FRAME
        self._reader = reader
        self._writer = writer
        self._ids = itertools.count(1)
        # id -> future of a waiting requester, or None for a reply nobody awaits
        # (fire-and-forget, abandoned): such replies only get cleaned up.
        self._pending: Dict[int, "Optional[asyncio.Future[Any]]"] = {}
        self._dead: Optional[SidecarError] = None
        self._fatal: Optional[PolyGateError] = None
        self._drain_lock = asyncio.Lock()
        self._task = asyncio.ensure_future(self._read_loop())

    # ------------------------------------------------------------ sending

    def _write(self, request: Any) -> int:
        if self._dead is not None:
            raise self._dead
        rid = next(self._ids)
        self._writer.write(_core.frame_request(rid, request, self.max_frame))  # whole frames: never interleaved
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
            err = _core.lost_error(self.path, e)
            self._die(err)
            raise err from e

    def post(self, request: Any) -> None:
        """Fire and forget (synchronous write; the reply is discarded)."""
        try:
            rid = self._write(request)
        except (SidecarError, _wire.WireError, ConnectionError, OSError, RuntimeError):
            return
        self._pending[rid] = None

    def _abandon(self, rid: int, fut: "asyncio.Future[Any]", cancel: bool) -> None:
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
        decoder = _wire.FrameDecoder(_core.MAX_INCOMING_FRAME)
        reason: Optional[SidecarError] = None
        try:
            while True:
                data = await self._reader.read(65536)
                if not data:
                    break
                for payload in decoder.feed(data):
                    self._dispatch(_wire.decode_server_frame(payload))
        except _wire.WireError as e:
            reason = _core.undecodable_error(e)
        except (ConnectionError, OSError) as e:
            reason = _core.lost_error(self.path, e)
        except asyncio.CancelledError:
            reason = _core.client_closed_error(self.path)
        except Exception as e:  # noqa: BLE001 - a bug must not leave waiters hanging
            reason = _core.protocol_error("reader failed: %r" % (e,))
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

    _call: "Call"

    async def _report(self, outcome: Any) -> ReportResult:
        request = self._claim(outcome)
        return self._reported_as(await self._call._conn.request(request))

    async def success(self, tokens: Optional[int] = None, count_attempt: bool = True) -> ReportResult:
        """The upstream answered usefully (see :meth:`polygate.Permit.success`)."""
        return await self._report(_core.outcome_success(tokens, count_attempt))

    async def failure(self, kind: str) -> ReportResult:
        """kind: timeout, server_error, connection, bad_result or error."""
        return await self._report(_core.outcome_failure(kind))

    async def rate_limited(self, retry_after_s: Optional[float] = None) -> ReportResult:
        """The upstream answered 429 (backpressure, not failure)."""
        return await self._report(_core.outcome_rate_limited(retry_after_s))

    async def cancel(self) -> ReportResult:
        """The attempt was given up before (or while) sending."""
        return await self._report(_core.OUTCOME_CANCELLED)


class Call(_core.CallBase[Permit]):
    """One logical request in a scope; ``async with client.call(...) as call``."""

    _permit_class = Permit
    _conn: _Connection

    async def begin(self) -> "Call":
        """Send ``BeginCall`` (done by ``async with``; the stall clock starts now)."""
        request = self._begin_request()
        if request is not None:
            self._began(await self._conn.request(request))
        return self

    async def acquire(self) -> Permit:
        """Await a permit. Raises CircuitOpenError, AllSourcesExhausted,
        GatewayUnavailableError or SidecarError. Cancelling the awaiting task
        sends ``Cancel`` and re-raises CancelledError."""
        await self.begin()
        return self._granted(await self._conn.request(self._acquire_request(), cancel_on_cancel=True))

    async def end(self) -> None:
        """Release what the call holds and forget it (idempotent)."""
        requests = self._release()
        for i, r in enumerate(requests):
            try:
                reply = await self._conn.request(r)
            except SidecarError as e:
                _core.check_release(r, None, e)
            except asyncio.CancelledError:  # make sure the call still ends
                for rest in requests[i + 1:]:
                    self._conn.post(rest)
                raise
            else:
                _core.check_release(r, reply, None)

    async def __aenter__(self) -> "Call":
        return await self.begin()

    async def __aexit__(self, exc_type: Optional[type], exc: Optional[BaseException], tb: Any) -> None:
        if exc_type is None:
            await self.end()
        else:  # queue the releases without awaiting (the task may be cancelled)
            for r in self._release():
                self._conn.post(r)

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

    async def status(self) -> _core.Status:
        return _core.status_dict(_core.expect(await self._conn.request(_core.STATUS), "Status"))

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
