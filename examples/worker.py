#!/usr/bin/env python3
"""Example PolyGate worker: the README's quick start, runnable as written.

Start the sidecar first (`cargo run --release -p polygate-sidecar`), then run this.
The upstream is simulated: 20% of requests time out, so you can watch failover,
and `status()` shows the breaker, pacer and quota state that results.
"""
import random

import polygate


def do_request(source):
    """Stand-in for your upstream call (OpenAI, Azure, vLLM, …)."""
    if random.random() < 0.2:
        raise TimeoutError(source)      # run() reports it as a timeout and fails over
    return {"text": "hello from " + source, "usage": {"total_tokens": random.randint(200, 900)}}


client = polygate.connect()             # path: arg, else $POLYGATE_SOCKET, else the default for this uid
reply = client.run("chat", lambda permit: do_request(permit.source), est_tokens=1200)
print(reply["text"])                    # the usage was reported from reply["usage"]
print(client.status()["scopes"]["chat"]["sources"]["openai-gpt4o"]["state"])
