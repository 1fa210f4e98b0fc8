"""End-to-end: tenants (DESIGN §19) through the HTTP transport under the real
``openai`` SDK, against the real daemon (memory and Redis) and a fake upstream. A
tenant over its token or dollar budget gets a 429 whose body names the tenant and the
limit (``"limit_source": "tenant"``) with ``x-should-retry: false``, and the SDK —
left at its default of 2 retries — does not retry it: the upstream sees nothing more.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Dict

import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")

import polygate  # noqa: E402
import polygate.httpx  # noqa: E402

from .fake_upstream import FakeUpstream, Reply  # noqa: E402
from .polygate_e2e import scope  # noqa: E402

pytestmark = pytest.mark.timeout(60)

MESSAGES = [{"role": "user", "content": "Say hello."}]
# $1 per 1M input tokens, $2 per 1M output.
PRICED = {"name": "a", "timeout": "5s", "usd_per_1m_input": 1.0, "usd_per_1m_output": 2.0}


def chat_body(prompt: int, completion: int) -> Dict[str, Any]:
    return {"id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": "gpt-test",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "Hello!"},
                         "finish_reason": "stop"}],
            "usage": {"prompt_tokens": prompt, "completion_tokens": completion,
                      "total_tokens": prompt + completion}}


@pytest.fixture(params=["memory", "redis"])
def backend(request: Any, redis_server: Any) -> Dict[str, Any]:
    if request.param == "memory":
        return {"backend": "memory"}
    return {"backend": "redis", "redis_url": redis_server.url, "key_prefix": "pg-tt",
            "redis_timeout": "500ms"}


@pytest.fixture
def upstream() -> Any:
    with FakeUpstream("a") as up:
        yield up


def oai(up: FakeUpstream, sock: str, **tkw: Any) -> Any:
    """The openai SDK with its default retries (2), through the transport."""
    return openai.OpenAI(api_key="sk-test", base_url=up.url + "/v1",
                         http_client=polygate.httpx.client("chat", socket=sock, **tkw))


def test_a_spent_dollar_budget_is_a_429_the_openai_sdk_does_not_retry(sidecar, backend, upstream):
    sidecar.write_config({"chat": scope(PRICED, quota_full="wait", stall_window="20s",
                                        tenants={"default": {"usd_per_day": 0.01}})}, **backend)
    sidecar.start()
    pg = sidecar.client()
    client = oai(upstream, sidecar.socket, tenant="acme")
    # A small estimate is admitted; the usage ($0.005 + $0.006) spends the whole budget.
    upstream.queue(Reply.json(chat_body(prompt=5000, completion=3000)))
    client.chat.completions.create(model="gpt-test", messages=MESSAGES, max_tokens=50)
    ledger = pg.tenant_status("acme")["scopes"]["chat"]["ledger"]
    assert ledger["usd_spent_day"] == pytest.approx(0.011, abs=1e-9) and ledger["in_flight"] == 0
    t0 = time.monotonic()
    with pytest.raises(openai.RateLimitError) as ei:
        client.chat.completions.create(model="gpt-test", messages=MESSAGES, max_tokens=50)
    assert time.monotonic() - t0 < 3, "a spent budget is neither waited on (quota_full = wait) nor retried"
    assert upstream.hits == 1, "nothing sent for the refusal, and the SDK did not retry it"
    r = ei.value.response
    assert r.status_code == 429 and r.headers["x-should-retry"] == "false"
    assert r.headers["x-polygate-refusal"] == "tenant_limited"
    err = r.json()["error"]
    assert (err["limit_source"], err["tenant"], err["limit"], err["code"]) == \
        ("tenant", "acme", "usd_per_day", "tenant_limited")
    now = time.time()
    assert abs(err["retry_after_s"] - (86400 - now % 86400)) < 5, "until midnight UTC"
    assert int(r.headers["retry-after"]) >= int(err["retry_after_s"])
    # Another tenant (the request header wins over the option) is not held back.
    upstream.queue(Reply.json(chat_body(prompt=10, completion=5)))
    client.chat.completions.create(model="gpt-test", messages=MESSAGES, max_tokens=50,
                                   extra_headers={"x-polygate-tenant": "globex"})
    assert upstream.hits == 2
    assert "x-polygate-tenant" not in upstream.received[-1].headers, "the tenant header is not sent upstream"
    assert pg.status()["scopes"]["chat"]["calls"] == 0


def test_a_tenant_over_its_tokens_named_by_a_function_gets_the_429(sidecar, backend, upstream):
    sidecar.write_config({"chat": scope("a", quota_full="fail_fast",
                                        tenants={"default": {"tpm": 1000}})}, **backend)
    sidecar.start()
    pg = sidecar.client()
    seen = []

    def tenant_of(request: Any) -> str:
        seen.append(request.url.path)
        return request.headers["x-user"]

    client = oai(upstream, sidecar.socket, tenant=tenant_of)
    upstream.queue(Reply.json(chat_body(prompt=600, completion=300)))
    client.chat.completions.create(model="gpt-test", messages=MESSAGES, max_tokens=50,
                                   extra_headers={"x-user": "u1"})
    # u1 has 100 of its 1000 tokens left: an estimate of 500 + the body is refused.
    with pytest.raises(openai.RateLimitError) as ei:
        client.chat.completions.create(model="gpt-test", messages=MESSAGES, max_tokens=500,
                                       extra_headers={"x-user": "u1"})
    err = ei.value.response.json()["error"]
    assert (err["limit_source"], err["tenant"], err["limit"]) == ("tenant", "u1", "tpm")
    assert 20 < err["retry_after_s"] <= 61
    assert upstream.hits == 1
    upstream.queue(Reply.json(chat_body(prompt=10, completion=5)))
    client.chat.completions.create(model="gpt-test", messages=MESSAGES, max_tokens=500,
                                   extra_headers={"x-user": "u2"})
    assert seen == ["/v1/chat/completions"] * 3 and upstream.hits == 2
    assert pg.tenant_status("u1")["scopes"]["chat"]["ledger"]["in_flight"] == 0


def test_on_refusal_raise_gives_the_typed_error_and_the_callers_request_is_untouched(sidecar):
    sidecar.write_config({"chat": scope("a", quota_full="fail_fast", tenants={"default": {"rpm": 1}})})
    sidecar.start()
    sent = []

    def upstream(request: Any) -> Any:
        sent.append(request)
        return httpx.Response(200, json={"ok": True})

    tr = polygate.httpx.Transport("chat", socket=sidecar.socket, on_refusal="raise", tenant="ignored",
                                  base=httpx.MockTransport(upstream))
    with httpx.Client(transport=tr) as http:
        req = http.build_request("POST", "http://h/v1/x", json={"a": 1}, headers={"x-polygate-tenant": "acme"})
        assert http.send(req).status_code == 200
        assert "x-polygate-tenant" not in sent[0].headers
        assert req.headers["x-polygate-tenant"] == "acme", "the caller's request keeps its header"
        with pytest.raises(polygate.TenantLimitExceeded) as ei:
            http.send(req)  # sent again: still acme's, now over its rpm
        assert (ei.value.tenant, ei.value.limit) == ("acme", "rpm") and len(sent) == 1
        # An empty header is the anonymous tenant (no limits here), not the option.
        assert http.post("http://h/v1/x", json={}, headers={"x-polygate-tenant": ""}).status_code == 200
        with pytest.raises(ValueError, match="128"):
            http.post("http://h/v1/x", json={}, headers={"x-polygate-tenant": "t" * 129})
    assert len(sent) == 2
    assert sidecar.client().status()["scopes"]["chat"]["calls"] == 0


def test_a_bad_tenant_option_is_refused_at_construction():
    with pytest.raises(TypeError, match="tenant must be a string or a function"):
        polygate.httpx.Transport("chat", tenant=42)  # type: ignore[arg-type]


def test_the_async_transport_carries_the_tenant(sidecar, upstream):
    sidecar.write_config({"chat": scope("a", quota_full="fail_fast", tenants={"default": {"rpm": 1}})})
    sidecar.start()

    async def main() -> Any:
        client = openai.AsyncOpenAI(api_key="sk-test", base_url=upstream.url + "/v1",
                                    http_client=polygate.httpx.async_client("chat", socket=sidecar.socket,
                                                                            tenant="acme"))
        await client.chat.completions.create(model="gpt-test", messages=MESSAGES)
        with pytest.raises(openai.RateLimitError) as ei:
            await client.chat.completions.create(model="gpt-test", messages=MESSAGES)
        await client.close()
        return ei.value.response.json()["error"]

    err = asyncio.run(main())
    assert (err["tenant"], err["limit"]) == ("acme", "rpm") and upstream.hits == 1


def test_the_cached_input_is_priced_at_its_own_rate(sidecar, backend, upstream):
    """§19 item 4: the transport reports the provider's cached input apart
    (``prompt_tokens_details.cached_tokens``), so the tenant pays the cached rate for
    it, as ``run()`` does."""
    priced = dict(PRICED, usd_per_1m_cached_input=0.5)
    sidecar.write_config({"chat": scope(priced, tenants={"default": {"usd_per_day": 1.0}})}, **backend)
    sidecar.start()
    pg = sidecar.client()
    client = oai(upstream, sidecar.socket, tenant="acme")
    body = chat_body(prompt=5000, completion=1000)
    body["usage"]["prompt_tokens_details"] = {"cached_tokens": 2000}
    upstream.queue(Reply.json(body))
    client.chat.completions.create(model="gpt-test", messages=MESSAGES, max_tokens=50)
    ledger = pg.tenant_status("acme")["scopes"]["chat"]["ledger"]
    # 3,000 input at $1/1M + 2,000 cached at $0.5/1M + 1,000 output at $2/1M (not $0.007:
    # the cached reads at the input rate).
    assert ledger["usd_spent_day"] == pytest.approx(0.006, abs=1e-9) and ledger["in_flight"] == 0
