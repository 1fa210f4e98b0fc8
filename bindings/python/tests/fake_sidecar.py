"""A fake PolyGate sidecar speaking the real wire format (via polygate._wire).

Thread-per-connection on a Unix socket. Default behaviour models a tiny
sidecar (scopes with sources, grants on the first source); tests override
``on_acquire`` (and friends) to script other answers, and inspect
``received`` to see exactly what the client sent.
"""

from __future__ import annotations

import itertools
import os
import socket
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

from polygate import _wire

HOLD = object()  # an on_acquire result: answer later (or on Cancel)


def error(kind: str, message: str = "", *, retry_after_s: float = 0.0,
          reasons: Tuple[Tuple[str, str], ...] = (), exhausted: Optional[str] = None,
          scope: Optional[str] = None) -> Dict[str, Any]:
    return {"Error": {
        "kind": kind,
        "message": message or "fake %s" % kind,
        "retry_after_s": retry_after_s,
        "per_source_reasons": [list(r) for r in reasons],
        "exhausted": exhausted,
        "scope": scope,
    }}


def source_status(name: str, state: str = "Closed") -> Dict[str, Any]:
    return {
        "name": name, "state": state, "epoch": 3, "retry_after_s": 0.0, "cooldown_level": 0,
        "window_successes": 10, "window_failures": 1, "streak": 0, "memo_remaining_s": 0.0,
        "pacer_ceiling": 8.0, "in_flight": 0, "tokens_available": 29000.5,
        "requests_available": None, "quota_blocked_s": 0.0, "degraded": False,
    }


class FakeConn:
    def __init__(self, server: "FakeSidecar", sock: socket.socket, index: int) -> None:
        self.server = server
        self.sock = sock
        self.index = index
        self.send_lock = threading.Lock()
        self.held: Dict[int, Dict[str, Any]] = {}  # request id -> Acquire body
        self.closed = False

    def send(self, rid: int, reply: Any) -> None:
        data = _wire.frame(_wire.encode_server_frame({"id": rid, "reply": reply}))
        with self.send_lock:
            if not self.closed:
                try:
                    self.sock.sendall(data)
                except OSError:
                    pass

    def send_raw(self, data: bytes) -> None:
        with self.send_lock:
            self.sock.sendall(data)

    def release_held(self, rid: int, reply: Any) -> bool:
        with self.server.lock:
            if self.held.pop(rid, None) is None:
                return False
        self.send(rid, reply)
        return True

    def close(self) -> None:
        self.closed = True
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


class FakeSidecar:
    def __init__(self, path: str, scopes: Optional[Dict[str, List[str]]] = None,
                 max_frame: int = 65536, version: str = "0.1.0-fake", protocol_version: int = 1) -> None:
        self.path = path
        self.scopes = scopes or {"chat": ["src-a", "src-b"], "embedding": ["emb-1"]}
        self.max_frame = max_frame
        self.version = version
        self.protocol_version = protocol_version
        self.lock = threading.Condition()
        self.received: List[Tuple[int, Dict[str, Any]]] = []
        self.conns: List[FakeConn] = []
        self._call_ids = itertools.count(100)
        self._permit_ids = itertools.count(500)
        self.attempts: Dict[int, int] = {}
        self.calls: Dict[int, str] = {}
        # Hooks: return a reply value, or HOLD (on_acquire only).
        self.on_acquire: Callable[[FakeConn, int, int], Any] = self.grant
        self.on_admin: Optional[Callable[[FakeConn, int, Any], Any]] = None
        self.on_cancel: Optional[Callable[[FakeConn, int, int], None]] = None
        self._listener: Optional[socket.socket] = None

    # ------------------------------------------------------------ lifecycle

    def start(self) -> "FakeSidecar":
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.bind(self.path)
        s.listen(64)
        self._listener = s
        threading.Thread(target=self._accept_loop, daemon=True).start()
        return self

    def stop(self) -> None:
        if self._listener is not None:
            try:
                self._listener.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self._listener.close()
            self._listener = None
        self.drop_all()
        try:
            os.unlink(self.path)
        except OSError:
            pass

    def drop_all(self) -> None:
        """Close every client connection (the sidecar 'dies' for them)."""
        for c in list(self.conns):
            c.close()

    def _accept_loop(self) -> None:
        while True:
            listener = self._listener
            if listener is None:
                return
            try:
                sock, _ = listener.accept()
            except OSError:
                return
            with self.lock:
                conn = FakeConn(self, sock, len(self.conns))
                self.conns.append(conn)
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    # ------------------------------------------------------------ inspection

    def requests(self, variant: Optional[str] = None) -> List[Dict[str, Any]]:
        """Received frames (optionally only those of one request variant)."""
        with self.lock:
            frames = [f for _, f in self.received]
        if variant is None:
            return frames
        return [f for f in frames if _name(f["request"]) == variant]

    def wait_for(self, predicate: Callable[[], bool], timeout: float = 5.0) -> None:
        deadline = time.monotonic() + timeout
        with self.lock:
            while not predicate():
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError("fake sidecar: condition not met within %ss; received %r"
                                         % (timeout, [f["request"] for _, f in self.received][-10:]))
                self.lock.wait(left)

    def held_count(self) -> int:
        return sum(len(c.held) for c in self.conns)

    def wait_held(self, n: int, timeout: float = 10.0) -> None:
        self.wait_for(lambda: self.held_count() >= n, timeout)

    def release_all_held(self, make_reply: Callable[[FakeConn, int, int], Any]) -> int:
        n = 0
        for c in list(self.conns):
            with self.lock:
                items = list(c.held.items())
            for rid, body in items:
                if c.release_held(rid, make_reply(c, rid, body["call"])):
                    n += 1
        return n

    # ------------------------------------------------------------ behaviour

    def grant(self, conn: FakeConn, rid: int, call: int, source: Optional[str] = None,
              is_probe: bool = False) -> Any:
        with self.lock:
            scope = self.calls.get(call)
            if scope is None:
                return error("UnknownCall", "no call %d on this connection" % call)
            self.attempts[call] = self.attempts.get(call, 0) + 1
            attempt = self.attempts[call]
            permit = next(self._permit_ids)
        return {"Granted": {"permit": permit, "source": source or self.scopes[scope][0],
                            "is_probe": is_probe, "attempt": attempt, "est_tokens": 1000}}

    def status_report(self) -> Dict[str, Any]:
        return {"Status": {"sidecar_version": self.version, "backend": "memory", "scopes": [
            {"name": name, "circuit_open": "fail_fast", "quota_full": "wait", "waiters": 0,
             "calls": 0, "sources": [source_status(s, "HalfOpen" if i else "Closed") for i, s in enumerate(srcs)]}
            for name, srcs in self.scopes.items()]}}

    def _serve(self, conn: FakeConn) -> None:
        dec = _wire.FrameDecoder(self.max_frame)
        try:
            while True:
                data = conn.sock.recv(65536)
                if not data:
                    break
                for payload in dec.feed(data):
                    frame = _wire.decode_client_frame(payload)
                    with self.lock:
                        self.received.append((conn.index, frame))
                        self.lock.notify_all()
                    self._handle(conn, frame)
        except (OSError, _wire.WireError):
            pass
        finally:
            conn.close()
            with self.lock:
                conn.held.clear()
                self.lock.notify_all()

    def _handle(self, conn: FakeConn, frame: Dict[str, Any]) -> None:
        rid, req = frame["id"], frame["request"]
        name = _name(req)
        body = req[name] if isinstance(req, dict) else None
        if name == "Hello":
            reply = {"Welcome": {"protocol_version": self.protocol_version,
                                 "sidecar_version": self.version, "max_frame": self.max_frame}}
        elif name == "BeginCall":
            if body["scope"] not in self.scopes:
                reply = error("UnknownScope", "unknown scope %r" % body["scope"], scope=body["scope"])
            else:
                cid = next(self._call_ids)
                with self.lock:
                    self.calls[cid] = body["scope"]
                reply = {"CallBegun": {"call": cid}}
        elif name == "Acquire":
            reply = self.on_acquire(conn, rid, body["call"])
            if reply is HOLD:
                with self.lock:
                    conn.held[rid] = body
                    self.lock.notify_all()
                return
        elif name == "Report":
            reply = {"Reported": {"applied": True, "state": "Closed", "retry_after_s": 0.0}}
        elif name == "EndCall":
            with self.lock:
                self.calls.pop(body["call"], None)
            reply = "Ok"
        elif name == "Status":
            reply = self.status_report()
        elif name in ("ForceOpen", "ForceClose", "Reset"):
            reply = self.on_admin(conn, rid, req) if self.on_admin else "Ok"
        elif name == "Ping":
            reply = "Pong"
        elif name == "Cancel":
            if self.on_cancel is not None:
                self.on_cancel(conn, rid, body["target"])
            else:
                conn.release_held(body["target"], error("Cancelled", "cancelled by request %d" % rid))
            reply = "Ok"
        else:  # pragma: no cover
            reply = error("Internal", "fake cannot handle %s" % name)
        conn.send(rid, reply)


def _name(value: Any) -> str:
    return value if isinstance(value, str) else next(iter(value))
