// The transport conformance scenarios (DESIGN §17, bindings/conformance/README.md
// "Transport scenarios") played by `polygate.fetch` against the real daemon and one
// fake upstream (node:http) per name in "upstreams", once per scenario × backend.

import * as assert from "node:assert/strict";
import * as fs from "node:fs";
import * as path from "node:path";
import { describe, test } from "node:test";

import {
  AllSourcesExhaustedError, CircuitOpenError, Client, FetchLike, RouteMissingError, TenantLimitExceededError,
  fetch as gatedFetch,
} from "../src/index.js";
import type { Route } from "../src/index.js";
import { FakeUpstream } from "./fake-upstream.js";
import { Mismatch, checkKeys, matchValue } from "./match.js";
import { REPO, show, sleep, withDaemon } from "./support.js";

const DIR = path.join(REPO, "bindings", "conformance", "transport");

type Obj = Record<string, unknown>;

interface Scenario {
  name: string;
  description?: string;
  backends?: string[];
  timeout_s?: number;
  config: string;
  upstreams: string[];
  transport: {
    scope: string; upstream: string; base_path?: string; on_refusal?: "response" | "raise"; tenant?: string;
    routes?: Record<string, { upstream: string; path?: string; headers?: Record<string, string>; query?: Record<string, string>; model?: string }>;
  };
  steps: Obj[];
}

const TOP_KEYS = ["name", "description", "backends", "timeout_s", "config", "upstreams", "transport", "steps"];
const TRANSPORT_KEYS = ["scope", "upstream", "base_path", "routes", "on_refusal", "tenant"];
const ROUTE_KEYS = ["upstream", "path", "headers", "query", "model"];
const OPS: Record<string, [string[], string[]]> = {
  respond: [["upstream", "status"], ["headers", "json", "sse", "body", "delay_s", "times"]],
  request: [["method", "path"], ["json", "headers", "stream", "read_events", "expect"]],
  upstream_hits: [["upstream", "expect"], ["header", "header_absent", "path", "json_subset"]],
  status: [["expect"], []],
  sleep: [["seconds"], []],
};
const EXPECT_KEYS = ["status", "headers", "retry_after_range", "json_subset", "body_unchanged", "error"];

function loadScenarios(): Scenario[] {
  if (!fs.existsSync(DIR)) throw new Error(`no transport conformance scenarios: ${DIR} is missing`);
  const files = fs.readdirSync(DIR).filter((f) => f.endsWith(".json")).sort();
  if (files.length === 0) throw new Error(`no transport conformance scenarios in ${DIR}`);
  return files.map((f) => {
    const sc = JSON.parse(fs.readFileSync(path.join(DIR, f), "utf8")) as Scenario;
    for (const k of Object.keys(sc)) if (!TOP_KEYS.includes(k)) throw new Error(`${f}: unknown top-level key ${k}`);
    for (const k of Object.keys(sc.transport)) if (!TRANSPORT_KEYS.includes(k)) throw new Error(`${f}: unknown transport key ${k}`);
    for (const [src, r] of Object.entries(sc.transport.routes ?? {})) {
      for (const k of Object.keys(r)) if (!ROUTE_KEYS.includes(k)) throw new Error(`${f}: unknown key ${k} in route ${src}`);
    }
    if (`${sc.name}.json` !== f) throw new Error(`${f}: name must match the file name`);
    return sc;
  });
}

/** `want` ⊆ `got`: objects by their listed keys (recursively), anything else exactly. */
function jsonSubset(want: unknown, got: unknown, where: string): void {
  if (typeof want === "object" && want !== null && !Array.isArray(want)) {
    if (typeof got !== "object" || got === null || Array.isArray(got)) throw new Mismatch(`${where}: expected an object, got ${show(got)}`);
    for (const [k, w] of Object.entries(want)) {
      if (!(k in got)) throw new Mismatch(`${where}: key ${k} missing in ${show(got)}`);
      jsonSubset(w, (got as Obj)[k], `${where}.${k}`);
    }
    return;
  }
  try {
    assert.deepStrictEqual(got, want);
  } catch {
    throw new Mismatch(`${where}: expected ${show(want)}, got ${show(got)}`);
  }
}

function headerSubset(want: Obj, got: (name: string) => string | null | undefined, where: string): void {
  for (const [k, v] of Object.entries(want)) {
    const g = got(k.toLowerCase());
    if (g !== v) throw new Mismatch(`${where}: header ${k} is ${show(g)}, expected ${show(v)}`);
  }
}

function checkError(want: Obj, err: unknown, where: string): void {
  checkKeys(want, ["kind", "reason", "message_contains"], `${where}.expect.error`);
  const e = err as Error & { reason?: unknown };
  const ok = want.kind === "CircuitOpen" ? err instanceof CircuitOpenError
    : want.kind === "AllSourcesExhausted" ? err instanceof AllSourcesExhaustedError
      : want.kind === "RouteMissing" ? err instanceof RouteMissingError
        : want.kind === "TenantLimited" ? err instanceof TenantLimitExceededError
          : (() => { throw new Mismatch(`${where}: unknown error kind ${show(want.kind)}`); })();
  if (!ok) throw new Mismatch(`${where}: expected ${String(want.kind)}, got ${e?.name}: ${e?.message}`);
  if ("reason" in want && e.reason !== want.reason) throw new Mismatch(`${where}: reason ${show(e.reason)}, expected ${show(want.reason)}`);
  if ("message_contains" in want && !String(e.message).includes(String(want.message_contains))) {
    throw new Mismatch(`${where}: message ${show(e.message)} lacks ${show(want.message_contains)}`);
  }
}

/** Read `body` whole, or until `events` SSE events were seen and then abandon it. */
async function readBody(body: ReadableStream<Uint8Array> | null, events: number | undefined): Promise<Buffer> {
  if (body === null) return Buffer.alloc(0);
  const reader = body.getReader();
  const parts: Buffer[] = [];
  for (;;) {
    const r = await reader.read();
    if (r.done) break;
    parts.push(Buffer.from(r.value));
    if (events !== undefined && Buffer.concat(parts).toString("utf8").split("\n\n").length - 1 >= events) {
      await reader.cancel();
      break;
    }
  }
  return Buffer.concat(parts);
}

async function play(sc: Scenario, client: Client, ups: Map<string, FakeUpstream>, label: string): Promise<void> {
  const upstream = (name: unknown, where: string): FakeUpstream => {
    const u = ups.get(String(name));
    if (u === undefined) throw new Mismatch(`${where}: upstream ${show(name)} is not in "upstreams"`);
    return u;
  };
  const tr = sc.transport;
  const routes: Record<string, Route> | undefined = tr.routes === undefined ? undefined
    : Object.fromEntries(Object.entries(tr.routes).map(([src, r]) => {
      const route: Route = { baseURL: upstream(r.upstream, `${label} routes`).url + (r.path ?? ""), headers: r.headers ?? {} };
      if (r.query !== undefined) route.query = r.query;
      if (r.model !== undefined) route.model = r.model;
      return [src, route];
    }));
  if (tr.tenant !== undefined && typeof tr.tenant !== "string") throw new Mismatch(`${label}: transport.tenant must be a string`);
  const f: FetchLike = gatedFetch({ scope: tr.scope, client, routes, onRefusal: tr.on_refusal ?? "response", tenant: tr.tenant });
  const baseURL = upstream(tr.upstream, `${label} transport`).url + (tr.base_path ?? "");

  for (const [i, step] of sc.steps.entries()) {
    const op = String(step.op);
    const where = `${label} step ${i} (${op})`;
    const spec = OPS[op];
    if (spec === undefined) throw new Mismatch(`${where}: unknown op ${show(step.op)}`);
    const missing = spec[0].filter((k) => !(k in step));
    if (missing.length) throw new Mismatch(`${where}: missing field(s) ${missing.join(", ")}`);
    checkKeys(step, ["op", ...spec[0], ...spec[1]], where);

    switch (op) {
      case "respond":
        upstream(step.upstream, where).respond({
          status: Number(step.status), headers: step.headers as Record<string, string> | undefined,
          json: step.json, sse: step.sse as string[] | undefined, body: step.body as string | undefined,
          delayS: step.delay_s as number | undefined,
        }, (step.times as number | undefined) ?? 1);
        break;
      case "request": {
        const expect = (step.expect ?? {}) as Obj;
        checkKeys(expect, EXPECT_KEYS, `${where}.expect`);
        const before = new Map([...ups].map(([n, u]) => [n, u.sent.length]));
        const hitsBefore = new Map([...ups].map(([n, u]) => [n, u.hits.length]));
        const init: RequestInit = { method: String(step.method) };
        const headers: Record<string, string> = {};
        if (step.json !== undefined) {
          init.body = JSON.stringify(step.json);
          headers["content-type"] = "application/json";
        }
        if (step.headers !== undefined) {
          const h = step.headers;
          if (typeof h !== "object" || h === null || Array.isArray(h)) throw new Mismatch(`${where}: headers must be an object`);
          for (const [k, v] of Object.entries(h)) {
            if (typeof v !== "string") throw new Mismatch(`${where}: header ${k} must be a string, got ${show(v)}`);
            headers[k] = v;
          }
        }
        if (Object.keys(headers).length > 0) init.headers = headers;
        let resp: Response;
        try {
          resp = await f(`${baseURL}${String(step.path)}`, init);
        } catch (e) {
          if (expect.error === undefined) throw new Mismatch(`${where}: the request raised ${(e as Error)?.name}: ${(e as Error)?.message}`);
          checkError(expect.error as Obj, e, where);
          break;
        }
        if (expect.error !== undefined) throw new Mismatch(`${where}: expected an error ${show(expect.error)}, got status ${resp.status}`);
        const events = step.read_events as number | undefined;
        const body = await readBody(resp.body, step.stream === true ? events : undefined);
        if ("status" in expect && resp.status !== expect.status) {
          throw new Mismatch(`${where}: status ${resp.status}, expected ${show(expect.status)}; body ${body.toString("utf8").slice(0, 300)}`);
        }
        if ("headers" in expect) headerSubset(expect.headers as Obj, (n) => resp.headers.get(n), where);
        if ("retry_after_range" in expect) {
          const [lo, hi] = expect.retry_after_range as [number, number];
          const ra = resp.headers.get("retry-after");
          if (ra === null || !/^\d+(\.\d+)?$/.test(ra) || Number(ra) < lo || Number(ra) > hi) {
            throw new Mismatch(`${where}: Retry-After ${show(ra)} is not a number within [${lo}, ${hi}]`);
          }
        }
        if ("json_subset" in expect) {
          let doc: unknown;
          try {
            doc = JSON.parse(body.toString("utf8"));
          } catch {
            throw new Mismatch(`${where}: the body is not JSON: ${body.toString("utf8").slice(0, 300)}`);
          }
          jsonSubset(expect.json_subset, doc, `${where}.json`);
        }
        if (expect.body_unchanged === true) {
          const hit = [...ups].filter(([n, u]) => u.hits.length > hitsBefore.get(n)! && u.sent.length > before.get(n)!);
          if (hit.length !== 1) throw new Mismatch(`${where}: body_unchanged needs exactly one upstream to have answered, got ${hit.length}`);
          const sent = hit[0]![1].sent.at(-1)!;
          if (!sent.equals(body)) throw new Mismatch(`${where}: body changed: sent ${show(sent.toString("utf8"))}, caller read ${show(body.toString("utf8"))}`);
        }
        break;
      }
      case "upstream_hits": {
        const u = upstream(step.upstream, where);
        if (u.hits.length !== step.expect) throw new Mismatch(`${where}: upstream ${String(step.upstream)} got ${u.hits.length} requests, expected ${show(step.expect)}`);
        if (step.header !== undefined) {
          const last = u.hits.at(-1);
          if (last === undefined) throw new Mismatch(`${where}: no request to check headers of`);
          headerSubset(step.header as Obj, (n) => {
            const v = last.headers[n];
            return Array.isArray(v) ? v.join(", ") : v;
          }, where);
        }
        if (step.header_absent !== undefined) {
          const names = step.header_absent;
          if (!Array.isArray(names) || names.some((n) => typeof n !== "string")) throw new Mismatch(`${where}: header_absent must be a list of names`);
          const last = u.hits.at(-1);
          if (last === undefined) throw new Mismatch(`${where}: no request to check headers of`);
          for (const n of names as string[]) {
            const v = last.headers[n.toLowerCase()];
            if (v !== undefined) throw new Mismatch(`${where}: last request carries header ${n}: ${show(v)}, expected none`);
          }
        }
        if (step.path !== undefined) {
          const last = u.hits.at(-1);
          if (last?.url !== step.path) throw new Mismatch(`${where}: last request's path is ${show(last?.url)}, expected ${show(step.path)}`);
        }
        if (step.json_subset !== undefined) {
          const last = u.hits.at(-1);
          if (last === undefined) throw new Mismatch(`${where}: no request to check the body of`);
          const clen = last.headers["content-length"];
          if (clen !== undefined && Number(clen) !== Buffer.byteLength(last.body, "utf8")) {
            throw new Mismatch(`${where}: last request's Content-Length ${clen}, its body ${Buffer.byteLength(last.body, "utf8")} bytes`);
          }
          let doc: unknown;
          try {
            doc = JSON.parse(last.body);
          } catch {
            throw new Mismatch(`${where}: last request's body is not JSON: ${last.body.slice(0, 300)}`);
          }
          jsonSubset(step.json_subset, doc, `${where}.json`);
        }
        break;
      }
      case "status":
        matchValue(step.expect, await client.status(), `${where} status`);
        break;
      case "sleep":
        await sleep(Number(step.seconds) * 1000);
        break;
    }
  }
}

async function runScenario(sc: Scenario, backend: string, skip: (why: string) => void): Promise<void> {
  const label = `transport scenario ${sc.name} [${backend}]`;
  await withDaemon(sc.config, backend, skip, async (client) => {
    const ups = new Map<string, FakeUpstream>();
    const limit = (sc.timeout_s ?? 30) * 1000;
    let timer: NodeJS.Timeout | undefined;
    try {
      for (const n of sc.upstreams) ups.set(n, await FakeUpstream.start());
      const overtime = new Promise<never>((_, reject) => {
        timer = setTimeout(() => reject(new Mismatch(`${label}: exceeded its time limit of ${limit / 1000} s`)), limit);
      });
      await Promise.race([play(sc, client, ups, label), overtime]);
    } finally {
      clearTimeout(timer);
      for (const u of ups.values()) await u.close();
    }
  });
}

describe("transport conformance scenarios", () => {
  for (const sc of loadScenarios()) {
    for (const backend of sc.backends ?? ["memory"]) {
      test(`${sc.name} [${backend}]`, { timeout: (sc.timeout_s ?? 30) * 1000 + 20_000 }, async (t) => {
        await runScenario(sc, backend, (why) => t.skip(why));
      });
    }
  }
});
