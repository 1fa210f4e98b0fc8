// A small fake sidecar speaking the real wire format (generic codec), scriptable per
// test: it records every frame and every read, and answers through `handle`.

import * as fs from "node:fs";
import * as net from "node:net";
import * as path from "node:path";

import { decodeClientFrame, encodeServerFrame } from "../src/codec.js";
import { tempDir } from "./support.js";

export type Value = unknown;
export interface Req {
  id: bigint;
  request: Value;
}

/** The variant name and body of an externally tagged value. */
export function variant(v: Value): [string, Record<string, unknown>] {
  if (typeof v === "string") return [v, {}];
  const [k] = Object.keys(v as object);
  return [k!, (v as Record<string, Record<string, unknown>>)[k!]!];
}

export function errorReply(kind: string, message = kind, extra: Record<string, unknown> = {}): Value {
  return { Error: { kind, message, retry_after_s: 0, per_source_reasons: [], exhausted: null, scope: null, ...extra } };
}

export class FakeConn {
  /** Every request received after the handshake, in order. */
  readonly requests: Req[] = [];
  /** How many `data` events (reads) carried requests. */
  reads = 0;
  hello: Record<string, unknown> | null = null;
  /** The protocol version its Hello said (after a Welcome). */
  version = 0;
  /** Every request frame received after the handshake, as bytes (length prefix included). */
  readonly rawFrames: Buffer[] = [];
  private buf = Buffer.alloc(0);

  constructor(readonly fake: FakeSidecar, readonly sock: net.Socket) {
    sock.on("data", (d) => this.onData(d));
    sock.on("error", () => {});
  }

  private onData(d: Buffer): void {
    this.buf = Buffer.concat([this.buf, d]);
    let counted = false;
    while (this.buf.length >= 4) {
      const n = this.buf.readUInt32BE(0);
      if (this.buf.length < 4 + n) break;
      const bytes = Buffer.from(this.buf.subarray(0, 4 + n));
      const frame = decodeClientFrame(bytes);
      this.buf = this.buf.subarray(4 + n);
      const [name, body] = variant(frame.request);
      if (name === "Hello") {
        this.hello = body;
        this.fake.onHello(this, frame);
        continue;
      }
      if (!counted) {
        this.reads++;
        counted = true;
      }
      this.requests.push(frame);
      this.rawFrames.push(bytes);
      this.fake.handle(frame, this);
    }
  }

  send(id: bigint | number, reply: Value): void {
    if (!this.sock.destroyed) this.sock.write(encodeServerFrame({ id: BigInt(id), reply }));
  }

  /** Several replies in one write. */
  sendAll(replies: [bigint | number, Value][]): void {
    if (!this.sock.destroyed) this.sock.write(Buffer.concat(replies.map(([id, r]) => encodeServerFrame({ id: BigInt(id), reply: r }))));
  }

  raw(bytes: Buffer): void {
    this.sock.write(bytes);
  }

  close(): void {
    this.sock.destroy();
  }

  /** Requests of one variant. */
  named(name: string): Record<string, unknown>[] {
    return this.requests.filter((r) => variant(r.request)[0] === name).map((r) => ({ id: r.id, ...variant(r.request)[1] }));
  }

  names(): string[] {
    return this.requests.map((r) => variant(r.request)[0]);
  }
}

/**
 * Default behaviour: a two-source scope "chat" granting "a" then "b" …; Start →
 * Started, Retry/Acquire → Granted, Finish/Report → Reported, EndCall/Cancel → Ok,
 * StatusJson → a document. Tests override `handle` (call `auto` for the rest).
 */
export class FakeSidecar {
  readonly dir = tempDir("pg-fake-");
  readonly socket = path.join(this.dir, "fake.sock");
  readonly conns: FakeConn[] = [];
  readonly server: net.Server;
  /** The server's own sockets (to tell client writes from server writes). */
  readonly serverSockets = new Set<net.Socket>();
  /** The highest version it speaks: a Hello above it is refused as a version-2 sidecar does. */
  protocolVersion = 3;
  /** The Welcome sent; `null`: one with the Hello's version. */
  welcome: Value | null = null;
  /** Tenant of each call begun by StartTenant / BeginTenant. */
  readonly tenants = new Map<bigint, string>();
  handle: (req: Req, conn: FakeConn) => void = (req, conn) => this.auto(req, conn);
  sources = ["a", "b", "c"];
  private nextCall = 100n;
  private nextPermit = 1000n;
  private attempts = new Map<bigint, number>();
  private permitCall = new Map<bigint, bigint>();
  private connected: ((c: FakeConn) => void)[] = [];

  private constructor() {
    this.server = net.createServer((sock) => {
      this.serverSockets.add(sock);
      const c = new FakeConn(this, sock);
      this.conns.push(c);
      for (const f of this.connected.splice(0)) f(c);
    });
  }

  static async start(): Promise<FakeSidecar> {
    const f = new FakeSidecar();
    await new Promise<void>((r) => f.server.listen(f.socket, r));
    return f;
  }

  onHello(conn: FakeConn, frame: Req): void {
    const v = Number(conn.hello!.protocol_version);
    if (v > this.protocolVersion) {
      // what an older sidecar says, before it closes the connection
      const speaks = this.protocolVersion === 1 ? "version 1" : `versions 1 to ${this.protocolVersion}`;
      conn.send(frame.id, errorReply("ProtocolViolation", `protocol version mismatch: client `
        + `${JSON.stringify(conn.hello!.client_name)} speaks version ${v}, this sidecar speaks ${speaks}`));
      conn.sock.end();
      return;
    }
    conn.version = v;
    conn.send(frame.id, this.welcome ?? { Welcome: { protocol_version: v, sidecar_version: "0.2.0-fake", max_frame: 65536 } });
  }

  /** The n-th connection (0-based), once it exists. */
  conn(n = 0): Promise<FakeConn> {
    if (this.conns[n] !== undefined) return Promise.resolve(this.conns[n]!);
    return new Promise((r) => this.connected.push(() => {
      if (this.conns[n] !== undefined) r(this.conns[n]!);
    }));
  }

  grant(call: bigint): Record<string, unknown> {
    const attempt = (this.attempts.get(call) ?? 0) + 1;
    this.attempts.set(call, attempt);
    const permit = this.nextPermit++;
    this.permitCall.set(permit, call);
    return { permit, source: this.sources[(attempt - 1) % this.sources.length], is_probe: false, attempt, est_tokens: 100n };
  }

  auto(req: Req, conn: FakeConn): void {
    const [variantName, body] = variant(req.request);
    const name = variantName.replace(/Observed$/, ""); // §18: answered like the plain report
    const outcome = body.outcome;
    if (conn.version < 3 && (["StartTenant", "BeginTenant", "TenantStatus"].includes(name)
      || (outcome !== undefined && variant(outcome)[0] === "SuccessCached"))) {
      // like the sidecar: a version-3 message on an older connection
      return conn.send(req.id, errorReply("InvalidArgument", `${name} needs protocol version 3`));
    }
    switch (name) {
      case "StartTenant": {
        const call = this.nextCall++;
        this.tenants.set(call, body.tenant as string);
        conn.send(req.id, { Started: { call, ...this.grant(call) } });
        break;
      }
      case "BeginTenant": {
        const call = this.nextCall++;
        this.tenants.set(call, body.tenant as string);
        conn.send(req.id, { CallBegun: { call } });
        break;
      }
      case "TenantStatus": {
        const scopes: Record<string, unknown> = {};
        for (const sc of body.scope === null ? ["chat", "embed"] : [body.scope as string]) {
          scopes[sc] = { limits: { tpm: 1000 }, in_flight: 0, waiting: 0, spend_usd: { day: 0.25 } };
        }
        conn.send(req.id, { StatusJson: JSON.stringify({ tenant: body.tenant, scopes }) });
        break;
      }
      case "Start": {
        const call = this.nextCall++;
        conn.send(req.id, { Started: { call, ...this.grant(call) } });
        break;
      }
      case "Begin":
      case "BeginCall":
        conn.send(req.id, { CallBegun: { call: this.nextCall++ } });
        break;
      case "Retry": {
        const call = this.permitCall.get(body.permit as bigint);
        if (call === undefined) return conn.send(req.id, errorReply("UnknownPermit", `no permit ${body.permit}`));
        conn.send(req.id, { Granted: this.grant(call) });
        break;
      }
      case "Acquire":
        conn.send(req.id, { Granted: this.grant(body.call as bigint) });
        break;
      case "Finish":
      case "Report":
        conn.send(req.id, { Reported: { applied: true, state: "Closed", retry_after_s: 0 } });
        break;
      case "EndCall":
      case "Cancel":
      case "ForceOpen":
      case "ForceClose":
      case "Reset":
        conn.send(req.id, "Ok");
        break;
      case "Ping":
        conn.send(req.id, "Pong");
        break;
      case "StatusJson":
        conn.send(req.id, { StatusJson: JSON.stringify({ sidecar_version: "0.2.0-fake", backend: "memory", protocol_version: 2, scopes: [] }) });
        break;
      default:
        conn.send(req.id, errorReply("Internal", `fake cannot ${name}`));
    }
  }

  async stop(): Promise<void> {
    for (const c of this.conns) c.close();
    await new Promise<void>((r) => this.server.close(() => r()));
    fs.rmSync(this.dir, { recursive: true, force: true });
  }
}

/** Wait until `pred()` holds (polling), or fail after `ms`. */
export async function until(pred: () => boolean, ms = 3000, what = "condition"): Promise<void> {
  const deadline = Date.now() + ms;
  while (!pred()) {
    if (Date.now() > deadline) throw new Error(`timed out waiting for ${what}`);
    await new Promise((r) => setTimeout(r, 5));
  }
}
