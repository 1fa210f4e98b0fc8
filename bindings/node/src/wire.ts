/**
 * The PolyGate wire format (bindings/PROTOCOL.md §2–§4, §14; DESIGN §11, §11a):
 * 4-byte big-endian length + a bincode-legacy payload (little-endian fixed-width
 * integers, u64 string/list lengths, u32 enum tags, Option as a 0/1 byte).
 *
 * The hot frames — the requests of a call (Start, StartTenant, Retry, Finish, Report,
 * Acquire, EndCall, Cancel) and their replies (Started, Granted, Reported, Error, CallBegun,
 * Ok) — are encoded and decoded here by hand, field after field, with no schema
 * walk. Everything else goes through the generic codec of `codec.ts`, which also
 * checks these against the golden vectors.
 *
 * Messages are plain objects in the form of `bindings/vectors/frames.json`'s
 * `value`: externally tagged (`{"Granted": {...}}`, `"Ok"`), u64 as `bigint` when
 * decoded (numbers or bigints are accepted when encoding), absent options `null`.
 */

import { TextDecoder } from "node:util";

/** The protocol version this client speaks (`Hello.protocol_version`). */
export const PROTOCOL_VERSION = 3;
/** The version said to a sidecar that refuses 3 (PROTOCOL §15): everything works but tenants. */
export const FALLBACK_VERSION = 2;
/** The first version with tenants (StartTenant, BeginTenant, TenantStatus, SuccessCached). */
export const TENANT_VERSION = 3;
/** A tenant id's limit, in bytes of UTF-8 (PROTOCOL §15). */
export const MAX_TENANT_BYTES = 128;
/** Frame payload limit until `Welcome` announces the sidecar's. */
export const DEFAULT_MAX_FRAME = 65536;
/** The largest incoming frame accepted: status replies may be this large (§14.4). */
export const MAX_INCOMING_FRAME = 16 * 1024 * 1024;

export const REQUEST_TAGS = {
  Hello: 0, BeginCall: 1, Acquire: 2, Report: 3, EndCall: 4, Status: 5, ForceOpen: 6,
  ForceClose: 7, Reset: 8, Ping: 9, Cancel: 10, Start: 11, Retry: 12, Finish: 13,
  Begin: 14, StatusJson: 15, ReportObserved: 16, RetryObserved: 17, FinishObserved: 18,
  StartTenant: 19, BeginTenant: 20, TenantStatus: 21,
} as const;

export const REPLY_TAGS = {
  Welcome: 0, CallBegun: 1, Granted: 2, Reported: 3, Ok: 4, Status: 5, Pong: 6,
  Error: 7, Started: 8, StatusJson: 9, TenantLimited: 10,
} as const;

export const FAILURE_KINDS = ["Timeout", "ServerError", "Connection", "BadResult", "Error"] as const;
export const BREAKER_STATES = ["Closed", "Open", "HalfOpen"] as const;
export const SKIP_REASONS = ["CircuitOpen", "Paced", "RateLimited", "BackendUnavailable", "TenantLimited"] as const;
export const EXHAUSTION_REASONS = ["Stalled", "QuotaExhausted", "RetryExhausted"] as const;
export const ERROR_KINDS = [
  "CircuitOpen", "AllSourcesExhausted", "UnknownScope", "UnknownCall", "UnknownPermit",
  "InvalidArgument", "Malformed", "FrameTooLarge", "ProtocolViolation", "PermissionDenied",
  "ShuttingDown", "BackendUnavailable", "Cancelled", "Busy", "Internal", "Overloaded", "TenantLimited",
] as const;

export type WireFailureKind = (typeof FAILURE_KINDS)[number];
export type WireBreakerState = (typeof BREAKER_STATES)[number];
export type WireSkipReason = (typeof SKIP_REASONS)[number];
export type WireExhaustion = (typeof EXHAUSTION_REASONS)[number];
export type WireErrorKind = (typeof ERROR_KINDS)[number];

/** A u64 on the encoding side: a non-negative integer number (≤ 2^53) or a bigint. */
export type U64 = number | bigint;

/** One dimension of `ObservedLimits` (DESIGN §18). */
export interface WireLimit {
  limit: U64 | null;
  remaining: U64 | null;
  reset_s: number | null;
}

/** `ObservedLimits`: the provider's rate-limit headers of one response (§18). */
export interface WireLimits {
  requests: WireLimit | null;
  tokens: WireLimit | null;
  input_tokens: WireLimit | null;
  output_tokens: WireLimit | null;
  age_s: number;
}

export interface WireUsage {
  tokens: U64 | null;
  input_tokens: U64 | null;
  output_tokens: U64 | null;
}

/** `Outcome` (§4.3) in the vectors' value form. */
export type WireOutcome =
  | { Success: { tokens: U64 | null; count_attempt: boolean } }
  | { Failure: { kind: WireFailureKind } }
  | { RateLimited: { retry_after_s: number | null } }
  | "Cancelled"
  | { SuccessUsage: { usage: WireUsage; count_attempt: boolean } }
  | { FailureUsage: { kind: WireFailureKind; usage: WireUsage } }
  | { SuccessCached: { usage: WireUsage; cached_input_tokens: U64; count_attempt: boolean } };

/** `CallSpec` (§14.2). */
export interface WireCallSpec {
  scope: string;
  est_tokens: U64 | null;
  priority: string | null;
  est_input_tokens: U64 | null;
  est_output_tokens: U64 | null;
}

export interface WireErrorReply {
  kind: WireErrorKind;
  message: string;
  retry_after_s: number;
  per_source_reasons: [string, WireSkipReason][];
  exhausted: WireExhaustion | null;
  scope: string | null;
}

/** `TenantRefusal` (v3, PROTOCOL §15): the body of `Reply::TenantLimited`. */
export interface WireTenantRefusal {
  error: WireErrorReply;
  tenant: string;
  limit: string;
}

export interface WireGranted {
  permit: bigint;
  source: string;
  is_probe: boolean;
  attempt: number;
  est_tokens: bigint;
}

export interface WireStarted extends WireGranted {
  call: bigint;
}

export interface WireReported {
  applied: boolean;
  state: WireBreakerState;
  retry_after_s: number;
}

export interface WireWelcome {
  protocol_version: number;
  sidecar_version: string;
  max_frame: number;
}

/** A decoded reply. `Status` (v1) is left loosely typed: this client uses `StatusJson`. */
export type WireReply =
  | { Welcome: WireWelcome }
  | { CallBegun: { call: bigint } }
  | { Granted: WireGranted }
  | { Reported: WireReported }
  | "Ok"
  | { Status: Record<string, unknown> }
  | "Pong"
  | { Error: WireErrorReply }
  | { Started: WireStarted }
  | { StatusJson: string }
  | { TenantLimited: WireTenantRefusal };

/** Raised for anything undecodable or unencodable. */
export class WireError extends Error {
  constructor(message: string) {
    super(message);
    this.name = "WireError";
  }
}

// ------------------------------------------------------------------ primitives

const TWO32 = 4294967296;
const U64_MAX = (1n << 64n) - 1n;

/** Whether `v` is a valid u64 (a safe non-negative integer number, or a bigint in range). */
export function isU64(v: unknown): v is U64 {
  if (typeof v === "number") return Number.isSafeInteger(v) && v >= 0;
  if (typeof v === "bigint") return v >= 0n && v <= U64_MAX;
  return false;
}

function checkU64(v: unknown, what: string): U64 {
  if (!isU64(v)) throw new WireError(`${what} must be a u64 (a non-negative integer), got ${String(v)}`);
  return v;
}

function checkU32(v: unknown, what: string): number {
  if (typeof v !== "number" || !Number.isInteger(v) || v < 0 || v > 0xffffffff) {
    throw new WireError(`${what} must be a u32, got ${String(v)}`);
  }
  return v;
}

/** Write a u64 (number or bigint) at `off`; returns the offset after it. */
export function writeU64(buf: Buffer, off: number, v: U64): number {
  if (typeof v === "number") {
    buf.writeUInt32LE(v % TWO32, off);
    buf.writeUInt32LE(Math.floor(v / TWO32), off + 4);
  } else {
    buf.writeBigUInt64LE(v, off);
  }
  return off + 8;
}

/** UTF-8 decoder that refuses invalid input (PROTOCOL §3: invalid UTF-8 is malformed). */
const strictUtf8 = new TextDecoder("utf-8", { fatal: true });

/**
 * A cursor over one payload. Every read checks the bytes left, so truncated data,
 * hostile lengths and bad bool/option bytes raise {@link WireError}.
 */
export class Reader {
  constructor(
    readonly buf: Buffer,
    public off: number,
    readonly end: number,
  ) {}

  need(n: number): void {
    if (this.end - this.off < n) {
      throw new WireError(`truncated payload: need ${n} more bytes at offset ${this.off}, have ${this.end - this.off}`);
    }
  }

  u32(): number {
    this.need(4);
    const v = this.buf.readUInt32LE(this.off);
    this.off += 4;
    return v;
  }

  u64(): bigint {
    this.need(8);
    const v = this.buf.readBigUInt64LE(this.off);
    this.off += 8;
    return v;
  }

  /** A length prefix (u64) that must fit in the bytes left, times `unit` bytes each. */
  len(unit: number): number {
    this.need(8);
    const lo = this.buf.readUInt32LE(this.off);
    const hi = this.buf.readUInt32LE(this.off + 4);
    this.off += 8;
    const left = this.end - this.off;
    if (hi !== 0 || lo * unit > left) {
      throw new WireError(`length ${hi * TWO32 + lo} exceeds the ${left} bytes left in the payload`);
    }
    return lo;
  }

  f64(): number {
    this.need(8);
    const v = this.buf.readDoubleLE(this.off);
    this.off += 8;
    return v;
  }

  /** A 0/1 byte: a `bool`, or an `Option`'s presence (`what` names it in the error). */
  flag(what: string): boolean {
    this.need(1);
    const b = this.buf[this.off++];
    if (b === 0) return false;
    if (b === 1) return true;
    throw new WireError(`invalid ${what} byte 0x${b!.toString(16)}`);
  }

  bool(): boolean {
    return this.flag("bool");
  }

  /** An Option's presence byte. */
  some(): boolean {
    return this.flag("Option");
  }

  str(): string {
    const n = this.len(1);
    const s = this.off;
    this.off += n;
    const text = this.buf.toString("utf8", s, s + n);
    // toString replaces invalid UTF-8 with U+FFFD; only then is the strict check needed.
    if (text.indexOf("\ufffd") !== -1) {
      try {
        return strictUtf8.decode(this.buf.subarray(s, s + n));
      } catch {
        throw new WireError("invalid UTF-8 in a string");
      }
    }
    return text;
  }

  optU64(): bigint | null {
    return this.some() ? this.u64() : null;
  }

  optF64(): number | null {
    return this.some() ? this.f64() : null;
  }

  optStr(): string | null {
    return this.some() ? this.str() : null;
  }

  tag<T>(names: readonly T[], what: string): T {
    const t = this.u32();
    if (t >= names.length) throw new WireError(`unknown ${what} tag ${t}`);
    return names[t]!;
  }

  done(): void {
    if (this.off !== this.end) throw new WireError(`${this.end - this.off} trailing bytes after the message`);
  }
}

// ------------------------------------------------------------------ hot encoders

/** UTF-8 bytes of short, often repeated strings (scope names, priorities). */
const strCache = new Map<string, Buffer>();

function utf8(s: string): Buffer {
  let b = strCache.get(s);
  if (b === undefined) {
    b = Buffer.from(s, "utf8");
    if (strCache.size >= 1024) strCache.clear();
    strCache.set(s, b);
  }
  return b;
}

/** A frame buffer of `body` payload bytes after id and tag, with prefix, id and tag written. */
function frame(id: U64, tag: number, body: number): Buffer {
  const buf = Buffer.allocUnsafe(16 + body);
  buf.writeUInt32BE(12 + body, 0);
  writeU64(buf, 4, id);
  buf.writeUInt32LE(tag, 12);
  return buf;
}

function writeStr(buf: Buffer, off: number, bytes: Buffer): number {
  off = writeU64(buf, off, bytes.length);
  bytes.copy(buf, off);
  return off + bytes.length;
}

function optU64Size(v: U64 | null | undefined): number {
  return v === null || v === undefined ? 1 : 9;
}

function writeOptU64(buf: Buffer, off: number, v: U64 | null | undefined, what: string): number {
  if (v === null || v === undefined) {
    buf[off] = 0;
    return off + 1;
  }
  buf[off] = 1;
  return writeU64(buf, off + 1, checkU64(v, what));
}

function failureTag(kind: unknown): number {
  const t = FAILURE_KINDS.indexOf(kind as WireFailureKind);
  if (t < 0) throw new WireError(`unknown FailureKind ${String(kind)}`);
  return t;
}

function usageSize(u: WireUsage): number {
  return optU64Size(u.tokens) + optU64Size(u.input_tokens) + optU64Size(u.output_tokens);
}

function writeUsage(buf: Buffer, off: number, u: WireUsage): number {
  off = writeOptU64(buf, off, u.tokens, "usage.tokens");
  off = writeOptU64(buf, off, u.input_tokens, "usage.input_tokens");
  return writeOptU64(buf, off, u.output_tokens, "usage.output_tokens");
}

/** Encoded size of an `Outcome`. */
export function outcomeSize(o: WireOutcome): number {
  if (o === "Cancelled") return 4;
  if ("Success" in o) return 4 + optU64Size(o.Success.tokens) + 1;
  if ("Failure" in o) return 8;
  if ("RateLimited" in o) return o.RateLimited.retry_after_s === null ? 5 : 13;
  if ("SuccessUsage" in o) return 4 + usageSize(o.SuccessUsage.usage) + 1;
  if ("FailureUsage" in o) return 8 + usageSize(o.FailureUsage.usage);
  if ("SuccessCached" in o) return 4 + usageSize(o.SuccessCached.usage) + 9;
  throw new WireError(`unknown Outcome ${JSON.stringify(o)}`);
}

/** Write an `Outcome` at `off`; returns the offset after it. */
export function writeOutcome(buf: Buffer, off: number, o: WireOutcome): number {
  if (o === "Cancelled") {
    buf.writeUInt32LE(3, off);
    return off + 4;
  }
  if ("Success" in o) {
    buf.writeUInt32LE(0, off);
    off = writeOptU64(buf, off + 4, o.Success.tokens, "tokens");
    buf[off] = o.Success.count_attempt ? 1 : 0;
    return off + 1;
  }
  if ("Failure" in o) {
    buf.writeUInt32LE(1, off);
    buf.writeUInt32LE(failureTag(o.Failure.kind), off + 4);
    return off + 8;
  }
  if ("RateLimited" in o) {
    buf.writeUInt32LE(2, off);
    const r = o.RateLimited.retry_after_s;
    if (r === null) {
      buf[off + 4] = 0;
      return off + 5;
    }
    buf[off + 4] = 1;
    buf.writeDoubleLE(r, off + 5);
    return off + 13;
  }
  if ("SuccessUsage" in o) {
    buf.writeUInt32LE(4, off);
    off = writeUsage(buf, off + 4, o.SuccessUsage.usage);
    buf[off] = o.SuccessUsage.count_attempt ? 1 : 0;
    return off + 1;
  }
  if ("SuccessCached" in o) {
    buf.writeUInt32LE(6, off);
    off = writeUsage(buf, off + 4, o.SuccessCached.usage);
    off = writeU64(buf, off, checkU64(o.SuccessCached.cached_input_tokens, "cached_input_tokens"));
    buf[off] = o.SuccessCached.count_attempt ? 1 : 0;
    return off + 1;
  }
  buf.writeUInt32LE(5, off);
  buf.writeUInt32LE(failureTag(o.FailureUsage.kind), off + 4);
  return writeUsage(buf, off + 8, o.FailureUsage.usage);
}

/** The payload bytes of a `CallSpec` (cached by a call: its Start frames reuse them). */
export function encodeCallSpec(spec: WireCallSpec): Buffer {
  const scope = utf8(spec.scope);
  const prio = spec.priority === null || spec.priority === undefined ? null : utf8(spec.priority);
  const size = 8 + scope.length + optU64Size(spec.est_tokens) + (prio === null ? 1 : 9 + prio.length)
    + optU64Size(spec.est_input_tokens) + optU64Size(spec.est_output_tokens);
  const buf = Buffer.allocUnsafe(size);
  let off = writeStr(buf, 0, scope);
  off = writeOptU64(buf, off, spec.est_tokens, "est_tokens");
  if (prio === null) {
    buf[off++] = 0;
  } else {
    buf[off++] = 1;
    off = writeStr(buf, off, prio);
  }
  off = writeOptU64(buf, off, spec.est_input_tokens, "est_input_tokens");
  writeOptU64(buf, off, spec.est_output_tokens, "est_output_tokens");
  return buf;
}

function specFrame(id: U64, tag: number, spec: Buffer): Buffer {
  const buf = frame(id, tag, spec.length);
  spec.copy(buf, 16);
  return buf;
}

/** `Start(CallSpec)` (tag 11) from a call's pre-encoded spec. */
export function encodeStart(id: U64, spec: Buffer): Buffer {
  return specFrame(id, 11, spec);
}

/** `Begin(CallSpec)` (tag 14). */
export function encodeBegin(id: U64, spec: Buffer): Buffer {
  return specFrame(id, 14, spec);
}

/**
 * The body of `StartTenant` / `BeginTenant` (v3): a pre-encoded `CallSpec` followed by
 * the tenant id (cached by a call, like its spec).
 */
export function encodeTenantSpec(spec: Buffer, tenant: string): Buffer {
  const t = utf8(tenant);
  const buf = Buffer.allocUnsafe(spec.length + 8 + t.length);
  spec.copy(buf, 0);
  writeStr(buf, spec.length, t);
  return buf;
}

/** `StartTenant{spec, tenant}` (tag 19) from {@link encodeTenantSpec}'s bytes. */
export function encodeStartTenant(id: U64, tenantSpec: Buffer): Buffer {
  return specFrame(id, 19, tenantSpec);
}

/** `BeginTenant{spec, tenant}` (tag 20). */
export function encodeBeginTenant(id: U64, tenantSpec: Buffer): Buffer {
  return specFrame(id, 20, tenantSpec);
}

/** `TenantStatus{scope, tenant}` (tag 21): `scope` null = every scope with tenants. */
export function encodeTenantStatus(id: U64, scope: string | null, tenant: string): Buffer {
  const sc = scope === null ? null : Buffer.from(scope, "utf8");
  const t = Buffer.from(tenant, "utf8");
  const buf = frame(id, 21, (sc === null ? 1 : 9 + sc.length) + 8 + t.length);
  let off = 16;
  if (sc === null) {
    buf[off++] = 0;
  } else {
    buf[off++] = 1;
    off = writeStr(buf, off, sc);
  }
  writeStr(buf, off, t);
  return buf;
}

function limitsSize(l: WireLimits): number {
  let n = 8;
  for (const d of [l.requests, l.tokens, l.input_tokens, l.output_tokens]) {
    n += d === null ? 1 : 1 + optU64Size(d.limit) + optU64Size(d.remaining) + (d.reset_s === null ? 1 : 9);
  }
  return n;
}

function writeLimits(buf: Buffer, off: number, l: WireLimits): number {
  for (const d of [l.requests, l.tokens, l.input_tokens, l.output_tokens]) {
    if (d === null) {
      buf[off++] = 0;
      continue;
    }
    buf[off++] = 1;
    off = writeOptU64(buf, off, d.limit, "limit");
    off = writeOptU64(buf, off, d.remaining, "remaining");
    if (d.reset_s === null) {
      buf[off++] = 0;
    } else {
      buf[off] = 1;
      buf.writeDoubleLE(d.reset_s, off + 1);
      off += 9;
    }
  }
  buf.writeDoubleLE(l.age_s, off);
  return off + 8;
}

function permitOutcome(id: U64, tag: number, permit: U64, outcome: WireOutcome, limits?: WireLimits | null): Buffer {
  const observed = limits !== null && limits !== undefined;
  const buf = frame(id, observed ? OBSERVED_TAG[tag]! : tag, 8 + outcomeSize(outcome) + (observed ? limitsSize(limits) : 0));
  writeU64(buf, 16, checkU64(permit, "permit"));
  const off = writeOutcome(buf, 24, outcome);
  if (observed) writeLimits(buf, off, limits);
  return buf;
}

/** §18: the tag of each report request's variant carrying observed limits. */
const OBSERVED_TAG: Record<number, number> = { 3: 16, 12: 17, 13: 18 };

/** `Report{permit, outcome}` (tag 3), or `ReportObserved` (16) with `limits`. */
export function encodeReport(id: U64, permit: U64, outcome: WireOutcome, limits?: WireLimits | null): Buffer {
  return permitOutcome(id, 3, permit, outcome, limits);
}

/** `Retry{permit, outcome}` (tag 12): report + acquire the next permit of the call; `RetryObserved` (17) with `limits`. */
export function encodeRetry(id: U64, permit: U64, outcome: WireOutcome, limits?: WireLimits | null): Buffer {
  return permitOutcome(id, 12, permit, outcome, limits);
}

/** `Finish{permit, outcome}` (tag 13): report + end the call; `FinishObserved` (18) with `limits`. */
export function encodeFinish(id: U64, permit: U64, outcome: WireOutcome, limits?: WireLimits | null): Buffer {
  return permitOutcome(id, 13, permit, outcome, limits);
}

function oneU64(id: U64, tag: number, v: U64, what: string): Buffer {
  const buf = frame(id, tag, 8);
  writeU64(buf, 16, checkU64(v, what));
  return buf;
}

/** `Acquire{call}` (tag 2). */
export function encodeAcquire(id: U64, call: U64): Buffer {
  return oneU64(id, 2, call, "call");
}

/** `EndCall{call}` (tag 4). */
export function encodeEndCall(id: U64, call: U64): Buffer {
  return oneU64(id, 4, call, "call");
}

/** `Cancel{target}` (tag 10). */
export function encodeCancel(id: U64, target: U64): Buffer {
  return oneU64(id, 10, target, "target");
}

/** `Hello{protocol_version, client_name, pid}` (tag 0). */
export function encodeHello(id: U64, version: number, clientName: string, pid: number): Buffer {
  const name = Buffer.from(clientName, "utf8");
  const buf = frame(id, 0, 4 + 8 + name.length + 4);
  buf.writeUInt32LE(checkU32(version, "protocol_version"), 16);
  const off = writeStr(buf, 20, name);
  buf.writeUInt32LE(checkU32(pid, "pid"), off);
  return buf;
}

/** A unit request (`Status`, `Ping`, `StatusJson`). */
export function encodeUnit(id: U64, tag: number): Buffer {
  return frame(id, tag, 0);
}

/** A request carrying one source name (`ForceClose` 7, `Reset` 8). */
export function encodeSource(id: U64, tag: number, source: string): Buffer {
  const s = Buffer.from(source, "utf8");
  const buf = frame(id, tag, 8 + s.length);
  writeStr(buf, 16, s);
  return buf;
}

/** `ForceOpen{source, seconds}` (tag 6). */
export function encodeForceOpen(id: U64, source: string, seconds: number): Buffer {
  const s = Buffer.from(source, "utf8");
  const buf = frame(id, 6, 16 + s.length);
  const off = writeStr(buf, 16, s);
  buf.writeDoubleLE(seconds, off);
  return buf;
}

// ------------------------------------------------------------------ hot decoders

function decodeGranted(r: Reader): WireGranted {
  const permit = r.u64();
  const source = r.str();
  const is_probe = r.bool();
  const attempt = r.u32();
  const est_tokens = r.u64();
  return { permit, source, is_probe, attempt, est_tokens };
}

/** `ErrorReply` (§4.7). */
export function decodeErrorReply(r: Reader): WireErrorReply {
  const kind = r.tag(ERROR_KINDS, "ErrorKind");
  const message = r.str();
  const retry_after_s = r.f64();
  const n = r.len(12); // each element is at least a u64 length + a u32 tag
  const per_source_reasons: [string, WireSkipReason][] = [];
  for (let i = 0; i < n; i++) {
    const src = r.str();
    per_source_reasons.push([src, r.tag(SKIP_REASONS, "SkipReason")]);
  }
  const exhausted = r.some() ? r.tag(EXHAUSTION_REASONS, "ExhaustionReason") : null;
  const scope = r.optStr();
  return { kind, message, retry_after_s, per_source_reasons, exhausted, scope };
}

/** Fallback for the cold replies (Welcome, Status, Pong, StatusJson, TenantLimited); set by codec.ts. */
let coldReply: ((r: Reader, tag: number) => WireReply) | null = null;

/** @internal codec.ts registers its generic decoder for the replies decoded here by hand. */
export function setColdReplyDecoder(f: (r: Reader, tag: number) => WireReply): void {
  coldReply = f;
}

/**
 * Decode a `Reply` occupying exactly `buf[off, end)` (the payload after the id).
 * The hot variants are read by hand; the rest by the generic codec.
 */
export function decodeReply(buf: Buffer, off: number, end: number): WireReply {
  const r = new Reader(buf, off, end);
  const tag = r.u32();
  let reply: WireReply;
  switch (tag) {
    case 1:
      reply = { CallBegun: { call: r.u64() } };
      break;
    case 2:
      reply = { Granted: decodeGranted(r) };
      break;
    case 3: {
      const applied = r.bool();
      const state = r.tag(BREAKER_STATES, "BreakerState");
      reply = { Reported: { applied, state, retry_after_s: r.f64() } };
      break;
    }
    case 4:
      reply = "Ok";
      break;
    case 7:
      reply = { Error: decodeErrorReply(r) };
      break;
    case 8: {
      const call = r.u64();
      const g = decodeGranted(r);
      reply = { Started: { call, ...g } };
      break;
    }
    default:
      if (coldReply === null) throw new WireError(`no decoder for Reply tag ${tag}`);
      reply = coldReply(r, tag);
  }
  r.done();
  return reply;
}

/** Read the id at the start of a payload as a number (exact below 2^53). */
export function payloadIdNumber(buf: Buffer, off: number): number {
  return buf.readUInt32LE(off + 4) * TWO32 + buf.readUInt32LE(off);
}
