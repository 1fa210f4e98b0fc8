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
// Needs the compiled package: (cd bindings/node && npm ci && npm run build).
import { existsSync } from "node:fs";
import { fileURLToPath, pathToFileURL } from "node:url";
import { parseArgs } from "node:util";

const entry = fileURLToPath(new URL("../../bindings/node/dist/esm/index.js", import.meta.url));
if (!existsSync(entry)) {
  process.stderr.write(`node_client: ${entry} is missing: build the package first (cd bindings/node && npm ci && npm run build)\n`);
  process.exit(2);
}
const { connect } = await import(pathToFileURL(entry).href);

const { values } = parseArgs({
  options: {
    socket: { type: "string" },
    concurrency: { type: "string", default: "64" },
    seconds: { type: "string", default: "5" },
    scope: { type: "string", default: "chat" },
    "est-tokens": { type: "string" },
    warmup: { type: "string", default: "0.5" },
  },
});
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

async function phase(durationS, record) {
  const lat = [];
  let calls = 0;
  const t0 = performance.now();
  const stopAt = t0 + durationS * 1000;
  await Promise.all(Array.from({ length: concurrency }, async () => {
    while (performance.now() < stopAt) {
      const s = performance.now();
      await oneCall();
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
if (warmup > 0) await phase(warmup, false);
const cpu0 = process.cpuUsage();
const { calls, elapsed, lat } = await phase(seconds, true);
const cpu = process.cpuUsage(cpu0);
lat.sort((a, b) => a - b);
const pct = (p) => (lat.length ? lat[Math.min(lat.length - 1, Math.floor(p * lat.length))] * 1000 : 0);
const round = (x, d = 1) => Math.round(x * 10 ** d) / 10 ** d;
process.stdout.write(JSON.stringify({
  lang: "node",
  concurrency,
  calls,
  seconds: round(elapsed, 3),
  calls_per_s: round(calls / elapsed),
  call_p50_us: round(pct(0.5)),
  call_p99_us: round(pct(0.99)),
  cpu_us_per_call: round(calls ? (cpu.user + cpu.system) / calls : 0, 2),
}) + "\n");
await client.close();
