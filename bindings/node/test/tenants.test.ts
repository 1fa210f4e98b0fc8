// Protocol 3, tenants (DESIGN §19, PROTOCOL §15), against the fake sidecar: StartTenant
// bytes, the TenantLimited refusal as TenantLimitExceededError, run() throwing it at once,
// the fallback to version 2 with tenants refused client-side, the 128-byte limit,
// SuccessCached on v3 only, tenantStatus.

import * as assert from "node:assert/strict";
import * as fs from "node:fs";
import * as path from "node:path";
import { describe, test } from "node:test";

import {
  Client, GatewayUnavailableError, MAX_TENANT_BYTES, SidecarError, TenantLimitExceededError, connect,
} from "../src/index.js";
import { parseJson } from "../src/json.js";
import { FakeConn, FakeSidecar, errorReply, until, variant } from "./fake-sidecar.js";
import { REPO } from "./support.js";

const T = { timeout: 10_000 };

interface Vector { name: string; frame_hex: string }
const VECTORS = new Map(((parseJson(fs.readFileSync(path.join(REPO, "bindings", "vectors", "frames.json"), "utf8")) as unknown as
  { vectors: Vector[] }).vectors).map((v) => [v.name, Buffer.from(v.frame_hex, "hex")]));

/** A vector's request bytes after the length prefix and the id. */
const body = (name: string): Buffer => VECTORS.get(name)!.subarray(12);

const REFUSAL = {
  TenantLimited: {
    error: {
      kind: "TenantLimited", message: "tenant \"acme\" of scope \"chat\" is over its usd_per_day budget", retry_after_s: 5400,
      per_source_reasons: [["a", "TenantLimited"], ["b", "CircuitOpen"]], exhausted: null, scope: "chat",
    },
    tenant: "acme",
    limit: "usd_per_day",
  },
};

function checkRefusal(e: unknown): true {
  assert.ok(e instanceof TenantLimitExceededError, String(e));
  assert.ok(e instanceof GatewayUnavailableError);
  assert.equal(e.tenant, "acme");
  assert.equal(e.limit, "usd_per_day");
  assert.equal(e.kind, "tenant_limited");
  assert.equal(e.retryAfterS, 5400);
  assert.equal(e.scope, "chat");
  assert.deepEqual(e.perSourceReasons, { a: "tenant_limited", b: "circuit_open" });
  assert.equal(e.message, "tenant \"acme\" of scope \"chat\" is over its usd_per_day budget");
  return true;
}

async function setup(version = 3): Promise<{ fake: FakeSidecar; client: Client; conn: FakeConn }> {
  const fake = await FakeSidecar.start();
  fake.protocolVersion = version;
  const client = await connect(fake.socket);
  return { fake, client, conn: await fake.conn(version === 3 ? 0 : 1) };
}

async function teardown(fake: FakeSidecar, client: Client): Promise<void> {
  await client.close();
  await fake.stop();
}

const outcomes = (conn: FakeConn): unknown[] => conn.named("Finish").map((f) => f.outcome);

describe("tenants (protocol 3)", () => {
  test("a tenant call sends StartTenant, byte for byte the vector's; no tenant or \"\" a plain Start", T, async () => {
    const { fake, client, conn } = await setup();
    try {
      const call = await client.call("chat", { estInputTokens: 800, estOutputTokens: 200, tenant: "acme" });
      assert.equal(call.tenant, "acme");
      await (await call.acquire()).success({ tokens: 5 });
      await call.end();
      for (const tenant of [undefined, null, ""]) {
        await client.run("chat", { estInputTokens: 800, estOutputTokens: 200, tenant }, async () => "ok");
      }
      assert.deepEqual(conn.names(), ["StartTenant", "Finish", "Start", "Finish", "Start", "Finish", "Start", "Finish"]);
      assert.equal(conn.rawFrames[0]!.subarray(12).toString("hex"), body("start_tenant").toString("hex"));
      const plain = conn.rawFrames.filter((_, i) => conn.names()[i] === "Start").map((b) => b.subarray(12).toString("hex"));
      assert.equal(new Set(plain).size, 1);
      assert.equal(plain[0], body("start_tenant").subarray(0, body("start_tenant").length - 12).toString("hex").replace(/^13/, "0b"));
      await client.run("chat", { tenant: "équipe-東京" }, async () => "ok");
      assert.equal(conn.named("StartTenant")[1]!.tenant, "équipe-東京");
    } finally {
      await teardown(fake, client);
    }
  });

  test("a tenant id over 128 bytes of UTF-8 is refused at the call, nothing sent", T, async () => {
    const { fake, client, conn } = await setup();
    try {
      assert.equal(MAX_TENANT_BYTES, 128);
      for (const bad of ["a".repeat(129), "東".repeat(43)]) {
        await assert.rejects(client.call("chat", { tenant: bad }), /is 129 bytes of UTF-8; the limit is 128 bytes/);
        await assert.rejects(client.run("chat", { tenant: bad }, async () => 1), RangeError);
        await assert.rejects(client.tenantStatus(bad), /the limit is 128 bytes/);
      }
      await assert.rejects(client.call("chat", { tenant: 7 as unknown as string }), /tenant must be a string/);
      await assert.rejects(client.call("chat", { tenant: "x\ud800" }), /lone surrogate/);
      await client.run("chat", { tenant: "東".repeat(42) + "ab" }, async () => 1); // exactly 128 bytes
      assert.deepEqual(conn.names(), ["StartTenant", "Finish"]);
    } finally {
      await teardown(fake, client);
    }
  });

  test("TenantLimited → TenantLimitExceededError with its fields; the call is over, nothing to end", T, async () => {
    const { fake, client, conn } = await setup();
    try {
      fake.handle = (req, c) => (variant(req.request)[0] === "StartTenant" ? c.send(req.id, REFUSAL) : fake.auto(req, c));
      const call = await client.call("chat", { tenant: "acme" });
      await assert.rejects(call.acquire(), checkRefusal);
      await assert.rejects(call.acquire(), /is over/);
      await call.end();
      assert.ok(await client.ping() >= 0);
      assert.deepEqual(conn.names(), ["StartTenant", "Ping"]);
    } finally {
      await teardown(fake, client);
    }
  });

  test("run() throws the tenant's refusal at once: no attempt after a refused Start, none after a refused Retry", T, async () => {
    const { fake, client, conn } = await setup();
    try {
      fake.handle = (req, c) => (variant(req.request)[0] === "StartTenant" ? c.send(req.id, REFUSAL) : fake.auto(req, c));
      let n = 0;
      await assert.rejects(client.run("chat", { tenant: "acme" }, async () => ++n), checkRefusal);
      assert.equal(n, 0);
      fake.handle = (req, c) => (variant(req.request)[0] === "Retry" ? c.send(req.id, REFUSAL) : fake.auto(req, c));
      const timeout = new DOMException("The operation timed out.", "TimeoutError");
      await assert.rejects(client.run("chat", { tenant: "acme" }, async () => {
        n++;
        throw timeout;
      }), (e: unknown) => checkRefusal(e) && (e as Error).cause === timeout);
      assert.equal(n, 1);
      assert.deepEqual(conn.names(), ["StartTenant", "StartTenant", "Retry"]);
    } finally {
      await teardown(fake, client);
    }
  });

  test("cachedInputTokens goes out as SuccessCached (tag 6) on v3; run() reads OpenAI and Anthropic caches", T, async () => {
    const { fake, client, conn } = await setup();
    try {
      const call = await client.call("chat");
      await (await call.acquire()).success({ inputTokens: 512, outputTokens: 300, cachedInputTokens: 2048 });
      await call.end();
      const finish = conn.rawFrames[1]!;
      assert.equal(finish.subarray(20).toString("hex"), body("finish_success_cached").subarray(8).toString("hex"));
      await client.run("chat", async () => ({ usage: { prompt_tokens: 90, completion_tokens: 10, prompt_tokens_details: { cached_tokens: 40 } } }));
      await client.run("chat", async () => ({ usage: { input_tokens: 7, output_tokens: 2, cache_read_input_tokens: 5000 } }));
      await client.run("chat", async () => ({ usage: { input_tokens: 7, output_tokens: 2, cache_read_input_tokens: 0 } }));
      assert.deepEqual(outcomes(conn), [
        { SuccessCached: { usage: { tokens: null, input_tokens: 512n, output_tokens: 300n }, cached_input_tokens: 2048n, count_attempt: true } },
        { SuccessCached: { usage: { tokens: null, input_tokens: 50n, output_tokens: 10n }, cached_input_tokens: 40n, count_attempt: true } },
        { SuccessCached: { usage: { tokens: null, input_tokens: 7n, output_tokens: 2n }, cached_input_tokens: 5000n, count_attempt: true } },
        { SuccessUsage: { usage: { tokens: null, input_tokens: 7n, output_tokens: 2n }, count_attempt: true } },
      ]);
      const bad = await client.call("chat");
      await assert.rejects((await bad.acquire()).success({ cachedInputTokens: -1 }), /cachedInputTokens/);
      await bad.end();
    } finally {
      await teardown(fake, client);
    }
  });

  test("tenantStatus sends TenantStatus and returns the document", T, async () => {
    const { fake, client, conn } = await setup();
    try {
      const all = await client.tenantStatus("acme");
      assert.deepEqual(Object.keys(all.scopes as object), ["chat", "embed"]);
      assert.equal(all.tenant, "acme");
      const one = await client.tenantStatus("", { scope: "chat" });
      assert.deepEqual(one, { tenant: "", scopes: { chat: { limits: { tpm: 1000 }, in_flight: 0, waiting: 0, spend_usd: { day: 0.25 } } } });
      assert.deepEqual(conn.named("TenantStatus").map((r) => [r.scope, r.tenant]), [[null, "acme"], ["chat", ""]]);
      fake.handle = (req, c) => c.send(req.id, errorReply("UnknownScope", "no scope nope"));
      await assert.rejects(client.tenantStatus("acme", { scope: "nope" }), (e: unknown) => e instanceof SidecarError && e.kind === "unknown_scope");
    } finally {
      await teardown(fake, client);
    }
  });
});

describe("a version-2 sidecar", () => {
  test("Hello 3 refused → reconnect saying 2; a tenant call is refused naming both versions, others work", T, async () => {
    const { fake, client, conn } = await setup(2);
    try {
      assert.deepEqual(fake.conns.map((c) => c.hello!.protocol_version), [3, 2]);
      assert.equal(client.protocolVersion, 2);
      const clear = (e: unknown): boolean => e instanceof SidecarError && e.kind === "protocol_violation"
        && e.message.includes("the sidecar speaks protocol 2; tenants need 3: upgrade polygate-sidecar");
      await assert.rejects(async () => (await client.call("chat", { tenant: "acme" })).acquire(), clear);
      let n = 0;
      await assert.rejects(client.run("chat", { tenant: "acme" }, async () => ++n), clear);
      assert.equal(n, 0);
      await assert.rejects(client.tenantStatus("acme"), clear);
      const call = await client.call("chat");
      await (await call.acquire()).success({ inputTokens: 1, outputTokens: 2, cachedInputTokens: 3 });
      await call.end();
      assert.deepEqual(conn.names(), ["Start", "Finish"]); // no tenant frame ever left
      assert.deepEqual(outcomes(conn), [{ SuccessUsage: { usage: { tokens: null, input_tokens: 1n, output_tokens: 2n }, count_attempt: true } }]);
    } finally {
      await teardown(fake, client);
    }
  });

  test("a reconnect to a sidecar that became version 2 falls back too", T, async () => {
    const { fake, client } = await setup();
    try {
      assert.equal(client.protocolVersion, 3);
      fake.protocolVersion = 2;
      fake.handle = () => {}; // hold the ping: its failure tells the client the connection is gone
      const ping = client.ping();
      await until(() => fake.conns[0]!.names().includes("Ping"), 3000, "the ping");
      fake.conns[0]!.close();
      await assert.rejects(ping, /lost/);
      fake.handle = (req, c) => fake.auto(req, c);
      await assert.rejects(client.run("chat", { tenant: "acme" }, async () => 1), /tenants need 3/);
      assert.equal(client.protocolVersion, 2);
      assert.deepEqual(fake.conns.map((c) => c.hello!.protocol_version), [3, 3, 2]);
      assert.ok(fake.conns.every((c) => !c.names().includes("StartTenant")));
    } finally {
      await teardown(fake, client);
    }
  });

  test("a version-1 sidecar is still a clear error, after one Hello", T, async () => {
    const fake = await FakeSidecar.start();
    fake.protocolVersion = 1;
    try {
      await assert.rejects(connect(fake.socket), /speaks protocol 1, this client .* needs protocol 2: upgrade polygate-sidecar/);
      assert.equal(fake.conns.length, 1);
    } finally {
      await fake.stop();
    }
  });
});
