// run()'s error classification and usage extraction, on the shapes real SDKs throw.

import * as assert from "node:assert/strict";
import { describe, test } from "node:test";

import { classifyError, retryAfterOf, statusOf, usageOf } from "../src/index.js";

const T = { timeout: 10_000 };

/** Shaped like openai-node's APIError: `.status`, `.headers` (a Headers-like), `.error`. */
class APIError extends Error {
  constructor(readonly status: number | undefined, readonly headers: Record<string, string> | undefined, message: string) {
    super(message);
  }
}
class RateLimitError extends APIError {}
class APIConnectionError extends APIError {
  constructor(opts: { cause?: unknown } = {}) {
    super(undefined, undefined, "Connection error.");
    if (opts.cause !== undefined) Object.defineProperty(this, "cause", { value: opts.cause });
  }
}
class APIConnectionTimeoutError extends APIConnectionError {}

describe("classifyError", () => {
  test("HTTP statuses: 429 with Retry-After, 408, 5xx, other 4xx re-thrown", T, () => {
    assert.deepEqual(classifyError(new RateLimitError(429, { "retry-after": "7" }, "Rate limit")), { kind: "rate_limited", retryAfterS: 7 });
    assert.deepEqual(classifyError(new RateLimitError(429, { "retry-after-ms": "1500", "retry-after": "2" }, "x")), { kind: "rate_limited", retryAfterS: 1.5 });
    assert.deepEqual(classifyError(new RateLimitError(429, undefined, "x")), { kind: "rate_limited" });
    assert.deepEqual(classifyError(new APIError(408, {}, "x")), { kind: "timeout" });
    assert.deepEqual(classifyError(new APIError(500, {}, "x")), { kind: "server_error" });
    assert.deepEqual(classifyError(new APIError(529, {}, "overloaded")), { kind: "server_error" });
    assert.deepEqual(classifyError(new APIError(400, {}, "x")), { kind: "error", rethrow: true });
    assert.deepEqual(classifyError(new APIError(401, {}, "x")), { kind: "error", rethrow: true });
    assert.deepEqual(classifyError(new APIError(404, {}, "x")), { kind: "error", rethrow: true });
  });

  test("thrown fetch Responses and axios-style errors", T, () => {
    assert.deepEqual(classifyError(new Response("slow down", { status: 429, headers: { "Retry-After": "3" } })), { kind: "rate_limited", retryAfterS: 3 });
    assert.deepEqual(classifyError(new Response(null, { status: 503 })), { kind: "server_error" });
    assert.deepEqual(classifyError(new Response(null, { status: 422 })), { kind: "error", rethrow: true });
    const axios = Object.assign(new Error("Request failed with status code 429"), { response: { status: 429, headers: { "retry-after": "4" } } });
    assert.deepEqual(classifyError(axios), { kind: "rate_limited", retryAfterS: 4 });
    assert.equal(statusOf({ statusCode: 502 }), 502);
    assert.equal(statusOf({ status: "503" }), 503);
    assert.equal(statusOf({ status: 42 }), undefined);
  });

  test("Retry-After as an HTTP date", T, () => {
    const now = Date.parse("2026-12-01T12:00:00Z");
    assert.equal(retryAfterOf({ headers: { "retry-after": "Tue, 01 Dec 2026 12:00:30 GMT" } }, now), 30);
    assert.equal(retryAfterOf({ headers: { "retry-after": "Tue, 01 Dec 2026 11:00:00 GMT" } }, now), 0);
    assert.equal(retryAfterOf({ headers: { "retry-after": "soon" } }, now), undefined);
    assert.equal(retryAfterOf({ headers: new Headers({ "retry-after": "12" }) }), 12);
    assert.equal(retryAfterOf({ headers: { "Retry-After": ["5", "6"] } }), 5);
  });

  test("timeouts: AbortError, TimeoutError, ETIMEDOUT, undici and SDK timeout classes", T, () => {
    assert.deepEqual(classifyError(new DOMException("aborted", "AbortError")), { kind: "timeout" });
    assert.deepEqual(classifyError(new DOMException("The operation timed out.", "TimeoutError")), { kind: "timeout" });
    assert.deepEqual(classifyError(Object.assign(new Error("connect ETIMEDOUT 1.2.3.4:443"), { code: "ETIMEDOUT" })), { kind: "timeout" });
    assert.deepEqual(classifyError(new TypeError("fetch failed", { cause: Object.assign(new Error("Headers Timeout Error"), { code: "UND_ERR_HEADERS_TIMEOUT" }) })), { kind: "timeout" });
    assert.deepEqual(classifyError(new APIConnectionTimeoutError()), { kind: "timeout" });
  });

  test("connection errors, also as fetch's cause", T, () => {
    for (const code of ["ECONNRESET", "ECONNREFUSED", "EPIPE", "ENOTFOUND", "EAI_AGAIN", "UND_ERR_SOCKET"]) {
      assert.deepEqual(classifyError(Object.assign(new Error(code), { code })), { kind: "connection" }, code);
    }
    assert.deepEqual(classifyError(new TypeError("fetch failed", { cause: Object.assign(new Error("x"), { code: "ECONNREFUSED" }) })), { kind: "connection" });
    assert.deepEqual(classifyError(new TypeError("fetch failed")), { kind: "connection" });
    assert.deepEqual(classifyError(new APIConnectionError({ cause: new Error("socket hang up") })), { kind: "connection" });
  });

  test("anything else is error (retried), whatever it is", T, () => {
    assert.deepEqual(classifyError(new Error("nope")), { kind: "error" });
    assert.deepEqual(classifyError(new TypeError("x is undefined")), { kind: "error" });
    assert.deepEqual(classifyError("a string"), { kind: "error" });
    assert.deepEqual(classifyError(undefined), { kind: "error" });
    assert.deepEqual(classifyError(null), { kind: "error" });
    const hostile = { get status(): number { throw new Error("getter"); } };
    assert.deepEqual(classifyError(hostile), { kind: "error" });
    const loop: { cause?: unknown } = {};
    loop.cause = loop;
    assert.deepEqual(classifyError(loop), { kind: "error" });
  });
});

describe("usageOf", () => {
  test("OpenAI chat: total, input minus cached reads, output", T, () => {
    assert.deepEqual(usageOf({ usage: { prompt_tokens: 900, completion_tokens: 300, total_tokens: 1200, prompt_tokens_details: { cached_tokens: 256 } } }),
      { tokens: 1200, inputTokens: 644, outputTokens: 300 });
    assert.deepEqual(usageOf({ usage: { total_tokens: 77 } }), { tokens: 77 });
  });

  test("Anthropic: input (cache reads already apart) and output; OpenAI Responses", T, () => {
    assert.deepEqual(usageOf({ usage: { input_tokens: 30, output_tokens: 7, cache_read_input_tokens: 100 } }), { inputTokens: 30, outputTokens: 7 });
    assert.deepEqual(usageOf({ usage: { input_tokens: 500, output_tokens: 20, total_tokens: 520, input_tokens_details: { cached_tokens: 100 } } }),
      { tokens: 520, inputTokens: 400, outputTokens: 20 });
  });

  test("no or junk usage", T, () => {
    assert.equal(usageOf(undefined), undefined);
    assert.equal(usageOf("text"), undefined);
    assert.equal(usageOf({ usage: null }), undefined);
    assert.equal(usageOf({ usage: { total_tokens: -5, prompt_tokens: 1.5 } }), undefined);
  });
});
