"""End-to-end, DESIGN §15 through the Python binding: priority classes order the
waiters of a host (weighted fair queueing) and hold a saturated source's reserves for
the class they belong to, on one host and across two sidecars on one Redis."""

from __future__ import annotations

import asyncio
import subprocess
import time

import pytest

import polygate
import polygate.aio
from .polygate_e2e import scope, wait_until

CLASSES = [
    {"name": "interactive", "weight": 8, "reserve": 0.3},
    {"name": "batch", "weight": 1},
]


def _scope_waiters(client, name="chat"):
    return client.status()["scopes"][name]["waiters"]


def test_interactive_calls_queued_behind_batch_finish_first(sidecar):
    """A pacer of one slot, 40 batch calls queued before 10 interactive ones: the
    interactive calls are served ahead of the batch backlog (8 of every 9 grants
    while both wait), so on the whole they finish first."""
    sidecar.write_config({"chat": scope(
        "a", default_priority="batch", poll_interval="50ms", stall_window="60s",
        pacer={"initial": 1.0, "min": 1.0, "max": 1.0}, priorities=CLASSES)})
    sidecar.start()
    sync = sidecar.client()
    done = []

    async def main():
        client = await polygate.aio.connect(sidecar.socket)
        try:
            holder = client.call("chat")
            await holder.__aenter__()
            held = await holder.acquire()  # the only slot, until everyone queued

            async def one(cls, i):
                async with client.call("chat", priority=cls) as call:
                    p = await call.acquire()
                    await asyncio.sleep(0.01)
                    await p.success()
                done.append((cls, i))

            tasks = []
            for i in range(40):
                # One at a time, each queued before the next is sent, so the sidecar
                # sees them in this order (frames read in one go may start their
                # acquires in any order).
                tasks.append(asyncio.ensure_future(one("batch", i)))
                await _until(lambda: _scope_waiters(sync) == i + 1)
            tasks += [asyncio.ensure_future(one("interactive", i)) for i in range(10)]
            await _until(lambda: _scope_waiters(sync) == 50)
            await held.success()
            await holder.__aexit__(None, None, None)
            await asyncio.wait_for(asyncio.gather(*tasks), timeout=30)
        finally:
            await client.close()

    asyncio.run(main())
    ranks = [k for k, (cls, _) in enumerate(done) if cls == "interactive"]
    assert len(done) == 50 and len(ranks) == 10
    # Weighted fair queueing would finish them by the 12th; allow a little slack.
    assert max(ranks) < 16, ranks
    batch_ranks = [k for k, (cls, _) in enumerate(done) if cls == "batch"]
    assert sum(ranks) / 10 < sum(batch_ranks) / 40
    # FIFO within a class.
    order = [i for cls, i in done if cls == "batch"]
    assert order == sorted(order), order
    st = sync.status()["scopes"]["chat"]
    assert st["waiters"] == 0 and st["calls"] == 0


async def _until(pred, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            pytest.fail("timed out waiting for the waiters to queue", pytrace=False)
        await asyncio.sleep(0.02)


def _saturated_scope():
    # 10 requests a minute; above 50 % in use interactive's 30 % (3 requests) is kept.
    return {"chat": scope({"name": "a", "rpm": 10, "timeout": "5s"}, quota_full="fail_fast",
                          default_priority="batch", saturation=0.5, priorities=CLASSES)}


def _one(client, cls):
    """One call of class `cls`: True when it ran, the error when refused."""
    try:
        with client.call("chat", priority=cls) as call:
            call.acquire().success()
        return True
    except polygate.AllSourcesExhausted as e:
        return e


def _check_saturation(clients):
    ran = [_one(clients[i % len(clients)], "batch") for i in range(7)]
    assert ran == [True] * 7, ran
    refused = _one(clients[-1], "batch")
    assert isinstance(refused, polygate.AllSourcesExhausted), refused
    assert refused.reason == "quota_exhausted"
    assert refused.per_source_reasons == {"a": "rate_limited"}
    # §6: certainly free once the bucket holds interactive's whole reserve again:
    # 8 + 3 − 10 = 1 request at one per 6 s.
    assert 5.0 < refused.retry_after_s <= 6.05, refused.retry_after_s
    # Interactive still gets its reserve, on either host, then the bucket is empty.
    ran = [_one(clients[(i + 1) % len(clients)], "interactive") for i in range(3)]
    assert ran == [True] * 3, ran
    empty = _one(clients[0], "interactive")
    assert isinstance(empty, polygate.AllSourcesExhausted) and empty.reason == "quota_exhausted"


def test_saturated_rpm_refuses_batch_but_keeps_the_interactive_reserve(sidecar):
    sidecar.write_config(_saturated_scope())
    sidecar.start()
    client = sidecar.client()
    _check_saturation([client])
    # Status per class: grants, their share, refusals by reason.
    classes = {c["name"]: c for c in client.status()["scopes"]["chat"]["classes"]}
    b, i = classes["batch"], classes["interactive"]
    assert (b["grants"], i["grants"]) == (7, 3), classes
    assert abs(b["grant_share"] - 0.7) < 1e-9 and abs(i["grant_share"] - 0.3) < 1e-9
    assert b["refusals"]["quota_exhausted"] == 1 and b["refusals"]["held_reserve"] == 1, b
    assert i["refusals"]["quota_exhausted"] == 1 and i["refusals"]["held_reserve"] == 0, i
    assert (b["weight"], i["reserve"], b["waiters"]) == (1, 0.3, 0)
    out = subprocess.run([str(sidecar.binary), "status", "--socket", sidecar.socket],
                         capture_output=True, text=True, timeout=10)
    assert out.returncode == 0, out.stderr
    lines = [ln.split() for ln in out.stdout.splitlines()]
    row = next(ln for ln in lines if ln and ln[0] == "batch")
    assert row[5] == "7" and "held_reserve=1" in row, out.stdout


def test_an_unknown_class_is_refused_naming_the_classes(sidecar):
    sidecar.write_config(_saturated_scope())
    sidecar.start()
    client = sidecar.client()
    with pytest.raises(polygate.SidecarError) as ei:
        with client.call("chat", priority="bulk") as call:
            call.acquire()
    msg = str(ei.value)
    assert ei.value.kind == "invalid_argument" and "bulk" in msg and "interactive, batch" in msg, msg
    assert client.status()["scopes"]["chat"]["calls"] == 0


def test_reserves_hold_across_two_sidecars_on_one_redis(sidecars, redis_server):
    clients = []
    for name in ("host-a", "host-b"):
        s = sidecars.new(name)
        s.write_config(_saturated_scope(), backend="redis", redis_url=redis_server.url,
                       key_prefix="pg-prio", redis_timeout="500ms")
        s.start()
        clients.append(s.client())
    _check_saturation(clients)


def test_metrics_per_class(sidecar):
    import urllib.request

    from .polygate_e2e import free_port

    port = free_port()
    sidecar.write_config(_saturated_scope(), admin_listen="127.0.0.1:%d" % port)
    sidecar.start()
    client = sidecar.client()
    assert _one(client, "interactive") is True
    assert _one(client, "batch") is True
    assert _one(client, "batch") is True
    with urllib.request.urlopen("http://127.0.0.1:%d/metrics" % port, timeout=5) as r:
        lines = set(r.read().decode().splitlines())
    for expected in [
        'polygate_class_grants_total{scope="chat",class="interactive"} 1',
        'polygate_class_grants_total{scope="chat",class="batch"} 2',
        'polygate_class_waiters{scope="chat",class="batch"} 0',
        'polygate_class_refusals_total{scope="chat",class="batch",reason="held_reserve"} 0',
    ]:
        assert expected in lines, "%s missing from:\n%s" % (expected, "\n".join(sorted(lines)))
