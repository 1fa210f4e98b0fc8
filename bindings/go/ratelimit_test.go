package polygate

// §18: the shared header cases (bindings/vectors/ratelimit_headers.json), and a
// permit's SetLimits going out as FinishObserved.

import (
	"encoding/json"
	"math"
	"net/http"
	"os"
	"testing"
	"time"
)

type headerCase struct {
	Name     string            `json:"name"`
	Headers  map[string]string `json:"headers"`
	Expected map[string]*struct {
		Limit     *float64 `json:"limit"`
		Remaining *float64 `json:"remaining"`
		ResetS    *float64 `json:"reset_s"`
	} `json:"expected"`
	RetryAfterS *float64 `json:"retry_after_s"`
}

func TestRateLimitHeaderVectors(t *testing.T) {
	raw, err := os.ReadFile("../vectors/ratelimit_headers.json")
	if err != nil {
		t.Fatal(err)
	}
	var doc struct {
		Cases []headerCase `json:"cases"`
	}
	if err := json.Unmarshal(raw, &doc); err != nil {
		t.Fatal(err)
	}
	if len(doc.Cases) < 5 {
		t.Fatalf("only %d cases", len(doc.Cases))
	}
	for _, c := range doc.Cases {
		t.Run(c.Name, func(t *testing.T) {
			h := http.Header{}
			for k, v := range c.Headers {
				h.Add(k, v)
			}
			l, retry := ParseRateLimitHeaders(h, time.Unix(0, 0))
			if c.Expected == nil {
				if l != nil {
					t.Fatalf("expected nothing, got %+v", l)
				}
			} else {
				if l == nil {
					t.Fatal("expected limits, got none")
				}
				got := map[string]*Limit{"requests": l.Requests, "tokens": l.Tokens, "input_tokens": l.InputTokens, "output_tokens": l.OutputTokens}
				for name, want := range c.Expected {
					g := got[name]
					if (want == nil) != (g == nil) {
						t.Fatalf("%s: got %+v, want %+v", name, g, want)
					}
					if want == nil {
						continue
					}
					checkCount(t, name+".limit", g.Limit, want.Limit)
					checkCount(t, name+".remaining", g.Remaining, want.Remaining)
					checkSecs(t, name+".reset", g.Reset, want.ResetS)
				}
			}
			checkSecs(t, "retry_after", retry, c.RetryAfterS)
		})
	}
}

func checkCount(t *testing.T, what string, got int64, want *float64) {
	t.Helper()
	if want == nil && got != -1 || want != nil && float64(got) != *want {
		t.Fatalf("%s: got %d, want %v", what, got, want)
	}
}

func checkSecs(t *testing.T, what string, got time.Duration, want *float64) {
	t.Helper()
	if want == nil {
		if got != -1 {
			t.Fatalf("%s: got %v, want none", what, got)
		}
		return
	}
	if math.Abs(got.Seconds()-*want) > 1e-6 {
		t.Fatalf("%s: got %v, want %vs", what, got, *want)
	}
}

func TestLimitsEncodeAsTheGoldenFinishObserved(t *testing.T) {
	// finish_observed_openai: permit 21, Success{1534, true}, OpenAI's headers.
	l := &Limits{
		Requests: &Limit{Limit: 500, Remaining: 499, Reset: 120 * time.Millisecond},
		Tokens:   &Limit{Limit: 30000, Remaining: 28466, Reset: 3068 * time.Millisecond},
	}
	w := l.wire()
	r := request{tag: reqFinish, target: 21, outcome: outcome{tag: outSuccess, tokens: optU64{1534, true}, countAttempt: true}, limits: &w}
	got := appendRequest(nil, 13, &r)
	var want string
	for _, v := range loadVectors(t) {
		if v.Name == "finish_observed_openai" {
			want = v.FrameHex
		}
	}
	if want == "" || want != hexOf(got) {
		t.Fatalf("got %s\nwant %s", hexOf(got), want)
	}
}

func hexOf(b []byte) string {
	const digits = "0123456789abcdef"
	out := make([]byte, 0, 2*len(b))
	for _, c := range b {
		out = append(out, digits[c>>4], digits[c&15])
	}
	return string(out)
}

func TestSetLimitsTravelsWithTheReport(t *testing.T) {
	s := startFake(t)
	c := dialFake(t, s)
	ctx := tctx(t)
	h := http.Header{}
	h.Set("x-ratelimit-remaining-tokens", "250")
	h.Set("x-ratelimit-limit-tokens", "30000")
	l, _ := ParseRateLimitHeaders(h, time.Now())
	// A failure is held and travels with the Retry; the success's Finish carries its own.
	call, err := c.Begin(ctx, "chat", CallOptions{})
	if err != nil {
		t.Fatal(err)
	}
	p, err := call.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	p.SetLimits(l)
	if err := p.Failure(ctx, ServerError); err != nil {
		t.Fatal(err)
	}
	p2, err := call.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	retry := lastRequest(t, s)
	if retry.tag != reqRetry || retry.limits == nil || retry.limits.dims[1].remaining != some(250) {
		t.Fatalf("Retry %+v", retry)
	}
	if err := p2.Success(ctx, 10); err != nil {
		t.Fatal(err)
	}
	if fin := lastRequest(t, s); fin.tag != reqFinish || fin.limits != nil {
		t.Fatalf("a permit without limits sends a plain Finish: %+v", fin)
	}
	_ = call.End(ctx)
}

// BenchmarkParseRateLimitHeaders: the transport parses every response's headers;
// an OpenAI response with its six rate-limit headers, and one with none.
func BenchmarkParseRateLimitHeaders(b *testing.B) {
	openai := http.Header{}
	for k, v := range map[string]string{
		"x-ratelimit-limit-requests": "10000", "x-ratelimit-remaining-requests": "9999",
		"x-ratelimit-reset-requests": "6ms", "x-ratelimit-limit-tokens": "2000000",
		"x-ratelimit-remaining-tokens": "1999970", "x-ratelimit-reset-tokens": "0s",
		"content-type": "application/json", "date": "Sat, 05 Dec 2026 12:00:00 GMT",
	} {
		openai.Set(k, v)
	}
	plain := http.Header{"Content-Type": {"application/json"}}
	now := time.Now()
	for _, c := range []struct {
		name string
		h    http.Header
	}{{"openai", openai}, {"none", plain}} {
		b.Run(c.name, func(b *testing.B) {
			b.ReportAllocs()
			for i := 0; i < b.N; i++ {
				ParseRateLimitHeaders(c.h, now)
			}
		})
	}
}
