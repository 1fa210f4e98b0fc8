"""The transports' sans-I/O decisions (DESIGN §17, polygate._core.transport):
estimates from request bodies, status → outcome, usage read from JSON bodies and
SSE streams as they pass (in any chunking), refusal responses, routes; and that
``import polygate`` needs no HTTP library."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
import textwrap

import pytest

import polygate
from polygate._core import transport as t


# ---------------------------------------------------------------- estimate


def test_estimate_input_is_body_bytes_over_four_and_output_is_max_tokens():
    body = json.dumps({"model": "m", "max_tokens": 700, "messages": [{"role": "user", "content": "x" * 100}]}).encode()
    assert t.estimate_request(body) == ((len(body) + 3) // 4, 700)
    for key in ("max_completion_tokens", "max_output_tokens"):
        assert t.estimate_request(json.dumps({key: 55, "input": "hi"}).encode())[1] == 55


def test_estimate_without_an_output_limit_leaves_output_to_the_source():
    assert t.estimate_request(b'{"model": "m", "input": "hello"}') == (8, None)
    assert t.estimate_request(b'{"max_tokens": true}')[1] is None  # not a count
    assert t.estimate_request(b'{"max_tokens": -1}')[1] is None
    assert t.estimate_request(b'{"max_tokens": 1.5}')[1] is None
    assert t.estimate_request(b'{"max_tokens": 99999999999}')[1] is None
    assert t.estimate_request(b"not json max_tokens") == (5, None)
    assert t.estimate_request(b"") == (None, None)
    assert t.estimate_request(None) == (None, None)
    # a tool's JSON schema naming the property is not a limit; the real one after it is
    schema = {"tools": [{"parameters": {"properties": {"max_tokens": {"type": "integer"}}}}], "max_tokens": 64}
    assert t.estimate_request(json.dumps(schema).encode())[1] == 64
    # in the prompt's text the key is escaped (\"max_tokens\"), never a match
    text = {"messages": [{"content": json.dumps({"max_tokens": 5})}]}
    assert t.estimate_request(json.dumps(text).encode())[1] is None


def test_check_estimate_rejects_what_is_not_a_pair_of_counts():
    assert t.check_estimate((10, None)) == (10, None)
    with pytest.raises(TypeError):
        t.check_estimate(10)
    with pytest.raises(ValueError):
        t.check_estimate((-1, 2))


# ---------------------------------------------------------------- status → outcome


@pytest.mark.parametrize("status,kind", [(408, "timeout"), (409, "server_error"), (500, "server_error"),
                                         (502, "server_error"), (503, "server_error"), (529, "server_error"),
                                         (400, "error"), (401, "error"), (404, "error"), (422, "error")])
def test_status_outcome(status, kind):
    o = t.status_outcome(status, {})
    assert o is not None and o.kind == kind


@pytest.mark.parametrize("status", [300, 301, 302, 303, 304, 307, 308])
def test_a_3xx_is_an_uncounted_success_with_no_tokens(status):
    """§17 item 4: the source answered (not blamed, as a 4xx error would be) and did
    no work (a redirect's next hop is its own call): the estimate is refunded."""
    o = t.status_outcome(status, {"location": "/v1/x"})
    assert o is not None and o.kind == "rejected" and o.tokens == 0


def test_2xx_is_a_success_and_429_is_rate_limited_with_retry_after_ms_first():
    assert t.status_outcome(200, {}) is None and t.status_outcome(201, {}) is None
    o = t.status_outcome(429, {"Retry-After": "20", "retry-after-ms": "2500"})
    assert o is not None and o.kind == "rate_limited" and o.retry_after_s == 2.5
    o = t.status_outcome(429, {"retry-after": "7"})
    assert o is not None and o.retry_after_s == 7.0
    o = t.status_outcome(429, {})
    assert o is not None and o.kind == "rate_limited" and o.retry_after_s is None


# ---------------------------------------------------------------- usage


def feed_all(reader: t.UsageReader, data: bytes, size: int) -> t.Usage:
    for i in range(0, len(data), size):
        reader.feed(data[i:i + size])
    return reader.usage()


CHAT = json.dumps({"id": "x", "choices": [{"message": {"content": "usage: none here"}}],
                   "usage": {"prompt_tokens": 40, "completion_tokens": 10, "total_tokens": 50,
                             "prompt_tokens_details": {"cached_tokens": 15}}}).encode()


@pytest.mark.parametrize("size", [1, 7, 4096])
def test_json_usage_of_openai_chat_excludes_cached_input_and_counts_it_apart(size):
    assert feed_all(t.UsageReader("application/json"), CHAT, size) == (50, 25, 10, 15)


def test_json_usage_of_responses_embeddings_and_anthropic():
    resp = {"object": "response", "output": [], "usage": {"input_tokens": 40, "output_tokens": 20, "total_tokens": 60,
                                                          "input_tokens_details": {"cached_tokens": 10}}}
    emb = {"object": "list", "data": [{"embedding": [0.5] * 10}], "usage": {"prompt_tokens": 8, "total_tokens": 8}}
    msg = {"type": "message", "usage": {"input_tokens": 12, "cache_read_input_tokens": 100, "output_tokens": 8}}
    for doc, want in ((resp, (60, 30, 20, 10)), (emb, (8, 8, None, None)), (msg, (None, 12, 8, 100))):
        r = t.UsageReader("application/json; charset=utf-8")
        r.feed(json.dumps(doc).encode())
        assert r.usage() == want, doc


def test_json_usage_far_from_the_end_and_in_a_big_body():
    doc = {"usage": {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}, "pad": "x" * 10000}
    r = t.UsageReader("application/json")
    r.feed(json.dumps(doc).encode())
    assert r.usage() == (7, 3, 4, None)  # not in the last 4 KiB: the whole document is read
    big = {"data": [{"embedding": [0.123456] * 200000}], "usage": {"prompt_tokens": 9, "total_tokens": 9}}
    r = t.UsageReader("application/json")
    r.feed(json.dumps(big).encode())
    assert r.usage() == (9, 9, None, None)


def test_gzip_bodies_are_read_and_unknown_encodings_keep_the_estimate():
    r = t.UsageReader("application/json", "gzip")
    assert feed_all(r, gzip.compress(CHAT), 5) == (50, 25, 10, 15)
    r = t.UsageReader("application/json", "br")
    r.feed(b"\x00\x01")
    assert r.usage() == (None, None, None, None)
    r = t.UsageReader("application/json", "gzip")
    r.feed(b"not gzip at all")
    assert r.usage() == (None, None, None, None)
    r = t.UsageReader("application/json")
    r.feed(b"<html>502</html>")
    assert r.usage() == (None, None, None, None)


def test_usage_fast_paths_give_what_the_whole_document_gives():
    """The shortcuts of the whole-body read (no regex for `"usage": {` / `"usage":{`,
    no parse at all for a body without "usage") answer as json.loads of the body."""
    want = (50, 25, 10, 15)
    usage = {"prompt_tokens": 40, "completion_tokens": 10, "total_tokens": 50,
             "prompt_tokens_details": {"cached_tokens": 15}}
    for seps in ((",", ":"), (", ", ": "), (",", " : "), (",", ":\n ")):
        body = json.dumps({"id": "x", "usage": usage}, separators=seps).encode()
        assert t.body_usage(body) == want, body
    assert t.body_usage(json.dumps({"id": "x", "usage": usage}, indent=2).encode()) == want
    # no "usage" in the bytes: nothing to find, unless an escape spells the key ...
    assert t.body_usage(b'{"error": {"message": "bad request"}}') == (None, None, None, None)
    escaped = json.dumps({"usage": usage}).encode().replace(b'"usage"', b'"\\u0075sage"')
    assert b'"usage"' not in escaped and t.body_usage(escaped) == want
    # ... or the body is UTF-16 / UTF-32 (json.loads reads those; the bytes hold no "usage")
    for enc in ("utf-16", "utf-16-le", "utf-16-be", "utf-32", "utf-32-le"):
        body = json.dumps({"usage": usage}).encode(enc)
        assert b'"usage"' not in body and t.body_usage(body) == want, enc
    # "usage": null and a usage that is no object fall back to the whole document, as before
    assert t.body_usage(b'{"usage": null, "response": {"usage": {"input_tokens": 3}}}') == (None, 3, None, None)
    assert t.body_usage(b'{"usage": {"total_tokens": true}, "x": 1}') == (None, None, None, None)
    assert t.body_usage(b'{"usage": {broken') == (None, None, None, None)


def test_is_sse_is_the_same_with_its_cache_full():
    for i in range(100):  # more distinct values than the cache keeps
        assert not t.is_sse("application/json; boundary=%d" % i)
        assert t.is_sse(" Text/Event-Stream ; x=%d" % i)
    assert t.is_sse("text/event-stream") and t.is_sse("TEXT/EVENT-STREAM;charset=utf-8")
    assert not t.is_sse(None) and not t.is_sse("") and not t.is_sse("text/event-streams")


def test_a_whole_body_read_by_the_transport():
    assert t.body_usage(CHAT) == (50, 25, 10, 15)
    assert t.body_usage(gzip.compress(CHAT), "gzip") == (50, 25, 10, 15)
    assert t.body_usage(b"\x00", "br") == (None, None, None, None)
    assert t.body_usage(b"garbage", "gzip") == (None, None, None, None)
    assert t.body_usage(b"") == (None, None, None, None)
    # read whole: a declared length up to 1 MiB and not a stream
    assert t.eager("application/json", "300") and t.eager(None, "0")
    assert not t.eager("application/json", None)  # chunked: passed through as it comes
    assert not t.eager("text/event-stream; charset=utf-8", "300")
    assert not t.eager("application/json", str(2 << 20)) and not t.eager("application/json", "x")


def sse(*events: str) -> bytes:
    return "".join(e + "\n\n" for e in events).encode()


def chunk(usage=None, content="hi") -> str:
    return "data: " + json.dumps({"object": "chat.completion.chunk", "choices": [{"delta": {"content": content}}],
                                  "usage": usage})


OPENAI_SSE = sse(chunk(), chunk(), chunk(usage={"prompt_tokens": 20, "completion_tokens": 3, "total_tokens": 23}),
                 "data: [DONE]")
ANTHROPIC_SSE = sse(
    'event: message_start\ndata: {"type":"message_start","message":{"id":"m","usage":{"input_tokens":25,"cache_read_input_tokens":7,"output_tokens":1}}}',
    'event: content_block_delta\ndata: {"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"usage"}}',
    'event: message_delta\ndata: {"type":"message_delta","delta":{"stop_reason":"end_turn"},"usage":{"output_tokens":15}}',
    'event: message_stop\ndata: {"type":"message_stop"}')
RESPONSES_SSE = sse(
    'event: response.created\ndata: {"type":"response.created","response":{"usage":null}}',
    'event: response.completed\ndata: {"type":"response.completed","response":{"usage":'
    '{"input_tokens":30,"input_tokens_details":{"cached_tokens":5},"output_tokens":12,"total_tokens":42}}}')


@pytest.mark.parametrize("size", [1, 3, 64, 100000])
def test_sse_usage_in_any_chunking(size):
    assert feed_all(t.UsageReader("text/event-stream"), OPENAI_SSE, size) == (23, 20, 3, None)
    assert feed_all(t.UsageReader("text/event-stream; charset=utf-8"), ANTHROPIC_SSE, size) == (None, 25, 15, 7)
    assert feed_all(t.UsageReader("text/event-stream"), RESPONSES_SSE, size) == (42, 25, 12, 5)


def test_an_abandoned_stream_has_what_was_seen():
    r = t.UsageReader("text/event-stream")
    cut = ANTHROPIC_SSE.index(b"event: content_block_delta")
    r.feed(ANTHROPIC_SSE[:cut])
    assert r.usage() == (None, 25, 1, 7)
    r = t.UsageReader("text/event-stream")
    r.feed(sse(chunk(), chunk()))
    assert r.usage() == (None, None, None, None)  # nothing seen: the estimate stays


def test_sse_with_crlf_lines_and_a_gzip_stream():
    r = t.UsageReader("text/event-stream")
    assert feed_all(r, OPENAI_SSE.replace(b"\n", b"\r\n"), 10) == (23, 20, 3, None)
    r = t.UsageReader("text/event-stream", "gzip")
    assert feed_all(r, gzip.compress(ANTHROPIC_SSE), 9) == (None, 25, 15, 7)


# ---------------------------------------------------------------- refusal


def test_refusal_of_an_open_circuit_is_a_503_naming_polygate():
    err = polygate.CircuitOpenError("every source's circuit is open", retry_after_s=9.2,
                                    per_source_reasons={"a": "circuit_open"}, scope="chat")
    status, headers, body = t.refusal(err, "chat")
    h = dict(headers)
    assert status == 503
    assert h["retry-after"] == "10" and h["retry-after-ms"] == "9200" and h["content-type"] == "application/json"
    assert h["x-should-retry"] == "false"
    doc = json.loads(body)["error"]
    assert doc["type"] == "polygate" and doc["code"] == "circuit_open" and doc["scope"] == "chat"
    assert doc["retry_after_s"] == 9.2 and doc["per_source_reasons"] == {"a": "circuit_open"}
    assert "PolyGate" in doc["message"]


@pytest.mark.parametrize("reason,status", [("quota_exhausted", 429), ("stalled", 503), ("retry_exhausted", 503)])
def test_refusal_of_an_exhausted_call(reason, status):
    err = polygate.AllSourcesExhausted("no", reason=reason, retry_after_s=0.0, scope=None)
    st, headers, body = t.refusal(err, "emb")
    assert st == status and dict(headers)["retry-after"] == "0"
    doc = json.loads(body)["error"]
    assert doc["code"] == reason and doc["scope"] == "emb"
    assert "limit_source" not in doc  # only a tenant's refusal names one


def test_refusal_by_a_tenant_is_a_429_naming_the_tenant_and_its_limit():
    err = polygate.TenantLimitExceeded("over", tenant="acme", limit="usd_per_month", retry_after_s=3600.4,
                                       per_source_reasons={"a": "tenant_limited"}, scope="chat")
    status, headers, body = t.refusal(err, "chat")
    h = dict(headers)
    assert status == 429 and h["x-should-retry"] == "false" and h["x-polygate-refusal"] == "tenant_limited"
    assert h["retry-after"] == "3601"
    doc = json.loads(body)["error"]
    assert (doc["limit_source"], doc["tenant"], doc["limit"], doc["code"]) == \
        ("tenant", "acme", "usd_per_month", "tenant_limited")


@pytest.mark.parametrize("bad", [42, b"acme", ["acme"]])
def test_a_tenant_option_is_a_string_or_a_function(bad):
    assert t.check_tenant("acme") == "acme" and t.check_tenant(None) is None
    assert t.check_tenant(len) is len
    with pytest.raises(TypeError, match="tenant must be"):
        t.check_tenant(bad)
    with pytest.raises(ValueError, match="128"):
        t.check_tenant("t" * 129)

    async def coro(request):
        return "acme"
    with pytest.raises(TypeError, match="coroutine"):
        t.check_tenant(coro)


# ---------------------------------------------------------------- routes


def test_routes_parse_and_validate():
    r = t.parse_routes({"a": {"base_url": "https://eu.example.com:8443/openai/", "headers": {"api-key": "K"}},
                        "b": "http://127.0.0.1:9000"})
    assert r is not None
    assert r["a"] == t.Route("https", "eu.example.com", 8443, "/openai", (("api-key", "K"),), (), None)
    assert r["a"].path("/v1/chat") == "/openai/v1/chat"
    assert r["b"].path("/v1/chat") == "/v1/chat" and r["b"].port == 9000
    assert t.parse_routes(None) is None
    for bad, needle in (({}, "non-empty"), ({"a": {"base_url": "ftp://x"}}, "routes['a'].base_url"),
                        ({"a": {"base_url": "http://x", "headers": {"k": 1}}}, "routes['a'].headers"),
                        ({"a": {"base_url": "http://x", "header": {}}}, "unknown key")):
        with pytest.raises(ValueError, match=needle.replace("[", r"\[").replace("]", r"\]")):
            t.parse_routes(bad)


def test_routes_parse_query_and_model():
    r = t.parse_routes({"az": {"base_url": "https://res.openai.azure.com/openai/deployments/d",
                               "query": {"z": "1", "api-version": "2024-10-21"}, "model": "gpt-4o-prod"}})
    assert r is not None
    assert r["az"].query == (("api-version", "2024-10-21"), ("z", "1")) and r["az"].model == "gpt-4o-prod"
    assert r["az"].origin() == ("https", "res.openai.azure.com", 443)
    for bad, needle in (({"a": {"base_url": "http://x", "query": {"k": 1}}}, "routes['a'].query"),
                        ({"a": {"base_url": "http://x", "query": {"": "v"}}}, "routes['a'].query"),
                        ({"a": {"base_url": "http://x", "model": ""}}, "routes['a'].model"),
                        ({"a": {"base_url": "http://x/v1?api-version=1"}}, "query or fragment")):
        with pytest.raises(ValueError, match=needle.replace("[", r"\[").replace("]", r"\]")):
            t.parse_routes(bad)


def _rebase(routes, source, url):
    import urllib.parse as up
    r = t.parse_routes(routes)
    assert r is not None
    u = up.urlsplit(url)
    return t.rebase(t.route_bases(r), r[source], u.scheme, u.hostname, u.port,
                    u.path + ("?" + u.query if u.query else ""))[0]


def test_rebase_says_when_a_request_leaves_the_origin_the_sdk_addressed():
    """§17: the SDK's credentials stay with their origin; ``cross`` says when not."""
    import urllib.parse as up
    r = t.parse_routes({"a": "http://h/a/v1", "b": "http://h/b/v1", "vllm": "http://gpu-1:8000/v1",
                        "tls": "https://h/a/v1"})
    assert r is not None

    def cross(source, url):
        u = up.urlsplit(url)
        return t.rebase(t.route_bases(r), r[source], u.scheme, u.hostname, u.port, u.path)[1]

    assert not cross("a", "http://h/a/v1/chat")
    assert not cross("b", "http://H:80/a/v1/chat")  # same scheme, host and port: another path
    assert cross("vllm", "http://h/a/v1/chat")
    assert cross("tls", "http://h/a/v1/chat")  # another scheme (and port)
    assert cross("a", "https://h/a/v1/chat")  # the SDK addressed tls's base: a is another origin
    assert not cross("vllm", "http://sdk.invalid/v1/chat")  # under no base: the routes are its only destinations


def test_rebase_replaces_the_matching_base_url_else_puts_the_path_in_front():
    routes = {"a": "http://h/a/v1", "b": "http://h/b/v1", "vllm": "http://gpu-1:8000/v1",
              "deep": "http://h/a/v1/deployments/x", "bare": "http://other:9000"}
    # the SDK's base URL is a's: a's prefix is replaced by the granted route's
    assert _rebase(routes, "b", "http://h/a/v1/chat/completions") == "/b/v1/chat/completions"
    assert _rebase(routes, "vllm", "http://h:80/a/v1/chat/completions?x=1") == "/v1/chat/completions?x=1"
    assert _rebase(routes, "b", "http://h/a/v1") == "/b/v1"
    assert _rebase(routes, "bare", "http://h/a/v1/embeddings") == "/embeddings"
    # the longest matching base URL wins
    assert _rebase(routes, "b", "http://h/a/v1/deployments/x/chat") == "/b/v1/chat"
    # a segment boundary: /a/v10 is not under /a/v1; another host or port matches nothing
    assert _rebase(routes, "b", "http://h/a/v10/chat") == "/b/v1/a/v10/chat"
    assert _rebase(routes, "b", "http://h:8080/a/v1/chat") == "/b/v1/a/v1/chat"
    assert _rebase(routes, "b", "https://h/a/v1/chat") == "/b/v1/a/v1/chat"
    assert _rebase(routes, "bare", "http://sdk/v1/chat") == "/v1/chat"


def test_a_base_url_path_is_percent_encoded_as_it_is_sent():
    """A base URL's path with a space or a non-ASCII character is matched and sent
    percent-encoded, as httpx sends the SDK's URL and as the Node and Go bindings do;
    existing escapes are kept."""
    r = t.parse_routes({"a": "http://h/my dep/v1", "b": "http://g/dép", "c": "http://g/x%2Fy/é%C3%A9"})
    assert r is not None
    assert [r[k].prefix for k in "abc"] == ["/my%20dep/v1", "/d%C3%A9p", "/x%2Fy/%C3%A9%C3%A9"]
    routes = {"a": "http://h/my dep/v1", "b": "http://g/v1", "u": "http://g/dép"}
    assert _rebase(routes, "b", "http://h/my%20dep/v1/chat") == "/v1/chat"
    assert _rebase(routes, "u", "http://h/my%20dep/v1/chat") == "/d%C3%A9p/chat"
    assert _rebase(routes, "u", "http://g/v1/chat").isascii()


def test_rebase_sets_the_routes_query():
    routes = {"o": "http://o/v1", "az": {"base_url": "https://r/openai/deployments/d",
                                         "query": {"api-version": "2024-10-21", "k": "a b&c/é"}}}
    assert _rebase(routes, "az", "http://o/v1/chat/completions?api-version=old&trace=1&api%2Dversion=x") == \
        "/openai/deployments/d/chat/completions?trace=1&api-version=2024-10-21&k=a%20b%26c%2F%C3%A9"
    assert _rebase(routes, "az", "http://o/v1/chat/completions") == \
        "/openai/deployments/d/chat/completions?api-version=2024-10-21&k=a%20b%26c%2F%C3%A9"


@pytest.mark.parametrize("body,want", [
    (b'{"model":"gpt-4o","stream":true,"seed":12345678901234567890123}',
     b'{"model":"m2","stream":true,"seed":12345678901234567890123}'),
    (b' { "tools" : [{"model":"x"}], "model" : "gpt" , "s":"}\\"model\\":" } ',
     b' { "tools" : [{"model":"x"}], "model" : "m2" , "s":"}\\"model\\":" } '),
    (b'{"input":"hi"}', b'{"model":"m2","input":"hi"}'),
    (b'{ }', b'{"model":"m2" }'),
    (b'{"mod\\u0065l":"a","n":1.5e3,"model":null}', b'{"mod\\u0065l":"m2","n":1.5e3,"model":"m2"}'),
    (b'{"model":"m2","x":1}', b'{"model":"m2","x":1}'),
    (b'[{"model":"x"}]', None), (b'"model"', None), (b'{"model":', None), (b'', None), (b'\xff{}', None),
])
def test_set_model_changes_only_the_top_level_model(body, want):
    got = t.set_model(body, "m2")
    assert got == want
    if want is not None:
        assert json.loads(got)["model"] == "m2"


def test_set_model_leaves_a_body_that_is_not_utf8_as_it_is():
    """Only strict UTF-8 is rewritten: a UTF-16 body (which json.loads on bytes reads)
    would be corrupted by a UTF-8 splice."""
    utf16 = '{"model":"gpt-4o","x":1}'.encode("utf-16-le")
    assert json.loads(utf16) == {"model": "gpt-4o", "x": 1}  # what made it look like JSON
    assert t.set_model(utf16, "m2") is None
    assert t.set_model('{"model":"a"}'.encode("utf-16"), "m2") is None  # with a BOM
    assert t.set_model(b'{"model":"a","s":"' + bytes([0xFF]) + b'"}', "m2") is None
    assert t.set_model('{"model":"a","s":"\u00e9"}'.encode(), "m2") == '{"model":"m2","s":"\u00e9"}'.encode()


def test_set_model_leaves_nan_and_infinity_as_they_are():
    """NaN / Infinity are Python's, not JSON's (RFC 8259): such a body is not rewritten."""
    assert t.set_model(b'{"model":"a","t":NaN}', "m2") is None
    assert t.set_model(b'{"a":-Infinity}', "m2") is None
    assert t.set_model(b'{"a":1e999}', "m2") == b'{"model":"m2","a":1e999}'  # a number, however large


def test_set_model_leaves_a_body_nested_too_deep_to_parse_as_it_is():
    """A RecursionError must not escape the transport: the body is sent as it is."""
    deep = b'{"model":"a","x":' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    assert t.set_model(deep, "m2") is None


def test_a_response_nested_too_deep_to_parse_has_no_usage():
    """Nor out of the usage readers: an upstream's absurd body leaves the estimate."""
    deep = b'{"usage":{"total_tokens":1},"x":' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    assert t.body_usage(b'{"usage":' + b"[" * 100_000 + b"]" * 100_000 + b"}") == t.NO_USAGE
    assert t.body_usage(b'{"x":' + b"[" * 100_000 + b"]" * 100_000 + b',"usage":{}}') == t.NO_USAGE
    r = t.UsageReader("text/event-stream")
    r.feed(b"data: " + deep + b"\n\n")
    assert r.usage() == t.NO_USAGE


# ---------------------------------------------------------------- packaging


def test_import_polygate_needs_no_http_library():
    """``import polygate`` (and polygate.aio) works with httpx and httpx2 missing;
    only the transport modules need them, and say so."""
    code = textwrap.dedent("""
        import sys
        for m in ("httpx", "httpx2", "openai", "anthropic"):
            sys.modules[m] = None  # an import of it raises ImportError
        import polygate, polygate.aio
        assert polygate.RouteMissingError
        for mod in ("polygate.httpx", "polygate.httpx2"):
            try:
                __import__(mod)
            except ImportError as e:
                assert mod.split(".")[1] in str(e), e
            else:
                raise SystemExit(mod + " imported without its library")
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_transport_options_are_checked_at_construction():
    httpx = pytest.importorskip("httpx")
    import polygate.httpx as ph

    with pytest.raises(ValueError, match="on_refusal"):
        ph.Transport("chat", on_refusal="ignore")
    with pytest.raises(ValueError, match="scope"):
        ph.Transport("")
    with pytest.raises(ValueError, match="routes"):
        ph.Transport("chat", routes={"a": {"base_url": "nope"}})
    with pytest.raises(TypeError, match="estimate"):
        ph.Transport("chat", estimate=5)  # type: ignore[arg-type]
    c = ph.client("chat", base_url="http://127.0.0.1:1")
    assert isinstance(c, httpx.Client) and isinstance(c._transport, ph.Transport)
    c.close()


@pytest.mark.parametrize("lib", ["httpx", "httpx2"])
def test_a_routed_3xx_location_is_written_back_as_the_sdks_url(lib):
    """§17 item 2: resolved against the URL sent (path, dot-segments,
    scheme-relative), a Location under the granted route's base URL is written back
    under the base URL the SDK's request was under (so the next hop is routed, and
    its credentials ruled, as any request); one elsewhere is made absolute; an
    absolute one elsewhere, or none, is left as it is."""
    import types
    mod = pytest.importorskip(lib)
    from polygate._gate import _Base
    gate = types.SimpleNamespace(routes=t.parse_routes({
        "openai": "https://api.openai.com/v1", "az": "http://g:8080/openai/deployments/x"}))
    sdk = mod.Request("POST", "https://api.openai.com/v1/chat/completions")
    sent = mod.Request("POST", "http://g:8080/openai/deployments/x/chat/completions?api-version=1")
    for loc, want in (("/openai/deployments/x/chat/completions?api-version=2",
                       "https://api.openai.com/v1/chat/completions?api-version=2"),
                      ("../y/chat", "https://api.openai.com/v1/y/chat"),  # against .../x/chat/completions
                      ("http://G:8080/openai/deployments/x/z", "https://api.openai.com/v1/z"),
                      ("/openai/deployments/other/chat", "http://g:8080/openai/deployments/other/chat"),
                      ("//h2/v1/chat", "http://h2/v1/chat"),
                      ("https://other/v1/chat", "https://other/v1/chat")):
        r = mod.Response(307, headers={"location": loc})
        _Base._relocate(gate, sdk, sent, r, "az")  # type: ignore[arg-type]
        assert r.headers["location"] == want, loc
    r = mod.Response(304)
    _Base._relocate(gate, sdk, sent, r, "az")  # type: ignore[arg-type]
    assert "location" not in r.headers
    # Under no base URL (the route's path put in front): back to the SDK's origin, the path without it.
    sdk2 = mod.Request("POST", "http://sdk.invalid/chat")
    sent2 = mod.Request("POST", "http://g:8080/openai/deployments/x/chat")
    r = mod.Response(302, headers={"location": "/openai/deployments/x/chat2"})
    _Base._relocate(gate, sdk2, sent2, r, "az")  # type: ignore[arg-type]
    assert r.headers["location"] == "http://sdk.invalid/chat2"


# ---------------------------------------------------------------- the transports' header reads


@pytest.mark.parametrize("lib", ["httpx", "httpx2"])
def test_header_reads_use_the_lowered_triples_and_fall_back_to_raw(lib):
    """_head / _tenant_header read httpx's (raw, lower, value) triples; a Headers of
    another shape goes by .raw. The rate-limit flag is set exactly when a name
    begins as parse_headers' names do (else it would find nothing)."""
    mod = pytest.importorskip(lib)
    __import__("polygate." + lib)  # trusts the library's Headers layout (read as it is)
    from polygate import _gate
    assert mod.Headers in _gate._TRIPLES
    _gate.trust_headers(dict)  # a class without the layout is not trusted
    assert dict not in _gate._TRIPLES
    from polygate._core import parse_headers

    class RawOnly:  # a Headers without httpx's list: only .raw
        def __init__(self, h):
            self.raw = list(mod.Headers(h).raw)

    class Shim:
        def __init__(self, headers):
            self.headers = headers

    cases = [
        ([("Content-Type", "application/json"), ("Content-Length", "12")], ("application/json", None, "12", False)),
        ([("content-encoding", "gzip"), ("X-RateLimit-Remaining-Requests", "9")], (None, "gzip", None, True)),
        ([("Retry-After", "3"), ("date", "Mon, 07 Dec 2026 09:00:00 GMT")], (None, None, None, True)),
        ([("date", "x"), ("x-ratelimit", "no dash"), ("server", "s")], (None, None, None, False)),
        ([("anthropic-ratelimit-tokens-remaining", "5"), ("content-type", "a"), ("Content-Type", "b")],
         ("b", None, None, True)),  # the last value wins, as before
        ([], (None, None, None, False)),
    ]
    for pairs, want in cases:
        for headers in (mod.Headers(pairs), RawOnly(pairs)):
            got = _gate._head(Shim(headers))
            assert got == want, (pairs, got)
            limits, retry = parse_headers(pairs)
            assert got[3] or (limits is None and retry is None), pairs  # nothing skipped that would parse
            if isinstance(headers, mod.Headers):
                assert parse_headers(headers) == parse_headers(pairs)
    for pairs, want in [([("X-PolyGate-Tenant", "acme"), ("accept", "*/*")], "acme"),
                        ([("accept", "*/*")], None), ([("x-polygate-tenant", "")], ""),
                        # spaces and tabs around a value are not part of it (as Node and Go read it)
                        ([("x-polygate-tenant", " acme\t")], "acme"), ([("x-polygate-tenant", "a b")], "a b"),
                        ([(b"x-polygate-tenant", b"acme\r\n")], "acme"),
                        # given twice: one value, joined as fetch's Headers.get joins them
                        ([("x-polygate-tenant", " a "), ("accept", "*/*"), ("X-Polygate-Tenant", "b")], "a, b")]:
        for headers in (mod.Headers(pairs), RawOnly(pairs)):
            assert _gate._tenant_header(Shim(headers)) == want
    with pytest.raises(ValueError):
        _gate._tenant_header(Shim(mod.Headers([(b"x-polygate-tenant", b"\xff")])))
