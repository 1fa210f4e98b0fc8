"""End-to-end: Redis round trips per admission, read from `INFO commandstats`.

DESIGN §10: one script call per admission and per report in the common path; the
host-local cooldown memo answers refusals without asking Redis."""

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
    M = 50
    before = redis_server.commandstats()
    s0 = redis_server.script_calls()
    for _ in range(M):
        with client.call("chat") as call:
            with pytest.raises(polygate.CircuitOpenError) as ei:
                call.acquire()
        assert ei.value.retry_after_s > 290
    used = redis_server.script_calls() - s0
    after = redis_server.commandstats()
    delta = {k: after.get(k, 0) - before.get(k, 0) for k in after if after.get(k, 0) != before.get(k, 0)}
    assert used == 0, "%d memo-answered refusals cost %d script calls; commands: %r" % (M, used, delta)
