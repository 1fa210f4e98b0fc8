package polygate

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"
)

// FailureKind says how an attempt failed (PROTOCOL.md §4.4).
type FailureKind uint8

const (
	// Timeout: the upstream did not answer in time (also lowers the source's
	// concurrency ceiling).
	Timeout FailureKind = iota
	// ServerError: HTTP 5xx or equivalent.
	ServerError
	// Connection: could not connect, or the connection dropped.
	Connection
	// BadResult: the answer was unusable (bad JSON, a refusal, ...).
	BadResult
	// Error: anything else.
	Error
)

var failureSnake = snakeAll(failureNames[:])

// String returns the kind's name: "timeout", "server_error", "connection",
// "bad_result" or "error".
func (k FailureKind) String() string { return nameOf(failureSnake, uint32(k)) }

// ParseFailureKind maps a name ("timeout", "server_error", "connection",
// "bad_result", "error") to its FailureKind.
func ParseFailureKind(name string) (FailureKind, error) {
	for i, n := range failureSnake {
		if n == name {
			return FailureKind(i), nil
		}
	}
	return 0, invalidArgument("unknown failure kind %q; allowed: timeout, server_error, connection, bad_result, error", name)
}

// Usage is the tokens an attempt consumed. A zero count means "not given": with
// neither a total nor a split, the sidecar keeps the attempt's estimate; with a
// split and no total, the total is the split's sum. Every count is at most
// 1,000,000,000.
type Usage struct {
	// Tokens is the total.
	Tokens int
	// InputTokens are the prompt's tokens, excluding cached reads.
	InputTokens int
	// OutputTokens are the answer's tokens.
	OutputTokens int
	// CachedInputTokens are the input tokens the provider read from its prompt
	// cache (apart from InputTokens): a tenant's dollar cost prices them at the
	// cached rate (DESIGN §19). Sent (as SuccessCached) on a version-3 connection
	// only, with a success; dropped on an older one.
	CachedInputTokens int
}

func (u *Usage) wire() (w usage, split bool, err error) {
	if w.tokens, err = countField("Tokens", u.Tokens); err != nil {
		return
	}
	if w.input, err = countField("InputTokens", u.InputTokens); err != nil {
		return
	}
	if w.output, err = countField("OutputTokens", u.OutputTokens); err != nil {
		return
	}
	if sum := u.InputTokens + u.OutputTokens; sum > maxCount {
		err = invalidArgument("InputTokens + OutputTokens = %d exceeds the limit of %d", sum, maxCount)
		return
	}
	if _, err = countField("CachedInputTokens", u.CachedInputTokens); err != nil {
		return
	}
	return w, w.input.ok || w.output.ok, nil
}

// SuccessOptions refine a success report.
type SuccessOptions struct {
	// Usage is what the attempt consumed; zero = keep the estimate.
	Usage Usage
	// NotCounted marks an answer that was unusable: it stays out of the breaker's
	// statistics (count_attempt = false) and, like a failure, the report waits for
	// the call's next Acquire (another attempt) or its End.
	NotCounted bool
}

// ReportResult is the sidecar's answer to a report sent at once (a success).
type ReportResult struct {
	// Applied is false when the outcome was fenced out: the source's breaker
	// changed state since the permit was granted.
	Applied bool
	// State is the source's breaker state after the report.
	State BreakerState
	// RetryAfter is how long until a retry of this source is certainly worth it.
	RetryAfter time.Duration
}

type callState uint8

const (
	// callIdle: no call exists on the sidecar yet (or a cancelled Acquire ended
	// it); the next Acquire sends Start.
	callIdle callState = iota
	// callActive: the call lives on Call.conn as Call.id.
	callActive
	// callDone: the call is over; Acquire returns Call.final.
	callDone
)

type permitState uint8

const (
	// permitOpen: granted, not yet reported.
	permitOpen permitState = iota
	// permitHeld: reported on this side; the report travels with the call's next
	// Acquire (Retry) or its End (Finish).
	permitHeld
	// permitDone: reported to the sidecar, or gone.
	permitDone
)

// Call is one logical request in a scope, made of one or more attempts, each under
// a Permit. A Call is used by one goroutine at a time (its Permits too); the Client
// it came from is shared.
//
// Lifecycle (protocol version 2): the first Acquire sends Start (begin the call and
// acquire in one round trip); a failure, 429 or cancel report is held and travels
// with the next Acquire (Retry: report and acquire in one round trip) or with End
// (Finish); a success is sent at once (Finish) and ends the call.
type Call struct {
	client *Client
	spec   callSpec
	// tenant is the call's tenant ("": the scope's anonymous tenant, a plain Start).
	tenant string

	mu    sync.Mutex
	state callState
	// busy: an Acquire, a success report or End is in flight.
	busy bool
	// conn and id: where the call lives, while callActive.
	conn *conn
	id   uint64
	// permit is the call's latest permit (nil before the first grant, or after it
	// was reclaimed).
	permit *Permit
	// final is what Acquire returns once the call is over.
	final error
}

// Permit is the sidecar's grant for one attempt: call Source now, then report the
// outcome exactly once with Success, Failure, RateLimited or Cancel (or End the
// call, which abandons an unreported permit: its reservation is kept as if the
// estimate was used, and the breaker learns nothing).
type Permit struct {
	// ID is the permit's id on its connection (for logs).
	ID uint64
	// Source is the upstream to call now.
	Source string
	// IsProbe: this attempt is the single trial call through a half-open breaker;
	// report it promptly, other calls wait on it.
	IsProbe bool
	// Attempt is the 1-based attempt number within the call.
	Attempt int
	// EstTokens are the tokens reserved for this attempt.
	EstTokens uint64

	call  *Call
	state permitState // guarded by call.mu
	held  outcome     // the report waiting for Acquire or End (permitHeld)
	// limits are the response's observed limits (SetLimits), sent with the report.
	limits *obsLimits
	// result is the sidecar's answer to a success report.
	result    ReportResult
	hasResult bool
	// usage is set by SetTokens / SetUsage for Run's report.
	usage Usage
}

func (p *Permit) String() string {
	probe := ""
	if p.IsProbe {
		probe = " probe"
	}
	return fmt.Sprintf("permit %d: source %q attempt %d%s est_tokens %d", p.ID, p.Source, p.Attempt, probe, p.EstTokens)
}

// SetTokens sets the total tokens the attempt used, for the success (or failure)
// report Run sends when the attempt function returns.
func (p *Permit) SetTokens(n int) { p.usage = Usage{Tokens: n} }

// SetUsage sets the attempt's usage with its input/output split, for Run's report.
func (p *Permit) SetUsage(u Usage) { p.usage = u }

// Result returns the sidecar's answer to this permit's success report, once it
// has been sent (false before, and for reports that were held: failures, 429s,
// cancels).
func (p *Permit) Result() (ReportResult, bool) {
	p.call.mu.Lock()
	defer p.call.mu.Unlock()
	return p.result, p.hasResult
}

var errFinished = &SidecarError{Kind: "unknown_call", Message: "the call is over: it ended with a success report or End"}

func busyError(what string) error {
	return &SidecarError{Kind: "busy", Message: what}
}

// Acquire returns a permit for the call's next attempt. In wait mode it blocks
// until a source is usable (the waiting happens in the sidecar); it fails with
// *CircuitOpenError or *AllSourcesExhaustedError (both *GatewayUnavailableError)
// when the call cannot proceed — final for the call: later Acquires return the
// same error.
//
// If ctx ends first, a Cancel is sent and ctx.Err() is returned; the sidecar
// releases whatever was granted meanwhile, and the call's attempts so far are
// forgotten: a later Acquire starts the call afresh (attempt 1).
func (c *Call) Acquire(ctx context.Context) (*Permit, error) {
	c.mu.Lock()
	if c.busy {
		c.mu.Unlock()
		return nil, busyError("Acquire while another Acquire, report or End of this call is in flight")
	}
	r := request{}
	var cn *conn
	id := c.id
	switch c.state {
	case callDone:
		err := c.final
		c.mu.Unlock()
		return nil, err
	case callIdle:
		r = request{tag: reqStart, spec: c.spec}
		if c.tenant != "" {
			r = request{tag: reqStartTenant, spec: c.spec, tenant: c.tenant}
		}
	case callActive:
		cn = c.conn
		switch p := c.permit; {
		case p != nil && p.state == permitOpen:
			c.mu.Unlock()
			return nil, busyError(fmt.Sprintf("%v is not reported yet: report it before acquiring again", p))
		case p != nil && p.state == permitHeld:
			r = request{tag: reqRetry, target: p.ID, outcome: p.held, limits: p.limits}
		default:
			r = request{tag: reqAcquire, target: c.id}
		}
	}
	c.busy = true
	c.mu.Unlock()

	if cn == nil {
		var err error
		if cn, err = c.client.conn(ctx); err == nil && r.tag == reqStartTenant && cn.version < tenantVersion {
			// Never sent without its tenant: refused here (PROTOCOL.md §15).
			err = tenantsUnsupported(fmt.Sprintf("call in scope %q for tenant %q", c.spec.scope, c.tenant), cn.version, c.spec.scope)
		}
		if err != nil {
			c.mu.Lock()
			c.busy = false
			c.mu.Unlock()
			return nil, err
		}
	}
	rep, err := cn.roundTrip(ctx, &r, rtCancellable|rtRelease, endCallOf(&r))
	if err == nil && r.tag == reqRetry && rep.tag == repError && rep.err.kind == kindUnknownPermit {
		// The permit was reclaimed (its lease ran out) but the call lives on: the
		// next attempt is a plain Acquire.
		c.mu.Lock()
		c.permit.state = permitDone
		c.permit = nil
		c.mu.Unlock()
		r = request{tag: reqAcquire, target: id}
		rep, err = cn.roundTrip(ctx, &r, rtCancellable|rtRelease, endCallOf(&r))
	}

	c.mu.Lock()
	defer c.mu.Unlock()
	c.busy = false
	if err != nil {
		var se *SidecarError
		if errors.As(err, &se) && r.tag != reqStart && r.tag != reqStartTenant {
			// The connection is gone, and with it the call.
			c.over(err)
		} else {
			// ctx ended: the reader releases whatever arrives late (the call ends
			// with it); or a Start never reached a live connection.
			c.state, c.conn, c.permit = callIdle, nil, nil
		}
		return nil, err
	}
	starting := r.tag == reqStart || r.tag == reqStartTenant
	switch rep.tag {
	case repStarted:
		c.state, c.conn, c.id = callActive, cn, rep.call
		return c.granted(&rep.grant), nil
	case repGranted:
		if !starting {
			return c.granted(&rep.grant), nil
		}
	case repTenantLimited:
		// The tenant's refusal ends the call (PROTOCOL.md §15): nothing is left of
		// it after a StartTenant or a Retry; an Acquire's call is ended here.
		e := tenantLimitError(rep.err, rep.tenant, rep.limit)
		if r.tag == reqAcquire {
			cn.fireAndForget(&request{tag: reqEndCall, target: id})
		}
		c.over(e)
		return nil, e
	case repError:
		e := errorFromReply(rep.err)
		switch {
		case r.tag == reqRetry && rep.err.kind == kindInvalidArgument:
			// Refused before anything changed: the permit is unreported again.
			c.permit.state = permitOpen
		case starting && (rep.err.kind == kindCancelled || rep.err.kind == kindOverloaded):
			// No call exists; a later Acquire may start it again.
			c.state, c.conn, c.permit = callIdle, nil, nil
		case r.tag == reqAcquire:
			// A version-1 Acquire's error leaves the call alive: end it.
			cn.fireAndForget(&request{tag: reqEndCall, target: id})
			c.over(e)
		default:
			// After a Start or Retry error the call is gone (PROTOCOL.md §14.1).
			c.over(e)
		}
		return nil, e
	}
	e := &SidecarError{Kind: "protocol", Message: fmt.Sprintf("the sidecar answered %s to %s", nameOf(replyNames[:], rep.tag), nameOf(requestNames[:], r.tag))}
	cn.kill(e)
	c.over(e)
	return nil, e
}

// endCallOf is the call a late error of r leaves alive (only a version-1 Acquire
// does).
func endCallOf(r *request) uint64 {
	if r.tag == reqAcquire {
		return r.target
	}
	return 0
}

// over ends the call locally (under c.mu).
func (c *Call) over(final error) {
	c.state, c.conn, c.final = callDone, nil, final
	if c.permit != nil {
		c.permit.state = permitDone
	}
}

func (c *Call) granted(g *grant) *Permit {
	p := &Permit{ID: g.permit, Source: g.source, IsProbe: g.isProbe, Attempt: int(g.attempt), EstTokens: g.estTokens, call: c}
	if c.permit != nil {
		c.permit.state = permitDone
	}
	c.permit = p
	return p
}

// hold records a report to send with the call's next Acquire or End.
func (p *Permit) hold(o outcome) error {
	c := p.call
	c.mu.Lock()
	defer c.mu.Unlock()
	if err := p.reportable(); err != nil {
		return err
	}
	p.state, p.held = permitHeld, o
	return nil
}

// reportable says whether p may be reported now (under call.mu).
func (p *Permit) reportable() error {
	if p.state != permitOpen || p.call.permit != p {
		return &SidecarError{Kind: "unknown_permit", Message: fmt.Sprintf("%v was already reported (or its call ended)", p)}
	}
	if p.call.busy {
		return busyError(fmt.Sprintf("report of %v while End of its call is in flight", p))
	}
	return nil
}

// Success reports that the upstream answered usefully, with the total tokens it
// used (0 = unknown: keep the estimate). It is sent at once and ends the call (one
// round trip: report and end). ctx bounds the wait for the sidecar's answer; the
// report is sent even if ctx is already done.
func (p *Permit) Success(ctx context.Context, tokens int) error {
	return p.SuccessWith(ctx, SuccessOptions{Usage: Usage{Tokens: tokens}})
}

// SuccessWith is Success with a token split (and cached input reads) and/or
// NotCounted.
func (p *Permit) SuccessWith(ctx context.Context, o SuccessOptions) error {
	u, split, err := o.Usage.wire()
	if err != nil {
		return err
	}
	out := outcome{tag: outSuccess, tokens: u.tokens, countAttempt: !o.NotCounted}
	if split {
		out = outcome{tag: outSuccessUsage, usage: u, countAttempt: !o.NotCounted}
	}
	if o.Usage.CachedInputTokens > 0 && p.connVersion() >= tenantVersion {
		out = outcome{tag: outSuccessCached, usage: u, cached: uint64(o.Usage.CachedInputTokens), countAttempt: !o.NotCounted}
	}
	if o.NotCounted {
		return p.hold(out)
	}
	return p.finish(ctx, out)
}

// connVersion is the protocol version of the connection p's call lives on.
func (p *Permit) connVersion() uint32 {
	c := p.call
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.conn == nil {
		return 0
	}
	return c.conn.version
}

// Failure reports that the attempt failed. The report is held and sent with the
// call's next Acquire (which fails over: sources that failed in this call are tried
// last) or with its End. It returns an error only for an invalid kind or a permit
// already reported.
func (p *Permit) Failure(ctx context.Context, kind FailureKind) error {
	return p.FailureWith(ctx, kind, Usage{})
}

// FailureWith is Failure with the tokens the upstream still consumed (a bad_result
// or error answer is charged).
func (p *Permit) FailureWith(ctx context.Context, kind FailureKind, used Usage) error {
	if int(kind) >= len(failureNames) {
		return invalidArgument("unknown failure kind %d", kind)
	}
	u, _, err := used.wire()
	if err != nil {
		return err
	}
	out := outcome{tag: outFailure, kind: uint32(kind)}
	if u.tokens.ok || u.input.ok || u.output.ok {
		out = outcome{tag: outFailureUsage, kind: uint32(kind), usage: u}
	}
	return p.hold(out)
}

// RateLimited reports that the upstream answered 429 / "rate limited" —
// backpressure, not a failure. retryAfter is the upstream's Retry-After (0 = none
// given); it blocks the source's quota until then on every host. Held like Failure.
func (p *Permit) RateLimited(ctx context.Context, retryAfter time.Duration) error {
	ra, err := optSeconds(retryAfter)
	if err != nil {
		return err
	}
	return p.hold(outcome{tag: outRateLimited, retryAfter: ra})
}

// Cancel reports that the upstream request was never sent (or abandoned while
// sending): the reservation is refunded. Held like Failure: the next Acquire makes
// another attempt, End ends the call.
func (p *Permit) Cancel(ctx context.Context) error {
	return p.hold(outcome{tag: outCancelled})
}

// finish sends Finish{p, o} and ends the call.
func (p *Permit) finish(ctx context.Context, o outcome) error {
	c := p.call
	c.mu.Lock()
	if err := p.reportable(); err != nil {
		c.mu.Unlock()
		return err
	}
	p.state, c.busy = permitDone, true
	cn, id, limits := c.conn, c.id, p.limits
	c.mu.Unlock()

	rep, err := cn.roundTrip(ctx, &request{tag: reqFinish, target: p.ID, outcome: o, limits: limits}, rtAlways, 0)
	c.mu.Lock()
	defer c.mu.Unlock()
	c.busy = false
	if err == nil {
		err = expect(&rep, repReported)
	}
	if err == nil {
		p.result = ReportResult{Applied: rep.applied, State: BreakerState(nameOf(stateSnake, rep.state)), RetryAfter: secondsToDuration(rep.retryAfter)}
		p.hasResult = true
		c.over(errFinished)
		return nil
	}
	if rep.tag == repError {
		switch rep.err.kind {
		case kindInvalidArgument:
			p.state = permitOpen // nothing changed: report again
			return err
		case kindUnknownPermit:
			// The permit was reclaimed; the call lives on without it: end it.
			cn.fireAndForget(&request{tag: reqEndCall, target: id})
		}
	}
	c.over(errFinished)
	return err
}

// End ends the call, releasing whatever it still holds: a held report is sent
// (Finish); an unreported permit is abandoned (its reservation is kept as if the
// estimate was used, the breaker learns nothing). End is idempotent and cheap when
// the call is already over (after a success or a final error: nothing is sent).
// The frame is sent even if ctx is already done; ctx bounds the wait for the
// answer. A lost connection is not an error here: the sidecar released the call.
func (c *Call) End(ctx context.Context) error {
	c.mu.Lock()
	if c.busy {
		c.mu.Unlock()
		return busyError("End while an Acquire or report of this call is in flight: cancel the Acquire's ctx instead")
	}
	if c.state != callActive {
		if c.state == callIdle {
			c.over(errFinished)
		}
		c.mu.Unlock()
		return nil
	}
	p, cn, id := c.permit, c.conn, c.id
	r := request{tag: reqEndCall, target: id}
	if p != nil && p.state == permitHeld {
		r = request{tag: reqFinish, target: p.ID, outcome: p.held, limits: p.limits}
	}
	c.busy = true
	c.over(errFinished)
	c.mu.Unlock()

	rep, err := cn.roundTrip(ctx, &r, rtAlways, 0)
	if err == nil && r.tag == reqFinish && rep.tag == repError &&
		(rep.err.kind == kindUnknownPermit || rep.err.kind == kindInvalidArgument) {
		// The held report was refused and the call lives on: end it plainly.
		r = request{tag: reqEndCall, target: id}
		rep, err = cn.roundTrip(ctx, &r, rtAlways, 0)
	}
	c.mu.Lock()
	c.busy = false
	c.mu.Unlock()
	if err != nil {
		var se *SidecarError
		if errors.As(err, &se) && se.Kind == "connection" {
			return nil
		}
		return err
	}
	want := uint32(repOk)
	if r.tag == reqFinish {
		want = repReported
	}
	return expect(&rep, want)
}
