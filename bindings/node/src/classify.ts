/**
 * How `client.run` turns what the upstream call threw into an outcome (DESIGN §14),
 * and where it finds the tokens a result used (DESIGN §7a). Duck-typed, so the
 * `openai` / `@anthropic-ai/sdk` errors (`.status`, `.headers`), a thrown `fetch`
 * `Response`, axios-style `err.response.status`, Node's `ECONNRESET`-style errors
 * and undici's `fetch failed` (with the code on `cause`) classify correctly without
 * importing any of them.
 */

/** The failure kinds of a report (PROTOCOL §4.4). */
export type FailureKind = "timeout" | "server_error" | "connection" | "bad_result" | "error";

/** What to report for an attempt that threw. */
export interface Verdict {
  /** A failure kind, or `"rate_limited"` (HTTP 429: backpressure, not failure). */
  kind: FailureKind | "rate_limited";
  /** For `rate_limited`: the upstream's Retry-After in seconds. */
  retryAfterS?: number;
  /** Report, end the call and re-throw at once instead of trying the next attempt. */
  rethrow?: boolean;
}

const TIMEOUT_CODES = new Set([
  "ETIMEDOUT", "ESOCKETTIMEDOUT", "ABORT_ERR", "UND_ERR_CONNECT_TIMEOUT", "UND_ERR_HEADERS_TIMEOUT",
  "UND_ERR_BODY_TIMEOUT", "ERR_HTTP_REQUEST_TIMEOUT",
]);

const CONNECTION_CODES = new Set([
  "ECONNRESET", "ECONNREFUSED", "ECONNABORTED", "EPIPE", "ENOTFOUND", "EAI_AGAIN", "EHOSTUNREACH",
  "EHOSTDOWN", "ENETUNREACH", "ENETDOWN", "ENETRESET", "ENOTCONN", "ESHUTDOWN", "EPROTO",
  "UND_ERR_SOCKET", "UND_ERR_CLOSED", "ERR_SOCKET_CLOSED", "ERR_STREAM_PREMATURE_CLOSE",
  "ERR_HTTP2_STREAM_ERROR", "ERR_HTTP2_SESSION_ERROR", "ERR_HTTP2_GOAWAY_SESSION",
]);

function field(o: unknown, k: string): unknown {
  if ((typeof o !== "object" && typeof o !== "function") || o === null) return undefined;
  try {
    return (o as Record<string, unknown>)[k];
  } catch {
    return undefined; // a throwing getter must not break classification
  }
}

function httpStatus(v: unknown): number | undefined {
  const n = typeof v === "string" && /^\d{3}$/.test(v) ? Number(v) : v;
  return typeof n === "number" && Number.isInteger(n) && n >= 100 && n <= 599 ? n : undefined;
}

/** The HTTP status an error (or thrown `Response`) carries: `.status`, `.statusCode`, `.response.status`. */
export function statusOf(err: unknown): number | undefined {
  return httpStatus(field(err, "status")) ?? httpStatus(field(err, "statusCode"))
    ?? httpStatus(field(field(err, "response"), "status")) ?? httpStatus(field(field(err, "response"), "statusCode"));
}

function header(headers: unknown, name: string): string | undefined {
  if (headers === null || headers === undefined) return undefined;
  const get = field(headers, "get");
  let v: unknown;
  if (typeof get === "function") {
    try {
      v = (get as (n: string) => unknown).call(headers, name);
    } catch {
      v = undefined;
    }
  } else if (typeof headers === "object") {
    for (const [k, x] of Object.entries(headers as Record<string, unknown>)) {
      if (k.toLowerCase() === name) {
        v = x;
        break;
      }
    }
  }
  if (Array.isArray(v)) v = v[0];
  return typeof v === "string" ? v : typeof v === "number" ? String(v) : undefined;
}

/**
 * Seconds of an upstream's `retry-after-ms` / `retry-after` header (seconds or an
 * HTTP date), from `err.headers` or `err.response.headers`; `undefined` if none.
 */
export function retryAfterOf(err: unknown, now: number = Date.now()): number | undefined {
  for (const h of [field(err, "headers"), field(field(err, "response"), "headers")]) {
    const ms = header(h, "retry-after-ms");
    if (ms !== undefined && /^\s*\d+(\.\d+)?\s*$/.test(ms)) return Number(ms) / 1000;
    const ra = header(h, "retry-after");
    if (ra === undefined) continue;
    if (/^\s*\d+(\.\d+)?\s*$/.test(ra)) return Number(ra);
    const t = Date.parse(ra);
    if (!Number.isNaN(t)) return Math.max(0, (t - now) / 1000);
  }
  return undefined;
}

function ctorName(e: unknown): string {
  const c = field(e, "constructor");
  const n = field(c, "name");
  return typeof n === "string" ? n : "";
}

/**
 * The built-in classification (DESIGN §14):
 * - HTTP 429 → `rate_limited` with the Retry-After; 408 → `timeout`; 5xx →
 *   `server_error`; any other 4xx → `error`, re-thrown at once (the request is wrong;
 *   another attempt would not help);
 * - `AbortError` / `TimeoutError` / `ETIMEDOUT` (and undici's timeouts, the SDKs'
 *   `…TimeoutError` classes) → `timeout`;
 * - `ECONNRESET`, `ECONNREFUSED`, `EPIPE`, … (also as `cause`, as `fetch` throws them),
 *   the SDKs' `APIConnectionError` → `connection`;
 * - anything else → `error`.
 */
export function classifyError(err: unknown): Verdict {
  const status = statusOf(err);
  if (status !== undefined) {
    if (status === 429) {
      const retryAfterS = retryAfterOf(err);
      return retryAfterS === undefined ? { kind: "rate_limited" } : { kind: "rate_limited", retryAfterS };
    }
    if (status === 408) return { kind: "timeout" };
    if (status >= 500) return { kind: "server_error" };
    if (status >= 400) return { kind: "error", rethrow: true };
  }
  let e: unknown = err;
  for (let depth = 0; depth < 5 && e !== null && e !== undefined; depth++) {
    const name = field(e, "name");
    const code = field(e, "code");
    const ctor = ctorName(e);
    if (name === "AbortError" || name === "TimeoutError" || (typeof code === "string" && TIMEOUT_CODES.has(code))
      || /Timeout(Error)?$/.test(ctor)) {
      return { kind: "timeout" };
    }
    if ((typeof code === "string" && CONNECTION_CODES.has(code)) || ctor === "APIConnectionError"
      || name === "APIConnectionError") {
      return { kind: "connection" };
    }
    const next = field(e, "cause");
    if (next === undefined && name === "TypeError" && field(e, "message") === "fetch failed") {
      return { kind: "connection" };
    }
    e = next;
  }
  return { kind: "error" };
}

/** Tokens an attempt used, as a report carries them. */
export interface Usage {
  tokens?: number;
  inputTokens?: number;
  outputTokens?: number;
}

function count(v: unknown): number | undefined {
  return typeof v === "number" && Number.isSafeInteger(v) && v >= 0 ? v : undefined;
}

/**
 * The usage of an SDK result (`result.usage`), or `undefined`:
 * - OpenAI chat: `total_tokens`; input = `prompt_tokens` − `prompt_tokens_details.cached_tokens`,
 *   output = `completion_tokens`;
 * - Anthropic: `input_tokens` (cache reads are already apart), `output_tokens`;
 * - OpenAI Responses: `input_tokens` − `input_tokens_details.cached_tokens`, `output_tokens`,
 *   `total_tokens`.
 */
export function usageOf(result: unknown): Usage | undefined {
  const u = field(result, "usage");
  if (typeof u !== "object" || u === null) return undefined;
  const out: Usage = {};
  const total = count(field(u, "total_tokens"));
  if (total !== undefined) out.tokens = total;
  const prompt = count(field(u, "prompt_tokens"));
  const completion = count(field(u, "completion_tokens"));
  const input = count(field(u, "input_tokens"));
  const output = count(field(u, "output_tokens"));
  if (prompt !== undefined || completion !== undefined) {
    const cached = count(field(field(u, "prompt_tokens_details"), "cached_tokens")) ?? 0;
    if (prompt !== undefined) out.inputTokens = Math.max(0, prompt - cached);
    if (completion !== undefined) out.outputTokens = completion;
  } else if (input !== undefined || output !== undefined) {
    const cached = count(field(field(u, "input_tokens_details"), "cached_tokens")) ?? 0;
    if (input !== undefined) out.inputTokens = Math.max(0, input - cached);
    if (output !== undefined) out.outputTokens = output;
  }
  return out.tokens === undefined && out.inputTokens === undefined && out.outputTokens === undefined ? undefined : out;
}

/**
 * The input tokens an SDK result says the provider read from its prompt cache
 * (`result.usage`), or `undefined`: OpenAI chat `prompt_tokens_details.cached_tokens`,
 * OpenAI Responses `input_tokens_details.cached_tokens`, Anthropic
 * `cache_read_input_tokens`. {@link usageOf}'s input already excludes them; `run`
 * reports them as `cachedInputTokens` (a tenant's dollar cost prices them at the
 * cached rate, DESIGN §19).
 */
export function cachedInputTokensOf(result: unknown): number | undefined {
  const u = field(result, "usage");
  if (typeof u !== "object" || u === null) return undefined;
  return count(field(field(u, "prompt_tokens_details"), "cached_tokens"))
    ?? count(field(field(u, "input_tokens_details"), "cached_tokens"))
    ?? count(field(u, "cache_read_input_tokens"));
}
