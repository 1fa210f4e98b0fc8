// End to end against the real daemon (memory and Redis): 1,000 concurrent runs on one
// connection, failover, reconnecting after a restart, the example worker and the
// README quick start as written.

import * as assert from "node:assert/strict";
import { spawn } from "node:child_process";
import * as fs from "node:fs";
import * as path from "node:path";
import { describe, test } from "node:test";

import { Client, SidecarError, connect } from "../src/index.js";
import { REPO, Sidecar, sleep, tempDir, withDaemon } from "./support.js";

const CONFIG = `
[scopes.chat]
circuit_open = "fail_fast"
quota_full = "wait"
max_attempts = 3
poll_interval = "10ms"
stall_window = "30s"

[scopes.chat.breaker]
failure_threshold = 1000

[scopes.chat.pacer]
initial = 256
max = 512

[[scopes.chat.sources]]
name = "a"
timeout = "10s"

[[scopes.chat.sources]]
name = "b"
timeout = "10s"
`;

for (const backend of ["memory", "redis"]) {
  describe(`real daemon [${backend}]`, () => {
    test("1,000 concurrent runs on one connection", { timeout: 60_000 }, async (t) => {
      // 1,000 calls on a loaded machine: a 5 s Redis timeout keeps every source on Redis.
      await withDaemon(CONFIG, backend, (why) => t.skip(why), async (client) => {
        const N = 1000;
        const inFlight = { now: 0, max: 0 };
        const results = await Promise.all(Array.from({ length: N }, (_, i) => client.run("chat", { estTokens: 10 }, async (permit) => {
          inFlight.now++;
          inFlight.max = Math.max(inFlight.max, inFlight.now);
          await sleep(i % 7); // overlap the attempts
          inFlight.now--;
          permit.tokens = 5;
          return `${i}:${permit.source}`;
        })));
        assert.equal(new Set(results).size, N);
        assert.ok(inFlight.max > 50, `only ${inFlight.max} attempts overlapped`);
        const st = await client.status();
        const chat = st.scopes.chat!;
        assert.equal(chat.calls, 0);
        assert.equal(chat.waiters, 0);
        const srcs = Object.values(chat.sources);
        assert.equal(srcs.reduce((s, x) => s + Number(x.window_successes), 0), N);
        for (const s of srcs) assert.equal(s.in_flight, 0);
      }, "5s");
    });

    test("run() fails over past a failing source; status shows it", { timeout: 30_000 }, async (t) => {
      await withDaemon(CONFIG, backend, (why) => t.skip(why), async (client) => {
        const seen: string[] = [];
        const r = await client.run("chat", async (permit) => {
          seen.push(permit.source);
          if (permit.source === "a") throw Object.assign(new Error("upstream 503"), { status: 503 });
          return { usage: { total_tokens: 42 }, from: permit.source };
        });
        assert.equal(r.from, "b");
        assert.deepEqual(seen, ["a", "b"]);
        const a = (await client.status()).scopes.chat!.sources.a!;
        assert.equal(a.window_failures, 1);
        assert.equal(a.streak, 1);
        await assert.rejects(client.run("nope", async () => 1), (e: unknown) => e instanceof SidecarError && e.kind === "unknown_scope");
        await client.forceOpen("a", 5);
        assert.equal((await client.status()).scopes.chat!.sources.a!.state, "open");
        await client.forceClose("a");
        assert.equal((await client.status()).scopes.chat!.sources.a!.state, "closed");
      });
    });
  });
}

describe("real daemon: permit.limits set by hand (DESIGN §18)", () => {
  const OBSERVE = `
[scopes.chat]
circuit_open = "fail_fast"
quota_full = "wait"

[[scopes.chat.sources]]
name = "llm"
timeout = "5s"
tpm = 6000
rpm = 60
observe_limits = "on"
`;

  test("a plain object of the Limits keys reaches the sidecar; another shape throws at the assignment", { timeout: 30_000 }, async (t) => {
    await withDaemon(OBSERVE, "memory", (why) => t.skip(why), async (client) => {
      const call = await client.call("chat", { estTokens: 10 });
      try {
        const p = await call.acquire();
        // What JavaScript without TypeScript may assign: each is refused where it is assigned.
        const bad: [unknown, RegExp][] = [
          [new Headers({ "x-ratelimit-remaining-tokens": "5" }), /must be a Limits.*parseRateLimitHeaders/],
          [{ tokens: 200 }, /permit\.limits\.tokens must be a Limit/],
          [{ input_tokens: { remaining: 5 } }, /unknown key input_tokens; a Limits has/],
          [{ tokens: { remaining: 5, reset_s: 20 } }, /permit\.limits\.tokens: unknown key reset_s/],
          [{ tokens: { remaining: "5" } }, /permit\.limits\.tokens\.remaining must be a number/],
          [{ tokens: { remaining: -1 } }, /permit\.limits\.tokens\.remaining must be an integer >= 0, got -1/],
          [{ requests: { limit: 1.5 } }, /permit\.limits\.requests\.limit must be an integer >= 0/],
          [{ tokens: { resetS: NaN } }, /permit\.limits\.tokens\.resetS must be a finite number/],
          [{ tokens: { remaining: 5 }, ageS: -2 }, /permit\.limits\.ageS must be a finite number >= 0/],
          ["tokens=5", /must be a Limits/],
          [[{ remaining: 5 }], /must be a Limits/],
        ];
        for (const [v, re] of bad) {
          assert.throws(() => { (p as { limits: unknown }).limits = v; }, (e: unknown) => e instanceof TypeError && re.test(e.message), String(v));
          assert.equal(p.limits, null);
        }
        (p as { limits: unknown }).limits = { tokens: { limit: 6000, remaining: 200, resetS: 20 }, requests: { remaining: 5 } };
        await p.success({ tokens: 10 });
      } finally {
        await call.end();
      }
      const src = (await client.status()).scopes.chat!.sources.llm!;
      const buckets = src.buckets as { bucket: string; level: number; observed: { remaining: number } | null }[];
      const tpm = buckets.find((b) => b.bucket === "tpm")!;
      const rpm = buckets.find((b) => b.bucket === "rpm")!;
      assert.equal(tpm.observed?.remaining, 200, JSON.stringify(tpm));
      assert.ok(tpm.level <= 400, JSON.stringify(tpm)); // 200, plus at most two seconds' refill
      assert.equal(rpm.observed?.remaining, 5, JSON.stringify(rpm));
      assert.equal(src.in_flight, 0);
    });
  });
});

describe("real daemon: connection life", () => {
  test("a restarted sidecar: pending calls fail with SidecarError, the next run reconnects", { timeout: 60_000 }, async () => {
    const sidecar = new Sidecar();
    // `slow` has one request a minute: its second call waits in the sidecar.
    sidecar.writeConfig(`${CONFIG}\n[scopes.slow]\nquota_full = "wait"\n\n[[scopes.slow.sources]]\nname = "s"\nrpm = 1\n`);
    let client: Client | null = null;
    try {
      await sidecar.start();
      client = await connect(sidecar.socket);
      assert.equal(await client.run("chat", async (p) => p.source), "a");
      await client.run("slow", async () => 1);
      const waiting = client.run("slow", async () => 2);
      const outcome = waiting.then(() => null, (e: unknown) => e);
      await sleep(200);
      await sidecar.stop(); // SIGTERM: the waits end with ShuttingDown, then the connection closes
      const err = await outcome;
      assert.ok(err instanceof SidecarError, `expected a SidecarError, got ${String(err)}`);
      assert.ok(["shutting_down", "connection"].includes(err.kind), err.kind);
      await sidecar.start();
      assert.equal(await client.run("chat", async (p) => p.source), "a");
    } finally {
      await client?.close();
      await sidecar.stop();
      sidecar.cleanup();
    }
  });
});

/** A dir where `import "polygate"` resolves to this package, as `npm install ./bindings/node` makes it. */
function projectWithPolygate(): string {
  const dir = tempDir("pg-proj-");
  fs.mkdirSync(path.join(dir, "node_modules"));
  fs.symlinkSync(path.join(REPO, "bindings", "node"), path.join(dir, "node_modules", "polygate"), "dir");
  return dir;
}

/**
 * Preloaded before the example: a seeded Math.random ($SEED), so its simulated 20 %
 * timeouts are the same every run (and a run never loses all three attempts by chance).
 */
const SEEDED_RANDOM = "data:text/javascript," + encodeURIComponent(
  "let s = Number(process.env.SEED) || 1; Math.random = () => (s = (s * 16807) % 2147483647, (s - 1) / 2147483646);");

function runNode(file: string, env: Record<string, string>, timeoutMs = 20_000): Promise<{ code: number | null; out: string; err: string }> {
  return new Promise((resolve) => {
    const child = spawn(process.execPath, ["--import", SEEDED_RANDOM, file], { env: { ...process.env, ...env }, stdio: ["ignore", "pipe", "pipe"] });
    let out = "";
    let err = "";
    child.stdout.on("data", (d) => (out += d));
    child.stderr.on("data", (d) => (err += d));
    const t = setTimeout(() => child.kill("SIGKILL"), timeoutMs);
    child.once("exit", (code) => {
      clearTimeout(t);
      resolve({ code, out, err });
    });
  });
}

describe("examples and README", () => {
  const worker = fs.readFileSync(path.join(REPO, "examples", "worker.mjs"), "utf8");
  const readme = fs.readFileSync(path.join(REPO, "README.md"), "utf8");

  test("the README's Node.js quick start is examples/worker.mjs", { timeout: 10_000 }, () => {
    const section = readme.split(/^## /m).find((s) => s.startsWith("Node.js quick start"));
    assert.ok(section, "README.md has no \"## Node.js quick start\" section");
    const block = /```js\n([\s\S]*?)```/.exec(section!);
    assert.ok(block, "the section has no ```js block");
    const code = worker.split("\n").filter((_l, i, all) => i >= all.findIndex((x) => !x.startsWith("//"))).join("\n");
    assert.equal(block![1]!.trim(), code.trim());
    assert.match(section!, /npm install --no-save \.\/bindings\/node/);
    assert.match(section!, /node examples\/worker\.mjs/);
  });

  test("examples/worker.mjs runs as written against the example config", { timeout: 60_000 }, async () => {
    const sidecar = new Sidecar();
    const proj = projectWithPolygate();
    try {
      // The README's command 1 runs the embedded example config; here it runs from the
      // file with only the socket moved (the default path needs /run/polygate).
      fs.copyFileSync(path.join(REPO, "examples", "polygate.toml"), sidecar.configPath);
      await sidecar.start({ SIDECAR__SOCKET: sidecar.socket });
      fs.copyFileSync(path.join(REPO, "examples", "worker.mjs"), path.join(proj, "worker.mjs"));
      for (const seed of ["1", "7", "42"]) {
        const r = await runNode(path.join(proj, "worker.mjs"), { POLYGATE_SOCKET: sidecar.socket, SEED: seed });
        assert.equal(r.code, 0, `worker.mjs failed: ${r.err}`);
        const [text, state] = r.out.trim().split("\n");
        assert.match(text!, /^hello from (openai-gpt4o|azure-gpt4o-eu|vllm-llama-local)$/);
        assert.ok(["closed", "open", "half_open"].includes(state!), state);
      }
    } finally {
      await sidecar.stop();
      sidecar.cleanup();
      fs.rmSync(proj, { recursive: true, force: true });
    }
  });
});
