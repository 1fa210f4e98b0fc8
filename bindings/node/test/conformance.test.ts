// The conformance scenarios (DESIGN §14, bindings/conformance/README.md) played by
// this binding against the real daemon, once per scenario × backend.

import * as assert from "node:assert/strict";
import * as fs from "node:fs";
import * as path from "node:path";
import { describe, test } from "node:test";

import {
  AllSourcesExhaustedError, Call, CircuitOpenError, Client, GatewayUnavailableError, Permit, PolyGateError,
  ReportResult, SidecarError,
} from "../src/index.js";
import type { FailureKind } from "../src/index.js";
import { Mismatch, checkKeys, matchNumber, matchValue } from "./match.js";
import { REPO, show, sleep, withDaemon } from "./support.js";

const DIR = path.join(REPO, "bindings", "conformance", "scenarios");

type Obj = Record<string, unknown>;

interface Scenario {
  name: string;
  description?: string;
  backends?: string[];
  timeout_s?: number;
  config: string;
  steps: Obj[];
}

const TOP_KEYS = new Set(["name", "description", "backends", "timeout_s", "config", "steps"]);
const OPS: Record<string, [string[], string[]]> = {
  call: [["call", "scope"], ["est_tokens", "priority", "est_input_tokens", "est_output_tokens"]],
  acquire: [["call"], ["expect"]],
  acquire_cancel: [["call", "after_s"], []],
  success: [["call"], ["tokens", "input_tokens", "output_tokens", "count_attempt", "expect"]],
  failure: [["call", "kind"], ["tokens", "expect"]],
  rate_limited: [["call"], ["retry_after_s", "expect"]],
  cancel: [["call"], ["expect"]],
  end: [["call"], []],
  status: [["expect"], []],
  admin: [["action", "source"], ["seconds", "expect"]],
  sleep: [["seconds"], []],
};
const GRANT_KEYS = ["source", "attempt", "is_probe", "est_tokens"];
const ERROR_KEYS = ["type", "reason", "kind", "retry_after_s", "per_source_reasons", "scope", "message_contains"];
const RESULT_KEYS = ["applied", "state", "retry_after_s"];

function loadScenarios(): Scenario[] {
  const files = fs.readdirSync(DIR).filter((f) => f.endsWith(".json")).sort();
  if (files.length === 0) throw new Error(`no conformance scenarios in ${DIR}`);
  return files.map((f) => {
    const sc = JSON.parse(fs.readFileSync(path.join(DIR, f), "utf8")) as Scenario;
    for (const k of Object.keys(sc)) if (!TOP_KEYS.has(k)) throw new Error(`${f}: unknown top-level key ${k}`);
    if (`${sc.name}.json` !== f) throw new Error(`${f}: name must match the file name`);
    return sc;
  });
}

// ------------------------------------------------------------------ matching

function checkError(want: Obj, err: unknown, where: string): void {
  checkKeys(want, ERROR_KEYS, `${where}.error`);
  const e = err as PolyGateError & { reason?: unknown; retryAfterS?: number; perSourceReasons?: Obj };
  const type = want.type;
  const ok = type === "circuit_open" ? err instanceof CircuitOpenError
    : type === "all_sources_exhausted" ? err instanceof AllSourcesExhaustedError
      : type === "gateway_unavailable" ? err instanceof GatewayUnavailableError && err.constructor === GatewayUnavailableError
        : type === "sidecar_error" ? err instanceof SidecarError
          : (() => { throw new Mismatch(`${where}: unknown error type ${show(type)}`); })();
  if (!ok) throw new Mismatch(`${where}: expected ${String(type)}, got ${(err as Error)?.name}: ${(err as Error)?.message}`);
  if ("reason" in want && e.reason !== want.reason) throw new Mismatch(`${where}: reason ${show(e.reason)}, expected ${show(want.reason)} (${e.message})`);
  if ("kind" in want && e.kind !== want.kind) throw new Mismatch(`${where}: kind ${show(e.kind)}, expected ${show(want.kind)} (${e.message})`);
  if ("retry_after_s" in want) matchNumber(want.retry_after_s, e.retryAfterS, `${where}.retry_after_s`);
  if ("per_source_reasons" in want) {
    try {
      assert.deepStrictEqual({ ...(e.perSourceReasons ?? {}) }, want.per_source_reasons);
    } catch {
      throw new Mismatch(`${where}: per_source_reasons ${show(e.perSourceReasons)}, expected ${show(want.per_source_reasons)}`);
    }
  }
  if ("scope" in want && e.scope !== want.scope) throw new Mismatch(`${where}: scope ${show(e.scope)}, expected ${show(want.scope)}`);
  if ("message_contains" in want && !String(e.message).includes(String(want.message_contains))) {
    throw new Mismatch(`${where}: message ${show(e.message)} lacks ${show(want.message_contains)}`);
  }
}

/** `expect` is `{okKey: {...}}` or `{error: {...}}` (undefined = the step succeeds). */
function checkOutcome(expect: Obj | undefined, value: unknown, err: unknown, failed: boolean, where: string, okKey: string): void {
  if (expect === undefined) {
    if (failed) throw new Mismatch(`${where}: unexpected ${(err as Error)?.name}: ${(err as Error)?.message}`);
    return;
  }
  checkKeys(expect, [okKey, "error"], `${where}.expect`);
  if (Object.keys(expect).length !== 1) throw new Mismatch(`${where}: expect needs exactly one of ${okKey} / error`);
  if ("error" in expect) {
    if (!failed) throw new Mismatch(`${where}: expected an error ${show(expect.error)}, the step succeeded`);
    return checkError(expect.error as Obj, err, where);
  }
  if (failed) throw new Mismatch(`${where}: expected ${okKey}, got ${(err as Error)?.name}: ${(err as Error)?.message}`);
  const want = expect[okKey] as Obj;
  if (okKey === "grant") {
    checkKeys(want, GRANT_KEYS, `${where}.grant`);
    const p = value as Permit;
    matchValue(want, { source: p.source, attempt: p.attempt, is_probe: p.isProbe, est_tokens: p.estTokens }, `${where}.grant`);
  } else {
    checkKeys(want, RESULT_KEYS, `${where}.result`);
    // A held report (failure, 429, cancel, an uncounted success) returns no result:
    // README — "checked when the binding returns the result".
    const r = value as ReportResult | undefined;
    if (r !== undefined) matchValue(want, { applied: r.applied, state: r.state, retry_after_s: r.retryAfterS }, `${where}.result`);
  }
}

// ------------------------------------------------------------------ playing

interface CallSlot {
  call: Call;
  permit: Permit | null;
}

async function attempt<T>(f: () => Promise<T>): Promise<[T | undefined, unknown, boolean]> {
  try {
    return [await f(), undefined, false];
  } catch (e) {
    if (e instanceof Mismatch) throw e;
    return [undefined, e, true];
  }
}

async function play(sc: Scenario, client: Client, label: string): Promise<void> {
  const calls = new Map<string, CallSlot>();
  const slot = (step: Obj, where: string): CallSlot => {
    const s = calls.get(String(step.call));
    if (s === undefined) throw new Mismatch(`${where}: call ${show(step.call)} was never opened`);
    return s;
  };
  const permitOf = (s: CallSlot, where: string): Permit => {
    if (s.permit === null) throw new Mismatch(`${where}: the call has no permit to report on`);
    return s.permit;
  };
  const num = (v: unknown): number | undefined => (typeof v === "number" ? v : undefined);

  for (const [i, step] of sc.steps.entries()) {
    const op = String(step.op);
    const where = `${label} step ${i} (${op})`;
    const spec = OPS[op];
    if (spec === undefined) throw new Mismatch(`${where}: unknown op ${show(step.op)}`);
    const missing = spec[0].filter((k) => !(k in step));
    if (missing.length) throw new Mismatch(`${where}: missing field(s) ${missing.join(", ")}`);
    checkKeys(step, ["op", ...spec[0], ...spec[1]], where);
    const expect = step.expect as Obj | undefined;

    switch (op) {
      case "call": {
        const call = await client.call(String(step.scope), {
          estTokens: num(step.est_tokens), priority: step.priority as string | undefined,
          estInputTokens: num(step.est_input_tokens), estOutputTokens: num(step.est_output_tokens),
        });
        calls.set(String(step.call), { call, permit: null });
        break;
      }
      case "acquire": {
        const s = slot(step, where);
        const [permit, err, failed] = await attempt(() => s.call.acquire());
        s.permit = permit ?? null;
        checkOutcome(expect ?? { grant: {} }, permit, err, failed, where, "grant");
        break;
      }
      case "acquire_cancel": {
        const s = slot(step, where);
        const ac = new AbortController();
        let settled = false;
        const p = s.call.acquire({ signal: ac.signal }).finally(() => (settled = true));
        p.catch(() => {});
        await sleep(Number(step.after_s) * 1000);
        if (settled) {
          const [v, e] = await attempt(() => p);
          throw new Mismatch(`${where}: acquire ended before it was cancelled: ${show(v ?? (e as Error)?.message)}`);
        }
        ac.abort();
        const [, err, failed] = await attempt(() => p);
        if (!failed) throw new Mismatch(`${where}: a cancelled acquire returned a permit`);
        if ((err as Error)?.name !== "AbortError") throw new Mismatch(`${where}: expected an AbortError, got ${(err as Error)?.name}: ${(err as Error)?.message}`);
        s.permit = null;
        break;
      }
      case "success": {
        const s = slot(step, where);
        const permit = permitOf(s, where);
        const [r, err, failed] = await attempt(() => permit.success({
          tokens: num(step.tokens), inputTokens: num(step.input_tokens), outputTokens: num(step.output_tokens),
          countAttempt: step.count_attempt === undefined ? true : Boolean(step.count_attempt),
        }));
        checkOutcome(expect, r, err, failed, where, "result");
        break;
      }
      case "failure": {
        const s = slot(step, where);
        const permit = permitOf(s, where);
        const [r, err, failed] = await attempt(() => permit.failure(step.kind as FailureKind, { tokens: num(step.tokens) }));
        checkOutcome(expect, r, err, failed, where, "result");
        break;
      }
      case "rate_limited": {
        const s = slot(step, where);
        const permit = permitOf(s, where);
        const [r, err, failed] = await attempt(() => permit.rateLimited({ retryAfterS: num(step.retry_after_s) }));
        checkOutcome(expect, r, err, failed, where, "result");
        break;
      }
      case "cancel": {
        const s = slot(step, where);
        const permit = permitOf(s, where);
        const [r, err, failed] = await attempt(() => permit.cancel());
        checkOutcome(expect, r, err, failed, where, "result");
        break;
      }
      case "end": {
        const s = slot(step, where);
        await s.call.end();
        s.permit = null;
        break;
      }
      case "status": {
        matchValue(expect, await client.status(), `${where} status`);
        break;
      }
      case "admin": {
        const src = String(step.source);
        const action = String(step.action);
        const [, err, failed] = await attempt(() => {
          if (action === "force_open") return client.forceOpen(src, Number(step.seconds));
          if (action === "force_close") return client.forceClose(src);
          if (action === "reset") return client.reset(src);
          throw new Mismatch(`${where}: unknown admin action ${show(action)}`);
        });
        if (expect === undefined) {
          if (failed) throw new Mismatch(`${where}: ${action} failed: ${(err as Error)?.message}`);
        } else {
          checkKeys(expect, ["error"], `${where}.expect`);
          if (!failed) throw new Mismatch(`${where}: expected an error ${show(expect.error)}, ${action} succeeded`);
          checkError(expect.error as Obj, err, where);
        }
        break;
      }
      case "sleep":
        await sleep(Number(step.seconds) * 1000);
        break;
    }
  }
}

async function runScenario(sc: Scenario, backend: string, skip: (why: string) => void): Promise<void> {
  const label = `scenario ${sc.name} [${backend}]`;
  await withDaemon(sc.config, backend, skip, async (client) => {
    const limit = (sc.timeout_s ?? 30) * 1000;
    let timer: NodeJS.Timeout | undefined;
    const overtime = new Promise<never>((_, reject) => {
      timer = setTimeout(() => reject(new Mismatch(`${label}: exceeded its time limit of ${limit / 1000} s`)), limit);
    });
    try {
      await Promise.race([play(sc, client, label), overtime]);
    } finally {
      clearTimeout(timer);
    }
  });
}

describe("conformance scenarios", () => {
  for (const sc of loadScenarios()) {
    for (const backend of sc.backends ?? ["memory"]) {
      test(`${sc.name} [${backend}]`, { timeout: (sc.timeout_s ?? 30) * 1000 + 20_000 }, async (t) => {
        await runScenario(sc, backend, (why) => t.skip(why));
      });
    }
  }
});
