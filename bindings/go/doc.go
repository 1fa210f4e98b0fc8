// Package polygate is the Go client of PolyGate, the per-host admission sidecar for
// programs that call rate-limited, failure-prone upstreams (LLM providers above
// all). Before each upstream request a worker asks the sidecar, over a Unix socket,
// which source it may call now; the sidecar answers with a permit for one source,
// makes the worker wait (the waiting happens in the sidecar), or refuses with a
// typed error. After the request the worker reports the outcome, which feeds the
// circuit breakers, quotas and concurrency pacers every worker on the host (and,
// with the Redis backend, every host) shares.
//
// The package uses the standard library only. A *Client is safe for concurrent
// use: all goroutines share one connection, multiplexed by request id, with writes
// coalesced into as few syscalls as the load allows.
//
// # The whole call in one function
//
// Client.Run acquires a permit, calls your function with it, classifies the error
// it returns (timeouts, connection errors, HTTP 429 with its Retry-After, 5xx, other
// 4xx: see Classify), reports, fails over to the next source, and ends the call on
// every path:
//
//	c, err := polygate.Dial(ctx, "") // "" → $POLYGATE_SOCKET → DefaultSocketPath()
//	if err != nil { ... }
//	defer c.Close()
//	err = c.Run(ctx, "chat", polygate.CallOptions{EstTokens: 1200}, func(ctx context.Context, p *polygate.Permit) error {
//		resp, err := callUpstream(ctx, p.Source)
//		if err != nil {
//			return err // classified; Run tries the next attempt if the call's budget allows
//		}
//		p.SetTokens(resp.Usage.TotalTokens)
//		return nil
//	})
//
// An upstream answering through net/http can return ResponseError(resp) for a
// status >= 400; errors of your own SDK are classified by status when they
// implement HTTPStatusError (and RetryAfterError), or by your CallOptions.Classify.
//
// # The low-level loop
//
// Begin, then Acquire / report until done, and always End:
//
//	call, err := c.Begin(ctx, "chat", polygate.CallOptions{EstTokens: 1200})
//	if err != nil { ... }
//	defer call.End(context.Background())
//	for {
//		p, err := call.Acquire(ctx) // ctx cancel/deadline → a Cancel frame
//		if err != nil {
//			return err // *CircuitOpenError, *AllSourcesExhaustedError: final for the call
//		}
//		reply, err := callUpstream(ctx, p.Source)
//		if err != nil {
//			p.Failure(ctx, polygate.Timeout) // failed sources go last in this call
//			continue
//		}
//		return p.Success(ctx, reply.Usage.TotalTokens)
//	}
//
// The client speaks protocol version 2 (bindings/PROTOCOL.md §14): a call that
// succeeds at once costs two round trips — the first Acquire sends Start (begin and
// acquire), Success sends Finish (report and end). Failure, RateLimited, Cancel and
// a NotCounted success are held and travel with the next Acquire (Retry: report and
// acquire) or with End (Finish), so each retry costs one round trip.
//
// # Errors
//
// *GatewayUnavailableError (RetryAfter, PerSourceReasons, Scope) means the
// call-level budget is spent: retries, back-off, failover and waiting already
// happened inside PolyGate. Its forms *CircuitOpenError and
// *AllSourcesExhaustedError (Reason: ReasonStalled, ReasonQuotaExhausted,
// ReasonRetryExhausted) unwrap to it, so errors.As finds either. Re-submitting the
// job later is a task-level retry, a different thing. *SidecarError (Kind) is
// everything else: the connection, the protocol, an unknown scope, an invalid
// argument, permission denied, shutting down.
//
// A lost connection fails the requests waiting on it with a *SidecarError of Kind
// "connection"; the sidecar releases everything the connection held, and the next
// use of the Client dials again.
package polygate
