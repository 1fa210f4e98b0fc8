"""Synchronous PolyGate client (thread-safe; one socket, one reader thread)."""

from __future__ import annotations

import itertools
import queue
import socket
import threading
import time
from typing import Any, Dict, Optional

from . import _core, _wire
from ._core import ReportResult
from .errors import PolyGateError, SidecarError

__all__ = ["connect", "Client", "Call", "Permit"]

_WAIT_SLICE = 0.25  # waits wake this often so asynchronous exceptions get through


class _Slot:
    __slots__ = ("event", "reply", "error", "abandoned")

    def __init__(self) -> None:
        self.event = threading.Event()
        self.reply: Any = None
        self.error: Optional[BaseException] = None
        self.abandoned = False


class _Connection:
    """Frames requests, demultiplexes replies by id to the waiting threads."""

    def __init__(self, sock: socket.socket, path: str) -> None:
        self.sock = sock
        self.path = path
        self.max_frame = _wire.DEFAULT_MAX_FRAME
        self._ids = itertools.count(1)
        self._lock = threading.Lock()  # pending + closed state
        self._outq: "queue.SimpleQueue[Optional[bytes]]" = queue.SimpleQueue()
        self._pending: Dict[int, _Slot] = {}
        self._dead: Optional[SidecarError] = None
        self._fatal: Optional[PolyGateError] = None  # an id-0 error, explains the close
        self._reader = threading.Thread(target=self._read_loop, name="polygate-reader", daemon=True)
        self._writer = threading.Thread(target=self._write_loop, name="polygate-writer", daemon=True)
        self._reader.start()
        self._writer.start()

    # ------------------------------------------------------------ sending

    def _write(self, data: bytes) -> None:
        # Frames go out through the writer thread: an interrupt (KeyboardInterrupt
        # lands only on the main thread) can then never cut a frame in half.
        # SimpleQueue.put is one C call: the frame is either queued or not.
        self._outq.put(data)

    def _write_loop(self) -> None:
        while True:
            data = self._outq.get()
            if data is None:
                return
            try:
                self.sock.sendall(data)
            except OSError as e:
                self._die(_core.lost_error(self.path, e))
                return

    def _register(self, request: Any, slot: _Slot) -> "tuple[int, bytes]":
        with self._lock:
            if self._dead is not None:
                raise self._dead
            rid = next(self._ids)
        data = _core.frame_request(rid, request, self.max_frame)  # bad input: raises, nothing registered or sent
        with self._lock:
            if self._dead is not None:
                raise self._dead
            self._pending[rid] = slot
        return rid, data

    def request(self, request: Any, *, cancel_on_interrupt: bool = False,
                timeout: Optional[float] = None) -> Any:
        """Send ``request``, block until its reply, return the reply value.

        If the wait is interrupted by any exception (KeyboardInterrupt, ...), the
        request is abandoned: with ``cancel_on_interrupt`` a ``Cancel`` is sent,
        and whatever a late reply created (permit, call) is released.
        """
        slot = _Slot()
        rid, data = self._register(request, slot)
        deadline = None if timeout is None else time.monotonic() + timeout
        # From here on the request may be on the wire (an interrupt can land between
        # any two bytecodes), so every exit by exception abandons it; a Cancel for an
        # id the sidecar never saw is answered Ok and does no harm.
        try:
            self._write(data)
            while not slot.event.wait(_WAIT_SLICE):
                if deadline is not None and time.monotonic() >= deadline:
                    raise SidecarError(
                        "no reply from the sidecar at %s within %ss" % (self.path, timeout), kind="connection"
                    )
        except BaseException:
            self._abandon(rid, slot, cancel_on_interrupt)
            raise
        if slot.error is not None:
            raise slot.error
        return slot.reply

    def post(self, request: Any) -> None:
        """Fire and forget: send ``request``, discard its reply."""
        slot = _Slot()
        slot.abandoned = True
        try:
            _, data = self._register(request, slot)
            self._write(data)
        except (SidecarError, _wire.WireError):
            pass

    def _abandon(self, rid: int, slot: _Slot, cancel: bool) -> None:
        with self._lock:
            arrived = slot.event.is_set()
            slot.abandoned = True
        if arrived:
            if slot.error is None:
                self._cleanup_late(slot.reply)
            return
        if cancel:
            self.post(_core.cancel(rid))

    def _cleanup_late(self, reply: Any) -> None:
        req = _core.late_cleanup(reply)
        if req is not None:
            self.post(req)

    # ------------------------------------------------------------ reading

    def _read_loop(self) -> None:
        decoder = _wire.FrameDecoder(_core.MAX_INCOMING_FRAME)
        reason: Optional[SidecarError] = None
        try:
            while True:
                try:
                    data = self.sock.recv(65536)
                except OSError as e:
                    reason = _core.lost_error(self.path, e)
                    break
                if not data:
                    break
                try:
                    for payload in decoder.feed(data):
                        self._dispatch(_wire.decode_server_frame(payload))
                except _wire.WireError as e:
                    reason = _core.undecodable_error(e)
                    break
        finally:
            if reason is None:
                reason = _core.closed_error(self.path, self._fatal)
            self._die(reason)

    def _dispatch(self, frame: Dict[str, Any]) -> None:
        rid, reply = frame["id"], frame["reply"]
        with self._lock:
            slot = self._pending.pop(rid, None)
            if slot is None:
                if rid == 0:
                    self._fatal = _core.connection_error(reply) or self._fatal
                return
            slot.reply = reply
            slot.event.set()
            late = slot.abandoned
        if late:
            self._cleanup_late(reply)

    def _die(self, err: SidecarError) -> None:
        with self._lock:
            if self._dead is None:
                self._dead = err
            pending, self._pending = self._pending, {}
            for slot in pending.values():
                slot.error = self._dead
                slot.event.set()
        self._outq.put(None)
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    @property
    def closed(self) -> bool:
        return self._dead is not None

    def close(self) -> None:
        if self._dead is None:
            self._outq.put(None)  # the writer sends what is queued, then stops
            if threading.current_thread() is not self._writer:
                self._writer.join(timeout=5)
        self._die(_core.client_closed_error(self.path))
        for t in (self._reader, self._writer):
            if threading.current_thread() is not t:
                t.join(timeout=5)
        try:
            self.sock.close()
        except OSError:
            pass


class Permit(_core.PermitBase):
    """Permission to make one attempt on ``source``. Report exactly once."""

    _call: "Call"

    def _report(self, outcome: Any) -> ReportResult:
        request = self._claim(outcome)
        return self._reported_as(self._call._conn.request(request))

    def success(self, tokens: Optional[int] = None, count_attempt: bool = True) -> ReportResult:
        """The upstream answered usefully. ``tokens``: actual usage (None keeps the
        estimate). ``count_attempt=False`` keeps an unusable "success" out of the
        breaker window."""
        return self._report(_core.outcome_success(tokens, count_attempt))

    def failure(self, kind: str) -> ReportResult:
        """The upstream failed; ``kind`` is one of timeout, server_error,
        connection, bad_result, error."""
        return self._report(_core.outcome_failure(kind))

    def rate_limited(self, retry_after_s: Optional[float] = None) -> ReportResult:
        """The upstream answered 429 (backpressure, not failure)."""
        return self._report(_core.outcome_rate_limited(retry_after_s))

    def cancel(self) -> ReportResult:
        """The attempt was given up before (or while) sending."""
        return self._report(_core.OUTCOME_CANCELLED)


class Call(_core.CallBase[Permit]):
    """One logical request in a scope. Use as a context manager; leaving the
    block reports ``Cancelled`` on an unreported permit and ends the call."""

    _permit_class = Permit
    _conn: _Connection

    def begin(self) -> "Call":
        """Send ``BeginCall`` (done by ``with``; the stall clock starts now)."""
        request = self._begin_request()
        if request is not None:
            self._began(self._conn.request(request))
        return self

    def acquire(self) -> Permit:
        """Block until the sidecar grants a permit. Raises CircuitOpenError,
        AllSourcesExhausted, GatewayUnavailableError or SidecarError. An
        interrupted wait (KeyboardInterrupt, ...) sends ``Cancel``."""
        self.begin()
        return self._granted(self._conn.request(self._acquire_request(), cancel_on_interrupt=True))

    def end(self, _quiet: bool = False) -> None:
        """Release what the call holds and forget it (idempotent)."""
        requests = self._release()
        if _quiet:
            for r in requests:
                self._conn.post(r)
            return
        for i, r in enumerate(requests):
            try:
                reply = self._conn.request(r)
            except SidecarError as e:
                _core.check_release(r, None, e)
            except BaseException:  # interrupted: make sure the call still ends
                for rest in requests[i + 1:]:
                    self._conn.post(rest)
                raise
            else:
                _core.check_release(r, reply, None)

    def __enter__(self) -> "Call":
        return self.begin()

    def __exit__(self, exc_type: Optional[type], exc: Optional[BaseException], tb: Any) -> None:
        self.end(_quiet=exc_type is not None)

    def __repr__(self) -> str:
        return "<Call %s scope=%r>" % (self.id, self.scope)


class Client:
    """A connection to the sidecar. Thread-safe: any number of threads may run
    calls over it concurrently. Use :func:`connect` to create one."""

    def __init__(self, conn: _Connection, welcome: Dict[str, Any]) -> None:
        self._conn = conn
        self.path = conn.path
        self.protocol_version: int = welcome["protocol_version"]
        self.sidecar_version: str = welcome["sidecar_version"]
        self.max_frame: int = welcome["max_frame"]

    def call(self, scope: str, est_tokens: Optional[int] = None) -> Call:
        """A call in ``scope``; use ``with client.call(...) as call:``."""
        return Call(self, scope, est_tokens)

    def status(self) -> _core.Status:
        """Live state: {"sidecar_version", "backend", "scopes": {scope: {...,
        "sources": {source: {...}}}}}."""
        return _core.status_dict(_core.expect(self._conn.request(_core.STATUS), "Status"))

    def force_open(self, source: str, seconds: float = 30) -> None:
        """Admin: open ``source``'s breaker for ``seconds``."""
        _core.expect(self._conn.request(_core.force_open(source, seconds)), "Ok")

    def force_close(self, source: str) -> None:
        """Admin: close ``source``'s breaker now (and clear its cooldown memo)."""
        _core.expect(self._conn.request(_core.force_close(source)), "Ok")

    def reset(self, source: str) -> None:
        """Admin: forget all breaker and quota state of ``source``."""
        _core.expect(self._conn.request(_core.reset(source)), "Ok")

    def ping(self) -> float:
        """Round trip to the sidecar; returns the seconds it took."""
        t0 = time.monotonic()
        _core.expect(self._conn.request(_core.PING), "Pong")
        return time.monotonic() - t0

    @property
    def closed(self) -> bool:
        return self._conn.closed

    def close(self) -> None:
        """Close the connection; the sidecar releases everything it held."""
        self._conn.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return "<polygate.Client %s sidecar=%s%s>" % (self.path, self.sidecar_version, " closed" if self.closed else "")


def connect(path: Optional[str] = None, *, client_name: Optional[str] = None,
            timeout: Optional[float] = 10.0) -> Client:
    """Connect to the sidecar and do the Hello/Welcome handshake.

    ``path``: the socket; default ``$POLYGATE_SOCKET``, else
    ``/run/polygate/sidecar.sock``. ``timeout`` bounds connect + handshake only.
    Raises :class:`SidecarError` (naming the path) if it cannot connect.
    """
    path = _core.resolve_path(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(timeout)
        sock.connect(path)
        sock.settimeout(None)
    except OSError as e:
        sock.close()
        raise _core.connect_error(path, e) from None
    conn = _Connection(sock, path)
    try:
        welcome = _core.check_welcome(conn.request(_core.hello(client_name), timeout=timeout))
    except BaseException:
        conn.close()
        raise
    conn.max_frame = welcome["max_frame"]
    return Client(conn, welcome)
