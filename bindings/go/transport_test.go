package polygate

// Transport (DESIGN §17) end to end through net/http: the real daemon (memory
// backend) and httptest upstreams — usage settled, estimates reserved, 429/5xx
// mapping, the synthetic refusal, routes failover, streams held and settled, a
// caller's retries one call each.

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"
)

func transportConfig(threshold int, sources ...string) string {
	var b strings.Builder
	fmt.Fprintf(&b, `
[scopes.chat]
circuit_open = "fail_fast"
quota_full = "wait"
max_attempts = 3
poll_interval = "10ms"
stall_window = "10s"

[scopes.chat.breaker]
failure_threshold = %d
cooldown = "10s"
`, threshold)
	for _, s := range sources {
		fmt.Fprintf(&b, "\n[[scopes.chat.sources]]\nname = %q\ntimeout = \"5s\"\ntpm = 6000\n", s)
	}
	return b.String()
}

const chatOK = `{"id":"c1","object":"chat.completion","created":1,"model":"m","choices":[{"index":0,"message":{"role":"assistant","content":"hi"},"finish_reason":"stop"}],"usage":{"prompt_tokens":12,"completion_tokens":18,"total_tokens":30}}`

const chatBody = `{"model":"m","max_tokens":2000,"messages":[{"role":"user","content":"say hi"}]}`

func chunk(content string, usage string) string {
	choices := "[]"
	if content != "" {
		choices = fmt.Sprintf(`[{"index":0,"delta":{"content":%q},"finish_reason":null}]`, content)
	}
	return fmt.Sprintf(`data: {"id":"s1","object":"chat.completion.chunk","created":1,"model":"m","choices":%s,"usage":%s}`, choices, usage)
}

type transportEnv struct {
	t  *testing.T
	c  *Client
	up *fakeUpstream
	d  *daemon
}

func newTransportEnv(t *testing.T, cfg string) *transportEnv {
	d := startSidecar(t, cfg, "memory")
	return &transportEnv{t: t, c: d.dial(t), up: startUpstream(t), d: d}
}

func (e *transportEnv) http(tr *Transport) *http.Client {
	if tr == nil {
		tr = &Transport{}
	}
	tr.Client, tr.Scope = e.c, "chat"
	return &http.Client{Transport: tr, Timeout: 20 * time.Second}
}

func (e *transportEnv) post(hc *http.Client, url, body string) (*http.Response, error) {
	req, err := http.NewRequest("POST", url, strings.NewReader(body))
	if err != nil {
		e.t.Fatal(err)
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Authorization", "Bearer caller")
	return hc.Do(req)
}

func (e *transportEnv) source(name string) SourceStatus {
	e.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	st, err := e.c.Status(ctx)
	if err != nil {
		e.t.Fatal(err)
	}
	return *st.Scope("chat").Source(name)
}

func (e *transportEnv) calls() int {
	e.t.Helper()
	st, err := e.c.Status(context.Background())
	if err != nil {
		e.t.Fatal(err)
	}
	return st.Scope("chat").Calls
}

func tokensAvail(s SourceStatus) float64 {
	if s.TokensAvailable == nil {
		return -1
	}
	return *s.TokensAvailable
}

func readAll(t *testing.T, resp *http.Response) []byte {
	t.Helper()
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

func TestTransportSuccessSettlesUsage(t *testing.T) {
	e := newTransportEnv(t, transportConfig(1, "a"))
	e.up.respond(canned{body: []byte(chatOK)}, 1)
	resp, err := e.post(e.http(nil), e.up.URL()+"/v1/chat/completions", chatBody)
	if err != nil {
		t.Fatal(err)
	}
	if b := readAll(t, resp); string(b) != chatOK || resp.StatusCode != 200 {
		t.Fatalf("the response changed: %d %s", resp.StatusCode, b)
	}
	a := e.source("a")
	if v := tokensAvail(a); v < 5900 || v > 6000 {
		t.Fatalf("tokens_available %v: the usage (30) should be charged, not the estimate (~2020)", v)
	}
	if a.WindowSuccesses != 1 || a.InFlight != 0 || e.calls() != 0 {
		t.Fatalf("after one request: successes %d, in flight %d, calls %d", a.WindowSuccesses, a.InFlight, e.calls())
	}
}

func TestTransportSlowRequestReservesEstimate(t *testing.T) {
	e := newTransportEnv(t, transportConfig(1, "a"))
	e.up.respond(canned{body: []byte(chatOK), delay: 600 * time.Millisecond}, 1)
	done := make(chan error, 1)
	go func() {
		resp, err := e.post(e.http(nil), e.up.URL()+"/v1/chat/completions", chatBody)
		if err == nil {
			_, err = io.ReadAll(resp.Body)
			resp.Body.Close()
		}
		done <- err
	}()
	time.Sleep(250 * time.Millisecond)
	a := e.source("a")
	// input ≈ len(body)/4 = 20, output = max_tokens 2000
	if v := tokensAvail(a); a.InFlight != 1 || v < 3800 || v > 4010 {
		t.Fatalf("while in flight: in_flight %d, tokens_available %v (want ~6000-2020)", a.InFlight, v)
	}
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if v := tokensAvail(e.source("a")); v < 5900 {
		t.Fatalf("after: tokens_available %v", v)
	}
}

func TestTransport429BlocksSourceBreakerClosed(t *testing.T) {
	e := newTransportEnv(t, transportConfig(1, "a"))
	e.up.respond(canned{status: 429, headers: map[string]string{"retry-after": "3"}, body: []byte(`{"error":{"message":"slow down"}}`)}, 1)
	resp, err := e.post(e.http(nil), e.up.URL()+"/v1/chat/completions", chatBody)
	if err != nil {
		t.Fatal(err)
	}
	if b := readAll(t, resp); resp.StatusCode != 429 || resp.Header.Get("Retry-After") != "3" || !strings.Contains(string(b), "slow down") {
		t.Fatalf("the 429 changed: %d %v %s", resp.StatusCode, resp.Header, b)
	}
	a := e.source("a")
	if a.State != StateClosed || a.Streak != 0 || a.WindowFailures != 0 {
		t.Fatalf("a 429 is not a failure: state %s, streak %d, failures %d", a.State, a.Streak, a.WindowFailures)
	}
	if b := a.QuotaBlocked.Seconds(); b < 2 || b > 3.01 {
		t.Fatalf("quota_blocked %v, want ~3 s", a.QuotaBlocked)
	}
}

func TestTransport5xxOpensThenSynthetic503(t *testing.T) {
	e := newTransportEnv(t, transportConfig(1, "a"))
	e.up.respond(canned{status: 500, body: []byte(`{"error":{"message":"boom"}}`)}, 1)
	hc := e.http(nil)
	resp, err := e.post(hc, e.up.URL()+"/v1/chat/completions", chatBody)
	if err != nil {
		t.Fatal(err)
	}
	readAll(t, resp)
	if resp.StatusCode != 500 || e.source("a").State != StateOpen {
		t.Fatalf("status %d, state %s", resp.StatusCode, e.source("a").State)
	}
	resp, err = e.post(hc, e.up.URL()+"/v1/chat/completions", chatBody)
	if err != nil {
		t.Fatal(err)
	}
	b := readAll(t, resp)
	var doc struct {
		Error struct {
			Type, Code, Message, Scope string
			RetryAfterS                float64           `json:"retry_after_s"`
			PerSourceReasons           map[string]string `json:"per_source_reasons"`
		}
	}
	if err := json.Unmarshal(b, &doc); err != nil {
		t.Fatalf("%v: %s", err, b)
	}
	ra := resp.Header.Get("Retry-After")
	if resp.StatusCode != 503 || resp.Header.Get("X-Should-Retry") != "false" || doc.Error.Type != "polygate" || doc.Error.Code != "circuit_open" || doc.Error.Scope != "chat" ||
		!strings.Contains(doc.Error.Message, "PolyGate") || doc.Error.PerSourceReasons["a"] != "circuit_open" ||
		doc.Error.RetryAfterS < 8 || doc.Error.RetryAfterS > 10 || (ra != "9" && ra != "10") {
		t.Fatalf("synthetic refusal: %d Retry-After %q %s", resp.StatusCode, ra, b)
	}
	if n := e.up.hitCount(); n != 1 {
		t.Fatalf("the refusal reached the upstream: %d hits", n)
	}
	// RefuseWithError: the typed error, through http.Client's *url.Error.
	_, err = e.post(e.http(&Transport{OnRefusal: RefuseWithError}), e.up.URL()+"/v1/chat/completions", chatBody)
	var co *CircuitOpenError
	if !errors.As(err, &co) || co.RetryAfter < 8*time.Second {
		t.Fatalf("RefuseWithError: %T %v", err, err)
	}
	if e.up.hitCount() != 1 || e.calls() != 0 {
		t.Fatalf("hits %d, calls %d", e.up.hitCount(), e.calls())
	}
}

// retrying is what an SDK's retry loop does: the same request again after a 429 /
// 5xx, up to n times; each try goes through the transport on its own.
func retrying(t *testing.T, e *transportEnv, hc *http.Client, url string, n int) *http.Response {
	t.Helper()
	for i := 0; ; i++ {
		resp, err := e.post(hc, url, chatBody)
		if err != nil {
			t.Fatal(err)
		}
		if resp.StatusCode < 500 || i == n {
			return resp
		}
		readAll(t, resp)
	}
}

func TestTransportRoutesFailoverWithHeaders(t *testing.T) {
	e := newTransportEnv(t, transportConfig(1, "a", "b"))
	upB := startUpstream(t)
	e.up.respond(canned{status: 503, body: []byte(`{"error":{"message":"down"}}`)}, 1)
	upB.respond(canned{body: []byte(chatOK)}, 1)
	sdk := "http://sdk.invalid/v1"
	hc := e.http(&Transport{SDKBaseURL: sdk, Routes: map[string]Route{
		"a": {BaseURL: e.up.URL() + "/v1", Headers: map[string]string{"Authorization": "Bearer key-A"}},
		"b": {BaseURL: upB.URL() + "/v1", Headers: map[string]string{"authorization": "Bearer key-B", "X-Deployment": "b"}},
	}})
	resp := retrying(t, e, hc, sdk+"/chat/completions?x=1", 2)
	if b := readAll(t, resp); resp.StatusCode != 200 || string(b) != chatOK {
		t.Fatalf("%d %s", resp.StatusCode, b)
	}
	ha, _ := e.up.lastHit()
	hb, _ := upB.lastHit()
	if e.up.hitCount() != 1 || ha.header.Get("Authorization") != "Bearer key-A" {
		t.Fatalf("A: %d hits, %v", e.up.hitCount(), ha.header)
	}
	if upB.hitCount() != 1 || hb.path != "/v1/chat/completions?x=1" || hb.header.Get("Authorization") != "Bearer key-B" ||
		hb.header.Get("X-Deployment") != "b" || string(hb.body) != chatBody {
		t.Fatalf("B: %d hits, %s %v %s", upB.hitCount(), hb.path, hb.header, hb.body)
	}
	if e.source("a").State != StateOpen || e.source("b").WindowSuccesses != 1 || e.calls() != 0 {
		t.Fatal("status after the failover")
	}
	// A granted source missing from Routes: a clear error, nothing sent, nothing held.
	if err := e.c.ForceClose(context.Background(), "a"); err != nil {
		t.Fatal(err)
	}
	partial := e.http(&Transport{Routes: map[string]Route{"b": {BaseURL: upB.URL()}}})
	_, err := e.post(partial, sdk+"/chat/completions", chatBody)
	var rm *RouteMissingError
	if !errors.As(err, &rm) || rm.Source != "a" || !strings.Contains(err.Error(), `"a"`) {
		t.Fatalf("missing route: %T %v", err, err)
	}
	if e.up.hitCount() != 1 || upB.hitCount() != 1 || e.source("a").InFlight != 0 || e.calls() != 0 {
		t.Fatal("the missing route sent something or held the permit")
	}
}

func TestTransportRetriesAdmittedOneByOne(t *testing.T) {
	e := newTransportEnv(t, transportConfig(5, "a"))
	e.up.respond(canned{status: 503, body: []byte(`{"error":{"message":"busy"}}`)}, 2)
	e.up.respond(canned{body: []byte(chatOK)}, 1)
	resp := retrying(t, e, e.http(nil), e.up.URL()+"/v1/chat/completions", 2)
	readAll(t, resp)
	a := e.source("a")
	if resp.StatusCode != 200 || e.up.hitCount() != 3 || a.WindowFailures != 2 || a.WindowSuccesses != 1 || e.calls() != 0 {
		t.Fatalf("status %d, hits %d, failures %d, successes %d", resp.StatusCode, e.up.hitCount(), a.WindowFailures, a.WindowSuccesses)
	}
}

func TestTransportStreamHeldAndCharged(t *testing.T) {
	e := newTransportEnv(t, transportConfig(1, "a"))
	hold := make(chan struct{})
	events := []string{chunk("he", "null"), chunk("llo", "null"), chunk("", `{"prompt_tokens":10,"completion_tokens":30,"total_tokens":40}`), "data: [DONE]"}
	e.up.respond(canned{sse: events, holdLast: hold}, 1)
	resp, err := e.post(e.http(nil), e.up.URL()+"/v1/chat/completions", `{"model":"m","max_tokens":2000,"stream":true,"messages":[]}`)
	if err != nil {
		t.Fatal(err)
	}
	r := bufio.NewReader(resp.Body)
	var got strings.Builder
	for i := 0; i < 3*2; i++ { // three events, two lines each
		line, err := r.ReadString('\n')
		if err != nil {
			t.Fatal(err)
		}
		got.WriteString(line)
	}
	a := e.source("a")
	if a.InFlight != 1 || tokensAvail(a) > 4010 || e.calls() != 1 {
		t.Fatalf("while streaming: in_flight %d, tokens %v, calls %d", a.InFlight, tokensAvail(a), e.calls())
	}
	close(hold)
	rest, err := io.ReadAll(r)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	got.Write(rest)
	want := strings.Join(events, "\n\n") + "\n\n"
	if got.String() != want {
		t.Fatalf("the stream changed:\n%q\n%q", got.String(), want)
	}
	a = e.source("a")
	if a.InFlight != 0 || tokensAvail(a) < 5900 || a.WindowSuccesses != 1 || e.calls() != 0 {
		t.Fatalf("after the stream: in_flight %d, tokens %v (charged 40), successes %d", a.InFlight, tokensAvail(a), a.WindowSuccesses)
	}
}

func TestTransportAbandonedStreamSettled(t *testing.T) {
	for _, how := range []string{"close", "cancel"} {
		t.Run(how, func(t *testing.T) {
			e := newTransportEnv(t, transportConfig(1, "a"))
			events := make([]string, 50)
			for i := range events {
				events[i] = chunk(fmt.Sprintf("t%d", i), "null")
			}
			e.up.respond(canned{sse: events, gap: 50 * time.Millisecond, holdLast: make(chan struct{})}, 1)
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			req, _ := http.NewRequestWithContext(ctx, "POST", e.up.URL()+"/v1/chat/completions", strings.NewReader(`{"stream":true}`))
			resp, err := e.http(nil).Do(req)
			if err != nil {
				t.Fatal(err)
			}
			r := bufio.NewReader(resp.Body)
			for i := 0; i < 4; i++ {
				if _, err := r.ReadString('\n'); err != nil {
					t.Fatal(err)
				}
			}
			if e.source("a").InFlight != 1 {
				t.Fatal("the stream is not counted in flight")
			}
			t0 := time.Now()
			if how == "close" {
				resp.Body.Close()
			} else {
				cancel() // the body is never closed: the request's context ends it
			}
			for e.source("a").InFlight != 0 || e.calls() != 0 {
				if time.Since(t0) > time.Second {
					t.Fatalf("the abandoned stream (%s) was not settled within 1 s", how)
				}
				time.Sleep(10 * time.Millisecond)
			}
			if e.source("a").WindowSuccesses != 1 {
				t.Fatal("an abandoned stream is a success settled with what was seen")
			}
		})
	}
}

// cannedRoundTripper answers every request in memory: the transport's own cost,
// without a network (go test -bench Transport -benchmem).
type cannedRoundTripper struct{ body string }

func (c cannedRoundTripper) RoundTrip(r *http.Request) (*http.Response, error) {
	if r.Body != nil {
		io.Copy(io.Discard, r.Body)
		r.Body.Close()
	}
	return &http.Response{StatusCode: 200, Status: "200 OK", Proto: "HTTP/1.1", ProtoMajor: 1, ProtoMinor: 1,
		Header: http.Header{"Content-Type": {"application/json"}}, Body: io.NopCloser(strings.NewReader(c.body)),
		ContentLength: int64(len(c.body)), Request: r}, nil
}

// runRoundTripper is the same request inside Client.Run: gating it by hand.
type runRoundTripper struct {
	base http.RoundTripper
	c    *Client
}

func (r runRoundTripper) RoundTrip(req *http.Request) (resp *http.Response, err error) {
	err = r.c.Run(req.Context(), "chat", CallOptions{}, func(ctx context.Context, p *Permit) error {
		resp, err = r.base.RoundTrip(req)
		return err
	})
	return resp, err
}

// BenchmarkTransport: a request through Transport minus the same request without it
// is the transport's overhead; the same request inside Run is what gating it by hand costs.
func BenchmarkTransport(b *testing.B) {
	d := startSidecar(b, e2eConfig, "memory")
	c := d.dial(b)
	base := cannedRoundTripper{body: chatOK}
	for _, bc := range []struct {
		name string
		rt   http.RoundTripper
	}{{"plain", base}, {"gated", &Transport{Base: base, Client: c, Scope: "chat"}}, {"run", runRoundTripper{base, c}}} {
		b.Run(bc.name, func(b *testing.B) {
			hc := &http.Client{Transport: bc.rt}
			b.ReportAllocs()
			b.SetParallelism(32)
			b.ResetTimer()
			b.RunParallel(func(pb *testing.PB) {
				for pb.Next() {
					resp, err := hc.Post("http://upstream.invalid/v1/chat/completions", "application/json", strings.NewReader(chatBody))
					if err != nil {
						b.Error(err)
						return
					}
					io.Copy(io.Discard, resp.Body)
					resp.Body.Close()
				}
			})
		})
	}
}

func TestEstimateBody(t *testing.T) {
	for _, c := range []struct {
		body    string
		in, out int64
	}{
		{``, 0, 0},
		{`{"max_tokens":100}`, 5, 100},
		{`{"messages":[{"content":"max_tokens: 9"}], "max_completion_tokens" : 42}`, 18, 42},
		{`{"tools":{"max_tokens":{"type":"integer"}},"max_output_tokens":7}`, 17, 7},
		{`{"model":"m"}`, 4, 0},
		{`{"content":"\"max_tokens\":5"}`, 8, 0},
	} {
		in, out := EstimateBody([]byte(c.body))
		if in != c.in || out != c.out {
			t.Errorf("EstimateBody(%s) = %d, %d; want %d, %d", c.body, in, out, c.in, c.out)
		}
	}
}

func TestJSONUsage(t *testing.T) {
	for _, c := range []struct {
		body string
		want Usage
	}{
		{chatOK, Usage{Tokens: 30, InputTokens: 12, OutputTokens: 18}},
		{`{"usage":{"prompt_tokens":100,"total_tokens":100,"prompt_tokens_details":{"cached_tokens":40}}}`, Usage{Tokens: 100, InputTokens: 60}},
		{`{"type":"message","content":[{"text":"a } { \"usage\":{\"input_tokens\":1}"}],"usage":{"input_tokens":25,"output_tokens":5,"cache_read_input_tokens":7}}`, Usage{InputTokens: 25, OutputTokens: 5}},
		{`{"output":[],"usage":{"input_tokens":50,"input_tokens_details":{"cached_tokens":10},"output_tokens":9,"total_tokens":59}}`, Usage{Tokens: 59, InputTokens: 40, OutputTokens: 9}},
		{`{"usage":null}`, Usage{}},
		{`{"usage":{"total_tokens":`, Usage{}},
		{`{"ok":true}`, Usage{}},
	} {
		if got := jsonUsage([]byte(c.body)); got != c.want {
			t.Errorf("jsonUsage(%s) = %+v, want %+v", c.body, got, c.want)
		}
	}
}

func TestUsageScannerAcrossReads(t *testing.T) {
	stream := "event: message_start\r\ndata: {\"type\":\"message_start\",\"message\":{\"usage\":{\"input_tokens\":25,\"output_tokens\":1}}}\r\n\r\n" +
		"data: {\"type\":\"content_block_delta\",\"delta\":{\"text\":\"\\\"usage\\\":{\"}}\n\n" +
		"data: {\"type\":\"message_delta\",\"usage\": {\"output_tokens\":15}}\n\n" +
		"data: {\"type\":\"message_stop\"}"
	for _, size := range []int{1, 3, 7, 64, len(stream)} {
		s := &usageScanner{}
		for i := 0; i < len(stream); i += size {
			s.push([]byte(stream[i:min(i+size, len(stream))]))
		}
		s.end()
		if got := s.usage(); got != (Usage{InputTokens: 25, OutputTokens: 15}) {
			t.Errorf("reads of %d bytes: %+v", size, got)
		}
	}
}

func TestTransportCancelAndDeadline(t *testing.T) {
	e := newTransportEnv(t, transportConfig(5, "a"))
	e.up.respond(canned{body: []byte(chatOK), delay: 2 * time.Second}, 2)
	// Dialled lazily from Path: the transport's own connection.
	hc := &http.Client{Transport: &Transport{Path: e.d.socket, Scope: "chat"}}
	ctx, cancel := context.WithCancel(context.Background())
	time.AfterFunc(100*time.Millisecond, cancel)
	req, _ := http.NewRequestWithContext(ctx, "POST", e.up.URL()+"/v1/chat/completions", strings.NewReader(chatBody))
	if _, err := hc.Do(req); !errors.Is(err, context.Canceled) {
		t.Fatalf("cancelled: %v", err)
	}
	a := e.source("a")
	if a.InFlight != 0 || a.Streak != 0 || a.WindowFailures != 0 || e.calls() != 0 {
		t.Fatalf("a cancel is not a failure: %+v", a)
	}
	ctx, cancel = context.WithTimeout(context.Background(), 100*time.Millisecond)
	defer cancel()
	req, _ = http.NewRequestWithContext(ctx, "POST", e.up.URL()+"/v1/chat/completions", strings.NewReader(chatBody))
	if _, err := hc.Do(req); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("deadline: %v", err)
	}
	if a := e.source("a"); a.InFlight != 0 || a.Streak != 1 || a.WindowFailures != 1 || e.calls() != 0 {
		t.Fatalf("a deadline is a timeout: %+v", a)
	}
}

// DESIGN §18 through §17: the transport reads the provider's rate-limit headers
// itself (no call site sets limits) and reports them aged by the stream's length,
// so the sidecar dates the observation when the headers came, not at the report.
func TestTransportReportsRateLimitHeadersAgedByTheStream(t *testing.T) {
	cfg := strings.Replace(transportConfig(1, "a"), "tpm = 6000\n", "tpm = 6000\nobserve_limits = \"on\"\n", 1)
	e := newTransportEnv(t, cfg)
	events := []string{chunk("he", "null"), chunk("llo", "null"), chunk("", `{"prompt_tokens":10,"completion_tokens":30,"total_tokens":40}`), "data: [DONE]"}
	e.up.respond(canned{sse: events, gap: 250 * time.Millisecond, headers: map[string]string{
		"x-ratelimit-limit-tokens": "6000", "x-ratelimit-remaining-tokens": "1000", "x-ratelimit-reset-tokens": "20s",
	}}, 1)
	resp, err := e.post(e.http(nil), e.up.URL()+"/v1/chat/completions", `{"model":"m","max_tokens":100,"stream":true,"messages":[]}`)
	if err != nil {
		t.Fatal(err)
	}
	readAll(t, resp)
	rep, err := e.c.do(context.Background(), &request{tag: reqStatusJSON}, true, repStatusJSON)
	if err != nil {
		t.Fatal(err)
	}
	var doc struct {
		Scopes []struct {
			Sources []struct {
				Name    string `json:"name"`
				Buckets []struct {
					Bucket   string `json:"bucket"`
					Level    float64
					Observed *struct {
						Remaining int64   `json:"remaining"`
						AgeS      float64 `json:"age_s"`
					} `json:"observed"`
				} `json:"buckets"`
			} `json:"sources"`
		} `json:"scopes"`
	}
	if err := json.Unmarshal([]byte(rep.text), &doc); err != nil {
		t.Fatal(err)
	}
	for _, b := range doc.Scopes[0].Sources[0].Buckets {
		if b.Bucket != "tpm" {
			continue
		}
		if b.Observed == nil || b.Observed.Remaining != 1000 {
			t.Fatalf("tpm observed %+v: the headers were not reported", b.Observed)
		}
		if b.Observed.AgeS < 0.5 || b.Level > 1000+100*(b.Observed.AgeS+0.5) {
			t.Fatalf("tpm level %.0f, observed %.3f s ago: not dated when the headers came (the stream took ~0.75 s)", b.Level, b.Observed.AgeS)
		}
		return
	}
	t.Fatal("no tpm bucket in the status")
}

func TestTransportRoutesRebase(t *testing.T) {
	tb, err := parseRoutes(map[string]Route{
		"a":    {BaseURL: "http://h/a/v1"},
		"b":    {BaseURL: "http://h/b/v1/"},
		"vllm": {BaseURL: "http://gpu-1:8000/v1"},
		"deep": {BaseURL: "http://h/a/v1/deployments/x"},
		"bare": {BaseURL: "http://other:9000"},
		"az":   {BaseURL: "https://r/openai/deployments/d", Query: map[string]string{"k": "a b&c/é", "api-version": "2024-10-21"}},
	}, "")
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct{ source, in, want string }{
		{"b", "http://h/a/v1/chat/completions", "/b/v1/chat/completions"},
		{"vllm", "http://h:80/a/v1/chat/completions?x=1", "/v1/chat/completions?x=1"},
		{"b", "http://h/a/v1", "/b/v1"},
		{"bare", "http://h/a/v1/embeddings", "/embeddings"},
		{"b", "http://h/a/v1/deployments/x/chat", "/b/v1/chat"}, // the longest wins
		{"b", "http://h/a/v10/chat", "/b/v1/a/v10/chat"},        // a segment boundary
		{"b", "http://h:8080/a/v1/chat", "/b/v1/a/v1/chat"},     // another port
		{"b", "https://h/a/v1/chat", "/b/v1/a/v1/chat"},         // another scheme
		{"bare", "http://sdk/v1/chat", "/v1/chat"},              // matching none: put in front
		{"az", "http://h/a/v1/chat/completions?api-version=old&trace=1&api%2Dversion=x",
			"/openai/deployments/d/chat/completions?trace=1&api-version=2024-10-21&k=a%20b%26c%2F%C3%A9"},
	} {
		u, _ := url.Parse(c.in)
		p, q, _ := tb.rebase(u, tb.routes[c.source])
		if q != "" {
			p += "?" + q
		}
		if p != c.want {
			t.Errorf("%s via %s: got %q, want %q", c.in, c.source, p, c.want)
		}
	}
	// SDKBaseURL is one more base URL matched like the routes'.
	tb, _ = parseRoutes(map[string]Route{"az": {BaseURL: "https://r/openai/deployments/d"}}, "https://api.openai.com/v1/")
	u, _ := url.Parse("https://api.openai.com/v1/chat/completions")
	if p, _, cross := tb.rebase(u, tb.routes["az"]); p != "/openai/deployments/d/chat/completions" || !cross {
		t.Errorf("SDKBaseURL: got %q, cross %v", p, cross)
	}
	for _, bad := range []map[string]Route{
		{"a": {BaseURL: "ftp://h/v1"}}, {"a": {BaseURL: "/v1"}},
		{"a": {BaseURL: "http://h/v1?api-version=1"}}, {"a": {BaseURL: "http://h", Query: map[string]string{"": "x"}}},
		{"a": {BaseURL: "http://h", Headers: map[string]string{"Api-Key": "1", "api-key": "2"}}}, // one header twice
	} {
		if _, err := parseRoutes(bad, ""); err == nil {
			t.Errorf("%v: no error", bad)
		}
	}
}

// DESIGN §17 item 2: resolved against the URL sent, a routed 3xx's Location under
// the granted route's base URL is written back under the SDK's base URL; one
// elsewhere is made absolute; an absolute one elsewhere, or none, is left as it is.
func TestTransportRelocateWritesTheLocationBackAsTheSDKsURL(t *testing.T) {
	tb, err := parseRoutes(map[string]Route{
		"openai": {BaseURL: "https://api.openai.com/v1"}, "az": {BaseURL: "http://g:8080/openai/deployments/x"},
	}, "")
	if err != nil {
		t.Fatal(err)
	}
	sdk, _ := url.Parse("https://api.openai.com/v1/chat/completions")
	sent, _ := url.Parse("http://g:8080/openai/deployments/x/chat/completions?api-version=1")
	for _, c := range []struct{ loc, want string }{
		{"/openai/deployments/x/chat/completions?api-version=2", "https://api.openai.com/v1/chat/completions?api-version=2"},
		{"../y/chat", "https://api.openai.com/v1/y/chat"},
		{"http://G:8080/openai/deployments/x/z", "https://api.openai.com/v1/z"},
		{"/openai/deployments/other/chat", "http://g:8080/openai/deployments/other/chat"},
		{"//h2/v1/chat", "http://h2/v1/chat"},
		{"https://other/v1/chat", "https://other/v1/chat"},
	} {
		h := http.Header{"Location": {c.loc}}
		relocate(sdk, sent, tb.routes["az"], h)
		if got := h.Get("Location"); got != c.want {
			t.Errorf("Location %q: got %q, want %q", c.loc, got, c.want)
		}
	}
	h := http.Header{}
	relocate(sdk, sent, tb.routes["az"], h)
	if _, ok := h["Location"]; ok {
		t.Errorf("no Location: got %q", h.Get("Location"))
	}
	// Under no base URL (the route's path put in front): back to the SDK's origin.
	sdk2, _ := url.Parse("http://sdk.invalid/chat")
	sent2, _ := url.Parse("http://g:8080/openai/deployments/x/chat")
	h = http.Header{"Location": {"/openai/deployments/x/chat2"}}
	relocate(sdk2, sent2, tb.routes["az"], h)
	if got := h.Get("Location"); got != "http://sdk.invalid/chat2" {
		t.Errorf("put in front: got %q", got)
	}
}

// An empty Routes (not nil) is refused before admission, as Python's and Node's
// constructors refuse routes={} — not a RouteMissingError at every grant.
func TestTransportEmptyRoutesAreRefusedBeforeAdmission(t *testing.T) {
	tr := &Transport{Scope: "chat", Routes: map[string]Route{}, Path: filepath.Join(t.TempDir(), "no-sidecar.sock")}
	req, _ := http.NewRequest("POST", "http://h/v1/chat/completions", strings.NewReader(`{}`))
	_, err := tr.RoundTrip(req)
	var se *SidecarError
	if !errors.As(err, &se) || se.Kind != "invalid_argument" || !strings.Contains(se.Message, "Transport.Routes is empty") {
		t.Fatalf("RoundTrip with empty Routes: %v, want an invalid_argument naming Transport.Routes", err)
	}
}

// DESIGN §17: the SDK's credentials stay with the origin it addressed.
func TestTransportRoutesSayWhenARequestLeavesTheSDKsOrigin(t *testing.T) {
	tb, err := parseRoutes(map[string]Route{
		"a": {BaseURL: "http://h/a/v1"}, "b": {BaseURL: "http://h/b/v1"},
		"vllm": {BaseURL: "http://gpu-1:8000/v1"}, "tls": {BaseURL: "https://h/a/v1"},
	}, "")
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		source, in string
		cross      bool
	}{
		{"a", "http://h/a/v1/chat", false},
		{"b", "http://H:80/a/v1/chat", false}, // same scheme, host and port: another path
		{"vllm", "http://h/a/v1/chat", true},
		{"tls", "http://h/a/v1/chat", true},           // another scheme (and port)
		{"a", "https://h/a/v1/chat", true},            // the SDK addressed tls's base
		{"vllm", "http://sdk.invalid/v1/chat", false}, // under no base: the routes are its only destinations
	} {
		u, _ := url.Parse(c.in)
		if _, _, cross := tb.rebase(u, tb.routes[c.source]); cross != c.cross {
			t.Errorf("%s via %s: cross %v, want %v", c.in, c.source, cross, c.cross)
		}
	}
}

func TestTransportSetModel(t *testing.T) {
	for _, c := range []struct{ in, want string }{
		{`{"model":"gpt-4o","stream":true,"seed":12345678901234567890123}`, `{"model":"m2","stream":true,"seed":12345678901234567890123}`},
		{` { "tools" : [{"model":"x"}], "model" : "gpt" , "s":"}\"model\":" } `, ` { "tools" : [{"model":"x"}], "model" : "m2" , "s":"}\"model\":" } `},
		{`{"input":"hi"}`, `{"model":"m2","input":"hi"}`},
		{`{ }`, `{"model":"m2" }`},
		{`{"mod\u0065l":"a","n":1.5e3,"model":null}`, `{"mod\u0065l":"m2","n":1.5e3,"model":"m2"}`},
		{`{"model":"m2","x":1}`, `{"model":"m2","x":1}`},
	} {
		got := setModel([]byte(c.in), "m2")
		if string(got) != c.want {
			t.Errorf("setModel(%s) = %s, want %s", c.in, got, c.want)
		}
	}
	for _, in := range []string{`[{"model":"x"}]`, `"model"`, `{"model":`, ``, "\xff{}", "{\"model\":\"a\",\"s\":\"caf\xe9\"}", `{"a":NaN}`} {
		if got := setModel([]byte(in), "m2"); got != nil {
			t.Errorf("setModel(%q) = %q, want nil", in, got)
		}
	}
}

const tenantTransportConfig = `
[scopes.chat]
circuit_open = "fail_fast"
quota_full = "fail_fast"
max_attempts = 2
poll_interval = "10ms"
stall_window = "5s"

[scopes.chat.tenants]
default = { rpm = 1 }

[[scopes.chat.sources]]
name = "a"
timeout = "5s"
`

// TestTransportTenantOverItsLimit429: DESIGN §19 item 6 through net/http against
// the real daemon: a tenant over rpm = 1 gets the synthetic 429 naming it (limit_source
// "tenant"), the upstream sees one request only, and the header never reaches it.
func TestTransportTenantOverItsLimit429(t *testing.T) {
	for _, backend := range backends {
		t.Run(backend, func(t *testing.T) {
			d := startSidecar(t, tenantTransportConfig, backend)
			e := &transportEnv{t: t, c: d.dial(t), up: startUpstream(t), d: d}
			e.up.respond(canned{body: []byte(chatOK)}, 1)
			hc := e.http(&Transport{Tenant: "the-option"})
			send := func() *http.Response {
				req, err := http.NewRequest("POST", e.up.URL()+"/v1/chat/completions", strings.NewReader(chatBody))
				if err != nil {
					t.Fatal(err)
				}
				req.Header.Set("Content-Type", "application/json")
				req.Header.Set(TenantHeader, "acme")
				resp, err := hc.Do(req)
				if err != nil {
					t.Fatal(err)
				}
				return resp
			}
			if resp := send(); resp.StatusCode != 200 || string(readAll(t, resp)) != chatOK {
				t.Fatalf("first request: %d", resp.StatusCode)
			}
			resp := send()
			b := readAll(t, resp)
			var doc refusalBody
			if err := json.Unmarshal(b, &doc); err != nil {
				t.Fatalf("%v: %s", err, b)
			}
			ra, _ := strconv.Atoi(resp.Header.Get("Retry-After"))
			if resp.StatusCode != 429 || resp.Header.Get("X-Should-Retry") != "false" || resp.Header.Get("X-Polygate-Refusal") != "tenant_limited" ||
				ra < 1 || ra > 61 || doc.Error["code"] != "tenant_limited" || doc.Error["limit_source"] != "tenant" ||
				doc.Error["tenant"] != "acme" || doc.Error["limit"] != "rpm" || doc.Error["scope"] != "chat" {
				t.Fatalf("over the limit: %d %v %s", resp.StatusCode, resp.Header, b)
			}
			last, _ := e.up.lastHit()
			if e.up.hitCount() != 1 || last.header.Get(TenantHeader) != "" {
				t.Fatalf("upstream: %d requests, last %v", e.up.hitCount(), last.header)
			}
			if e.calls() != 0 || e.source("a").InFlight != 0 {
				t.Fatal("the refusal left a call or a permit")
			}
		})
	}
}
