// Autostart (DESIGN §20) against the real daemon: off unless asked for; on, it starts
// one sidecar that several concurrent connects share (the sidecar's own lock sends the
// extra starts away with status 75); a bad config's message reaches the caller; SIGTERM
// (like idle_exit) removes socket and lock.

import * as assert from "node:assert/strict";
import { spawn } from "node:child_process";
import * as fs from "node:fs";
import * as net from "node:net";
import * as path from "node:path";
import { afterEach, describe, test } from "node:test";

import { SidecarError, connect, sidecarPath } from "../src/index.js";
import { sidecarBin, sleep, tempDir } from "./support.js";

/** Live autostarted sidecars whose socket is under `dir`. */
function sidecarsIn(dir: string): number[] {
  const pids: number[] = [];
  for (const e of fs.readdirSync("/proc")) {
    if (!/^\d+$/.test(e)) continue;
    try {
      const cmd = fs.readFileSync(`/proc/${e}/cmdline`, "utf8");
      const env = fs.readFileSync(`/proc/${e}/environ`, "utf8").split("\0");
      const state = fs.readFileSync(`/proc/${e}/stat`, "utf8").split(") ")[1]?.[0];
      if (state !== "Z" && cmd.includes("--autostarted") && env.some((v) => v.startsWith(`SIDECAR__SOCKET=${dir}`))) {
        pids.push(Number(e));
      }
    } catch {
      // gone meanwhile
    }
  }
  return pids;
}

const saved = { ...process.env };
const dirs: string[] = [];
afterEach(() => {
  for (const d of dirs.splice(0)) for (const pid of sidecarsIn(d)) process.kill(pid, "SIGKILL");
  for (const k of Object.keys(process.env)) if (!(k in saved)) delete process.env[k];
  Object.assign(process.env, saved);
});

function setup(): { dir: string; sock: string } {
  const dir = tempDir("pg-auto-");
  dirs.push(dir);
  const bin = sidecarBin(); // before $POLYGATE_SIDECAR_BIN goes with the other POLYGATE_ variables
  for (const k of Object.keys(process.env)) if (k.includes("__") || k.startsWith("POLYGATE_")) delete process.env[k];
  process.env.POLYGATE_SIDECAR = bin;
  return { dir, sock: path.join(dir, "run", "s.sock") };
}

/** An autostarted sidecar that closes an idle connection and then exits within a second. */
function quickIdle(): void {
  process.env.SIDECAR__IDLE_TIMEOUT = "300ms";
  process.env.SIDECAR__IDLE_EXIT = "300ms";
}

async function waitFor(what: string, cond: () => boolean): Promise<void> {
  const until = Date.now() + 10_000;
  while (!cond()) {
    if (Date.now() > until) assert.fail(`timed out waiting for ${what}`);
    await sleep(20);
  }
}

/**
 * A listener on `sock` that closes the first connection that says Hello, then stops
 * listening and removes the socket: a sidecar caught by idle_exit between a connect
 * (a probe's, which says nothing, passes) and its handshake.
 */
async function goingAway(sock: string): Promise<{ done: Promise<void> }> {
  fs.mkdirSync(path.dirname(sock), { recursive: true });
  const server = net.createServer();
  const done = new Promise<void>((resolve) => {
    server.on("connection", (c) => {
      c.on("error", () => {});
      c.once("data", () => {
        c.destroy();
        server.close(() => resolve());
        fs.rmSync(sock, { force: true });
      });
    });
  });
  await new Promise<void>((r) => server.listen(sock, r));
  return { done }; // not the promise itself: an async function's result would adopt it
}

describe("autostart", { timeout: 60_000 }, () => {
  test("off by default; on, concurrent connects share one sidecar; SIGTERM removes socket and lock", async () => {
    const { dir, sock } = setup();
    await assert.rejects(connect(sock), SidecarError);
    assert.deepEqual(sidecarsIn(dir), [], "nothing started without autostart");

    const clients = await Promise.all(Array.from({ length: 8 }, () => connect(sock, { autostart: true })));
    const pids = sidecarsIn(dir);
    assert.equal(pids.length, 1, `one sidecar serves the socket: ${pids}`);
    const permit = await (await clients[0]!.call("chat", { estTokens: 10 })).acquire();
    await permit.success({ tokens: 5 });
    for (const c of clients) await c.close();
    assert.ok(fs.existsSync(`${sock}.lock`));

    process.env.POLYGATE_AUTOSTART = "1";
    const again = await connect(sock);
    await again.close();
    assert.deepEqual(sidecarsIn(dir), pids, "the running one is used, not replaced");

    process.kill(pids[0]!, "SIGTERM");
    const until = Date.now() + 10_000;
    while (sidecarsIn(dir).length > 0 && Date.now() < until) await sleep(20);
    assert.ok(!fs.existsSync(sock) && !fs.existsSync(`${sock}.lock`), "socket and lock removed");
  });

  test("a bad config gives the sidecar's own message and the log path, fast", async () => {
    const { dir, sock } = setup();
    const bad = path.join(dir, "bad.toml");
    fs.writeFileSync(bad, '[sidecar]\nmax_frame = 10\n\n[scopes.chat]\n[[scopes.chat.sources]]\nname = "a"\n');
    process.env.POLYGATE_CONFIG = bad;
    const t0 = Date.now();
    const err = await connect(sock, { autostart: true }).then(
      () => assert.fail("connected"),
      (e: unknown) => e,
    );
    assert.ok(Date.now() - t0 < 5000);
    assert.ok(err instanceof SidecarError);
    assert.match(err.message, /sidecar\.max_frame/);
    assert.ok(err.message.includes(`${sock}.log`), err.message);
  });

  test("sidecarPath: $POLYGATE_SIDECAR, else PATH, else an error naming the fixes", async () => {
    setup();
    process.env.POLYGATE_SIDECAR = "/opt/x/polygate-sidecar";
    assert.equal(await sidecarPath(), "/opt/x/polygate-sidecar");
    delete process.env.POLYGATE_SIDECAR;
    const dir = tempDir("pg-path-");
    process.env.PATH = dir;
    await assert.rejects(sidecarPath(), /POLYGATE_SIDECAR/);
    fs.writeFileSync(path.join(dir, "polygate-sidecar"), "#!/bin/sh\n", { mode: 0o755 });
    assert.equal(await sidecarPath(), path.join(dir, "polygate-sidecar"));
  });

  // A red team saw a client connected with autostart fail forever (ENOENT) once
  // idle_timeout closed its connection and idle_exit stopped the sidecar.
  test("a client with autostart starts the sidecar again after idle_exit and after a kill -9", async () => {
    const { dir, sock } = setup();
    quickIdle();
    const c = await connect(sock, { autostart: true });
    try {
      await c.status();
      const [first] = sidecarsIn(dir);
      await waitFor("idle_timeout, then idle_exit", () => sidecarsIn(dir).length === 0 && !fs.existsSync(sock));
      await c.status();
      const [second] = sidecarsIn(dir);
      assert.ok(second !== undefined && second !== first, "a new sidecar");
      process.kill(second, "SIGKILL");
      await waitFor("the killed sidecar to go", () => sidecarsIn(dir).length === 0);
      await sleep(200); // the client sees its connection close (a request already on it would fail)
      await c.status();
      assert.equal(sidecarsIn(dir).length, 1);
    } finally {
      await c.close();
    }
  });

  test("POLYGATE_AUTOSTART=1 is remembered too: two calls that find the loss together make one sidecar", async () => {
    const { dir, sock } = setup();
    quickIdle();
    process.env.POLYGATE_AUTOSTART = "1";
    const c = await connect(sock);
    try {
      await c.status();
      await waitFor("idle_exit", () => sidecarsIn(dir).length === 0 && !fs.existsSync(sock));
      await Promise.all([c.status(), c.status()]);
      assert.equal(sidecarsIn(dir).length, 1);
    } finally {
      await c.close();
    }
  });

  test("a client without autostart does not start one at reconnect", async () => {
    const { dir, sock } = setup();
    quickIdle();
    await (await connect(sock, { autostart: true })).close();
    const c = await connect(sock); // the sidecar is there: a plain connect
    try {
      await waitFor("idle_exit", () => sidecarsIn(dir).length === 0 && !fs.existsSync(sock));
      await assert.rejects(c.status(), /cannot connect/);
      assert.deepEqual(sidecarsIn(dir), []);
    } finally {
      await c.close();
    }
  });

  // idle_exit raced a new connect: the probe got into the backlog of a listener that
  // was closing, and the caller got "ECONNRESET" / "connection lost".
  test("autostart takes a connection closed by an exiting sidecar for none", async () => {
    const { dir, sock } = setup();
    quickIdle();
    const { done } = await goingAway(sock);
    const c = await connect(sock, { autostart: true, timeoutMs: 10_000 });
    try {
      await done;
      await c.status();
      assert.equal(sidecarsIn(dir).length, 1);
    } finally {
      await c.close();
    }
  });

  // It sent READY=1 / STOPPING=1 to the caller's NOTIFY_SOCKET.
  test("the autostarted sidecar does not get the caller's service-manager variables", async () => {
    const { dir, sock } = setup();
    const notify = path.join(dir, "notify");
    // Node.js has no AF_UNIX datagram socket: a python3 receiver counts what arrives.
    const recv = spawn("python3", ["-c", [
      "import socket, sys",
      "s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM); s.bind(sys.argv[1]); s.settimeout(3)",
      "print('ready', flush=True)",
      "try: print('got', s.recv(4096))",
      "except socket.timeout: print('nothing')",
    ].join("\n"), notify], { stdio: ["ignore", "pipe", "inherit"] });
    let out = "";
    recv.stdout.on("data", (b: Buffer) => { out += b.toString(); });
    const exited = new Promise<void>((r) => recv.once("exit", () => r()));
    await waitFor("the receiver", () => out.includes("ready"));
    const manager: Record<string, string> = {
      NOTIFY_SOCKET: notify, WATCHDOG_USEC: "1000000", WATCHDOG_PID: String(process.pid),
      LISTEN_FDS: "1", LISTEN_PID: String(process.pid), LISTEN_FDNAMES: "x",
    };
    Object.assign(process.env, manager);
    const c = await connect(sock, { autostart: true });
    try {
      const [pid] = sidecarsIn(dir);
      const env = fs.readFileSync(`/proc/${pid}/environ`, "utf8").split("\0");
      assert.deepEqual(env.filter((kv) => kv.split("=")[0]! in manager), [], "the caller's variables stay the caller's");
      await exited;
      assert.match(out, /nothing/, `the sidecar notified the caller's service manager: ${out}`);
      for (const [k, v] of Object.entries(manager)) assert.equal(process.env[k], v, "the caller's own environment is untouched");
    } finally {
      await c.close();
      recv.kill();
    }
  });

  // Node.js spawned sidecars in a loop while another live process held the lock (47
  // in 3 s, each exiting 75) and ended with "no sidecar listened ... (it wrote nothing)".
  test("with the lock held by another live process, no sidecar is started and the error names the lock", async () => {
    const { dir, sock } = setup();
    const wrapper = path.join(dir, "polygate-sidecar");
    fs.writeFileSync(wrapper, `#!/bin/sh\necho $$ >> ${dir}/starts\nexec ${process.env.POLYGATE_SIDECAR} "$@"\n`, { mode: 0o755 });
    process.env.POLYGATE_SIDECAR = wrapper;
    fs.mkdirSync(path.dirname(sock), { recursive: true });
    const holder = spawn("python3", ["-c", [
      "import fcntl, os, sys, time",
      "fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o600); fcntl.flock(fd, fcntl.LOCK_EX)",
      "print('locked', flush=True); time.sleep(30)",
    ].join("\n"), `${sock}.lock`], { stdio: ["ignore", "pipe", "inherit"] });
    let out = "";
    holder.stdout.on("data", (b: Buffer) => { out += b.toString(); });
    try {
      await waitFor("the lock holder", () => out.includes("locked"));
      const t0 = Date.now();
      await assert.rejects(connect(sock, { autostart: true, timeoutMs: 1500 }),
        (e: unknown) => e instanceof SidecarError && /another process holds \S+s\.sock\.lock \(starting one\?\)/.test(e.message));
      assert.ok(Date.now() - t0 < 5000);
      const started = fs.existsSync(path.join(dir, "starts")) ? fs.readFileSync(path.join(dir, "starts"), "utf8") : "";
      assert.equal(started, "", "no sidecar is started while another process holds the lock");
    } finally {
      holder.kill();
    }
  });

  test("SOCKET.log holds one start's log, not every start's", async () => {
    const { dir, sock } = setup();
    await (await connect(sock, { autostart: true })).close();
    const [pid] = sidecarsIn(dir);
    process.kill(pid!, "SIGTERM");
    await waitFor("the sidecar to exit", () => sidecarsIn(dir).length === 0 && !fs.existsSync(`${sock}.lock`));
    fs.appendFileSync(`${sock}.log`, "A LINE OF THE FIRST START\n");
    await (await connect(sock, { autostart: true })).close();
    const log = fs.readFileSync(`${sock}.log`, "utf8");
    assert.ok(!log.includes("A LINE OF THE FIRST START"), log);
    assert.equal(fs.statSync(`${sock}.log`).mode & 0o777, 0o600);
  });

  // A signal death was reported as "status 128".
  test("a sidecar killed by a signal before listening is named so", async () => {
    const { dir, sock } = setup();
    const crash = path.join(dir, "crash");
    fs.writeFileSync(crash, "#!/bin/sh\necho about to crash >&2\nkill -SEGV $$\n", { mode: 0o755 });
    process.env.POLYGATE_SIDECAR = crash;
    await assert.rejects(connect(sock, { autostart: true, timeoutMs: 5000 }),
      (e: unknown) => e instanceof SidecarError && e.message.includes("killed by signal 11 (SIGSEGV)")
        && e.message.includes("about to crash"));
  });
});
