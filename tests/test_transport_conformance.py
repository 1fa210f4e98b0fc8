"""Transport conformance scenarios (DESIGN §17, `bindings/conformance/README.md`,
"Transport scenarios") played by the Python transports against the real daemon and
fake upstreams: ``polygate.httpx.Transport`` under a sync ``httpx.Client``, and
``polygate.httpx2.AsyncTransport`` under an ``httpx2.AsyncClient`` (one shared
implementation, two libraries, both modes). The Node and Go runners play the same
files.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import uuid
from typing import Any, Dict, List, Optional, Tuple

import pytest

httpx = pytest.importorskip("httpx")
httpx2 = pytest.importorskip("httpx2")

import polygate  # noqa: E402
import polygate.httpx  # noqa: E402
import polygate.httpx2  # noqa: E402

from .fake_upstream import FakeUpstream, Reply  # noqa: E402
from .polygate_e2e import REPO, RedisServer  # noqa: E402
from .test_conformance import Mismatch, check_keys, match_value, sidecar_config  # noqa: E402

SCENARIOS = REPO / "bindings" / "conformance" / "transport"

TOP_KEYS = {"name", "description", "backends", "timeout_s", "config", "upstreams", "transport", "steps"}
TRANSPORT_KEYS = {"scope", "upstream", "base_path", "routes", "on_refusal", "tenant"}
ROUTE_KEYS = {"upstream", "path", "headers", "query", "model"}
OPS: Dict[str, Tuple[set, set]] = {
    "respond": ({"upstream", "status"}, {"headers", "json", "sse", "body", "delay_s", "times"}),
    "request": ({"method", "path"}, {"json", "headers", "stream", "read_events", "expect"}),
    "upstream_hits": ({"upstream", "expect"}, {"header", "header_absent", "path", "json_subset"}),
    "status": ({"expect"}, set()),
    "sleep": ({"seconds"}, set()),
}
EXPECT_KEYS = {"status", "headers", "retry_after_range", "json_subset", "body_unchanged", "error"}
ERROR_KINDS = {
    "CircuitOpen": polygate.CircuitOpenError,
    "AllSourcesExhausted": polygate.AllSourcesExhausted,
    "RouteMissing": polygate.RouteMissingError,
    "TenantLimited": polygate.TenantLimitExceeded,
}
FLAVOURS = ("httpx-sync", "httpx2-async")


def load_scenarios() -> List[Dict[str, Any]]:
    files = sorted(SCENARIOS.glob("*.json"))
    if not files:
        raise RuntimeError("no transport scenarios in %s" % SCENARIOS)
    out = []
    for f in files:
        sc = json.loads(f.read_text())
        sc["_file"] = f.name
        out.append(sc)
    return out


def _params() -> List[Any]:
    ps = []
    for sc in load_scenarios():
        for backend in sc.get("backends", ["memory"]):
            # every flavour on memory; Redis once (the backend's rules are the contract suite's)
            for flavour in FLAVOURS if backend == "memory" else FLAVOURS[:1]:
                ps.append(pytest.param(sc, backend, flavour, id="%s-%s-%s" % (sc["name"], backend, flavour)))
    return ps


# ------------------------------------------------------------------ checks


def polygate_error(exc: BaseException) -> Optional[BaseException]:
    """The PolyGate error an HTTP library may have wrapped."""
    seen = set()
    e: Optional[BaseException] = exc
    while e is not None and id(e) not in seen:
        if isinstance(e, polygate.PolyGateError):
            return e
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return None


def json_subset(want: Any, got: Any, where: str) -> None:
    if isinstance(want, dict):
        if not isinstance(got, dict):
            raise Mismatch("%s: expected an object, got %r" % (where, got))
        for k, w in want.items():
            if k not in got:
                raise Mismatch("%s: key %r missing (have %s)" % (where, k, sorted(got)))
            json_subset(w, got[k], "%s.%s" % (where, k))
    elif want != got:
        raise Mismatch("%s: expected %r, got %r" % (where, want, got))


class Seen:
    """What the caller got for one request."""

    def __init__(self, status: int = 0, headers: Optional[Dict[str, str]] = None, body: bytes = b"",
                 error: Optional[BaseException] = None) -> None:
        self.status = status
        self.headers = headers or {}
        self.body = body
        self.error = error


def check_request(expect: Dict[str, Any], seen: Seen, sent: Optional[bytes], where: str) -> None:
    check_keys(expect, EXPECT_KEYS, where + ".expect")
    if "error" in expect:
        want = expect["error"]
        check_keys(want, {"kind", "reason", "message_contains"}, where + ".expect.error")
        if seen.error is None:
            raise Mismatch("%s: expected error %r, got status %d" % (where, want, seen.status))
        err = polygate_error(seen.error)
        cls = ERROR_KINDS.get(want["kind"])
        if cls is None:
            raise Mismatch("%s: unknown error kind %r" % (where, want["kind"]))
        if not isinstance(err, cls):
            raise Mismatch("%s: expected %s, got %r" % (where, want["kind"], seen.error))
        if "reason" in want and getattr(err, "reason", None) != want["reason"]:
            raise Mismatch("%s: reason %r, expected %r" % (where, getattr(err, "reason", None), want["reason"]))
        if "message_contains" in want and want["message_contains"] not in str(err):
            raise Mismatch("%s: message %r lacks %r" % (where, str(err), want["message_contains"]))
        return
    if seen.error is not None:
        raise Mismatch("%s: the request raised %s: %s" % (where, type(seen.error).__name__, seen.error)) \
            from seen.error
    if "status" in expect and seen.status != expect["status"]:
        raise Mismatch("%s: status %d, expected %d (body %r)" % (where, seen.status, expect["status"], seen.body[:300]))
    for k, v in expect.get("headers", {}).items():
        got = seen.headers.get(k.lower())
        if got != v:
            raise Mismatch("%s: header %r is %r, expected %r" % (where, k, got, v))
    if "retry_after_range" in expect:
        lo, hi = expect["retry_after_range"]
        ra = seen.headers.get("retry-after")
        try:
            v = float(ra) if ra is not None else math.nan
        except ValueError:
            v = math.nan
        if not lo <= v <= hi:
            raise Mismatch("%s: Retry-After %r not within [%s, %s]" % (where, ra, lo, hi))
    if "json_subset" in expect:
        try:
            doc = json.loads(seen.body)
        except ValueError:
            raise Mismatch("%s: body is not JSON: %r" % (where, seen.body[:300])) from None
        json_subset(expect["json_subset"], doc, where + ".json")
    if expect.get("body_unchanged"):
        if sent is None:
            raise Mismatch("%s: no upstream answered this request" % where)
        if seen.body != sent:
            raise Mismatch("%s: body changed:\n upstream %r\n caller   %r" % (where, sent[:500], seen.body[:500]))


def reply_of(step: Dict[str, Any]) -> Reply:
    headers = dict(step.get("headers") or {})
    kw = {"delay_s": step.get("delay_s", 0.0)}
    given = [k for k in ("json", "sse", "body") if k in step]
    if len(given) > 1:
        raise Mismatch("respond: give one of json / sse / body, not %s" % given)
    if "sse" in step:
        return Reply.sse(step["sse"], step["status"], headers, **kw)
    if "body" in step:
        return Reply(step["status"], headers, step["body"].encode(), **kw)
    return Reply.json(step.get("json", {"ok": True}), step["status"], headers, **kw)


def count_events(data: bytes) -> int:
    return data.replace(b"\r\n", b"\n").count(b"\n\n")


# ------------------------------------------------------------------ requesters


class SyncRequester:
    def __init__(self, base_url: str, tr: Any) -> None:
        # follow_redirects: as the SDKs' clients do (openai and anthropic set it)
        self.client = httpx.Client(base_url=base_url, transport=tr, timeout=20, follow_redirects=True)

    def request(self, step: Dict[str, Any]) -> Seen:
        kw: Dict[str, Any] = {"json": step["json"]} if "json" in step else {}
        if "headers" in step:
            kw["headers"] = step["headers"]
        try:
            with self.client.stream(step["method"], step["path"], **kw) as r:
                body = b""
                n = step.get("read_events")
                for chunk in r.iter_raw():
                    body += chunk
                    if n is not None and count_events(body) >= n:
                        break
                return Seen(r.status_code, {k.lower(): v for k, v in r.headers.items()}, body)
        except Exception as e:
            return Seen(error=e)

    def close(self) -> None:
        self.client.close()


class AsyncRequester:
    def __init__(self, base_url: str, tr: Any, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.client = httpx2.AsyncClient(base_url=base_url, transport=tr, timeout=20, follow_redirects=True)

    async def _request(self, step: Dict[str, Any]) -> Seen:
        kw: Dict[str, Any] = {"json": step["json"]} if "json" in step else {}
        if "headers" in step:
            kw["headers"] = step["headers"]
        try:
            async with self.client.stream(step["method"], step["path"], **kw) as r:
                body = b""
                n = step.get("read_events")
                async for chunk in r.aiter_raw():
                    body += chunk
                    if n is not None and count_events(body) >= n:
                        break
                return Seen(r.status_code, {k.lower(): v for k, v in r.headers.items()}, body)
        except Exception as e:
            return Seen(error=e)

    def request(self, step: Dict[str, Any]) -> Seen:
        return self.loop.run_until_complete(self._request(step))

    def close(self) -> None:
        self.loop.run_until_complete(self.client.aclose())


# ------------------------------------------------------------------ playing


def check_scenario(sc: Dict[str, Any]) -> None:
    where = sc["_file"]
    check_keys({k: 1 for k in sc if k != "_file"}, TOP_KEYS, where)
    check_keys(sc["transport"], TRANSPORT_KEYS, where + ".transport")
    ups = set(sc["upstreams"])
    if sc["transport"]["upstream"] not in ups:
        raise Mismatch("%s: transport.upstream %r is not in upstreams" % (where, sc["transport"]["upstream"]))
    for src, r in (sc["transport"].get("routes") or {}).items():
        check_keys(r, ROUTE_KEYS, "%s.routes.%s" % (where, src))
        if r["upstream"] not in ups:
            raise Mismatch("%s: route %r names an unknown upstream" % (where, src))
    for i, step in enumerate(sc["steps"]):
        op = step.get("op")
        if op not in OPS:
            raise Mismatch("%s step %d: unknown op %r" % (where, i, op))
        required, optional = OPS[op]
        missing = required - set(step)
        if missing:
            raise Mismatch("%s step %d: missing %s" % (where, i, sorted(missing)))
        check_keys(step, required | optional | {"op"}, "%s step %d" % (where, i))
        if op in ("respond", "upstream_hits") and step["upstream"] not in ups:
            raise Mismatch("%s step %d: unknown upstream %r" % (where, i, step["upstream"]))
        if op == "request":
            check_keys(step.get("expect", {}), EXPECT_KEYS, "%s step %d expect" % (where, i))
        if op == "sleep" and step["seconds"] > 2:
            raise Mismatch("%s step %d: sleeps are at most 2 s" % (where, i))


def play(sc: Dict[str, Any], label: str, socket_path: str, flavour: str) -> None:
    check_scenario(sc)
    log: List[Tuple[str, bytes]] = []
    ups = {name: FakeUpstream(name, log).start() for name in sc["upstreams"]}
    status_client = polygate.connect(socket_path)
    loop = asyncio.new_event_loop() if flavour == "httpx2-async" else None
    req: Any = None
    try:
        spec = sc["transport"]
        routes = None
        if spec.get("routes"):
            routes = {}
            for src, r in spec["routes"].items():
                routes[src] = {"base_url": ups[r["upstream"]].url + r.get("path", ""), "headers": r.get("headers", {})}
                routes[src].update({k: r[k] for k in ("query", "model") if k in r})
        kw = dict(routes=routes, on_refusal=spec.get("on_refusal", "response"), socket=socket_path,
                  tenant=spec.get("tenant"))
        base_url = ups[spec["upstream"]].url + spec.get("base_path", "")
        if loop is None:
            req = SyncRequester(base_url, polygate.httpx.Transport(spec["scope"], **kw))
        else:
            req = AsyncRequester(base_url, polygate.httpx2.AsyncTransport(spec["scope"], **kw), loop)
        import time

        deadline = time.monotonic() + sc.get("timeout_s", 30)
        for i, step in enumerate(sc["steps"]):
            if time.monotonic() > deadline:
                raise Mismatch("%s: exceeded its time limit of %ss" % (label, sc.get("timeout_s", 30)))
            op = step["op"]
            where = "%s step %d (%s)" % (label, i, op)
            if op == "respond":
                ups[step["upstream"]].queue(reply_of(step), step.get("times", 1))
            elif op == "request":
                before = len(log)
                seen = req.request(step)
                sent = log[-1][1] if len(log) > before else None
                check_request(step.get("expect", {}), seen, sent, where)
            elif op == "upstream_hits":
                up = ups[step["upstream"]]
                if up.hits != step["expect"]:
                    raise Mismatch("%s: upstream %r got %d requests, expected %d"
                                   % (where, step["upstream"], up.hits, step["expect"]))
                if "header" in step:
                    got = up.received[-1].headers
                    for k, v in step["header"].items():
                        if got.get(k.lower()) != v:
                            raise Mismatch("%s: last request's header %r is %r, expected %r"
                                           % (where, k, got.get(k.lower()), v))
                if "header_absent" in step and not up.received:
                    raise Mismatch("%s: header_absent, but upstream %r received no request" % (where, step["upstream"]))
                for k in step.get("header_absent", ()):
                    if k.lower() in up.received[-1].headers:
                        raise Mismatch("%s: last request carries header %r (%r), which must not be sent"
                                       % (where, k, up.received[-1].headers[k.lower()]))
                if "path" in step and up.received[-1].path != step["path"]:
                    raise Mismatch("%s: last request's path is %r, expected %r"
                                   % (where, up.received[-1].path, step["path"]))
                if "json_subset" in step:
                    last = up.received[-1]
                    clen = last.headers.get("content-length")
                    if clen is not None and int(clen) != len(last.body):
                        raise Mismatch("%s: last request's Content-Length %s, its body %d bytes"
                                       % (where, clen, len(last.body)))
                    try:
                        doc = json.loads(last.body)
                    except ValueError:
                        raise Mismatch("%s: last request's body is not JSON: %r" % (where, last.body[:300])) from None
                    json_subset(step["json_subset"], doc, where + ".json")
            elif op == "status":
                match_value(step["expect"], status_client.status(), where + " status")
            elif op == "sleep":
                time.sleep(step["seconds"])
    finally:
        if req is not None:
            req.close()
        if loop is not None:
            loop.close()
        status_client.close()
        for up in ups.values():
            up.stop()


def test_transport_scenarios_are_well_formed():
    names = set()
    for sc in load_scenarios():
        assert sc["name"] + ".json" == sc["_file"]
        assert sc["name"] not in names
        names.add(sc["name"])
        check_scenario(sc)


@pytest.mark.parametrize("scenario,backend,flavour", _params())
def test_transport_conformance(scenario, backend, flavour, sidecar, tmp_path):
    label = "transport scenario %s [%s, %s]" % (scenario["name"], backend, flavour)
    own = {"socket": json.dumps(sidecar.socket), "admin_uids": "[%d]" % os.getuid(), "shutdown_grace": '"1s"'}
    redis = None
    if backend == "redis":
        redis = RedisServer(tmp_path / "redis")
        redis.start()
        own["backend"] = '"redis"'
        own["redis_url"] = json.dumps("redis://127.0.0.1:%d/0" % redis.port)
        own["key_prefix"] = json.dumps("tconf-" + uuid.uuid4().hex[:12])
        own["redis_timeout"] = '"2s"'
    else:
        own["backend"] = '"memory"'
    try:
        sidecar.config_path.write_text(sidecar_config(scenario["config"], own))
        sidecar.start(timeout=10)
        play(scenario, label, sidecar.socket, flavour)
    finally:
        sidecar.stop()
        if redis is not None:
            redis.kill()
