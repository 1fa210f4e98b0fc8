package polygate

// End-to-end tests against the real daemon, on the memory and the Redis backend.

import (
	"context"
	"errors"
	"fmt"
	"os"
	"strings"
	"testing"
	"time"
)

var backends = []string{"memory", "redis"}

const e2eConfig = `
[scopes.chat]
circuit_open = "fail_fast"
quota_full = "wait"
max_attempts = 3
poll_interval = "20ms"
stall_window = "20s"

[scopes.chat.breaker]
failure_threshold = 1000
min_calls = 100000

[scopes.chat.pacer]
initial = 64
max = 64

[[scopes.chat.sources]]
name = "a"
timeout = "5s"

[[scopes.chat.sources]]
name = "b"
timeout = "5s"

[scopes.slow]
circuit_open = "wait"
quota_full = "wait"
poll_interval = "20ms"
stall_window = "20s"

[[scopes.slow.sources]]
name = "w"
timeout = "5s"
`

func eachBackend(t *testing.T, f func(t *testing.T, d *daemon)) {
	for _, backend := range backends {
		t.Run(backend, func(t *testing.T) {
			f(t, startSidecar(t, e2eConfig, backend))
		})
	}
}

func TestE2ERunFailsOver(t *testing.T) {
	eachBackend(t, func(t *testing.T, d *daemon) {
		c := d.dial(t)
		ctx := tctx(t)
		var seen []string
		err := c.Run(ctx, "chat", CallOptions{EstTokens: 100}, func(ctx context.Context, p *Permit) error {
			seen = append(seen, fmt.Sprintf("%s/%d", p.Source, p.Attempt))
			if p.Source == "a" {
				return context.DeadlineExceeded
			}
			p.SetTokens(80)
			return nil
		})
		if err != nil {
			t.Fatal(err)
		}
		if strings.Join(seen, " ") != "a/1 b/2" {
			t.Fatal(seen)
		}
		st, err := c.Status(ctx)
		if err != nil {
			t.Fatal(err)
		}
		sc := st.Scope("chat")
		a, b := sc.Source("a"), sc.Source("b")
		if sc.Calls != 0 || a.WindowFailures != 1 || a.Streak != 1 || b.WindowSuccesses != 1 || a.InFlight+b.InFlight != 0 {
			t.Fatalf("scope %+v\na %+v\nb %+v", sc, a, b)
		}
		wantBackend := d.backendName()
		if st.Backend != wantBackend || st.ProtocolVersion != 3 || st.SidecarVersion == "" {
			t.Fatalf("status %q %d %q", st.Backend, st.ProtocolVersion, st.SidecarVersion)
		}
	})
}

func (d *daemon) backendName() string {
	raw, _ := os.ReadFile(d.config)
	if strings.Contains(string(raw), `backend = "redis"`) {
		return "redis"
	}
	return "memory"
}

func TestE2EErrorsAndAdmin(t *testing.T) {
	eachBackend(t, func(t *testing.T, d *daemon) {
		c := d.dial(t)
		ctx := tctx(t)
		if err := c.ForceOpen(ctx, "a", 30*time.Second); err != nil {
			t.Fatal(err)
		}
		if err := c.ForceOpen(ctx, "b", 5*time.Second); err != nil {
			t.Fatal(err)
		}
		err := c.Run(ctx, "chat", CallOptions{}, func(ctx context.Context, p *Permit) error { return nil })
		var co *CircuitOpenError
		if !errors.As(err, &co) || co.Scope != "chat" || co.RetryAfter < 4*time.Second || co.RetryAfter > 5*time.Second ||
			co.PerSourceReasons["a"] != SkipCircuitOpen || co.PerSourceReasons["b"] != SkipCircuitOpen {
			t.Fatalf("error %#v", err)
		}
		se := asSidecar(t, c.ForceOpen(ctx, "no-such-source", time.Second), "invalid_argument")
		if !strings.Contains(se.Message, "no-such-source") {
			t.Fatal(se)
		}
		if err := c.ForceClose(ctx, "a"); err != nil {
			t.Fatal(err)
		}
		if err := c.Reset(ctx, "b"); err != nil {
			t.Fatal(err)
		}
		call, _ := c.Begin(ctx, "no-such-scope", CallOptions{})
		_, err = call.Acquire(ctx)
		asSidecar(t, err, "unknown_scope")
		call.End(ctx)
		call, _ = c.Begin(ctx, "chat", CallOptions{Priority: "interactive"})
		_, err = call.Acquire(ctx)
		se = asSidecar(t, err, "invalid_argument")
		if !strings.Contains(se.Message, "chat") {
			t.Fatal(se)
		}
		call.End(ctx)
		// Retry exhaustion through Run.
		err = c.Run(ctx, "chat", CallOptions{}, func(ctx context.Context, p *Permit) error {
			return &HTTPError{StatusCode: 503}
		})
		var ex *AllSourcesExhaustedError
		if !errors.As(err, &ex) || ex.Reason != ReasonRetryExhausted {
			t.Fatalf("error %v", err)
		}
		// A 429 with Retry-After blocks the source's quota.
		err = c.Run(ctx, "chat", CallOptions{}, func(ctx context.Context, p *Permit) error {
			if p.Attempt == 1 {
				return throttled429(3 * time.Second)
			}
			return nil
		})
		if err != nil {
			t.Fatal(err)
		}
		st, _ := c.Status(ctx)
		if qb := st.Scope("chat").Source("a").QuotaBlocked; qb < 2*time.Second || qb > 3*time.Second {
			t.Fatalf("quota blocked for %v", qb)
		}
	})
}

// throttled429 is a caller's error with an HTTP 429 and a Retry-After.
func throttled429(after time.Duration) error {
	return statusRetryErr{statusErr{429, after}}
}

func TestE2ECancelAndDeadline(t *testing.T) {
	eachBackend(t, func(t *testing.T, d *daemon) {
		c := d.dial(t)
		ctx := tctx(t)
		if err := c.ForceOpen(ctx, "w", time.Hour); err != nil {
			t.Fatal(err)
		}
		call, _ := c.Begin(ctx, "slow", CallOptions{})
		dctx, cancel := context.WithTimeout(ctx, 200*time.Millisecond)
		defer cancel()
		t0 := time.Now()
		if _, err := call.Acquire(dctx); !errors.Is(err, context.DeadlineExceeded) {
			t.Fatalf("error %v", err)
		}
		if d := time.Since(t0); d > 2*time.Second {
			t.Fatalf("took %v", d)
		}
		call.End(ctx)
		waitStatus(t, c, func(st *Status) bool { sc := st.Scope("slow"); return sc.Waiters == 0 && sc.Calls == 0 })
		if err := c.ForceClose(ctx, "w"); err != nil {
			t.Fatal(err)
		}
		if err := c.Run(ctx, "slow", CallOptions{}, func(ctx context.Context, p *Permit) error { return nil }); err != nil {
			t.Fatal(err)
		}
	})
}

func waitStatus(t *testing.T, c *Client, ok func(*Status) bool) *Status {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for {
		st, err := c.Status(tctx(t))
		if err != nil {
			t.Fatal(err)
		}
		if ok(st) {
			return st
		}
		if time.Now().After(deadline) {
			t.Fatalf("status never matched: %s", st.Raw)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func TestE2EThousandGoroutinesOneClient(t *testing.T) {
	eachBackend(t, func(t *testing.T, d *daemon) {
		c := d.dial(t)
		const n = 1000
		retried := manyCalls(t, c, n, 5, &HTTPError{StatusCode: 500})
		st := waitStatus(t, c, func(st *Status) bool { return st.Scope("chat").Calls == 0 })
		sc := st.Scope("chat")
		a, b := sc.Source("a"), sc.Source("b")
		if got := a.WindowSuccesses + b.WindowSuccesses; got != n {
			t.Fatalf("%d successes, want %d", got, n)
		}
		if got := a.WindowFailures + b.WindowFailures; got != uint64(retried) {
			t.Fatalf("%d failures, want %d", got, retried)
		}
		if a.InFlight+b.InFlight != 0 || sc.Waiters != 0 {
			t.Fatalf("left behind: %s", st.Raw)
		}
	})
}

func TestE2ESidecarRestartRedials(t *testing.T) {
	d := startSidecar(t, e2eConfig, "memory")
	c := d.dial(t)
	ctx := tctx(t)
	if err := c.ForceOpen(ctx, "w", time.Hour); err != nil {
		t.Fatal(err)
	}
	call, _ := c.Begin(ctx, "slow", CallOptions{})
	errc := make(chan error, 1)
	go func() {
		_, err := call.Acquire(ctx)
		errc <- err
	}()
	waitStatus(t, c, func(st *Status) bool { return st.Scope("slow").Waiters == 1 })
	d.kill()
	select {
	case err := <-errc:
		asSidecar(t, err, "connection")
	case <-time.After(5 * time.Second):
		t.Fatal("the waiting Acquire did not fail when the sidecar died")
	}
	call.End(ctx)
	err := c.Ping(ctx)
	asSidecar(t, err, "connection") // nobody listens: the redial fails
	d.start(sidecarBin(t))
	if err := c.Run(ctx, "chat", CallOptions{}, func(ctx context.Context, p *Permit) error { return nil }); err != nil {
		t.Fatal("after the restart:", err)
	}
}

func TestE2EAdminNeedsAdminUID(t *testing.T) {
	config := "[sidecar]\nadmin_uids = [" + fmt.Sprint(os.Getuid()+1) + "]\n" + e2eConfig
	d := startSidecar(t, config, "memory")
	c := d.dial(t)
	ctx := tctx(t)
	se := asSidecar(t, c.ForceOpen(ctx, "a", time.Second), "permission_denied")
	if !strings.Contains(se.Message, "admin_uids") {
		t.Fatal(se)
	}
	if _, err := c.Status(ctx); err != nil {
		t.Fatal("status needs no admin right:", err)
	}
}

func TestE2EShutdownEndsWaits(t *testing.T) {
	d := startSidecar(t, e2eConfig, "memory")
	c := d.dial(t)
	ctx := tctx(t)
	c.ForceOpen(ctx, "w", time.Hour)
	errc := make(chan error, 1)
	go func() {
		errc <- c.Run(ctx, "slow", CallOptions{}, func(ctx context.Context, p *Permit) error { return nil })
	}()
	waitStatus(t, c, func(st *Status) bool { return st.Scope("slow").Waiters == 1 })
	d.stop() // SIGTERM
	select {
	case err := <-errc:
		var se *SidecarError
		if !errors.As(err, &se) || (se.Kind != "shutting_down" && se.Kind != "connection") {
			t.Fatalf("error %v", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the wait did not end on SIGTERM")
	}
}

// BenchmarkE2ECall measures full success calls (Start + Finish) from parallel
// goroutines on one client against the real daemon (go test -bench E2ECall).
func BenchmarkE2ECall(b *testing.B) {
	d := startSidecar(b, e2eConfig, "memory")
	c := d.dial(b)
	ctx := context.Background()
	b.ReportAllocs()
	b.SetParallelism(32)
	b.ResetTimer()
	b.RunParallel(func(pb *testing.PB) {
		for pb.Next() {
			call, err := c.Begin(ctx, "chat", CallOptions{})
			if err != nil {
				b.Error(err)
				return
			}
			p, err := call.Acquire(ctx)
			if err != nil {
				b.Error(err)
				return
			}
			if err := p.Success(ctx, 1); err != nil {
				b.Error(err)
				return
			}
		}
	})
}
