"""Synchronous PolyGate client: thread-safe, one socket, no helper threads.

The request path has no thread hop (DESIGN §16): the calling thread frames its
request and writes it under a lock, then waits for the reply by reading the
socket itself. When several threads wait at once, one of them reads for all
(the *leader*): it hands each reply to the thread waiting for that id and, once
its own reply is in, passes the reading on to another waiter.

Interrupts: ``KeyboardInterrupt`` reaches only the main thread, and it may land
at any bytecode — also between a ``send`` or ``recv`` returning and the client
noting how many bytes moved, which would cut the byte stream. So while a
request of the main thread is on its way, SIGINT's handler is swapped for one
that *defers* it to safe points: the waits (a ``poll``, or a follower's event),
where nothing is half-read, and the end of the request. An interrupted wait
sends ``Cancel`` for its request and re-raises. Any other exception raised in
the middle of a read or write (another signal's handler) closes the connection
instead: every pending request fails with ``SidecarError``, and the sidecar
releases everything the connection held.

Reconnection: a lost connection (closed by the sidecar — idle timeout, restart —
or failed under us) fails every request in flight on it, and the calls begun on
it. The next request that needs no state of the old connection (a call's first
frame, status, admin, ping) opens a new one first: :meth:`Client._reconnect`,
one dial for all the threads that noticed the loss. Nobody reads an idle
socket, so a connection the sidecar closed while idle is usually found dead by
the next write: that frame never left, so it is sent again on the new
connection — never a frame that may have been applied. Connected, a request
pays one attribute check for all this: no lock, no syscall.
"""

from __future__ import annotations

import functools
import itertools
import json
import select
import signal
import socket
import threading
import time
from typing import Any, Callable, Dict, List, Optional, TypeVar

from . import _autostart, _core, _frames, _wire
from ._core import ReportResult
from .errors import GatewayUnavailableError, PolyGateError, SidecarError

__all__ = ["connect", "Client", "Call", "Permit"]

# CPython's C module behind `signal`: signal.signal/getsignal wrap it in enum
# conversions that cost microseconds per request.
_sig: Any = getattr(signal, "_signal", signal)
_SIGINT = int(signal.SIGINT)

_WAIT_SLICE = 0.25  # the main thread's waits wake this often so signals get through
_RECV_SIZE = 65536
# A write to a connection the sidecar closed must fail with EPIPE, not kill a
# program that restored SIGPIPE's default action (CLI tools often do).
_SEND_FLAGS = getattr(socket, "MSG_NOSIGNAL", 0)
_MAIN_IDENT = threading.main_thread().ident

T = TypeVar("T")


class _SigintGuard:
    """Defers SIGINT on the main thread while a request is on its way (see the
    module doc): a SIGINT is handed to the previous handler at once during a
    safe wait, else noted and handed over at the next safe point."""

    __slots__ = ("prev", "pending", "safe")

    def __init__(self, prev: Callable[[int, Any], Any]) -> None:
        self.prev = prev
        self.pending = False
        self.safe = False

    def __call__(self, signum: int, frame: Any) -> None:
        if self.safe:
            self.safe = False
            self.prev(signum, frame)
        else:
            self.pending = True

    def deliver(self) -> None:
        """At a safe point: run a deferred SIGINT (KeyboardInterrupt raises here)."""
        if self.pending:
            self.pending = False
            self.prev(_SIGINT, None)

    @staticmethod
    def install() -> "Optional[_SigintGuard]":
        """A guard for this request: only on the main thread, and only when SIGINT
        runs a Python handler (SIG_IGN / SIG_DFL never raise)."""
        if threading.get_ident() != _MAIN_IDENT:
            return None
        prev = _sig.getsignal(_SIGINT)
        if not callable(prev) or isinstance(prev, _SigintGuard):
            return None
        guard = _SigintGuard(prev)
        _sig.signal(_SIGINT, guard)
        return guard

    def restore(self) -> None:
        _sig.signal(_SIGINT, self.prev)
        self.deliver()


class _Slot:
    """One request awaiting its reply."""

    __slots__ = ("done", "reply", "error", "abandoned", "event", "on_late")

    def __init__(self, on_late: Optional[_core.OnReply]) -> None:
        self.done = False
        self.reply: Any = None
        self.error: Optional[BaseException] = None
        self.abandoned = False  # nobody awaits the reply: on_late reads it
        self.event: Optional[threading.Event] = None  # made when a thread waits as a follower
        self.on_late = on_late


class _Connection:
    """Frames requests, and demultiplexes replies by id to the waiting threads."""

    def __init__(self, sock: socket.socket, path: str) -> None:
        self.sock = sock
        self.path = path
        self.max_frame = _wire.DEFAULT_MAX_FRAME
        self.welcome: Dict[str, Any] = {}  # the sidecar's Welcome, once the handshake is done
        self._ids = itertools.count(1)
        self._lock = threading.Lock()  # pending, the reading role, dead
        self._wlock = threading.Lock()  # one writer at a time: frames never interleave
        self._pending: Dict[int, _Slot] = {}
        self._reading = False
        self._close_fd = False  # close() came while a leader was reading: it closes the fd
        self._dead: Optional[SidecarError] = None
        self.gone = False  # _dead says the sidecar closed or reset the connection (not us, not a bad frame)
        self._fatal: Optional[PolyGateError] = None  # an id-0 error, explains the close
        self._decoder = _wire.FrameDecoder(_core.MAX_INCOMING_FRAME)
        self._buf = bytearray(_RECV_SIZE)
        self._view = memoryview(self._buf)
        self._poll = select.poll()
        self._poll.register(sock.fileno(), select.POLLIN)

    # ------------------------------------------------------------ sending

    def _register(self, request: Any, slot: _Slot) -> "tuple[int, bytes]":
        rid = next(self._ids)
        data = _core.frame_request(rid, request, self.max_frame)  # bad input: raises, nothing registered
        with self._lock:
            if self._dead is not None:
                raise _core.NotSent(self._dead)
            self._pending[rid] = slot
        return rid, data

    def _send(self, data: bytes) -> None:
        with self._wlock:
            try:
                self.sock.sendall(data, _SEND_FLAGS)
            except OSError as e:
                # The sidecar never got the whole frame, so it cannot have applied it.
                self._die(_core.lost_error(self.path, e), gone=True)
                raise _core.NotSent(self._dead_error()) from None
            except BaseException:  # an interrupt inside sendall: part of the frame may be out
                self._die(SidecarError("interrupted while writing to the sidecar at %s; the connection "
                                       "was closed (its frames could be cut)" % self.path, kind="connection"))
                raise

    def _dead_error(self) -> SidecarError:
        assert self._dead is not None
        return self._dead

    def request(self, request: Any, *, cancel_on_interrupt: bool = False,
                on_late: Optional[_core.OnReply] = None, timeout: Optional[float] = None,
                fresh: bool = False) -> Any:
        """Send ``request``, block until its reply, return the reply value.

        If the wait ends by any exception (KeyboardInterrupt, ...), the request
        is abandoned: with ``cancel_on_interrupt`` a ``Cancel`` is sent, and a
        late reply goes to ``on_late`` (default: release what it created).
        A request whose frame could not leave because the connection is lost
        raises :class:`_core.NotSent` when ``fresh`` (the caller sends it again
        on a new connection), else that connection's ``SidecarError``.
        """
        slot = _Slot(on_late)
        try:
            rid, data = self._register(request, slot)
        except _core.NotSent as e:
            if fresh:
                raise
            raise e.error from None
        deadline = None if timeout is None else time.monotonic() + timeout
        # From here on the request may be on the wire, so every exit by exception
        # abandons it; a Cancel for an id the sidecar never saw is answered Ok.
        try:
            guard = _SigintGuard.install()
            try:
                self._send(data)
                self._wait(slot, deadline, timeout, guard)
            finally:
                if guard is not None:
                    guard.restore()
        except _core.NotSent as e:  # the connection died and failed the slot: nothing to abandon
            if fresh:
                raise
            raise e.error from None
        except BaseException:
            self._abandon(rid, slot, cancel_on_interrupt)
            raise
        if slot.error is not None:
            raise slot.error
        return slot.reply

    def post(self, request: Any, on_late: Optional[_core.OnReply] = None) -> None:
        """Fire and forget: send ``request``; its reply goes to ``on_late``."""
        slot = _Slot(on_late)
        slot.abandoned = True
        try:
            _, data = self._register(request, slot)
            guard = _SigintGuard.install()
            try:
                self._send(data)
            finally:
                if guard is not None:
                    guard.restore()
        except (SidecarError, _core.NotSent, _wire.WireError):
            return
        self._ensure_drain()

    def _abandon(self, rid: int, slot: _Slot, cancel: bool) -> None:
        with self._lock:
            arrived = slot.done
            slot.abandoned = True
        if arrived:
            if slot.error is None:
                self._late(slot, slot.reply)
            return
        if cancel and self._dead is None:
            self.post(_core.cancel(rid))
        self._ensure_drain()

    def _late(self, slot: _Slot, reply: Any) -> None:
        follow = (slot.on_late or _core.late_cleanup)(reply)
        if follow is not None:
            self.post(follow)

    # ------------------------------------------------------------ waiting and reading

    def _wait(self, slot: _Slot, deadline: Optional[float], timeout: Optional[float],
              guard: Optional[_SigintGuard]) -> None:
        while not slot.done:
            with self._lock:
                if slot.done:
                    return
                lead = not self._reading
                if lead:
                    self._reading = True
                elif slot.event is None:
                    slot.event = threading.Event()
                event = slot.event
            if lead:
                try:
                    self._read_until(slot, deadline, timeout, guard)
                finally:
                    self._hand_over()
            else:
                assert event is not None
                if guard is not None:
                    guard.deliver()
                    guard.safe = True
                event.wait(_WAIT_SLICE)
                if guard is not None:
                    guard.safe = False
                with self._lock:
                    if not slot.done:
                        event.clear()  # a hand-over nudge: loop and take the reading
                self._check_deadline(deadline, timeout)

    def _check_deadline(self, deadline: Optional[float], timeout: Optional[float]) -> None:
        if deadline is not None and time.monotonic() >= deadline:
            raise SidecarError("no reply from the sidecar at %s within %ss" % (self.path, timeout),
                               kind="connection")

    def _read_until(self, slot: _Slot, deadline: Optional[float], timeout: Optional[float],
                    guard: Optional[_SigintGuard]) -> None:
        """Read and dispatch frames until ``slot`` is answered (we hold the reading)."""
        careful = deadline is not None or guard is not None or threading.get_ident() == _MAIN_IDENT
        while not slot.done and self._read_once(careful, guard, deadline, timeout):
            pass

    def _read_once(self, careful: bool, guard: Optional[_SigintGuard], deadline: Optional[float],
                   timeout: Optional[float]) -> bool:
        """One read (waiting for data first when ``careful``) and the dispatch of
        the frames it completes; False once the connection is dead."""
        if careful:  # an interrupt (or the deadline) in poll consumes nothing
            wait = _WAIT_SLICE
            if deadline is not None:
                wait = max(0.0, min(wait, deadline - time.monotonic()))
            if guard is not None:
                guard.deliver()
                guard.safe = True
            ready = self._poll.poll(int(wait * 1000) + 1)
            if guard is not None:
                guard.safe = False
            if not ready:
                self._check_deadline(deadline, timeout)
                return self._dead is None
        try:
            n = self.sock.recv_into(self._buf)
            if n == 0:
                self._die(_core.closed_error(self.path, self._fatal), gone=True)
                return False
            self._dispatch(self._decoder.feed(self._view[:n]))
        except InterruptedError:
            pass
        except OSError as e:
            self._die(_core.lost_error(self.path, e), gone=True)
            return False
        except _wire.WireError as e:
            self._die(_core.undecodable_error(e))
            return False
        except BaseException:  # interrupted between reading bytes and handing them out
            self._die(SidecarError("interrupted while reading from the sidecar at %s; the connection "
                                   "was closed (replies could be lost)" % self.path, kind="connection"))
            raise
        return self._dead is None

    def _ensure_drain(self) -> None:
        """Replies nobody waits for (a cancelled request's, a release's) may hold
        something to release — a grant that raced its Cancel. When no thread is
        reading, one short-lived thread reads until they are all in, so nothing
        stays held until this client's next request."""
        with self._lock:
            if self._reading or self._dead is not None or not any(s.abandoned for s in self._pending.values()):
                return
            self._reading = True
        try:
            threading.Thread(target=self._drain, name="polygate-drain", daemon=True).start()
        except BaseException:
            self._hand_over()
            raise

    def _drain(self) -> None:
        try:
            while True:
                with self._lock:
                    if not any(s.abandoned for s in self._pending.values()):
                        return
                if not self._read_once(True, None, None, None):
                    return
        finally:
            self._hand_over()

    def _dispatch(self, payloads: List[bytes]) -> None:
        for payload in payloads:
            frame = _frames.decode_server_frame(payload)
            rid, reply = frame["id"], frame["reply"]
            with self._lock:
                slot = self._pending.pop(rid, None)
                if slot is None:
                    if rid == 0:
                        self._fatal = _core.connection_error(reply) or self._fatal
                    continue
                slot.reply = reply
                slot.done = True
                late, event = slot.abandoned, slot.event
            if late:
                self._late(slot, reply)
            elif event is not None:
                event.set()

    def _hand_over(self) -> None:
        """Give up the reading; wake a waiting follower to take it."""
        nudge: Optional[threading.Event] = None
        with self._lock:
            self._reading = False
            close_fd, self._close_fd = self._close_fd, False
            for s in self._pending.values():
                if s.event is not None and not s.done:
                    nudge = s.event
                    break
        if nudge is not None:
            nudge.set()
        if close_fd:
            self._close_socket()

    def _die(self, err: SidecarError, gone: bool = False) -> None:
        events = []
        with self._lock:
            if self._dead is None:
                self._dead = err
                self.gone = gone
            pending, self._pending = self._pending, {}
            for slot in pending.values():
                slot.error = self._dead
                slot.done = True
                if slot.event is not None:
                    events.append(slot.event)
        for e in events:
            e.set()
        try:
            self.sock.shutdown(socket.SHUT_RDWR)  # wakes a leader blocked in recv
        except OSError:
            pass

    def _close_socket(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass

    @property
    def closed(self) -> bool:
        return self._dead is not None

    def close(self) -> None:
        self._die(_core.client_closed_error(self.path))
        with self._lock:
            reading = self._reading
            if reading:
                self._close_fd = True  # the leader closes it when it lets go: no fd reuse under it
        if not reading:
            self._close_socket()


class Permit(_core.PermitBase):
    """Permission to make one attempt on ``source``. Report exactly once."""

    _call: "Call"

    def success(self, tokens: Optional[int] = None, *, input_tokens: Optional[int] = None,
                output_tokens: Optional[int] = None, cached_input_tokens: Optional[int] = None,
                count_attempt: bool = True) -> Optional[ReportResult]:
        """The upstream answered usefully; this ends the call (one ``Finish``)
        and returns the sidecar's :class:`ReportResult`.

        ``tokens``: actual usage (None keeps the estimate); ``input_tokens`` /
        ``output_tokens``: the split (input excluding cached reads), ``tokens``
        then defaults to their sum. ``cached_input_tokens``: the input the
        provider read from its prompt cache (a tenant's dollar cost prices them at
        the cached rate; sent as ``SuccessCached`` on a version-3 connection,
        dropped on an older one). ``count_attempt=False``: the answer was
        unusable — kept out of the breaker window, and the call goes on (the
        report is held like a failure's, and None is returned)."""
        call = self._call
        outcome = _core.outcome_success(tokens, count_attempt, input_tokens, output_tokens, cached_input_tokens,
                                        call._protocol_version)
        request = call._report(self, outcome, final=count_attempt)
        if request is None:
            return None
        return call._finished(self, call._conn.request(request))

    def failure(self, kind: str, tokens: Optional[int] = None) -> None:
        """The upstream failed; ``kind`` is one of timeout, server_error,
        connection, bad_result, error. ``tokens``: what the failed request still
        consumed, if known. The report goes out with the next ``acquire()``
        (as ``Retry``) or when the call ends (as ``Finish``)."""
        self._call._report(self, _core.outcome_failure(kind, tokens), final=False)

    def rate_limited(self, retry_after_s: Optional[float] = None) -> None:
        """The upstream answered 429 (backpressure, not failure); pass its
        ``Retry-After`` in seconds. Held like a failure."""
        self._call._report(self, _core.outcome_rate_limited(retry_after_s), final=False)

    def cancel(self) -> None:
        """The attempt was given up before (or while) sending. Held like a failure."""
        self._call._report(self, _core.OUTCOME_CANCELLED, final=False)


class Call(_core.CallBase[Permit]):
    """One logical request in a scope. Use as a context manager; leaving the
    block releases what the call still holds, in one frame at most."""

    _permit_class = Permit
    _conn: _Connection  # calls.UNBOUND until the call's first frame binds it (see CallBase)
    _client: "Client"

    def _resend(self, request: bytes, cancel: bool, on_late: _core.OnReply) -> Any:
        """The call's first frame (``Start`` or ``Begin``) could not leave the
        connection it was bound to, found lost: reconnect, bind the call to the
        new connection and send it there (once)."""
        conn = self._bind(self._client._reconnect(self._conn))
        return conn.request(request, cancel_on_interrupt=cancel, on_late=on_late)

    def begin(self) -> "Call":
        """Optional: send ``Begin`` now, so the stall clock starts before the
        first ``acquire()`` (which otherwise begins the call itself)."""
        request = self._begin_request()
        if request is not None:
            try:
                reply = self._conn.request(request, on_late=_core.late_cleanup, fresh=True)
            except _core.NotSent:
                reply = self._resend(request, False, _core.late_cleanup)
            self._began(reply)
        return self

    def acquire(self) -> Permit:
        """Block until the sidecar grants a permit (sending any held report with
        it). Raises CircuitOpenError, AllSourcesExhausted, GatewayUnavailableError
        — the call is over then — or SidecarError. An interrupted wait
        (KeyboardInterrupt, ...) sends ``Cancel`` and ends the call."""
        acq = self._acquisition()
        try:
            # A call lives on the connection its first frame went to: lost, the call is.
            try:
                reply = self._conn.request(acq.request, cancel_on_interrupt=True, on_late=acq.on_late,
                                           fresh=acq.fresh)
            except _core.NotSent:  # the first frame found its connection lost: a new one
                reply = self._resend(acq.request, True, acq.on_late)
        except BaseException:
            self._acquire_abandoned(acq)
            raise
        return self._acquired(acq, reply)

    def end(self, _quiet: bool = False) -> None:
        """Release what the call holds and forget it (idempotent; never raises
        for the sidecar's answer: the release is best effort by design)."""
        rel = self._release()
        if rel is None:
            return
        if _quiet:
            self._conn.post(rel.request, on_late=rel.on_reply)
            return
        try:
            reply = self._conn.request(rel.request, on_late=rel.on_reply)
        except SidecarError:
            return  # the connection is gone: the sidecar released everything
        follow = rel.on_reply(reply)
        if follow is not None:
            self._conn.post(follow)

    def __enter__(self) -> "Call":
        self._check_open()
        return self

    def __exit__(self, exc_type: Optional[type], exc: Optional[BaseException], tb: Any) -> None:
        self.end(_quiet=exc_type is not None)

    def __repr__(self) -> str:
        return "<Call %s scope=%r>" % (self.id, self.scope)


class Client(_core.WelcomeInfo[_Connection]):
    """A connection to the sidecar. Thread-safe: any number of threads may run
    calls over it concurrently. Use :func:`connect` to create one.

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
        self._lock = threading.Lock()  # _closed and the swap of _conn (held briefly)
        self._dial_lock = threading.Lock()  # one reconnect at a time; the others wait for its result
        self._dials = 0  # reconnect attempts finished: a thread that waited for one takes its result
        self._dial_error: Optional[SidecarError] = None  # why the last attempt failed
        self._opening: Optional[_Connection] = None  # a reconnect's connection, until its handshake is done

    def _reconnect(self, lost: _Connection) -> _Connection:
        """The live connection, after ``lost`` was found dead: a new one (socket
        + Hello/Welcome), unless another thread made it meanwhile. Threads that
        find the loss together dial once; those that waited for a dial that
        failed get its error instead of dialing again each in turn."""
        seen = self._dials
        with self._dial_lock:
            if self._closed:
                raise _core.client_closed_error(self.path)
            conn = self._conn
            if conn._dead is None:
                return conn  # another thread reconnected
            failed = self._dial_error
            if self._dials != seen and failed is not None:
                raise SidecarError(failed.message, kind=failed.kind) from None
            # cleared first: a dial that ends otherwise (KeyboardInterrupt) must not
            # hand its waiters the error of an older one
            self._dial_error = None
            try:
                new = _dial(self.path, self._client_name, self._timeout, self._autostart, self._opened)
            except SidecarError as e:
                self._dial_error = e
                raise
            finally:
                self._dials += 1
                with self._lock:
                    self._opening = None
            with self._lock:
                closed = self._closed
                if not closed:
                    self._conn = new
            if closed:  # close() came while we dialed
                new.close()
                raise _core.client_closed_error(self.path)
        conn.close()  # the lost one: its fd (the sidecar released what it held)
        if lost is not conn:
            lost.close()
        return new

    def _opened(self, conn: _Connection) -> None:
        """A reconnect's socket is connected: close() must reach it, so that a
        close() during the handshake ends it at once, as in the asyncio client."""
        with self._lock:
            closed = self._closed
            if not closed:
                self._opening = conn
        if closed:
            conn.close()  # the handshake fails now with the closed-client error

    def _request(self, request: Any, needs_tenants: Optional[str] = None) -> Any:
        """A request that stands alone (status, admin, ping) on the live
        connection; its frame, if it could not leave a lost one, on a new one.
        ``needs_tenants`` (what the request is, for the error): refused on a
        connection older than version 3."""
        conn = self._conn
        try:
            if needs_tenants is not None and not conn.closed:
                _core.require_tenants(conn.welcome, needs_tenants)
            return conn.request(request, fresh=True)  # found lost: NotSent, before any write
        except _core.NotSent:
            conn = self._reconnect(conn)
            if needs_tenants is not None:
                _core.require_tenants(conn.welcome, needs_tenants)
            return conn.request(request)

    def call(self, scope: str, est_tokens: Optional[int] = None, priority: Optional[str] = None, *,
             est_input_tokens: Optional[int] = None, est_output_tokens: Optional[int] = None,
             tenant: Optional[str] = None) -> Call:
        """A call in ``scope``; use ``with client.call(...) as call:``. Nothing is
        sent until the first ``acquire()`` (or ``begin()``). ``tenant``: the
        tenant the call is made for (DESIGN §19; at most 128 bytes of UTF-8;
        None or ``""``: the scope's anonymous tenant); it needs a sidecar that
        speaks protocol 3."""
        return Call(self, scope, est_tokens, priority, est_input_tokens, est_output_tokens, tenant)

    def run(self, scope: str, fn: Callable[[Permit], T], est_tokens: Optional[int] = None,
            priority: Optional[str] = None, classify: Optional[_core.Classifier] = None, *,
            est_input_tokens: Optional[int] = None, est_output_tokens: Optional[int] = None,
            tenant: Optional[str] = None) -> T:
        """Run ``fn(permit)`` under the sidecar's admission until it succeeds, and
        return its result: the whole acquire / call / report / fail-over loop.

        ``fn`` gets each attempt's :class:`Permit` (``permit.source`` says where to
        send the request). A return is a success, reported with the usage found in
        the result (``usage.total_tokens`` / ``prompt_tokens`` / ``completion_tokens``,
        or ``input_tokens`` / ``output_tokens``) or set by ``fn`` as ``permit.tokens``.
        An exception is classified (timeouts, connection errors, HTTP 429 with its
        ``Retry-After``, 5xx, ...; ``classify(exc)`` first, when given, may return
        a :class:`polygate.Outcome`) and either retried — the next attempt, maybe
        on another source — or reported and re-raised at once (a 400, or an
        exception nothing recognises). When the call's budget is spent, the
        sidecar's error (``AllSourcesExhausted``, ``CircuitOpenError``) is raised
        from the last exception; a tenant's refusal (:class:`TenantLimitExceeded`,
        ``tenant=``) at once, with no other attempt. Every path releases what the
        call held.
        """
        last: Optional[BaseException] = None
        with self.call(scope, est_tokens, priority, est_input_tokens=est_input_tokens,
                       est_output_tokens=est_output_tokens, tenant=tenant) as call:
            while True:
                try:
                    permit = call.acquire()
                except GatewayUnavailableError as e:
                    if last is None:
                        raise
                    raise e from last
                try:
                    result = fn(permit)
                except BaseException as exc:
                    if not call._attempt_failed(permit, exc, classify).retry:
                        raise
                    last = exc
                    continue
                if not permit.reported:
                    tokens, input_tokens, output_tokens, cached = _core.usage_of(result, permit.tokens)
                    if permit.limits is None:  # §18: a raw response carries its headers
                        permit.limits = _core.limits_of(result)
                    permit.success(tokens, input_tokens=input_tokens, output_tokens=output_tokens,
                                   cached_input_tokens=cached)
                return result

    def gated(self, scope: str, est_tokens: Optional[int] = None, priority: Optional[str] = None,
              classify: Optional[_core.Classifier] = None, *, tenant: Optional[str] = None
              ) -> Callable[[Callable[..., T]], Callable[..., T]]:
        """Decorator form of :meth:`run`::

            @client.gated("chat", est_tokens=1200)
            def ask(permit, prompt):
                return openai_client(permit.source).chat.completions.create(...)

            reply = ask("hello")   # fn(permit, *args, **kwargs) under client.run
        """
        def wrap(fn: Callable[..., T]) -> Callable[..., T]:
            @functools.wraps(fn)
            def gated_call(*args: Any, **kwargs: Any) -> T:
                return self.run(scope, lambda permit: fn(permit, *args, **kwargs), est_tokens, priority, classify,
                                tenant=tenant)
            return gated_call
        return wrap

    def tenant_status(self, tenant: str, scope: Optional[str] = None) -> Dict[str, Any]:
        """One tenant's ledger (DESIGN §19): ``{"tenant": ..., "scopes": {scope:
        {...}}}`` — per scope with tenants (only ``scope`` when given), its limits,
        bucket levels, spend in the current day and month, calls in flight and
        waiting, as the sidecar sends it (``TenantStatus``; ``""`` is the
        anonymous tenant). Needs a sidecar that speaks protocol 3."""
        request = _core.tenant_status(tenant, scope)
        body = _core.expect(self._request(request, "tenant_status(%r)" % (tenant,)), "StatusJson")
        doc: Dict[str, Any] = json.loads(body)
        return doc

    def status(self) -> _core.Status:
        """Live state: {"sidecar_version", "backend", "scopes": {scope: {...,
        "sources": {source: {...}}}}, ...} (``StatusJson``; new keys pass through)."""
        body = _core.expect(self._request(_core.STATUS_JSON), "StatusJson")
        return _core.status_from_json(body)

    def force_open(self, source: str, seconds: float = 30) -> None:
        """Admin: open ``source``'s breaker for ``seconds``."""
        _core.expect(self._request(_core.force_open(source, seconds)), "Ok")

    def force_close(self, source: str) -> None:
        """Admin: close ``source``'s breaker now (and clear its cooldown memo)."""
        _core.expect(self._request(_core.force_close(source)), "Ok")

    def reset(self, source: str) -> None:
        """Admin: forget all breaker and quota state of ``source``."""
        _core.expect(self._request(_core.reset(source)), "Ok")

    def ping(self) -> float:
        """Round trip to the sidecar; returns the seconds it took."""
        t0 = time.monotonic()
        _core.expect(self._request(_core.PING), "Pong")
        return time.monotonic() - t0

    @property
    def closed(self) -> bool:
        """True once :meth:`close` was called (a lost connection is not closed:
        the next use reconnects)."""
        return self._closed

    def close(self) -> None:
        """Close the connection for good (requests waiting on it fail; later use
        is a ``SidecarError``); the sidecar releases everything it held."""
        with self._lock:
            self._closed = True
            conn, opening = self._conn, self._opening
        if opening is not None:  # a reconnect waiting for Welcome: it fails now
            opening.close()
        conn.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return "<polygate.Client %s sidecar=%s%s>" % (self.path, self.sidecar_version, " closed" if self.closed else "")


def connect(path: Optional[str] = None, *, client_name: Optional[str] = None,
            timeout: Optional[float] = 10.0, autostart: Optional[bool] = None) -> Client:
    """Connect to the sidecar and do the Hello/Welcome handshake.

    ``path``: the socket; default ``$POLYGATE_SOCKET``, else the default for
    this uid (``/run/polygate/sidecar.sock`` for root,
    ``$XDG_RUNTIME_DIR/polygate/sidecar.sock`` for anyone else). ``timeout`` bounds connect + handshake only
    (here and at every reconnect). Raises :class:`SidecarError` (naming the
    path) if it cannot connect, or if the sidecar speaks neither protocol
    version 3 nor 2 (with a version-2 sidecar everything works but tenants,
    which are refused with a clear error). The client reconnects by itself
    after a lost connection.
    ``autostart`` (default ``$POLYGATE_AUTOSTART``): when nothing answers on the
    socket, start the bundled sidecar for it first (DESIGN §20, :mod:`polygate._autostart`),
    and again at any reconnect that finds none (it exited after ``idle_exit``, or
    was killed).
    """
    path = _core.resolve_path(path)
    auto = _autostart.wanted(autostart)
    return Client(_dial(path, client_name, timeout, auto), client_name, timeout, auto)


def _dial(path: str, client_name: Optional[str], timeout: Optional[float], autostart: bool,
          opened: Optional[Callable[[_Connection], None]] = None) -> _Connection:
    """:func:`_open`; with ``autostart``, a connect or handshake that finds no
    sidecar (none there, or one exiting after ``idle_exit`` that reset the
    connection) starts one (:func:`_autostart.ensure`, whose lock makes one of any
    number of concurrent starters) and tries again, within ``timeout`` (10 s if
    None) for the whole."""
    if not autostart:
        return _open(path, client_name, timeout, opened)
    deadline = time.monotonic() + _autostart.bound(timeout)
    tries = 0
    while True:
        try:
            return _open(path, client_name, timeout, opened, gone=True)
        except _autostart.Gone as g:
            left = deadline - time.monotonic()
            if left <= 0:
                raise g.error from None
            if tries:
                time.sleep(min(left, _autostart.POLL))  # a listener still closing: let it go
            tries += 1
            _autostart.ensure(path, left)


def _open(path: str, client_name: Optional[str], timeout: Optional[float],
          opened: Optional[Callable[[_Connection], None]] = None, gone: bool = False) -> _Connection:
    """A new connection with its handshake done (``connect`` and every reconnect);
    ``opened`` learns of the connection before its handshake. ``Hello`` says 3;
    a sidecar that refuses it but speaks 2 (it closes the connection) gets a
    second connection saying 2 (PROTOCOL.md §15). ``gone``: a connect or
    handshake that finds no sidecar raises :class:`_autostart.Gone`."""
    version = _wire.PROTOCOL_VERSION
    while True:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(timeout)
            sock.connect(path)
            sock.settimeout(None)
        except OSError as e:
            sock.close()
            if gone and e.errno in _autostart.GONE:
                raise _autostart.Gone(_core.connect_error(path, e)) from None
            raise _core.connect_error(path, e) from None
        conn = _Connection(sock, path)
        try:
            if opened is not None:
                opened(conn)
            welcome = _core.check_welcome(conn.request(_core.hello(client_name, version), timeout=timeout),
                                          version)
        except _core.VersionFallback as fallback:
            conn.close()
            version = fallback.version
            continue
        except SidecarError as e:
            conn.close()
            if gone and conn.gone:
                raise _autostart.Gone(e) from None
            raise
        except BaseException:
            conn.close()
            raise
        conn.max_frame = welcome["max_frame"]
        conn.welcome = welcome
        return conn
