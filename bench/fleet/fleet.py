#!/usr/bin/env python3
"""Fleet scenario (DESIGN §7a) for `polygate-bench --scenario fleet`: N sidecars on a
throwaway redis-server, a local fake upstream enforcing one provider rule and
answering 429 + Retry-After when it is broken, and W workers per host that go through
the Python binding (`client.run`-style loop: acquire, call the upstream, report the
usage or the 429). Prints one JSON line:
{"upstream_429s", "startup_429s", "utilisation", "calls_ok", "calls_failed", ...}.

Upstream rules (limits per deployment, as `--rpm` / `--tpm` say):
* token-bucket  (Anthropic): RPM, ITPM, OTPM buckets, continuous refill, capacity one
                 minute's worth; input + actual output charged on arrival.
* per-second    (Azure OpenAI): RPM and TPM evaluated per fixed 1-second period
                 (limit / 60 each); TPM charged with prompt + max_tokens on arrival.
* fixed-minute  (fixed 60-second windows): RPM and TPM (actual usage) per window.

`--config matching` writes the source block examples/providers.toml recommends for
the rule; `--config default` is today's configuration (rpm + tpm only) as the control.

Redis faults (DESIGN §10, issue 25): `--cluster` runs a throwaway 3-master /
3-replica Redis Cluster instead of one server, and `--fault` strikes at `--fault-at`
seconds: `redis-pause` stops every Redis process (SIGSTOP) for `--fault-for` seconds,
`master-kill` kills the master holding the source (kill -9; its replica takes over),
`failover` moves it to its replica (`CLUSTER FAILOVER`). The line then adds
`max_rolling_60s_over_allowed` (the most requests the fleet sent in any rolling
window of min(60 s, run) over what the provider's rule admits in such a window),
`calls_lost` (calls that ended in an error), `max_concurrent_probes` (half-open probe
permits held at once, per source) and `recovery_s` (from the end of the fault to
every host serving the source from Redis again).

DESIGN §18: every answer carries the rule's provider's rate-limit headers
(token-bucket → Anthropic's, fixed-minute → OpenAI's, per-second → Azure's), which
the workers attach to their reports (`permit.limits`). `--foreign SHARE` adds a
consumer outside PolyGate that uses SHARE of each limit directly at the upstream
(evenly paced); `--observe on|off` turns the sources' `observe_limits` on or off
(off: today's behaviour, the control); `--auto` configures the limits the headers
say as `"auto"` instead of numbers. The JSON line then also has `foreign_ok`,
`foreign_429s` and `left_utilisation` (PolyGate's accepted requests / what the
foreign consumer left of the rule's allowance). `--learn-rate aimd` sets the source's
`learn_rate` (the rate learned from the 429s; default off).
Standard library only (plus the polygate binding on sys.path)."""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bindings" / "python"))
import polygate  # noqa: E402

PROMPT, MAX_TOKENS, OUTPUT = 60, 40, 30  # tokens per request: in, max out, actual out


class Upstream:
    """A fake provider deployment enforcing one rule; thread-safe."""

    def __init__(self, rule: str, rpm: int, tpm: int) -> None:
        self.rule, self.rpm, self.tpm = rule, rpm, tpm
        self.itpm, self.otpm = tpm * PROMPT // (PROMPT + OUTPUT), tpm * OUTPUT // (PROMPT + OUTPUT)
        self.lock = threading.Lock()
        self.t0 = time.monotonic()
        self.ok = self.r429 = self.startup_429 = 0
        self.levels = {"r": float(rpm), "i": float(self.itpm), "o": float(self.otpm)}
        self.last = self.t0
        self.window = (-1, 0, 0)  # (index, requests, tokens)
        self.arrivals = []  # every request's arrival (monotonic), accepted or not

        self.foreign_ok = self.foreign_429 = 0

    def call(self, foreign: bool = False) -> tuple:
        """One request arriving now: (ok, retry_after_s, input, output, headers)."""
        with self.lock:
            now = time.monotonic()
            self.arrivals.append(now)
            retry = self._admit(now)
            headers = self._headers(now)
            if retry is None:
                if foreign:
                    self.foreign_ok += 1
                else:
                    self.ok += 1
                return True, 0.0, PROMPT, OUTPUT, headers
            if foreign:
                self.foreign_429 += 1
            else:
                self.r429 += 1
                if now - self.t0 < 60:
                    self.startup_429 += 1
            return False, retry, 0, 0, headers

    def _headers(self, now: float) -> dict:
        """DESIGN §18: what the rule's provider says is left, after this request."""
        if self.rule == "token-bucket":  # Anthropic: four dimensions, RFC 3339 resets
            caps = {"requests": ("r", self.rpm), "input-tokens": ("i", self.itpm),
                    "output-tokens": ("o", self.otpm)}
            h = {}
            wall = time.time()
            for name, (k, cap) in caps.items():
                level = max(0.0, self.levels[k])
                full_in = (cap - level) * 60 / cap
                stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(wall + full_in))
                frac = ("%.3f" % ((wall + full_in) % 1))[1:]
                h["anthropic-ratelimit-%s-limit" % name] = str(cap)
                h["anthropic-ratelimit-%s-remaining" % name] = str(int(level))
                h["anthropic-ratelimit-%s-reset" % name] = stamp + frac + "Z"
            return h
        period = 1.0 if self.rule == "per-second" else 60.0
        rl = self.rpm / 60 if period == 1.0 else self.rpm
        tl = self.tpm / 60 if period == 1.0 else self.tpm
        w, n, t = self.window
        idx = int((now - self.t0) // period)
        if w != idx:
            n, t = 0, 0
        left_r, left_t = max(0, int(rl - n)), max(0, int(tl - t))
        if self.rule == "per-second":  # Azure: remaining only
            return {"x-ratelimit-remaining-requests": str(left_r),
                    "x-ratelimit-remaining-tokens": str(left_t)}
        reset = period * (idx + 1) - (now - self.t0)  # OpenAI: Go durations
        d = "%dm%.3fs" % (reset // 60, reset % 60)
        return {"x-ratelimit-limit-requests": str(self.rpm), "x-ratelimit-remaining-requests": str(left_r),
                "x-ratelimit-reset-requests": d, "x-ratelimit-limit-tokens": str(self.tpm),
                "x-ratelimit-remaining-tokens": str(left_t), "x-ratelimit-reset-tokens": d}

    def _admit(self, now: float):
        if self.rule == "token-bucket":
            dt, self.last = now - self.last, now
            caps = {"r": self.rpm, "i": self.itpm, "o": self.otpm}
            need = {"r": 1, "i": PROMPT, "o": OUTPUT}
            waits = []
            for k in caps:
                self.levels[k] = min(caps[k], self.levels[k] + dt * caps[k] / 60)
                if self.levels[k] < need[k]:
                    waits.append((need[k] - self.levels[k]) * 60 / caps[k])
            if waits:
                return max(waits)
            for k in caps:
                self.levels[k] -= need[k]
            return None
        period = 1.0 if self.rule == "per-second" else 60.0
        rl = self.rpm / 60 if period == 1.0 else self.rpm
        tl = self.tpm / 60 if period == 1.0 else self.tpm
        cost = PROMPT + MAX_TOKENS if period == 1.0 else PROMPT + OUTPUT
        idx = int((now - self.t0) // period)
        w, n, t = self.window
        if w != idx:
            n, t = 0, 0
        if n + 1 > rl or t + cost > tl:
            self.window = (idx, n, t)
            return period * (idx + 1) - (now - self.t0)
        self.window = (idx, n + 1, t + cost)
        return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(port: int, proc: subprocess.Popen, seconds: float = 10) -> bool:
    """`True` once `port` accepts; `False` if `proc` exited or time ran out."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), 0.2).close()
            return True
        except OSError:
            if proc.poll() is not None:
                return False
            time.sleep(0.05)
    return False


def cli(port: int, *args: str) -> str:
    out = subprocess.run(["redis-cli", "-p", str(port), *args], capture_output=True,
                         text=True, timeout=10)
    return out.stdout


class Redis:
    """One throwaway redis-server, or a 3-master / 3-replica cluster."""

    def __init__(self, tmp: Path, cluster: bool) -> None:
        self.cluster = cluster
        self.procs = {}  # port -> Popen
        n = 6 if cluster else 1
        for i in range(n):
            d = tmp / ("redis%d" % i)
            d.mkdir()
            # A free port may be taken again before the server binds it: retry.
            for _ in range(5):
                port = free_port()
                args = ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                        "--appendonly", "no", "--dir", str(d)]
                if cluster:
                    args += ["--cluster-enabled", "yes", "--cluster-config-file",
                             str(d / "nodes.conf"), "--cluster-node-timeout", "2000"]
                proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                self.procs[port] = proc
                if wait_port(port, proc):
                    break
                proc.kill()
                proc.wait()
                del self.procs[port]
            else:
                raise SystemExit("redis-server did not start")
        self.ports = list(self.procs)
        if cluster:
            self._join()

    def _join(self) -> None:
        masters, replicas = self.ports[:3], self.ports[3:]
        for port, (lo, hi) in zip(masters, [(0, 5460), (5461, 10922), (10923, 16383)]):
            cli(port, "CLUSTER", "ADDSLOTSRANGE", str(lo), str(hi))
        for port in self.ports[1:]:
            cli(port, "CLUSTER", "MEET", "127.0.0.1", str(self.ports[0]))
        deadline = time.monotonic() + 30
        for m, r in zip(masters, replicas):
            mid = cli(m, "CLUSTER", "MYID").strip()
            while "OK" not in cli(r, "CLUSTER", "REPLICATE", mid):
                if time.monotonic() > deadline:
                    raise SystemExit("cluster replicas did not attach")
                time.sleep(0.1)
        while not all("cluster_state:ok" in cli(p, "CLUSTER", "INFO") for p in self.ports) \
                or not all("master_link_status:up" in cli(r, "INFO", "replication") for r in replicas):
            if time.monotonic() > deadline:
                raise SystemExit("cluster did not come up")
            time.sleep(0.1)

    def sidecar_keys(self) -> str:
        if self.cluster:
            nodes = ", ".join('"redis://127.0.0.1:%d"' % p for p in self.ports)
            return "redis_cluster_nodes = [%s]\n" % nodes
        return 'redis_url = "redis://127.0.0.1:%d/0"\n' % self.ports[0]

    def master_of(self, key: str) -> tuple:
        """(port of the master holding `key`'s slot, port of its replica)."""
        live = [p for p, pr in self.procs.items() if pr.poll() is None]
        slot = int(cli(live[0], "CLUSTER", "KEYSLOT", key).strip())
        rows = [line.split() for line in cli(live[0], "CLUSTER", "NODES").splitlines()]

        def port(f: list) -> int:
            return int(f[1].split("@")[0].rsplit(":", 1)[1])

        master = None
        for f in rows:
            if "master" in f[2] and "fail" not in f[2]:
                for r in f[8:]:
                    lo, _, hi = r.partition("-")
                    if lo.isdigit() and int(lo) <= slot <= int(hi or lo):
                        master = f
        if master is None:
            raise SystemExit("no master holds slot %d" % slot)
        replica = next((port(f) for f in rows if f[3] == master[0]), None)
        return port(master), replica

    def signal_all(self, sig: int) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                os.kill(p.pid, sig)

    def kill(self, port: int) -> None:
        self.procs[port].kill()
        self.procs[port].wait()

    def is_master(self, port: int) -> bool:
        return "role:master" in cli(port, "INFO", "replication")

    def stop(self) -> None:
        self.signal_all(signal.SIGCONT)
        for p in self.procs.values():
            p.terminate()
        for p in self.procs.values():
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                p.kill()


def max_rolling(arrivals: list, t0: float, end: float, rule: str, rpm: int) -> float:
    """The most requests sent in any window of min(60 s, the run) over what the rule
    admits in such a window (token-bucket: a full bucket plus the window's refill)."""
    span = min(60.0, max(end - t0, 1e-9))
    if rule == "token-bucket":
        allowed = rpm + rpm * span / 60
    elif rule == "per-second":
        allowed = rpm / 60 * math.ceil(span)
    else:
        allowed = rpm * math.ceil(span / 60)
    times = sorted(arrivals)
    best, j = 0, 0
    for i, t in enumerate(times):
        while times[j] < t - span:
            j += 1
        best = max(best, i - j + 1)
    return best / allowed


def source_block(rule: str, config: str, rpm: int, tpm: int, observe: str = "off", auto: bool = False,
                 learn: str = "off") -> str:
    lines = ['name = "deploy"', 'timeout = "10s"', f'observe_limits = "{observe}"',
             # Only when on: an older sidecar (a "before" run) knows no such key.
             *([f'learn_rate = "{learn}"'] if learn != "off" else []),
             'rpm = "auto"' if auto and rule != "per-second" else f"rpm = {rpm}"]
    if auto and rule == "token-bucket":
        return "\n".join(lines + ['itpm = "auto"', 'otpm = "auto"', f"est_tokens = {PROMPT + MAX_TOKENS}"])
    if auto and rule == "fixed-minute":
        return "\n".join(lines + ['tpm = "auto"', f"est_tokens = {PROMPT + MAX_TOKENS}"])
    if config == "default":
        return "\n".join(lines + [f"tpm = {tpm}"])
    if rule == "token-bucket":
        itpm, otpm = tpm * PROMPT // (PROMPT + OUTPUT), tpm * OUTPUT // (PROMPT + OUTPUT)
        # A bucket one request's interval short of a minute (capacity rpm - 1): the
        # provider's bucket runs on arrivals, PolyGate's on grants, and the first
        # request of a burst reaches the provider later after its grant than the
        # ones after it; a full minute's bucket let the grant due one refill later
        # arrive just before the provider had refilled it (docs/benchmarks.md).
        burst_ms = 60_000 - max(1, 60_000 // rpm)
        return "\n".join(lines + [f"itpm = {itpm}", f"otpm = {otpm}", f'burst = "{burst_ms}ms"'])
    if rule == "per-second":
        # One request's interval: a bucket of one request never sends more than
        # limit/60 in a fixed second (a bucket of a second's worth could send ~2x).
        burst_ms = max(1, 60_000 // rpm)
        return "\n".join(lines + [f"tpm = {tpm}", f'burst = "{burst_ms}ms"',
                                  'tokens_charged = "estimate"'])
    return "\n".join(lines + [f"tpm = {tpm}", f'burst = "{max(1, 60_000 // rpm)}ms"'])


def degraded_hosts(socks: list) -> int:
    """How many hosts serve the source from local state now (unknown: counted)."""
    n = 0
    for sock in socks:
        try:
            c = polygate.connect(str(sock))
            try:
                st = c.status()
            finally:
                c.close()
            srcs = [s for sc in st["scopes"].values() for s in sc["sources"].values()]
            n += any(s["degraded"] for s in srcs)
        except (polygate.PolyGateError, OSError):
            n += 1
    return n


def run_fault(a, redis: "Redis", socks: list, t0: float, stop_at: float) -> dict:
    """Strike `a.fault` at `a.fault_at`; return when it ended and how long the
    fleet took to serve from Redis again."""
    if a.fault == "none":
        return {"fault_at_s": None, "fault_end_s": None, "recovery_s": None}
    at = t0 + (a.fault_at if a.fault_at is not None else a.seconds / 2)
    time.sleep(max(0.0, at - time.monotonic()))
    struck = time.monotonic()
    if a.fault == "redis-pause":
        redis.signal_all(signal.SIGSTOP)
        time.sleep(a.fault_for)
        redis.signal_all(signal.SIGCONT)
    else:
        master, replica = redis.master_of("{fleet:deploy}:b")
        if replica is None:
            raise SystemExit("the source's master has no replica")
        if a.fault == "master-kill":
            redis.kill(master)
        else:
            cli(replica, "CLUSTER", "FAILOVER")
        deadline = time.monotonic() + 30
        while not redis.is_master(replica):
            if time.monotonic() > deadline:
                raise SystemExit("no failover within 30 s")
            time.sleep(0.05)
    ended = time.monotonic()
    recovered = None
    while time.monotonic() < stop_at:
        if degraded_hosts(socks) == 0:
            recovered = time.monotonic() - ended
            break
        time.sleep(0.05)
    return {"fault_at_s": round(struck - t0, 2), "fault_end_s": round(ended - t0, 2),
            "recovery_s": None if recovered is None else round(recovered, 2)}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hosts", type=int, default=4)
    ap.add_argument("--workers", type=int, default=16)
    ap.add_argument("--seconds", type=float, default=90)
    ap.add_argument("--upstream", choices=["token-bucket", "per-second", "fixed-minute"],
                    default="token-bucket")
    ap.add_argument("--config", choices=["matching", "default"], default="matching")
    ap.add_argument("--burst", default=None,
                    help="override the matching block's burst (e.g. 1s, to compare)")
    ap.add_argument("--foreign", type=float, default=0.0,
                    help="share of each limit a consumer outside PolyGate uses (DESIGN §18)")
    ap.add_argument("--observe", choices=["on", "off"], default="on",
                    help="observe_limits of the source: the provider's headers correct the buckets")
    ap.add_argument("--auto", action="store_true",
                    help='limits the headers carry configured as "auto" (learned)')
    ap.add_argument("--learn-rate", choices=["aimd", "off"], default="off",
                    help="learn_rate of the source: the rate learned from the 429s (DESIGN §18)")
    ap.add_argument("--rpm", type=int, default=60)
    ap.add_argument("--tpm", type=int, default=6000)
    ap.add_argument("--cluster", action="store_true",
                    help="a throwaway 3-master / 3-replica Redis Cluster instead of one server")
    ap.add_argument("--fault", choices=["none", "redis-pause", "master-kill", "failover"],
                    default="none")
    ap.add_argument("--fault-at", type=float, default=None,
                    help="seconds into the run (default: half of it)")
    ap.add_argument("--fault-for", type=float, default=10.0,
                    help="redis-pause: how long Redis stays stopped")
    ap.add_argument("--degraded-share", default="auto",
                    help='sidecar.degraded_share: "auto" or a fraction (1 = the whole limit '
                         'per host, the control)')
    ap.add_argument("--sidecar", default=os.environ.get(
        "POLYGATE_SIDECAR_BIN", str(ROOT / "target" / "debug" / "polygate-sidecar")))
    a = ap.parse_args()
    if a.fault in ("master-kill", "failover") and not a.cluster:
        ap.error("--fault %s needs --cluster (a master with a replica)" % a.fault)
    # SIGTERM (a timeout, the bench's own stop) still stops what this run started.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    tmp = Path(tempfile.mkdtemp(prefix="pg-fleet-"))
    procs = []
    redis = None
    try:
        redis = Redis(tmp, a.cluster)
        socks = []
        # A fault is noticed within one timeout per source; a run without one keeps
        # the slack a loaded machine needs.
        timeout = "2s" if a.fault == "none" else "500ms"
        block = source_block(a.upstream, a.config, a.rpm, a.tpm, a.observe, a.auto, a.learn_rate)
        if a.burst is not None:
            block = "\n".join(l for l in block.splitlines() if not l.startswith("burst"))
            block += f'\nburst = "{a.burst}"'
        for h in range(a.hosts):
            sock = tmp / f"h{h}.sock"
            cfg = tmp / f"h{h}.toml"
            cfg.write_text(
                f'[sidecar]\nsocket = "{sock}"\nbackend = "redis"\n'
                f'{redis.sidecar_keys()}redis_timeout = "{timeout}"\n'
                f'degraded_share = "{a.degraded_share}"\n'
                f'key_prefix = "fleet"\n\n[scopes.chat]\nquota_full = "wait"\n'
                f'stall_window = "600s"\npoll_interval = "20ms"\nmax_attempts = 10\n'
                f'[scopes.chat.pacer]\ninitial = {a.workers}\nmax = {a.workers}\n'
                f'min = {a.workers}\n\n[[scopes.chat.sources]]\n{block}\n')
            procs.append(subprocess.Popen([a.sidecar, "--config", str(cfg)],
                                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            socks.append(sock)
        deadline = time.monotonic() + 15
        while not all(s.exists() for s in socks):
            if time.monotonic() > deadline:
                raise SystemExit("a sidecar did not start")
            time.sleep(0.05)
        up = Upstream(a.upstream, a.rpm, a.tpm)
        stop_at = up.t0 + a.seconds
        counts = {"ok": 0, "failed": 0}
        lock = threading.Lock()
        probes = {"now": 0, "max": 0}

        def worker(sock: Path) -> None:
            client = polygate.connect(str(sock))
            try:
                while time.monotonic() < stop_at:
                    try:
                        with client.call("chat", est_input_tokens=PROMPT,
                                         est_output_tokens=MAX_TOKENS) as call:
                            while True:
                                p = call.acquire()
                                if time.monotonic() >= stop_at:
                                    p.cancel()
                                    return
                                if p.is_probe:
                                    with lock:
                                        probes["now"] += 1
                                        probes["max"] = max(probes["max"], probes["now"])
                                ok, retry, i, o, headers = up.call()
                                if p.is_probe:
                                    with lock:
                                        probes["now"] -= 1
                                p.limits = polygate.parse_headers(headers)[0]
                                if ok:
                                    p.success(input_tokens=i, output_tokens=o)
                                    break
                                p.rate_limited(retry_after_s=retry)
                        with lock:
                            counts["ok"] += 1
                    except polygate.PolyGateError:
                        with lock:
                            counts["failed"] += 1
            finally:
                client.close()

        def foreign() -> None:
            # Outside PolyGate: SHARE of the request limit, evenly paced (each
            # request costs what PolyGate's do, so it is SHARE of the token limits
            # too); a 429 is retried after its Retry-After, as an SDK would, so the
            # consumer keeps its demand.
            interval = 60.0 / (a.foreign * a.rpm)
            nxt = up.t0
            while True:
                nxt += interval
                pause = nxt - time.monotonic()
                if pause > 0:
                    time.sleep(pause)
                while time.monotonic() < stop_at:
                    ok, retry = up.call(foreign=True)[:2]
                    if ok:
                        break
                    time.sleep(min(max(retry, 0.01), 1.0))
                if time.monotonic() >= stop_at:
                    return

        threads = [threading.Thread(target=worker, args=(s,), daemon=True)
                   for s in socks for _ in range(a.workers)]
        if a.foreign > 0:
            threads.append(threading.Thread(target=foreign, daemon=True))
        for t in threads:
            t.start()
        fault = run_fault(a, redis, socks, up.t0, stop_at)
        # A worker still waiting out a 429 at the end is left behind (a daemon
        # thread): the upstream's counts are the result.
        for t in threads:
            t.join(timeout=max(0.0, stop_at + 5 - time.monotonic()))
        elapsed = min(time.monotonic(), stop_at) - up.t0
        with up.lock:
            ok, r429, startup = up.ok, up.r429, up.startup_429
            f_ok, f_429 = up.foreign_ok, up.foreign_429
        requests = ok + r429
        # What the rule could have accepted in requests over the run.
        if a.upstream == "token-bucket":
            allowed = a.rpm + a.rpm * elapsed / 60
        elif a.upstream == "per-second":
            allowed = a.rpm / 60 * math.ceil(elapsed)
        else:
            allowed = a.rpm * math.ceil(elapsed / 60)
        print(json.dumps({
            "scenario": "fleet", "upstream": a.upstream, "config": a.config,
            "burst": a.burst,
            "hosts": a.hosts, "workers": a.workers, "seconds": round(elapsed, 2),
            "upstream_requests": requests, "upstream_429s": r429,
            "upstream_429_share": round(r429 / max(1, requests), 4),
            "startup_429s": startup,
            "utilisation": round(ok / allowed, 4),
            "calls_ok": counts["ok"], "calls_failed": counts["failed"],
            "cluster": a.cluster, "fault": a.fault, "degraded_share": a.degraded_share,
            "max_rolling_60s_over_allowed": round(
                max_rolling(up.arrivals, up.t0, up.t0 + elapsed, a.upstream, a.rpm), 4),
            "calls_lost": counts["failed"],
            "max_concurrent_probes": probes["max"],
            **fault,
            "foreign": a.foreign, "observe": a.observe, "auto": a.auto,
            "learn_rate": a.learn_rate,
            "foreign_ok": f_ok, "foreign_429s": f_429,
            "left_utilisation": round(ok / max(1.0, allowed - f_ok), 4),
            "all_429_share": round((r429 + f_429) / max(1, requests), 4),
        }))
        return 0
    finally:
        if redis is not None:
            redis.stop()
        for p in reversed(procs):
            p.terminate()
        for p in procs:
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                p.kill()


if __name__ == "__main__":
    sys.exit(main())
