#!/usr/bin/env python3
"""PolyGate under the openai and anthropic SDKs (DESIGN §17): the README's Python
quick start, runnable as written and offline.

Start the sidecar first (`cargo run --release -p polygate-sidecar`: the example config,
scope `chat` with sources openai-gpt4o, azure-gpt4o-eu, vllm-llama-local), then:

    pip install ./bindings/python openai anthropic
    python3 examples/transport_openai.py

The providers are faked by examples/fake_provider.py (a local HTTP server speaking
OpenAI and Anthropic JSON and SSE, with usage), so no key or network is needed.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # fake_provider.py, beside this file
from fake_provider import FakeProvider  # noqa: E402

with FakeProvider(failing=["openai-gpt4o"]) as provider:
    UPSTREAM = provider.url + "/v1"                      # your provider's base URL
    os.environ.setdefault("OPENAI_API_KEY", "sk-offline-example")
    os.environ.setdefault("ANTHROPIC_API_KEY", "sk-ant-offline-example")

    import openai
    import polygate.httpx

    # One line where the SDK client is built: every request it sends is admitted by PolyGate.
    client = openai.OpenAI(base_url=UPSTREAM, http_client=polygate.httpx.client("chat"))
    reply = client.chat.completions.create(model="gpt-4o", max_tokens=200,
                                           messages=[{"role": "user", "content": "Say hello."}])
    print(reply.choices[0].message.content)   # settled with reply.usage, not the estimate

    # anthropic 2.x takes httpx2 clients: polygate.httpx2 is the same transport.
    import anthropic
    import polygate.httpx2

    claude = anthropic.Anthropic(base_url=provider.url, http_client=polygate.httpx2.client("chat"))
    with claude.messages.stream(model="claude-sonnet", max_tokens=200,
                                messages=[{"role": "user", "content": "Say hello."}]) as stream:
        for text in stream.text_stream:       # the permit is held until the stream ends
            print(text, end="", flush=True)
    print()

    # Routes: one scope fails over across deployments with no change at the call site.
    # Each request goes to the granted source's base URL with that source's headers
    # (here all three are the fake provider; openai-gpt4o answers 503 there).
    routes = {source: {"base_url": provider.url, "headers": {"x-deployment": source}}
              for source in ("openai-gpt4o", "azure-gpt4o-eu", "vllm-llama-local")}
    routed = openai.OpenAI(base_url="https://placeholder.invalid/v1", max_retries=3,
                           http_client=polygate.httpx.client("chat", routes=routes))
    for i in range(3):
        try:
            r = routed.chat.completions.create(model="gpt-4o", max_tokens=50,
                                               messages=[{"role": "user", "content": "Hi"}])
            print("request %d: %s" % (i + 1, r.choices[0].message.content))
        except openai.APIStatusError as e:   # a 503 from the failing deployment, or PolyGate's own
            print("request %d: %d %s" % (i + 1, e.status_code, e.message))
    print("requests per deployment:", provider.hits)

    state = polygate.connect().status()["scopes"]["chat"]["sources"]
    print("breakers:", {name: s["state"] for name, s in state.items()})
