"""Stand-in for bench/drivers/python_client.py (written with the Python binding).

Same command line and output as the real driver, so `polygate-bench --scenario
python --python-driver bench/stand-in/python_client.py` exercises the scenario
before the real driver exists:

    python_client.py --socket PATH --mode sync|asyncio --concurrency N --seconds S
                     --scope SCOPE [--est-tokens N]

prints one JSON line: {"calls_per_s", "call_p50_us", "call_p99_us", "calls"}.
It uses the binding's public `call` API (whatever frames the binding sends), one
shared client per process, `concurrency` threads (sync) or tasks (asyncio).
"""

import argparse
import asyncio
import json
import threading
import time


def quantile(sorted_ns, q):
    if not sorted_ns:
        return 0.0
    return sorted_ns[round((len(sorted_ns) - 1) * q)] / 1000.0


def report(lat, seconds):
    lat.sort()
    print(json.dumps({
        "calls_per_s": len(lat) / seconds,
        "call_p50_us": quantile(lat, 0.5),
        "call_p99_us": quantile(lat, 0.99),
        "calls": len(lat),
    }))


def run_sync(a):
    import polygate
    client = polygate.connect(a.socket, client_name="bench-stand-in")
    lat = []
    lock = threading.Lock()
    deadline = time.monotonic() + a.seconds

    def worker():
        mine = []
        while time.monotonic() < deadline:
            t = time.perf_counter_ns()
            with client.call(a.scope, est_tokens=a.est_tokens) as call:
                call.acquire().success(tokens=a.est_tokens)
            mine.append(time.perf_counter_ns() - t)
        with lock:
            lat.extend(mine)

    threads = [threading.Thread(target=worker) for _ in range(a.concurrency)]
    start = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    report(lat, time.monotonic() - start)
    client.close()


async def run_asyncio(a):
    from polygate import aio
    client = await aio.connect(a.socket, client_name="bench-stand-in")
    lat = []
    deadline = time.monotonic() + a.seconds

    async def worker():
        while time.monotonic() < deadline:
            t = time.perf_counter_ns()
            async with client.call(a.scope, est_tokens=a.est_tokens) as call:
                permit = await call.acquire()
                await permit.success(tokens=a.est_tokens)
            lat.append(time.perf_counter_ns() - t)

    start = time.monotonic()
    await asyncio.gather(*(worker() for _ in range(a.concurrency)))
    report(lat, time.monotonic() - start)
    await client.close()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--socket", required=True)
    p.add_argument("--mode", choices=["sync", "asyncio"], required=True)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--seconds", type=float, default=3.0)
    p.add_argument("--scope", required=True)
    p.add_argument("--est-tokens", type=int, default=10)
    a = p.parse_args()
    if a.mode == "sync":
        run_sync(a)
    else:
        asyncio.run(run_asyncio(a))


if __name__ == "__main__":
    main()
