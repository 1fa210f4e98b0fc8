"""A fake LLM provider for the examples, so they run offline: a stdlib HTTP server in
a thread that answers OpenAI chat completions and Anthropic messages — JSON, or SSE
when the request asks to stream — with usage, like the real APIs.

A request carrying ``x-deployment: NAME`` (the header the example's routes add) is
answered as that deployment; a deployment in ``failing`` answers 503 (with a short
``retry-after-ms``, as OpenAI sends, so the SDK retries soon).
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Dict, Iterable, List, Set


def _sse(events: Iterable[str]) -> bytes:
    return "".join(e + "\n\n" for e in events).encode()


def _openai(who: str, stream: bool) -> "tuple[str, bytes]":
    text = "Hello from %s!" % who
    usage = {"prompt_tokens": 12, "completion_tokens": 6, "total_tokens": 18}
    if not stream:
        return "application/json", json.dumps({
            "id": "chatcmpl-1", "object": "chat.completion", "created": 0, "model": "gpt-4o",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
            "usage": usage}).encode()

    def chunk(delta: Dict[str, Any], u: Any = None) -> str:
        return "data: " + json.dumps({"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 0,
                                      "model": "gpt-4o", "usage": u,
                                      "choices": [] if u else [{"index": 0, "delta": delta, "finish_reason": None}]})
    words = [w + " " for w in text.split()]
    return "text/event-stream", _sse([chunk({"content": w}) for w in words] + [chunk({}, usage), "data: [DONE]"])


def _anthropic(who: str, stream: bool) -> "tuple[str, bytes]":
    text = "Hello from %s!" % who
    if not stream:
        return "application/json", json.dumps({
            "id": "msg_1", "type": "message", "role": "assistant", "model": "claude-sonnet",
            "content": [{"type": "text", "text": text}], "stop_reason": "end_turn", "stop_sequence": None,
            "usage": {"input_tokens": 14, "output_tokens": 7}}).encode()

    def ev(name: str, data: Dict[str, Any]) -> str:
        return "event: %s\ndata: %s" % (name, json.dumps(dict(data, type=name)))
    events: List[str] = [
        ev("message_start", {"message": {"id": "msg_1", "type": "message", "role": "assistant",
                                         "model": "claude-sonnet", "content": [], "stop_reason": None,
                                         "stop_sequence": None, "usage": {"input_tokens": 14, "output_tokens": 1}}}),
        ev("content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}}),
    ]
    events += [ev("content_block_delta", {"index": 0, "delta": {"type": "text_delta", "text": w + " "}})
               for w in text.split()]
    events += [ev("content_block_stop", {"index": 0}),
               ev("message_delta", {"delta": {"stop_reason": "end_turn", "stop_sequence": None},
                                    "usage": {"output_tokens": 7}}),
               ev("message_stop", {})]
    return "text/event-stream", _sse(events)


class FakeProvider:
    """``with FakeProvider() as p: p.url`` — OpenAI at ``p.url + "/v1"``, Anthropic at ``p.url``."""

    def __init__(self, failing: Iterable[str] = ()) -> None:
        self.failing: Set[str] = set(failing)
        self.hits: Dict[str, int] = {}  # deployment → requests received
        provider = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers.get("content-length") or 0)) or b"{}")
                who = self.headers.get("x-deployment") or "the fake provider"
                provider.hits[who] = provider.hits.get(who, 0) + 1
                if who in provider.failing:
                    status, ctype, data = 503, "application/json", json.dumps(
                        {"error": {"message": who + " is overloaded", "type": "server_error"}}).encode()
                    extra = {"retry-after-ms": "50"}
                else:
                    answer = _anthropic if self.path.endswith("/messages") else _openai
                    status, extra = 200, {}
                    ctype, data = answer(who, bool(body.get("stream")))
                self.send_response(status)
                self.send_header("content-type", ctype)
                self.send_header("content-length", str(len(data)))
                for k, v in extra.items():
                    self.send_header(k, v)
                self.end_headers()
                self.wfile.write(data)

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.url = "http://127.0.0.1:%d" % self._server.server_address[1]

    def __enter__(self) -> "FakeProvider":
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._server.shutdown()
        self._server.server_close()
