/**
 * Generic codec for every PolyGate message, both directions (bindings/PROTOCOL.md
 * §4): a schema of the types and one encoder/decoder that walks it. The client
 * uses it only for cold frames (Welcome, Status, Pong, StatusJson); tests use it
 * for the golden vectors and the fake sidecar. The hot frames of a call have
 * hand-written codecs in `wire.ts`; {@link encodeClientFrame} and
 * {@link decodeServerFrame} dispatch to those, so the vectors check both.
 */

import {
  BREAKER_STATES, ERROR_KINDS, EXHAUSTION_REASONS, FAILURE_KINDS, Reader, SKIP_REASONS, WireError,
  WireReply, decodeReply, encodeAcquire, encodeCallSpec, encodeCancel, encodeEndCall, encodeFinish,
  encodeReport, encodeRetry, encodeStart, encodeStartTenant, encodeBeginTenant, encodeTenantSpec, encodeTenantStatus, isU64, setColdReplyDecoder, writeU64,
} from "./wire.js";
import type { U64, WireCallSpec, WireLimits, WireOutcome } from "./wire.js";

type Ty =
  | "u32" | "u64" | "f64" | "bool" | "string"
  | { opt: Ty }
  | { vec: Ty }
  | { tuple: Ty[] }
  | { struct: [string, Ty][] }
  | { enum: Variant[] };

/** A variant: unit, with named fields, or wrapping one value. */
interface Variant {
  name: string;
  fields?: [string, Ty][];
  value?: Ty;
}

const units = (names: readonly string[]): Ty => ({ enum: names.map((name) => ({ name })) });

const FailureKind = units(FAILURE_KINDS);
const BreakerState = units(BREAKER_STATES);
const SkipReason = units(SKIP_REASONS);
const ExhaustionReason = units(EXHAUSTION_REASONS);
const ErrorKind = units(ERROR_KINDS);
const optU64: Ty = { opt: "u64" };

const Usage: Ty = { struct: [["tokens", optU64], ["input_tokens", optU64], ["output_tokens", optU64]] };

const Outcome: Ty = {
  enum: [
    { name: "Success", fields: [["tokens", optU64], ["count_attempt", "bool"]] },
    { name: "Failure", fields: [["kind", FailureKind]] },
    { name: "RateLimited", fields: [["retry_after_s", { opt: "f64" }]] },
    { name: "Cancelled" },
    { name: "SuccessUsage", fields: [["usage", Usage], ["count_attempt", "bool"]] },
    { name: "FailureUsage", fields: [["kind", FailureKind], ["usage", Usage]] },
    { name: "SuccessCached", fields: [["usage", Usage], ["cached_input_tokens", "u64"], ["count_attempt", "bool"]] },
  ],
};

const CallSpec: Ty = {
  struct: [
    ["scope", "string"], ["est_tokens", optU64], ["priority", { opt: "string" }],
    ["est_input_tokens", optU64], ["est_output_tokens", optU64],
  ],
};

const ObservedLimit: Ty = { struct: [["limit", optU64], ["remaining", optU64], ["reset_s", { opt: "f64" }]] };

const ObservedLimits: Ty = {
  struct: [
    ["requests", { opt: ObservedLimit }], ["tokens", { opt: ObservedLimit }],
    ["input_tokens", { opt: ObservedLimit }], ["output_tokens", { opt: ObservedLimit }], ["age_s", "f64"],
  ],
};

const Request: Ty = {
  enum: [
    { name: "Hello", fields: [["protocol_version", "u32"], ["client_name", "string"], ["pid", "u32"]] },
    { name: "BeginCall", fields: [["scope", "string"], ["est_tokens", optU64]] },
    { name: "Acquire", fields: [["call", "u64"]] },
    { name: "Report", fields: [["permit", "u64"], ["outcome", Outcome]] },
    { name: "EndCall", fields: [["call", "u64"]] },
    { name: "Status" },
    { name: "ForceOpen", fields: [["source", "string"], ["seconds", "f64"]] },
    { name: "ForceClose", fields: [["source", "string"]] },
    { name: "Reset", fields: [["source", "string"]] },
    { name: "Ping" },
    { name: "Cancel", fields: [["target", "u64"]] },
    { name: "Start", value: CallSpec },
    { name: "Retry", fields: [["permit", "u64"], ["outcome", Outcome]] },
    { name: "Finish", fields: [["permit", "u64"], ["outcome", Outcome]] },
    { name: "Begin", value: CallSpec },
    { name: "StatusJson" },
    { name: "ReportObserved", fields: [["permit", "u64"], ["outcome", Outcome], ["limits", ObservedLimits]] },
    { name: "RetryObserved", fields: [["permit", "u64"], ["outcome", Outcome], ["limits", ObservedLimits]] },
    { name: "FinishObserved", fields: [["permit", "u64"], ["outcome", Outcome], ["limits", ObservedLimits]] },
    { name: "StartTenant", fields: [["spec", CallSpec], ["tenant", "string"]] },
    { name: "BeginTenant", fields: [["spec", CallSpec], ["tenant", "string"]] },
    { name: "TenantStatus", fields: [["scope", { opt: "string" }], ["tenant", "string"]] },
  ],
};

const SourceStatus: Ty = {
  struct: [
    ["name", "string"], ["state", BreakerState], ["epoch", "u64"], ["retry_after_s", "f64"],
    ["cooldown_level", "u32"], ["window_successes", "u64"], ["window_failures", "u64"],
    ["streak", "u32"], ["memo_remaining_s", "f64"], ["pacer_ceiling", "f64"], ["in_flight", "u32"],
    ["tokens_available", { opt: "f64" }], ["requests_available", { opt: "f64" }],
    ["quota_blocked_s", "f64"], ["degraded", "bool"],
  ],
};

const ScopeStatus: Ty = {
  struct: [
    ["name", "string"], ["circuit_open", "string"], ["quota_full", "string"], ["waiters", "u32"],
    ["calls", "u32"], ["sources", { vec: SourceStatus }],
  ],
};

const StatusReport: Ty = {
  struct: [["sidecar_version", "string"], ["backend", "string"], ["scopes", { vec: ScopeStatus }]],
};

const ErrorReply: Ty = {
  struct: [
    ["kind", ErrorKind], ["message", "string"], ["retry_after_s", "f64"],
    ["per_source_reasons", { vec: { tuple: ["string", SkipReason] } }],
    ["exhausted", { opt: ExhaustionReason }], ["scope", { opt: "string" }],
  ],
};

const Granted: [string, Ty][] = [
  ["permit", "u64"], ["source", "string"], ["is_probe", "bool"], ["attempt", "u32"], ["est_tokens", "u64"],
];

const Reply: Ty = {
  enum: [
    { name: "Welcome", fields: [["protocol_version", "u32"], ["sidecar_version", "string"], ["max_frame", "u32"]] },
    { name: "CallBegun", fields: [["call", "u64"]] },
    { name: "Granted", fields: Granted },
    { name: "Reported", fields: [["applied", "bool"], ["state", BreakerState], ["retry_after_s", "f64"]] },
    { name: "Ok" },
    { name: "Status", value: StatusReport },
    { name: "Pong" },
    { name: "Error", value: ErrorReply },
    { name: "Started", fields: [["call", "u64"], ...Granted] },
    { name: "StatusJson", value: "string" },
    { name: "TenantLimited", value: { struct: [["error", ErrorReply], ["tenant", "string"], ["limit", "string"]] } },
  ],
};

/** The schema, by message name (for tests and tools). */
export const SCHEMA = { Request, Reply, Outcome, CallSpec, Usage, ErrorReply, StatusReport } as const;

// ------------------------------------------------------------------ encoding

class Writer {
  private buf = Buffer.allocUnsafe(256);
  len = 0;

  private room(n: number): void {
    if (this.len + n > this.buf.length) {
      const b = Buffer.allocUnsafe(Math.max(this.buf.length * 2, this.len + n));
      this.buf.copy(b, 0, 0, this.len);
      this.buf = b;
    }
  }

  u32(v: number): void {
    this.room(4);
    this.buf.writeUInt32LE(v, this.len);
    this.len += 4;
  }

  u64(v: U64): void {
    this.room(8);
    this.len = writeU64(this.buf, this.len, v);
  }

  f64(v: number): void {
    this.room(8);
    this.buf.writeDoubleLE(v, this.len);
    this.len += 8;
  }

  byte(v: number): void {
    this.room(1);
    this.buf[this.len++] = v;
  }

  bytes(b: Buffer): void {
    this.room(b.length);
    b.copy(this.buf, this.len);
    this.len += b.length;
  }

  result(): Buffer {
    return this.buf.subarray(0, this.len);
  }
}

function fail(path: string, what: string, v: unknown): never {
  throw new WireError(`${path}: expected ${what}, got ${stringify(v)}`);
}

function stringify(v: unknown): string {
  try {
    return JSON.stringify(v, (_k, x) => (typeof x === "bigint" ? x.toString() : x)) ?? String(v);
  } catch {
    return String(v);
  }
}

function isObj(v: unknown): v is Record<string, unknown> {
  return typeof v === "object" && v !== null && !Array.isArray(v);
}

function enc(w: Writer, ty: Ty, v: unknown, path: string): void {
  if (ty === "u32") {
    if (typeof v !== "number" || !Number.isInteger(v) || v < 0 || v > 0xffffffff) fail(path, "a u32", v);
    w.u32(v);
  } else if (ty === "u64") {
    if (!isU64(v)) fail(path, "a u64", v);
    w.u64(v);
  } else if (ty === "f64") {
    if (typeof v !== "number") fail(path, "a number", v);
    w.f64(v);
  } else if (ty === "bool") {
    if (typeof v !== "boolean") fail(path, "a boolean", v);
    w.byte(v ? 1 : 0);
  } else if (ty === "string") {
    if (typeof v !== "string") fail(path, "a string", v);
    const b = Buffer.from(v, "utf8");
    w.u64(b.length);
    w.bytes(b);
  } else if ("opt" in ty) {
    if (v === null || v === undefined) {
      w.byte(0);
    } else {
      w.byte(1);
      enc(w, ty.opt, v, path);
    }
  } else if ("vec" in ty) {
    if (!Array.isArray(v)) fail(path, "an array", v);
    w.u64(v.length);
    v.forEach((x, i) => enc(w, ty.vec, x, `${path}[${i}]`));
  } else if ("tuple" in ty) {
    if (!Array.isArray(v) || v.length !== ty.tuple.length) fail(path, `a ${ty.tuple.length}-tuple`, v);
    ty.tuple.forEach((t, i) => enc(w, t, v[i], `${path}[${i}]`));
  } else if ("struct" in ty) {
    if (!isObj(v)) fail(path, "an object", v);
    for (const [k, t] of ty.struct) enc(w, t, v[k], `${path}.${k}`);
  } else {
    let name: string;
    let body: unknown;
    if (typeof v === "string") {
      name = v;
    } else if (isObj(v) && Object.keys(v).length === 1) {
      name = Object.keys(v)[0]!;
      body = v[name];
    } else {
      return fail(path, "an enum variant", v);
    }
    const tag = ty.enum.findIndex((x) => x.name === name);
    if (tag < 0) fail(path, `one of ${ty.enum.map((x) => x.name).join(", ")}`, v);
    const variant = ty.enum[tag]!;
    w.u32(tag);
    if (variant.value !== undefined) {
      enc(w, variant.value, body, `${path}.${name}`);
    } else if (variant.fields !== undefined) {
      enc(w, { struct: variant.fields }, body, `${path}.${name}`);
    } else if (typeof v !== "string") {
      fail(path, `the unit variant "${name}"`, v);
    }
  }
}

function framed(id: unknown, ty: Ty, value: unknown, what: string): Buffer {
  const w = new Writer();
  w.u32(0); // length, patched below
  if (!isU64(id)) fail(`${what}.id`, "a u64", id);
  w.u64(id);
  enc(w, ty, value, what);
  const buf = w.result();
  buf.writeUInt32BE(buf.length - 4, 0);
  return Buffer.from(buf);
}

/** Encode any value of `ty` generically (payload bytes, no frame prefix). */
export function encodeValue(ty: Ty, value: unknown): Buffer {
  const w = new Writer();
  enc(w, ty, value, "value");
  return Buffer.from(w.result());
}

/** A `ClientFrame` `{id, request}` → the whole frame, by the schema walk. */
export function encodeClientFrameGeneric(frame: { id: U64; request: unknown }): Buffer {
  return framed(frame.id, Request, frame.request, "request");
}

/** A `ServerFrame` `{id, reply}` → the whole frame (used by the fake sidecar and tests). */
export function encodeServerFrame(frame: { id: U64; reply: unknown }): Buffer {
  return framed(frame.id, Reply, frame.reply, "reply");
}

/**
 * A `ClientFrame` → the whole frame: the hot requests through the hand-written
 * encoders of `wire.ts`, the rest by the schema walk.
 */
export function encodeClientFrame(frame: { id: U64; request: unknown }): Buffer {
  const { id, request } = frame;
  if (!isU64(id)) fail("request.id", "a u64", id);
  if (isObj(request)) {
    const keys = Object.keys(request);
    if (keys.length === 1) {
      const body = request[keys[0]!] as Record<string, unknown>;
      switch (keys[0]) {
        case "Start":
          return encodeStart(id, encodeCallSpec(body as unknown as WireCallSpec));
        case "StartTenant":
          if (typeof body.tenant !== "string") fail("request.StartTenant.tenant", "a string", body.tenant);
          return encodeStartTenant(id, encodeTenantSpec(encodeCallSpec(body.spec as WireCallSpec), body.tenant));
        case "BeginTenant":
          if (typeof body.tenant !== "string") fail("request.BeginTenant.tenant", "a string", body.tenant);
          return encodeBeginTenant(id, encodeTenantSpec(encodeCallSpec(body.spec as WireCallSpec), body.tenant));
        case "TenantStatus":
          if (typeof body.tenant !== "string") fail("request.TenantStatus.tenant", "a string", body.tenant);
          if (body.scope !== null && typeof body.scope !== "string") fail("request.TenantStatus.scope", "a string or null", body.scope);
          return encodeTenantStatus(id, body.scope, body.tenant);
        case "Retry":
          return encodeRetry(id, body.permit as U64, body.outcome as WireOutcome);
        case "Finish":
          return encodeFinish(id, body.permit as U64, body.outcome as WireOutcome);
        case "Report":
          return encodeReport(id, body.permit as U64, body.outcome as WireOutcome);
        case "RetryObserved":
          return encodeRetry(id, body.permit as U64, body.outcome as WireOutcome, body.limits as WireLimits);
        case "FinishObserved":
          return encodeFinish(id, body.permit as U64, body.outcome as WireOutcome, body.limits as WireLimits);
        case "ReportObserved":
          return encodeReport(id, body.permit as U64, body.outcome as WireOutcome, body.limits as WireLimits);
        case "Acquire":
          return encodeAcquire(id, body.call as U64);
        case "EndCall":
          return encodeEndCall(id, body.call as U64);
        case "Cancel":
          return encodeCancel(id, body.target as U64);
      }
    }
  }
  return encodeClientFrameGeneric(frame);
}

// ------------------------------------------------------------------ decoding

function dec(r: Reader, ty: Ty): unknown {
  if (ty === "u32") return r.u32();
  if (ty === "u64") return r.u64();
  if (ty === "f64") return r.f64();
  if (ty === "bool") return r.bool();
  if (ty === "string") return r.str();
  if ("opt" in ty) return r.some() ? dec(r, ty.opt) : null;
  if ("vec" in ty) {
    const n = r.len(1); // every element takes at least one byte
    const out: unknown[] = [];
    for (let i = 0; i < n; i++) out.push(dec(r, ty.vec));
    return out;
  }
  if ("tuple" in ty) return ty.tuple.map((t) => dec(r, t));
  if ("struct" in ty) {
    const o: Record<string, unknown> = {};
    for (const [k, t] of ty.struct) o[k] = dec(r, t);
    return o;
  }
  const tag = r.u32();
  return decVariant(r, ty, tag);
}

function decVariant(r: Reader, ty: Ty & { enum: Variant[] }, tag: number): unknown {
  const v = ty.enum[tag];
  if (v === undefined) throw new WireError(`unknown tag ${tag}`);
  if (v.value !== undefined) return { [v.name]: dec(r, v.value) };
  if (v.fields !== undefined) return { [v.name]: dec(r, { struct: v.fields }) };
  return v.name;
}

function payload(buf: Buffer): Reader {
  if (buf.length < 4) throw new WireError("frame shorter than its length prefix");
  const n = buf.readUInt32BE(0);
  if (n !== buf.length - 4) throw new WireError(`length prefix ${n} but ${buf.length - 4} payload bytes`);
  return new Reader(buf, 4, buf.length);
}

/** Decode any value of `ty` from payload bytes (strict: no trailing bytes). */
export function decodeValue(ty: Ty, bytes: Buffer): unknown {
  const r = new Reader(bytes, 0, bytes.length);
  const v = dec(r, ty);
  r.done();
  return v;
}

function decodeFrame(buf: Buffer, ty: Ty): { id: bigint; body: unknown } {
  const r = payload(buf);
  const id = r.u64();
  const body = dec(r, ty);
  r.done();
  return { id, body };
}

/** A whole client frame → `{id, request}` (the fake sidecar's side). */
export function decodeClientFrame(buf: Buffer): { id: bigint; request: unknown } {
  const { id, body } = decodeFrame(buf, Request);
  return { id, request: body };
}

/** A whole server frame → `{id, reply}` by the schema walk alone. */
export function decodeServerFrameGeneric(buf: Buffer): { id: bigint; reply: unknown } {
  const { id, body } = decodeFrame(buf, Reply);
  return { id, reply: body };
}

/** A whole server frame → `{id, reply}` as the client decodes it (hot replies by hand). */
export function decodeServerFrame(buf: Buffer): { id: bigint; reply: WireReply } {
  const r = payload(buf);
  const id = r.u64();
  return { id, reply: decodeReply(buf, r.off, buf.length) };
}

setColdReplyDecoder((r, tag) => decVariant(r, Reply as Ty & { enum: Variant[] }, tag) as WireReply);
