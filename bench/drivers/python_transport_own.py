#!/usr/bin/env python3
"""The Python transport's own work per request, in process (DESIGN §17; issue 29 #6).

    python_transport_own.py [--rounds R] [--per N] [TREE ...]

No sidecar and no network: ``httpx.MockTransport`` answers the bench's chat request
(``python_transport.py``'s ``BODY`` / ``REPLY``) and a stand-in PolyGate client grants
at once, so what is left is the Python that gating adds to a request:

* ``transport``: ``polygate.httpx.Transport`` with ``_Instant`` (the driver's
  ``own_cpu_us``): estimate, tenant header, header read, body usage, settlement;
* ``run``: ``client.run(scope, fn)`` around the same plain request, with a stand-in
  call of the same kind: what gating the call site by hand adds (``usage_of`` on the
  parsed body, the permit's report).

Each figure is CPU time per request minus plain httpx's, as the min over rounds and
as the median of same-round differences (the kinds alternate, the order flipping
every round, so drift of the machine's load cancels). ``transport - run`` is the part
of the per-request gap the transport's own code is responsible for: the two make the
same sidecar round trips in the real bench.

Each TREE is a ``bindings/python`` directory (default: this checkout's); several are
measured in the same process, interleaved (each is imported as its own copy of the
package), so a before/after comparison is not at the mercy of the machine's load.
"""

from __future__ import annotations

import argparse
import importlib
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any, Callable, Dict, List

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)


class _RunPermit:
    source = "a"
    reported = False
    tokens = None
    limits = None

    def success(self, *a: Any, **k: Any) -> None:
        pass


class _RunCall:
    def __enter__(self) -> "_RunCall":
        return self

    def __exit__(self, *a: Any) -> bool:
        return False

    def acquire(self) -> _RunPermit:
        return _RunPermit()


class _RunStandIn:
    """What ``Client.run`` needs of its client, granting at once."""

    def call(self, *a: Any, **k: Any) -> _RunCall:
        return _RunCall()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--per", type=int, default=400, help="requests per kind per round")
    ap.add_argument("trees", nargs="*", default=[os.path.join(HERE, "..", "..", "bindings", "python")])
    a = ap.parse_args()
    import httpx
    from python_transport import BODY, REPLY, _Instant

    pkgs = tempfile.mkdtemp(prefix="pg-own-")
    try:
        for i, tree in enumerate(a.trees):
            shutil.copytree(os.path.join(tree, "polygate"), os.path.join(pkgs, "pg%d" % i))
        sys.path.insert(0, pkgs)

        def handler(req: Any) -> Any:
            req.read()
            return httpx.Response(200, headers={"content-type": "application/json",
                                                "content-length": str(len(REPLY))}, stream=httpx.ByteStream(REPLY))

        base = httpx.MockTransport(handler)
        plain = httpx.Client(base_url="http://h", transport=base)

        def plain_one() -> Any:
            return plain.post("/v1/chat/completions", json=BODY).json()

        kinds: Dict[str, Callable[[], Any]] = {"plain": plain_one}
        for i in range(len(a.trees)):
            gate = importlib.import_module("pg%d.httpx" % i)
            sync = importlib.import_module("pg%d._sync" % i)
            c = httpx.Client(base_url="http://h", transport=gate.Transport("bench", client=_Instant(), base=base))
            kinds["transport%d" % i] = (lambda c: lambda: c.post("/v1/chat/completions", json=BODY).json())(c)
            kinds["run%d" % i] = (lambda run, s: lambda: run(s, "bench", lambda permit: plain_one()))(
                sync.Client.run, _RunStandIn())

        def timed(fn: Callable[[], Any], n: int) -> float:
            t0 = time.process_time()
            for _ in range(n):
                fn()
            return (time.process_time() - t0) * 1e6 / n

        res: Dict[str, List[float]] = {k: [] for k in kinds}
        for fn in kinds.values():
            timed(fn, 200)  # warm
        for r in range(a.rounds):
            order = list(kinds) if r % 2 == 0 else list(reversed(kinds))
            for k in order:
                res[k].append(timed(kinds[k], a.per))
        p = res["plain"]
        print("plain: %.1f us CPU per request (min of %d rounds of %d)" % (min(p), a.rounds, a.per))
        for i, tree in enumerate(a.trees):
            t, r = res["transport%d" % i], res["run%d" % i]
            print("tree %d %s" % (i, os.path.normpath(tree)))
            for name, v in (("transport", t), ("run()", r)):
                print("  %-9s own us: min-min %5.1f   median paired %5.1f"
                      % (name, min(v) - min(p), statistics.median(x - y for x, y in zip(v, p))))
            print("  transport - run (median paired): %.1f us" % statistics.median(x - y for x, y in zip(t, r)))
    finally:
        shutil.rmtree(pkgs, ignore_errors=True)


if __name__ == "__main__":
    main()
