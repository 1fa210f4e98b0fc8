// §18: the shared header cases (bindings/vectors/ratelimit_headers.json) through
// parseRateLimitHeaders, and permit limits encoded as the golden FinishObserved.

import * as assert from "node:assert/strict";
import * as fs from "node:fs";
import * as path from "node:path";
import { describe, test } from "node:test";

import { connect } from "../src/client.js";
import { HeaderSource, Limit, parseDuration, parseRateLimitHeaders, toWireLimits } from "../src/ratelimit.js";
import { encodeFinish } from "../src/wire.js";
import { FakeSidecar } from "./fake-sidecar.js";
import { REPO } from "./support.js";

interface Case {
  name: string;
  headers: Record<string, string>;
  expected: Record<string, { limit: number | null; remaining: number | null; reset_s: number | null } | null> | null;
  retry_after_s: number | null;
}

const cases = (JSON.parse(fs.readFileSync(path.join(REPO, "bindings", "vectors", "ratelimit_headers.json"), "utf8")) as
  { cases: Case[] }).cases;

function near(got: number | null, want: number | null, what: string): void {
  if (want === null) {
    assert.equal(got, null, what);
  } else {
    assert.ok(got !== null && Math.abs(got - want) < 1e-6, `${what}: ${String(got)} != ${want}`);
  }
}

describe("rate-limit header vectors", { timeout: 10_000 }, () => {
  assert.ok(cases.length >= 5);
  for (const c of cases) {
    // A plain object, fetch Headers, a Map and pairs with upper-case names (read in
    // one pass, names compared in lower case), and a get-only object.
    const upper = (): [string, string][] => Object.entries(c.headers).map(([k, v]) => [k.toUpperCase(), v]);
    const shapes = {
      object: () => c.headers,
      Headers: () => new Headers(c.headers),
      "Map, upper-case names": () => new Map(upper()),
      "pairs, upper-case names": () => upper(),
      "get only": () => {
        const h = new Headers(c.headers);
        return { get: (n: string) => h.get(n) };
      },
    };
    for (const [shape, make] of Object.entries(shapes)) {
      test(`${c.name} (${shape})`, () => {
        const src = make() as HeaderSource;
        const { limits, retryAfterS } = parseRateLimitHeaders(src, 0);
        near(retryAfterS, c.retry_after_s, "retry_after_s");
        if (c.expected === null) {
          assert.equal(limits, null);
          return;
        }
        assert.ok(limits !== null);
        const got: Record<string, Limit | null | undefined> = {
          requests: limits.requests, tokens: limits.tokens, input_tokens: limits.inputTokens, output_tokens: limits.outputTokens,
        };
        for (const [k, want] of Object.entries(c.expected)) {
          const g = got[k] ?? null;
          if (want === null) {
            assert.equal(g, null, k);
            continue;
          }
          assert.ok(g !== null, k);
          near(g.limit, want.limit, `${k}.limit`);
          near(g.remaining, want.remaining, `${k}.remaining`);
          near(g.resetS, want.reset_s, `${k}.reset_s`);
        }
      });
    }
  }

  test("durations", () => {
    assert.equal(parseDuration("6m0s"), 360);
    assert.equal(parseDuration("250ms"), 0.25);
    assert.equal(parseDuration("1m30.5s"), 90.5);
    assert.equal(parseDuration("1x"), null);
    assert.equal(parseDuration(""), null);
  });
});

describe("permit limits on the wire", { timeout: 10_000 }, () => {
  test("encode as the golden finish_observed_openai", () => {
    const frames = JSON.parse(fs.readFileSync(path.join(REPO, "bindings", "vectors", "frames.json"), "utf8")) as
      { vectors: { name: string; frame_hex: string }[] };
    const want = frames.vectors.find((v) => v.name === "finish_observed_openai")!.frame_hex;
    const limits = toWireLimits({
      requests: { limit: 500, remaining: 499, resetS: 0.12 },
      tokens: { limit: 30000, remaining: 28466, resetS: 3.068 },
    });
    const got = encodeFinish(13, 21, { Success: { tokens: 1534, count_attempt: true } }, limits);
    assert.equal(got.toString("hex"), want);
  });

  test("bad values are refused before anything is sent", () => {
    assert.throws(() => toWireLimits({ tokens: { limit: null, remaining: -1, resetS: null } }), /tokens.remaining/);
    assert.throws(() => toWireLimits({ tokens: { limit: null, remaining: 1, resetS: null }, ageS: NaN }), /ageS/);
    assert.equal(toWireLimits({}), null);
  });
});

describe("run() sends the provider's headers", { timeout: 10_000 }, () => {
  test("from a 429's error and from a raw response", async () => {
    const fake = await FakeSidecar.start();
    const client = await connect(fake.socket);
    try {
      let n = 0;
      const out = await client.run("chat", async () => {
        n += 1;
        if (n === 1) {
          const e = Object.assign(new Error("429"), {
            status: 429, headers: new Headers({ "retry-after": "0", "x-ratelimit-remaining-tokens": "0", "x-ratelimit-reset-tokens": "2s" }),
          });
          throw e;
        }
        return { headers: { "anthropic-ratelimit-requests-remaining": "7" }, usage: { input_tokens: 3, output_tokens: 4 } };
      });
      assert.equal(n, 2);
      assert.ok(out.headers !== undefined);
      const conn = await fake.conn(0);
      const retry = conn.named("RetryObserved");
      assert.equal(retry.length, 1, conn.names().join(","));
      const rl = retry[0]!.limits as { tokens: { remaining: bigint; reset_s: number } };
      assert.equal(Number(rl.tokens.remaining), 0);
      assert.equal(rl.tokens.reset_s, 2);
      const fin = conn.named("FinishObserved");
      assert.equal(fin.length, 1, conn.names().join(","));
      assert.equal(Number((fin[0]!.limits as { requests: { remaining: bigint } }).requests.remaining), 7);
    } finally {
      await client.close();
      await fake.stop();
    }
  });
});
