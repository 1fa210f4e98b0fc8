// Test helpers: the real `polygate-sidecar` binary and throwaway `redis-server`s,
// the same way tests/polygate_e2e.py starts them (bindings/conformance/README.md).

import { ChildProcess, spawn, spawnSync } from "node:child_process";
import * as fs from "node:fs";
import * as net from "node:net";
import * as os from "node:os";
import * as path from "node:path";
import { randomBytes } from "node:crypto";
import { fileURLToPath } from "node:url";

import { Client, connect } from "../src/index.js";

/** The repository root (this file is bindings/node/build/test/support.js once compiled). */
export const REPO = path.resolve(path.dirname(fileURLToPath(import.meta.url)), "..", "..", "..", "..");

const children = new Set<ChildProcess>();
process.on("exit", () => {
  for (const c of children) c.kill("SIGKILL");
});

export const sleep = (ms: number): Promise<void> => new Promise((r) => setTimeout(r, ms));

/** `$POLYGATE_SIDECAR_BIN`, else `<repo>/target/debug/polygate-sidecar`; throws naming the fix. */
export function sidecarBin(): string {
  const p = process.env.POLYGATE_SIDECAR_BIN || path.join(REPO, "target", "debug", "polygate-sidecar");
  try {
    fs.accessSync(p, fs.constants.X_OK);
  } catch {
    throw new Error(`polygate-sidecar binary not found at ${p}: build it with \`cargo build -p polygate-sidecar\` or set POLYGATE_SIDECAR_BIN`);
  }
  return p;
}

export function tempDir(prefix = "pg-node-"): string {
  return fs.mkdtempSync(path.join(os.tmpdir(), prefix)); // short: AF_UNIX paths are ≤ 108 bytes
}

function canConnect(sock: string): Promise<boolean> {
  return new Promise((resolve) => {
    const s = net.createConnection(sock);
    s.once("connect", () => {
      s.destroy();
      resolve(true);
    });
    s.once("error", () => resolve(false));
  });
}

/** One daemon with its config, socket and log in a temp dir. */
export class Sidecar {
  readonly dir: string;
  readonly socket: string;
  readonly configPath: string;
  readonly logPath: string;
  proc: ChildProcess | null = null;

  constructor(dir = tempDir()) {
    this.dir = dir;
    this.socket = path.join(dir, "s.sock");
    this.configPath = path.join(dir, "polygate.toml");
    this.logPath = path.join(dir, "sidecar.log");
  }

  /** Write `text` with the runner's `[sidecar]` keys merged in (README: runners own them). */
  writeConfig(text: string, own: Record<string, string> = {}): void {
    const keys: Record<string, string> = {
      socket: JSON.stringify(this.socket),
      admin_uids: `[${process.getuid!()}]`,
      ...(text.includes("shutdown_grace") ? {} : { shutdown_grace: '"1s"' }),
      backend: '"memory"',
      ...own,
    };
    for (const k of ["socket", "admin_uids", "backend", "redis_url", "key_prefix", "redis_timeout"]) {
      if (new RegExp(`^\\s*${k}\\s*=`, "m").test(text)) throw new Error(`the config sets ${k}, which the runner owns`);
    }
    const body = Object.entries(keys).map(([k, v]) => `${k} = ${v}\n`).join("");
    const lines = text.split(/(?<=\n)/);
    const i = lines.findIndex((l) => l.trim() === "[sidecar]");
    const out = i >= 0
      ? lines.slice(0, i + 1).join("") + body + lines.slice(i + 1).join("")
      : `[sidecar]\n${body}\n${text}`;
    fs.writeFileSync(this.configPath, out);
  }

  async start(env: Record<string, string> = {}, timeoutMs = 10_000): Promise<this> {
    const log = fs.openSync(this.logPath, "a");
    const fullEnv: NodeJS.ProcessEnv = { ...process.env, RUST_LOG: process.env.RUST_LOG ?? "info", ...env };
    delete fullEnv.POLYGATE_SOCKET;
    const proc = spawn(sidecarBin(), ["--config", this.configPath], { stdio: ["ignore", log, log], env: fullEnv });
    fs.closeSync(log);
    this.proc = proc;
    children.add(proc);
    proc.once("exit", () => children.delete(proc));
    const deadline = Date.now() + timeoutMs;
    for (;;) {
      if (proc.exitCode !== null || proc.signalCode !== null) {
        throw new Error(`polygate-sidecar exited (${proc.exitCode ?? proc.signalCode}) during startup:\n${this.log()}`);
      }
      if (fs.existsSync(this.socket) && (await canConnect(this.socket))) return this;
      if (Date.now() > deadline) throw new Error(`polygate-sidecar did not accept on ${this.socket} within ${timeoutMs} ms:\n${this.log()}`);
      await sleep(10);
    }
  }

  log(): string {
    try {
      return fs.readFileSync(this.logPath, "utf8").slice(-6000);
    } catch {
      return "";
    }
  }

  /** SIGTERM, then SIGKILL after 5 s. */
  async stop(): Promise<void> {
    const p = this.proc;
    this.proc = null;
    if (p === null || p.exitCode !== null || p.signalCode !== null) return;
    const exited = new Promise<void>((r) => p.once("exit", () => r()));
    p.kill("SIGTERM");
    const t = setTimeout(() => p.kill("SIGKILL"), 5000);
    await exited;
    clearTimeout(t);
  }

  cleanup(): void {
    fs.rmSync(this.dir, { recursive: true, force: true });
  }
}

function freePort(): Promise<number> {
  return new Promise((resolve, reject) => {
    const s = net.createServer();
    s.once("error", reject);
    s.listen(0, "127.0.0.1", () => {
      const port = (s.address() as net.AddressInfo).port;
      s.close(() => resolve(port));
    });
  });
}

/** Whether Redis cases must fail (CI=true) rather than skip when redis-server cannot start. */
export const CI = process.env.CI === "true";

/** A throwaway redis-server on a free port; `start()` resolves null with the reason it could not start. */
export class RedisServer {
  port = 0;
  proc: ChildProcess | null = null;
  readonly dir = tempDir("pg-redis-");

  get url(): string {
    return `redis://127.0.0.1:${this.port}/0`;
  }

  private ping(): Promise<boolean> {
    return new Promise((resolve) => {
      const s = net.createConnection(this.port, "127.0.0.1");
      let got = "";
      s.setTimeout(300, () => {
        s.destroy();
        resolve(false);
      });
      s.once("connect", () => s.write("PING\r\n"));
      s.on("data", (d) => {
        got += d.toString();
        if (got.includes("\r\n")) {
          s.destroy();
          resolve(got.startsWith("+PONG"));
        }
      });
      s.once("error", () => resolve(false));
    });
  }

  async start(): Promise<string | null> {
    const bin = process.env.REDIS_SERVER || "redis-server";
    if (spawnSync("sh", ["-c", `command -v ${bin}`]).status !== 0 && !fs.existsSync(bin)) return `${bin} not found on PATH`;
    this.port = await freePort();
    const proc = spawn(bin, ["--port", String(this.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
      "--dir", this.dir, "--protected-mode", "no", "--daemonize", "no"], { stdio: "ignore" });
    this.proc = proc;
    children.add(proc);
    proc.once("exit", () => children.delete(proc));
    const deadline = Date.now() + 5000;
    while (Date.now() < deadline) {
      if (await this.ping()) return null;
      if (proc.exitCode !== null) return `redis-server exited with ${proc.exitCode}`;
      await sleep(10);
    }
    return `redis-server on port ${this.port} not answering PING after 5 s`;
  }

  async kill(): Promise<void> {
    const p = this.proc;
    this.proc = null;
    if (p !== null && p.exitCode === null && p.signalCode === null) {
      const exited = new Promise<void>((r) => p.once("exit", () => r()));
      p.kill("SIGKILL");
      await exited;
    }
    fs.rmSync(this.dir, { recursive: true, force: true });
  }
}

/**
 * A Redis for a test: started, or — when it cannot start — a failure under CI=true,
 * otherwise a loud skip through `skip`.
 */
export async function redisOrSkip(skip: (why: string) => void): Promise<RedisServer | null> {
  const r = new RedisServer();
  const why = await r.start();
  if (why === null) return r;
  await r.kill();
  if (CI) throw new Error(`redis-server unavailable under CI=true: ${why}`);
  process.stderr.write(`\n${"#".repeat(60)}\n## WARNING: redis-server unavailable, SKIPPING: ${why}\n${"#".repeat(60)}\n`);
  skip(`WARNING: redis-server unavailable, SKIPPING (set CI=true to fail instead): ${why}`);
  return null;
}

/** JSON.stringify that prints bigints. */
export function show(v: unknown): string {
  return JSON.stringify(v, (_k, x) => (typeof x === "bigint" ? `${x}n` : x));
}

/**
 * Run `body` against a fresh daemon on `config` and `backend` (`redis`: a throwaway
 * redis-server, a unique key prefix, `redis_timeout` as given), cleaning up on every
 * path; a failure gets the daemon's log appended.
 */
export async function withDaemon(
  config: string, backend: string, skip: (why: string) => void,
  body: (client: Client, sidecar: Sidecar) => Promise<void>, redisTimeout = "2s",
): Promise<void> {
  let redis: RedisServer | null = null;
  const own: Record<string, string> = {};
  if (backend === "redis") {
    redis = await redisOrSkip(skip);
    if (redis === null) return;
    own.backend = '"redis"';
    own.redis_url = JSON.stringify(redis.url);
    own.key_prefix = JSON.stringify(`pg-node-${randomBytes(6).toString("hex")}`);
    own.redis_timeout = JSON.stringify(redisTimeout); // a loaded machine must not degrade a source mid-test
  }
  const sidecar = new Sidecar();
  let client: Client | null = null;
  try {
    sidecar.writeConfig(config, own);
    await sidecar.start();
    client = await connect(sidecar.socket);
    await body(client, sidecar);
  } catch (e) {
    if (e instanceof Error) e.message += `\n----- sidecar log -----\n${sidecar.log()}`;
    throw e;
  } finally {
    await client?.close();
    await sidecar.stop();
    sidecar.cleanup();
    await redis?.kill();
  }
}
