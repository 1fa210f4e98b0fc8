/**
 * The provider's rate-limit headers → observed limits (DESIGN §18), sent with a
 * permit's report (`permit.limits = …`).
 *
 * `parseRateLimitHeaders(headers, now?)` reads OpenAI's
 * `x-ratelimit-{limit,remaining,reset}-{requests,tokens}` (resets as durations:
 * `1s`, `6m0s`, `250ms`, `1m30.5s`), Anthropic's `anthropic-ratelimit-{requests,
 * tokens,input-tokens,output-tokens}-{limit,remaining,reset}` (RFC 3339 instants,
 * counted from the response's `date` header, else from `now`), Azure's
 * `x-ratelimit-remaining-{requests,tokens}`, and `retry-after-ms` before
 * `retry-after` (seconds or an HTTP date). The shared cases are
 * `bindings/vectors/ratelimit_headers.json`. No I/O, no dependencies.
 */

import type { WireLimit, WireLimits } from "./wire.js";

/** One dimension of a response's rate-limit headers; `null` = not said. */
export interface Limit {
  /** The provider's limit (what an `"auto"` bucket learns). */
  limit: number | null;
  /** What the provider says is left. */
  remaining: number | null;
  /** Seconds from the response until the counter is whole again. */
  resetS: number | null;
}

/** What one response's headers say. */
export interface Limits {
  requests?: Limit | null;
  tokens?: Limit | null;
  inputTokens?: Limit | null;
  outputTokens?: Limit | null;
  /**
   * Seconds between the response and the report (a stream's length): the sidecar
   * dates the observation `now − ageS` and ignores one older than an observation
   * it already applied. Default 0.
   */
  ageS?: number;
}

/** Header sources `parseRateLimitHeaders` takes: a fetch `Headers`, a plain object, or pairs. */
export type HeaderSource =
  | { get(name: string): string | null }
  | Record<string, string | string[] | undefined>
  | Iterable<[string, string]>;

const UNIT_S: Record<string, number> = { h: 3600, m: 60, s: 1, ms: 1e-3, us: 1e-6, "µs": 1e-6, ns: 1e-9 };
const PART = /(\d+(?:\.\d*)?|\.\d+)(ms|us|µs|ns|h|m|s)/gy;

/** A Go-style duration (`6m0s`, `250ms`) or a bare number of seconds; null otherwise. */
export function parseDuration(text: string): number | null {
  const t = text.trim();
  if (t === "") return null;
  if (/^[0-9]*\.?[0-9]+(e[+-]?\d+)?$/i.test(t)) {
    const v = Number(t);
    return Number.isFinite(v) && v >= 0 ? v : null;
  }
  PART.lastIndex = 0;
  let total = 0;
  let pos = 0;
  for (let m = PART.exec(t); m !== null; m = PART.exec(t)) {
    total += Number(m[1]) * UNIT_S[m[2]!]!;
    pos = PART.lastIndex;
  }
  return pos === t.length && pos > 0 ? total : null;
}

/** Whether the parser reads header `k` (lower case): rate limits, retry-after, date. */
function wanted(k: string): boolean {
  return k.startsWith("x-ratelimit-") || k.startsWith("anthropic-ratelimit-") || k.startsWith("retry-after") || k === "date";
}

/**
 * A lookup of the headers the parser reads, or null when there is none. An
 * iterable or a plain object is read in one pass, keeping only those headers
 * (a fetch `Headers.get` validates and normalises its name on each of the ~20
 * lookups the parser makes: ~3.5 µs per response, against ~0.5 µs for the pass).
 */
function getter(h: HeaderSource): ((name: string) => string | null) | null {
  const iterable = Symbol.iterator in h;
  if (!iterable && typeof (h as { get?: unknown }).get === "function") {
    const g = h as { get(name: string): string | null };
    return (name) => g.get(name);
  }
  let table: Map<string, string> | null = null;
  const add = (k: string, v: unknown): void => {
    const key = k.toLowerCase();
    if (v === undefined || v === null || !wanted(key)) return;
    table ??= new Map<string, string>();
    if (!table.has(key)) table.set(key, Array.isArray(v) ? String(v[0]) : String(v));
  };
  if (iterable) {
    for (const [k, v] of h as Iterable<[string, unknown]>) add(k, v);
  } else {
    for (const [k, v] of Object.entries(h)) add(k, v);
  }
  const found = table as Map<string, string> | null; // assigned in add (not seen by narrowing)
  return found === null ? null : (name) => found.get(name) ?? null;
}

/** The largest count a parsed header gives (the sidecar cuts larger ones to it). */
const MAX_COUNT = 1_000_000_000;

function count(v: string | null): number | null {
  if (v === null) return null;
  const t = v.trim();
  if (!/^[0-9]*\.?[0-9]+$/.test(t)) return null;
  const n = Number(t);
  // The sidecar cuts counts above 10^9 (PROTOCOL §14.6); cutting here keeps an
  // absurd header from failing the report's encoding (a bigint past 2^53).
  return Number.isFinite(n) && n >= 0 ? Math.min(Math.floor(n), MAX_COUNT) : null;
}

function httpDate(v: string | null): number | null {
  if (v === null || !/[a-z]/i.test(v)) return null;
  const ms = Date.parse(v);
  return Number.isNaN(ms) ? null : ms / 1000;
}

/** Each dimension's limit, remaining and reset headers (OpenAI and Azure name two). */
const keys = (p: string): readonly [string, string, string] => [`${p}limit`, `${p}remaining`, `${p}reset`];
const ANTHROPIC = {
  requests: keys("anthropic-ratelimit-requests-"),
  tokens: keys("anthropic-ratelimit-tokens-"),
  inputTokens: keys("anthropic-ratelimit-input-tokens-"),
  outputTokens: keys("anthropic-ratelimit-output-tokens-"),
} as const;
const OPENAI = {
  requests: ["x-ratelimit-limit-requests", "x-ratelimit-remaining-requests", "x-ratelimit-reset-requests"],
  tokens: ["x-ratelimit-limit-tokens", "x-ratelimit-remaining-tokens", "x-ratelimit-reset-tokens"],
} as const;

/**
 * `{limits, retryAfterS}` of one response's headers: `limits` is null when no
 * rate-limit header was found, `retryAfterS` when none was given. `now` (Unix
 * seconds, default the clock) counts Anthropic's instants when there is no `date`.
 */
export function parseRateLimitHeaders(headers: HeaderSource, now?: number): { limits: Limits | null; retryAfterS: number | null } {
  const get = getter(headers);
  if (get === null) return { limits: null, retryAfterS: null };
  // Instants count from the response's date, else from now (parsed once, when needed).
  let baseS: number | null = null;
  const base = (): number => (baseS ??= httpDate(get("date")) ?? now ?? Date.now() / 1000);
  const reset = (v: string | null): number | null => {
    if (v === null) return null;
    const d = parseDuration(v);
    if (d !== null) return d;
    if (!/^\d{4}-\d{2}-\d{2}T/.test(v.trim())) return null;
    const ms = Date.parse(v.trim());
    return Number.isNaN(ms) ? null : Math.max(0, ms / 1000 - base());
  };
  const dim = ([lim, rem, rst]: readonly [string, string, string]): Limit | null => {
    const d: Limit = { limit: count(get(lim)), remaining: count(get(rem)), resetS: reset(get(rst)) };
    return d.limit === null && d.remaining === null && d.resetS === null ? null : d;
  };
  const limits: Limits = {
    requests: dim(ANTHROPIC.requests) ?? dim(OPENAI.requests),
    tokens: dim(ANTHROPIC.tokens) ?? dim(OPENAI.tokens),
    inputTokens: dim(ANTHROPIC.inputTokens),
    outputTokens: dim(ANTHROPIC.outputTokens),
  };
  let retryAfterS: number | null = null;
  const ms = get("retry-after-ms");
  if (ms !== null && /^\s*[0-9]*\.?[0-9]+\s*$/.test(ms)) retryAfterS = Number(ms) / 1000;
  const ra = get("retry-after");
  if (retryAfterS === null && ra !== null) {
    if (/^\s*[0-9]*\.?[0-9]+\s*$/.test(ra)) {
      retryAfterS = Number(ra);
    } else {
      const at = httpDate(ra);
      if (at !== null) retryAfterS = Math.max(0, at - base());
    }
  }
  const empty = !limits.requests && !limits.tokens && !limits.inputTokens && !limits.outputTokens;
  return { limits: empty ? null : limits, retryAfterS };
}

function wireLimit(l: Limit | null | undefined, what: string): WireLimit | null {
  if (l === null || l === undefined) return null;
  checkLimit(what, l);
  const n = (v: number | null, k: string): number | null => {
    if (v === null || v === undefined) return null;
    if (!Number.isSafeInteger(v) || v < 0) throw new TypeError(`${what}.${k} must be an integer >= 0, got ${String(v)}`);
    return v;
  };
  if (l.resetS !== null && l.resetS !== undefined && (!Number.isFinite(l.resetS) || l.resetS < 0)) {
    throw new TypeError(`${what}.resetS must be a finite number of seconds >= 0, got ${String(l.resetS)}`);
  }
  return { limit: n(l.limit, "limit"), remaining: n(l.remaining, "remaining"), reset_s: l.resetS ?? null };
}

const LIMITS_KEYS = ["requests", "tokens", "inputTokens", "outputTokens", "ageS"];
const LIMIT_KEYS = ["limit", "remaining", "resetS"];

function kindOf(v: unknown): string {
  if (v === null) return "null";
  if (Array.isArray(v)) return "an array";
  if (typeof v === "object") return `a ${(v as object).constructor?.name ?? "object"}`;
  return `a ${typeof v}`;
}

function checkNumber(what: string, v: unknown): void {
  if (v !== null && v !== undefined && typeof v !== "number") throw new TypeError(`${what} must be a number or null, got ${kindOf(v)}`);
}

function checkLimit(what: string, v: unknown): void {
  if (v === null || v === undefined) return;
  if (typeof v !== "object" || Array.isArray(v) || typeof (v as { get?: unknown }).get === "function") {
    throw new TypeError(`${what} must be a Limit ({ ${LIMIT_KEYS.join(", ")} }) or null, got ${kindOf(v)}`);
  }
  for (const [k, x] of Object.entries(v as Record<string, unknown>)) {
    if (!LIMIT_KEYS.includes(k)) throw new TypeError(`${what}: unknown key ${k}; a Limit has ${LIMIT_KEYS.join(", ")}`);
    checkNumber(`${what}.${k}`, x);
  }
}

/**
 * What `permit.limits = v` accepts (checked at the assignment, also from JavaScript): a
 * {@link Limits} — an object of its keys, each dimension a {@link Limit} — or null.
 * Anything else (a `Headers`, snake_case keys, a number for a dimension, a count that
 * is not an integer >= 0, seconds that are not finite and >= 0) throws a TypeError
 * naming `Limits` or the bad key, rather than being dropped or failing inside the report.
 */
export function checkLimits(v: unknown): Limits | null {
  if (v === null || v === undefined) return null;
  if (typeof v !== "object" || Array.isArray(v) || v instanceof Map || typeof (v as { get?: unknown }).get === "function") {
    const hint = typeof (v as { get?: unknown } | null)?.get === "function" ? " (parseRateLimitHeaders(headers).limits makes one from headers)" : "";
    throw new TypeError(`permit.limits must be a Limits ({ ${LIMITS_KEYS.join(", ")} }) or null, got ${kindOf(v)}${hint}`);
  }
  for (const [k, x] of Object.entries(v as Record<string, unknown>)) {
    if (!LIMITS_KEYS.includes(k)) throw new TypeError(`permit.limits: unknown key ${k}; a Limits has ${LIMITS_KEYS.join(", ")}`);
    if (k === "ageS") checkNumber("permit.limits.ageS", x);
    else checkLimit(`permit.limits.${k}`, x);
  }
  // the values too (an integer count >= 0, finite seconds >= 0): a NaN or a -1 is
  // refused here, not when the report is sent
  try {
    toWireLimits(v as Limits);
  } catch (e) {
    throw new TypeError(`permit.limits.${(e as Error).message}`);
  }
  return v as Limits;
}

/** `limits` as the wire's `ObservedLimits` (null when it says nothing); a bad value throws TypeError. */
export function toWireLimits(limits: Limits | null | undefined): WireLimits | null {
  if (limits === null || limits === undefined) return null;
  const w: WireLimits = {
    requests: wireLimit(limits.requests, "requests"),
    tokens: wireLimit(limits.tokens, "tokens"),
    input_tokens: wireLimit(limits.inputTokens, "inputTokens"),
    output_tokens: wireLimit(limits.outputTokens, "outputTokens"),
    age_s: limits.ageS ?? 0,
  };
  if (!Number.isFinite(w.age_s) || w.age_s < 0) throw new TypeError(`ageS must be a finite number >= 0, got ${String(limits.ageS)}`);
  if (!w.requests && !w.tokens && !w.input_tokens && !w.output_tokens) return null;
  return w;
}

/**
 * `run`: the observed limits of an SDK error (`err.headers`, `err.response.headers`)
 * or of a raw response (`.headers`); null when it carries none.
 */
export function limitsOf(x: unknown): Limits | null {
  if (x === null || typeof x !== "object") return null;
  const o = x as { headers?: unknown; response?: { headers?: unknown } };
  for (const h of [o.headers, o.response?.headers]) {
    if (h !== null && typeof h === "object") {
      try {
        const { limits } = parseRateLimitHeaders(h as HeaderSource);
        if (limits !== null) return limits;
      } catch {
        // headers of an unexpected shape: nothing observed
      }
    }
  }
  return null;
}
