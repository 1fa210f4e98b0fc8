// The client against a fake sidecar (real wire format): the two-frame call, held
// reports, cancellation, connection loss and reconnection, coalesced writes, limits.

import * as assert from "node:assert/strict";
import { spawn } from "node:child_process";
import * as net from "node:net";
import * as path from "node:path";
import { after, before, describe, test } from "node:test";
import { fileURLToPath } from "node:url";

import {
  AllSourcesExhaustedError, Call, CircuitOpenError, Client, GatewayUnavailableError, SidecarError, connect,
  defaultSocket, resolvePath,
} from "../src/index.js";
import { connectHint } from "../src/client.js";
import { FakeConn, FakeSidecar, Req, errorReply, until, variant } from "./fake-sidecar.js";

const T = { timeout: 10_000 };
const HERE = path.dirname(fileURLToPath(import.meta.url));

async function setup(tweak?: (f: FakeSidecar) => void): Promise<{ fake: FakeSidecar; client: Client; conn: FakeConn }> {
  const fake = await FakeSidecar.start();
  tweak?.(fake);
  const client = await connect(fake.socket);
  return { fake, client, conn: await fake.conn(0) };
}

async function teardown(fake: FakeSidecar, client: Client): Promise<void> {
  await client.close();
  await fake.stop();
}

// The fake sidecar, client and server-side connection of the running describe block
// (blocks run one after another).
let fake: FakeSidecar;
let client: Client;
let conn: FakeConn;

/** One fake sidecar and client for every test of a describe block. */
function sharedFake(): void {
  before(async () => ({ fake, client, conn } = await setup()));
  after(async () => teardown(fake, client));
}

describe("connecting", () => {
  test("Hello v3 → Welcome; the path falls back to $POLYGATE_SOCKET", T, async () => {
    const fake = await FakeSidecar.start();
    const old = process.env.POLYGATE_SOCKET;
    process.env.POLYGATE_SOCKET = fake.socket;
    try {
      assert.equal(resolvePath(), fake.socket);
      assert.equal(resolvePath("/x.sock"), "/x.sock");
      const client = await connect();
      const conn = await fake.conn(0);
      assert.equal(conn.hello!.protocol_version, 3);
      assert.equal(conn.hello!.client_name, "polygate-node/0.2.0");
      assert.equal(conn.hello!.pid, process.pid);
      assert.equal(client.sidecarVersion, "0.2.0-fake");
      assert.equal(client.protocolVersion, 3);
      assert.equal(await client.ping() >= 0, true);
      await client.close();
    } finally {
      if (old === undefined) delete process.env.POLYGATE_SOCKET;
      else process.env.POLYGATE_SOCKET = old;
      delete process.env.POLYGATE_SOCKET_UNUSED;
      await fake.stop();
    }
    delete process.env.POLYGATE_SOCKET;
    assert.equal(resolvePath(), defaultSocket());
    if (old !== undefined) process.env.POLYGATE_SOCKET = old;
  });

  test("the default socket: /run/polygate for root, $XDG_RUNTIME_DIR for anyone else", () => {
    assert.equal(defaultSocket(0, "/run/user/0"), "/run/polygate/sidecar.sock");
    assert.equal(defaultSocket(0, null), "/run/polygate/sidecar.sock");
    assert.equal(defaultSocket(1000, "/run/user/1000"), "/run/user/1000/polygate/sidecar.sock");
    assert.equal(defaultSocket(1000, "/run/user/1000/"), "/run/user/1000/polygate/sidecar.sock");
    for (const xdg of [null, "", "relative"]) {
      assert.throws(() => defaultSocket(1000, xdg), (e: unknown) => {
        assert.ok(e instanceof SidecarError);
        for (const w of ["uid 1000", "XDG_RUNTIME_DIR", "POLYGATE_SOCKET"]) assert.ok(e.message.includes(w), e.message);
        return true;
      });
    }
    const old = process.env.XDG_RUNTIME_DIR;
    try {
      process.env.XDG_RUNTIME_DIR = "/run/user/4242";
      assert.equal(defaultSocket(4242), "/run/user/4242/polygate/sidecar.sock");
    } finally {
      if (old === undefined) delete process.env.XDG_RUNTIME_DIR;
      else process.env.XDG_RUNTIME_DIR = old;
    }
  });

  test("a permission error names the setting to change", () => {
    const eacces = connectHint("EACCES");
    assert.ok(eacces.includes("POLYGATE_SOCKET") && eacces.includes("socket_mode"), eacces);
    const missing = connectHint("ENOENT");
    assert.ok(missing.includes("is polygate-sidecar running") && missing.includes("XDG_RUNTIME_DIR"), missing);
  });

  test("a version-1 sidecar: a clear error naming both versions", T, async () => {
    const fake = await FakeSidecar.start();
    fake.onHello = (c, f) => c.send(f.id, errorReply("ProtocolViolation", "protocol version 2 not supported; this sidecar speaks 1"));
    await assert.rejects(connect(fake.socket), (e: unknown) => {
      assert.ok(e instanceof SidecarError);
      assert.equal(e.kind, "protocol_violation");
      assert.match(e.message, /speaks protocol 1, this client .* needs protocol 2: upgrade polygate-sidecar/);
      return true;
    });
    fake.welcome = { Welcome: { protocol_version: 1, sidecar_version: "0.1.0", max_frame: 65536 } };
    fake.onHello = (c, f) => c.send(f.id, fake.welcome);
    await assert.rejects(connect(fake.socket), /answered with protocol 1, this client needs 2 to 3/);
    await fake.stop();
  });

  test("refused credentials (PermissionDenied, id 0) and a missing socket", T, async () => {
    const fake = await FakeSidecar.start();
    fake.onHello = (c) => {
      c.send(0, errorReply("PermissionDenied", "uid 1000 may not connect"));
      c.close();
    };
    await assert.rejects(connect(fake.socket), (e: unknown) => e instanceof SidecarError && e.kind === "permission_denied"
      && /uid 1000/.test(e.message));
    await fake.stop();
    await assert.rejects(connect("/nonexistent/pg.sock"), (e: unknown) => e instanceof SidecarError && e.kind === "connection"
      && /cannot connect to the PolyGate sidecar at \/nonexistent\/pg.sock \(ENOENT/.test(e.message));
  });

  test("no Welcome within the timeout", T, async () => {
    const fake = await FakeSidecar.start();
    fake.onHello = () => {};
    await assert.rejects(connect(fake.socket, { timeoutMs: 200 }), /no Welcome .* within 200 ms/);
    await fake.stop();
  });
});

describe("the two-frame call", () => {
  sharedFake();

  test("Start, then Finish on success: two frames, no EndCall", T, async () => {
    conn.requests.length = 0;
    const call = await client.call("chat", { estTokens: 1200, priority: "interactive", estInputTokens: 900, estOutputTokens: 300 });
    assert.equal(conn.requests.length, 0, "opening a call sends nothing");
    const p = await call.acquire();
    assert.equal(p.source, "a");
    assert.equal(p.attempt, 1);
    assert.equal(p.estTokens, 100);
    assert.equal(typeof p.id, "bigint");
    assert.equal(typeof call.id, "bigint");
    const r = await p.success({ tokens: 812 });
    assert.deepEqual(r, { applied: true, state: "closed", retryAfterS: 0 });
    assert.equal(p.result, r);
    await call.end();
    assert.deepEqual(conn.names(), ["Start", "Finish"]);
    const [start] = conn.named("Start");
    assert.deepEqual({ ...start, id: undefined }, {
      id: undefined, scope: "chat", est_tokens: 1200n, priority: "interactive", est_input_tokens: 900n, est_output_tokens: 300n,
    });
    assert.deepEqual(conn.named("Finish")[0]!.outcome, { Success: { tokens: 812n, count_attempt: true } });
    assert.equal(conn.named("Finish")[0]!.permit, p.id);
  });

  test("held failure travels as Retry; success with a split as SuccessUsage", T, async () => {
    conn.requests.length = 0;
    const call = await client.call("chat", { priority: "" });
    const p1 = await call.acquire();
    await p1.failure("timeout");
    assert.equal(p1.reported, true);
    assert.deepEqual(conn.names(), ["Start"], "a failure is held");
    const p2 = await call.acquire();
    assert.equal(p2.source, "b");
    assert.equal(p2.attempt, 2);
    await p2.rateLimited({ retryAfterS: 2.5 });
    const p3 = await call.acquire();
    await p3.failure("bad_result", { tokens: 740 });
    const p4 = await call.acquire();
    await p4.success({ countAttempt: false, tokens: 5 });
    const p5 = await call.acquire();
    await p5.success({ inputTokens: 1200, outputTokens: 334 });
    await call.end();
    assert.deepEqual(conn.names(), ["Start", "Retry", "Retry", "Retry", "Retry", "Finish"]);
    const retries = conn.named("Retry");
    assert.equal(conn.named("Start")[0]!.priority, null, "an empty priority is the default");
    assert.deepEqual(retries.map((r) => r.permit), [p1.id, p2.id, p3.id, p4.id]);
    assert.deepEqual(retries.map((r) => r.outcome), [
      { Failure: { kind: "Timeout" } },
      { RateLimited: { retry_after_s: 2.5 } },
      { FailureUsage: { kind: "BadResult", usage: { tokens: 740n, input_tokens: null, output_tokens: null } } },
      { Success: { tokens: 5n, count_attempt: false } },
    ]);
    assert.deepEqual(conn.named("Finish")[0]!.outcome,
      { SuccessUsage: { usage: { tokens: null, input_tokens: 1200n, output_tokens: 334n }, count_attempt: true } });
  });

  test("end() sends a held report as Finish, an unreported permit as EndCall, nothing for a finished call", T, async () => {
    conn.requests.length = 0;
    const c1 = await client.call("chat");
    const p1 = await c1.acquire();
    await p1.failure("server_error");
    const r = await c1.end();
    assert.deepEqual(r, { applied: true, state: "closed", retryAfterS: 0 });
    const c2 = await client.call("chat");
    const p2 = await c2.acquire();
    await p2.cancel();
    await c2.end();
    const c3 = await client.call("chat");
    await c3.acquire();
    await c3.end();
    await c3.end(); // idempotent
    const c4 = await client.call("chat");
    await c4.end(); // never started: nothing to send
    assert.deepEqual(conn.names(), ["Start", "Finish", "Start", "Finish", "Start", "EndCall"]);
    const fin = conn.named("Finish");
    assert.deepEqual(fin.map((f) => f.outcome), [{ Failure: { kind: "ServerError" } }, "Cancelled"]);
    assert.equal(conn.named("EndCall")[0]!.call, c3.id);
  });

  test("misuse: reporting twice, acquiring over an unreported permit, acquiring after the end", T, async () => {
    const call = await client.call("chat");
    const p = await call.acquire();
    await assert.rejects(call.acquire(), (e: unknown) => e instanceof SidecarError && e.kind === "busy");
    await p.failure("timeout");
    await assert.rejects(p.failure("timeout"), /already reported/);
    await assert.rejects(p.success(), /already reported/);
    await assert.rejects(p.failure("nope" as never), /unknown failure kind "nope"/);
    const p2 = await call.acquire();
    await assert.rejects(p2.rateLimited({ retryAfterS: -1 }), RangeError);
    await assert.rejects(p2.success({ tokens: -3 }), RangeError);
    await p2.success();
    await assert.rejects(call.acquire(), /is over/);
    await call.end();
    await assert.rejects(call.acquire(), /has ended/);
    await assert.rejects(client.call("chat", { estTokens: 1.5 }), RangeError);
    await assert.rejects(client.call(""), TypeError);
    await assert.rejects(client.forceOpen("a", 0), RangeError);
  });

  test("u64 ids beyond 2^53 stay exact both ways", T, async () => {
    const save = fake.handle;
    fake.handle = (req, c) => {
      const [name] = variant(req.request);
      if (name === "Start") {
        c.send(req.id, { Started: { call: (1n << 64n) - 1n, permit: (1n << 64n) - 2n, source: "東京", is_probe: true, attempt: 2, est_tokens: 1n << 40n } });
      } else fake.auto(req, c);
    };
    conn.requests.length = 0;
    const call = await client.call("chat");
    const p = await call.acquire();
    assert.equal(call.id, (1n << 64n) - 1n);
    assert.equal(p.id, (1n << 64n) - 2n);
    assert.equal(p.source, "東京");
    assert.equal(p.isProbe, true);
    assert.equal(p.estTokens, 2 ** 40);
    await p.success();
    assert.equal(conn.named("Finish")[0]!.permit, (1n << 64n) - 2n);
    fake.handle = save;
  });

  test("status() is keyed by name and keeps big integers; admin ops send their frames", T, async () => {
    const save = fake.handle;
    const doc = {
      sidecar_version: "0.2.0", backend: "redis", protocol_version: 2, future_key: 1,
      scopes: [{ name: "chat", circuit_open: "wait", quota_full: "fail_fast", waiters: 1, calls: 2,
        sources: [{ name: "a", state: "open", epoch: 0, retry_after_s: 1.5 }, { name: "b", state: "half_open", epoch: 0 }] }],
    };
    fake.handle = (req, c) => {
      if (variant(req.request)[0] === "StatusJson") {
        c.send(req.id, { StatusJson: JSON.stringify(doc).replace('"epoch":0,"retry', '"epoch":18446744073709551615,"retry') });
      } else fake.auto(req, c);
    };
    const st = await client.status();
    assert.equal(st.backend, "redis");
    assert.equal(st.future_key, 1, "unknown keys are kept");
    assert.deepEqual(Object.keys(st.scopes), ["chat"]);
    assert.deepEqual(Object.keys(st.scopes.chat!.sources), ["a", "b"]);
    assert.equal(st.scopes.chat!.sources.a!.epoch, 18446744073709551615n);
    assert.equal(st.scopes.chat!.sources.a!.state, "open");
    assert.equal(st.scopes.chat!.sources.a!.name, undefined);
    assert.equal(st.scopes.chat!.waiters, 1);
    fake.handle = save;
    conn.requests.length = 0;
    await client.forceOpen("a", 0.1);
    await client.forceClose("a");
    await client.reset("quelle-äöü");
    assert.deepEqual(conn.requests.map((r) => r.request), [
      { ForceOpen: { source: "a", seconds: 0.1 } }, { ForceClose: { source: "a" } }, { Reset: { source: "quelle-äöü" } },
    ]);
    fake.handle = (req, c) => c.send(req.id, errorReply("PermissionDenied", "uid 1000 is not in admin_uids"));
    await assert.rejects(client.reset("a"), (e: unknown) => e instanceof SidecarError && e.kind === "permission_denied");
    fake.handle = save;
  });
});

describe("errors of a call", () => {
  sharedFake();

  test("CircuitOpen on Retry: typed fields, and the call is gone (no EndCall)", T, async () => {
    fake.handle = (req, c) => {
      if (variant(req.request)[0] === "Retry") {
        c.send(req.id, errorReply("CircuitOpen", "every source of scope chat has an open circuit", {
          retry_after_s: 12.75, per_source_reasons: [["a", "CircuitOpen"], ["b", "Paced"]], scope: "chat",
        }));
      } else fake.auto(req, c);
    };
    conn.requests.length = 0;
    const call = await client.call("chat");
    await (await call.acquire()).failure("timeout");
    await assert.rejects(call.acquire(), (e: unknown) => {
      assert.ok(e instanceof CircuitOpenError && e instanceof GatewayUnavailableError);
      assert.equal(e.name, "CircuitOpenError");
      assert.equal(e.kind, "circuit_open");
      assert.equal(e.retryAfterS, 12.75);
      assert.deepEqual(e.perSourceReasons, { a: "circuit_open", b: "paced" });
      assert.equal(e.scope, "chat");
      return true;
    });
    await call.end();
    assert.deepEqual(conn.names(), ["Start", "Retry"]);
  });

  test("AllSourcesExhausted on Start: reason; no call left", T, async () => {
    fake.handle = (req, c) => c.send(req.id, errorReply("AllSourcesExhausted", "3 of max_attempts 3 used", { exhausted: "RetryExhausted", scope: "chat" }));
    conn.requests.length = 0;
    const call = await client.call("chat");
    await assert.rejects(call.acquire(), (e: unknown) => e instanceof AllSourcesExhaustedError && e.reason === "retry_exhausted"
      && e.name === "AllSourcesExhaustedError");
    await call.end();
    assert.deepEqual(conn.names(), ["Start"]);
  });

  test("BackendUnavailable is the base GatewayUnavailableError; unknown scope a SidecarError", T, async () => {
    fake.handle = (req, c) => c.send(req.id, errorReply("BackendUnavailable", "redis unreachable"));
    await assert.rejects((await client.call("chat")).acquire(),
      (e: unknown) => e instanceof GatewayUnavailableError && e.constructor === GatewayUnavailableError && e.kind === "backend_unavailable");
    fake.handle = (req, c) => c.send(req.id, errorReply("UnknownScope", 'unknown scope "x"', { scope: "x" }));
    await assert.rejects((await client.call("x")).acquire(),
      (e: unknown) => e instanceof SidecarError && e.kind === "unknown_scope" && e.scope === "x");
  });

  test("Retry refused as UnknownPermit: the call lives on (Acquire next, EndCall at the end)", T, async () => {
    conn.requests.length = 0;
    let refused = false;
    fake.handle = (req, c) => {
      if (variant(req.request)[0] === "Retry" && !refused) {
        refused = true;
        c.send(req.id, errorReply("UnknownPermit", "no permit"));
      } else fake.auto(req, c);
    };
    const call = await client.call("chat");
    await (await call.acquire()).failure("timeout");
    await assert.rejects(call.acquire(), (e: unknown) => e instanceof SidecarError && e.kind === "unknown_permit");
    const p = await call.acquire();
    assert.equal(p.attempt, 2);
    await p.failure("timeout");
    await call.end();
    assert.deepEqual(conn.names(), ["Start", "Retry", "Acquire", "Finish"]);
  });

  test("Retry refused as InvalidArgument: the permit is unreported again", T, async () => {
    conn.requests.length = 0;
    fake.handle = (req, c) => {
      const [name, body] = variant(req.request);
      const bad = name === "Retry" && JSON.stringify(body.outcome, (_k, v) => (typeof v === "bigint" ? String(v) : v)).includes("2000000000");
      if (bad) c.send(req.id, errorReply("InvalidArgument", "tokens 2000000000 exceeds 1000000000"));
      else fake.auto(req, c);
    };
    const call = await client.call("chat");
    const p = await call.acquire();
    await p.failure("error", { tokens: 2_000_000_000 });
    await assert.rejects(call.acquire(), (e: unknown) => e instanceof SidecarError && e.kind === "invalid_argument");
    assert.equal(p.reported, false);
    assert.equal(call.currentPermit, p);
    await p.failure("error", { tokens: 10 });
    const p2 = await call.acquire();
    await p2.success();
    assert.deepEqual(conn.names(), ["Start", "Retry", "Retry", "Finish"]);
  });

  test("Finish refused as UnknownPermit (reclaimed): end() sends EndCall", T, async () => {
    conn.requests.length = 0;
    fake.handle = (req, c) => {
      if (variant(req.request)[0] === "Finish") c.send(req.id, errorReply("UnknownPermit", "no permit"));
      else fake.auto(req, c);
    };
    const call = await client.call("chat");
    const p = await call.acquire();
    await assert.rejects(p.success(), (e: unknown) => e instanceof SidecarError && e.kind === "unknown_permit");
    await call.end();
    assert.deepEqual(conn.names(), ["Start", "Finish", "EndCall"]);
    fake.handle = (req, c) => fake.auto(req, c);
  });
});

describe("cancellation", () => {
  let held: Req[] = [];
  sharedFake();

  /** Acquire, wait until the fake holds the request, abort: the acquire rejects with AbortError. */
  async function abortWhileWaiting(call: Call): Promise<void> {
    const ac = new AbortController();
    const p = call.acquire({ signal: ac.signal });
    await until(() => held.length === 1, 3000, "the held acquire");
    ac.abort();
    await assert.rejects(p, (e: unknown) => (e as Error).name === "AbortError");
  }

  function holdAcquires(): void {
    held = [];
    fake.handle = (req, c) => {
      const [name, body] = variant(req.request);
      if (name === "Start" || name === "Retry") held.push(req);
      else if (name === "Cancel") {
        const t = held.findIndex((h) => h.id === body.target);
        if (t >= 0) {
          c.send(held[t]!.id, errorReply("Cancelled", "cancelled"));
          held.splice(t, 1);
        }
        c.send(req.id, "Ok");
      } else fake.auto(req, c);
    };
  }

  test("aborting a waiting Start sends Cancel for it; nothing is left", T, async () => {
    holdAcquires();
    conn.requests.length = 0;
    const call = await client.call("chat");
    await abortWhileWaiting(call);
    await call.end();
    assert.deepEqual(conn.names(), ["Start", "Cancel"]);
    assert.equal(conn.named("Cancel")[0]!.target, conn.named("Start")[0]!.id);
    await assert.rejects(call.acquire(), /has ended/);
  });

  test("an already-aborted signal sends nothing; a reason is passed through", T, async () => {
    conn.requests.length = 0;
    const call = await client.call("chat");
    await assert.rejects(call.acquire({ signal: AbortSignal.abort(new Error("mine")) }), /mine/);
    assert.deepEqual(conn.names(), []);
    holdAcquires();
    const ac = new AbortController();
    const p = call.acquire({ signal: ac.signal });
    await until(() => held.length === 1, 3000, "the Start");
    ac.abort(new Error("stop it"));
    await assert.rejects(p, /stop it/);
    await call.end();
  });

  test("a grant that raced the Cancel is finished unused (Finish Cancelled)", T, async () => {
    held = [];
    conn.requests.length = 0;
    fake.handle = (req, c) => {
      const [name] = variant(req.request);
      if (name === "Start") held.push(req);
      else if (name === "Cancel") {
        // The grant was already on its way: the target gets its normal reply.
        c.sendAll([[held[0]!.id, { Started: { call: 9n, permit: 99n, source: "a", is_probe: true, attempt: 1, est_tokens: 5n } }], [req.id, "Ok"]]);
      } else fake.auto(req, c);
    };
    const call = await client.call("chat");
    await abortWhileWaiting(call);
    await call.end(); // waits for the release
    assert.deepEqual(conn.names(), ["Start", "Cancel", "Finish"]);
    assert.deepEqual(conn.named("Finish")[0], { id: conn.named("Finish")[0]!.id, permit: 99n, outcome: "Cancelled" });
  });

  test("aborting a waiting Retry: the held report went with it, the call is over", T, async () => {
    conn.requests.length = 0;
    fake.handle = (req, c) => fake.auto(req, c);
    const call = await client.call("chat");
    const p1 = await call.acquire();
    await p1.failure("timeout");
    holdAcquires();
    await abortWhileWaiting(call);
    await call.end();
    assert.deepEqual(conn.names(), ["Start", "Retry", "Cancel"]);
    assert.deepEqual(conn.named("Retry")[0]!.outcome, { Failure: { kind: "Timeout" } });
  });

  test("one signal shared by many waiting acquires: all cancelled, one listener, no warning", T, async () => {
    holdAcquires();
    conn.requests.length = 0;
    const warnings: Error[] = [];
    const onWarning = (w: Error): void => void warnings.push(w);
    process.on("warning", onWarning);
    const ac = new AbortController();
    const calls = await Promise.all(Array.from({ length: 50 }, () => client.call("chat")));
    const outcomes = calls.map((c) => c.acquire({ signal: ac.signal }).then(() => null, (e: unknown) => e));
    await until(() => held.length === 50, 3000, "50 Starts");
    ac.abort();
    for (const e of await Promise.all(outcomes)) assert.equal((e as Error).name, "AbortError");
    for (const c of calls) await c.end();
    await new Promise((r) => setImmediate(r));
    process.off("warning", onWarning);
    assert.deepEqual(warnings.map((w) => w.message), []);
    assert.equal(conn.named("Cancel").length, 50);
  });

  test("end() while an acquire waits cancels it", T, async () => {
    holdAcquires();
    conn.requests.length = 0;
    const call = await client.call("chat");
    const p = call.acquire();
    const outcome = p.then(() => null, (e: unknown) => e);
    await until(() => held.length === 1, 3000, "the Start");
    await call.end();
    assert.equal(((await outcome) as Error).name, "AbortError");
    assert.deepEqual(conn.names(), ["Start", "Cancel"]);
  });
});

describe("the connection", () => {
  test("a closed connection fails every pending promise with SidecarError; the next use reconnects", T, async () => {
    const { fake, client } = await setup();
    const held: Req[] = [];
    fake.handle = (req) => held.push(req);
    const calls = await Promise.all([1, 2, 3].map(() => client.call("chat")));
    const pending = calls.map((c) => c.acquire());
    const st = client.status();
    await until(() => held.length === 4, 3000, "4 requests");
    (await fake.conn(0)).close();
    for (const p of [...pending, st]) {
      await assert.rejects(p, (e: unknown) => e instanceof SidecarError && e.kind === "connection"
        && /connection to the sidecar at .* was lost/.test(e.message));
    }
    for (const c of calls) await c.end(); // nothing to do, never throws
    fake.handle = (req, c) => fake.auto(req, c);
    const r = await client.run("chat", async (p) => p.source);
    assert.equal(r, "a");
    assert.equal(fake.conns.length, 2, "reconnected once");
    assert.equal(fake.conns[1]!.hello!.protocol_version, 3);
    await teardown(fake, client);
  });

  test("a fatal id-0 error before the close names the reason", T, async () => {
    const { fake, client } = await setup();
    fake.handle = (_req, c) => {
      c.send(0, errorReply("Overloaded", "too many connections (max_connections = 1024); retry later"));
      c.close();
    };
    await assert.rejects((await client.call("chat")).acquire(),
      (e: unknown) => e instanceof SidecarError && e.kind === "overloaded" && /max_connections/.test(e.message));
    await teardown(fake, client);
  });

  test("an undecodable reply or an oversize frame closes the connection with a protocol error", T, async () => {
    const { fake, client } = await setup();
    fake.handle = (req, c) => {
      const b = Buffer.alloc(16);
      b.writeUInt32BE(12, 0);
      b.writeBigUInt64LE(req.id, 4);
      b.writeUInt32LE(42, 12); // no such Reply tag
      c.raw(b);
    };
    await assert.rejects(client.status(), (e: unknown) => e instanceof SidecarError && e.kind === "protocol" && /unknown tag 42/.test(e.message));
    fake.handle = (_req, c) => {
      const b = Buffer.alloc(4);
      b.writeUInt32BE(16 * 1024 * 1024 + 1, 0);
      c.raw(b);
    };
    await assert.rejects(client.status(), /frame of 16777217 bytes \(limit 16777216\)/);
    await teardown(fake, client);
  });

  test("a 1 MiB status in many chunks is read; requests over max_frame are refused before sending", T, async () => {
    const { fake, client } = await setup((f) => {
      f.welcome = { Welcome: { protocol_version: 2, sidecar_version: "x", max_frame: 1024 } };
    });
    const sources = Array.from({ length: 8000 }, (_, i) => ({ name: `source-${i}`, state: "closed", epoch: i, padding: "x".repeat(80) }));
    const text = JSON.stringify({ sidecar_version: "x", backend: "memory", scopes: [{ name: "big", sources }] });
    assert.ok(text.length > 1 << 20);
    fake.handle = (req, c) => {
      const whole = Buffer.concat([Buffer.alloc(0), encodeStatusJson(req.id, text)]);
      // dribble it out in 64 KiB pieces
      for (let off = 0; off < whole.length; off += 65536) c.raw(whole.subarray(off, off + 65536));
    };
    const st = await client.status();
    assert.equal(Object.keys(st.scopes.big!.sources).length, 8000);
    assert.equal(st.scopes.big!.sources["source-7999"]!.epoch, 7999);
    assert.equal(client.maxFrame, 1024);
    await assert.rejects((await client.call("s".repeat(2000))).acquire(),
      (e: unknown) => e instanceof SidecarError && e.kind === "frame_too_large");
    await teardown(fake, client);
  });

  test("frames of one tick go out in one write (200 Starts, then 200 Finishes)", { timeout: 20_000 }, async () => {
    const { fake, client, conn } = await setup();
    const held: Req[] = [];
    fake.handle = (req, c) => {
      if (variant(req.request)[0] === "Start") held.push(req);
      else fake.auto(req, c);
    };
    let writes = 0;
    const orig = net.Socket.prototype.write;
    net.Socket.prototype.write = function (this: net.Socket, ...args: unknown[]) {
      if (!fake.serverSockets.has(this)) writes++;
      return (orig as (...a: unknown[]) => boolean).apply(this, args);
    } as typeof orig;
    try {
      conn.requests.length = 0;
      const runs = Array.from({ length: 200 }, () => client.run("chat", async (p) => p.id));
      await until(() => held.length === 200, 5000, "200 Starts");
      assert.equal(writes, 1, "200 Starts in one write");
      assert.equal(conn.reads <= 2, true, `200 Starts arrived in ${conn.reads} reads`);
      writes = 0;
      // Answer all 200 in one write: every run resolves and sends its Finish in the same tick.
      conn.sendAll(held.map((h, i) => [h.id, { Started: { call: BigInt(i + 1), permit: BigInt(i + 1), source: "a", is_probe: false, attempt: 1, est_tokens: 1n } }]));
      const ids = await Promise.all(runs);
      assert.equal(new Set(ids.map(String)).size, 200);
      assert.equal(conn.named("Finish").length, 200);
      assert.equal(writes, 1, `200 Finishes in ${writes} writes`);
    } finally {
      net.Socket.prototype.write = orig;
    }
    await teardown(fake, client);
  });

  test("an idle client does not keep the process alive", { timeout: 20_000 }, async () => {
    const fake = await FakeSidecar.start();
    const script = `import { connect } from ${JSON.stringify(path.join(HERE, "..", "src", "index.js"))};
      const c = await connect(${JSON.stringify(fake.socket)});
      const call = await c.call("chat"); const p = await call.acquire(); await p.success();
      console.log("done " + p.source);`;
    // Async: the fake sidecar lives in this process and must keep serving.
    const child = spawn(process.execPath, ["--input-type=module", "-e", script], { stdio: ["ignore", "pipe", "pipe"] });
    let stdout = "";
    let stderr = "";
    child.stdout.on("data", (d) => (stdout += d));
    child.stderr.on("data", (d) => (stderr += d));
    const killer = setTimeout(() => child.kill("SIGKILL"), 10_000);
    const code = await new Promise<number | null>((r) => child.once("exit", (c) => r(c)));
    clearTimeout(killer);
    assert.equal(code, 0, `the child did not exit by itself: ${stderr}`);
    assert.equal(stdout.trim(), "done a");
    await fake.stop();
  });
});

function encodeStatusJson(id: bigint, text: string): Buffer {
  const s = Buffer.from(text, "utf8");
  const b = Buffer.alloc(4 + 8 + 4 + 8 + s.length);
  b.writeUInt32BE(b.length - 4, 0);
  b.writeBigUInt64LE(id, 4);
  b.writeUInt32LE(9, 12);
  b.writeBigUInt64LE(BigInt(s.length), 16);
  s.copy(b, 24);
  return b;
}

describe("run()", () => {
  sharedFake();

  const outcomes = (): unknown[] => conn.requests.filter((r) => ["Retry", "Finish"].includes(variant(r.request)[0]))
    .map((r) => variant(r.request)[1].outcome);

  test("classifies, fails over and settles tokens from the result's usage", T, async () => {
    conn.requests.length = 0;
    const seen: string[] = [];
    let n = 0;
    const r = await client.run("chat", { estTokens: 50 }, async (p) => {
      seen.push(p.source);
      n++;
      if (n === 1) throw Object.assign(new Error("Service Unavailable"), { status: 503 });
      if (n === 2) throw new Response(null, { status: 429, headers: { "retry-after": "3" } });
      if (n === 3) throw Object.assign(new Error("socket hang up"), { code: "ECONNRESET" });
      if (n === 4) throw new DOMException("The operation timed out.", "TimeoutError");
      return { usage: { prompt_tokens: 1000, completion_tokens: 200, total_tokens: 1200, prompt_tokens_details: { cached_tokens: 400 } } };
    });
    assert.equal(n, 5);
    assert.deepEqual(seen, ["a", "b", "c", "a", "b"]);
    assert.ok(r.usage.total_tokens === 1200);
    assert.deepEqual(outcomes(), [
      { Failure: { kind: "ServerError" } },
      { RateLimited: { retry_after_s: 3 } },
      { Failure: { kind: "Connection" } },
      { Failure: { kind: "Timeout" } },
      // v3: the cached reads go out with the usage (SuccessCached, outcome tag 6)
      { SuccessCached: { usage: { tokens: 1200n, input_tokens: 600n, output_tokens: 200n }, cached_input_tokens: 400n,
        count_attempt: true } },
    ]);
    assert.equal(conn.named("Start")[0]!.est_tokens, 50n);
  });

  test("permit.tokens overrides the usage; Anthropic usage is read", T, async () => {
    conn.requests.length = 0;
    await client.run("chat", async (p) => {
      p.tokens = 812;
      return { usage: { total_tokens: 5 } };
    });
    await client.run("chat", async () => ({ usage: { input_tokens: 30, output_tokens: 7, cache_read_input_tokens: 100 } }));
    await client.run("chat", async () => "no usage");
    assert.deepEqual(outcomes(), [
      { Success: { tokens: 812n, count_attempt: true } },
      { SuccessCached: { usage: { tokens: null, input_tokens: 30n, output_tokens: 7n }, cached_input_tokens: 100n,
        count_attempt: true } },
      { Success: { tokens: null, count_attempt: true } },
    ]);
  });

  test("another 4xx is reported and re-thrown at once (not retried)", T, async () => {
    conn.requests.length = 0;
    let n = 0;
    const bad = Object.assign(new Error("Bad Request"), { status: 400, headers: {} });
    await assert.rejects(client.run("chat", async () => {
      n++;
      throw bad;
    }), (e: unknown) => e === bad);
    assert.equal(n, 1);
    assert.deepEqual(conn.names(), ["Start", "Finish"]);
    assert.deepEqual(outcomes(), [{ Failure: { kind: "Error" } }]);
  });

  test("the call's final error carries the last upstream error as cause", T, async () => {
    conn.requests.length = 0;
    let n = 0;
    fake.handle = (req, c) => {
      if (variant(req.request)[0] === "Retry" && ++n === 2) {
        c.send(req.id, errorReply("AllSourcesExhausted", "2 of max_attempts 2 used", { exhausted: "RetryExhausted", scope: "chat" }));
      } else fake.auto(req, c);
    };
    const boom = new Error("boom");
    await assert.rejects(client.run("chat", async () => {
      throw boom;
    }), (e: unknown) => e instanceof AllSourcesExhaustedError && e.cause === boom);
    assert.deepEqual(conn.names(), ["Start", "Retry", "Retry"], "no EndCall after the call's final error");
    fake.handle = (req, c) => fake.auto(req, c);
  });

  test("a classify hook decides first; undefined falls back to the rules", T, async () => {
    conn.requests.length = 0;
    let n = 0;
    await client.run("chat", {
      classify: (err) => ((err as Error).message === "refusal" ? "bad_result" : (err as Error).message === "slow" ? { kind: "rate_limited", retryAfterS: 1 } : undefined),
    }, async () => {
      n++;
      if (n === 1) throw new Error("refusal");
      if (n === 2) throw new Error("slow");
      if (n === 3) throw Object.assign(new Error("x"), { statusCode: 502 });
      return 1;
    });
    assert.deepEqual(outcomes(), [
      { Failure: { kind: "BadResult" } }, { RateLimited: { retry_after_s: 1 } }, { Failure: { kind: "ServerError" } },
      { Success: { tokens: null, count_attempt: true } },
    ]);
  });

  test("aborting the run's signal while fn runs: Finish Cancelled, the error re-thrown", T, async () => {
    conn.requests.length = 0;
    const ac = new AbortController();
    await assert.rejects(client.run("chat", { signal: ac.signal }, async () => {
      ac.abort();
      throw new DOMException("aborted", "AbortError");
    }), (e: unknown) => (e as Error).name === "AbortError");
    assert.deepEqual(conn.names(), ["Start", "Finish"]);
    assert.deepEqual(outcomes(), ["Cancelled"]);
  });

  test("a report made inside fn stands (run does not report twice)", T, async () => {
    conn.requests.length = 0;
    const r = await client.run("chat", async (p) => {
      await p.success({ tokens: 9 });
      return "ok";
    });
    assert.equal(r, "ok");
    let n = 0;
    await client.run("chat", async (p) => {
      if (n++ === 0) {
        await p.rateLimited({ retryAfterS: 2 });
        throw new Error("429 handled by hand");
      }
      return 1;
    });
    assert.deepEqual(outcomes(), [
      { Success: { tokens: 9n, count_attempt: true } },
      { RateLimited: { retry_after_s: 2 } },
      { Success: { tokens: null, count_attempt: true } },
    ]);
  });

  test("a throwing success (bad count) abandons the permit via EndCall", T, async () => {
    conn.requests.length = 0;
    await assert.rejects(client.run("chat", async (p) => {
      p.tokens = -1;
      return 1;
    }), RangeError);
    assert.deepEqual(conn.names(), ["Start", "EndCall"]);
  });
});
