"""The in-process redis-py baseline of `polygate-bench --scenario python` (DESIGN §16).

What a Python service would do without the sidecar: run PolyGate's admit and report
scripts itself, straight from the process, with redis-py. To be *the same* script
calls the sidecar makes, they are not rebuilt here from a copy of the argument list
(which would drift when the script changes): the bench records the sidecar's own
commands for one call with MONITOR (bench/src/drivers.rs) and hands them over in
`--capture`, as {"admit": [[cmd, arg, ...], ...], "report": [[...], ...]}. A call here
replays the admit commands, then the report commands, exactly as captured. With a
closed breaker and quotas far above the rate, every replay does the work the
sidecar's call did (the report's epoch stays valid).

`--script` is `sidecar/src/backend/redis/gate.lua`: it is loaded (SCRIPT LOAD) so an
EVALSHA replay finds it even on a fresh server (an FCALL replay finds the library the
sidecar loaded), and its SHA1 is checked against the captured script hash or function
name, so a baseline that replays anything but the source tree's script says so.

    redis_py_baseline.py --redis-url URL --capture FILE --script gate.lua
                         --mode sync|asyncio --concurrency N --seconds S

prints one JSON line: {"calls_per_s", "call_p50_us", "call_p99_us", "calls",
"commands_per_call", "script_matches"}. Needs redis-py (`.venv/bin/pip install redis`;
the bench installs nothing itself).
"""

import argparse
import asyncio
import hashlib
import json
import threading
import time


def quantile(sorted_ns, q):
    if not sorted_ns:
        return 0.0
    return sorted_ns[round((len(sorted_ns) - 1) * q)] / 1000.0


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--redis-url", required=True)
    p.add_argument("--capture", required=True)
    p.add_argument("--script", required=True)
    p.add_argument("--mode", choices=["sync", "asyncio"], required=True)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--seconds", type=float, default=3.0)
    a = p.parse_args()

    import redis

    with open(a.capture) as f:
        cap = json.load(f)
    commands = [tuple(c) for c in cap["admit"] + cap["report"]]
    with open(a.script, "rb") as f:
        source = f.read()
    sha = hashlib.sha1(source).hexdigest()
    r = redis.Redis.from_url(a.redis_url)
    r.script_load(source)
    # The sidecar calls gate.lua as the Redis Function `polygate_<SHA-1 prefix>`
    # (FCALL; it loaded the library itself), or as a script (EVALSHA) on Redis < 7.
    names = [c[1] for c in commands if c[0].upper() in ("EVALSHA", "FCALL")]
    wanted = {sha, "polygate_" + sha[:16]}
    script_matches = all(n in wanted for n in names) if names else None
    r.close()

    lat = []
    deadline = time.monotonic() + a.seconds
    start = time.monotonic()
    if a.mode == "sync":
        lock = threading.Lock()

        def worker():
            conn = redis.Redis.from_url(a.redis_url)
            mine = []
            while time.monotonic() < deadline:
                t = time.perf_counter_ns()
                for c in commands:
                    conn.execute_command(*c)
                mine.append(time.perf_counter_ns() - t)
            with lock:
                lat.extend(mine)
            conn.close()

        threads = [threading.Thread(target=worker) for _ in range(a.concurrency)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    else:
        import redis.asyncio as aredis

        async def run():
            conn = aredis.Redis.from_url(a.redis_url, max_connections=a.concurrency)

            async def worker():
                while time.monotonic() < deadline:
                    t = time.perf_counter_ns()
                    for c in commands:
                        await conn.execute_command(*c)
                    lat.append(time.perf_counter_ns() - t)

            await asyncio.gather(*(worker() for _ in range(a.concurrency)))
            await conn.aclose()

        asyncio.run(run())
    elapsed = time.monotonic() - start
    lat.sort()
    print(json.dumps({
        "calls_per_s": len(lat) / elapsed,
        "call_p50_us": quantile(lat, 0.5),
        "call_p99_us": quantile(lat, 0.99),
        "calls": len(lat),
        "commands_per_call": len(commands),
        "script_matches": script_matches,
    }))


if __name__ == "__main__":
    main()
