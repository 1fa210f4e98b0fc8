// The transport's pure parts (DESIGN §17): the built-in estimate, the SSE usage
// scanner across arbitrary read boundaries, and the synthetic refusal.

import * as assert from "node:assert/strict";
import { test } from "node:test";

import { AllSourcesExhaustedError, CircuitOpenError, GatewayUnavailableError, TenantLimitExceededError } from "../src/index.js";
import { UsageScanner, estimateBody, refusalResponse } from "../src/transport.js";

const T = { timeout: 10_000 };

test("estimateBody: bytes / 4 and the first max_tokens-like key with a number", T, () => {
  assert.deepEqual(estimateBody(null), {});
  assert.deepEqual(estimateBody('{"max_tokens":100}'), { input: 5, output: 100 });
  assert.deepEqual(estimateBody('{"messages":[{"content":"max_tokens: 9"}], "max_completion_tokens" : 42}'), { input: 18, output: 42 });
  assert.deepEqual(estimateBody('{"tools":{"max_tokens":{"type":"integer"}},"max_output_tokens":7}'), { input: 17, output: 7 });
  assert.deepEqual(estimateBody('{"content":"\\"max_tokens\\":5"}'), { input: 8 });
  assert.deepEqual(estimateBody('{"c":"é"}'), { input: 3 }); // UTF-8 bytes, not characters
});

test("UsageScanner: Anthropic start + delta, CRLF, escaped keys, any read size", T, () => {
  const stream = 'event: message_start\r\ndata: {"type":"message_start","message":{"usage":{"input_tokens":25,"output_tokens":1}}}\r\n\r\n'
    + 'data: {"type":"content_block_delta","delta":{"text":"\\"usage\\":{"}}\n\n'
    + 'data: {"type":"message_delta","usage": {"output_tokens":15}}\n\n'
    + 'data: {"type":"message_stop"}';
  const bytes = Buffer.from(stream);
  for (const size of [1, 3, 7, 64, bytes.length]) {
    const s = new UsageScanner();
    for (let i = 0; i < bytes.length; i += size) s.push(new Uint8Array(bytes.subarray(i, i + size)));
    s.end();
    assert.deepEqual(s.usage(), { inputTokens: 25, outputTokens: 15 }, `reads of ${size} bytes`);
  }
});

test("UsageScanner: OpenAI chat's final chunk and Responses' response.completed", T, () => {
  const chat = new UsageScanner();
  chat.push(Buffer.from('data: {"choices":[{"delta":{"content":"hi"}}],"usage":null}\n\n'));
  chat.push(Buffer.from('data: {"choices":[],"usage":{"prompt_tokens":20,"completion_tokens":3,"total_tokens":23,"prompt_tokens_details":{"cached_tokens":5}}}\n\ndata: [DONE]\n\n'));
  chat.end();
  assert.deepEqual(chat.usage(), { tokens: 23, inputTokens: 15, outputTokens: 3 });
  const resp = new UsageScanner();
  resp.push(Buffer.from('event: response.completed\ndata: {"type":"response.completed","response":{"usage":{"input_tokens":9,"output_tokens":4,"total_tokens":13}}}\n\n'));
  resp.end();
  assert.deepEqual(resp.usage(), { tokens: 13, inputTokens: 9, outputTokens: 4 });
  const none = new UsageScanner();
  none.push(Buffer.from('data: {"usage":null}\n\n'));
  none.end();
  assert.equal(none.usage(), undefined);
});

test("refusalResponse: 503 / 429, Retry-After rounded up, the JSON body", T, async () => {
  const open = refusalResponse(new CircuitOpenError("all open", { retryAfterS: 2.2, perSourceReasons: { a: "circuit_open" }, scope: "chat" }), "chat");
  assert.equal(open.status, 503);
  assert.equal(open.headers.get("retry-after"), "3");
  assert.equal(open.headers.get("retry-after-ms"), "2200");
  assert.equal(open.headers.get("x-should-retry"), "false");
  assert.deepEqual(await open.json(), { error: { type: "polygate", code: "circuit_open", message: 'PolyGate refused the request in scope "chat" (circuit_open): all open', scope: "chat", retry_after_s: 2.2, per_source_reasons: { a: "circuit_open" } } });
  const quota = refusalResponse(new AllSourcesExhaustedError("empty", { reason: "quota_exhausted", retryAfterS: 0 }), "chat");
  assert.equal(quota.status, 429);
  assert.equal(quota.headers.get("retry-after"), "0");
  const stalled = refusalResponse(new AllSourcesExhaustedError("slow", { reason: "stalled" }), "chat");
  assert.equal(stalled.status, 503);
  assert.equal(((await stalled.json()) as { error: { code: string } }).error.code, "stalled");
});

test("refusalResponse: x-polygate-refusal names the code; only a tenant's refusal carries limit_source", T, async () => {
  const cases: [GatewayUnavailableError, number, string][] = [
    [new CircuitOpenError("open", { scope: "chat" }), 503, "circuit_open"],
    [new AllSourcesExhaustedError("q", { reason: "quota_exhausted" }), 429, "quota_exhausted"],
    [new AllSourcesExhaustedError("r", { reason: "retry_exhausted" }), 503, "retry_exhausted"],
    [new GatewayUnavailableError("down"), 503, "backend_unavailable"],
  ];
  for (const [e, status, code] of cases) {
    const r = refusalResponse(e, "chat");
    assert.equal(r.status, status, code);
    assert.equal(r.headers.get("x-polygate-refusal"), code);
    const body = (await r.json()) as { error: Record<string, unknown> };
    assert.equal(body.error.code, code);
    assert.ok(!("limit_source" in body.error) && !("tenant" in body.error) && !("limit" in body.error), code);
  }
  const t = refusalResponse(new TenantLimitExceededError('tenant "" is over its usd_per_day budget', {
    tenant: "", limit: "usd_per_day", retryAfterS: 5400.2, perSourceReasons: { a: "tenant_limited" }, scope: "chat",
  }), "chat");
  assert.equal(t.status, 429);
  assert.equal(t.statusText, "Too Many Requests");
  assert.equal(t.headers.get("content-type"), "application/json");
  assert.equal(t.headers.get("retry-after"), "5401");
  assert.equal(t.headers.get("retry-after-ms"), "5400200");
  assert.equal(t.headers.get("x-polygate-refusal"), "tenant_limited");
  assert.equal(t.headers.get("x-should-retry"), "false");
  assert.deepEqual(await t.json(), {
    error: {
      type: "polygate", code: "tenant_limited",
      message: 'PolyGate refused the request in scope "chat" (tenant_limited): tenant "" is over its usd_per_day budget',
      scope: "chat", retry_after_s: 5400.2, per_source_reasons: { a: "tenant_limited" },
      limit_source: "tenant", tenant: "", limit: "usd_per_day",
    },
  });
});
