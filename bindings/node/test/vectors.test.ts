// Golden vectors (bindings/PROTOCOL.md §12): every vector in both directions, byte
// for byte, through the client's own (hand-written hot) codec and the generic one.

import * as assert from "node:assert/strict";
import * as fs from "node:fs";
import * as path from "node:path";
import { describe, test } from "node:test";

import {
  SCHEMA, decodeClientFrame, decodeServerFrame, decodeServerFrameGeneric, decodeValue, encodeClientFrame,
  encodeClientFrameGeneric, encodeServerFrame,
} from "../src/codec.js";
import { Json, parseJson } from "../src/json.js";
import { PROTOCOL_VERSION, WireError, decodeReply } from "../src/wire.js";
import { REPO } from "./support.js";

interface Vector {
  name: string;
  direction: "client" | "server";
  description: string;
  value: { id: bigint | number; request?: unknown; reply?: unknown };
  frame_hex: string;
}

const FILE = path.join(REPO, "bindings", "vectors", "frames.json");
const doc = parseJson(fs.readFileSync(FILE, "utf8")) as unknown as { protocol_version: number; vectors: Vector[] };

/** Deep equality where a number and a bigint of the same value are equal (JSON ints vs decoded u64s). */
function same(a: unknown, b: unknown, where = "value"): void {
  if ((typeof a === "bigint" || typeof b === "bigint") && (typeof a === "number" || typeof a === "bigint")
    && (typeof b === "number" || typeof b === "bigint")) {
    assert.equal(BigInt(a), BigInt(b), where);
    return;
  }
  if (typeof a === "number" && typeof b === "number") {
    assert.ok(Object.is(a, b) || a === b, `${where}: ${a} !== ${b}`);
    return;
  }
  if (Array.isArray(a) || Array.isArray(b)) {
    assert.ok(Array.isArray(a) && Array.isArray(b), `${where}: array vs non-array`);
    assert.equal(a.length, b.length, `${where}: length`);
    a.forEach((x, i) => same(x, b[i], `${where}[${i}]`));
    return;
  }
  if (typeof a === "object" && a !== null && typeof b === "object" && b !== null) {
    assert.deepEqual(Object.keys(a).sort(), Object.keys(b).sort(), `${where}: keys`);
    for (const k of Object.keys(a)) same((a as Record<string, unknown>)[k], (b as Record<string, unknown>)[k], `${where}.${k}`);
    return;
  }
  assert.equal(a, b, where);
}

const HOT_REQUESTS = new Set(["Start", "StartTenant", "BeginTenant", "TenantStatus", "Retry", "Finish", "Report", "Acquire", "EndCall", "Cancel"]);
const HOT_REPLIES = new Set(["Started", "Granted", "Reported", "Error", "CallBegun", "Ok"]);
const variant = (v: unknown): string => (typeof v === "string" ? v : Object.keys(v as object)[0]!);

describe("golden vectors", () => {
  test("the file is version 3 and has the v2 and v3 vectors", { timeout: 10_000 }, () => {
    assert.equal(doc.protocol_version, PROTOCOL_VERSION);
    const names = new Set(doc.vectors.map((v) => v.name));
    for (const n of ["hello_v2", "start_minimal", "start_full", "retry_failure_timeout", "finish_success_usage",
      "started", "started_probe_max_ids", "status_json", "error_overloaded", "status_full", "ping_max_id",
      "hello_v3", "welcome_v3", "start_tenant", "begin_tenant_unicode", "tenant_status_all_scopes",
      "tenant_status_one_scope", "finish_success_cached", "tenant_limited_usd"]) {
      assert.ok(names.has(n), `vector ${n} missing`);
    }
    assert.ok(doc.vectors.length >= 60, `only ${doc.vectors.length} vectors`);
  });

  for (const v of doc.vectors) {
    test(`${v.direction} ${v.name}`, { timeout: 10_000 }, () => {
      const bytes = Buffer.from(v.frame_hex, "hex");
      if (v.direction === "client") {
        const frame = { id: v.value.id as bigint, request: v.value.request };
        // encode: the client's dispatch (hot frames by hand) and the schema walk
        assert.equal(encodeClientFrame(frame).toString("hex"), v.frame_hex, "encodeClientFrame");
        assert.equal(encodeClientFrameGeneric(frame).toString("hex"), v.frame_hex, "generic encoder");
        // decode
        const got = decodeClientFrame(bytes);
        same(got.id, v.value.id, "id");
        same(got.request, v.value.request, "request");
      } else {
        const frame = { id: v.value.id as bigint, reply: v.value.reply };
        // decode: the client's decoder (hot replies by hand) and the schema walk
        const got = decodeServerFrame(bytes);
        same(got.id, v.value.id, "id");
        same(got.reply, v.value.reply, "reply (client decoder)");
        const gen = decodeServerFrameGeneric(bytes);
        same(gen.reply, v.value.reply, "reply (generic decoder)");
        // encode
        assert.equal(encodeServerFrame(frame).toString("hex"), v.frame_hex, "encodeServerFrame");
      }
    });
  }

  test("every hot request and reply is covered by a vector", { timeout: 10_000 }, () => {
    const reqs = new Set(doc.vectors.filter((v) => v.direction === "client").map((v) => variant(v.value.request)));
    const reps = new Set(doc.vectors.filter((v) => v.direction === "server").map((v) => variant(v.value.reply)));
    for (const r of HOT_REQUESTS) assert.ok(reqs.has(r), `no vector for ${r}`);
    for (const r of HOT_REPLIES) assert.ok(reps.has(r), `no vector for ${r}`);
  });
});

describe("strict decoding (PROTOCOL §3, §12)", () => {
  const byName = new Map(doc.vectors.map((v) => [v.name, Buffer.from(v.frame_hex, "hex")]));
  const payloadOf = (name: string): Buffer => byName.get(name)!.subarray(4);
  const decode = (payload: Buffer): unknown => decodeReply(payload, 8, payload.length);

  test("trailing bytes are refused", { timeout: 10_000 }, () => {
    for (const n of ["granted", "started", "reported_closed", "error_circuit_open", "ok", "call_begun", "welcome", "status_full"]) {
      const p = Buffer.concat([payloadOf(n), Buffer.from([0])]);
      assert.throws(() => decode(p), WireError, n);
    }
  });

  test("truncated payloads are refused at every length", { timeout: 10_000 }, () => {
    for (const n of ["granted", "started_probe_max_ids", "error_exhausted_quota", "reported_open_fenced", "status_full", "welcome_v2", "status_json"]) {
      const p = payloadOf(n);
      for (let len = 8; len < p.length; len++) assert.throws(() => decode(p.subarray(0, len)), WireError, `${n} cut at ${len}`);
    }
  });

  test("unknown tags are refused", { timeout: 10_000 }, () => {
    const p = Buffer.from(payloadOf("ok"));
    p.writeUInt32LE(11, 8); // Reply tag 11 does not exist
    assert.throws(() => decode(p), /unknown tag 11/);
    const e = Buffer.from(payloadOf("error_busy"));
    e.writeUInt32LE(99, 12); // ErrorKind
    assert.throws(() => decode(e), /unknown ErrorKind tag 99/);
  });

  test("bool and Option bytes other than 0/1 are refused", { timeout: 10_000 }, () => {
    const g = Buffer.from(payloadOf("granted"));
    // Granted: id 8, tag 4, permit 8, source (8 + 15), is_probe
    g[8 + 4 + 8 + 8 + 15] = 2;
    assert.throws(() => decode(g), /invalid bool/);
    const e = Buffer.from(payloadOf("error_unknown_call"));
    e[e.length - 2] = 7; // exhausted: Option byte (then scope: None)
    assert.throws(() => decode(e), /invalid Option/);
  });

  test("invalid UTF-8 is refused, valid non-ASCII kept", { timeout: 10_000 }, () => {
    const g = Buffer.from(payloadOf("started_probe_max_ids"));
    const r = decode(g) as { Started: { source: string } };
    assert.equal(r.Started.source, "東京");
    const at = 8 + 4 + 8 + 8 + 8; // the source's first byte
    g[at] = 0xff;
    assert.throws(() => decode(g), /invalid UTF-8/);
  });

  test("a hostile length prefix is refused without allocating", { timeout: 10_000 }, () => {
    const g = Buffer.from(payloadOf("granted"));
    g.writeUInt32LE(0, 20);
    g.writeUInt32LE(0x80000000, 24); // source length 2^63
    assert.throws(() => decode(g), /exceeds/);
    const e = Buffer.from(payloadOf("error_busy"));
    // per_source_reasons count: after kind (4) and message (8 + n) and retry_after (8)
    const msgLen = e.readUInt32LE(16);
    e.writeUInt32LE(0xffffffff, 16 + 8 + msgLen + 8);
    assert.throws(() => decode(e), /exceeds/);
  });

  test("the generic decoder is as strict", { timeout: 10_000 }, () => {
    const p = payloadOf("status_full");
    assert.throws(() => decodeValue(SCHEMA.Reply as never, Buffer.concat([p.subarray(8), Buffer.from([1])])), WireError);
    assert.throws(() => decodeClientFrame(Buffer.from("0000000c0f0000000000000063000000", "hex")), /unknown tag 99/);
  });

  test("encoders refuse values outside their types", { timeout: 10_000 }, () => {
    assert.throws(() => encodeClientFrame({ id: 1, request: { Acquire: { call: -1 } } }), WireError);
    assert.throws(() => encodeClientFrame({ id: 1, request: { Retry: { permit: 1, outcome: { Failure: { kind: "Nope" } } } } }), WireError);
    assert.throws(() => encodeClientFrame({ id: 1, request: { Acquire: { call: 1n << 64n } } }), WireError);
    assert.throws(() => encodeClientFrameGeneric({ id: 1, request: { Hello: { protocol_version: 2, client_name: 5, pid: 1 } } }), WireError);
  });
});

describe("big-integer JSON", () => {
  test("integers beyond 2^53 stay exact; others are numbers", { timeout: 10_000 }, () => {
    const v = parseJson('{"a": 18446744073709551615, "b": 12, "c": 1.5, "d": [9007199254740993, -3], "e": "x\\"1234567890123456789"}') as Record<string, Json>;
    assert.equal(v.a, 18446744073709551615n);
    assert.equal(v.b, 12);
    assert.equal(v.c, 1.5);
    assert.deepEqual(v.d, [9007199254740993n, -3]);
    assert.equal(v.e, 'x"1234567890123456789');
    assert.throws(() => parseJson('{"a": 12345678901234567890,}'), SyntaxError);
  });
});
