#!/usr/bin/env node
// Bench driver for the Node.js client (DESIGN §16), run by `polygate-bench` as a
// subprocess: N concurrent workers on ONE client (one connection), each doing full
// success calls — call → acquire (Start) → success (Finish) → end — for S seconds.
// Prints ONE JSON line:
//   {"lang":"node","concurrency":N,"calls":…,"seconds":…,"calls_per_s":…,"call_p50_us":…,"call_p99_us":…,
//    "cpu_us_per_call":…}
// cpu_us_per_call is this process's CPU (user + system) over the timed window per
// call: the binding's own cost, which hardly moves when other work shares the machine.
// Any error ends the run with a non-zero exit and the error on stderr.
//
//   node bench/drivers/node_client.mjs --socket PATH --concurrency 64 --seconds 5 --scope chat [--est-tokens 10]
//
// --mode transport (DESIGN §17 goals): the same concurrency of requests to a local fake
// upstream (this script with --serve, in a child process so its CPU is not counted):
// with the plain global fetch, through polygate.fetch, and inside client.run(); prints
// the per-request CPU and p50 of each, and the transport's overhead (gated − plain)
// over run()'s (run − plain):
//   {"lang":"node","mode":"transport",…,"overhead_cpu_us":…,"run_overhead_cpu_us":…,"overhead_ratio":…}
// --mode stream: one stream of --chunks SSE events (default 1000, sent --gap-ms apart,
// default 1, so each is its own read as a model's tokens are) at a time, read whole,
// plain vs through the transport, for --seconds each; prints the CPU per stream of
// each and "cpu_ratio" (gated / plain).
//
// Needs the compiled package: (cd bindings/node && npm ci && npm run build).
import { existsSync } from "node:fs";
import { fileURLToPath, pathToFileURL } from "node:url";
import { parseArgs } from "node:util";

const entry = fileURLToPath(new URL("../../bindings/node/dist/esm/index.js", import.meta.url));
if (!existsSync(entry)) {
  process.stderr.write(`node_client: ${entry} is missing: build the package first (cd bindings/node && npm ci && npm run build)\n`);
  process.exit(2);
}
const polygate = await import(pathToFileURL(entry).href);
const { connect } = polygate;

const { values } = parseArgs({
  options: {
    socket: { type: "string" },
    concurrency: { type: "string", default: "64" },
    seconds: { type: "string", default: "5" },
    scope: { type: "string", default: "chat" },
    "est-tokens": { type: "string" },
    warmup: { type: "string", default: "0.5" },
    mode: { type: "string", default: "calls" },
    chunks: { type: "string", default: "1000" },
    "gap-ms": { type: "string", default: "1" },
    serve: { type: "boolean", default: false },
  },
});

// --serve: the fake upstream. POST /json → a chat completion with usage; POST /stream →
// --chunks SSE events (one write each) and a final usage chunk. Prints its port.
if (values.serve) {
  const http = await import("node:http");
  const n = Number(values.chunks);
  const usage = { prompt_tokens: 12, completion_tokens: 6, total_tokens: 18 };
  const json = JSON.stringify({
    id: "c1", object: "chat.completion", created: 0, model: "m",
    choices: [{ index: 0, message: { role: "assistant", content: "hello" }, finish_reason: "stop" }], usage,
  });
  const ev = `data: ${JSON.stringify({ id: "s1", object: "chat.completion.chunk", created: 0, model: "m", choices: [{ index: 0, delta: { content: "tok " }, finish_reason: null }], usage: null })}\n\n`;
  const last = `data: ${JSON.stringify({ id: "s1", object: "chat.completion.chunk", created: 0, model: "m", choices: [], usage })}\n\ndata: [DONE]\n\n`;
  const server = http.createServer(async (req, res) => {
    for await (const _ of req);
    if (req.url === "/stream") {
      res.writeHead(200, { "content-type": "text/event-stream" });
      // Paced like a model's tokens (--gap-ms apart), so each event is its own read.
      const gap = Number(values["gap-ms"]);
      for (let i = 0; i < n; i++) {
        res.write(ev);
        if (gap > 0) await new Promise((r) => setTimeout(r, gap));
      }
      res.end(last);
    } else {
      res.writeHead(200, { "content-type": "application/json" });
      res.end(json);
    }
  });
  server.keepAliveTimeout = 60_000;
  server.listen(0, "127.0.0.1", () => process.stdout.write(`${server.address().port}\n`));
  await new Promise(() => {});
}
const concurrency = Number(values.concurrency);
const seconds = Number(values.seconds);
const warmup = Number(values.warmup);
const estTokens = values["est-tokens"] === undefined ? undefined : Number(values["est-tokens"]);
for (const [k, v] of [["concurrency", concurrency], ["seconds", seconds], ["warmup", warmup]]) {
  if (!Number.isFinite(v) || v < 0 || (k === "concurrency" && (v < 1 || !Number.isInteger(v)))) {
    process.stderr.write(`node_client: bad --${k} ${v}\n`);
    process.exit(2);
  }
}

const client = await connect(values.socket);
const scope = values.scope;
const mode = values.mode;
if (!["calls", "transport", "stream"].includes(mode)) {
  process.stderr.write(`node_client: bad --mode ${mode} (calls | transport | stream)\n`);
  process.exit(2);
}
const opts = estTokens === undefined ? {} : { estTokens };

async function oneCall() {
  const call = await client.call(scope, opts);
  try {
    const permit = await call.acquire();
    await permit.success(estTokens === undefined ? {} : { tokens: estTokens });
  } finally {
    await call.end();
  }
}

async function phase(durationS, record, one = oneCall, n = concurrency) {
  const lat = [];
  let calls = 0;
  const t0 = performance.now();
  const stopAt = t0 + durationS * 1000;
  await Promise.all(Array.from({ length: n }, async () => {
    while (performance.now() < stopAt) {
      const s = performance.now();
      await one();
      calls++;
      if (record) lat.push(performance.now() - s);
    }
  }));
  return { calls, elapsed: (performance.now() - t0) / 1000, lat };
}

process.on("unhandledRejection", (e) => {
  process.stderr.write(`node_client: ${e?.name ?? "error"}: ${e?.message ?? e}\n`);
  process.exit(1);
});
const round = (x, d = 1) => Math.round(x * 10 ** d) / 10 ** d;

/** Timed phase of `one`: calls, calls/s, p50, CPU µs per call. */
async function measure(one, n = concurrency) {
  if (warmup > 0) await phase(warmup, false, one, n);
  const cpu0 = process.cpuUsage();
  const { calls, elapsed, lat } = await phase(seconds, true, one, n);
  const cpu = process.cpuUsage(cpu0);
  lat.sort((a, b) => a - b);
  const pct = (p) => (lat.length ? lat[Math.min(lat.length - 1, Math.floor(p * lat.length))] * 1000 : 0);
  return { calls, elapsed, p50: pct(0.5), p99: pct(0.99), cpu: calls ? (cpu.user + cpu.system) / calls : 0 };
}

/** The fake upstream in a child process; resolves with its base URL. */
async function upstream() {
  const { spawn } = await import("node:child_process");
  const child = spawn(process.execPath, [fileURLToPath(import.meta.url), "--serve", "--chunks", values.chunks, "--gap-ms", values["gap-ms"]], { stdio: ["ignore", "pipe", "inherit"] });
  process.on("exit", () => child.kill());
  const port = await new Promise((resolve, reject) => {
    child.stdout.once("data", (d) => resolve(Number(String(d).trim())));
    child.once("exit", (c) => reject(new Error(`the fake upstream exited (${c})`)));
  });
  return { url: `http://127.0.0.1:${port}`, child };
}

if (mode === "calls") {
  const r = await measure(oneCall);
  process.stdout.write(JSON.stringify({
    lang: "node",
    concurrency,
    calls: r.calls,
    seconds: round(r.elapsed, 3),
    calls_per_s: round(r.calls / r.elapsed),
    call_p50_us: round(r.p50),
    call_p99_us: round(r.p99),
    cpu_us_per_call: round(r.cpu, 2),
  }) + "\n");
} else {
  const up = await upstream();
  const gated = polygate.fetch({ scope, client });
  const body = JSON.stringify({ model: "m", max_tokens: 10, messages: [{ role: "user", content: "hello" }] });
  const init = { method: "POST", headers: { "content-type": "application/json" }, body };
  if (mode === "transport") {
    const req = (f) => async () => {
      const r = await f(`${up.url}/json`, init);
      if (r.status !== 200) throw new Error(`upstream answered ${r.status}`);
      await r.json();
    };
    const plainReq = req(globalThis.fetch);
    const plain = await measure(plainReq);
    const viaGate = await measure(req(gated));
    // The same request inside run(): what gating it by hand costs.
    const viaRun = await measure(() => client.run(scope, () => plainReq()));
    process.stdout.write(JSON.stringify({
      lang: "node", mode, concurrency,
      plain_req_per_s: round(plain.calls / plain.elapsed), gated_req_per_s: round(viaGate.calls / viaGate.elapsed),
      run_req_per_s: round(viaRun.calls / viaRun.elapsed),
      plain_p50_us: round(plain.p50), gated_p50_us: round(viaGate.p50), run_p50_us: round(viaRun.p50),
      plain_cpu_us: round(plain.cpu, 2), gated_cpu_us: round(viaGate.cpu, 2), run_cpu_us: round(viaRun.cpu, 2),
      overhead_cpu_us: round(viaGate.cpu - plain.cpu, 2), run_overhead_cpu_us: round(viaRun.cpu - plain.cpu, 2),
      overhead_ratio: round((viaGate.cpu - plain.cpu) / (viaRun.cpu - plain.cpu), 3),
    }) + "\n");
  } else {
    const chunks = Number(values.chunks);
    const read = (f) => async () => {
      const r = await f(`${up.url}/stream`, init);
      let n = 0;
      for await (const c of r.body) n += c.length;
      if (n < chunks * 50) throw new Error(`short stream: ${n} bytes`);
    };
    let counted = 0;
    const reads = (f) => async () => {
      const r = await f(`${up.url}/stream`, init);
      for await (const _ of r.body) counted++;
    };
    await reads(globalThis.fetch)();
    const readsPerStream = counted;
    // Plain and gated streams alternate, one at a time, in an order that flips every
    // round, so a change in the machine's load (or an order effect) hits both alike.
    const cpuOf = async (f) => {
      const c0 = process.cpuUsage();
      await f();
      const c = process.cpuUsage(c0);
      return c.user + c.system;
    };
    await cpuOf(read(gated));
    const plain = { calls: 0, cpu: 0 };
    const viaGate = { calls: 0, cpu: 0 };
    const stopAt = performance.now() + seconds * 1000;
    for (let round = 0; performance.now() < stopAt; round++) {
      for (const [acc, f] of round % 2 ? [[viaGate, gated], [plain, globalThis.fetch]] : [[plain, globalThis.fetch], [viaGate, gated]]) {
        acc.cpu += await cpuOf(read(f));
        acc.calls++;
      }
    }
    plain.cpu /= plain.calls;
    viaGate.cpu /= viaGate.calls;
    process.stdout.write(JSON.stringify({
      lang: "node", mode, chunks, concurrency: 1,
      reads_per_stream: readsPerStream, plain_streams: plain.calls, gated_streams: viaGate.calls,
      plain_cpu_us_per_stream: round(plain.cpu), gated_cpu_us_per_stream: round(viaGate.cpu),
      cpu_ratio: round(viaGate.cpu / plain.cpu, 3),
    }) + "\n");
  }
  up.child.kill();
}
await client.close();
