"""End-to-end: Redis round trips per admission, read from `INFO commandstats`.

DESIGN §10: one script call per admission and per report in the common path; the
host-local cooldown memo answers refusals without asking Redis (but for one read per
second, which notices a Redis that lost its state)."""

from __future__ import annotations

import pytest

import polygate
from .polygate_e2e import scope


def test_script_calls_per_call_and_memo_answers_refusals(sidecar, redis_server):
    sidecar.write_config({"chat": scope("s1")}, backend="redis", redis_url=redis_server.url,
                         key_prefix="pg-cmds", redis_timeout="500ms")
    sidecar.start()
    client = sidecar.client()
    # warm-up: connection, script loading
    with client.call("chat") as call:
        call.acquire().success(tokens=5)

    N = 50
    before = redis_server.commandstats()
    s0 = redis_server.script_calls()
    for _ in range(N):
        with client.call("chat") as call:
            call.acquire().success(tokens=5)
    used = redis_server.script_calls() - s0
    after = redis_server.commandstats()
    delta = {k: after.get(k, 0) - before.get(k, 0) for k in after if after.get(k, 0) != before.get(k, 0)}
    assert used <= 2 * N, "%d admitted+reported calls cost %d script calls (> 2N); commands: %r" % (N, used, delta)
    assert used > 0, "the Redis backend ran no scripts at all? commands: %r" % delta

    client.force_open("s1", seconds=300)
    with client.call("chat") as call:
        with pytest.raises(polygate.CircuitOpenError):
            call.acquire()  # the breaker's refusal writes the memo
    import time

    M = 50
    before = redis_server.commandstats()
    s0 = redis_server.script_calls()
    t0 = time.monotonic()
    for _ in range(M):
        with client.call("chat") as call:
            with pytest.raises(polygate.CircuitOpenError) as ei:
                call.acquire()
        assert ei.value.retry_after_s > 290
    elapsed = time.monotonic() - t0
    used = redis_server.script_calls() - s0
    after = redis_server.commandstats()
    delta = {k: after.get(k, 0) - before.get(k, 0) for k in after if after.get(k, 0) != before.get(k, 0)}
    # At most one memo re-check per second (engine MEMO_RECHECK), not one per refusal.
    assert used <= int(elapsed) + 1, "%d memo-answered refusals in %.2fs cost %d script calls; commands: %r" \
        % (M, elapsed, used, delta)


def test_quota_waiters_share_one_redis_check_per_tick(sidecar, redis_server):
    """100 calls waiting on a rate-limited source cost about one script call per poll
    tick from this host, not one per waiter per nap (issue 2, "built for scale")."""
    import asyncio
    import time

    import polygate.aio

    sidecar.write_config({"chat": scope({"name": "s1", "timeout": "5s", "rpm": 1},
                                        poll_interval="100ms", stall_window="10s")},
                         backend="redis", redis_url=redis_server.url, key_prefix="pg-tick",
                         redis_timeout="500ms")
    sidecar.start()
    client = sidecar.client()
    with client.call("chat") as call:
        call.acquire().success()  # the minute's only request is used

    async def wait_all(seconds):
        c = await polygate.aio.connect(sidecar.socket)
        try:
            async def one():
                async with c.call("chat") as call:
                    try:
                        await asyncio.wait_for(call.acquire(), seconds)
                    except asyncio.TimeoutError:
                        pass
            await asyncio.gather(*(one() for _ in range(100)))
        finally:
            await c.close()

    s0 = redis_server.script_calls()
    t0 = time.monotonic()
    asyncio.run(wait_all(1.5))
    elapsed = time.monotonic() - t0
    used = redis_server.script_calls() - s0
    ticks = elapsed / 0.1
    # One shared check per tick (+ the first passes racing the first refusal, and the
    # Cancel of each waiter on exit). One per waiter per nap would be ~100 × 20.
    assert used <= 2 * ticks + 150, "%d script calls for 100 waiters over %.1fs" % (used, elapsed)
