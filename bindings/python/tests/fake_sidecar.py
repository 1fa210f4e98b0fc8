"""A fake PolyGate sidecar speaking the real wire format (via polygate._wire).

Thread-per-connection on a Unix socket. Default behaviour models a tiny
sidecar (scopes with sources, grants on the first source); tests override
``on_acquire`` (and friends) to script other answers, and inspect
``received`` to see exactly what the client sent.
"""

from __future__ import annotations

import itertools
import json
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


def source_status(name: str, state: str = "closed") -> Dict[str, Any]:
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
        self.version = 0  # the protocol version its Hello said

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
            body = self.held.pop(rid, None)
            if body is None:
                return False
        self.send(rid, self.server._after_acquire(body, reply))
        return True

    def close(self) -> None:
        self.closed = True
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


class FakeSidecar:
    def __init__(self, path: str, scopes: Optional[Dict[str, List[str]]] = None,
                 max_frame: int = 65536, version: str = "0.1.0-fake", protocol_version: int = 3) -> None:
        self.path = path
        self.scopes = scopes or {"chat": ["src-a", "src-b"], "embedding": ["emb-1"]}
        self.max_frame = max_frame
        self.version = version
        self.protocol_version = protocol_version
        self.lock = threading.Condition()
        self.received: List[Tuple[int, Dict[str, Any]]] = []
        self.payloads: List[bytes] = []  # every frame's payload as it arrived, in order
        self.conns: List[FakeConn] = []
        self._call_ids = itertools.count(100)
        self._permit_ids = itertools.count(500)
        self.attempts: Dict[int, int] = {}
        self.calls: Dict[int, str] = {}  # live calls: id -> scope
        self.tenants: Dict[int, str] = {}  # calls begun by StartTenant / BeginTenant: id -> tenant
        self.permits: Dict[int, int] = {}  # granted permits: id -> call
        # Hooks: return a reply value, or HOLD (on_acquire only).
        self.on_acquire: Callable[[FakeConn, int, int], Any] = self.grant
        self.on_admin: Optional[Callable[[FakeConn, int, Any], Any]] = None
        self.on_cancel: Optional[Callable[[FakeConn, int, int], None]] = None
        # StartTenant / BeginTenant: (conn, rid, spec, tenant) -> a reply that ends
        # the call at once (e.g. tenant_limited(...)), or None to go on as Start / Begin.
        self.on_tenant: Optional[Callable[[FakeConn, int, Dict[str, Any], str], Any]] = None
        # When set, a Hello is answered only once this event is set (a slow handshake).
        self.hello_gate: Optional[threading.Event] = None
        self._listener: Optional[socket.socket] = None

    # ------------------------------------------------------------ lifecycle

    def start(self) -> "FakeSidecar":
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.bind(self.path)
        s.listen(64)
        self._listener = s
        threading.Thread(target=self._accept_loop, name="fake-sidecar", daemon=True).start()
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
            threading.Thread(target=self._serve, args=(conn,), name="fake-sidecar", daemon=True).start()

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
            self.permits[permit] = call
        return {"Granted": {"permit": permit, "source": source or self.scopes[scope][0],
                            "is_probe": is_probe, "attempt": attempt, "est_tokens": 1000}}

    def status_report(self) -> Dict[str, Any]:
        """The StatusJson document (as the sidecar's JSON, before the client reshapes it)."""
        return {"sidecar_version": self.version, "backend": "memory", "protocol_version": 2,
                "future_key": {"ignored": True},
                "scopes": [
                    {"name": name, "circuit_open": "fail_fast", "quota_full": "wait", "waiters": 0, "calls": 0,
                     "sources": [source_status(s, "half_open" if i else "closed") for i, s in enumerate(srcs)]}
                    for name, srcs in self.scopes.items()]}

    def _after_acquire(self, held: Dict[str, Any], reply: Any) -> Any:
        """A Start is answered Started (its Granted with the call id); a Start or
        Retry answered with an error leaves no call, like the real sidecar."""
        if held.get("kind") in ("start", "retry"):
            name = _name(reply)
            with self.lock:
                if name == "Granted" and held["kind"] == "start":
                    return {"Started": dict(reply["Granted"], call=held["call"])}
                if name == "Error":
                    self.calls.pop(held["call"], None)
        return reply

    def _acquire(self, conn: FakeConn, rid: int, call: int, kind: str) -> Any:
        reply = self.on_acquire(conn, rid, call)
        held = {"call": call, "kind": kind}
        if reply is HOLD:
            with self.lock:
                conn.held[rid] = held
                self.lock.notify_all()
            return HOLD
        return self._after_acquire(held, reply)

    def _new_call(self, spec: Dict[str, Any]) -> Any:
        if spec["scope"] not in self.scopes:
            return error("UnknownScope", "unknown scope %r" % spec["scope"], scope=spec["scope"])
        if spec.get("priority") is not None:
            return error("InvalidArgument", "scope %r has no priority classes; omit priority" % spec["scope"],
                         scope=spec["scope"])
        cid = next(self._call_ids)
        with self.lock:
            self.calls[cid] = spec["scope"]
        return cid

    def tenant_status_report(self, tenant: str, scope: Optional[str]) -> Dict[str, Any]:
        """The TenantStatus document (a stand-in with the real one's outer shape)."""
        with self.lock:
            in_flight = sum(1 for c, t in self.tenants.items() if t == tenant and c in self.calls)
        return {"tenant": tenant, "scopes": {
            name: {"limits": {"tpm": 1000}, "in_flight": in_flight, "waiting": 0, "spend_usd": {"day": 0.5}}
            for name in self.scopes if scope is None or name == scope}}

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
                        self.payloads.append(payload)
                        self.lock.notify_all()
                    self._handle(conn, frame)
        except (OSError, _wire.WireError):
            pass
        finally:
            conn.close()
            conn.sock.close()  # the fd too: tests count the process's fds
            with self.lock:
                conn.held.clear()
                self.lock.notify_all()

    def _handle(self, conn: FakeConn, frame: Dict[str, Any]) -> None:
        rid, req = frame["id"], frame["request"]
        name = _name(req)
        body = req[name] if isinstance(req, dict) else None
        if name == "Hello":
            if self.hello_gate is not None:
                self.hello_gate.wait(30)
            theirs = body["protocol_version"]
            if not 1 <= theirs <= self.protocol_version:
                # what a version-1 / version-2 sidecar says (and then it closes the connection)
                speaks = ("version 1" if self.protocol_version == 1
                          else "versions 1 to %d" % self.protocol_version)
                conn.send(rid, error("ProtocolViolation", "protocol version mismatch: client %r speaks version "
                                     "%d, this sidecar speaks %s" % (body["client_name"], theirs, speaks)))
                conn.close()
                return
            conn.version = theirs
            reply = {"Welcome": {"protocol_version": theirs,
                                 "sidecar_version": self.version, "max_frame": self.max_frame}}
        elif conn.version < 3 and _needs_v3(name, body):
            # like the sidecar: a version-3 message on an older connection
            reply = error("InvalidArgument", "%s needs protocol version 3; this connection speaks %d"
                          % (name, conn.version))
        elif name in ("StartTenant", "BeginTenant"):
            refused = self.on_tenant(conn, rid, body["spec"], body["tenant"]) if self.on_tenant else None
            if refused is not None:
                reply = refused
            else:
                cid = self._new_call(dict({"priority": None}, **body["spec"]))
                if isinstance(cid, int):
                    with self.lock:
                        self.tenants[cid] = body["tenant"]
                if not isinstance(cid, int):
                    reply = cid
                elif name == "BeginTenant":
                    reply = {"CallBegun": {"call": cid}}
                else:
                    reply = self._acquire(conn, rid, cid, "start")
        elif name == "TenantStatus":
            reply = {"StatusJson": json.dumps(self.tenant_status_report(body["tenant"], body["scope"]))}
        elif name in ("BeginCall", "Begin"):
            cid = self._new_call(dict({"priority": None}, **body))
            reply = {"CallBegun": {"call": cid}} if isinstance(cid, int) else cid
        elif name == "Start":
            cid = self._new_call(body)
            reply = cid if not isinstance(cid, int) else self._acquire(conn, rid, cid, "start")
        elif name == "Acquire":
            reply = self._acquire(conn, rid, body["call"], "acquire")
        elif name in ("Report", "Retry", "Finish"):
            with self.lock:
                call = self.permits.pop(body["permit"], None)
                if call is not None and name == "Finish":
                    self.calls.pop(call, None)
            if call is None:
                reply = error("UnknownPermit", "no permit %d on this connection" % body["permit"])
            elif name == "Retry":
                reply = self._acquire(conn, rid, call, "retry")
            else:
                reply = {"Reported": {"applied": True, "state": "Closed", "retry_after_s": 0.0}}
        elif name == "EndCall":
            with self.lock:
                known = self.calls.pop(body["call"], None) is not None
                # like the sidecar: an unreported permit of the call is abandoned
                for pid in [k for k, c in self.permits.items() if c == body["call"]]:
                    del self.permits[pid]
            reply = "Ok" if known else error("UnknownCall", "no call %d on this connection" % body["call"])
        elif name == "StatusJson":
            reply = {"StatusJson": json.dumps(self.status_report())}
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
        if reply is not HOLD:
            conn.send(rid, reply)


def _needs_v3(name: str, body: Any) -> bool:
    if name in ("StartTenant", "BeginTenant", "TenantStatus"):
        return True
    return isinstance(body, dict) and "outcome" in body and _name(body["outcome"]) == "SuccessCached"


def tenant_limited(tenant: str, limit: str, *, retry_after_s: float = 0.0,
                   reasons: Tuple[Tuple[str, str], ...] = (), scope: Optional[str] = None,
                   message: str = "") -> Dict[str, Any]:
    """A ``Reply::TenantLimited`` (v3): the tenant's refusal."""
    err = error("TenantLimited", message or "tenant %r is over its %s limit" % (tenant, limit),
                retry_after_s=retry_after_s, reasons=reasons, scope=scope)["Error"]
    return {"TenantLimited": {"error": err, "tenant": tenant, "limit": limit}}


def _name(value: Any) -> str:
    return value if isinstance(value, str) else next(iter(value))
