#!/usr/bin/env python3
"""The HTTP transport's driver for `polygate-bench --scenario transport` (DESIGN §17, §16).

    python_transport.py --socket PATH --scope SCOPE [--requests N] [--rounds R]
                        [--chunks C] [--streams S]

Measures what ``polygate.httpx.Transport`` adds to an ``httpx.Client`` request, against
a local fake upstream (this file run with ``--serve``, in its own process so that it
takes none of the worker's CPU or GIL), and prints ONE JSON line:

* ``plain_us`` / ``transport_us``: wall time per request (POST of an OpenAI-style chat
  body, a JSON answer with usage; keep-alive) without / with the transport;
* ``run_http_us``: the same plain request made inside the binding's own
  ``client.run(scope, fn)`` — what gating that call site by hand costs today;
  ``run_us``: ``client.run`` around a function that does nothing (for reference);
* ``overhead_us`` = transport − plain, ``run_overhead_us`` = run_http − plain, and
  ``overhead_ratio`` = overhead / run_overhead: the goal is ≤ 1.10 (the transport
  costs no more than ``run()`` + 10 %). ``run()`` alone is not the yardstick: the
  same two sidecar round trips cost more interleaved with HTTP I/O than back to back
  (the sidecar and the worker go idle and are woken between them);
* the same as CPU time of this process per request (``*_cpu_us``,
  ``cpu_overhead_ratio``), which moves less with machine load;
* ``own_cpu_us``: what the transport's own work costs per request — the transport
  with a stand-in PolyGate client that answers at once (estimate, usage read,
  settlement bookkeeping; no sidecar round trips), minus plain;
* ``stream_cpu_plain_ms`` / ``stream_cpu_transport_ms``: this process's CPU to read one
  C-chunk SSE stream (``iter_lines``, as an SDK reads it) without / with the transport,
  and ``stream_cpu_ratio`` = with / without: the goal is ≤ 1.05.

The request kinds run in alternating rounds (R rounds of N/R requests each); each
figure is the median of its rounds, and each difference (``overhead_us``, ...) the
median of the same-round differences, so drift of the machine's load between rounds
cancels out. Streams alternate too (S pairs; the ratio is the median of the pairs'). The sidecar is the caller's (``--socket``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any, Callable, Dict, List, Tuple

try:
    import polygate  # noqa: F401
except ImportError:  # run from a checkout without the package installed
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bindings", "python"))
    import polygate  # noqa: F401

REPLY = json.dumps({
    "id": "chatcmpl-bench", "object": "chat.completion", "created": 0, "model": "gpt-bench",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "Hello! How can I help you today?"},
                 "finish_reason": "stop"}],
    "usage": {"prompt_tokens": 40, "completion_tokens": 9, "total_tokens": 49,
              "prompt_tokens_details": {"cached_tokens": 0}},
}).encode()
BODY = {"model": "gpt-bench", "max_tokens": 100,
        "messages": [{"role": "system", "content": "You are a helpful assistant."},
                     {"role": "user", "content": "Say hello to the benchmark, please. " * 4}]}


def chunk(i: int) -> bytes:
    return b'data: {"id":"chatcmpl-bench","object":"chat.completion.chunk","created":0,"model":"gpt-bench",' \
           b'"choices":[{"index":0,"delta":{"content":"tok%d "},"finish_reason":null}],"usage":null}\n\n' % i


USAGE_CHUNK = b'data: {"id":"chatcmpl-bench","object":"chat.completion.chunk","created":0,"model":"gpt-bench",' \
              b'"choices":[],"usage":{"prompt_tokens":40,"completion_tokens":1000,"total_tokens":1040}}\n\n' \
              b"data: [DONE]\n\n"


def serve() -> None:
    """The fake upstream: prints its port, serves until stdin closes."""
    import socket
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: Any) -> None:
            pass

        def setup(self) -> None:
            super().setup()
            # headers and body are two writes: without this, Nagle + the client's delayed ACK add 40 ms
            self.request.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("content-length") or 0))
            if not self.path.startswith("/v1/stream"):
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(REPLY)))
                self.end_headers()
                self.wfile.write(REPLY)
                return
            n = int(self.path.rsplit("=", 1)[1])
            self.send_response(200)
            self.send_header("content-type", "text/event-stream")
            self.send_header("transfer-encoding", "chunked")
            self.end_headers()
            for i in range(n):
                c = chunk(i)
                self.wfile.write(b"%x\r\n%s\r\n" % (len(c), c))  # one write per event, as a provider streams
            self.wfile.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(USAGE_CHUNK), USAGE_CHUNK))
            self.wfile.flush()

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    srv.daemon_threads = True
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    print(srv.server_address[1], flush=True)
    sys.stdin.read()  # until the driver exits


class _Instant:
    """A stand-in PolyGate client granting at once (``own_cpu_us``)."""

    class _Permit:
        source = "a"

        def success(self, *a: Any, **k: Any) -> None:
            pass

        def failure(self, *a: Any, **k: Any) -> None:
            pass

        def rate_limited(self, *a: Any) -> None:
            pass

        def cancel(self) -> None:
            pass

    class _Call:
        def acquire(self) -> Any:
            return _Instant._Permit()

        def end(self, _quiet: bool = False) -> None:
            pass

    def call(self, *a: Any, **k: Any) -> Any:
        return _Instant._Call()


def timed(fn: Callable[[], Any], n: int) -> Tuple[float, float]:
    """(wall µs, CPU µs) per call of ``fn`` over ``n`` calls."""
    w0, c0 = time.perf_counter(), time.process_time()
    for _ in range(n):
        fn()
    return (time.perf_counter() - w0) * 1e6 / n, (time.process_time() - c0) * 1e6 / n


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--socket")
    ap.add_argument("--scope", default="bench")
    ap.add_argument("--requests", type=int, default=3000)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--chunks", type=int, default=1000)
    ap.add_argument("--streams", type=int, default=20)
    a = ap.parse_args()
    if a.serve:
        serve()
        return
    try:
        import httpx
        import polygate.httpx
    except ImportError as e:
        print(json.dumps({"skipped": "httpx is not installed (%s)" % e}))
        return
    if not a.socket:
        ap.error("--socket is required")

    upstream = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--serve"],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert upstream.stdout is not None
        url = "http://127.0.0.1:%d" % int(upstream.stdout.readline())
        pg = polygate.connect(a.socket)
        plain = httpx.Client(base_url=url)
        gated = httpx.Client(base_url=url, transport=polygate.httpx.Transport(a.scope, client=pg))

        def req(c: Any) -> Callable[[], Any]:
            def one() -> Any:
                r = c.post("/v1/chat/completions", json=BODY)
                if r.status_code != 200:
                    raise SystemExit("request failed: %d %s" % (r.status_code, r.text[:200]))
                return r.json()
            return one

        def run_nothing() -> None:
            pg.run(a.scope, lambda permit: None)

        plain_req = req(plain)

        def run_http() -> None:  # the call site gated by hand: usage reported from the parsed body
            pg.run(a.scope, lambda permit: plain_req())

        own = httpx.Client(base_url=url, transport=polygate.httpx.Transport(a.scope, client=_Instant()))
        kinds: Dict[str, Callable[[], Any]] = {"plain": plain_req, "transport": req(gated), "run_http": run_http,
                                               "run": run_nothing, "own": req(own)}
        for fn in kinds.values():  # warm: connections, caches, the sidecar's first call
            timed(fn, 20)
        per = max(1, a.requests // max(1, a.rounds))
        wall: Dict[str, List[float]] = {k: [] for k in kinds}
        cpu: Dict[str, List[float]] = {k: [] for k in kinds}
        for _ in range(max(1, a.rounds)):
            for k, fn in kinds.items():
                w, c = timed(fn, per)
                wall[k].append(w)
                cpu[k].append(c)
        m = {k: statistics.median(v) for k, v in wall.items()}
        mc = {k: statistics.median(v) for k, v in cpu.items()}

        def stream(c: Any) -> Callable[[], Any]:
            def one() -> None:
                with c.stream("POST", "/v1/stream?n=%d" % a.chunks, json=dict(BODY, stream=True)) as r:
                    n = sum(1 for line in r.iter_lines() if line)
                if n != a.chunks + 2:
                    raise SystemExit("stream: %d lines, expected %d" % (n, a.chunks + 2))
            return one

        sp, st = stream(plain), stream(gated)
        sp(), st()  # warm
        s_plain: List[float] = []
        s_gated: List[float] = []
        for _ in range(max(1, a.streams)):
            s_plain.append(timed(sp, 1)[1])
            s_gated.append(timed(st, 1)[1])
        status = pg.status()["scopes"][a.scope]
        if status["calls"] != 0:
            raise SystemExit("calls left open on the sidecar: %r" % status["calls"])
        def paired(xs: Dict[str, List[float]], k: str) -> float:
            """The median over rounds of (k − plain) in the same round: drift of the
            machine's load between rounds cancels out."""
            return statistics.median(a - b for a, b in zip(xs[k], xs["plain"]))

        overhead, run_overhead = paired(wall, "transport"), paired(wall, "run_http")
        cpu_overhead, run_cpu_overhead = paired(cpu, "transport"), paired(cpu, "run_http")
        sc_plain, sc_gated = statistics.median(s_plain), statistics.median(s_gated)
        stream_ratio = statistics.median(g / p for g, p in zip(s_gated, s_plain) if p > 0)
        out = {
            "requests": per * max(1, a.rounds),
            "plain_us": round(m["plain"], 1),
            "transport_us": round(m["transport"], 1),
            "run_http_us": round(m["run_http"], 1),
            "run_us": round(m["run"], 1),
            "overhead_us": round(overhead, 1),
            "run_overhead_us": round(run_overhead, 1),
            "overhead_ratio": round(overhead / run_overhead, 3) if run_overhead > 0 else None,
            "plain_cpu_us": round(mc["plain"], 1),
            "transport_cpu_us": round(mc["transport"], 1),
            "run_http_cpu_us": round(mc["run_http"], 1),
            "run_cpu_us": round(mc["run"], 1),
            "cpu_overhead_ratio": round(cpu_overhead / run_cpu_overhead, 3) if run_cpu_overhead > 0 else None,
            "own_cpu_us": round(paired(cpu, "own"), 1),
            "chunks": a.chunks,
            "stream_cpu_plain_ms": round(sc_plain / 1000, 3),
            "stream_cpu_transport_ms": round(sc_gated / 1000, 3),
            "stream_cpu_ratio": round(stream_ratio, 3),
        }
        plain.close()
        gated.close()
        own.close()
        pg.close()
        print(json.dumps(out))
    finally:
        upstream.kill()
        upstream.wait()


if __name__ == "__main__":
    main()
