"""A fake LLM provider for the transport tests (DESIGN §17): a stdlib HTTP/1.1
server on 127.0.0.1 in a thread, answering from a queue of canned responses —
JSON bodies (``Content-Length``), SSE streams (chunked, one write per event,
optionally spaced out in time), any status and headers — and recording what it
received (count, headers and body of every request).

An empty queue answers ``200 {"ok": true}``. ``Reply.hold_s`` keeps a stream open
after its events (to test abandoned streams: the client closes first).
"""

from __future__ import annotations

import json
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Deque, Dict, List, Optional, Tuple


@dataclass
class Reply:
    """One canned response."""

    status: int = 200
    headers: Dict[str, str] = field(default_factory=dict)
    body: bytes = b""
    events: Optional[List[bytes]] = None
    """SSE: each item is written (and flushed) as one chunk; None: a plain body."""
    delay_s: float = 0.0
    """Wait this long before answering (a slow upstream)."""
    event_delay_s: float = 0.0
    """Wait this long between SSE events."""
    hold_s: float = 0.0
    """Keep the stream open this long after the last event (before ending it)."""

    @classmethod
    def json(cls, doc: Any, status: int = 200, headers: Optional[Dict[str, str]] = None, **kw: Any) -> "Reply":
        h = {"content-type": "application/json"}
        h.update(headers or {})
        return cls(status, h, json.dumps(doc, separators=(",", ":")).encode(), **kw)

    @classmethod
    def sse(cls, events: List[str], status: int = 200, headers: Optional[Dict[str, str]] = None,
            **kw: Any) -> "Reply":
        h = {"content-type": "text/event-stream"}
        h.update(headers or {})
        return cls(status, h, b"", [(e + "\n\n").encode() for e in events], **kw)

    def sent_body(self) -> bytes:
        return b"".join(self.events) if self.events is not None else self.body


@dataclass
class Received:
    method: str
    path: str
    headers: Dict[str, str]  # lower-case names
    body: bytes


class FakeUpstream:
    """``start()`` → ``url``; ``queue(reply, times=1)``; ``hits``, ``received``."""

    def __init__(self, name: str = "upstream", log: Optional[List[Tuple[str, bytes]]] = None) -> None:
        self.name = name
        self._queue: Deque[Reply] = deque()
        self._lock = threading.Lock()
        self.received: List[Received] = []
        self.log = log if log is not None else []  # (name, body sent) of every answer, shared between upstreams
        self.server: Optional[ThreadingHTTPServer] = None
        self._thread: Optional[threading.Thread] = None
        self.closed_early = threading.Event()  # a client closed a stream before its end

    def queue(self, reply: Reply, times: int = 1) -> None:
        with self._lock:
            for _ in range(times):
                self._queue.append(reply)

    @property
    def hits(self) -> int:
        with self._lock:
            return len(self.received)

    @property
    def url(self) -> str:
        assert self.server is not None
        return "http://127.0.0.1:%d" % self.server.server_address[1]

    def start(self) -> "FakeUpstream":
        upstream = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def _serve(self) -> None:
                n = int(self.headers.get("content-length") or 0)
                body = self.rfile.read(n) if n else b""
                with upstream._lock:
                    upstream.received.append(Received(self.command, self.path,
                                                      {k.lower(): v for k, v in self.headers.items()}, body))
                    reply = upstream._queue.popleft() if upstream._queue else Reply.json({"ok": True})
                    upstream.log.append((upstream.name, reply.sent_body()))
                if reply.delay_s:
                    time.sleep(reply.delay_s)
                try:
                    self.send_response(reply.status)
                    for k, v in reply.headers.items():
                        self.send_header(k, v)
                    if reply.events is None:
                        self.send_header("content-length", str(len(reply.body)))
                        self.end_headers()
                        self.wfile.write(reply.body)
                        return
                    self.send_header("transfer-encoding", "chunked")
                    self.end_headers()
                    for i, ev in enumerate(reply.events):
                        if i and reply.event_delay_s:
                            time.sleep(reply.event_delay_s)
                        self.wfile.write(b"%x\r\n%s\r\n" % (len(ev), ev))
                        self.wfile.flush()
                    if reply.hold_s:
                        time.sleep(reply.hold_s)
                    self.wfile.write(b"0\r\n\r\n")
                    self.wfile.flush()
                except (BrokenPipeError, ConnectionResetError):
                    upstream.closed_early.set()
                    self.close_connection = True

            do_GET = do_POST = do_PUT = do_DELETE = _serve

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self._thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05},
                                        daemon=True, name="fake-upstream-" + self.name)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None

    def __enter__(self) -> "FakeUpstream":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()
