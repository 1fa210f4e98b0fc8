package polygate

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

func dialFake(t *testing.T, s *fakeSidecar) *Client {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	c, err := Dial(ctx, s.path)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

func tctx(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	t.Cleanup(cancel)
	return ctx
}

func wantRequests(t *testing.T, s *fakeSidecar, want ...string) {
	t.Helper()
	// The fake logs a request when it reads it; give fire-and-forget frames a moment.
	deadline := time.Now().Add(2 * time.Second)
	for {
		got := s.requests()
		if slices.Equal(got, want) {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("requests %v, want %v", got, want)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// acquireOne begins a call in scope and acquires its first permit.
func acquireOne(t *testing.T, c *Client, scope string) (*Call, *Permit) {
	t.Helper()
	ctx := tctx(t)
	call, err := c.Begin(ctx, scope, CallOptions{})
	if err != nil {
		t.Fatal(err)
	}
	p, err := call.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	return call, p
}

func lastRequest(t *testing.T, s *fakeSidecar) request {
	t.Helper()
	e := s.entries()
	if len(e) == 0 {
		t.Fatal("no request")
	}
	return e[len(e)-1].req
}

func asSidecar(t *testing.T, err error, kind string) *SidecarError {
	t.Helper()
	var se *SidecarError
	if !errors.As(err, &se) {
		t.Fatalf("error %v (%T) is not a *SidecarError", err, err)
	}
	if se.Kind != kind {
		t.Fatalf("SidecarError kind %q (%v), want %q", se.Kind, se, kind)
	}
	return se
}

func TestSuccessCallIsStartAndFinish(t *testing.T) {
	s := startFake(t)
	c := dialFake(t, s)
	ctx := tctx(t)
	call, err := c.Begin(ctx, "chat", CallOptions{EstTokens: 1200, Priority: "interactive"})
	if err != nil {
		t.Fatal(err)
	}
	wantRequests(t, s) // Begin sends nothing
	p, err := call.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if p.Source != "a" || p.Attempt != 1 || p.IsProbe || p.EstTokens != 1200 {
		t.Fatalf("permit %v", p)
	}
	start := lastRequest(t, s)
	if start.spec.scope != "chat" || start.spec.estTokens != some(1200) || start.spec.priority != (optStr{"interactive", true}) {
		t.Fatalf("Start %+v", start.spec)
	}
	if err := p.Success(ctx, 812); err != nil {
		t.Fatal(err)
	}
	fin := lastRequest(t, s)
	if fin.target != p.ID || fin.outcome != (outcome{tag: outSuccess, tokens: some(812), countAttempt: true}) {
		t.Fatalf("Finish %+v", fin)
	}
	res, ok := p.Result()
	if !ok || !res.Applied || res.State != StateClosed {
		t.Fatalf("result %+v %v", res, ok)
	}
	if err := call.End(ctx); err != nil {
		t.Fatal(err)
	}
	wantRequests(t, s, "Start", "Finish") // End after a success sends nothing
	if _, err := call.Acquire(ctx); err == nil {
		t.Fatal("Acquire after the call ended")
	} else {
		asSidecar(t, err, "unknown_call")
	}
}

func TestHeldFailureTravelsWithRetry(t *testing.T) {
	s := startFake(t)
	c := dialFake(t, s)
	ctx := tctx(t)
	call, _ := c.Begin(ctx, "chat", CallOptions{})
	defer call.End(ctx)
	p1, err := call.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if err := p1.FailureWith(ctx, BadResult, Usage{Tokens: 740}); err != nil {
		t.Fatal(err)
	}
	wantRequests(t, s, "Start") // held
	p2, err := call.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	retry := lastRequest(t, s)
	if retry.tag != reqRetry || retry.target != p1.ID || retry.outcome != (outcome{tag: outFailureUsage, kind: 3, usage: usage{tokens: some(740)}}) {
		t.Fatalf("Retry %+v", retry)
	}
	if p2.Source != "b" || p2.Attempt != 2 {
		t.Fatalf("second permit %v, want source b attempt 2 (a demoted)", p2)
	}
	if err := p2.SuccessWith(ctx, SuccessOptions{Usage: Usage{InputTokens: 1200, OutputTokens: 334}}); err != nil {
		t.Fatal(err)
	}
	fin := lastRequest(t, s)
	if fin.outcome != (outcome{tag: outSuccessUsage, usage: usage{input: some(1200), output: some(334)}, countAttempt: true}) {
		t.Fatalf("Finish %+v", fin.outcome)
	}
	wantRequests(t, s, "Start", "Retry", "Finish")
	if err := p1.Failure(ctx, Timeout); err == nil {
		t.Fatal("a second report of the same permit was accepted")
	} else {
		asSidecar(t, err, "unknown_permit")
	}
}

func TestEndSendsHeldReportAsFinish(t *testing.T) {
	for _, tc := range []struct {
		name   string
		report func(ctx context.Context, p *Permit) error
		want   outcome
	}{
		{"rate limited", func(ctx context.Context, p *Permit) error { return p.RateLimited(ctx, 2500*time.Millisecond) }, outcome{tag: outRateLimited, retryAfter: optF64{2.5, true}}},
		{"rate limited without Retry-After", func(ctx context.Context, p *Permit) error { return p.RateLimited(ctx, 0) }, outcome{tag: outRateLimited}},
		{"cancel", func(ctx context.Context, p *Permit) error { return p.Cancel(ctx) }, outcome{tag: outCancelled}},
		{"failure", func(ctx context.Context, p *Permit) error { return p.Failure(ctx, ServerError) }, outcome{tag: outFailure, kind: 1}},
		{"not counted success", func(ctx context.Context, p *Permit) error {
			return p.SuccessWith(ctx, SuccessOptions{NotCounted: true, Usage: Usage{Tokens: 5}})
		}, outcome{tag: outSuccess, tokens: some(5)}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s := startFake(t)
			c := dialFake(t, s)
			ctx := tctx(t)
			call, _ := c.Begin(ctx, "chat", CallOptions{})
			p, err := call.Acquire(ctx)
			if err != nil {
				t.Fatal(err)
			}
			if err := tc.report(ctx, p); err != nil {
				t.Fatal(err)
			}
			if err := call.End(ctx); err != nil {
				t.Fatal(err)
			}
			wantRequests(t, s, "Start", "Finish")
			if got := lastRequest(t, s); got.target != p.ID || got.outcome != tc.want {
				t.Fatalf("Finish %+v, want %+v", got.outcome, tc.want)
			}
			if err := call.End(ctx); err != nil {
				t.Fatal("second End:", err)
			}
			wantRequests(t, s, "Start", "Finish")
		})
	}
}

func TestEndAbandonsUnreportedPermit(t *testing.T) {
	s := startFake(t)
	c := dialFake(t, s)
	ctx := tctx(t)
	call, p := acquireOne(t, c, "chat")
	if _, err := call.Acquire(ctx); err == nil {
		t.Fatal("Acquire with an unreported permit")
	} else {
		asSidecar(t, err, "busy")
	}
	// End with an already cancelled ctx still sends the EndCall.
	done, cancel := context.WithCancel(ctx)
	cancel()
	if err := call.End(done); err != nil && !errors.Is(err, context.Canceled) {
		t.Fatal(err)
	}
	wantRequests(t, s, "Start", "EndCall")
	if err := p.Success(ctx, 1); err == nil {
		t.Fatal("report after End accepted")
	}
	st, err := c.Status(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if sc := st.Scope("chat"); sc.Calls != 0 || sc.Source("a").InFlight != 0 {
		t.Fatalf("after End: %+v", sc)
	}
}

func TestEndWithoutAcquireSendsNothing(t *testing.T) {
	s := startFake(t)
	c := dialFake(t, s)
	ctx := tctx(t)
	call, _ := c.Begin(ctx, "chat", CallOptions{})
	if err := call.End(ctx); err != nil {
		t.Fatal(err)
	}
	if _, err := call.Acquire(ctx); err == nil {
		t.Fatal("Acquire after End")
	}
	if err := c.Ping(ctx); err != nil {
		t.Fatal(err)
	}
	wantRequests(t, s, "Ping")
}

func TestRetryExhausted(t *testing.T) {
	s := startFake(t, &fakeScope{name: "chat", sources: []string{"a", "b"}, maxAttempts: 3})
	c := dialFake(t, s)
	ctx := tctx(t)
	call, _ := c.Begin(ctx, "chat", CallOptions{})
	var sources []string
	for i := 0; i < 3; i++ {
		p, err := call.Acquire(ctx)
		if err != nil {
			t.Fatal(err)
		}
		sources = append(sources, p.Source)
		p.Failure(ctx, Timeout)
	}
	if !reflect.DeepEqual(sources, []string{"a", "b", "a"}) {
		t.Fatalf("sources %v", sources)
	}
	_, err := call.Acquire(ctx)
	var ex *AllSourcesExhaustedError
	if !errors.As(err, &ex) || ex.Reason != ReasonRetryExhausted || ex.Scope != "chat" || ex.Kind != "all_sources_exhausted" {
		t.Fatalf("error %v (%T)", err, err)
	}
	var gu *GatewayUnavailableError
	if !errors.As(err, &gu) || gu.Scope != "chat" {
		t.Fatalf("not a GatewayUnavailableError: %v", err)
	}
	if _, err2 := call.Acquire(ctx); err2 != err {
		t.Fatalf("a later Acquire: %v, want the call's final error", err2)
	}
	if err := call.End(ctx); err != nil {
		t.Fatal(err)
	}
	// After a Retry error the call is gone: no EndCall.
	wantRequests(t, s, "Start", "Retry", "Retry", "Retry")
}

func TestCircuitOpen(t *testing.T) {
	s := startFake(t, &fakeScope{name: "chat", sources: []string{"a", "b"}})
	c := dialFake(t, s)
	ctx := tctx(t)
	if err := c.ForceOpen(ctx, "a", 30*time.Second); err != nil {
		t.Fatal(err)
	}
	if err := c.ForceOpen(ctx, "b", 10*time.Second); err != nil {
		t.Fatal(err)
	}
	err := c.Run(ctx, "chat", CallOptions{}, func(ctx context.Context, p *Permit) error {
		t.Fatal("fn called")
		return nil
	})
	var co *CircuitOpenError
	if !errors.As(err, &co) {
		t.Fatalf("error %v (%T)", err, err)
	}
	if co.RetryAfter < 9*time.Second || co.RetryAfter > 10*time.Second {
		t.Fatalf("RetryAfter %v", co.RetryAfter)
	}
	if !reflect.DeepEqual(co.PerSourceReasons, map[string]string{"a": SkipCircuitOpen, "b": SkipCircuitOpen}) || co.Scope != "chat" {
		t.Fatalf("%+v", co)
	}
	if !strings.Contains(err.Error(), "open circuit") {
		t.Fatal(err)
	}
	var gu *GatewayUnavailableError
	if !errors.As(err, &gu) || gu.RetryAfter != co.RetryAfter {
		t.Fatal("CircuitOpenError does not unwrap to its GatewayUnavailableError")
	}
	var ex *AllSourcesExhaustedError
	if errors.As(err, &ex) {
		t.Fatal("a CircuitOpenError is not an AllSourcesExhaustedError")
	}
	if err := c.ForceClose(ctx, "a"); err != nil {
		t.Fatal(err)
	}
	if err := c.Reset(ctx, "b"); err != nil {
		t.Fatal(err)
	}
	wantRequests(t, s, "ForceOpen", "ForceOpen", "Start", "ForceClose", "Reset")
	if e := s.entries()[0].req; e.source != "a" || e.seconds != 30 {
		t.Fatalf("ForceOpen %+v", e)
	}
}

func TestAdminErrors(t *testing.T) {
	s := startFake(t)
	c := dialFake(t, s)
	ctx := tctx(t)
	asSidecar(t, c.ForceOpen(ctx, "a", 0), "invalid_argument")
	asSidecar(t, c.ForceOpen(ctx, "", time.Second), "invalid_argument")
	asSidecar(t, c.Reset(ctx, "bad\xff"), "invalid_argument")
	wantRequests(t, s) // refused locally
	se := asSidecar(t, c.ForceClose(ctx, "nope"), "invalid_argument")
	if !strings.Contains(se.Message, `"nope"`) {
		t.Fatal(se)
	}
	s.setHook(func(fc *fakeConn, id uint64, r *request) bool {
		fc.replyErr(id, kindPermissionDenied, "uid 1000 is not in admin_uids")
		return true
	})
	se = asSidecar(t, c.ForceOpen(ctx, "a", time.Second), "permission_denied")
	if !strings.Contains(se.Error(), "admin_uids") {
		t.Fatal(se)
	}
}

func TestUnknownScopeAndBadOptions(t *testing.T) {
	s := startFake(t)
	c := dialFake(t, s)
	ctx := tctx(t)
	call, err := c.Begin(ctx, "größe", CallOptions{})
	if err != nil {
		t.Fatal(err)
	}
	_, err = call.Acquire(ctx)
	se := asSidecar(t, err, "unknown_scope")
	if se.Scope != "größe" || !strings.Contains(se.Error(), "größe") {
		t.Fatal(se)
	}
	if _, err2 := call.Acquire(ctx); err2 != err {
		t.Fatal(err2)
	}
	call.End(ctx)
	wantRequests(t, s, "Start") // the second Acquire returns the final error; End sends nothing
	for _, o := range []CallOptions{{EstTokens: -1}, {EstTokens: 1_000_000_001}, {EstInputTokens: 600_000_000, EstOutputTokens: 600_000_000}, {Priority: "\xff"}} {
		if _, err := c.Begin(ctx, "chat", o); err == nil {
			t.Errorf("Begin with %+v accepted", o)
		} else {
			asSidecar(t, err, "invalid_argument")
		}
	}
	for _, scope := range []string{"", "bad\xffutf8"} {
		if _, err := c.Begin(ctx, scope, CallOptions{}); err == nil {
			t.Errorf("scope %q accepted", scope)
		}
	}
	call, _ = c.Begin(ctx, "chat", CallOptions{})
	p, err := call.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	asSidecar(t, p.Success(ctx, -5), "invalid_argument")
	asSidecar(t, p.SuccessWith(ctx, SuccessOptions{Usage: Usage{InputTokens: 2_000_000_000}}), "invalid_argument")
	asSidecar(t, p.RateLimited(ctx, -time.Second), "invalid_argument")
	asSidecar(t, p.Failure(ctx, FailureKind(9)), "invalid_argument")
	// The permit is still unreported after refused reports.
	if err := p.Success(ctx, 0); err != nil {
		t.Fatal(err)
	}
	if got := lastRequest(t, s).outcome; got != (outcome{tag: outSuccess, countAttempt: true}) {
		t.Fatalf("Success(0) sends no token count: %+v", got)
	}
}

// waitScope has one source the tests force open, so acquires wait.
func waitScope() *fakeScope { return &fakeScope{name: "slow", sources: []string{"w"}, wait: true} }

func TestAcquireCancelSendsCancel(t *testing.T) {
	s := startFake(t, waitScope())
	c := dialFake(t, s)
	ctx := tctx(t)
	if err := c.ForceOpen(ctx, "w", time.Hour); err != nil {
		t.Fatal(err)
	}
	call, _ := c.Begin(ctx, "slow", CallOptions{})
	defer call.End(ctx)
	cctx, cancel := context.WithCancel(ctx)
	time.AfterFunc(50*time.Millisecond, cancel)
	t0 := time.Now()
	_, err := call.Acquire(cctx)
	if !errors.Is(err, context.Canceled) {
		t.Fatalf("error %v", err)
	}
	if d := time.Since(t0); d < 40*time.Millisecond || d > 2*time.Second {
		t.Fatalf("returned after %v", d)
	}
	wantRequests(t, s, "ForceOpen", "Start", "Cancel")
	e := s.entries()
	if e[2].req.target != e[1].id {
		t.Fatalf("Cancel targets %d, the Start was %d", e[2].req.target, e[1].id)
	}
	// The call can be acquired again: a fresh Start.
	if err := c.ForceClose(ctx, "w"); err != nil {
		t.Fatal(err)
	}
	p, err := call.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if p.Attempt != 1 {
		t.Fatalf("attempt %d", p.Attempt)
	}
	wantRequests(t, s, "ForceOpen", "Start", "Cancel", "ForceClose", "Start")
}

func TestRunDeadlineSendsCancel(t *testing.T) {
	s := startFake(t, waitScope())
	c := dialFake(t, s)
	ctx := tctx(t)
	c.ForceOpen(ctx, "w", time.Hour)
	dctx, cancel := context.WithTimeout(ctx, 50*time.Millisecond)
	defer cancel()
	err := c.Run(dctx, "slow", CallOptions{}, func(ctx context.Context, p *Permit) error {
		t.Error("granted")
		return nil
	})
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("error %v", err)
	}
	wantRequests(t, s, "ForceOpen", "Start", "Cancel")
}

func TestRetryCancelledMidWait(t *testing.T) {
	s := startFake(t, &fakeScope{name: "slow", sources: []string{"w", "v"}, wait: true})
	c := dialFake(t, s)
	ctx := tctx(t)
	call, _ := c.Begin(ctx, "slow", CallOptions{})
	defer call.End(ctx)
	p, err := call.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	c.ForceOpen(ctx, "w", time.Hour)
	c.ForceOpen(ctx, "v", time.Hour)
	p.Failure(ctx, Timeout)
	dctx, cancel := context.WithTimeout(ctx, 50*time.Millisecond)
	defer cancel()
	if _, err := call.Acquire(dctx); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("error %v", err)
	}
	wantRequests(t, s, "Start", "ForceOpen", "ForceOpen", "Retry", "Cancel")
	if e := s.entries(); e[4].req.target != e[3].id {
		t.Fatal("Cancel does not target the Retry")
	}
}

// A Cancel that loses the race: the sidecar granted first. The late grant is
// handed back with Finish{Cancelled}.
func TestLateGrantIsReleased(t *testing.T) {
	s := startFake(t)
	c := dialFake(t, s)
	ctx := tctx(t)
	var startID atomic.Uint64
	s.setHook(func(fc *fakeConn, id uint64, r *request) bool {
		switch r.tag {
		case reqStart:
			startID.Store(id)
			return true // no answer yet
		case reqCancel:
			fc.reply(id, &reply{tag: repOk})
			fc.reply(r.target, &reply{tag: repStarted, call: 77, grant: grant{permit: 78, source: "a", attempt: 1}})
			return true
		case reqFinish:
			fc.reply(id, &reply{tag: repReported, applied: true})
			return true
		}
		return false
	})
	call, _ := c.Begin(ctx, "chat", CallOptions{})
	cctx, cancel := context.WithTimeout(ctx, 30*time.Millisecond)
	defer cancel()
	if _, err := call.Acquire(cctx); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatal(err)
	}
	wantRequests(t, s, "Start", "Cancel", "Finish")
	if fin := lastRequest(t, s); fin.target != 78 || fin.outcome.tag != outCancelled {
		t.Fatalf("Finish %+v", fin)
	}
	if err := call.End(ctx); err != nil {
		t.Fatal(err)
	}
	wantRequests(t, s, "Start", "Cancel", "Finish")
}

func TestConnectionLossFailsPendingAndRedials(t *testing.T) {
	s := startFake(t, waitScope(), &fakeScope{name: "chat", sources: []string{"a"}})
	c := dialFake(t, s)
	ctx := tctx(t)
	c.ForceOpen(ctx, "w", time.Hour)
	errs := make(chan error, 1)
	call, _ := c.Begin(ctx, "slow", CallOptions{})
	go func() {
		_, err := call.Acquire(ctx)
		errs <- err
	}()
	for len(s.requests()) < 2 {
		time.Sleep(2 * time.Millisecond)
	}
	s.dropConns()
	var err error
	select {
	case err = <-errs:
	case <-time.After(5 * time.Second):
		t.Fatal("the pending Acquire did not fail")
	}
	se := asSidecar(t, err, "connection")
	if !strings.Contains(se.Error(), s.path) {
		t.Fatal(se)
	}
	if err := call.End(ctx); err != nil {
		t.Fatal("End after a lost connection:", err)
	}
	// Next use dials again.
	if err := c.Run(ctx, "chat", CallOptions{}, func(ctx context.Context, p *Permit) error { return nil }); err != nil {
		t.Fatal(err)
	}
	if n := s.connCount(); n != 2 {
		t.Fatalf("%d connections, want 2", n)
	}
}

func TestConnectionLostMidCall(t *testing.T) {
	s := startFake(t)
	c := dialFake(t, s)
	ctx := tctx(t)
	call, p := acquireOne(t, c, "chat")
	s.dropConns()
	time.Sleep(20 * time.Millisecond)
	asSidecar(t, p.Success(ctx, 3), "connection")
	if _, err := call.Acquire(ctx); err == nil {
		t.Fatal("Acquire on a call of a lost connection")
	}
	if err := call.End(ctx); err != nil {
		t.Fatal(err)
	}
}

func TestVersion1Sidecar(t *testing.T) {
	s := startFake(t)
	s.version = 1
	_, err := Dial(tctx(t), s.path)
	se := asSidecar(t, err, "protocol_violation")
	for _, want := range []string{"protocol version 1", "needs version 2", "upgrade polygate-sidecar", s.path} {
		if !strings.Contains(se.Error(), want) {
			t.Errorf("%q does not say %q", se.Error(), want)
		}
	}
	s.version, s.welcomeVersion = 2, 1
	_, err = Dial(tctx(t), s.path)
	asSidecar(t, err, "protocol_violation")
}

func TestDialPaths(t *testing.T) {
	s := startFake(t)
	ctx := tctx(t)
	t.Setenv(SocketEnv, s.path)
	c, err := Dial(ctx, "")
	if err != nil {
		t.Fatal(err)
	}
	if c.Path() != s.path {
		t.Fatal(c.Path())
	}
	c.Close()
	missing := filepath.Join(t.TempDir(), "none.sock")
	_, err = Dial(ctx, missing)
	se := asSidecar(t, err, "connection")
	if !strings.Contains(se.Error(), missing) || !strings.Contains(se.Error(), "is polygate-sidecar running") || !errors.Is(err, os.ErrNotExist) {
		t.Fatal(se)
	}
	t.Setenv(SocketEnv, "")
	t.Setenv("XDG_RUNTIME_DIR", t.TempDir())
	def, err := DefaultSocketPath()
	if err != nil {
		t.Fatal(err)
	}
	c, err = Dial(ctx, "")
	if err == nil {
		c.Close()
	} else if !strings.Contains(err.Error(), def) {
		t.Fatal(err)
	}
	cctx, cancel := context.WithCancel(ctx)
	cancel()
	if _, err := Dial(cctx, s.path); !errors.Is(err, context.Canceled) {
		t.Fatal(err)
	}
}

func TestHandshakeTimeout(t *testing.T) {
	// A listener that accepts and never answers.
	dir := t.TempDir()
	path := filepath.Join(dir, "mute.sock")
	ln, err := net.Listen("unix", path)
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	defer cancel()
	if _, err := Dial(ctx, path); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("error %v", err)
	}
}

func TestIDZeroErrorEndsConnection(t *testing.T) {
	s := startFake(t, waitScope())
	c := dialFake(t, s)
	ctx := tctx(t)
	c.ForceOpen(ctx, "w", time.Hour)
	s.setHook(func(fc *fakeConn, id uint64, r *request) bool {
		if r.tag == reqStart {
			fc.replyErr(0, kindOverloaded, "too many connections (max_connections = 1024); retry later")
			return true
		}
		return false
	})
	err := c.Run(ctx, "slow", CallOptions{}, func(ctx context.Context, p *Permit) error { return nil })
	se := asSidecar(t, err, "overloaded")
	if !strings.Contains(se.Message, "max_connections") {
		t.Fatal(se)
	}
}

func TestUndecodableReplyEndsConnection(t *testing.T) {
	for name, frame := range map[string][]byte{
		"unknown reply tag": append(binary.BigEndian.AppendUint32(nil, 12), []byte{1, 0, 0, 0, 0, 0, 0, 0, 99, 0, 0, 0}...),
		"oversize frame":    binary.BigEndian.AppendUint32(nil, 17<<20),
	} {
		t.Run(name, func(t *testing.T) {
			s := startFake(t)
			c := dialFake(t, s)
			s.setHook(func(fc *fakeConn, id uint64, r *request) bool {
				fc.wmu.Lock()
				fc.nc.Write(frame)
				fc.wmu.Unlock()
				return true
			})
			err := c.Ping(tctx(t))
			var se *SidecarError
			if !errors.As(err, &se) || (se.Kind != "protocol" && se.Kind != "connection") {
				t.Fatalf("error %v", err)
			}
		})
	}
}

func TestLargeStatusAndFrameLimit(t *testing.T) {
	var scopes []*fakeScope
	for i := 0; i < 400; i++ {
		var srcs []string
		for j := 0; j < 10; j++ {
			srcs = append(srcs, fmt.Sprintf("source-%03d-%d-%s", i, j, strings.Repeat("x", 20)))
		}
		scopes = append(scopes, &fakeScope{name: fmt.Sprintf("scope-%03d", i), sources: srcs})
	}
	s := startFake(t, scopes...)
	c := dialFake(t, s)
	ctx := tctx(t)
	st, err := c.Status(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if len(st.Raw) <= 1<<20 || len(st.Scopes) != 400 || len(st.Scopes[399].Sources) != 10 {
		t.Fatalf("status of %d bytes, %d scopes", len(st.Raw), len(st.Scopes))
	}
	// A request beyond max_frame is refused here, and the connection stays usable.
	call, _ := c.Begin(ctx, strings.Repeat("s", 70000), CallOptions{})
	_, err = call.Acquire(ctx)
	se := asSidecar(t, err, "invalid_argument")
	if !strings.Contains(se.Message, "max_frame") {
		t.Fatal(se)
	}
	if err := c.Ping(ctx); err != nil {
		t.Fatal(err)
	}
}

func TestStatusTypedAndForwardCompatible(t *testing.T) {
	s := startFake(t)
	c := dialFake(t, s)
	ctx := tctx(t)
	if err := c.Run(ctx, "chat", CallOptions{}, func(ctx context.Context, p *Permit) error { return nil }); err != nil {
		t.Fatal(err)
	}
	st, err := c.Status(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if st.SidecarVersion != "0.2.0-fake" || st.Backend != "memory" || st.ProtocolVersion != 2 {
		t.Fatalf("%+v", st)
	}
	if string(st.Extra["future_top_key"]) != `"x"` {
		t.Fatalf("extra %v", st.Extra)
	}
	sc := st.Scope("chat")
	if sc == nil || sc.CircuitOpen != "fail_fast" || sc.Calls != 0 || sc.Extra["priorities"] == nil {
		t.Fatalf("%+v", sc)
	}
	a := sc.Source("a")
	if a.State != StateClosed || a.WindowSuccesses != 1 || a.Epoch != 1<<63+1 || a.PacerCeiling != 8 ||
		a.TokensAvailable == nil || *a.TokensAvailable != 1500.5 || a.RequestsAvailable != nil || a.Extra["future_source_key"] == nil {
		t.Fatalf("%+v", a)
	}
	if st.Scope("nope") != nil || sc.Source("nope") != nil {
		t.Fatal("lookup of unknown names")
	}
	if _, err := parseStatus([]byte(`{"scopes": [{"name": 3}]}`)); err == nil {
		t.Fatal("a status with a mistyped key")
	} else {
		asSidecar(t, err, "protocol")
	}
}

func TestCloseFailsPending(t *testing.T) {
	s := startFake(t, waitScope())
	c := dialFake(t, s)
	ctx := tctx(t)
	c.ForceOpen(ctx, "w", time.Hour)
	call, _ := c.Begin(ctx, "slow", CallOptions{})
	errs := make(chan error, 1)
	go func() {
		_, err := call.Acquire(ctx)
		errs <- err
	}()
	for len(s.requests()) < 2 {
		time.Sleep(2 * time.Millisecond)
	}
	c.Close()
	asSidecar(t, <-errs, "connection")
	asSidecar(t, c.Ping(ctx), "connection")
	if _, err := c.Begin(ctx, "slow", CallOptions{}); err == nil {
		t.Fatal("Begin on a closed client")
	}
	c.Close()
}

func TestRetryValidationErrorKeepsPermit(t *testing.T) {
	s := startFake(t)
	c := dialFake(t, s)
	ctx := tctx(t)
	var refused atomic.Bool
	s.setHook(func(fc *fakeConn, id uint64, r *request) bool {
		if r.tag == reqRetry && !refused.Swap(true) {
			fc.replyErr(id, kindInvalidArgument, "retry_after_s must be >= 0")
			return true
		}
		return false
	})
	call, _ := c.Begin(ctx, "chat", CallOptions{})
	defer call.End(ctx)
	p, _ := call.Acquire(ctx)
	p.RateLimited(ctx, time.Second)
	_, err := call.Acquire(ctx)
	asSidecar(t, err, "invalid_argument")
	// nothing changed: the permit may be reported again
	if err := p.Failure(ctx, Timeout); err != nil {
		t.Fatal(err)
	}
	p2, err := call.Acquire(ctx)
	if err != nil || p2.Attempt != 2 {
		t.Fatal(p2, err)
	}
}

func TestRetryUnknownPermitFallsBackToAcquire(t *testing.T) {
	s := startFake(t)
	c := dialFake(t, s)
	ctx := tctx(t)
	s.setHook(func(fc *fakeConn, id uint64, r *request) bool {
		if r.tag == reqRetry {
			// the lease ran out: the sidecar reclaimed the permit itself
			fc.mu.Lock()
			p := fc.permits[r.target]
			delete(fc.permits, r.target)
			fc.calls[p.call].permit = 0
			fc.mu.Unlock()
			fc.s.mu.Lock()
			fc.s.stats[p.source].inFlight--
			fc.s.mu.Unlock()
			fc.replyErr(id, kindUnknownPermit, fmt.Sprintf("no permit %d on this connection", r.target))
			return true
		}
		return false
	})
	call, p := acquireOne(t, c, "chat")
	p.Failure(ctx, Timeout)
	p2, err := call.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if p2.Attempt != 2 {
		t.Fatal(p2)
	}
	if err := p2.Success(ctx, 1); err != nil {
		t.Fatal(err)
	}
	wantRequests(t, s, "Start", "Retry", "Acquire", "Finish")
}

func TestFinishUnknownPermitEndsCall(t *testing.T) {
	s := startFake(t)
	c := dialFake(t, s)
	ctx := tctx(t)
	s.setHook(func(fc *fakeConn, id uint64, r *request) bool {
		if r.tag == reqFinish {
			fc.replyErr(id, kindUnknownPermit, "no permit")
			return true
		}
		return false
	})
	call, p := acquireOne(t, c, "chat")
	asSidecar(t, p.Success(ctx, 1), "unknown_permit")
	call.End(ctx)
	wantRequests(t, s, "Start", "Finish", "EndCall")
}

// manyCalls makes n concurrent Runs in scope "chat" on c: call i fails its first
// attempt with failure when i%failEvery == 0, checks that every permit it gets is
// its own call's (EstTokens = i+1), and every tenth call also asks for Status. It
// returns how many first attempts failed.
func manyCalls(t *testing.T, c *Client, n, failEvery int, failure error) int {
	t.Helper()
	ctx := tctx(t)
	var wg sync.WaitGroup
	var failed atomic.Int64
	errs := make(chan error, 2*n)
	for i := 0; i < n; i++ {
		wg.Add(1)
		go func(i int) {
			defer wg.Done()
			err := c.Run(ctx, "chat", CallOptions{EstTokens: i + 1}, func(ctx context.Context, p *Permit) error {
				if p.EstTokens != uint64(i+1) {
					return fmt.Errorf("call %d got the permit of another call: %v", i, p)
				}
				if i%failEvery == 0 && p.Attempt == 1 {
					failed.Add(1)
					return failure
				}
				p.SetTokens(i)
				return nil
			})
			if err != nil {
				errs <- fmt.Errorf("call %d: %w", i, err)
			}
			if i%10 == 0 {
				if _, err := c.Status(ctx); err != nil {
					errs <- err
				}
			}
		}(i)
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	return int(failed.Load())
}

func TestManyGoroutinesShareOneConnection(t *testing.T) {
	s := startFake(t, &fakeScope{name: "chat", sources: []string{"a", "b", "c"}, maxAttempts: 5})
	c := dialFake(t, s)
	ctx := tctx(t)
	const n = 1000
	failed := manyCalls(t, c, n, 7, context.DeadlineExceeded) // a timeout: the next attempt fails over
	if s.connCount() != 1 {
		t.Fatalf("%d connections", s.connCount())
	}
	st, err := c.Status(ctx)
	if err != nil {
		t.Fatal(err)
	}
	total := 0
	for _, src := range st.Scope("chat").Sources {
		total += int(src.WindowSuccesses)
		if src.InFlight != 0 {
			t.Fatalf("%s: %d in flight", src.Name, src.InFlight)
		}
	}
	if total != n || st.Scope("chat").Calls != 0 {
		t.Fatalf("%d successes, %d calls left", total, st.Scope("chat").Calls)
	}
	counts := map[string]int{}
	for _, r := range s.requests() {
		counts[r]++
	}
	if counts["Start"] != n || counts["Finish"] != n || counts["Retry"] != failed {
		t.Fatalf("frames %v (%d failures)", counts, failed)
	}
}

func TestDefaultSocketFor(t *testing.T) {
	for _, c := range []struct {
		uid  int
		xdg  string
		want string
	}{
		{0, "/run/user/0", "/run/polygate/sidecar.sock"},
		{0, "", "/run/polygate/sidecar.sock"},
		{1000, "/run/user/1000", "/run/user/1000/polygate/sidecar.sock"},
		{1000, "/run/user/1000/", "/run/user/1000/polygate/sidecar.sock"},
	} {
		got, err := DefaultSocketFor(c.uid, c.xdg)
		if err != nil || got != c.want {
			t.Fatalf("DefaultSocketFor(%d, %q) = %q, %v; want %q", c.uid, c.xdg, got, err, c.want)
		}
	}
	for _, xdg := range []string{"", "relative"} {
		_, err := DefaultSocketFor(1000, xdg)
		se := asSidecar(t, err, "connection")
		for _, w := range []string{"uid 1000", "XDG_RUNTIME_DIR", "POLYGATE_SOCKET"} {
			if !strings.Contains(se.Error(), w) {
				t.Fatalf("%q missing: %v", w, se)
			}
		}
	}
}

func TestPermissionErrorNamesTheSetting(t *testing.T) {
	se := connectError("/x.sock", &net.OpError{Op: "dial", Net: "unix", Err: os.ErrPermission})
	if !strings.Contains(se.Error(), "POLYGATE_SOCKET") || !strings.Contains(se.Error(), "socket_mode") {
		t.Fatal(se)
	}
	if strings.Contains(connectError("/x.sock", errors.New("other")).Error(), "socket_mode") {
		t.Fatal("the hint is for permission errors only")
	}
}
