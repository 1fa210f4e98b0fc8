/**
 * The gate as a `fetch` (DESIGN §17): install it once where the SDK client is built
 * and every request the SDK sends is admitted, reported and settled.
 *
 * ```ts
 * import OpenAI from "openai";
 * import * as polygate from "polygate";
 * const openai = new OpenAI({ fetch: polygate.fetch({ scope: "chat" }) });
 * ```
 *
 * - One HTTP request = one call: `Start` before it is sent, `Finish` after the response
 *   body (or stream) ends. An SDK's own retries are separate calls, each admitted.
 * - `routes` (source → `{baseURL, headers, query, model}`) sends the request to the
 *   granted source's deployment with that source's extra headers, query parameters and
 *   model name (see {@link Route}); a granted source missing from `routes` is a
 *   {@link RouteMissingError} before anything is sent.
 * - The estimate: input = UTF-8 bytes of the body / 4, output = the body's
 *   `max_tokens` / `max_completion_tokens` / `max_output_tokens` (else the source's
 *   `est_output_tokens`), or the user's `estimate` hook.
 * - The outcome: 2xx → success with the JSON body's usage (OpenAI chat, responses,
 *   embeddings; Anthropic messages); `text/event-stream` bodies pass through unchanged
 *   while {@link UsageScanner} reads the usage events, and the permit is held until the
 *   stream ends (or is abandoned: then settled with what was seen, else the estimate);
 *   429 → rate-limited (`retry-after-ms`, then `Retry-After`); 408, 409, 5xx → transient
 *   failures; transport errors → classified (`connection`, `timeout`); other 4xx →
 *   `error`; a 3xx (`redirect: "manual"`, a 304) → an uncounted success with no
 *   tokens. The response reaches the SDK unchanged, but for a routed 3xx's relative
 *   `Location`, made absolute against the URL actually sent.
 * - Tenants (DESIGN §19): the `tenant` option (a string, or a synchronous function of
 *   the request) names the tenant of every request; a request's `x-polygate-tenant`
 *   header wins over it (`""`: the anonymous tenant). The header is never sent upstream.
 * - A refusal (`CircuitOpen`, `AllSourcesExhausted`, `TenantLimited`) becomes a
 *   synthetic 503 (429 for exhausted quota and a tenant's limit) with `Retry-After` and
 *   a JSON body naming PolyGate and the reason, or, with `onRefusal: "raise"`, the
 *   typed error is thrown.
 *
 * DESIGN §18: {@link Attempt} is the one place holding (permit, response headers) after
 * a response; the provider's rate-limit headers are turned into observed limits there.
 */

import { Usage, classifyError, retryAfterOf, usageOf } from "./classify.js";
import type { FailureKind } from "./classify.js";
import { Call, Client, Permit, connect } from "./client.js";
import {
  AllSourcesExhaustedError, CircuitOpenError, GatewayUnavailableError, PolyGateError, TenantLimitExceededError,
} from "./errors.js";
import { parseRateLimitHeaders } from "./ratelimit.js";
import { MAX_TENANT_BYTES } from "./wire.js";

/** What `fetch` looks like to an SDK (`new OpenAI({fetch})`, `new Anthropic({fetch})`, `createOpenAI({fetch})`). */
export type FetchLike = (input: string | URL | Request, init?: RequestInit) => Promise<Response>;

/**
 * Where a granted source's requests go (DESIGN §17 item 2). A request URL under one of
 * the routes' base URLs (same scheme, host and port, path prefix at a segment boundary;
 * the longest wins) has that prefix replaced by the granted route's `baseURL`; a
 * request under none keeps its path, with `baseURL`'s path put in front.
 */
export interface Route {
  /** Base URL of the source's deployment, as you would give it to the SDK (`https://api.openai.com/v1`). */
  baseURL: string;
  /** Extra headers set on the request (API key, `api-key`, …), replacing the SDK's of the same name. */
  headers?: Record<string, string>;
  /**
   * Query parameters set on the request (Azure OpenAI's `{"api-version": "2024-10-21"}`),
   * replacing same-named ones; the request's others are kept.
   */
  query?: Record<string, string>;
  /** The `"model"` a JSON-object request body gets on this route (a deployment serving it under another name). */
  model?: string;
}

/** The request as the `estimate` hook sees it. */
export interface EstimateRequest {
  url: string;
  method: string;
  headers: Headers;
  /** The body as text, or `null` (no body, or a form/stream body that cannot be read without consuming it). */
  body: string | null;
}

/** Token estimate of one request; an absent side falls back to the built-in rule. */
export interface Estimate {
  input?: number;
  output?: number;
}

/** Options of {@link fetch}. */
export interface FetchOptions {
  /** The PolyGate scope every request of this fetch belongs to. */
  scope: string;
  /** A connected client; default: one connection per fetch function, opened on first use. */
  client?: Client | Promise<Client>;
  /** Socket path when no `client` is given (else `$POLYGATE_SOCKET`, else the default path). */
  path?: string;
  /** A priority class of the scope (DESIGN §15). */
  priority?: string;
  /** Source → deployment (at least one: `{}` is a `TypeError`); without it the request goes where the SDK sent it. */
  routes?: Record<string, Route>;
  /**
   * The SDK's base URL (e.g. `https://api.openai.com/v1`) when it is none of the routes'
   * base URLs: matched like theirs, so the request URL's part after it is appended to
   * the route's `baseURL`.
   */
  sdkBaseURL?: string;
  /** Your own estimate; return `undefined` (or leave a side out) for the built-in rule. */
  estimate?: (req: EstimateRequest) => Estimate | null | undefined;
  /**
   * The tenant of every request (DESIGN §19): a tenant id (at most 128 bytes of UTF-8),
   * or a **synchronous** function of the request returning one (`undefined`, `null` or
   * `""`: the scope's anonymous tenant). The function sees the request's URL, method and
   * headers — a `Request` without its body, which a synchronous function could not read
   * anyway; returning a Promise is a `TypeError`. A request's `x-polygate-tenant` header
   * wins over this option (and the function is then not called); the header is removed
   * from every request before it is sent. Absent: the anonymous tenant.
   */
  tenant?: string | ((request: Request) => string | null | undefined);
  /** `"response"` (default): a synthetic 503/429; `"raise"`: throw the typed error. */
  onRefusal?: "response" | "raise";
  /** The fetch that sends the request; default the global `fetch`. */
  fetch?: FetchLike;
}

/** A granted source has no entry in `routes`: nothing was sent. */
export class RouteMissingError extends PolyGateError {
  /** The granted source. */
  readonly source: string;

  constructor(message: string, scope: string, source: string) {
    super(message, "route_missing", scope);
    this.source = source;
  }
}

// ------------------------------------------------------------------ estimate

const OUTPUT_KEY = /"(?:max_tokens|max_completion_tokens|max_output_tokens)"\s*:\s*(\d+)/;

function bodyText(body: unknown): string | null {
  if (typeof body === "string") return body;
  const bytes = bodyBytes(body);
  if (bytes !== null) return Buffer.from(bytes.buffer, bytes.byteOffset, bytes.byteLength).toString("utf8");
  if (body instanceof URLSearchParams) return body.toString();
  return null;
}

/** The bytes of a binary body (`ArrayBuffer`, a typed array or `DataView`), else `null`. */
function bodyBytes(body: unknown): Uint8Array | null {
  if (body instanceof ArrayBuffer) return new Uint8Array(body);
  if (ArrayBuffer.isView(body)) return new Uint8Array(body.buffer, body.byteOffset, body.byteLength);
  return null;
}

const STRICT_UTF8 = new TextDecoder("utf-8", { fatal: true, ignoreBOM: true });

/** `bytes` as UTF-8 text, or `null` when they are not valid UTF-8 (a route's model is then not set). */
function strictUtf8(bytes: Uint8Array): string | null {
  try {
    return STRICT_UTF8.decode(bytes);
  } catch {
    return null;
  }
}

function checkCount(v: unknown, what: string): number | undefined {
  if (v === undefined || v === null) return undefined;
  if (typeof v !== "number" || !Number.isSafeInteger(v) || v < 0) {
    throw new RangeError(`the estimate hook returned ${what} = ${String(v)}: expected a non-negative integer`);
  }
  return v;
}

/**
 * The built-in estimate of a request body: input = ceil(UTF-8 bytes / 4); output = the
 * first `max_tokens` / `max_completion_tokens` / `max_output_tokens` with a number.
 */
export function estimateBody(text: string | null): Estimate {
  if (text === null || text.length === 0) return {};
  const out: Estimate = { input: Math.ceil(Buffer.byteLength(text, "utf8") / 4) };
  const m = OUTPUT_KEY.exec(text);
  if (m !== null) {
    const n = Number(m[1]);
    if (Number.isSafeInteger(n)) out.output = n;
  }
  return out;
}

// ------------------------------------------------------------------ usage of a stream

const USAGE = Buffer.from('"usage"');
/** `"usage"` as bytes, matched backwards from the `:` before a `{`. */
const USAGE_BYTES = Uint8Array.from(USAGE);
const NL = 0x0a;
/** A line longer than this (with no newline yet) is dropped: its usage is lost, memory is not. */
const MAX_CARRY = 1 << 20;

/** Whether `buf[at..]` starts with `"usage"`. */
function usageAt(buf: Uint8Array, at: number): boolean {
  if (at < 0) return false;
  for (let i = 0; i < USAGE_BYTES.length; i++) if (buf[at + i] !== USAGE_BYTES[i]) return false;
  return true;
}

function utf8(b: Uint8Array): string {
  return Buffer.from(b.buffer, b.byteOffset, b.byteLength).toString("utf8");
}

function num(v: unknown): number | undefined {
  return typeof v === "number" && Number.isSafeInteger(v) && v >= 0 ? v : undefined;
}

/**
 * Reads the usage events of a server-sent-events stream as its bytes pass by: OpenAI
 * chat's final usage chunk, Responses' `response.completed`, Anthropic's
 * `message_start` (input) and `message_delta` (cumulative output). Only lines whose
 * `"usage"` is an object are parsed; a chunk without one costs a search for `{`.
 */
export class UsageScanner {
  /** Input tokens seen (cached reads excluded). */
  input: number | undefined;
  /** Output tokens seen. */
  output: number | undefined;
  /** Total tokens, when the provider states it. */
  total: number | undefined;
  private carry: Uint8Array | null = null;

  /** Scan the next chunk of the stream. */
  push(chunk: Uint8Array): void {
    let buf = chunk;
    if (this.carry !== null) {
      buf = Buffer.concat([this.carry, chunk]);
      this.carry = null;
    }
    const last = buf.lastIndexOf(NL);
    if (last + 1 < buf.length && buf.length - last - 1 <= MAX_CARRY) {
      this.carry = buf.slice(last + 1); // a copy: the chunk goes on to the caller
    }
    if (last >= 0) this.scan(buf, last);
  }

  /** The stream ended: a last line without a newline is scanned too. */
  end(): void {
    const c = this.carry;
    this.carry = null;
    if (c !== null) this.scan(c, c.length);
  }

  /**
   * Parse the lines of `buf[..end]` holding a usage object: a `{` after `"usage":`
   * (or `"usage": `). Only `{` bytes are visited (a few per event, found by the
   * typed array's own search), never a JSON parse of a chunk without one.
   */
  private scan(buf: Uint8Array, end: number): void {
    for (let p = buf.indexOf(0x7b); p >= 0 && p < end; p = buf.indexOf(0x7b, p + 1)) {
      let q = p - 1;
      if (buf[q] === 0x20) q--;
      if (buf[q] !== 0x3a /* : */) continue;
      if (buf[q - 1] === 0x20) q--;
      if (!usageAt(buf, q - USAGE_BYTES.length)) continue;
      const start = buf.lastIndexOf(NL, q) + 1;
      let stop = buf.indexOf(NL, p);
      if (stop < 0) stop = buf.length;
      this.line(utf8(buf.subarray(start, stop)));
      p = stop;
    }
  }

  private line(text: string): void {
    const t = text.endsWith("\r") ? text.slice(0, -1) : text;
    if (!t.startsWith("data:")) return;
    let doc: unknown;
    try {
      doc = JSON.parse(t.slice(5));
    } catch {
      return;
    }
    if (typeof doc !== "object" || doc === null) return;
    this.apply(doc as Record<string, unknown>);
  }

  private apply(d: Record<string, unknown>): void {
    const type = d.type;
    if (type === "message_start") {
      const u = (d.message as Record<string, unknown> | undefined)?.usage as Record<string, unknown> | undefined;
      if (typeof u !== "object" || u === null) return;
      this.input = num(u.input_tokens) ?? this.input;
      this.output = num(u.output_tokens) ?? this.output;
      return;
    }
    if (type === "message_delta") {
      const u = d.usage as Record<string, unknown> | undefined;
      if (typeof u !== "object" || u === null) return;
      this.input = num(u.input_tokens) ?? this.input;
      this.output = num(u.output_tokens) ?? this.output;
      return;
    }
    const r = d.response;
    const u = typeof r === "object" && r !== null && "usage" in r ? usageOf(r) : usageOf(d);
    if (u === undefined) return;
    this.total = u.tokens ?? this.total;
    this.input = u.inputTokens ?? this.input;
    this.output = u.outputTokens ?? this.output;
  }

  /** What was seen, as a report carries it; `undefined` = nothing (the estimate stands). */
  usage(): Usage | undefined {
    if (this.total === undefined && this.input === undefined && this.output === undefined) return undefined;
    const u: Usage = {};
    if (this.total !== undefined) u.tokens = this.total;
    if (this.input !== undefined) u.inputTokens = this.input;
    if (this.output !== undefined) u.outputTokens = this.output;
    return u;
  }
}

/** The usage of a JSON response body (parsed only if it names `"usage"`). */
function jsonUsage(buf: Uint8Array): Usage | undefined {
  const b = Buffer.from(buf.buffer, buf.byteOffset, buf.byteLength);
  if (b.indexOf(USAGE) < 0) return undefined;
  try {
    return usageOf(JSON.parse(b.toString("utf8")));
  } catch {
    return undefined;
  }
}

// ------------------------------------------------------------------ refusal

/** The `code` of a synthetic refusal body, and its status. */
function refusalCode(e: GatewayUnavailableError): [string, number] {
  if (e instanceof TenantLimitExceededError) return ["tenant_limited", 429];
  if (e instanceof CircuitOpenError) return ["circuit_open", 503];
  if (e instanceof AllSourcesExhaustedError) {
    const r = e.reason ?? "stalled";
    return [r, r === "quota_exhausted" ? 429 : 503];
  }
  return [e.kind, 503];
}

/**
 * The synthetic response of a refusal (bindings/conformance/transport): 503 for an open
 * circuit (and `stalled`, `retry_exhausted`), 429 for exhausted quota and for a
 * tenant's limit; `Retry-After` = ceil(retry_after_s), `retry-after-ms`,
 * `x-polygate-refusal: <code>`, `x-should-retry: false`, and a JSON error body naming
 * PolyGate. A tenant's refusal (DESIGN §19) adds `limit_source: "tenant"`, `tenant`
 * and `limit`, so a caller can tell a spent customer budget from a provider quota; no
 * other refusal carries `limit_source`.
 */
export function refusalResponse(e: GatewayUnavailableError, scope: string): Response {
  const [code, status] = refusalCode(e);
  const after = Number.isFinite(e.retryAfterS) && e.retryAfterS > 0 ? e.retryAfterS : 0;
  const error: Record<string, unknown> = {
    type: "polygate",
    code,
    message: `PolyGate refused the request in scope "${scope}" (${code}): ${e.message}`,
    scope,
    retry_after_s: after,
    per_source_reasons: e.perSourceReasons,
  };
  if (e instanceof TenantLimitExceededError) {
    error.limit_source = "tenant";
    error.tenant = e.tenant;
    error.limit = e.limit;
  }
  const body = { error };
  return new Response(JSON.stringify(body), {
    status,
    statusText: status === 429 ? "Too Many Requests" : "Service Unavailable",
    headers: {
      "content-type": "application/json",
      "retry-after": String(Math.ceil(after)),
      "retry-after-ms": String(Math.round(after * 1000)),
      // PolyGate's answer, not the provider's (DESIGN §17).
      "x-polygate-refusal": code,
      // The call-level budget is spent (PolyGate retried, failed over and waited as the
      // scope says): openai-node and @anthropic-ai/sdk honour this and do not retry it.
      "x-should-retry": "false",
    },
  });
}

// ------------------------------------------------------------------ one attempt

const noop = (): void => {};

/**
 * One request's attempt after the response arrived: the call, its permit and the
 * response headers. Every report of the transport goes through here, once.
 *
 * DESIGN §18: the provider's rate-limit headers of the response become the report's
 * observed limits in {@link Attempt.report}, aged by the time since the headers
 * arrived (a stream's length), so the sidecar dates the observation when the
 * provider made it. The sidecar applies them to an observing source only.
 */
class Attempt {
  private done = false;
  /** When the response's headers arrived (ms, `performance.now()`). */
  private readonly at = performance.now();

  constructor(
    /** The call of this request (ended by the report). */
    readonly call: Call,
    /** The permit the request was sent under. */
    readonly permit: Permit,
    /** The response's headers (`null` for a transport error: no response). */
    readonly headers: Headers | null,
  ) {}

  /** Report once and end the call; sidecar trouble never replaces the upstream's answer. */
  async report(send: (p: Permit) => Promise<unknown>): Promise<void> {
    if (this.done) return;
    this.done = true;
    if (this.headers !== null && this.permit.limits === null) {
      try {
        const limits = parseRateLimitHeaders(this.headers).limits;
        if (limits !== null) limits.ageS = Math.max(0, (performance.now() - this.at) / 1000);
        this.permit.limits = limits;
      } catch {
        // headers the parser cannot read: the report goes without them
      }
    }
    try {
      await send(this.permit);
    } catch {
      // a lost connection released everything; a refused report leaves the permit
      // unreported, and end() abandons it (its estimate is charged)
    }
    await this.call.end().catch(noop);
  }

  success(u: Usage | undefined): Promise<void> {
    return this.report((p) => p.success(u ?? {}));
  }

  failure(kind: FailureKind, u?: Usage): Promise<void> {
    return this.report((p) => p.failure(kind, u ?? {}));
  }

  rateLimited(retryAfterS: number | undefined): Promise<void> {
    return this.report((p) => p.rateLimited({ retryAfterS: retryAfterS ?? null }));
  }

  cancel(): Promise<void> {
    return this.report((p) => p.cancel());
  }
}

/** A non-2xx status → the report (DESIGN §17 item 4). */
function reportStatus(att: Attempt, status: number, headers: Headers): Promise<void> {
  // A 3xx (seen here with `redirect: "manual"`, or a 304): the source answered but did
  // no work — an uncounted success with no tokens (not blamed, the estimate refunded).
  if (status >= 300 && status < 400) return att.report((p) => p.success({ tokens: 0, countAttempt: false }));
  if (status === 429) return att.rateLimited(retryAfterOf({ headers }));
  if (status === 408) return att.failure("timeout");
  if (status === 409 || status >= 500) return att.failure("server_error");
  return att.failure("error");
}

/** The failure kind of a transport error (never `rate_limited`: no status came back). */
function failKind(e: unknown): FailureKind {
  const k = classifyError(e).kind;
  return k === "rate_limited" ? "error" : k;
}

/** An aborted request: the caller gave up (cancel) unless the abort says it timed out. */
function abortedOutcome(att: Attempt, signal: AbortSignal): Promise<void> {
  const reason = signal.reason as { name?: unknown } | undefined;
  return reason?.name === "TimeoutError" ? att.failure("timeout") : att.cancel();
}

const NULL_BODY = new Set([101, 103, 204, 205, 304]);

/** A response with the upstream's status and headers and `body` (the bytes it sent, or a gated stream). */
function rebuild(up: Response, body: ConstructorParameters<typeof Response>[0]): Response {
  const r = new Response(NULL_BODY.has(up.status) ? null : body, {
    status: up.status, statusText: up.statusText, headers: up.headers,
  });
  if (up.url) Object.defineProperty(r, "url", { value: up.url });
  return r;
}

/**
 * A gated stream dropped unread (garbage-collected before it ended or was cancelled)
 * is settled as abandoned, so its permit is not held until the sidecar's lease.
 */
const dropped = new FinalizationRegistry<() => void>((abandon) => abandon());

/**
 * `body` passed through unchanged, read on demand; the attempt is settled when the
 * stream ends (success with the usage seen), fails (classified failure), or is
 * abandoned — cancelled by the caller, the request's signal aborted, or the stream
 * dropped unread (success with what was seen, else the estimate).
 */
function gateStream(
  body: ReadableStream<Uint8Array>, att: Attempt, scan: UsageScanner | null, signal: AbortSignal | undefined,
): ReadableStream<Uint8Array> {
  const reader = body.getReader();
  let settled = false;
  const settle = (how: "end" | "abandon" | "error", err?: unknown): Promise<void> => {
    if (settled) return Promise.resolve();
    settled = true;
    dropped.unregister(att);
    signal?.removeEventListener("abort", onAbort);
    if (how === "end") scan?.end();
    const u = scan?.usage();
    if (how !== "error") return att.success(u);
    return signal?.aborted ? abortedOutcome(att, signal) : att.failure(failKind(err), u);
  };
  const onAbort = (): void => {
    void settle("abandon");
    reader.cancel(signal?.reason).catch(noop);
  };
  if (signal !== undefined) {
    if (signal.aborted) queueMicrotask(onAbort);
    else signal.addEventListener("abort", onAbort, { once: true });
  }
  const out = new ReadableStream<Uint8Array>({
    async pull(controller): Promise<void> {
      let r: Awaited<ReturnType<typeof reader.read>>;
      try {
        r = await reader.read();
      } catch (e) {
        await settle(signal?.aborted ? "abandon" : "error", e);
        controller.error(e);
        return;
      }
      if (r.done) {
        // settled before the caller sees the end: its next request finds the call gone
        await settle("end");
        controller.close();
        return;
      }
      scan?.push(r.value);
      controller.enqueue(r.value);
    },
    async cancel(reason): Promise<void> {
      await Promise.all([settle("abandon"), reader.cancel(reason).catch(noop)]);
    },
  });
  // The held callback must not reach `out` (it would never be collected).
  dropped.register(out, onAbort, att);
  return out;
}

/** Settle the attempt from the upstream's response; the response the caller gets. */
async function settleResponse(att: Attempt, up: Response, signal: AbortSignal | undefined): Promise<Response> {
  const status = up.status;
  const body = up.body;
  if (status < 200 || status >= 300) {
    let bytes: ArrayBuffer | null = null;
    try {
      bytes = body === null ? null : await up.arrayBuffer();
    } finally {
      await reportStatus(att, status, up.headers);
    }
    return rebuild(up, bytes);
  }
  if (body === null) {
    await att.success(undefined);
    return up;
  }
  const type = up.headers.get("content-type") ?? "";
  if (type.includes("text/event-stream")) return rebuild(up, gateStream(body, att, new UsageScanner(), signal));
  if (!type.includes("json")) return rebuild(up, gateStream(body, att, null, signal));
  let bytes: ArrayBuffer;
  try {
    bytes = await up.arrayBuffer();
  } catch (e) {
    await (signal?.aborted ? abortedOutcome(att, signal) : att.failure(failKind(e)));
    throw e;
  }
  await att.success(jsonUsage(new Uint8Array(bytes)));
  return rebuild(up, bytes);
}

// ------------------------------------------------------------------ tenants

/** The request header naming a request's tenant (DESIGN §19); removed before the request is sent. */
export const TENANT_HEADER = "x-polygate-tenant";

type TenantOption = NonNullable<FetchOptions["tenant"]>;

/** A tenant id given as `what`: a string of at most {@link MAX_TENANT_BYTES} bytes of UTF-8. */
function checkTenantId(what: string, v: string): string {
  const n = Buffer.byteLength(v, "utf8");
  if (n > MAX_TENANT_BYTES) {
    throw new RangeError(`${what}: the tenant id ${JSON.stringify(v.slice(0, 32))}... is ${n} bytes of UTF-8; the limit is ${MAX_TENANT_BYTES} bytes`);
  }
  return v;
}

function checkTenantOption(v: unknown): TenantOption | undefined {
  if (v === undefined || v === null) return undefined;
  if (typeof v === "function") return v as TenantOption;
  if (typeof v !== "string") {
    throw new TypeError(`tenant must be a string (a tenant id) or a function of the request returning one, got ${v === null ? "null" : typeof v}`);
  }
  return checkTenantId("the tenant option", v);
}

/**
 * The request as the tenant function sees it: its URL, method and headers, no body (a
 * synchronous function cannot read one, and the body still has to be sent).
 */
function tenantView(url: string, method: string, headers: Headers): Request {
  return new Request(url, { method, headers });
}

/** The tenant `fn` names for the request; `null`: the anonymous tenant. */
function tenantOf(fn: (request: Request) => unknown, view: () => Request): string | null {
  const t = fn(view());
  if (t === undefined || t === null || t === "") return null;
  if (typeof t === "string") return checkTenantId("the tenant function", t);
  if (typeof t === "object" && typeof (t as { then?: unknown }).then === "function") {
    throw new TypeError("the tenant function returned a Promise: it must be synchronous, returning the tenant id (a string) or undefined");
  }
  throw new TypeError(`the tenant function must return a string (a tenant id) or undefined, got ${typeof t}`);
}

// ------------------------------------------------------------------ the fetch

interface RouteIn {
  /** `scheme://host[:port]` the request goes to. */
  root: string;
  /** `baseURL`'s path without its trailing `/` (`""` for none). */
  prefix: string;
  /** `baseURL`'s origin, the port always given (`originKey`): a request under a base URL of another origin leaves its credentials behind. */
  origin: string;
  /** Extra headers. */
  headers: [string, string][];
  /** Query parameters set on the request, sorted by name. */
  query: [string, string][];
  /** The model name a JSON-object body gets, if any. */
  model: string | undefined;
}

/** A base URL a request URL is matched against: its origin (the port always given) and path prefix. */
type Base = [origin: string, prefix: string];

function originKey(u: URL): string {
  return `${u.protocol}//${u.hostname}:${u.port || (u.protocol === "https:" ? "443" : "80")}`;
}

function parseBase(what: string, raw: unknown): URL {
  let u: URL;
  try {
    u = new URL(String(raw));
  } catch {
    throw new TypeError(`${what} is not an absolute URL: ${JSON.stringify(raw)}`);
  }
  if (u.protocol !== "http:" && u.protocol !== "https:") throw new TypeError(`${what} must be an http(s) URL, got ${JSON.stringify(raw)}`);
  if (u.search !== "" || u.hash !== "") {
    throw new TypeError(`${what} must not have a query or fragment (give query parameters as its route's query), got ${JSON.stringify(raw)}`);
  }
  return u;
}

function stringMap(what: string, v: unknown): [string, string][] {
  if (v === undefined) return [];
  if (typeof v !== "object" || v === null || Array.isArray(v)) throw new TypeError(`${what} must be an object of strings`);
  return Object.entries(v as Record<string, unknown>).map(([k, x]): [string, string] => {
    if (typeof x !== "string") throw new TypeError(`${what}["${k}"] must be a string, got ${typeof x}`);
    return [k, x];
  });
}

function prepareRoutes(routes: Record<string, Route> | undefined, sdkBaseURL: string | undefined): [Map<string, RouteIn>, Base[]] | null {
  if (routes === undefined) return null;
  if (typeof routes !== "object" || routes === null) throw new TypeError("routes must be an object: source → {baseURL, headers}");
  // Every grant would be a RouteMissingError: said once, here, as Python's constructor says it.
  if (Object.keys(routes).length === 0) {
    throw new TypeError("routes must name at least one source (source → {baseURL, headers}); leave it out to send requests where the SDK sent them");
  }
  const m = new Map<string, RouteIn>();
  const bases: Base[] = [];
  for (const [src, r] of Object.entries(routes)) {
    if (typeof r !== "object" || r === null || typeof r.baseURL !== "string") {
      throw new TypeError(`routes["${src}"] needs a baseURL string`);
    }
    const u = parseBase(`routes["${src}"].baseURL`, r.baseURL);
    const query = stringMap(`routes["${src}"].query`, r.query).sort(([a], [b]) => (a < b ? -1 : a > b ? 1 : 0));
    if (query.some(([k]) => k === "")) throw new TypeError(`routes["${src}"].query has an empty parameter name`);
    if (r.model !== undefined && (typeof r.model !== "string" || r.model === "")) {
      throw new TypeError(`routes["${src}"].model must be a non-empty string, got ${JSON.stringify(r.model)}`);
    }
    const prefix = u.pathname.replace(/\/+$/, "");
    m.set(src, { root: u.origin, prefix, origin: originKey(u), headers: stringMap(`routes["${src}"].headers`, r.headers), query, model: r.model });
    bases.push([originKey(u), prefix]);
  }
  if (sdkBaseURL !== undefined) {
    const u = parseBase("sdkBaseURL", sdkBaseURL);
    bases.push([originKey(u), u.pathname.replace(/\/+$/, "")]);
  }
  bases.sort((a, b) => b[1].length - a[1].length);
  return [m, bases];
}

/** Whether `path` is `prefix` or below it, at a segment boundary. */
function under(path: string, prefix: string): boolean {
  return prefix === "" || path === prefix || (path.startsWith(prefix) && path[prefix.length] === "/");
}

/** Percent-encoding of everything but `A-Za-z0-9-._~` (as the Python and Go bindings do). */
function enc(s: string): string {
  return encodeURIComponent(s).replace(/[!'()*]/g, (c) => `%${c.charCodeAt(0).toString(16).toUpperCase()}`);
}

function decodeName(s: string): string {
  try {
    return decodeURIComponent(s.replace(/\+/g, " "));
  } catch {
    return s;
  }
}

/** `query` (raw, no `?`) without the parameters `params` names, then `params`. */
function withQuery(query: string, params: [string, string][]): string {
  const names = new Set(params.map(([k]) => k));
  const kept = query.split("&").filter((kv) => kv !== "" && !names.has(decodeName(kv.split("=", 1)[0]!)));
  for (const [k, v] of params) kept.push(`${enc(k)}=${enc(v)}`);
  return kept.join("&");
}

/**
 * Headers that carry a caller's credentials (HTTP auth, cookies; Azure's, Anthropic's
 * and Gemini's API key headers): they stay with the origin the SDK sent them to.
 */
const CREDENTIAL_HEADERS = ["authorization", "proxy-authorization", "cookie", "api-key", "x-api-key", "x-goog-api-key"] as const;

/**
 * `[url, cross]`: `url` for `route`, and whether that leaves the origin the SDK
 * addressed. Under one of `bases` (the longest first; the SDK's base URL is one of the
 * routes') that prefix is replaced by the route's base URL, `cross` when the route's
 * origin is another (its `CREDENTIAL_HEADERS` are then not sent, DESIGN §17); else the
 * route's path is put in front of the whole path (not `cross`: the routes are its only
 * destinations). The route's query replaces same-named parameters.
 */
function rebase(url: string, route: RouteIn, bases: Base[]): [string, boolean] {
  const u = new URL(url);
  const key = originKey(u);
  let path = u.pathname;
  const hit = bases.find(([o, p]) => o === key && under(path, p));
  path = route.prefix + (hit === undefined ? path : path.slice(hit[1].length));
  if (!path.startsWith("/")) path = `/${path}`;
  let query = u.search.slice(1);
  if (route.query.length > 0) query = withQuery(query, route.query);
  return [route.root + path + (query === "" ? "" : `?${query}`), hit !== undefined && hit[0] !== route.origin];
}

/**
 * A routed 3xx (the SDK's `redirect: "manual"`; fetch follows the others itself,
 * below the transport) with its `Location` written as the SDK's own URL. Resolved
 * against the URL actually sent (RFC 9110, section 10.2.2), a target under the
 * granted route's base URL has that prefix replaced by the one the SDK's request
 * (`sdk`) was under, so a caller following it asks for its own URL again, admitted
 * and routed as any other (its credentials ruled for its own grant) — not one
 * resolved against its own URL and routed twice, nor the route's host's URL sent
 * with the SDK's keys. Any other target is made absolute.
 */
function relocate(up: Response, sdk: string, sent: string, route: RouteIn): Response {
  const loc = up.headers.get("location");
  if (loc === null) return up;
  let to: URL;
  try {
    to = new URL(loc, sent);
  } catch {
    return up; // a Location the URL parser refuses: the caller's to deal with
  }
  const back = sdkLocation(new URL(sdk), new URL(sent), route, to);
  if (back === null && /^[A-Za-z][A-Za-z0-9+.-]*:/.test(loc)) return up;
  const headers = new Headers(up.headers);
  headers.set("location", back ?? to.href);
  const r = new Response(NULL_BODY.has(up.status) ? null : up.body, { status: up.status, statusText: up.statusText, headers });
  if (up.url) Object.defineProperty(r, "url", { value: up.url });
  return r;
}

/** `target` under the SDK's base URL, for a target under `route`'s base URL (the origin `sent` went to); `null` for any other. */
function sdkLocation(sdk: URL, sent: URL, route: RouteIn, target: URL): string | null {
  if (originKey(target) !== originKey(sent) || !under(target.pathname, route.prefix) || !sent.pathname.startsWith(route.prefix)) return null;
  const rest = sent.pathname.slice(route.prefix.length);
  if (!sdk.pathname.endsWith(rest)) return null;
  let path = sdk.pathname.slice(0, sdk.pathname.length - rest.length) + target.pathname.slice(route.prefix.length);
  if (!path.startsWith("/")) path = `/${path}`;
  return sdk.origin + path + target.search + target.hash;
}

/** `headers` without the caller's credentials when the request leaves their origin. */
function dropCredentials(headers: Headers, cross: boolean): void {
  if (cross) for (const k of CREDENTIAL_HEADERS) headers.delete(k);
}

const J_STRING = /"(?:[^"\\]|\\.)*"/sy;
const J_SCALAR = /[^,}\]\s]*/y;
const J_NESTED = /"(?:[^"\\]|\\.)*"|[[\]{}]/gs;
const J_WS = /[ \t\r\n]*/y;

function sticky(re: RegExp, s: string, i: number): number {
  re.lastIndex = i;
  return re.exec(s) === null ? i : re.lastIndex;
}

/** The index after the JSON value at `s[i]` (`s` is valid JSON). */
function valueEnd(s: string, i: number): number {
  const c = s[i];
  if (c === '"') return sticky(J_STRING, s, i);
  if (c !== "{" && c !== "[") return sticky(J_SCALAR, s, i);
  let depth = 0;
  J_NESTED.lastIndex = i;
  for (let m = J_NESTED.exec(s); m !== null; m = J_NESTED.exec(s)) {
    const t = m[0];
    if (t === "{" || t === "[") depth++;
    else if (t === "}" || t === "]") {
      depth--;
      if (depth === 0) return J_NESTED.lastIndex;
    }
  }
  return s.length;
}

/**
 * `text` with its top-level `"model"` set to `model` (added first when it has none),
 * every other character kept; `null` when the body is not a JSON object (sent as it is).
 */
export function setModel(text: string, model: string): string | null {
  let doc: unknown;
  try {
    doc = JSON.parse(text);
  } catch {
    return null;
  }
  if (typeof doc !== "object" || doc === null || Array.isArray(doc)) return null;
  if ((doc as Record<string, unknown>).model === model) return text;
  const lit = JSON.stringify(model);
  const spans: [number, number][] = [];
  let i = sticky(J_WS, text, sticky(J_WS, text, 0) + 1);
  while (text[i] === '"') {
    const keyEnd = sticky(J_STRING, text, i);
    const key = text.slice(i, keyEnd);
    i = sticky(J_WS, text, sticky(J_WS, text, keyEnd) + 1); // past the ':'
    const end = valueEnd(text, i);
    if (key === '"model"' || (key.includes("\\") && JSON.parse(key) === "model")) spans.push([i, end]);
    i = sticky(J_WS, text, end);
    if (text[i] !== ",") break;
    i = sticky(J_WS, text, i + 1);
  }
  if (spans.length === 0) {
    const at = text.indexOf("{") + 1;
    return `${text.slice(0, at)}"model":${lit}${Object.keys(doc).length > 0 ? "," : ""}${text.slice(at)}`;
  }
  let out = text;
  for (const [a, b] of spans.reverse()) out = out.slice(0, a) + lit + out.slice(b);
  return out;
}

/**
 * A `fetch` that gates every request through PolyGate (DESIGN §17): pass it to an SDK
 * once, where the client is built — `new OpenAI({ fetch: polygate.fetch({ scope: "chat" }) })`.
 */
export function fetch(opts: FetchOptions): FetchLike {
  if (typeof opts !== "object" || opts === null) throw new TypeError("polygate.fetch({ scope, ... }) needs an options object");
  const scope = opts.scope;
  if (typeof scope !== "string" || scope === "") throw new TypeError(`scope must be a non-empty string, got ${String(scope)}`);
  const onRefusal = opts.onRefusal ?? "response";
  if (onRefusal !== "response" && onRefusal !== "raise") {
    throw new TypeError(`onRefusal must be "response" or "raise", got ${JSON.stringify(onRefusal)}`);
  }
  const prepared = prepareRoutes(opts.routes, opts.sdkBaseURL);
  const routes = prepared === null ? null : prepared[0];
  const bases = prepared === null ? [] : prepared[1];
  const base: FetchLike = opts.fetch ?? ((input, init) => globalThis.fetch(input, init));
  const hook = opts.estimate;
  const priority = opts.priority;
  const tenantOpt = checkTenantOption(opts.tenant);
  const tenantFn = typeof tenantOpt === "function" ? tenantOpt : null;
  const tenantFixed = typeof tenantOpt === "string" && tenantOpt !== "" ? tenantOpt : null;
  let clientP: Promise<Client> | null = null;
  const getClient = (): Promise<Client> => {
    if (opts.client !== undefined) return Promise.resolve(opts.client);
    if (clientP === null) {
      clientP = connect(opts.path).catch((e: unknown) => {
        clientP = null;
        throw e;
      });
    }
    return clientP;
  };

  return async function gatedFetch(input: string | URL | Request, init?: RequestInit): Promise<Response> {
    const isReq = typeof Request !== "undefined" && input instanceof Request;
    const url = isReq ? (input as Request).url : String(input);
    const signal = init?.signal ?? (isReq ? (input as Request).signal : undefined) ?? undefined;
    let text: string | null;
    // A binary body's bytes (init's, or the Request's, read here for the estimate): a
    // route's model is set only in valid UTF-8, and a Request's body is sent as these
    // bytes (its length known: re-wrapping the Request would send it chunked).
    let bytes: Uint8Array | null = null;
    let readReq = false;
    if (init?.body !== undefined && init.body !== null) {
      text = bodyText(init.body);
      bytes = bodyBytes(init.body);
    } else if (isReq && (input as Request).body !== null) {
      bytes = new Uint8Array(await (input as Request).clone().arrayBuffer());
      text = Buffer.from(bytes.buffer, bytes.byteOffset, bytes.byteLength).toString("utf8");
      readReq = true;
    } else text = null;
    // The headers the request is sent with: init's replace the Request's (as fetch does).
    const reqHeaders = init?.headers !== undefined ? init.headers : isReq ? (input as Request).headers : undefined;
    const headersOf = (): Headers => new Headers(reqHeaders);
    const methodOf = (): string => (init?.method ?? (isReq ? (input as Request).method : "GET")).toUpperCase();
    // The tenant: the request's header, else the option (DESIGN §19); "" is the anonymous tenant.
    const named = reqHeaders === undefined ? null : (reqHeaders instanceof Headers ? reqHeaders : headersOf()).get(TENANT_HEADER);
    let tenant: string | null;
    if (named !== null) tenant = named === "" ? null : checkTenantId(`the ${TENANT_HEADER} header`, named);
    else if (tenantFn !== null) tenant = tenantOf(tenantFn, () => tenantView(url, methodOf(), headersOf()));
    else tenant = tenantFixed;

    let est = estimateBody(text);
    if (hook !== undefined) {
      const mine = hook({ url, method: methodOf(), headers: headersOf(), body: text });
      if (mine !== null && mine !== undefined) {
        est = {
          input: checkCount(mine.input, "input") ?? est.input,
          output: checkCount(mine.output, "output") ?? est.output,
        };
      }
    }

    const client = await getClient();
    const call = await client.call(scope, { estInputTokens: est.input, estOutputTokens: est.output, priority, tenant });
    let permit: Permit;
    try {
      permit = await call.acquire({ signal: signal ?? undefined });
    } catch (e) {
      await call.end().catch(noop);
      if (onRefusal === "response" && e instanceof GatewayUnavailableError) return refusalResponse(e, scope);
      throw e;
    }

    let target: string | Request = isReq ? (input as Request) : url;
    let sendInit = init;
    let granted: RouteIn | undefined;
    if (routes !== null) {
      const route = routes.get(permit.source);
      granted = route;
      if (route === undefined) {
        await new Attempt(call, permit, null).cancel();
        throw new RouteMissingError(
          `PolyGate granted source "${permit.source}" in scope "${scope}", which has no entry in routes `
          + `(routes name: ${[...routes.keys()].join(", ") || "nothing"}); add it to routes, or remove it from the scope`,
          scope, permit.source);
      }
      const [to, cross] = rebase(url, route, bases);
      // The route's model, set in a JSON-object body (its length follows: no stale Content-Length).
      // A binary body that is not valid UTF-8 is sent as it is (decoding it would corrupt it).
      const json = bytes === null ? text : strictUtf8(bytes);
      const model = route.model === undefined || json === null ? null : setModel(json, route.model);
      const body = model !== null && model !== json ? model : null;
      if (isReq) {
        let r = new Request(to, new Request(input as Request, init));
        if (body !== null) r = new Request(r, { body });
        else if (readReq && bytes !== null) r = new Request(r, { body: bytes }); // its length known, not chunked
        dropCredentials(r.headers, cross); // the SDK's keys stay with their origin (DESIGN §17)
        for (const [k, v] of route.headers) r.headers.set(k, v);
        if (body !== null) r.headers.delete("content-length");
        r.headers.delete(TENANT_HEADER);
        target = r;
        sendInit = undefined;
      } else {
        const headers = new Headers(init?.headers);
        dropCredentials(headers, cross); // the SDK's keys stay with their origin (DESIGN §17)
        for (const [k, v] of route.headers) headers.set(k, v);
        headers.delete(TENANT_HEADER);
        target = to;
        sendInit = { ...init, headers };
        if (body !== null) {
          headers.delete("content-length");
          sendInit.body = body;
        }
      }
    } else if (named !== null) {
      // Sent where the caller sent it, without the tenant header.
      if (isReq) {
        const r = new Request(input as Request, init);
        r.headers.delete(TENANT_HEADER);
        target = r;
        sendInit = undefined;
      } else {
        const headers = headersOf();
        headers.delete(TENANT_HEADER);
        sendInit = { ...init, headers };
      }
    }

    let up: Response;
    try {
      up = await base(target, sendInit);
    } catch (e) {
      const att = new Attempt(call, permit, null);
      if (signal?.aborted) await abortedOutcome(att, signal);
      else await att.failure(failKind(e));
      throw e;
    }
    if (granted !== undefined && up.status >= 300 && up.status < 400) {
      up = relocate(up, url, typeof target === "string" ? target : target.url, granted);
    }
    return settleResponse(new Attempt(call, permit, up.headers), up, signal ?? undefined);
  };
}
