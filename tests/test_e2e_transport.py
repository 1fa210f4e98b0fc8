"""End-to-end: the HTTP transports (DESIGN §17) under the real SDKs — ``openai``
through ``polygate.httpx``, ``anthropic`` through ``polygate.httpx2`` — against the
real daemon and a fake upstream speaking OpenAI and Anthropic JSON, SSE and
rate-limit headers (tests/fake_upstream.py). The SDKs are test-only dependencies.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from typing import Any, Dict

import pytest

httpx = pytest.importorskip("httpx")
httpx2 = pytest.importorskip("httpx2")
openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")

import polygate  # noqa: E402
import polygate.aio  # noqa: E402
import polygate.httpx  # noqa: E402
import polygate.httpx2  # noqa: E402

from .fake_upstream import FakeUpstream, Reply  # noqa: E402
from .polygate_e2e import scope, wait_until  # noqa: E402

pytestmark = pytest.mark.timeout(60)

MESSAGES = [{"role": "user", "content": "Say hello."}]


def chat_body(prompt: int = 20, completion: int = 10, cached: int = 0) -> Dict[str, Any]:
    return {"id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": "gpt-test",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "Hello!"},
                         "finish_reason": "stop"}],
            "usage": {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                      "prompt_tokens_details": {"cached_tokens": cached}}}


def chunk(content: Any = None, usage: Any = None) -> str:
    d = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "gpt-test",
         "choices": [] if usage else [{"index": 0, "delta": {"content": content}, "finish_reason": None}],
         "usage": usage}
    return "data: " + json.dumps(d)


OPENAI_STREAM = [chunk("Hel"), chunk("lo"), chunk("!"),
                 chunk(usage={"prompt_tokens": 20, "completion_tokens": 3, "total_tokens": 23}), "data: [DONE]"]


def anthropic_stream() -> list:
    def ev(name: str, data: Dict[str, Any]) -> str:
        return "event: %s\ndata: %s" % (name, json.dumps(data))
    return [
        ev("message_start", {"type": "message_start", "message": {
            "id": "msg_1", "type": "message", "role": "assistant", "model": "claude-test", "content": [],
            "stop_reason": None, "stop_sequence": None, "usage": {"input_tokens": 25, "output_tokens": 1}}}),
        ev("content_block_start", {"type": "content_block_start", "index": 0,
                                   "content_block": {"type": "text", "text": ""}}),
        ev("content_block_delta", {"type": "content_block_delta", "index": 0,
                                   "delta": {"type": "text_delta", "text": "Hello"}}),
        ev("content_block_stop", {"type": "content_block_stop", "index": 0}),
        ev("message_delta", {"type": "message_delta", "delta": {"stop_reason": "end_turn", "stop_sequence": None},
                             "usage": {"output_tokens": 15}}),
        ev("message_stop", {"type": "message_stop"}),
    ]


@pytest.fixture
def upstream():
    with FakeUpstream("a") as up:
        yield up


def start(sidecar, **src: Any):
    """A daemon with scope chat, one source ``a`` (tpm 6000 unless given)."""
    source = {"name": "a", "timeout": "5s", "tpm": 6000, "est_output_tokens": 10}
    source.update(src.pop("source", {}))
    sidecar.write_config({"chat": scope(source, **src)})
    sidecar.start()
    return sidecar.client()


def src(pg, name: str = "a") -> Dict[str, Any]:
    return pg.status()["scopes"]["chat"]["sources"][name]


def calls(pg) -> int:
    return pg.status()["scopes"]["chat"]["calls"]


def oai(up: FakeUpstream, sock: str, **kw: Any) -> Any:
    tkw = {k: kw.pop(k) for k in ("routes", "on_refusal") if k in kw}
    return openai.OpenAI(api_key="sk-test", base_url=up.url + "/v1",
                         http_client=polygate.httpx.client("chat", socket=sock, **tkw), **kw)


# ------------------------------------------------------------------ openai, sync


def test_openai_success_settles_the_usage_not_the_estimate(sidecar, upstream):
    pg = start(sidecar)
    upstream.queue(Reply.json(chat_body(prompt=40, completion=10, cached=15)))
    client = oai(upstream, sidecar.socket, max_retries=0)
    r = client.chat.completions.create(model="gpt-test", messages=MESSAGES, max_tokens=3000)
    assert r.choices[0].message.content == "Hello!"  # the body reached the SDK unchanged
    assert r.usage.total_tokens == 50
    s = src(pg)
    # charged 50 (the usage), not ~3030 (max_tokens + body/4)
    assert 5900 <= s["tokens_available"] <= 6000, s
    assert s["window_successes"] == 1 and s["in_flight"] == 0
    assert calls(pg) == 0
    assert upstream.hits == 1
    assert upstream.received[0].headers["authorization"] == "Bearer sk-test"  # no routes: sent as the SDK sent it


def test_slow_request_shows_its_estimate_reserved(sidecar, upstream):
    pg = start(sidecar)
    upstream.queue(Reply.json(chat_body(), delay_s=1.5))
    client = oai(upstream, sidecar.socket, max_retries=0)
    done = threading.Event()
    t = threading.Thread(target=lambda: (client.chat.completions.create(
        model="gpt-test", messages=MESSAGES, max_tokens=3000), done.set()), daemon=True)
    t.start()
    s = wait_until(lambda: (lambda s: s if s["in_flight"] == 1 else None)(src(pg)), 5, what="the request in flight")
    # reserved: output 3000 (max_tokens, not the source's est_output_tokens 10) + the body's bytes / 4
    assert 2750 <= s["tokens_available"] <= 3100, s
    assert calls(pg) == 1
    t.join(10)
    assert done.is_set()
    s = src(pg)
    assert s["in_flight"] == 0 and s["tokens_available"] >= 5900, s


def test_429_blocks_the_source_and_leaves_the_breaker_closed(sidecar, upstream):
    pg = start(sidecar, breaker={"failure_threshold": 1})
    upstream.queue(Reply.json({"error": {"message": "Rate limit", "type": "requests"}}, 429,
                              {"retry-after": "2", "x-ratelimit-remaining-requests": "0"}))
    client = oai(upstream, sidecar.socket, max_retries=0)
    with pytest.raises(openai.RateLimitError) as ei:
        client.chat.completions.create(model="gpt-test", messages=MESSAGES, max_tokens=100)
    assert ei.value.response.headers["retry-after"] == "2"  # the upstream's own response
    s = src(pg)
    assert s["state"] == "closed" and s["streak"] == 0 and s["window_failures"] == 0, s
    assert 1.0 <= s["quota_blocked_s"] <= 2.01, s
    assert s["in_flight"] == 0 and calls(pg) == 0


def test_5xx_opens_the_breaker_and_the_next_request_gets_a_synthetic_503(sidecar, upstream):
    pg = start(sidecar, breaker={"failure_threshold": 1, "cooldown": "30s"})
    upstream.queue(Reply.json({"error": {"message": "boom", "type": "server_error"}}, 500))
    client = oai(upstream, sidecar.socket, max_retries=0)
    with pytest.raises(openai.InternalServerError) as ei:
        client.chat.completions.create(model="gpt-test", messages=MESSAGES, max_tokens=100)
    assert ei.value.status_code == 500 and ei.value.body["message"] == "boom"
    assert src(pg)["state"] == "open"
    with pytest.raises(openai.APIStatusError) as ei:
        client.chat.completions.create(model="gpt-test", messages=MESSAGES, max_tokens=100)
    e = ei.value
    assert e.status_code == 503
    assert 28 <= int(e.response.headers["retry-after"]) <= 30
    assert e.body["type"] == "polygate" and e.body["code"] == "circuit_open", e.body  # openai unwraps "error"
    assert "PolyGate" in e.body["message"]
    assert upstream.hits == 1  # the refused request never reached the upstream
    assert calls(pg) == 0 and src(pg)["in_flight"] == 0
    # With the SDK's retries on, the refusal is final too (x-should-retry: false):
    # openai would otherwise sleep out the ~30 s Retry-After before each retry.
    retrying = oai(upstream, sidecar.socket, max_retries=2)
    t0 = time.monotonic()
    with pytest.raises(openai.APIStatusError) as ei:
        retrying.chat.completions.create(model="gpt-test", messages=MESSAGES, max_tokens=100)
    assert ei.value.status_code == 503 and time.monotonic() - t0 < 5
    assert ei.value.response.headers["x-should-retry"] == "false"


def test_on_refusal_raise_raises_the_polygate_error(sidecar, upstream):
    pg = start(sidecar)
    pg.force_open("a", seconds=30)
    client = oai(upstream, sidecar.socket, max_retries=0, on_refusal="raise")
    with pytest.raises(polygate.CircuitOpenError) as ei:  # the SDK lets a non-HTTP error through
        client.chat.completions.create(model="gpt-test", messages=MESSAGES)
    assert ei.value.retry_after_s > 25 and ei.value.per_source_reasons == {"a": "circuit_open"}
    assert upstream.hits == 0


def test_the_sdks_own_retries_are_admitted_one_by_one(sidecar, upstream):
    pg = start(sidecar, breaker={"failure_threshold": 10})
    err = Reply.json({"error": {"message": "boom"}}, 500, {"retry-after-ms": "10"})
    upstream.queue(err, times=2)
    upstream.queue(Reply.json(chat_body()))
    client = oai(upstream, sidecar.socket, max_retries=2)
    r = client.chat.completions.create(model="gpt-test", messages=MESSAGES, max_tokens=100)
    assert r.usage.total_tokens == 30
    assert upstream.hits == 3
    s = src(pg)
    # three calls, each admitted and reported: two failures, then a success
    assert s["window_failures"] == 2 and s["window_successes"] == 1 and s["streak"] == 0, s
    assert s["in_flight"] == 0 and calls(pg) == 0


def test_routes_fail_over_from_a_to_b_with_bs_headers(sidecar):
    with FakeUpstream("sdk") as sdk, FakeUpstream("a") as a, FakeUpstream("b") as b:
        sidecar.write_config({"chat": scope("a", "b", breaker={"failure_threshold": 1})})
        sidecar.start()
        pg = sidecar.client()
        a.queue(Reply.json({"error": {"message": "down"}}, 503, {"retry-after-ms": "10"}))
        b.queue(Reply.json(chat_body()))
        # a route's base URL replaces scheme, host and port; the request's path is kept
        routes = {"a": {"base_url": a.url, "headers": {"authorization": "Bearer key-a"}},
                  "b": {"base_url": b.url, "headers": {"authorization": "Bearer key-b"}}}
        # The SDK's base URL is a placeholder: routes decide where each attempt goes.
        client = openai.OpenAI(api_key="unused", base_url=sdk.url + "/v1", max_retries=1,
                               http_client=polygate.httpx.client("chat", socket=sidecar.socket, routes=routes))
        r = client.chat.completions.create(model="gpt-test", messages=MESSAGES)
        assert r.choices[0].message.content == "Hello!"
        assert sdk.hits == 0
        assert a.hits == 1 and b.hits == 1
        assert a.received[0].headers["authorization"] == "Bearer key-a"
        assert b.received[0].headers["authorization"] == "Bearer key-b"
        assert b.received[0].path == "/v1/chat/completions"
        assert b.received[0].headers["host"] == b.url.split("//")[1]
        assert json.loads(b.received[0].body)["messages"] == MESSAGES
        st = pg.status()["scopes"]["chat"]
        assert st["sources"]["a"]["state"] == "open" and st["sources"]["b"]["window_successes"] == 1
        assert st["calls"] == 0


def test_routes_with_the_sdks_own_base_url_fail_over_to_another_base_path(sidecar):
    """Issue 29: the SDK points at ``http://h/a/v1`` and ``routes`` names the same base
    URL for ``a`` and ``http://h/b/v1`` for ``b``; the retry granted ``b`` goes to
    ``/b/v1/chat/completions`` (not ``/b/v1/a/v1/chat/completions``)."""
    with FakeUpstream("h") as h:
        sidecar.write_config({"chat": scope("a", "b", breaker={"failure_threshold": 1})})
        sidecar.start()
        pg = sidecar.client()
        h.queue(Reply.json({"error": {"message": "down"}}, 503, {"retry-after-ms": "10"}))
        h.queue(Reply.json(chat_body()))
        routes = {"a": {"base_url": h.url + "/a/v1", "headers": {"authorization": "Bearer key-a"}},
                  "b": {"base_url": h.url + "/b/v1", "headers": {"authorization": "Bearer key-b"}}}
        client = openai.OpenAI(api_key="unused", base_url=h.url + "/a/v1", max_retries=1,
                               http_client=polygate.httpx.client("chat", socket=sidecar.socket, routes=routes))
        r = client.chat.completions.create(model="gpt-test", messages=MESSAGES)
        assert r.choices[0].message.content == "Hello!"
        assert [x.path for x in h.received] == ["/a/v1/chat/completions", "/b/v1/chat/completions"]
        assert [x.headers["authorization"] for x in h.received] == ["Bearer key-a", "Bearer key-b"]
        assert src(pg, "b")["window_successes"] == 1 and calls(pg) == 0


def test_an_azure_route_sets_query_and_model_under_the_openai_sdk_streaming(sidecar):
    """An Azure OpenAI deployment as the granted route: the deployment path, the
    route's ``api-version`` and ``model`` (the body otherwise as the SDK wrote it,
    Content-Length following it); the stream is settled with its usage."""
    with FakeUpstream("openai") as o, FakeUpstream("azure") as az:
        sidecar.write_config({"chat": scope("openai", {"name": "azure", "timeout": "5s", "tpm": 6000},
                                            breaker={"failure_threshold": 1})})
        sidecar.start()
        pg = sidecar.client()
        o.queue(Reply.json({"error": {"message": "down"}}, 503, {"retry-after-ms": "10"}))
        az.queue(Reply.sse(OPENAI_STREAM))
        routes = {"openai": {"base_url": o.url + "/v1"},
                  "azure": {"base_url": az.url + "/openai/deployments/gpt4o-eu", "headers": {"api-key": "AZ"},
                            "query": {"api-version": "2024-10-21"}, "model": "gpt-4o-eu-prod"}}
        client = openai.OpenAI(api_key="unused", base_url=o.url + "/v1", max_retries=1,
                               http_client=polygate.httpx.client("chat", socket=sidecar.socket, routes=routes))
        stream = client.chat.completions.create(model="gpt-4o", messages=MESSAGES, max_tokens=1500, stream=True,
                                                stream_options={"include_usage": True})
        text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        assert text == "Hello!"
        (got,) = az.received
        assert got.path == "/openai/deployments/gpt4o-eu/chat/completions?api-version=2024-10-21"
        assert got.headers["api-key"] == "AZ" and int(got.headers["content-length"]) == len(got.body)
        sent = json.loads(o.received[0].body)
        assert sent["model"] == "gpt-4o"
        assert json.loads(got.body) == dict(sent, model="gpt-4o-eu-prod")  # only the model changed
        wait_until(lambda: calls(pg) == 0, 5, what="the stream settled")
        s = src(pg, "azure")
        assert s["window_successes"] == 1 and s["in_flight"] == 0
        assert s["tokens_available"] >= 5900  # the usage (23), not the estimate (1,500+)


def test_a_route_missing_for_the_granted_source_fails_before_sending(sidecar, upstream):
    pg = start(sidecar)
    client = oai(upstream, sidecar.socket, max_retries=0,
                 routes={"b": {"base_url": upstream.url, "headers": {}}})
    with pytest.raises(polygate.RouteMissingError) as ei:
        client.chat.completions.create(model="gpt-test", messages=MESSAGES)
    assert ei.value.source == "a" and '"a"' in str(ei.value)
    assert upstream.hits == 0
    s = src(pg)
    assert s["in_flight"] == 0 and s["streak"] == 0 and s["tokens_available"] >= 5900
    assert calls(pg) == 0


def test_a_stream_is_counted_in_flight_while_open_and_charged_its_final_usage(sidecar, upstream):
    pg = start(sidecar)
    upstream.queue(Reply.sse(OPENAI_STREAM, event_delay_s=0.2))
    client = oai(upstream, sidecar.socket, max_retries=0)
    stream = client.chat.completions.create(model="gpt-test", messages=MESSAGES, max_tokens=3000, stream=True,
                                            stream_options={"include_usage": True})
    it = iter(stream)
    first = next(it)
    assert first.choices[0].delta.content == "Hel"
    s = src(pg)
    assert s["in_flight"] == 1 and s["tokens_available"] <= 3200, s  # held, with its estimate
    assert calls(pg) == 1
    rest = list(it)
    assert rest[-1].usage.total_tokens == 23  # the usage chunk reached the SDK too
    s = src(pg)
    assert s["in_flight"] == 0 and s["tokens_available"] >= 5900 and s["window_successes"] == 1, s
    assert calls(pg) == 0


def test_an_abandoned_stream_is_settled_within_a_second(sidecar, upstream):
    pg = start(sidecar)
    upstream.queue(Reply.sse(OPENAI_STREAM[:1], hold_s=10))  # one event, then silence
    client = oai(upstream, sidecar.socket, max_retries=0)
    stream = client.chat.completions.create(model="gpt-test", messages=MESSAGES, max_tokens=3000, stream=True)
    next(iter(stream))
    assert src(pg)["in_flight"] == 1
    t0 = time.monotonic()
    stream.close()
    wait_until(lambda: src(pg)["in_flight"] == 0 and calls(pg) == 0, 1.0, what="the abandoned stream settled")
    assert time.monotonic() - t0 < 1.0
    s = src(pg)
    assert s["state"] == "closed" and s["streak"] == 0, s  # abandoning is not the upstream's failure


def test_transport_errors_are_transient_failures(sidecar, upstream):
    pg = start(sidecar, breaker={"failure_threshold": 10}, pacer={"initial": 8})
    dead = FakeUpstream("dead").start()
    url = dead.url
    dead.stop()  # nothing listens there now: connection refused
    client = openai.OpenAI(api_key="k", base_url=url + "/v1", max_retries=0,
                           http_client=polygate.httpx.client("chat", socket=sidecar.socket))
    with pytest.raises(openai.APIConnectionError):
        client.chat.completions.create(model="gpt-test", messages=MESSAGES, max_tokens=3000)
    s = src(pg)
    assert s["streak"] == 1 and s["pacer_ceiling"] == 8 and s["tokens_available"] >= 5900, s  # refunded
    upstream.queue(Reply.json(chat_body(), delay_s=2))
    client = oai(upstream, sidecar.socket, max_retries=0, timeout=0.3)
    with pytest.raises(openai.APITimeoutError):
        client.chat.completions.create(model="gpt-test", messages=MESSAGES, max_tokens=3000)
    s = src(pg)
    # a timeout: the streak grows and the pacer's ceiling halves (a connection error leaves it)
    assert s["streak"] == 2 and s["pacer_ceiling"] == 4 and s["in_flight"] == 0, s
    assert calls(pg) == 0


def test_a_dropped_stream_is_settled_by_the_safety_net(sidecar, upstream):
    """Closing is the contract (the SDKs close what they abandon); a response
    dropped unclosed is settled too, when it is garbage-collected — here with
    plain httpx (sync) and httpx2 (asyncio), which do not close it for you."""
    import gc

    pg = start(sidecar)
    upstream.queue(Reply.sse(OPENAI_STREAM[:1], hold_s=10), times=2)
    body = {"model": "gpt-test", "messages": MESSAGES, "max_tokens": 3000, "stream": True}
    hc = polygate.httpx.client("chat", socket=sidecar.socket, base_url=upstream.url)
    r = hc.send(hc.build_request("POST", "/v1/chat/completions", json=body), stream=True)
    it = r.iter_raw()
    next(it)
    assert src(pg)["in_flight"] == 1
    del it, r
    gc.collect()
    wait_until(lambda: src(pg)["in_flight"] == 0 and calls(pg) == 0, 1.0, what="the dropped stream settled")

    async def main() -> None:
        ac = polygate.httpx2.async_client("chat", socket=sidecar.socket, base_url=upstream.url)
        r = await ac.send(ac.build_request("POST", "/v1/chat/completions", json=body), stream=True)
        it = r.aiter_raw()
        await it.__anext__()
        assert src(pg)["in_flight"] == 1
        del it, r
        t0 = time.monotonic()
        while src(pg)["in_flight"] != 0 and time.monotonic() - t0 < 1.0:
            gc.collect()
            await asyncio.sleep(0.02)  # the loop finalizes the suspended async generator, then it is garbage
        assert src(pg)["in_flight"] == 0 and calls(pg) == 0

    asyncio.run(main())


def test_a_chunked_json_body_is_settled_when_the_sdk_has_read_it(sidecar, upstream):
    """A JSON body of unknown length (chunked) is passed through as a stream and
    settled at its end; one with a Content-Length is read whole by the transport
    first. Both settle the usage."""
    pg = start(sidecar)
    body = json.dumps(chat_body(prompt=11, completion=9)).encode()
    upstream.queue(Reply(200, {"content-type": "application/json"}, events=[body[:40], body[40:]]))
    client = oai(upstream, sidecar.socket, max_retries=0)
    r = client.chat.completions.create(model="gpt-test", messages=MESSAGES, max_tokens=3000)
    assert r.usage.total_tokens == 20
    s = src(pg)
    assert s["in_flight"] == 0 and s["tokens_available"] >= 5950 and s["window_successes"] == 1, s
    assert calls(pg) == 0


def test_a_base_transport_that_reads_the_body_itself_is_settled_at_once(sidecar):
    """httpx.MockTransport (or a caching transport) returns a response already read
    and closed: the transport settles it before returning (nothing would close it)."""
    pg = start(sidecar)

    def handler(request):
        assert json.loads(request.content)["max_tokens"] == 3000
        return httpx.Response(200, json=chat_body(prompt=7, completion=3))

    hc = polygate.httpx.client("chat", socket=sidecar.socket, base=httpx.MockTransport(handler))
    r = hc.post("http://mock/v1/chat/completions", json={"model": "m", "max_tokens": 3000, "messages": MESSAGES})
    assert r.json()["usage"]["total_tokens"] == 10
    s = src(pg)
    assert s["in_flight"] == 0 and s["window_successes"] == 1 and s["tokens_available"] >= 5950, s
    assert calls(pg) == 0


# ------------------------------------------------------------------ anthropic (httpx2)


def ant(up: FakeUpstream, sock: str, **kw: Any) -> Any:
    return anthropic.Anthropic(api_key="sk-ant-test", base_url=up.url, max_retries=0,
                               http_client=polygate.httpx2.client("chat", socket=sock), **kw)


def test_anthropic_message_settles_its_usage(sidecar, upstream):
    pg = start(sidecar)
    upstream.queue(Reply.json({"id": "msg_1", "type": "message", "role": "assistant", "model": "claude-test",
                               "content": [{"type": "text", "text": "Hello."}], "stop_reason": "end_turn",
                               "stop_sequence": None,
                               "usage": {"input_tokens": 12, "cache_read_input_tokens": 500, "output_tokens": 8}}))
    client = ant(upstream, sidecar.socket)
    m = client.messages.create(model="claude-test", max_tokens=3000, messages=MESSAGES)
    assert m.content[0].text == "Hello." and m.usage.output_tokens == 8
    s = src(pg)
    assert 5950 <= s["tokens_available"] <= 6000, s  # 20 charged (cache reads are not input), not ~3000
    assert upstream.received[0].headers["authorization"] == "Bearer sk-ant-test"
    assert "anthropic-version" in upstream.received[0].headers
    assert calls(pg) == 0


def test_anthropic_stream_settles_message_start_and_delta_usage(sidecar, upstream):
    pg = start(sidecar)
    upstream.queue(Reply.sse(anthropic_stream(), event_delay_s=0.1))
    client = ant(upstream, sidecar.socket)
    texts = []
    with client.messages.stream(model="claude-test", max_tokens=3000, messages=MESSAGES) as stream:
        for text in stream.text_stream:
            texts.append(text)
            assert src(pg)["in_flight"] == 1
        final = stream.get_final_message()
    assert texts == ["Hello"] and final.usage.output_tokens == 15
    s = src(pg)
    assert s["in_flight"] == 0 and s["tokens_available"] >= 5950 and s["window_successes"] == 1, s
    assert calls(pg) == 0


def test_anthropic_routes_replace_the_sdks_base_url_on_failover(sidecar):
    """Issue 29.1 under the anthropic SDK: its base URL (``http://h/a``, a gateway
    path; the SDK adds ``/v1/messages``) is route ``a``'s; the retry granted ``b``
    goes to ``/b/v1/messages`` on b's host with b's key (not ``/b/a/v1/messages``),
    the stream settled on ``b``."""
    with FakeUpstream("h") as h, FakeUpstream("hb") as hb:
        sidecar.write_config({"chat": scope("a", "b", breaker={"failure_threshold": 1})})
        sidecar.start()
        pg = sidecar.client()
        h.queue(Reply.json({"type": "error", "error": {"type": "overloaded_error", "message": "busy"}}, 529,
                           {"retry-after-ms": "10"}))
        hb.queue(Reply.sse(anthropic_stream()))
        routes = {"a": {"base_url": h.url + "/a", "headers": {"x-api-key": "key-a"}},
                  "b": {"base_url": hb.url + "/b/", "headers": {"x-api-key": "key-b"}}}
        client = anthropic.Anthropic(api_key="unused", base_url=h.url + "/a", max_retries=1,
                                     http_client=polygate.httpx2.client("chat", socket=sidecar.socket, routes=routes))
        with client.messages.stream(model="claude-test", max_tokens=3000, messages=MESSAGES) as stream:
            assert "".join(stream.text_stream) == "Hello"
        assert [x.path for x in h.received] == ["/a/v1/messages"]
        assert [x.path for x in hb.received] == ["/b/v1/messages"]
        assert h.received[0].headers["x-api-key"] == "key-a" and hb.received[0].headers["x-api-key"] == "key-b"
        assert hb.received[0].headers["host"] == hb.url.split("//", 1)[1]
        wait_until(lambda: calls(pg) == 0, 5, what="the stream settled")
        assert src(pg, "a")["state"] == "open"
        s = src(pg, "b")
        assert s["window_successes"] == 1 and s["in_flight"] == 0, s


# ------------------------------------------------------------------ §18: the provider's headers


def bucket(pg, name: str) -> Dict[str, Any]:
    return next(b for b in src(pg)["buckets"] if b["bucket"] == name)


def test_the_transport_reports_openais_rate_limit_headers(sidecar, upstream):
    """DESIGN §18 through §17: no call site sets ``permit.limits``; the transport
    reads the response's ``x-ratelimit-*`` headers and an observing source lowers
    its bucket to what the provider says is left."""
    pg = start(sidecar, source={"observe_limits": "on"})
    upstream.queue(Reply.json(chat_body(), headers={
        "x-ratelimit-limit-tokens": "6000", "x-ratelimit-remaining-tokens": "1000",
        "x-ratelimit-reset-tokens": "20s", "x-ratelimit-limit-requests": "60",
        "x-ratelimit-remaining-requests": "59", "x-ratelimit-reset-requests": "1s"}))
    t0 = time.monotonic()
    oai(upstream, sidecar.socket, max_retries=0).chat.completions.create(
        model="gpt-test", messages=MESSAGES, max_tokens=10)
    tpm = bucket(pg, "tpm")
    assert tpm["observed"]["remaining"] == 1000 and tpm["observed"]["limit"] == 6000, tpm
    # 5970 after the usage of 30 without the headers; the provider says 1000.
    assert tpm["level"] <= 1000 + 100 * (time.monotonic() - t0 + 0.05) + 1, tpm


def test_a_streams_headers_are_dated_when_its_response_began(sidecar, upstream):
    """The observation of a stream is reported when the stream ends, aged by its
    length, so the sidecar dates it when the provider said it (DESIGN §18)."""
    pg = start(sidecar, source={"observe_limits": "on"})
    reset = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() + 30))
    upstream.queue(Reply.sse(anthropic_stream(), event_delay_s=0.15, headers={
        "anthropic-ratelimit-tokens-limit": "6000", "anthropic-ratelimit-tokens-remaining": "2000",
        "anthropic-ratelimit-tokens-reset": reset}))
    client = ant(upstream, sidecar.socket)
    t0 = time.monotonic()
    with client.messages.stream(model="claude-test", max_tokens=100, messages=MESSAGES) as stream:
        final = stream.get_final_message()
    took = time.monotonic() - t0
    assert final.usage.output_tokens == 15 and took >= 0.6, took
    tpm = bucket(pg, "tpm")
    assert tpm["observed"]["remaining"] == 2000, tpm
    # Seen when the headers came (before the ~0.75 s of events), not at the report.
    assert tpm["observed"]["age_s"] >= 0.5, tpm


# ------------------------------------------------------------------ asyncio


def test_async_openai_and_anthropic(sidecar):
    with FakeUpstream("a") as up:
        sidecar.write_config({"chat": scope({"name": "a", "timeout": "5s", "tpm": 6000})})
        sidecar.start()
        pg = sidecar.client()
        up.queue(Reply.json(chat_body(prompt=30, completion=20)))
        up.queue(Reply.sse(OPENAI_STREAM, event_delay_s=0.05))
        up.queue(Reply.sse(anthropic_stream()))

        async def main() -> None:
            oc = openai.AsyncOpenAI(api_key="k", base_url=up.url + "/v1", max_retries=0,
                                    http_client=polygate.httpx.async_client("chat", socket=sidecar.socket))
            r = await oc.chat.completions.create(model="gpt-test", messages=MESSAGES, max_tokens=3000)
            assert r.usage.total_tokens == 50
            stream = await oc.chat.completions.create(model="gpt-test", messages=MESSAGES, max_tokens=3000,
                                                      stream=True, stream_options={"include_usage": True})
            n = 0
            async for _ in stream:
                n += 1
                if n == 1:
                    assert src(pg)["in_flight"] == 1
            assert n == 4
            ac = anthropic.AsyncAnthropic(api_key="k", base_url=up.url, max_retries=0,
                                          http_client=polygate.httpx2.async_client("chat", socket=sidecar.socket))
            async with ac.messages.stream(model="claude-test", max_tokens=3000, messages=MESSAGES) as s:
                final = await s.get_final_message()
            assert final.usage.output_tokens == 15
            await oc.close()
            await ac.close()

        asyncio.run(main())
        s = src(pg)
        # 50 + 23 + 40 charged, not three estimates of ~3000
        assert s["tokens_available"] >= 5800 and s["window_successes"] == 3 and s["in_flight"] == 0, s
        assert calls(pg) == 0


# ------------------------------------------------------------------ the README's example


def test_readme_transport_example_runs_as_written(sidecar):
    import os
    import subprocess
    import sys

    from .polygate_e2e import REPO

    # The README quick start targets the example config's `chat` scope.
    sidecar.write_config({"chat": scope("openai-gpt4o", "azure-gpt4o-eu", "vllm-llama-local")})
    sidecar.start()
    env = dict(os.environ, POLYGATE_SOCKET=sidecar.socket)
    out = subprocess.run([sys.executable, str(REPO / "examples" / "transport_openai.py")],
                         env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == "Hello from the fake provider!" and lines[1].strip() == "Hello from the fake provider!"
    assert "request 3: Hello from azure-gpt4o-eu!" in lines  # failed over once openai-gpt4o's breaker opened
    assert lines[-1] == ("breakers: {'openai-gpt4o': 'open', 'azure-gpt4o-eu': 'closed', "
                         "'vllm-llama-local': 'closed'}"), out.stdout
    assert sidecar.client().status()["scopes"]["chat"]["calls"] == 0
