// The transport (DESIGN §17) end to end: the real openai-node SDK with
// `fetch: polygate.fetch(...)`, the real daemon (memory backend), and a fake upstream
// (node:http) — usage settled, estimates reserved, 429/5xx mapping, the synthetic
// refusal, routes failover, streams held and settled, the SDK's retries one call each.

import * as assert from "node:assert/strict";
import { execFile } from "node:child_process";
import * as v8 from "node:v8";
import * as vm from "node:vm";
import * as fs from "node:fs";
import * as path from "node:path";
import { describe, test } from "node:test";

import OpenAI from "openai";

import { CircuitOpenError, Client, RouteMissingError, Status, fetch as gatedFetch } from "../src/index.js";
import type { FetchOptions } from "../src/index.js";
import { FakeUpstream } from "./fake-upstream.js";
import { REPO, Sidecar, sleep, tempDir, withDaemon } from "./support.js";

const T = { timeout: 30_000 };

function config(sources: string[], extra = ""): string {
  return `
[scopes.chat]
circuit_open = "fail_fast"
quota_full = "wait"
max_attempts = 3
poll_interval = "10ms"
stall_window = "10s"

[scopes.chat.breaker]
failure_threshold = 1
cooldown = "10s"
${sources.map((s) => `\n[[scopes.chat.sources]]\nname = "${s}"\ntimeout = "5s"\ntpm = 6000\n${extra}`).join("")}`;
}

const CHAT_OK = {
  id: "c1", object: "chat.completion", created: 1, model: "m",
  choices: [{ index: 0, message: { role: "assistant", content: "hi" }, finish_reason: "stop", logprobs: null }],
  usage: { prompt_tokens: 12, completion_tokens: 18, total_tokens: 30 },
};

function chunk(content: string | null, usage: unknown = null): string {
  const choices = content === null ? [] : [{ index: 0, delta: { content }, finish_reason: null }];
  return `data: ${JSON.stringify({ id: "s1", object: "chat.completion.chunk", created: 1, model: "m", choices, usage })}`;
}

const MESSAGES = [{ role: "user" as const, content: "say hi" }];

interface Env {
  client: Client;
  up: FakeUpstream;
  sdk: (opts?: Partial<FetchOptions>, maxRetries?: number) => OpenAI;
  source: (name?: string) => Promise<Status["scopes"][string]["sources"][string]>;
}

async function withEnv(cfg: string, body: (env: Env) => Promise<void>, t: { skip: (why: string) => void }): Promise<void> {
  await withDaemon(cfg, "memory", t.skip.bind(t), async (client) => {
    const up = await FakeUpstream.start();
    try {
      await body({
        client,
        up,
        sdk: (opts = {}, maxRetries = 0) => new OpenAI({
          apiKey: "sk-test", baseURL: `${up.url}/v1`, maxRetries,
          fetch: gatedFetch({ scope: "chat", client, ...opts }),
        }),
        source: async (name = "a") => (await client.status()).scopes.chat!.sources[name]!,
      });
    } finally {
      await up.close();
    }
  });
}

async function until(what: string, ms: number, cond: () => Promise<boolean>): Promise<number> {
  const t0 = Date.now();
  for (;;) {
    if (await cond()) return Date.now() - t0;
    if (Date.now() - t0 > ms) throw new Error(`${what}: not within ${ms} ms`);
    await sleep(10);
  }
}

describe("transport through openai-node", () => {
  test("a success settles the usage, not the estimate; one request = one call", T, async (t) => {
    await withEnv(config(["a"]), async ({ up, sdk, source, client }) => {
      up.respond({ json: CHAT_OK });
      const r = await sdk().chat.completions.create({ model: "m", max_tokens: 2000, messages: MESSAGES });
      assert.equal(r.usage?.total_tokens, 30);
      assert.equal(r.choices[0]!.message.content, "hi");
      assert.equal(up.hits.length, 1);
      const a = await source();
      // estimate ≈ input + 2000; the usage (30) is what stays charged
      assert.ok(a.tokens_available! >= 5900 && a.tokens_available! <= 6000, `tokens_available ${a.tokens_available}`);
      assert.equal(a.window_successes, 1);
      assert.equal(a.in_flight, 0);
      assert.equal((await client.status()).scopes.chat!.calls, 0);
    }, t);
  });

  test("a slow request shows its estimate reserved (output from max_tokens)", T, async (t) => {
    await withEnv(config(["a"]), async ({ up, sdk, source }) => {
      up.respond({ json: CHAT_OK, delayS: 0.6 });
      const p = sdk().chat.completions.create({ model: "m", max_tokens: 2000, messages: MESSAGES });
      await sleep(250);
      const a = await source();
      assert.equal(a.in_flight, 1);
      assert.ok(a.tokens_available! >= 3800 && a.tokens_available! <= 4010, `tokens_available ${a.tokens_available}`);
      await p;
      assert.ok((await source()).tokens_available! >= 5900);
    }, t);
  });

  test("429 with Retry-After blocks the source and leaves the breaker closed", T, async (t) => {
    await withEnv(config(["a"]), async ({ up, sdk, source }) => {
      up.respond({ status: 429, headers: { "retry-after": "3" }, json: { error: { message: "slow down" } } });
      await assert.rejects(sdk().chat.completions.create({ model: "m", messages: MESSAGES }),
        (e: unknown) => e instanceof OpenAI.RateLimitError && e.status === 429);
      const a = await source();
      assert.equal(a.state, "closed");
      assert.equal(a.streak, 0);
      assert.equal(a.window_failures, 0);
      assert.ok(a.quota_blocked_s >= 2 && a.quota_blocked_s <= 3.01, `quota_blocked_s ${a.quota_blocked_s}`);
    }, t);
  });

  test("a 5xx opens the breaker; the next request gets the synthetic 503 without reaching the upstream", T, async (t) => {
    await withEnv(config(["a"]), async ({ up, sdk, source, client }) => {
      up.respond({ status: 500, json: { error: { message: "boom" } } });
      await assert.rejects(sdk().chat.completions.create({ model: "m", messages: MESSAGES }),
        (e: unknown) => e instanceof OpenAI.InternalServerError && e.status === 500);
      assert.equal((await source()).state, "open");
      const err = await sdk().chat.completions.create({ model: "m", messages: MESSAGES }).then(() => null, (e: unknown) => e);
      assert.ok(err instanceof OpenAI.APIError, String(err));
      assert.equal(err.status, 503);
      assert.deepEqual({ ...(err.error as object), message: "", retry_after_s: 0 }, {
        type: "polygate", code: "circuit_open", message: "", scope: "chat", retry_after_s: 0,
        per_source_reasons: { a: "circuit_open" },
      });
      assert.match((err.error as { message: string }).message, /PolyGate/);
      const ra = Number(err.headers?.get("retry-after"));
      assert.ok(ra >= 8 && ra <= 10, `retry-after ${ra}`);
      assert.equal(err.headers?.get("x-should-retry"), "false");
      assert.equal(up.hits.length, 1);
      // x-should-retry: false — an SDK allowed retries sends the refused request once
      let sent = 0;
      const g = gatedFetch({ scope: "chat", client });
      const retrying = new OpenAI({
        apiKey: "k", baseURL: `${up.url}/v1`, maxRetries: 2,
        fetch: (u, i) => {
          sent++;
          return g(u, i);
        },
      });
      const again = await retrying.chat.completions.create({ model: "m", messages: MESSAGES }).then(() => null, (e: unknown) => e);
      assert.ok(again instanceof OpenAI.APIError && again.status === 503, String(again));
      assert.equal(sent, 1);
      assert.equal(up.hits.length, 1);
      // onRefusal "raise": the typed error (the SDK wraps what fetch throws as its cause)
      const raised = await sdk({ onRefusal: "raise" }).chat.completions.create({ model: "m", messages: MESSAGES })
        .then(() => null, (e: unknown) => e);
      assert.ok(raised instanceof OpenAI.APIConnectionError, String(raised));
      assert.ok(raised.cause instanceof CircuitOpenError, String(raised.cause));
      assert.equal(up.hits.length, 1);
    }, t);
  });

  test("a tenant over its limit (rpm = 1, fail_fast): the SDK gets the 429 naming the tenant and does not retry it", T, async (t) => {
    const cfg = config(["a"]).replace('quota_full = "wait"', 'quota_full = "fail_fast"')
      + "\n[scopes.chat.tenants]\ndefault = { rpm = 1 }\n";
    await withEnv(cfg, async ({ up, client }) => {
      up.respond({ json: CHAT_OK }, 2);
      let sent = 0;
      const g = gatedFetch({ scope: "chat", client, tenant: "acme" });
      const openai = new OpenAI({
        apiKey: "sk-test", baseURL: `${up.url}/v1`, maxRetries: 2,
        fetch: (u, i) => {
          sent++;
          return g(u, i);
        },
      });
      const r = await openai.chat.completions.create({ model: "m", messages: MESSAGES });
      assert.equal(r.usage?.total_tokens, 30);
      assert.equal(up.hits.length, 1);
      assert.equal(up.hits[0]!.headers["x-polygate-tenant"], undefined);
      const err = await openai.chat.completions.create({ model: "m", messages: MESSAGES }).then(() => null, (e: unknown) => e);
      assert.ok(err instanceof OpenAI.RateLimitError, String(err));
      assert.equal(err.status, 429);
      const body = err.error as Record<string, unknown>;
      assert.deepEqual([body.type, body.code, body.limit_source, body.tenant, body.limit, body.scope],
        ["polygate", "tenant_limited", "tenant", "acme", "rpm", "chat"]);
      assert.equal(err.headers?.get("x-should-retry"), "false");
      assert.equal(err.headers?.get("x-polygate-refusal"), "tenant_limited");
      const ra = Number(err.headers?.get("retry-after"));
      assert.ok(ra >= 1 && ra <= 61, `retry-after ${ra}`);
      assert.equal(sent, 2, "the SDK sent the refused request once (maxRetries: 2, x-should-retry: false)");
      assert.equal(up.hits.length, 1, "the fake upstream saw exactly one request");
      // another tenant, named by the header through the SDK's per-request headers, is not affected
      const other = await openai.chat.completions.create({ model: "m", messages: MESSAGES }, { headers: { "x-polygate-tenant": "globex" } });
      assert.equal(other.usage?.total_tokens, 30);
      assert.equal(up.hits.length, 2);
      assert.equal(up.hits[1]!.headers["x-polygate-tenant"], undefined);
      // an id over 128 bytes: a clear error through the SDK, nothing sent, no call left
      const long = await openai.chat.completions.create({ model: "m", messages: MESSAGES }, {
        headers: { "x-polygate-tenant": "x".repeat(129) }, maxRetries: 0,
      }).then(() => null, (e: unknown) => e);
      assert.ok(long instanceof OpenAI.APIConnectionError && long.cause instanceof RangeError, String(long));
      assert.match((long.cause as Error).message, /x-polygate-tenant header.*129 bytes of UTF-8; the limit is 128 bytes/);
      assert.equal(up.hits.length, 2);
      const st = (await client.status()).scopes.chat!;
      assert.equal(st.calls, 0);
      assert.equal(st.sources.a!.in_flight, 0);
    }, t);
  });

  test("routes: a failure on A → the SDK's retry goes to B with B's headers; each retry is its own call", T, async (t) => {
    await withEnv(config(["a", "b"]), async ({ client, up }) => {
      const upB = await FakeUpstream.start();
      try {
        up.respond({ status: 503, headers: { "retry-after-ms": "10" }, json: { error: { message: "down" } } });
        upB.respond({ json: CHAT_OK });
        const sdkBase = "http://sdk.invalid/v1";
        const openai = new OpenAI({
          apiKey: "sk-caller", baseURL: sdkBase, maxRetries: 2,
          fetch: gatedFetch({
            scope: "chat", client, sdkBaseURL: sdkBase, routes: {
              a: { baseURL: `${up.url}/v1`, headers: { authorization: "Bearer key-A" } },
              b: { baseURL: `${upB.url}/v1`, headers: { authorization: "Bearer key-B", "x-deployment": "b" } },
            },
          }),
        });
        const r = await openai.chat.completions.create({ model: "m", messages: MESSAGES });
        assert.equal(r.usage?.total_tokens, 30);
        assert.equal(up.hits.length, 1);
        assert.equal(up.hits[0]!.headers.authorization, "Bearer key-A");
        assert.equal(upB.hits.length, 1);
        assert.equal(upB.hits[0]!.url, "/v1/chat/completions");
        assert.equal(upB.hits[0]!.headers.authorization, "Bearer key-B");
        assert.equal(upB.hits[0]!.headers["x-deployment"], "b");
        const st = (await client.status()).scopes.chat!;
        assert.equal(st.calls, 0);
        assert.equal(st.sources.a!.state, "open");
        assert.equal(st.sources.b!.window_successes, 1);
        // a granted source missing from routes: a clear error, nothing sent
        await client.forceClose("a");
        const partial = new OpenAI({
          apiKey: "k", baseURL: sdkBase, maxRetries: 0,
          fetch: gatedFetch({ scope: "chat", client, sdkBaseURL: sdkBase, routes: { b: { baseURL: upB.url } } }),
        });
        const e = await partial.chat.completions.create({ model: "m", messages: MESSAGES }).then(() => null, (x: unknown) => x);
        assert.ok(e instanceof OpenAI.APIConnectionError && e.cause instanceof RouteMissingError, String(e));
        assert.match((e.cause as Error).message, /"a".*no entry in routes/);
        assert.equal(up.hits.length, 1);
        assert.equal((await client.status()).scopes.chat!.sources.a!.in_flight, 0);
      } finally {
        await upB.close();
      }
    }, t);
  });

  test("routes name the SDK's own base URL: the failover replaces it (b's path, not b's + a's); an Azure deployment gets its query and model", T, async (t) => {
    await withEnv(config(["a", "b", "az"]), async ({ client, up }) => {
      const az = await FakeUpstream.start();
      try {
        up.respond({ status: 503, headers: { "retry-after-ms": "10" }, json: { error: { message: "down" } } }, 2);
        up.respond({ json: CHAT_OK });
        az.respond({ sse: [chunk("hi"), chunk(null, { prompt_tokens: 20, completion_tokens: 5, total_tokens: 25 }), "data: [DONE]"] });
        // no sdkBaseURL: the SDK's base URL is route a's, as a user writes both
        const openai = new OpenAI({
          apiKey: "sk-caller", baseURL: `${up.url}/a/v1`, maxRetries: 2,
          fetch: gatedFetch({
            scope: "chat", client, routes: {
              a: { baseURL: `${up.url}/a/v1`, headers: { authorization: "Bearer key-A" } },
              b: { baseURL: `${up.url}/b/v1`, headers: { authorization: "Bearer key-B" } },
              az: {
                baseURL: `${az.url}/openai/deployments/gpt4o-eu`, headers: { "api-key": "AZ" },
                query: { "api-version": "2024-10-21" }, model: "gpt-4o-eu-prod",
              },
            },
          }),
        });
        // a fails (opens), b fails (opens), the last retry is granted az
        const r = await openai.chat.completions.create({ model: "gpt-4o", messages: MESSAGES, stream: true, stream_options: { include_usage: true } });
        let text = "";
        for await (const c of r) text += c.choices[0]?.delta.content ?? "";
        assert.equal(text, "hi");
        assert.deepEqual(up.hits.map((h) => h.url).sort(), ["/a/v1/chat/completions", "/b/v1/chat/completions"]);
        const byPath = Object.fromEntries(up.hits.map((h) => [h.url, h.headers.authorization]));
        assert.deepEqual(byPath, { "/a/v1/chat/completions": "Bearer key-A", "/b/v1/chat/completions": "Bearer key-B" });
        assert.equal(az.hits.length, 1);
        const hit = az.hits[0]!;
        assert.equal(hit.url, "/openai/deployments/gpt4o-eu/chat/completions?api-version=2024-10-21");
        assert.equal(hit.headers["api-key"], "AZ");
        assert.equal(Number(hit.headers["content-length"]), Buffer.byteLength(hit.body));
        const sent = JSON.parse(up.hits[0]!.body) as Record<string, unknown>;
        assert.equal(sent.model, "gpt-4o");
        assert.deepEqual(JSON.parse(hit.body), { ...sent, model: "gpt-4o-eu-prod" });
        await until("the stream settled", 5000, async () => (await client.status()).scopes.chat!.calls === 0);
        const st = (await client.status()).scopes.chat!;
        assert.equal(st.sources.az!.window_successes, 1);
        assert.equal(st.sources.az!.in_flight, 0);
        assert.ok(st.sources.az!.tokens_available! >= 5970, `tokens_available ${st.sources.az!.tokens_available}`);
        // a URL under none of the routes' base URLs (another host) keeps its path, the route's put in front
        await client.forceClose("a");
        const other = gatedFetch({ scope: "chat", client, routes: { a: { baseURL: `${up.url}/proxy` } } });
        await (await other(`http://sdk.invalid/v1/models?x=1`)).arrayBuffer();
        assert.equal(up.hits.at(-1)!.url, "/proxy/v1/models?x=1");
      } finally {
        await az.close();
      }
    }, t);
  });

  test("an abort while waiting for the upstream is a cancel; a TimeoutError reason is a timeout", T, async (t) => {
    await withEnv(config(["a"]).replace("failure_threshold = 1", "failure_threshold = 5"), async ({ up, source, client }) => {
      up.respond({ json: CHAT_OK, delayS: 2 }, 2);
      const f = gatedFetch({ scope: "chat", client });
      const init = { method: "POST", body: JSON.stringify({ max_tokens: 10 }) };
      const ac = new AbortController();
      setTimeout(() => ac.abort(), 100);
      await assert.rejects(f(`${up.url}/v1/chat/completions`, { ...init, signal: ac.signal }), (e: Error) => e.name === "AbortError");
      let a = await source();
      assert.deepEqual([a.in_flight, a.streak, a.window_failures, a.window_successes], [0, 0, 0, 0]);
      assert.equal((await client.status()).scopes.chat!.calls, 0);
      await assert.rejects(f(`${up.url}/v1/chat/completions`, { ...init, signal: AbortSignal.timeout(100) }), (e: Error) => e.name === "TimeoutError");
      a = await source();
      assert.deepEqual([a.in_flight, a.streak, a.window_failures], [0, 1, 1]);
    }, t);
  });

  test("a Request object and lazily connecting from path", T, async (t) => {
    await withDaemon(config(["a"]), "memory", t.skip.bind(t), async (client, sidecar) => {
      const up = await FakeUpstream.start();
      try {
        up.respond({ json: CHAT_OK });
        const f = gatedFetch({ scope: "chat", path: sidecar.socket, routes: { a: { baseURL: `${up.url}/base`, headers: { "x-key": "A" } } } });
        const r = await f(new Request("http://sdk.invalid/v1/chat/completions?q=1", {
          method: "POST", headers: { "x-key": "caller", "content-type": "application/json" }, body: JSON.stringify({ max_tokens: 5 }),
        }));
        assert.equal(r.status, 200);
        assert.equal(((await r.json()) as { usage: { total_tokens: number } }).usage.total_tokens, 30);
        assert.equal(up.hits[0]!.url, "/base/v1/chat/completions?q=1");
        assert.equal(up.hits[0]!.headers["x-key"], "A");
        assert.equal(up.hits[0]!.body, JSON.stringify({ max_tokens: 5 }));
        const st = await client.status();
        assert.equal(st.scopes.chat!.sources.a!.window_successes, 1);
        assert.equal(st.scopes.chat!.calls, 0);
      } finally {
        await up.close();
      }
    });
  });

  test("routes: the longest matching base URL is replaced, at a segment boundary; a Request's body gets the route's model", T, async (t) => {
    await withDaemon(config(["a"]), "memory", t.skip.bind(t), async (client) => {
      const up = await FakeUpstream.start();
      try {
        up.respond({ json: CHAT_OK }, 3);
        const f = gatedFetch({
          scope: "chat", client, routes: {
            a: { baseURL: `${up.url}/v1/`, headers: { "x-key": "A" }, query: { "api-version": "2024-10-21", k: "a b!" }, model: "served-name" },
            deep: { baseURL: `${up.url}/v1/deployments/x` },
          },
        });
        const body = ' { "tools": [{"model": "x"}], "model" : "gpt-4o", "seed": 12345678901234567890123, "max_tokens": 5 }';
        const r = await f(new Request(`${up.url}/v1/deployments/x/chat/completions?api-version=old&q=1`, {
          method: "POST", headers: { "content-type": "application/json", "content-length": String(body.length) }, body,
        }));
        assert.equal(r.status, 200);
        await r.arrayBuffer();
        assert.equal(up.hits[0]!.url, "/v1/chat/completions?q=1&api-version=2024-10-21&k=a%20b%21");
        assert.equal(up.hits[0]!.body, body.replace('"gpt-4o"', '"served-name"'));
        assert.equal(Number(up.hits[0]!.headers["content-length"]), Buffer.byteLength(up.hits[0]!.body));
        // /v10 is not under /v1: the whole path, the route's path in front; a non-JSON body is sent as it is
        await (await f(`${up.url}/v10/x`, { method: "POST", body: "plain" })).arrayBuffer();
        assert.equal(up.hits[1]!.url, "/v1/v10/x?api-version=2024-10-21&k=a%20b%21");
        assert.equal(up.hits[1]!.body, "plain");
        // a JSON object without a model gets one, first
        await (await f(`${up.url}/v1/embeddings`, { method: "POST", body: '{"input":"hi"}' })).arrayBuffer();
        assert.equal(up.hits[2]!.body, '{"model":"served-name","input":"hi"}');
        assert.equal((await client.status()).scopes.chat!.calls, 0);
      } finally {
        await up.close();
      }
    });
  });

  test("routes: a 3xx under redirect \"manual\" has its Location written back as the SDK's URL, and is an uncounted success with no tokens", T, async (t) => {
    await withDaemon(config(["a"]), "memory", t.skip.bind(t), async (client) => {
      const up = await FakeUpstream.start();
      try {
        up.respond({ status: 307, headers: { location: "/openai/deployments/x/chat/completions?api-version=2024" }, json: {} });
        const f = gatedFetch({
          scope: "chat", client, routes: {
            sdk: { baseURL: "https://api.openai.com/v1" },
            a: { baseURL: `${up.url}/openai/deployments/x`, query: { "api-version": "2024" } },
          },
        });
        const r = await f("https://api.openai.com/v1/chat/completions", { method: "POST", body: '{"model":"m","max_tokens":1500}', redirect: "manual" });
        assert.equal(r.status, 307);
        await r.arrayBuffer();
        assert.equal(up.hits[0]!.url, "/openai/deployments/x/chat/completions?api-version=2024");
        // written back as the SDK's own URL: following it is a call admitted and routed again
        assert.equal(r.headers.get("location"), "https://api.openai.com/v1/chat/completions?api-version=2024");
        const a = (await client.status()).scopes.chat!.sources.a!;
        assert.deepEqual([a.state, a.streak, a.window_failures, a.window_successes, a.in_flight], ["closed", 0, 0, 0, 0]);
        assert.ok(a.tokens_available !== null && a.tokens_available >= 5999, `the estimate is refunded: ${a.tokens_available}`);
      } finally {
        await up.close();
      }
    });
  });

  test("routes: a Request's body is sent with its Content-Length (not chunked) when no model changes it", T, async (t) => {
    await withDaemon(config(["a"]), "memory", t.skip.bind(t), async (client) => {
      const up = await FakeUpstream.start();
      try {
        up.respond({ json: CHAT_OK }, 2);
        const body = '{"model":"m","a":1}';
        const f = gatedFetch({ scope: "chat", client, routes: { a: { baseURL: `${up.url}/v1` } } });
        await (await f(new Request(`${up.url}/v1/chat/completions`, { method: "POST", body }))).arrayBuffer();
        await (await f(new Request(`${up.url}/v1/chat/completions`, { method: "POST", body: new ReadableStream({
          start(c): void {
            c.enqueue(Buffer.from(body));
            c.close();
          },
        }), duplex: "half" } as RequestInit))).arrayBuffer();
        for (const hit of up.hits) {
          assert.equal(hit.url, "/v1/chat/completions");
          assert.equal(hit.body, body);
          assert.equal(hit.headers["content-length"], String(body.length));
          assert.equal(hit.headers["transfer-encoding"], undefined);
        }
      } finally {
        await up.close();
      }
    });
  });

  test("routes: a body that is not valid UTF-8 is sent byte for byte, its model not set", T, async (t) => {
    await withDaemon(config(["a"]), "memory", t.skip.bind(t), async (client) => {
      const up = await FakeUpstream.start();
      try {
        up.respond({ json: CHAT_OK }, 3);
        const f = gatedFetch({ scope: "chat", client, routes: { a: { baseURL: `${up.url}/v1`, model: "served" } } });
        const latin1 = Buffer.from('{"model":"m","s":"caf\u00e9"}', "latin1"); // é as the one byte 0xE9
        await (await f(`${up.url}/v1/chat/completions`, { method: "POST", body: new Uint8Array(latin1) })).arrayBuffer();
        await (await f(new Request(`${up.url}/v1/chat/completions`, { method: "POST", body: latin1 }))).arrayBuffer();
        // valid UTF-8 bytes get the model
        await (await f(`${up.url}/v1/chat/completions`, { method: "POST", body: Buffer.from('{"model":"m","s":"caf\u00e9"}') })).arrayBuffer();
        assert.deepEqual(up.hits[0]!.raw, latin1);
        assert.deepEqual(up.hits[1]!.raw, latin1);
        assert.equal(up.hits[2]!.body, '{"model":"served","s":"caf\u00e9"}');
      } finally {
        await up.close();
      }
    });
  });

  test("routes: a bad query, model or base URL, or no route at all, is a TypeError at construction", T, () => {
    assert.throws(() => gatedFetch({ scope: "chat", routes: { a: { baseURL: "http://h/v1", query: { v: 1 as unknown as string } } } }), /routes\["a"\]\.query\["v"\] must be a string/);
    assert.throws(() => gatedFetch({ scope: "chat", routes: { a: { baseURL: "http://h/v1", model: "" } } }), /routes\["a"\]\.model/);
    assert.throws(() => gatedFetch({ scope: "chat", routes: { a: { baseURL: "http://h/v1?api-version=1" } } }), /query or fragment/);
    assert.throws(() => gatedFetch({ scope: "chat", routes: { a: { baseURL: "ftp://h/v1" } } }), /http\(s\)/);
    // an empty routes object would make every grant a RouteMissingError: refused here, as in Python
    assert.throws(() => gatedFetch({ scope: "chat", routes: {} }), (e: unknown) => e instanceof TypeError && /routes must name at least one source/.test(e.message));
  });

  test("the SDK's own retries are admitted one by one", T, async (t) => {
    await withEnv(config(["a"], "").replace("failure_threshold = 1", "failure_threshold = 5"), async ({ up, sdk, source, client }) => {
      up.respond({ status: 503, headers: { "retry-after-ms": "10" }, json: { error: { message: "busy" } } }, 2);
      up.respond({ json: CHAT_OK });
      const r = await sdk({}, 2).chat.completions.create({ model: "m", messages: MESSAGES });
      assert.equal(r.usage?.total_tokens, 30);
      assert.equal(up.hits.length, 3);
      const a = await source();
      assert.equal(a.window_failures, 2);
      assert.equal(a.window_successes, 1);
      assert.equal((await client.status()).scopes.chat!.calls, 0);
    }, t);
  });

  test("a stream is counted in flight while open and charged its final usage", T, async (t) => {
    await withEnv(config(["a"]), async ({ up, sdk, source, client }) => {
      let release!: () => void;
      const hold = new Promise<void>((r) => (release = r));
      up.respond({ sse: [chunk("he"), chunk("llo"), chunk(null, { prompt_tokens: 10, completion_tokens: 30, total_tokens: 40 }), "data: [DONE]"], holdLast: hold });
      const stream = await sdk().chat.completions.create({
        model: "m", max_tokens: 2000, messages: MESSAGES, stream: true, stream_options: { include_usage: true },
      });
      let text = "";
      let usage: unknown = null;
      let n = 0;
      for await (const c of stream) {
        text += c.choices[0]?.delta.content ?? "";
        if (c.usage) usage = c.usage;
        if (++n === 2) {
          const a = await source();
          assert.equal(a.in_flight, 1);
          assert.ok(a.tokens_available! <= 4010, `the estimate is held while streaming: ${a.tokens_available}`);
          assert.equal((await client.status()).scopes.chat!.calls, 1);
          release();
        }
      }
      assert.equal(text, "hello");
      assert.deepEqual(usage, { prompt_tokens: 10, completion_tokens: 30, total_tokens: 40 });
      await until("the stream's settle", 1000, async () => (await source()).in_flight === 0);
      const a = await source();
      assert.ok(a.tokens_available! >= 5900, `charged the usage (40), not the estimate: ${a.tokens_available}`);
      assert.equal(a.window_successes, 1);
    }, t);
  });

  test("the provider's rate-limit headers are reported, aged by the stream's length (§18)", T, async (t) => {
    await withEnv(config(["a"], 'observe_limits = "on"\n'), async ({ up, sdk, source }) => {
      up.respond({
        sse: [chunk("he"), chunk("llo"), chunk(null, { prompt_tokens: 10, completion_tokens: 30, total_tokens: 40 }), "data: [DONE]"],
        gapMs: 250,
        headers: { "x-ratelimit-limit-tokens": "6000", "x-ratelimit-remaining-tokens": "1000", "x-ratelimit-reset-tokens": "20s" },
      });
      const stream = await sdk().chat.completions.create({ model: "m", max_tokens: 100, messages: MESSAGES, stream: true });
      for await (const _ of stream) {
        // read it to the end
      }
      await until("the stream's settle", 1000, async () => (await source()).in_flight === 0);
      const buckets = (await source()).buckets as { bucket: string; level: number; observed: { remaining: number; age_s: number } | null }[];
      const tpm = buckets.find((b) => b.bucket === "tpm")!;
      assert.equal(tpm.observed?.remaining, 1000, `no call site set limits; the transport reported them: ${JSON.stringify(tpm)}`);
      // Dated when the headers came, ~0.75 s before the stream ended, not at the report.
      assert.ok(tpm.observed!.age_s >= 0.5, `observed ${tpm.observed!.age_s} s ago`);
      assert.ok(tpm.level <= 1000 + 100 * (tpm.observed!.age_s + 0.5), `level ${tpm.level}`);
    }, t);
  });

  test("an abandoned stream is settled within 1 s", T, async (t) => {
    await withEnv(config(["a"]), async ({ up, sdk, source, client }) => {
      const events = Array.from({ length: 50 }, (_, i) => chunk(`t${i}`));
      up.respond({ sse: [...events, "data: [DONE]"], gapMs: 50, holdLast: new Promise(() => {}) });
      const stream = await sdk().chat.completions.create({ model: "m", max_tokens: 100, messages: MESSAGES, stream: true });
      let n = 0;
      for await (const _ of stream) if (++n === 2) break;
      const ms = await until("the abandoned stream's settle", 1000, async () => (await source()).in_flight === 0);
      assert.ok(ms <= 1000);
      assert.equal((await client.status()).scopes.chat!.calls, 0);
      assert.equal((await source()).window_successes, 1);
    }, t);
  });
});

describe("transport: a stream dropped unread", () => {
  test("is settled once it is garbage-collected", T, async (t) => {
    v8.setFlagsFromString("--expose-gc");
    const gc = vm.runInNewContext("gc") as () => void;
    await withEnv(config(["a"]), async ({ up, source, client }) => {
      up.respond({ sse: [chunk("a"), chunk("b")], holdLast: new Promise(() => {}) });
      const f = gatedFetch({ scope: "chat", client });
      await (async () => {
        const r = await f(`${up.url}/v1/chat/completions`, { method: "POST", body: "{}" });
        assert.equal(r.status, 200); // and r is dropped here, its body never read
      })();
      assert.equal((await source()).in_flight, 1);
      await until("the dropped stream's settle", 5000, async () => {
        gc();
        await sleep(20);
        return (await source()).in_flight === 0;
      });
      assert.equal((await source()).window_successes, 1);
    }, t);
  });
});

describe("examples", () => {
  test("examples/transport-openai.mjs runs as written against the example config, offline", { timeout: 60_000 }, async () => {
    const sidecar = new Sidecar();
    const proj = tempDir("pg-proj-");
    try {
      fs.copyFileSync(path.join(REPO, "examples", "polygate.toml"), sidecar.configPath);
      await sidecar.start({ SIDECAR__SOCKET: sidecar.socket });
      // `npm install ./bindings/node openai` in a project, as the example's header says
      fs.mkdirSync(path.join(proj, "node_modules"));
      fs.symlinkSync(path.join(REPO, "bindings", "node"), path.join(proj, "node_modules", "polygate"), "dir");
      fs.symlinkSync(path.join(REPO, "bindings", "node", "node_modules", "openai"), path.join(proj, "node_modules", "openai"), "dir");
      fs.copyFileSync(path.join(REPO, "examples", "transport-openai.mjs"), path.join(proj, "example.mjs"));
      const out = await new Promise<string>((resolve, reject) => {
        execFile(process.execPath, [path.join(proj, "example.mjs")], { env: { ...process.env, POLYGATE_SOCKET: sidecar.socket }, timeout: 30_000 },
          (err, stdout, stderr) => (err ? reject(new Error(`${err.message}\n${stderr}`)) : resolve(stdout)));
      });
      assert.equal(out, "hello from the fake upstream (18 tokens settled)\nstreamed hello\ncalls 0, successes 2\n");
    } finally {
      await sidecar.stop();
      sidecar.cleanup();
      fs.rmSync(proj, { recursive: true, force: true });
    }
  });
});
