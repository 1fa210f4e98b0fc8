#!/usr/bin/env python3
"""The Python binding's driver for `polygate-bench --scenario python` (DESIGN §16).

    python_client.py --socket PATH --mode sync|asyncio --concurrency N --seconds S
                     --scope SCOPE [--est-tokens N]

Runs full successful calls — ``with client.call(scope, est_tokens) as call:
call.acquire().success(tokens=est)``, which is ``Start`` + ``Finish`` on the wire
(protocol 2) — for S seconds and prints ONE JSON line:

    {"mode", "concurrency", "calls", "seconds", "calls_per_s", "call_p50_us", "call_p99_us",
     "cpu_us_per_call"}

``cpu_us_per_call`` is this process's CPU time (all threads, user + system) over
the timed window per call: the binding's own cost, which — unlike calls/s —
hardly moves when other work shares the machine.

Concurrency, chosen to match what each kind of worker really is (and the
redis-py baseline, bench/baseline/redis_py_baseline.py, which runs the same
shapes with one Redis connection per thread / a pool per loop):

* ``sync``: N threads, **each with its own client** (its own connection) — a
  sync worker is a thread or process doing one call at a time, and a connection
  per worker is how it is deployed. The threads share one interpreter, so the
  GIL bounds the total; N processes would scale further, but then the driver
  would measure process count rather than the binding. (Worker threads are not
  the main thread, so the sync client's main-thread SIGINT guard — two handler
  swaps per request — is not in these figures.)
* ``asyncio``: one event loop, **one client** shared by N tasks — the asyncio
  client multiplexes every call of a loop over one connection, which is its
  point.

Each worker connects and makes one untimed call before the clock starts, so
connection setup is not measured. Latency is per call, from ``call()`` to the
``Finish`` answer. Any error ends the run with a non-zero exit and the error on
stderr (a benchmark that silently counts failures is no benchmark).

The binding is imported from the environment, else from this checkout
(``bindings/python``); set PYTHONPATH to measure another copy of it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import threading
import time
from typing import Any, Dict, List

try:
    import polygate  # noqa: F401
except ImportError:  # run from a checkout without the package installed
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bindings", "python"))
    import polygate  # noqa: F401


def _quantile_us(sorted_ns: List[int], q: float) -> float:
    if not sorted_ns:
        return 0.0
    return sorted_ns[min(len(sorted_ns) - 1, round((len(sorted_ns) - 1) * q))] / 1000.0


def _result(mode: str, concurrency: int, lat: List[int], seconds: float, cpu_s: float) -> Dict[str, Any]:
    lat.sort()
    return {
        "mode": mode,
        "concurrency": concurrency,
        "calls": len(lat),
        "seconds": round(seconds, 4),
        "calls_per_s": round(len(lat) / seconds, 1) if seconds > 0 else 0.0,
        "call_p50_us": round(_quantile_us(lat, 0.50), 1),
        "call_p99_us": round(_quantile_us(lat, 0.99), 1),
        "cpu_us_per_call": round(cpu_s * 1e6 / len(lat), 1) if lat else 0.0,
    }


def run_sync(a: argparse.Namespace) -> Dict[str, Any]:
    import polygate

    est = a.est_tokens
    clients = [polygate.connect(a.socket, client_name="polygate-bench-sync") for _ in range(a.concurrency)]
    for c in clients:  # untimed warm-up call per connection
        with c.call(a.scope, est_tokens=est) as call:
            call.acquire().success(tokens=est)
    lat: List[int] = []
    errors: List[BaseException] = []
    lock = threading.Lock()
    go = threading.Event()
    deadline = [0.0]

    def worker(client: Any) -> None:
        mine: List[int] = []
        clock = time.perf_counter_ns
        scope = a.scope
        try:
            go.wait()
            end = deadline[0]
            while time.monotonic() < end:
                t = clock()
                with client.call(scope, est_tokens=est) as call:
                    call.acquire().success(tokens=est)
                mine.append(clock() - t)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)
        with lock:
            lat.extend(mine)

    threads = [threading.Thread(target=worker, args=(c,)) for c in clients]
    for t in threads:
        t.start()
    cpu0 = time.process_time()
    start = time.monotonic()
    deadline[0] = start + a.seconds
    go.set()
    for t in threads:
        t.join()
    elapsed = time.monotonic() - start
    cpu = time.process_time() - cpu0
    for c in clients:
        c.close()
    if errors:
        raise errors[0]
    return _result("sync", a.concurrency, lat, elapsed, cpu)


async def run_asyncio(a: argparse.Namespace) -> Dict[str, Any]:
    from polygate import aio

    est = a.est_tokens
    client = await aio.connect(a.socket, client_name="polygate-bench-asyncio")
    lat: List[int] = []
    clock = time.perf_counter_ns

    async def one() -> None:
        async with client.call(a.scope, est_tokens=est) as call:
            permit = await call.acquire()
            await permit.success(tokens=est)

    await asyncio.gather(*(one() for _ in range(a.concurrency)))  # untimed warm-up

    async def worker() -> None:
        while time.monotonic() < deadline:
            t = clock()
            await one()
            lat.append(clock() - t)

    cpu0 = time.process_time()
    start = time.monotonic()
    deadline = start + a.seconds  # read by the workers, which start below
    await asyncio.gather(*(worker() for _ in range(a.concurrency)))
    elapsed = time.monotonic() - start
    cpu = time.process_time() - cpu0
    await client.close()
    return _result("asyncio", a.concurrency, lat, elapsed, cpu)


def main(argv: List[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--socket", required=True)
    p.add_argument("--mode", choices=["sync", "asyncio"], required=True)
    p.add_argument("--concurrency", type=int, default=1)
    p.add_argument("--seconds", type=float, default=3.0)
    p.add_argument("--scope", required=True)
    p.add_argument("--est-tokens", type=int, default=None)
    a = p.parse_args(argv)
    if a.concurrency < 1 or a.seconds <= 0:
        p.error("--concurrency must be >= 1 and --seconds > 0")
    try:
        out = run_sync(a) if a.mode == "sync" else asyncio.run(run_asyncio(a))
    except Exception as e:  # noqa: BLE001
        print("python_client: %s: %s" % (type(e).__name__, e), file=sys.stderr)
        return 1
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
