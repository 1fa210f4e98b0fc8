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
 * - `routes` (source → `{baseURL, headers}`) sends the request to the granted source's
 *   deployment with that source's extra headers; a granted source missing from
 *   `routes` is a {@link RouteMissingError} before anything is sent.
 * - The estimate: input = UTF-8 bytes of the body / 4, output = the body's
 *   `max_tokens` / `max_completion_tokens` / `max_output_tokens` (else the source's
 *   `est_output_tokens`), or the user's `estimate` hook.
 * - The outcome: 2xx → success with the JSON body's usage (OpenAI chat, responses,
 *   embeddings; Anthropic messages); `text/event-stream` bodies pass through unchanged
 *   while {@link UsageScanner} reads the usage events, and the permit is held until the
 *   stream ends (or is abandoned: then settled with what was seen, else the estimate);
 *   429 → rate-limited (`retry-after-ms`, then `Retry-After`); 408, 409, 5xx → transient
 *   failures; transport errors → classified (`connection`, `timeout`); other 4xx →
 *   `error`. The response reaches the SDK unchanged.
 * - A refusal (`CircuitOpen`, `AllSourcesExhausted`) becomes a synthetic 503 (429 for
 *   exhausted quota) with `Retry-After` and a JSON body naming PolyGate and the reason,
 *   or, with `onRefusal: "raise"`, the typed error is thrown.
 *
 * DESIGN §18: {@link Attempt} is the one place holding (permit, response headers) after
 * a response; the provider's rate-limit headers are turned into observed limits there.
 */

import { Usage, classifyError, retryAfterOf, usageOf } from "./classify.js";
import type { FailureKind } from "./classify.js";
import { Call, Client, Permit, connect } from "./client.js";
import { AllSourcesExhaustedError, CircuitOpenError, GatewayUnavailableError, PolyGateError } from "./errors.js";
import { parseRateLimitHeaders } from "./ratelimit.js";

/** What `fetch` looks like to an SDK (`new OpenAI({fetch})`, `new Anthropic({fetch})`, `createOpenAI({fetch})`). */
export type FetchLike = (input: string | URL | Request, init?: RequestInit) => Promise<Response>;

/** Where a granted source's requests go (DESIGN §17 item 2). */
export interface Route {
  /** Base URL of the source's deployment; replaces the SDK's base URL (see {@link FetchOptions.sdkBaseURL}). */
  baseURL: string;
  /** Extra headers set on the request (API key, `api-key`, …), replacing the SDK's of the same name. */
  headers?: Record<string, string>;
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
  /** Source → deployment; without it the request goes where the SDK sent it. */
  routes?: Record<string, Route>;
  /**
   * The SDK's base URL (e.g. `https://api.openai.com/v1`): with `routes`, the request
   * URL's part after it is appended to the route's `baseURL`. Default: the request's
   * origin, so the whole path is appended.
   */
  sdkBaseURL?: string;
  /** Your own estimate; return `undefined` (or leave a side out) for the built-in rule. */
  estimate?: (req: EstimateRequest) => Estimate | null | undefined;
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
  if (body instanceof ArrayBuffer) return Buffer.from(body).toString("utf8");
  if (ArrayBuffer.isView(body)) return Buffer.from(body.buffer, body.byteOffset, body.byteLength).toString("utf8");
  if (body instanceof URLSearchParams) return body.toString();
  return null;
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
  if (e instanceof CircuitOpenError) return ["circuit_open", 503];
  if (e instanceof AllSourcesExhaustedError) {
    const r = e.reason ?? "stalled";
    return [r, r === "quota_exhausted" ? 429 : 503];
  }
  return [e.kind, 503];
}

/**
 * The synthetic response of a refusal (bindings/conformance/transport): 503 for an open
 * circuit (and `stalled`, `retry_exhausted`), 429 for exhausted quota; `Retry-After` =
 * ceil(retry_after_s), `retry-after-ms`, `x-should-retry: false`, and a JSON error
 * body naming PolyGate.
 */
export function refusalResponse(e: GatewayUnavailableError, scope: string): Response {
  const [code, status] = refusalCode(e);
  const after = Number.isFinite(e.retryAfterS) && e.retryAfterS > 0 ? e.retryAfterS : 0;
  const body = {
    error: {
      type: "polygate",
      code,
      message: `PolyGate refused the request in scope "${scope}" (${code}): ${e.message}`,
      scope,
      retry_after_s: after,
      per_source_reasons: e.perSourceReasons,
    },
  };
  return new Response(JSON.stringify(body), {
    status,
    statusText: status === 429 ? "Too Many Requests" : "Service Unavailable",
    headers: {
      "content-type": "application/json",
      "retry-after": String(Math.ceil(after)),
      "retry-after-ms": String(Math.round(after * 1000)),
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

// ------------------------------------------------------------------ the fetch

interface RouteIn {
  base: string;
  headers: [string, string][];
}

function prepareRoutes(routes: Record<string, Route> | undefined): Map<string, RouteIn> | null {
  if (routes === undefined) return null;
  if (typeof routes !== "object" || routes === null) throw new TypeError("routes must be an object: source → {baseURL, headers}");
  const m = new Map<string, RouteIn>();
  for (const [src, r] of Object.entries(routes)) {
    if (typeof r !== "object" || r === null || typeof r.baseURL !== "string") {
      throw new TypeError(`routes["${src}"] needs a baseURL string`);
    }
    let u: URL;
    try {
      u = new URL(r.baseURL);
    } catch {
      throw new TypeError(`routes["${src}"].baseURL is not an absolute URL: ${JSON.stringify(r.baseURL)}`);
    }
    const headers = Object.entries(r.headers ?? {}).map(([k, v]): [string, string] => {
      if (typeof v !== "string") throw new TypeError(`routes["${src}"].headers["${k}"] must be a string`);
      return [k, v];
    });
    m.set(src, { base: u.href.replace(/\/+$/, ""), headers });
  }
  return m;
}

/** `url` re-rooted under `route.base`: the part after `sdkBase` (else after the origin) is appended. */
function rebase(url: string, route: RouteIn, sdkBase: string | null): string {
  let rest: string;
  if (sdkBase !== null && url.startsWith(sdkBase)) {
    rest = url.slice(sdkBase.length);
  } else {
    const u = new URL(url);
    rest = u.pathname + u.search;
  }
  return route.base + (rest.startsWith("/") || rest.startsWith("?") || rest === "" ? rest : `/${rest}`);
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
  const routes = prepareRoutes(opts.routes);
  const sdkBase = opts.sdkBaseURL === undefined ? null : opts.sdkBaseURL.replace(/\/+$/, "");
  const base: FetchLike = opts.fetch ?? ((input, init) => globalThis.fetch(input, init));
  const hook = opts.estimate;
  const priority = opts.priority;
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
    if (init?.body !== undefined && init.body !== null) text = bodyText(init.body);
    else if (isReq && (input as Request).body !== null) text = await (input as Request).clone().text();
    else text = null;
    let est = estimateBody(text);
    if (hook !== undefined) {
      const method = init?.method ?? (isReq ? (input as Request).method : "GET");
      const headers = new Headers(init?.headers ?? (isReq ? (input as Request).headers : undefined));
      const mine = hook({ url, method: method.toUpperCase(), headers, body: text });
      if (mine !== null && mine !== undefined) {
        est = {
          input: checkCount(mine.input, "input") ?? est.input,
          output: checkCount(mine.output, "output") ?? est.output,
        };
      }
    }

    const client = await getClient();
    const call = await client.call(scope, { estInputTokens: est.input, estOutputTokens: est.output, priority });
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
    if (routes !== null) {
      const route = routes.get(permit.source);
      if (route === undefined) {
        await new Attempt(call, permit, null).cancel();
        throw new RouteMissingError(
          `PolyGate granted source "${permit.source}" in scope "${scope}", which has no entry in routes `
          + `(routes name: ${[...routes.keys()].join(", ") || "nothing"}); add it to routes, or remove it from the scope`,
          scope, permit.source);
      }
      const to = rebase(url, route, sdkBase);
      if (isReq) {
        const r = new Request(to, new Request(input as Request, init));
        for (const [k, v] of route.headers) r.headers.set(k, v);
        target = r;
        sendInit = undefined;
      } else {
        const headers = new Headers(init?.headers);
        for (const [k, v] of route.headers) headers.set(k, v);
        target = to;
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
    return settleResponse(new Attempt(call, permit, up.headers), up, signal ?? undefined);
  };
}
