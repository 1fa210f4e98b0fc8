package polygate

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"os"
	"strings"
	"syscall"
	"testing"
	"time"
)

// statusErr is a caller's own error type exposing an HTTP status (and optionally
// a Retry-After) through the documented interfaces.
type statusErr struct {
	code  int
	after time.Duration
}

func (e statusErr) Error() string   { return fmt.Sprintf("HTTP %d", e.code) }
func (e statusErr) HTTPStatus() int { return e.code }

type statusRetryErr struct{ statusErr }

func (e statusRetryErr) RetryAfter() time.Duration { return e.after }

type timeoutErr struct{}

func (timeoutErr) Error() string   { return "i/o timeout" }
func (timeoutErr) Timeout() bool   { return true }
func (timeoutErr) Temporary() bool { return true }

func TestClassify(t *testing.T) {
	hdr := http.Header{}
	hdr.Set("Retry-After", "7")
	cases := []struct {
		err  error
		want Verdict
	}{
		{statusRetryErr{statusErr{429, 3 * time.Second}}, Throttled(3 * time.Second)},
		{fmt.Errorf("wrapped: %w", statusErr{429, 0}), Throttled(0)},
		{&HTTPError{StatusCode: 429, Header: hdr}, Throttled(7 * time.Second)},
		{statusErr{408, 0}, Failed(Timeout)},
		{statusErr{500, 0}, Failed(ServerError)},
		{&HTTPError{StatusCode: 503}, Failed(ServerError)},
		{statusErr{400, 0}, Fatal()},
		{statusErr{404, 0}, Fatal()},
		{context.DeadlineExceeded, Failed(Timeout)},
		{fmt.Errorf("upstream: %w", context.DeadlineExceeded), Failed(Timeout)},
		{os.ErrDeadlineExceeded, Failed(Timeout)},
		{timeoutErr{}, Failed(Timeout)},
		{&url.Error{Op: "Post", URL: "https://x", Err: timeoutErr{}}, Failed(Timeout)},
		{&url.Error{Op: "Post", URL: "https://x", Err: errors.New("refused")}, Failed(Connection)},
		{&net.OpError{Op: "dial", Net: "tcp", Err: syscall.ECONNREFUSED}, Failed(Connection)},
		{fmt.Errorf("read: %w", syscall.ECONNRESET), Failed(Connection)},
		{syscall.EPIPE, Failed(Connection)},
		{io.ErrUnexpectedEOF, Failed(Connection)},
		{context.Canceled, Abandon()},
		{errors.New("bad json"), Failed(Error)},
		{statusErr{302, 0}, Failed(Error)},
	}
	for _, c := range cases {
		if got := Classify(c.err); got != c.want {
			t.Errorf("Classify(%v) = %v, want %v", c.err, got, c.want)
		}
	}
}

func TestRetryAfterHeader(t *testing.T) {
	now := time.Date(2026, 12, 1, 12, 0, 0, 0, time.UTC)
	h := func(kv ...string) http.Header {
		out := http.Header{}
		for i := 0; i < len(kv); i += 2 {
			out.Set(kv[i], kv[i+1])
		}
		return out
	}
	for _, c := range []struct {
		h    http.Header
		want time.Duration
	}{
		{h(), 0},
		{h("Retry-After", "2.5"), 2500 * time.Millisecond},
		{h("Retry-After", "-1"), 0},
		{h("Retry-After", "soon"), 0},
		{h("Retry-After", now.Add(90*time.Second).Format(http.TimeFormat)), 90 * time.Second},
		{h("Retry-After", now.Add(-time.Minute).Format(http.TimeFormat)), 0},
		{h("Retry-After", "10", "Retry-After-Ms", "1500"), 1500 * time.Millisecond},
	} {
		if got := RetryAfterHeader(c.h, now); got != c.want {
			t.Errorf("%v: %v, want %v", c.h, got, c.want)
		}
	}
	resp := &http.Response{StatusCode: 429, Status: "429 Too Many Requests", Header: h("Retry-After", "4")}
	e := ResponseError(resp)
	if e.HTTPStatus() != 429 || e.RetryAfter() != 4*time.Second || !strings.Contains(e.Error(), "429 Too Many Requests") {
		t.Fatal(e)
	}
}

func TestRunFailsOverAndReports(t *testing.T) {
	s := startFake(t)
	c := dialFake(t, s)
	ctx := tctx(t)
	var seen []string
	err := c.Run(ctx, "chat", CallOptions{EstTokens: 50}, func(ctx context.Context, p *Permit) error {
		seen = append(seen, p.Source)
		switch p.Source {
		case "a":
			return statusRetryErr{statusErr{429, 3 * time.Second}}
		case "b":
			p.SetTokens(99) // a failure's tokens are charged too
			return fmt.Errorf("upstream: %w", syscall.ECONNRESET)
		}
		p.SetUsage(Usage{InputTokens: 10, OutputTokens: 5})
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if strings.Join(seen, ",") != "a,b,c" {
		t.Fatal(seen)
	}
	wantRequests(t, s, "Start", "Retry", "Retry", "Finish")
	e := s.entries()
	if o := e[1].req.outcome; o != (outcome{tag: outRateLimited, retryAfter: optF64{3, true}}) {
		t.Errorf("first report %+v", o)
	}
	if o := e[2].req.outcome; o != (outcome{tag: outFailureUsage, kind: uint32(Connection), usage: usage{tokens: some(99)}}) {
		t.Errorf("second report %+v", o)
	}
	if o := e[3].req.outcome; o != (outcome{tag: outSuccessUsage, usage: usage{input: some(10), output: some(5)}, countAttempt: true}) {
		t.Errorf("success %+v", o)
	}
}

func TestRunFatalReturnsAtOnce(t *testing.T) {
	s := startFake(t)
	c := dialFake(t, s)
	ctx := tctx(t)
	calls := 0
	bad := statusErr{400, 0}
	err := c.Run(ctx, "chat", CallOptions{}, func(ctx context.Context, p *Permit) error {
		calls++
		return bad
	})
	if err != bad || calls != 1 {
		t.Fatalf("error %v after %d calls", err, calls)
	}
	// The upstream answered: a success kept out of the breaker's statistics.
	wantRequests(t, s, "Start", "Finish")
	if o := lastRequest(t, s).outcome; o != (outcome{tag: outSuccess, countAttempt: false}) {
		t.Fatalf("report %+v", o)
	}
}

func TestRunExhaustedReturnsGatewayError(t *testing.T) {
	s := startFake(t, &fakeScope{name: "chat", sources: []string{"a", "b"}, maxAttempts: 2})
	c := dialFake(t, s)
	ctx := tctx(t)
	err := c.Run(ctx, "chat", CallOptions{}, func(ctx context.Context, p *Permit) error {
		return statusErr{502, 0}
	})
	var ex *AllSourcesExhaustedError
	if !errors.As(err, &ex) || ex.Reason != ReasonRetryExhausted {
		t.Fatalf("error %v", err)
	}
	wantRequests(t, s, "Start", "Retry", "Retry")
	st, _ := c.Status(ctx)
	if f := st.Scope("chat").Source("a").WindowFailures; f != 1 {
		t.Fatalf("a: %d failures", f)
	}
}

func TestRunParentCancelledCancelsPermit(t *testing.T) {
	s := startFake(t)
	c := dialFake(t, s)
	ctx, cancel := context.WithCancel(tctx(t))
	err := c.Run(ctx, "chat", CallOptions{}, func(ctx context.Context, p *Permit) error {
		cancel()
		<-ctx.Done()
		return ctx.Err()
	})
	if !errors.Is(err, context.Canceled) {
		t.Fatalf("error %v", err)
	}
	wantRequests(t, s, "Start", "Finish")
	if o := lastRequest(t, s).outcome; o.tag != outCancelled {
		t.Fatalf("report %+v", o)
	}
}

func TestRunClassifyHook(t *testing.T) {
	s := startFake(t)
	c := dialFake(t, s)
	ctx := tctx(t)
	quota := errors.New("insufficient_quota")
	attempts := 0
	err := c.Run(ctx, "chat", CallOptions{Classify: func(err error) Verdict {
		if errors.Is(err, quota) {
			return Throttled(time.Minute)
		}
		return Verdict{} // the built-in rules
	}}, func(ctx context.Context, p *Permit) error {
		attempts++
		if attempts == 1 {
			return quota
		}
		if attempts == 2 {
			return statusErr{400, 0}
		}
		return nil
	})
	if err == nil || attempts != 2 {
		t.Fatalf("error %v after %d attempts", err, attempts)
	}
	if o := s.entries()[1].req.outcome; o != (outcome{tag: outRateLimited, retryAfter: optF64{60, true}}) {
		t.Fatalf("hook's verdict not reported: %+v", o)
	}
}

func TestRunPanicEndsCall(t *testing.T) {
	s := startFake(t)
	c := dialFake(t, s)
	ctx := tctx(t)
	func() {
		defer func() {
			if recover() == nil {
				t.Fatal("no panic")
			}
		}()
		c.Run(ctx, "chat", CallOptions{}, func(ctx context.Context, p *Permit) error { panic("boom") })
	}()
	wantRequests(t, s, "Start", "EndCall")
}

func TestRunInvalidUsageStillReports(t *testing.T) {
	s := startFake(t)
	c := dialFake(t, s)
	ctx := tctx(t)
	err := c.Run(ctx, "chat", CallOptions{}, func(ctx context.Context, p *Permit) error {
		p.SetTokens(-3)
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	wantRequests(t, s, "Start", "Finish")
	if o := lastRequest(t, s).outcome; o != (outcome{tag: outSuccess, countAttempt: true}) {
		t.Fatalf("report %+v", o)
	}
}
