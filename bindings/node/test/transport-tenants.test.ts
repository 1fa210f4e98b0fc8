// The transport's tenants (DESIGN §19 items 1 and 6) against the fake sidecar, with a
// capturing `fetch` in place of the network: the `tenant` option (string or function of
// the request), the x-polygate-tenant header winning over it and never sent, the checks
// at construction, over-long ids, and a tenant's refusal as a 429 or the typed error.

import * as assert from "node:assert/strict";
import { describe, test } from "node:test";

import { Client, SidecarError, TENANT_HEADER, TenantLimitExceededError, connect, fetch as gatedFetch } from "../src/index.js";
import type { FetchOptions } from "../src/index.js";
import { FakeConn, FakeSidecar, errorReply, variant } from "./fake-sidecar.js";

const T = { timeout: 10_000 };
const URL_ = "http://up.invalid/v1/chat/completions";
const BODY = JSON.stringify({ model: "m", max_tokens: 5, messages: [] });

/** A request as the capturing fetch received it: its headers and URL. */
interface Sent { url: string; headers: Headers; body: string }

interface Env {
  fake: FakeSidecar;
  client: Client;
  conn: FakeConn;
  sent: Sent[];
  f: (opts?: Partial<FetchOptions>) => ReturnType<typeof gatedFetch>;
  /** The tenant of each call the fake saw, in order (`null`: a plain Start). */
  tenants: () => (string | null)[];
}

async function withFake(body: (env: Env) => Promise<void>): Promise<void> {
  const fake = await FakeSidecar.start();
  const client = await connect(fake.socket);
  try {
    const conn = await fake.conn(0);
    const sent: Sent[] = [];
    const capture = async (input: string | URL | Request, init?: RequestInit): Promise<Response> => {
      const r = new Request(input, init);
      sent.push({ url: r.url, headers: r.headers, body: await r.text() });
      return new Response(JSON.stringify({ usage: { prompt_tokens: 1, completion_tokens: 1 } }), {
        status: 200, headers: { "content-type": "application/json" },
      });
    };
    await body({
      fake, client, conn, sent,
      f: (opts = {}) => gatedFetch({ scope: "chat", client, fetch: capture, ...opts }),
      tenants: () => conn.requests.map((r) => variant(r.request)).filter(([n]) => n === "Start" || n === "StartTenant")
        .map(([n, b]) => (n === "StartTenant" ? (b.tenant as string) : null)),
    });
  } finally {
    await client.close();
    await fake.stop();
  }
}

async function ok(p: Promise<Response>): Promise<void> {
  const r = await p;
  assert.equal(r.status, 200);
  await r.arrayBuffer();
}

describe("transport tenants", () => {
  test("the string option names every request's tenant; the header is never sent", T, async () => {
    await withFake(async ({ f, sent, tenants }) => {
      const g = f({ tenant: "acme" });
      await ok(g(URL_, { method: "POST", body: BODY }));
      await ok(g(URL_, { method: "POST", body: BODY, headers: { "x-other": "kept" } }));
      assert.deepEqual(tenants(), ["acme", "acme"]);
      assert.equal(sent.length, 2);
      assert.equal(sent[1]!.headers.get("x-other"), "kept");
      for (const s of sent) assert.equal(s.headers.get("x-polygate-tenant"), null);
      // no option: the anonymous tenant, a plain Start
      await ok(f()(URL_, { method: "POST", body: BODY }));
      assert.deepEqual(tenants(), ["acme", "acme", null]);
    });
  });

  test("the function form is called with the request (URL, method, headers) and its result used", T, async () => {
    await withFake(async ({ f, tenants, sent }) => {
      const seen: Request[] = [];
      const g = f({
        tenant: (req) => {
          seen.push(req);
          const org = req.headers.get("x-org");
          return org === null ? undefined : org === "none" ? "" : `org-${org}`;
        },
      });
      await ok(g(URL_, { method: "post", body: BODY, headers: { "x-org": "o1" } }));
      await ok(g(new Request(`${URL_}?q=2`, { method: "POST", body: BODY, headers: { "x-org": "o2" } })));
      await ok(g(URL_, { method: "POST", body: BODY })); // undefined: anonymous
      await ok(g(URL_, { method: "POST", body: BODY, headers: { "x-org": "none" } })); // "": anonymous
      assert.deepEqual(tenants(), ["org-o1", "org-o2", null, null]);
      assert.equal(seen.length, 4);
      assert.ok(seen.every((r) => r instanceof Request));
      assert.deepEqual(seen.map((r) => [r.method, r.url]), [["POST", URL_], ["POST", `${URL_}?q=2`], ["POST", URL_], ["POST", URL_]]);
      // the body was still sent whole (the function saw a body-less view)
      assert.deepEqual(sent.map((s) => s.body), [BODY, BODY, BODY, BODY]);
    });
  });

  test("the x-polygate-tenant header wins over the option (the function is not called); an empty one is anonymous", T, async () => {
    await withFake(async ({ f, tenants, sent }) => {
      await ok(f({ tenant: "acme" })(URL_, { method: "POST", body: BODY, headers: { "X-PolyGate-Tenant": "globex" } }));
      let calls = 0;
      const fn = f({ tenant: () => (calls++, "from-fn") });
      await ok(fn(URL_, { method: "POST", body: BODY, headers: { "x-polygate-tenant": "initech" } }));
      await ok(fn(URL_, { method: "POST", body: BODY }));
      await ok(f({ tenant: "acme" })(URL_, { method: "POST", body: BODY, headers: { "x-polygate-tenant": "" } }));
      // given twice: one value, joined by ", " (what Python and Go read too)
      await ok(f()(URL_, { method: "POST", body: BODY, headers: [["x-polygate-tenant", " a "], ["X-Polygate-Tenant", "b"]] }));
      assert.deepEqual(tenants(), ["globex", "initech", "from-fn", null, "a, b"]);
      assert.equal(calls, 1);
      for (const s of sent) assert.equal(s.headers.get("x-polygate-tenant"), null);
    });
  });

  test("the header is removed from every form of request, with and without routes; other headers and the caller's objects are kept", T, async () => {
    await withFake(async ({ f, tenants, sent }) => {
      const callers = new Headers({ "x-polygate-tenant": "t1", "x-other": "1" });
      const forms: [string, (g: ReturnType<typeof gatedFetch>) => Promise<Response>][] = [
        ["record", (g) => g(URL_, { method: "POST", body: BODY, headers: { "x-polygate-tenant": "t1", "x-other": "1" } })],
        ["Headers", (g) => g(URL_, { method: "POST", body: BODY, headers: callers })],
        ["pairs", (g) => g(URL_, { method: "POST", body: BODY, headers: [["x-polygate-tenant", "t1"], ["x-other", "1"]] })],
        ["Request", (g) => g(new Request(URL_, { method: "POST", body: BODY, headers: { "x-polygate-tenant": "t1", "x-other": "1" } }))],
        ["Request + init", (g) => g(new Request(URL_, { method: "POST", body: BODY }), { headers: { "x-polygate-tenant": "t1", "x-other": "1" } })],
      ];
      const routes = { a: { baseURL: "http://a.invalid/v1", headers: { "x-key": "A" } }, b: { baseURL: "http://b.invalid/v1" }, c: { baseURL: "http://c.invalid/v1" } };
      for (const opts of [{}, { routes }]) {
        for (const [, send] of forms) await ok(send(f(opts)));
      }
      assert.deepEqual(tenants(), Array(10).fill("t1"));
      assert.equal(sent.length, 10);
      for (const [i, s] of sent.entries()) {
        const form = `${forms[i % 5]![0]}${i >= 5 ? " (routes)" : ""}`;
        assert.equal(s.headers.get("x-polygate-tenant"), null, form);
        assert.equal(s.headers.get("x-other"), "1", form);
        assert.equal(s.body, BODY, form);
      }
      assert.ok(sent.slice(5).some((s) => s.headers.get("x-key") === "A" && s.url.startsWith("http://a.invalid/v1/")));
      assert.equal(callers.get("x-polygate-tenant"), "t1"); // the caller's Headers is not changed
    });
  });

  test("a bad tenant option is refused at construction naming tenant", T, async () => {
    assert.equal(TENANT_HEADER, "x-polygate-tenant");
    for (const bad of [7, true, {}, ["acme"], Symbol("t")]) {
      assert.throws(() => gatedFetch({ scope: "chat", tenant: bad as unknown as string }),
        (e: unknown) => e instanceof TypeError && /^tenant must be a string/.test(e.message), String(typeof bad));
    }
    assert.throws(() => gatedFetch({ scope: "chat", tenant: "a".repeat(129) }),
      (e: unknown) => e instanceof RangeError && /tenant option.*129 bytes of UTF-8; the limit is 128 bytes/.test(e.message));
    gatedFetch({ scope: "chat", tenant: "東".repeat(42) + "ab" }); // exactly 128 bytes
    gatedFetch({ scope: "chat", tenant: undefined });
  });

  test("an id over 128 bytes (header or function), a non-string or async function: a clear error, nothing started or sent", T, async () => {
    await withFake(async ({ f, sent, conn, client }) => {
      await assert.rejects(f()(URL_, { method: "POST", body: BODY, headers: { "x-polygate-tenant": "a".repeat(129) } }),
        (e: unknown) => e instanceof RangeError && /x-polygate-tenant header.*129 bytes of UTF-8; the limit is 128 bytes/.test(e.message));
      await assert.rejects(f({ tenant: () => "東".repeat(43) })(URL_, { method: "POST", body: BODY }),
        (e: unknown) => e instanceof RangeError && /tenant function.*129 bytes/.test(e.message));
      await assert.rejects(f({ tenant: (async () => "acme") as unknown as () => string })(URL_, { method: "POST", body: BODY }),
        (e: unknown) => e instanceof TypeError && /returned a Promise: it must be synchronous/.test(e.message));
      await assert.rejects(f({ tenant: (() => 7) as unknown as () => string })(URL_, { method: "POST", body: BODY }),
        (e: unknown) => e instanceof TypeError && /must return a string/.test(e.message));
      const boom = new Error("no org");
      await assert.rejects(f({ tenant: () => { throw boom; } })(URL_, { method: "POST", body: BODY }), (e: unknown) => e === boom);
      assert.equal(sent.length, 0);
      assert.ok(await client.ping() >= 0);
      assert.deepEqual(conn.requests.map((r) => variant(r.request)[0]), ["Ping"]);
    });
  });

  test("the sidecar refusing the tenant id (InvalidArgument) rejects with its error, nothing sent, no hang", T, async () => {
    await withFake(async ({ f, fake, sent, conn }) => {
      fake.handle = (req, c) => (variant(req.request)[0] === "StartTenant"
        ? c.send(req.id, errorReply("InvalidArgument", "tenant id is 200 bytes; at most 128", { scope: "chat" }))
        : fake.auto(req, c));
      for (const onRefusal of ["response", "raise"] as const) {
        await assert.rejects(f({ tenant: "acme", onRefusal })(URL_, { method: "POST", body: BODY }),
          (e: unknown) => e instanceof SidecarError && e.kind === "invalid_argument" && /at most 128/.test(e.message));
      }
      assert.equal(sent.length, 0);
      assert.ok(conn.requests.every((r) => variant(r.request)[0] !== "Finish"));
    });
  });

  test("a tenant's refusal: a 429 naming the tenant and limit (x-should-retry: false), or the typed error under raise", T, async () => {
    await withFake(async ({ f, fake, sent }) => {
      fake.handle = (req, c) => (variant(req.request)[0] === "StartTenant" ? c.send(req.id, {
        TenantLimited: {
          error: {
            kind: "TenantLimited", message: 'tenant "acme" of scope "chat" is over its rpm limit', retry_after_s: 2.25,
            per_source_reasons: [["a", "TenantLimited"]], exhausted: null, scope: "chat",
          },
          tenant: "acme", limit: "rpm",
        },
      }) : fake.auto(req, c));
      const r = await f({ tenant: "acme" })(URL_, { method: "POST", body: BODY });
      assert.equal(r.status, 429);
      assert.deepEqual(Object.fromEntries(r.headers), {
        "content-type": "application/json", "retry-after": "3", "retry-after-ms": "2250",
        "x-polygate-refusal": "tenant_limited", "x-should-retry": "false",
      });
      assert.deepEqual(await r.json(), {
        error: {
          type: "polygate", code: "tenant_limited",
          message: 'PolyGate refused the request in scope "chat" (tenant_limited): tenant "acme" of scope "chat" is over its rpm limit',
          scope: "chat", retry_after_s: 2.25, per_source_reasons: { a: "tenant_limited" },
          limit_source: "tenant", tenant: "acme", limit: "rpm",
        },
      });
      await assert.rejects(f({ tenant: "acme", onRefusal: "raise" })(URL_, { method: "POST", body: BODY }),
        (e: unknown) => e instanceof TenantLimitExceededError && e.tenant === "acme" && e.limit === "rpm" && e.retryAfterS === 2.25);
      assert.equal(sent.length, 0);
    });
  });
});
