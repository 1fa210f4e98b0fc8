/**
 * Autostart (DESIGN §20): start a sidecar for this socket when none answers.
 *
 * Opt-in (`connect(path, { autostart: true })` or `POLYGATE_AUTOSTART=1`). Node.js
 * has no `flock`, so the sidecar takes the lock file `SOCKET.lock` itself: the client
 * starts {@link sidecarPath} detached (its own session, so it outlives this process)
 * as `polygate-sidecar --autostarted` on the embedded default configuration (or
 * `$POLYGATE_CONFIG`), bound to this socket (`SIDECAR__SOCKET`). A sidecar that finds
 * the lock held (another client is starting one, or one is serving) exits 75, and
 * the client keeps connecting; while /proc/locks shows the lock held, the client
 * starts nothing and waits for the socket. A client connected with autostart runs
 * this again at any reconnect that finds no sidecar (`dial` in client.ts). The sidecar's stderr goes to `SOCKET.log`; if it dies
 * before listening, the caller gets a {@link SidecarError} with its first lines and
 * the log path.
 */

import { spawn } from "node:child_process";
import * as fs from "node:fs";
import * as net from "node:net";
import * as os from "node:os";
import * as path from "node:path";

import { SidecarError } from "./errors.js";

/** `POLYGATE_AUTOSTART`: `1`/`true`/`yes`/`on` turns autostart on for every connect. */
export const AUTOSTART_ENV = "POLYGATE_AUTOSTART";
/** `POLYGATE_SIDECAR`: the sidecar binary, overriding the packaged one. */
export const SIDECAR_ENV = "POLYGATE_SIDECAR";
/** `POLYGATE_CONFIG`: the configuration file an autostarted sidecar reads. */
export const CONFIG_ENV = "POLYGATE_CONFIG";
/** The sidecar's exit status when another process holds the lock (`EX_TEMPFAIL`). */
const EXIT_BUSY = 75;
const POLL_MS = 10;
const ERROR_LINES = 12;
/**
 * The caller's service-manager variables: an autostarted sidecar must not send
 * READY=1 / STOPPING=1 to the caller's NOTIFY_SOCKET, nor take its sockets.
 */
const CHILD_ENV_DROPPED = ["NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID", "LISTEN_FDS", "LISTEN_PID", "LISTEN_FDNAMES"];

/** The sidecar's environment: this process's without {@link CHILD_ENV_DROPPED}, bound to `sock`. */
function childEnv(sock: string): NodeJS.ProcessEnv {
  const env: NodeJS.ProcessEnv = { ...process.env, SIDECAR__SOCKET: sock };
  for (const k of CHILD_ENV_DROPPED) delete env[k];
  return env;
}

/** `opt` as given, else `$POLYGATE_AUTOSTART`. */
export function autostartWanted(opt: boolean | undefined): boolean {
  if (opt !== undefined) return opt;
  return ["1", "true", "yes", "on"].includes((process.env[AUTOSTART_ENV] ?? "").trim().toLowerCase());
}

/** The npm platform package carrying the binary for this platform. */
export function platformPackage(): string {
  return `@polygate/sidecar-${process.platform}-${process.arch}-gnu`;
}

/**
 * The `polygate-sidecar` binary: `$POLYGATE_SIDECAR`, else the one in the platform
 * package ({@link platformPackage}, an optional dependency of `polygate`), else the
 * first on PATH. Rejects with a {@link SidecarError} when there is none.
 */
export async function sidecarPath(): Promise<string> {
  const env = process.env[SIDECAR_ENV];
  if (env) return env;
  try {
    // Resolved from this module's own location (ESM and CommonJS alike): the
    // platform package's main module (CommonJS) exports `binaryPath`.
    type Platform = { binaryPath?: unknown; default?: { binaryPath?: unknown } };
    const mod = (await import(platformPackage())) as Platform;
    const found = mod.binaryPath ?? mod.default?.binaryPath;
    if (typeof found === "string") return found;
  } catch {
    // not installed (another platform, or --no-optional): PATH next
  }
  for (const dir of (process.env["PATH"] ?? "").split(path.delimiter)) {
    if (!dir) continue;
    const candidate = path.join(dir, "polygate-sidecar");
    try {
      fs.accessSync(candidate, fs.constants.X_OK);
      return candidate;
    } catch {
      // next
    }
  }
  throw new SidecarError(
    `no polygate-sidecar binary: install polygate with its optional dependency ${platformPackage()}, `
      + `put polygate-sidecar on PATH, or set $${SIDECAR_ENV}`,
    "connection",
  );
}

/** Whether something listens on `p` (or the connect fails for a reason a start cannot fix). */
function answers(p: string): Promise<boolean> {
  return new Promise((resolve) => {
    const s = net.createConnection(p);
    s.once("connect", () => {
      s.destroy();
      resolve(true);
    });
    s.once("error", (e: NodeJS.ErrnoException) => {
      s.destroy();
      resolve(e.code !== "ENOENT" && e.code !== "ECONNREFUSED");
    });
  });
}

const sleep = (ms: number) => new Promise<void>((r) => setTimeout(r, ms));

/**
 * Resolve once a sidecar answers on `socketPath`, starting one if none does (see the
 * module text). `timeoutMs` bounds the whole start.
 */
export async function ensureSidecar(socketPath: string, timeoutMs: number): Promise<void> {
  if (await answers(socketPath)) return;
  const sock = path.resolve(socketPath);
  const deadline = Date.now() + timeoutMs;
  const logPath = `${sock}.log`;
  try {
    fs.mkdirSync(path.dirname(sock), { recursive: true, mode: 0o700 });
  } catch (e) {
    throw new SidecarError(`autostart: cannot create the socket directory ${path.dirname(sock)}: ${String(e)}`);
  }
  const binary = await sidecarPath();
  const lockPath = `${sock}.lock`;
  for (;;) {
    if (await answers(sock)) return;
    const held = lockHeld(lockPath);
    if (held === true) {
      // A live process holds the lock: a sidecar starting (or exiting), or another
      // client's start. Wait for the socket (or the lock's release), as Python and Go
      // do, rather than start sidecars that find it held and exit 75.
      if (Date.now() > deadline) {
        throw new SidecarError(
          `autostart: no sidecar answers on ${sock} and another process holds ${lockPath} (starting one?) past the timeout`);
      }
      await sleep(POLL_MS);
      continue;
    }
    // Nobody holds the lock: the log is this start's (as in Python and Go). Several
    // Node.js starters may write it at once (O_APPEND): read from where ours began.
    const { O_WRONLY, O_CREAT, O_APPEND, O_TRUNC } = fs.constants;
    const log = fs.openSync(logPath, O_WRONLY | O_CREAT | O_APPEND | (held === false ? O_TRUNC : 0), 0o600);
    const from = fs.fstatSync(log).size;
    const args = ["--autostarted"];
    const config = process.env[CONFIG_ENV];
    if (config) args.unshift("--config", path.resolve(config));
    let child;
    try {
      child = spawn(binary, args, {
        detached: true,
        cwd: "/",
        stdio: ["ignore", log, log],
        env: childEnv(sock),
      });
    } finally {
      fs.closeSync(log);
    }
    let exit: number | null | undefined;
    let exitText = "";
    let spawnError: Error | undefined;
    child.once("exit", (code, signal) => {
      exit = code ?? -1;
      exitText = signal !== null
        ? `was killed by signal ${os.constants.signals[signal] ?? "?"} (${signal})`
        : `exited with status ${String(code)}`;
    });
    child.once("error", (e) => {
      spawnError = e;
    });
    child.unref();
    for (;;) {
      if (spawnError) throw new SidecarError(`autostart: cannot start ${binary}: ${spawnError.message}`);
      if (await answers(sock)) return;
      if (exit === EXIT_BUSY) break; // another start holds the lock: look again
      if (exit !== undefined) {
        throw new SidecarError(
          `autostart: the sidecar ${exitText} before listening on ${sock}:\n`
            + `${firstLines(logPath, from)}\n(log: ${logPath})`,
        );
      }
      if (Date.now() > deadline) {
        child.kill("SIGKILL");
        throw new SidecarError(
          `autostart: no sidecar listened on ${sock} within ${timeoutMs} ms:\n${firstLines(logPath, from)}\n(log: ${logPath})`,
        );
      }
      await sleep(POLL_MS);
    }
    if (Date.now() > deadline) {
      throw new SidecarError(
        `autostart: no sidecar answers on ${sock} and another process holds ${lockPath} (starting one?) past the timeout`);
    }
    await sleep(5 * POLL_MS);
  }
}

/**
 * Whether a process holds an `flock` on `lockPath`, read from Linux's /proc/locks
 * (Node.js has no `flock` to try); `false` when there is no such file, `null` when
 * it cannot tell (no /proc/locks: the sidecar's own lock still decides, exit 75).
 */
function lockHeld(lockPath: string): boolean | null {
  let st: fs.BigIntStats;
  try {
    st = fs.statSync(lockPath, { bigint: true });
  } catch {
    return false;
  }
  let locks: string;
  try {
    locks = fs.readFileSync("/proc/locks", "utf8");
  } catch {
    return null;
  }
  // st_dev as glibc encodes it; /proc/locks prints MAJOR:MINOR:INODE, in hex, hex, decimal.
  const major = ((st.dev >> 8n) & 0xfffn) | ((st.dev >> 32n) & ~0xfffn);
  const minor = (st.dev & 0xffn) | ((st.dev >> 12n) & ~0xffn);
  const want = `${major.toString(16).padStart(2, "0")}:${minor.toString(16).padStart(2, "0")}:${st.ino}`;
  for (const line of locks.split("\n")) {
    // "1: FLOCK  ADVISORY  WRITE 4352 fe:00:9986476 0 EOF" ("1: -> FLOCK ..." is a waiter)
    const f = line.trim().split(/\s+/);
    if (f[1] === "FLOCK" && f[5] === want) return true;
  }
  return false;
}

function firstLines(logPath: string, from: number): string {
  try {
    const fd = fs.openSync(logPath, "r");
    try {
      const buf = Buffer.alloc(16384);
      const n = fs.readSync(fd, buf, 0, buf.length, from);
      const lines = buf.subarray(0, n).toString("utf8").split("\n").filter((l) => l.trim() !== "");
      return lines.length > 0 ? lines.slice(0, ERROR_LINES).join("\n") : "(it wrote nothing)";
    } finally {
      fs.closeSync(fd);
    }
  } catch (e) {
    return `(cannot read the log: ${String(e)})`;
  }
}
