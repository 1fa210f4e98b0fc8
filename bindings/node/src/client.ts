/**
 * The PolyGate client for Node.js (DESIGN §13, §14; bindings/PROTOCOL.md §6–§8, §14).
 *
 * One {@link Client} holds one Unix-socket connection that multiplexes every
 * concurrent call: a reader dispatches replies by request id, and the frames
 * produced in one tick are written with one `socket.write`. Calls use protocol
 * version 2 — two round trips for a call that succeeds first time:
 *
 * - a call's first `acquire()` sends `Start` (begin + acquire);
 * - `failure()`, `rateLimited()`, `cancel()` (and `success({countAttempt: false})`)
 *   are held, and travel with the next `acquire()` as `Retry`, or with `end()` as
 *   `Finish`;
 * - `success()` sends `Finish` (report + end) at once.
 *
 * `Hello` says version 3 (tenants, PROTOCOL §15); a sidecar that refuses it but
 * speaks 2 gets a second connection saying 2, where every call works except one
 * for a tenant, which is refused here before anything is sent.
 *
 * A closed connection fails every pending promise with {@link SidecarError}
 * (`kind` `"connection"`); the next call reconnects. The socket is unref'd while
 * nothing is pending, so an idle client never keeps the process alive.
 */

import * as net from "node:net";

import { autostartWanted, ensureSidecar } from "./autostart.js";
import { Usage, Verdict, cachedInputTokensOf, classifyError, usageOf } from "./classify.js";
import type { FailureKind } from "./classify.js";
import "./codec.js"; // registers the generic decoder of the cold replies
import {
  GatewayUnavailableError, PolyGateError, SidecarError, errorFromReply, errorFromTenantRefusal,
} from "./errors.js";
import { parseJson } from "./json.js";
import { Limits, checkLimits, limitsOf, toWireLimits } from "./ratelimit.js";
import {
  DEFAULT_MAX_FRAME, FALLBACK_VERSION, MAX_INCOMING_FRAME, MAX_TENANT_BYTES, PROTOCOL_VERSION, REQUEST_TAGS,
  TENANT_VERSION, U64, WireCallSpec, WireFailureKind, WireGranted, WireLimits, WireOutcome, WireReply, WireUsage,
  WireWelcome, decodeReply, encodeAcquire, encodeCallSpec, encodeCancel, encodeEndCall, encodeFinish,
  encodeForceOpen, encodeHello, encodeRetry, encodeSource, encodeStart, encodeStartTenant, encodeTenantSpec,
  encodeTenantStatus, encodeUnit, isU64, payloadIdNumber,
} from "./wire.js";

/** This package's version (also in `Hello.client_name`). */
export const VERSION = "0.2.0";
/** Where a root sidecar listens unless told otherwise; {@link defaultSocket} gives any user's. */
export const DEFAULT_SOCKET = "/run/polygate/sidecar.sock";
/** A non-root user's default socket, under `$XDG_RUNTIME_DIR`. */
export const USER_SOCKET = "polygate/sidecar.sock";
/** The environment variable naming the socket. */
export const SOCKET_ENV = "POLYGATE_SOCKET";

/**
 * The sidecar's default socket for `uid` (default: this process's effective uid),
 * by the sidecar's own rule (DESIGN §12): root `/run/polygate/sidecar.sock`, anyone
 * else `$XDG_RUNTIME_DIR/polygate/sidecar.sock` (`xdgRuntimeDir` default: the
 * environment's). Throws a {@link SidecarError} naming what to set when a non-root
 * user has no absolute `XDG_RUNTIME_DIR`.
 */
export function defaultSocket(uid?: number, xdgRuntimeDir?: string | null): string {
  const id = uid ?? (typeof process.geteuid === "function" ? process.geteuid() : 0);
  if (id === 0) return DEFAULT_SOCKET;
  const xdg = xdgRuntimeDir === undefined ? process.env.XDG_RUNTIME_DIR : xdgRuntimeDir;
  if (xdg && xdg.startsWith("/")) return `${xdg.replace(/\/+$/, "")}/${USER_SOCKET}`;
  throw new SidecarError(
    `no default PolyGate socket for uid ${id}: XDG_RUNTIME_DIR is not set (or not an absolute path); `
    + `set $${SOCKET_ENV} or pass the path (the root default ${DEFAULT_SOCKET} is for uid 0)`, "connection");
}

/** What a failed connect's message suggests, by errno code: a permission error names the settings to change. */
export function connectHint(code?: string): string {
  if (code === "EACCES" || code === "EPERM") {
    return "this user may not open the socket: ask the sidecar's operator to admit it (socket_mode, "
      + `the socket directory's group), or set $${SOCKET_ENV} or pass the path of a sidecar of this user`;
  }
  return "is polygate-sidecar running, and is the socket path right (argument, "
    + `$${SOCKET_ENV}, default ${DEFAULT_SOCKET} for root, $XDG_RUNTIME_DIR/${USER_SOCKET} for others)?`;
}

/** The socket path: the argument, else `$POLYGATE_SOCKET`, else {@link defaultSocket} for this uid. */
export function resolvePath(path?: string | null): string {
  if (path) return path;
  const env = process.env[SOCKET_ENV];
  return env ? env : defaultSocket();
}

// ------------------------------------------------------------------ public types

/** Options of {@link connect}. */
export interface ConnectOptions {
  /** Free text for the sidecar's logs; default `polygate-node/<version>`. */
  clientName?: string;
  /** Bound on connecting + the Hello/Welcome handshake, in milliseconds (default 10000). */
  timeoutMs?: number;
  /**
   * When nothing answers on the socket, start the packaged sidecar first, and again
   * at any reconnect that finds none (DESIGN §20); default `$POLYGATE_AUTOSTART`.
   */
  autostart?: boolean;
}

/** Options of a call (PROTOCOL §14.2). */
export interface CallOptions {
  /** Tokens reserved per attempt; absent = the split's sum, else the source's default. */
  estTokens?: number | bigint;
  /** A priority class of the scope (DESIGN §15); absent or `""` = the scope's default. */
  priority?: string | null;
  /** Input (prompt) estimate, for input-token limits (DESIGN §7a). */
  estInputTokens?: number | bigint;
  /** Output estimate, normally the request's `max_tokens`. */
  estOutputTokens?: number | bigint;
  /**
   * The tenant the call is made for (DESIGN §19): at most 128 bytes of UTF-8; absent,
   * `null` or `""` = the scope's anonymous tenant (a plain `Start`). Needs a sidecar
   * that speaks protocol 3.
   */
  tenant?: string | null;
}

/** Options of {@link Client.tenantStatus}. */
export interface TenantStatusOptions {
  /** Only this scope (absent: every scope with tenants). */
  scope?: string | null;
}

/** Options of {@link Call.acquire}. */
export interface AcquireOptions {
  /** Aborting sends `Cancel`: the wait ends at once and nothing stays held; the call is over. */
  signal?: AbortSignal;
}

/** What a user `classify` hook may return: a verdict, a kind, or nothing (= built-in rules). */
export type ClassifyResult = Verdict | FailureKind | "rate_limited" | null | undefined;

/** Options of {@link Client.run}. */
export interface RunOptions extends CallOptions, AcquireOptions {
  /** Your own classification of what `fn` threw; return `undefined` for the built-in rules. */
  classify?: (err: unknown, permit: Permit) => ClassifyResult;
}

/** Options of {@link Permit.success}. */
export interface SuccessOptions {
  /** Total tokens used (absent with a split = the split's sum; all absent = keep the estimate). */
  tokens?: number | bigint | null;
  /** Input tokens, excluding cached reads. */
  inputTokens?: number | bigint | null;
  /** Output tokens. */
  outputTokens?: number | bigint | null;
  /**
   * Input tokens the provider read from its prompt cache (a tenant's dollar cost
   * prices them at the cached rate): sent as `SuccessCached` on a version-3
   * connection, dropped on an older one.
   */
  cachedInputTokens?: number | bigint | null;
  /** `false`: the answer was unusable — kept out of the breaker window, and the call may retry. */
  countAttempt?: boolean;
}

/** Options of {@link Permit.failure}: tokens the upstream still consumed (charged for `bad_result` / `error`). */
export interface FailureOptions {
  tokens?: number | bigint | null;
  inputTokens?: number | bigint | null;
  outputTokens?: number | bigint | null;
}

/** The sidecar's answer to a report. */
export interface ReportResult {
  /** `false` when the outcome was fenced out (the breaker moved on since the grant). */
  applied: boolean;
  /** The source's breaker state now. */
  state: "closed" | "open" | "half_open";
  /** Seconds until a retry of this source is certainly worth attempting (0 = now). */
  retryAfterS: number;
}

/** One source in {@link Status} (keys as the sidecar's JSON status, PROTOCOL §14.4). */
export interface SourceStatus {
  state: "closed" | "open" | "half_open";
  epoch: number | bigint;
  retry_after_s: number;
  cooldown_level: number;
  window_successes: number | bigint;
  window_failures: number | bigint;
  streak: number;
  memo_remaining_s: number;
  pacer_ceiling: number;
  in_flight: number;
  tokens_available: number | null;
  requests_available: number | null;
  quota_blocked_s: number;
  degraded: boolean;
  [key: string]: unknown;
}

/** One scope in {@link Status}. */
export interface ScopeStatus {
  circuit_open: string;
  quota_full: string;
  waiters: number;
  calls: number;
  /** Sources by name, in configuration order. */
  sources: Record<string, SourceStatus>;
  [key: string]: unknown;
}

/** `client.status()`: the same shape as the Python binding's dict — scopes and sources keyed by name. */
export interface Status {
  sidecar_version: string;
  backend: string;
  protocol_version?: number;
  /** Scopes by name, in configuration order. */
  scopes: Record<string, ScopeStatus>;
  [key: string]: unknown;
}

// ------------------------------------------------------------------ helpers

const FAILURE_WIRE: Record<FailureKind, WireFailureKind> = {
  timeout: "Timeout",
  server_error: "ServerError",
  connection: "Connection",
  bad_result: "BadResult",
  error: "Error",
};

const STATES = { Closed: "closed", Open: "open", HalfOpen: "half_open" } as const;

function abortReason(signal: AbortSignal): unknown {
  return signal.reason ?? new DOMException("This operation was aborted", "AbortError");
}

function count(v: unknown, what: string): U64 | null {
  if (v === null || v === undefined) return null;
  if (!isU64(v)) {
    throw new RangeError(`${what} must be a non-negative integer (number or bigint), got ${String(v)}`);
  }
  return v;
}

function usageFields(o: FailureOptions): WireUsage | null {
  const u: WireUsage = {
    tokens: count(o.tokens, "tokens"),
    input_tokens: count(o.inputTokens, "inputTokens"),
    output_tokens: count(o.outputTokens, "outputTokens"),
  };
  return u.tokens === null && u.input_tokens === null && u.output_tokens === null ? null : u;
}

/** The body of `reply` if it is the `name` variant; the mapped error for `Error`. */
function expectReply<K extends string>(reply: WireReply, name: K): unknown {
  if (typeof reply === "string") {
    if (reply === name) return null;
  } else if (name in reply) {
    return (reply as Record<string, unknown>)[name];
  } else if ("Error" in reply) {
    throw errorFromReply(reply.Error);
  } else if ("TenantLimited" in reply) {
    throw errorFromTenantRefusal(reply.TenantLimited);
  }
  const got = typeof reply === "string" ? reply : Object.keys(reply)[0];
  throw new SidecarError(`unexpected reply ${got} from the sidecar (expected ${name})`, "protocol");
}

function reportResult(r: { applied: boolean; state: keyof typeof STATES; retry_after_s: number }): ReportResult {
  return { applied: r.applied, state: STATES[r.state], retryAfterS: r.retry_after_s };
}

const noop = (): void => {};

// ------------------------------------------------------------------ connection

/** A reply handler: the reader calls `ok` with the reply, or `err` when the connection dies. */
interface Pending {
  ok(reply: WireReply): void;
  err(e: SidecarError): void;
}

const DISCARD: Pending = { ok: noop, err: noop };

/**
 * Requests waiting on each AbortSignal: one listener per signal, however many
 * concurrent acquires share it (a shared shutdown signal must not pile up listeners).
 */
const watched = new WeakMap<AbortSignal, Set<Request>>();

function watch(signal: AbortSignal, r: Request): void {
  let set = watched.get(signal);
  if (set === undefined) {
    const s = new Set<Request>();
    set = s;
    watched.set(signal, s);
    signal.addEventListener("abort", () => {
      watched.delete(signal);
      const reason = abortReason(signal);
      for (const req of s) req.cancel(reason);
    }, { once: true });
  }
  set.add(r);
}

/** One request in flight; cancellable (its late reply then goes to `late`). */
class Request implements Pending {
  promise: Promise<WireReply>;
  private resolve!: (r: WireReply) => void;
  private reject!: (e: unknown) => void;
  private settled = false;
  private signal: AbortSignal | undefined;

  constructor(
    private readonly conn: Connection,
    readonly id: number,
    signal: AbortSignal | undefined,
    private readonly late: Pending,
  ) {
    this.promise = new Promise<WireReply>((res, rej) => {
      this.resolve = res;
      this.reject = rej;
    });
    if (signal !== undefined) {
      this.signal = signal;
      watch(signal, this);
    }
  }

  private settle(): boolean {
    if (this.settled) return false;
    this.settled = true;
    if (this.signal !== undefined) watched.get(this.signal)?.delete(this);
    return true;
  }

  ok(reply: WireReply): void {
    if (this.settle()) this.resolve(reply);
  }

  err(e: SidecarError): void {
    if (this.settle()) this.reject(e);
  }

  /** Give up: `Cancel` goes to the sidecar, the promise rejects with `reason` now. */
  cancel(reason: unknown): void {
    if (!this.settle()) return;
    this.conn.abandon(this.id, this, this.late);
    this.reject(reason);
  }
}

/** A connect or connection that fails with one of these found no sidecar, or one on its way out. */
const GONE_CODES = ["ENOENT", "ECONNREFUSED", "ECONNRESET", "EPIPE"];
/** The errors of connections the sidecar's side ended (see {@link GONE_CODES}). */
const goneErrors = new WeakSet<object>();

/**
 * {@link Connection.open}; with autostart, a connect or handshake that finds no
 * sidecar (nothing listening, or one exiting after `idle_exit` that refused, reset or
 * closed the connection) starts one ({@link ensureSidecar}) and tries again, all
 * within `timeoutMs` (10 s). @internal
 */
export async function dial(path: string, opts: ConnectOptions): Promise<Connection> {
  if (opts.autostart !== true) return Connection.open(path, opts);
  const deadline = Date.now() + (opts.timeoutMs ?? 10_000);
  for (let tries = 0; ; tries++) {
    try {
      return await Connection.open(path, opts);
    } catch (e) {
      const left = deadline - Date.now();
      if (typeof e !== "object" || e === null || !goneErrors.has(e) || left <= 0) throw e;
      if (tries > 0) await new Promise((r) => setTimeout(r, Math.min(left, 10))); // a listener still closing
      await ensureSidecar(path, left);
    }
  }
}

/** One socket to the sidecar, after a successful handshake. @internal */
export class Connection {
  readonly path: string;
  maxFrame = DEFAULT_MAX_FRAME;
  welcome: WireWelcome | null = null;
  /** Why the connection is unusable, once it is. */
  dead: SidecarError | null = null;
  private readonly sock: net.Socket;
  private nextId = 1;
  private readonly pending = new Map<number, Pending>();
  private out: Buffer[] = [];
  private flushScheduled = false;
  private readonly flushBound = (): void => this.flush();
  private parts: Buffer[] = [];
  private partsLen = 0;
  private need = 0;
  private connected = false;
  private sockError: Error | null = null;
  private fatal: PolyGateError | null = null;
  private closedByClient = false;
  private readonly closed: Promise<void>;
  onDead: ((c: Connection) => void) | null = null;

  private constructor(path: string) {
    this.path = path;
    this.sock = net.createConnection(path);
    this.closed = new Promise((resolve) => this.sock.once("close", () => resolve()));
    this.sock.once("connect", () => {
      this.connected = true;
    });
    this.sock.on("data", (chunk: Buffer) => this.onData(chunk));
    this.sock.on("error", (e: Error) => {
      this.sockError = e;
    });
    this.sock.on("close", () => {
      if (this.dead !== null) return;
      const err = this.closeReason();
      // Not closed by us: refused, reset, EOF... "no sidecar there", or one on its way out.
      const code = (this.sockError as NodeJS.ErrnoException | null)?.code;
      if (!this.closedByClient && (code === undefined || GONE_CODES.includes(code))) goneErrors.add(err);
      this.die(err);
    });
  }

  /**
   * Connect and handshake (`Hello` v3 → `Welcome`); a sidecar that refuses 3 naming
   * versions up to 2 (it closes the connection) gets a second one saying 2.
   */
  static async open(path: string, opts: ConnectOptions = {}): Promise<Connection> {
    try {
      return await Connection.openVersion(path, opts, PROTOCOL_VERSION);
    } catch (e) {
      if (!(e instanceof VersionFallback)) throw e;
      return Connection.openVersion(path, opts, e.version);
    }
  }

  private static openVersion(path: string, opts: ConnectOptions, version: number): Promise<Connection> {
    const conn = new Connection(path);
    const ms = opts.timeoutMs ?? 10_000;
    const name = opts.clientName ?? `polygate-node/${VERSION}`;
    return new Promise<Connection>((resolve, reject) => {
      const timer = setTimeout(() => {
        const e = new SidecarError(`no Welcome from the PolyGate sidecar at ${path} within ${ms} ms`, "connection");
        conn.close(e);
        reject(e);
      }, ms);
      // Hello uses id 0 (PROTOCOL §6), so a PermissionDenied with id 0 answers it too.
      const hello = new Request(conn, 0, undefined, DISCARD);
      conn.register(0, hello, encodeHello(0, version, name, process.pid));
      hello.promise.then(
        (reply) => {
          clearTimeout(timer);
          try {
            conn.welcome = checkWelcome(reply, path, version);
          } catch (e) {
            conn.close(e instanceof SidecarError ? e : undefined);
            reject(e);
            return;
          }
          conn.maxFrame = conn.welcome.max_frame;
          resolve(conn);
        },
        (e: unknown) => {
          clearTimeout(timer);
          reject(e);
        },
      );
    });
  }

  // -------------------------------------------------------------- sending

  /** Register `p` under `id` and queue `frame` (written with the rest of this tick's frames). */
  register(id: number, p: Pending, frame: Buffer): void {
    if (this.dead !== null) throw this.dead;
    if (frame.length - 4 > this.maxFrame) {
      throw new SidecarError(
        `request of ${frame.length - 4} bytes exceeds the sidecar's max_frame ${this.maxFrame}`, "frame_too_large");
    }
    this.pending.set(id, p);
    if (this.pending.size === 1) this.sock.ref();
    this.out.push(frame);
    if (!this.flushScheduled) {
      this.flushScheduled = true;
      // A tick queued from a promise continuation runs once the microtask queue is
      // drained: every frame the woken calls produce goes out in one write.
      process.nextTick(this.flushBound);
    }
  }

  private flush(): void {
    this.flushScheduled = false;
    const out = this.out;
    if (out.length === 0 || this.dead !== null) return;
    this.out = [];
    this.sock.write(out.length === 1 ? out[0]! : Buffer.concat(out));
  }

  /** A new request id. */
  id(): number {
    return this.nextId++;
  }

  /** Send a request and await its reply (rejects only if the connection dies, or on abort). */
  request(make: (id: number) => Buffer, signal?: AbortSignal, late: Pending = DISCARD): Request {
    const id = this.nextId++;
    const r = new Request(this, id, signal, late);
    try {
      this.register(id, r, make(id));
    } catch (e) {
      r.err(e as SidecarError);
    }
    return r;
  }

  /** Fire and forget: the reply is read and discarded. */
  post(make: (id: number) => Buffer): void {
    if (this.dead !== null) return;
    const id = this.nextId++;
    try {
      this.register(id, DISCARD, make(id));
    } catch {
      // the connection died or the frame cannot be sent: nothing is left to release
    }
  }

  /** A request given up: `Cancel` it; whatever it still returns goes to `late`. */
  abandon(id: number, current: Pending, late: Pending): void {
    if (this.pending.get(id) !== current) return;
    this.pending.set(id, late);
    this.post((cid) => encodeCancel(cid, id));
  }

  // -------------------------------------------------------------- reading

  private onData(chunk: Buffer): void {
    let buf: Buffer;
    if (this.partsLen === 0) {
      buf = chunk;
    } else {
      this.parts.push(chunk);
      this.partsLen += chunk.length;
      if (this.partsLen < this.need) return; // a large frame: wait for all of it, concat once
      buf = this.parts.length === 1 ? this.parts[0]! : Buffer.concat(this.parts, this.partsLen);
      this.parts = [];
      this.partsLen = 0;
    }
    let off = 0;
    const len = buf.length;
    while (len - off >= 4) {
      const n = buf.readUInt32BE(off);
      if (n > MAX_INCOMING_FRAME) {
        this.close(new SidecarError(
          `the sidecar at ${this.path} sent a frame of ${n} bytes (limit ${MAX_INCOMING_FRAME})`, "protocol"));
        return;
      }
      if (len - off - 4 < n) break;
      this.dispatch(buf, off + 4, off + 4 + n);
      if (this.dead !== null) return;
      off += 4 + n;
    }
    if (off < len) {
      const rest = off === 0 ? buf : buf.subarray(off);
      this.parts = [rest];
      this.partsLen = rest.length;
      this.need = rest.length >= 4 ? 4 + rest.readUInt32BE(0) : 4;
    }
  }

  private dispatch(buf: Buffer, start: number, end: number): void {
    let reply: WireReply;
    let id: number;
    try {
      if (end - start < 12) throw new Error(`a payload of ${end - start} bytes`);
      id = payloadIdNumber(buf, start);
      reply = decodeReply(buf, start + 8, end);
    } catch (e) {
      this.close(new SidecarError(
        `undecodable frame from the sidecar at ${this.path}: ${(e as Error).message}`, "protocol"));
      return;
    }
    const p = this.pending.get(id);
    if (p === undefined) {
      // Id 0 that answers nothing: a connection-level error, sent before the sidecar closes.
      if (id === 0 && typeof reply === "object" && "Error" in reply) this.fatal = errorFromReply(reply.Error);
      return;
    }
    this.pending.delete(id);
    if (this.pending.size === 0) this.sock.unref();
    p.ok(reply);
  }

  // -------------------------------------------------------------- closing

  private closeReason(): SidecarError {
    if (this.closedByClient) return new SidecarError(`the client closed its connection to ${this.path}`, "connection");
    if (!this.connected) {
      const e = this.sockError as NodeJS.ErrnoException | null;
      const why = e === null ? "connection closed" : `${e.code ?? e.name}: ${e.message}`;
      return new SidecarError(
        `cannot connect to the PolyGate sidecar at ${this.path} (${why}); ${connectHint(e?.code)}`, "connection",
        { cause: e ?? undefined });
    }
    if (this.fatal !== null) {
      const kind = this.fatal instanceof SidecarError ? this.fatal.kind : "connection";
      return new SidecarError(`the sidecar at ${this.path} closed the connection: ${this.fatal.message}`, kind,
        { cause: this.fatal });
    }
    const why = this.sockError === null ? "" : `: ${this.sockError.message}`;
    return new SidecarError(`the connection to the sidecar at ${this.path} was lost${why}`, "connection",
      { cause: this.sockError ?? undefined });
  }

  private die(err: SidecarError): void {
    if (this.dead !== null) return;
    this.dead = err;
    const pending = [...this.pending.values()];
    this.pending.clear();
    this.out = [];
    this.sock.destroy();
    for (const p of pending) p.err(err);
    this.onDead?.(this);
  }

  /** Close (the sidecar releases everything this connection held). */
  close(reason?: SidecarError): Promise<void> {
    this.closedByClient = reason === undefined;
    this.die(reason ?? this.closeReason());
    return this.closed;
  }
}

/** An older sidecar refused `Hello` 3 but speaks {@link version}: connect again saying it. @internal */
class VersionFallback extends Error {
  constructor(readonly version: number, said: string) {
    super(said);
  }
}

function checkWelcome(reply: WireReply, path: string, version: number): WireWelcome {
  if (typeof reply === "object" && "Error" in reply && reply.Error.kind === "ProtocolViolation") {
    // "... this sidecar speaks versions 1 to 2" (the client's own "speaks version 3" comes first)
    const m = /sidecar speaks (?:versions? )?(\d+)(?: to (\d+))?/.exec(reply.Error.message);
    const highest = m === null ? null : Number(m[2] ?? m[1]);
    if (version > FALLBACK_VERSION && (highest === null || highest >= FALLBACK_VERSION)) {
      throw new VersionFallback(FALLBACK_VERSION, reply.Error.message);
    }
    const theirs = highest === null ? "an older protocol" : `protocol ${highest}`;
    throw new SidecarError(
      `the sidecar at ${path} speaks ${theirs}, this client (polygate-node ${VERSION}) needs protocol `
      + `${FALLBACK_VERSION}: upgrade polygate-sidecar (the sidecar said: ${reply.Error.message})`,
      "protocol_violation");
  }
  const w = expectReply(reply, "Welcome") as WireWelcome;
  if (w.protocol_version < FALLBACK_VERSION || w.protocol_version > version) {
    throw new SidecarError(
      `the sidecar at ${path} answered with protocol ${w.protocol_version}, this client needs `
      + `${FALLBACK_VERSION} to ${PROTOCOL_VERSION}: upgrade polygate-sidecar`, "protocol_violation");
  }
  return w;
}

/**
 * A tenant call (or tenant status) on a connection older than version 3: refused
 * here, never sent without its tenant (PROTOCOL §15).
 */
function tenantsUnsupported(what: string, version: number, scope: string | null): SidecarError {
  return new SidecarError(
    `${what}: the sidecar speaks protocol ${version}; tenants need ${TENANT_VERSION}: upgrade polygate-sidecar`,
    "protocol_violation", { scope });
}

/** Lone UTF-16 surrogates: `Buffer.from` would turn them into U+FFFD, a different tenant id. */
const LONE_SURROGATE = /[\uD800-\uDBFF](?![\uDC00-\uDFFF])|(?<![\uD800-\uDBFF])[\uDC00-\uDFFF]/;

/** A tenant id, checked where it is given: a string of at most 128 bytes of UTF-8. */
function checkTenant(tenant: unknown): string {
  if (typeof tenant !== "string") throw new TypeError(`tenant must be a string (a tenant id), got ${String(tenant)}`);
  if (LONE_SURROGATE.test(tenant)) throw new TypeError(`tenant ${JSON.stringify(tenant)} is not valid Unicode (a lone surrogate)`);
  const n = Buffer.byteLength(tenant, "utf8");
  if (n > MAX_TENANT_BYTES) {
    throw new RangeError(
      `tenant id ${JSON.stringify(tenant.slice(0, 32))}... is ${n} bytes of UTF-8; the limit is ${MAX_TENANT_BYTES} bytes`);
  }
  return tenant;
}

// ------------------------------------------------------------------ permit

/** Permission to make one attempt on {@link source}. Report it exactly once. */
export class Permit {
  /** The permit's id (u64). */
  readonly id: bigint;
  /** The source to call now. */
  readonly source: string;
  /** This attempt is the one trial call through a half-open breaker: report it promptly. */
  readonly isProbe: boolean;
  /** 1-based attempt number within the call. */
  readonly attempt: number;
  /** Tokens reserved for this attempt. */
  readonly estTokens: number;
  /** Tokens the attempt used; set by a `run` function to override the result's usage. */
  tokens?: number;
  /** Input tokens (excluding cached reads); set by a `run` function. */
  inputTokens?: number;
  /** Output tokens; set by a `run` function. */
  outputTokens?: number;
  /** Input tokens read from the provider's prompt cache; set by a `run` function. */
  cachedInputTokens?: number;
  /**
   * The provider's rate-limit headers of this attempt's response (DESIGN §18),
   * sent with its report: set by hand (`permit.limits = parseRateLimitHeaders(res.headers).limits`,
   * or an object of the {@link Limits} keys) or by `run` from an SDK error's or a raw
   * response's headers. Another shape throws a TypeError at the assignment.
   */
  get limits(): Limits | null {
    return this._limits;
  }

  set limits(v: Limits | null) {
    this._limits = checkLimits(v);
  }

  private _limits: Limits | null = null;
  /** The sidecar's answer once a `success()` was reported. */
  result: ReportResult | undefined;
  /** @internal */
  _reported = false;
  /** @internal */
  readonly _call: Call;

  /** @internal */
  constructor(call: Call, g: WireGranted) {
    this._call = call;
    this.id = g.permit;
    this.source = g.source;
    this.isProbe = g.is_probe;
    this.attempt = g.attempt;
    this.estTokens = Number(g.est_tokens);
  }

  /** Whether an outcome was reported. */
  get reported(): boolean {
    return this._reported;
  }

  /**
   * The upstream answered usefully: sends `Finish` (report + end of the call) and
   * resolves with the sidecar's answer. With `countAttempt: false` (the answer was
   * unusable) the report is held like a failure — the call may `acquire()` again —
   * and this resolves with `undefined`.
   */
  success(opts?: SuccessOptions & { countAttempt?: true }): Promise<ReportResult>;
  success(opts: SuccessOptions & { countAttempt: false }): Promise<undefined>;
  success(opts?: SuccessOptions): Promise<ReportResult | undefined>;
  success(opts: SuccessOptions = {}): Promise<ReportResult | undefined> {
    let outcome: WireOutcome;
    const countAttempt = opts.countAttempt ?? true;
    try {
      const u = usageFields(opts);
      const cached = count(opts.cachedInputTokens, "cachedInputTokens");
      if (cached !== null && cached !== 0 && cached !== 0n && this._call._protocolVersion() >= TENANT_VERSION) {
        outcome = {
          SuccessCached: {
            usage: u ?? { tokens: null, input_tokens: null, output_tokens: null },
            cached_input_tokens: cached, count_attempt: countAttempt,
          },
        };
      } else {
        outcome = u === null || (u.input_tokens === null && u.output_tokens === null)
          ? { Success: { tokens: u === null ? null : u.tokens, count_attempt: countAttempt } }
          : { SuccessUsage: { usage: u, count_attempt: countAttempt } };
      }
    } catch (e) {
      return Promise.reject(e);
    }
    return this._call._success(this, outcome, countAttempt);
  }

  /**
   * The upstream failed (`timeout`, `server_error`, `connection`, `bad_result`,
   * `error`). Held: sent with the next `acquire()` (as `Retry`) or with `end()`.
   */
  failure(kind: FailureKind, opts: FailureOptions = {}): Promise<void> {
    const wire = FAILURE_WIRE[kind];
    if (wire === undefined) {
      return Promise.reject(new RangeError(
        `unknown failure kind ${JSON.stringify(kind)}: expected one of ${Object.keys(FAILURE_WIRE).join(", ")}`));
    }
    let outcome: WireOutcome;
    try {
      const u = usageFields(opts);
      outcome = u === null ? { Failure: { kind: wire } } : { FailureUsage: { kind: wire, usage: u } };
    } catch (e) {
      return Promise.reject(e);
    }
    return this._call._hold(this, outcome);
  }

  /** The upstream answered 429 (backpressure, not failure); pass its Retry-After. Held like a failure. */
  rateLimited(opts: { retryAfterS?: number | null } = {}): Promise<void> {
    const r = opts.retryAfterS ?? null;
    if (r !== null && (typeof r !== "number" || !Number.isFinite(r) || r < 0)) {
      return Promise.reject(new RangeError(`retryAfterS must be a finite number >= 0, got ${String(r)}`));
    }
    return this._call._hold(this, { RateLimited: { retry_after_s: r } });
  }

  /** The attempt was given up before (or while) sending; its reservation is refunded. Held like a failure. */
  cancel(): Promise<void> {
    return this._call._hold(this, "Cancelled");
  }
}

// ------------------------------------------------------------------ call

/**
 * Where the late reply of an abandoned acquire goes: it releases what the request
 * still created (a grant that raced the Cancel is finished unused; a call that
 * outlived its request is ended). `done()` settles once that is over.
 */
class LateAcquire implements Pending {
  private finished = false;
  private resolveDone: (() => void) | null = null;

  constructor(
    private readonly conn: Connection,
    private readonly kind: "start" | "retry" | "acquire",
    private readonly callId: bigint | null,
  ) {}

  done(): Promise<void> {
    return this.finished ? Promise.resolve() : new Promise((r) => (this.resolveDone = r));
  }

  private finish = (): void => {
    this.finished = true;
    this.resolveDone?.();
  };

  private release(make: (id: number) => Buffer): void {
    this.conn.request(make).promise.then(this.finish, this.finish);
  }

  ok(reply: WireReply): void {
    if (typeof reply === "object" && ("Started" in reply || "Granted" in reply)) {
      const permit = "Started" in reply ? reply.Started.permit : reply.Granted.permit;
      this.release((id) => encodeFinish(id, permit, "Cancelled"));
    } else if (this.kind === "acquire" || (this.kind === "retry" && typeof reply === "object" && "Error" in reply
      && (reply.Error.kind === "UnknownPermit" || reply.Error.kind === "InvalidArgument"))) {
      const call = this.callId!;
      this.release((id) => encodeEndCall(id, call));
    } else {
      this.finish(); // a cancelled Start or Retry leaves no call behind
    }
  }

  err(): void {
    this.finish();
  }
}

/**
 * - `new`: nothing on the sidecar yet (the first acquire sends Start);
 * - `live`: the call exists; acquire may continue it;
 * - `over`: the call exists but cannot continue (end() sends EndCall);
 * - `finishing`: a Finish is in flight;
 * - `gone`: nothing left on the sidecar.
 */
type CallState = "new" | "live" | "over" | "finishing" | "gone";

/** One logical request in a scope; it may take several attempts. End it on every path. */
export class Call {
  /** The scope of the call. */
  readonly scope: string;
  /** The call's id on its connection, once the first acquire began it. */
  id: bigint | null = null;
  /** The tenant the call is made for (`null`: the scope's anonymous tenant). */
  readonly tenant: string | null;
  private readonly client: Client;
  private readonly spec: Buffer;
  /** `StartTenant`'s body (spec + tenant id), for a call with a tenant. */
  private readonly tenantSpec: Buffer | null;
  private conn: Connection | null = null;
  private state: CallState = "new";
  private permit: Permit | null = null;
  private held: { permit: Permit; outcome: WireOutcome; limits: WireLimits | null } | null = null;
  private acquireReq: Request | null = null;
  private acquiring: Promise<unknown> | null = null;
  private finishing: Promise<unknown> | null = null;
  private cleanup: Promise<void> | null = null;
  private ending: Promise<ReportResult | undefined> | null = null;

  /** @internal use {@link Client.call} */
  constructor(client: Client, scope: string, opts: CallOptions) {
    if (typeof scope !== "string" || scope === "") throw new TypeError(`scope must be a non-empty string, got ${String(scope)}`);
    const priority = opts.priority;
    if (priority !== undefined && priority !== null && typeof priority !== "string") {
      throw new TypeError(`priority must be a string, got ${String(priority)}`);
    }
    const spec: WireCallSpec = {
      scope,
      est_tokens: count(opts.estTokens, "estTokens"),
      priority: priority ? priority : null,
      est_input_tokens: count(opts.estInputTokens, "estInputTokens"),
      est_output_tokens: count(opts.estOutputTokens, "estOutputTokens"),
    };
    const tenant = opts.tenant === undefined || opts.tenant === null ? null : checkTenant(opts.tenant);
    this.client = client;
    this.scope = scope;
    this.spec = encodeCallSpec(spec);
    this.tenant = tenant ? tenant : null;
    this.tenantSpec = this.tenant === null ? null : encodeTenantSpec(this.spec, this.tenant);
  }

  /** @internal the version of the connection the call went to (a success's outcome depends on it). */
  _protocolVersion(): number {
    return this.conn?.welcome?.protocol_version ?? FALLBACK_VERSION;
  }

  /** The permit of the current attempt, if one is held and unreported. */
  get currentPermit(): Permit | null {
    return this.permit;
  }

  /**
   * Await a permit. The first acquire begins the call (`Start`); a later one carries
   * the held report of the previous attempt (`Retry`). May wait in the sidecar
   * (wait mode). Rejects with {@link CircuitOpenError}, {@link AllSourcesExhaustedError},
   * {@link GatewayUnavailableError} (the call is over) or {@link SidecarError}.
   * Aborting `signal` sends `Cancel` and rejects with the signal's reason; the call is over.
   */
  async acquire(opts: AcquireOptions = {}): Promise<Permit> {
    // Everything up to the first await runs synchronously: the checks and the flag are atomic.
    if (this.ending !== null) throw new Error(`the call in scope "${this.scope}" has ended`);
    if (this.acquiring !== null) {
      throw new SidecarError(`the call in scope "${this.scope}" already has an acquire in progress`, "busy", { scope: this.scope });
    }
    if (this.permit !== null) {
      throw new SidecarError(
        `the call in scope "${this.scope}" holds permit ${this.permit.id} (source ${this.permit.source}) that was `
        + "not reported: report it before acquiring again", "busy", { scope: this.scope });
    }
    if (this.state !== "new" && this.state !== "live") {
      throw new Error(`the call in scope "${this.scope}" is over (it succeeded, failed for good or was cancelled)`);
    }
    const signal = opts.signal;
    if (signal?.aborted) throw abortReason(signal);
    const p = this.doAcquire(signal);
    this.acquiring = p;
    try {
      return await p;
    } finally {
      this.acquiring = null;
      this.acquireReq = null;
    }
  }

  private async doAcquire(signal: AbortSignal | undefined): Promise<Permit> {
    let conn: Connection;
    if (this.state === "new") {
      conn = await this.client._connection();
      if (signal?.aborted) throw abortReason(signal);
      if (this.ending !== null) throw new DOMException("the call was ended", "AbortError");
    } else {
      conn = this.conn!;
      if (conn.dead !== null) {
        this.state = "gone";
        throw conn.dead;
      }
    }
    const kind = this.state === "new" ? "start" : this.held !== null ? "retry" : "acquire";
    const tenantSpec = this.tenantSpec;
    if (kind === "start" && tenantSpec !== null) {
      const version = conn.welcome?.protocol_version ?? FALLBACK_VERSION;
      if (version < TENANT_VERSION) {
        throw tenantsUnsupported(`call in scope "${this.scope}" for tenant "${this.tenant}"`, version, this.scope);
      }
    }
    const held = this.held;
    this.held = null;
    const callId = this.id;
    const spec = this.spec;
    const late = new LateAcquire(conn, kind, callId);
    const req = conn.request(
      kind === "start" ? (tenantSpec === null ? (id) => encodeStart(id, spec) : (id) => encodeStartTenant(id, tenantSpec))
        : kind === "retry" ? (id) => encodeRetry(id, held!.permit.id, held!.outcome, held!.limits)
          : (id) => encodeAcquire(id, callId!),
      signal, late);
    this.acquireReq = req;
    let reply: WireReply;
    try {
      reply = await req.promise;
    } catch (e) {
      // Aborted (the late handler releases whatever the request still creates) or
      // the connection died (which released everything): either way the call is over.
      this.state = "gone";
      if (!(e instanceof SidecarError)) this.cleanup = late.done();
      throw e;
    }
    if (typeof reply === "object") {
      if ("Started" in reply) {
        const s = reply.Started;
        this.id = s.call;
        this.conn = conn;
        this.state = "live";
        return (this.permit = new Permit(this, s));
      }
      if ("Granted" in reply) return (this.permit = new Permit(this, reply.Granted));
      if ("TenantLimited" in reply) {
        // The tenant's refusal ends the call (PROTOCOL §15): nothing is left to end after a
        // StartTenant or a Retry; after an Acquire, end() ends the call as after any error.
        this.state = kind === "acquire" ? "over" : "gone";
        throw errorFromTenantRefusal(reply.TenantLimited);
      }
      if ("Error" in reply) {
        const err = errorFromReply(reply.Error);
        if (kind === "start") {
          this.state = "gone"; // a Start that ends in an error leaves no call behind
        } else if (kind === "retry" && err.kind === "invalid_argument") {
          // Nothing changed: the permit is still unreported (a bad count in the held report).
          held!.permit._reported = false;
          this.permit = held!.permit;
        } else if (kind === "retry" && err.kind === "unknown_permit") {
          // The permit was reclaimed; the call still exists (the next acquire sends Acquire).
        } else if (kind === "retry") {
          this.state = "gone"; // PROTOCOL §14.1: after any other Retry error the call is gone
        } else {
          this.state = "over"; // an Acquire's error leaves the call: end() ends it
        }
        throw err;
      }
    }
    this.state = kind === "start" ? "gone" : "over";
    throw new SidecarError(`unexpected reply ${JSON.stringify(reply)} to an acquire`, "protocol");
  }

  /** @internal */
  private reportable(permit: Permit): void {
    if (permit._reported) throw new Error(`permit ${permit.id} (source ${permit.source}) was already reported`);
    if (this.permit !== permit) {
      throw new Error(`permit ${permit.id} (source ${permit.source}) no longer belongs to a live call (the call ended)`);
    }
  }

  /** @internal */
  _hold(permit: Permit, outcome: WireOutcome): Promise<void> {
    let limits: WireLimits | null;
    try {
      this.reportable(permit);
      limits = toWireLimits(permit.limits);
    } catch (e) {
      return Promise.reject(e);
    }
    permit._reported = true;
    this.permit = null;
    this.held = { permit, outcome, limits };
    return Promise.resolve();
  }

  /** @internal */
  async _success(permit: Permit, outcome: WireOutcome, countAttempt: boolean): Promise<ReportResult | undefined> {
    this.reportable(permit);
    const limits = toWireLimits(permit.limits);
    if (!countAttempt) {
      permit._reported = true;
      this.permit = null;
      this.held = { permit, outcome, limits };
      return undefined;
    }
    const conn = this.conn!;
    permit._reported = true;
    this.permit = null;
    this.state = "finishing";
    const req = conn.request((id) => encodeFinish(id, permit.id, outcome, limits));
    this.finishing = req.promise;
    let reply: WireReply;
    try {
      reply = await req.promise;
    } catch (e) {
      this.state = "gone";
      throw e;
    } finally {
      this.finishing = null;
    }
    if (typeof reply === "object" && "Reported" in reply) {
      this.state = "gone";
      return (permit.result = reportResult(reply.Reported));
    }
    if (typeof reply === "object" && "Error" in reply) {
      const err = errorFromReply(reply.Error);
      if (err.kind === "invalid_argument") {
        permit._reported = false; // nothing changed: report again with valid counts
        this.permit = permit;
        this.state = "live";
      } else if (err.kind === "unknown_permit") {
        this.state = "over"; // the permit was reclaimed; end() sends EndCall for the call
      } else {
        this.state = "gone";
      }
      throw err;
    }
    this.state = "over";
    throw new SidecarError(`unexpected reply ${JSON.stringify(reply)} to Finish`, "protocol");
  }

  /**
   * Release whatever the call still holds and forget it (idempotent; never rejects
   * for sidecar trouble — the call is over either way). A held report goes out as
   * `Finish` (resolving with its result); a pending acquire is cancelled; a permit
   * never reported is abandoned — its reservation is charged as if the upstream
   * used the estimate (report `cancel()` first if nothing was sent).
   */
  end(): Promise<ReportResult | undefined> {
    if (this.ending === null) this.ending = this.doEnd();
    return this.ending;
  }

  private async doEnd(): Promise<ReportResult | undefined> {
    for (;;) {
      if (this.acquiring !== null) {
        this.acquireReq?.cancel(new DOMException("the call was ended", "AbortError"));
        await this.acquiring.catch(noop);
      } else if (this.finishing !== null) {
        await this.finishing.catch(noop);
      } else if (this.cleanup !== null) {
        const c = this.cleanup;
        this.cleanup = null;
        await c;
      } else {
        break;
      }
    }
    if (this.state !== "live" && this.state !== "over") return undefined;
    const conn = this.conn!;
    const callId = this.id!;
    this.permit = null;
    try {
      if (this.held !== null) {
        const h = this.held;
        this.held = null;
        const reply = await conn.request((id) => encodeFinish(id, h.permit.id, h.outcome, h.limits)).promise;
        if (typeof reply === "object" && "Reported" in reply) {
          this.state = "gone";
          return (h.permit.result = reportResult(reply.Reported));
        }
        const kind = typeof reply === "object" && "Error" in reply ? reply.Error.kind : "";
        if (kind !== "UnknownPermit" && kind !== "InvalidArgument") {
          this.state = "gone"; // the call is gone with any other Finish answer
          return undefined;
        }
      }
      await conn.request((id) => encodeEndCall(id, callId)).promise;
    } catch {
      // connection lost: the sidecar released everything the connection held
    }
    this.state = "gone";
    return undefined;
  }
}

// ------------------------------------------------------------------ client

/** A connection to the sidecar shared by every call of this process (or of this client). */
export class Client {
  /** The socket path. */
  readonly path: string;
  private readonly opts: ConnectOptions;
  private conn: Connection | null;
  private connecting: Promise<Connection> | null = null;
  private closedByUser = false;

  /** @internal use {@link connect} */
  constructor(path: string, conn: Connection, opts: ConnectOptions) {
    this.path = path;
    this.conn = conn;
    this.opts = opts;
  }

  /** The protocol version of the current connection. */
  get protocolVersion(): number {
    return this.conn?.welcome?.protocol_version ?? PROTOCOL_VERSION;
  }

  /** The sidecar's software version (from `Welcome`). */
  get sidecarVersion(): string {
    return this.conn?.welcome?.sidecar_version ?? "";
  }

  /** The sidecar's frame size limit (from `Welcome`). */
  get maxFrame(): number {
    return this.conn?.maxFrame ?? DEFAULT_MAX_FRAME;
  }

  /** Whether {@link close} was called. */
  get closed(): boolean {
    return this.closedByUser;
  }

  /** @internal the live connection, reconnecting after a lost one. */
  _connection(): Promise<Connection> {
    if (this.closedByUser) return Promise.reject(new SidecarError(`the client for ${this.path} was closed`, "connection"));
    const c = this.conn;
    if (c !== null && c.dead === null) return Promise.resolve(c);
    if (this.connecting === null) {
      this.connecting = dial(this.path, this.opts).then(
        (conn) => {
          this.connecting = null;
          if (this.closedByUser) {
            void conn.close();
            throw new SidecarError(`the client for ${this.path} was closed`, "connection");
          }
          this.conn = conn;
          return conn;
        },
        (e: unknown) => {
          this.connecting = null;
          throw e;
        },
      );
    }
    return this.connecting;
  }

  private async request(make: (id: number) => Buffer): Promise<WireReply> {
    const conn = await this._connection();
    return conn.request(make).promise;
  }

  /**
   * Open a call in `scope` (nothing is sent until its first `acquire()`). End it
   * in a `finally`: `await call.end()`.
   */
  async call(scope: string, opts: CallOptions = {}): Promise<Call> {
    if (this.closedByUser) throw new SidecarError(`the client for ${this.path} was closed`, "connection");
    return new Call(this, scope, opts);
  }

  /**
   * The whole loop of a call (DESIGN §14): acquire, run `fn(permit)`, classify what
   * it threw (timeouts, connection errors, HTTP 429 with Retry-After, 5xx, other 4xx
   * re-thrown at once, anything else), report, fail over, end the call on every path.
   * Resolves with `fn`'s result — its `usage` (OpenAI / Anthropic) or `permit.tokens`
   * settles the quota — or rejects with the call's final error (its `cause` is the
   * last error `fn` threw). A tenant's refusal ({@link TenantLimitExceededError},
   * `opts.tenant`) rejects at once: no other attempt, no other source.
   */
  run<T>(scope: string, fn: (permit: Permit) => Promise<T> | T): Promise<T>;
  run<T>(scope: string, opts: RunOptions, fn: (permit: Permit) => Promise<T> | T): Promise<T>;
  async run<T>(scope: string, a: RunOptions | ((permit: Permit) => Promise<T> | T),
    b?: (permit: Permit) => Promise<T> | T): Promise<T> {
    const opts: RunOptions = typeof a === "function" ? {} : a;
    const fn = typeof a === "function" ? a : b;
    if (typeof fn !== "function") throw new TypeError("run(scope, [opts], fn): fn must be a function");
    const signal = opts.signal;
    const call = await this.call(scope, opts);
    let last: unknown;
    let failed = false;
    try {
      for (;;) {
        let permit: Permit;
        try {
          permit = await call.acquire({ signal });
        } catch (e) {
          if (failed && e instanceof GatewayUnavailableError && e.cause === undefined) {
            Object.defineProperty(e, "cause", { value: last, configurable: true, writable: true });
          }
          throw e;
        }
        let result: T;
        try {
          result = await fn(permit);
        } catch (err) {
          last = err;
          failed = true;
          if (signal?.aborted) {
            if (!permit.reported) await permit.cancel();
            throw err;
          }
          const v = verdict(err, permit, opts.classify);
          if (permit.limits === null) permit.limits = limitsOf(err); // §18: an SDK error carries its response's headers
          if (permit.reported) {
            // fn reported the attempt itself; its report stands
          } else if (v.kind === "rate_limited") {
            await permit.rateLimited({ retryAfterS: v.retryAfterS ?? null });
          } else {
            await permit.failure(v.kind, permitUsage(permit) ?? {});
          }
          if (v.rethrow) throw err;
          continue;
        }
        if (permit.limits === null) permit.limits = limitsOf(result); // §18: a raw response's headers
        if (!permit.reported) {
          const own = permitUsage(permit);
          const cached = own !== undefined || permit.cachedInputTokens !== undefined
            ? permit.cachedInputTokens : cachedInputTokensOf(result);
          await permit.success({ ...(own ?? usageOf(result) ?? {}), cachedInputTokens: cached ?? null });
        }
        return result;
      }
    } finally {
      await call.end();
    }
  }

  /** The live state of every scope and source (scopes and sources keyed by name). */
  async status(): Promise<Status> {
    const reply = await this.request((id) => encodeUnit(id, REQUEST_TAGS.StatusJson));
    const text = expectReply(reply, "StatusJson") as string;
    return statusFromJson(parseJson(text));
  }

  /**
   * One tenant's ledger (DESIGN §19): `{tenant, scopes: {NAME: {...}}}` — per scope
   * with tenants (only `opts.scope` when given), its limits, bucket levels, spend in the
   * current day and month, calls in flight and waiting, as the sidecar sends it
   * (`TenantStatus`; `""` is the anonymous tenant). Needs a sidecar that speaks protocol 3.
   */
  async tenantStatus(tenant: string, opts: TenantStatusOptions = {}): Promise<Record<string, unknown>> {
    checkTenant(tenant);
    const scope = opts.scope ?? null;
    if (scope !== null && (typeof scope !== "string" || scope === "")) {
      throw new TypeError(`scope must be a non-empty string, got ${String(scope)}`);
    }
    const conn = await this._connection();
    const version = conn.welcome?.protocol_version ?? FALLBACK_VERSION;
    if (version < TENANT_VERSION) throw tenantsUnsupported(`tenantStatus("${tenant}")`, version, scope);
    const reply = await conn.request((id) => encodeTenantStatus(id, scope, tenant)).promise;
    const doc = parseJson(expectReply(reply, "StatusJson") as string);
    if (typeof doc !== "object" || doc === null || Array.isArray(doc)) {
      throw new SidecarError("the sidecar's tenant status is not a JSON object", "protocol");
    }
    return doc as Record<string, unknown>;
  }

  /** Admin: open `source`'s breaker for `seconds` (needs a uid in `admin_uids`). */
  async forceOpen(source: string, seconds = 30): Promise<void> {
    checkSource(source);
    if (typeof seconds !== "number" || !Number.isFinite(seconds) || seconds <= 0) {
      throw new RangeError(`seconds must be a finite number > 0, got ${String(seconds)}`);
    }
    expectReply(await this.request((id) => encodeForceOpen(id, source, seconds)), "Ok");
  }

  /** Admin: close `source`'s breaker now, on every host sharing the backend. */
  async forceClose(source: string): Promise<void> {
    checkSource(source);
    expectReply(await this.request((id) => encodeSource(id, REQUEST_TAGS.ForceClose, source)), "Ok");
  }

  /** Admin: forget all breaker and quota state of `source`. */
  async reset(source: string): Promise<void> {
    checkSource(source);
    expectReply(await this.request((id) => encodeSource(id, REQUEST_TAGS.Reset, source)), "Ok");
  }

  /** One round trip; resolves with its duration in milliseconds. */
  async ping(): Promise<number> {
    const conn = await this._connection();
    const t0 = performance.now();
    expectReply(await conn.request((id) => encodeUnit(id, REQUEST_TAGS.Ping)).promise, "Pong");
    return performance.now() - t0;
  }

  /** Close the connection: the sidecar releases everything it held. The client cannot be reused. */
  async close(): Promise<void> {
    this.closedByUser = true;
    const c = this.conn;
    this.conn = null;
    if (c !== null) await c.close();
  }
}

function checkSource(source: unknown): void {
  if (typeof source !== "string" || source === "") throw new TypeError(`source must be a non-empty string, got ${String(source)}`);
}

function permitUsage(p: Permit): Usage | undefined {
  if (p.tokens === undefined && p.inputTokens === undefined && p.outputTokens === undefined) return undefined;
  const u: Usage = {};
  if (p.tokens !== undefined) u.tokens = p.tokens;
  if (p.inputTokens !== undefined) u.inputTokens = p.inputTokens;
  if (p.outputTokens !== undefined) u.outputTokens = p.outputTokens;
  return u;
}

function verdict(err: unknown, permit: Permit, classify: RunOptions["classify"]): Verdict {
  if (classify !== undefined) {
    const v = classify(err, permit);
    if (typeof v === "string") return { kind: v };
    if (v !== null && v !== undefined) return v;
  }
  return classifyError(err);
}

function statusFromJson(doc: unknown): Status {
  const d = doc as Record<string, unknown> & { scopes?: unknown };
  if (typeof d !== "object" || d === null || !Array.isArray(d.scopes)) {
    throw new SidecarError("the sidecar's status is not a JSON object with a scopes list", "protocol");
  }
  const scopes: Record<string, ScopeStatus> = {};
  for (const sc of d.scopes as Record<string, unknown>[]) {
    const { name, sources, ...rest } = sc;
    const srcs: Record<string, SourceStatus> = {};
    for (const s of (sources ?? []) as Record<string, unknown>[]) {
      const { name: n, ...r } = s;
      srcs[String(n)] = r as SourceStatus;
    }
    scopes[String(name)] = { ...rest, sources: srcs } as unknown as ScopeStatus;
  }
  return { ...d, scopes } as unknown as Status;
}

/** Connect to the sidecar: `path`, else `$POLYGATE_SOCKET`, else {@link defaultSocket} for this uid. */
export async function connect(path?: string | null, opts: ConnectOptions = {}): Promise<Client> {
  const p = resolvePath(path);
  const o = { ...opts, autostart: autostartWanted(opts.autostart) }; // every reconnect does the same
  return new Client(p, await dial(p, o), o);
}
