// A fake provider for the transport tests (DESIGN §17, bindings/conformance/transport):
// a node:http server on 127.0.0.1 answering from a queue of canned responses
// (JSON or SSE, with a delay), recording every request it receives.

import * as http from "node:http";
import type { AddressInfo } from "node:net";

/** One canned answer. */
export interface Canned {
  status?: number;
  headers?: Record<string, string>;
  /** A JSON body. */
  json?: unknown;
  /** SSE events: each item is sent as `<item>\n\n` (content-type text/event-stream). */
  sse?: string[];
  /** A body sent as UTF-8 (content-type text/plain unless `headers` says otherwise). */
  body?: string;
  /** Seconds before the response starts. */
  delayS?: number;
  /** Milliseconds between SSE events. */
  gapMs?: number;
  /** SSE: awaited before the last event is sent (a stream held open by the test). */
  holdLast?: Promise<void>;
}

/** A request the upstream received. */
export interface Hit {
  method: string;
  url: string;
  headers: http.IncomingHttpHeaders;
  body: string;
  /** The body's bytes as received. */
  raw: Buffer;
}

const sleep = (ms: number): Promise<void> => new Promise((r) => setTimeout(r, ms));

export class FakeUpstream {
  readonly hits: Hit[] = [];
  /** Bytes of each answer's body as sent (for byte-for-byte checks). */
  readonly sent: Buffer[] = [];
  private readonly queue: Canned[] = [];
  private readonly open = new Set<http.ServerResponse>();

  private constructor(private readonly server: http.Server, readonly port: number) {}

  static async start(): Promise<FakeUpstream> {
    const server = http.createServer();
    await new Promise<void>((r) => server.listen(0, "127.0.0.1", () => r()));
    const up = new FakeUpstream(server, (server.address() as AddressInfo).port);
    server.on("request", (req, res) => void up.serve(req, res));
    return up;
  }

  get url(): string {
    return `http://127.0.0.1:${this.port}`;
  }

  /** Queue `c` for the next `times` requests. */
  respond(c: Canned, times = 1): void {
    for (let i = 0; i < times; i++) this.queue.push(c);
  }

  private async serve(req: http.IncomingMessage, res: http.ServerResponse): Promise<void> {
    const chunks: Buffer[] = [];
    for await (const c of req) chunks.push(c as Buffer);
    const raw = Buffer.concat(chunks);
    this.hits.push({ method: req.method ?? "", url: req.url ?? "", headers: req.headers, body: raw.toString("utf8"), raw });
    const c = this.queue.shift() ?? { status: 200, json: { ok: true } };
    this.open.add(res);
    res.once("close", () => this.open.delete(res));
    if (c.delayS) await sleep(c.delayS * 1000);
    const headers: Record<string, string> = {};
    for (const [k, v] of Object.entries(c.headers ?? {})) headers[k.toLowerCase()] = v;
    if (c.sse !== undefined) {
      res.writeHead(c.status ?? 200, { "content-type": "text/event-stream", ...headers });
      const all: Buffer[] = [];
      for (const [i, ev] of c.sse.entries()) {
        if (res.destroyed) return;
        if (i === c.sse.length - 1 && c.holdLast !== undefined) await c.holdLast;
        if (i > 0 && c.gapMs) await sleep(c.gapMs);
        const b = Buffer.from(`${ev}\n\n`);
        all.push(b);
        res.write(b);
      }
      this.sent.push(Buffer.concat(all));
      res.end();
      return;
    }
    const body = Buffer.from(c.body ?? JSON.stringify(c.json ?? { ok: true }));
    this.sent.push(body);
    res.writeHead(c.status ?? 200, { "content-type": c.body !== undefined ? "text/plain" : "application/json", ...headers });
    res.end(body);
  }

  async close(): Promise<void> {
    for (const r of this.open) r.destroy();
    this.server.closeAllConnections();
    await new Promise<void>((r) => this.server.close(() => r()));
  }
}
