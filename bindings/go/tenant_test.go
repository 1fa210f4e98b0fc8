package polygate

// Protocol 3, tenants (DESIGN §19, PROTOCOL.md §15), against the fake sidecar:
// StartTenant bytes, the TenantLimited refusal as *TenantLimitError, Run returning
// it at once, the fallback to version 2 with tenant calls refused client-side, the
// 128-byte limit, SuccessCached on v3 only, TenantStatus, UsageOf.

import (
	"bytes"
	"context"
	"encoding/hex"
	"errors"
	"reflect"
	"strings"
	"testing"
	"time"
)

// vectorPayload is a vector's payload after its id.
func vectorPayload(t *testing.T, name string) []byte {
	t.Helper()
	for _, v := range loadVectors(t) {
		if v.Name == name {
			b, err := hex.DecodeString(v.FrameHex)
			if err != nil {
				t.Fatal(err)
			}
			return b[12:]
		}
	}
	t.Fatalf("no vector %q", name)
	return nil
}

// rawRequests are the payloads (after the id) the fake's connection i received.
func rawRequests(s *fakeSidecar, i int) [][]byte {
	s.mu.Lock()
	c := s.conns[i]
	s.mu.Unlock()
	s.mu.Lock()
	defer s.mu.Unlock()
	out := make([][]byte, len(c.raw))
	for j, p := range c.raw {
		out[j] = p[8:]
	}
	return out
}

func refusal() *reply {
	return &reply{tag: repTenantLimited, tenant: "acme", limit: "usd_per_day", err: &errorReply{
		kind: kindTenantLimited, message: `tenant "acme" of scope "chat" is over its usd_per_day budget`, retryAfter: 5400,
		reasons: []sourceReason{{"a", 4}, {"b", 0}}, scope: optStr{"chat", true}}}
}

func checkRefusal(t *testing.T, err error) {
	t.Helper()
	var te *TenantLimitError
	if !errors.As(err, &te) {
		t.Fatalf("%v (%T) is not a *TenantLimitError", err, err)
	}
	var gu *GatewayUnavailableError
	if !errors.As(err, &gu) || gu.Kind != "tenant_limited" {
		t.Fatalf("%v does not unwrap to a *GatewayUnavailableError of kind tenant_limited", err)
	}
	if te.Tenant != "acme" || te.Limit != "usd_per_day" || te.RetryAfter != 5400*time.Second || te.Scope != "chat" ||
		!reflect.DeepEqual(te.PerSourceReasons, map[string]string{"a": SkipTenantLimited, "b": SkipCircuitOpen}) ||
		te.Error() != `polygate: tenant "acme" of scope "chat" is over its usd_per_day budget` {
		t.Fatalf("refusal fields: %+v", te)
	}
}

func TestTenantStartBytesAndAnonymousStart(t *testing.T) {
	s := startFake(t)
	c := dialFake(t, s)
	ctx := tctx(t)
	call, err := c.Begin(ctx, "chat", CallOptions{EstInputTokens: 800, EstOutputTokens: 200, Tenant: "acme"})
	if err != nil {
		t.Fatal(err)
	}
	p, err := call.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if err := p.Success(ctx, 5); err != nil {
		t.Fatal(err)
	}
	// no tenant: a plain Start, byte for byte what it was
	if err := c.Run(ctx, "chat", CallOptions{EstInputTokens: 800, EstOutputTokens: 200}, func(context.Context, *Permit) error { return nil }); err != nil {
		t.Fatal(err)
	}
	wantRequests(t, s, "StartTenant", "Finish", "Start", "Finish")
	raw := rawRequests(s, 0)
	if want := vectorPayload(t, "start_tenant"); !bytes.Equal(raw[0], want) {
		t.Fatalf("StartTenant:\n got %x\nwant %x", raw[0], want)
	}
	plain := append(putU32(nil, reqStart), vectorPayload(t, "start_tenant")[4:len(vectorPayload(t, "start_tenant"))-12]...)
	if !bytes.Equal(raw[2], plain) {
		t.Fatalf("Start:\n got %x\nwant %x", raw[2], plain)
	}
}

func TestTenantTooLongIsRefusedAtTheCall(t *testing.T) {
	s := startFake(t)
	c := dialFake(t, s)
	ctx := tctx(t)
	for _, bad := range []string{strings.Repeat("a", 129), strings.Repeat("東", 43)} {
		_, err := c.Begin(ctx, "chat", CallOptions{Tenant: bad})
		se := asSidecar(t, err, "invalid_argument")
		if !strings.Contains(se.Message, "is 129 bytes of UTF-8; the limit is 128 bytes") {
			t.Fatalf("message %q", se.Message)
		}
		if err := c.Run(ctx, "chat", CallOptions{Tenant: bad}, func(context.Context, *Permit) error { return nil }); err == nil {
			t.Fatal("Run accepted a 129-byte tenant")
		}
		if _, err := c.TenantStatus(ctx, bad, ""); err == nil {
			t.Fatal("TenantStatus accepted a 129-byte tenant")
		}
	}
	asSidecar(t, func() error { _, err := c.Begin(ctx, "chat", CallOptions{Tenant: "\xff"}); return err }(), "invalid_argument")
	if err := c.Run(ctx, "chat", CallOptions{Tenant: strings.Repeat("東", 42) + "ab"}, func(context.Context, *Permit) error { return nil }); err != nil {
		t.Fatal(err) // exactly 128 bytes
	}
	wantRequests(t, s, "StartTenant", "Finish")
}

func TestTenantLimitedIsATypedErrorAndEndsTheCall(t *testing.T) {
	s := startFake(t)
	s.setHook(func(fc *fakeConn, id uint64, r *request) bool {
		if r.tag == reqStartTenant {
			fc.reply(id, refusal())
			return true
		}
		return false
	})
	c := dialFake(t, s)
	ctx := tctx(t)
	call, err := c.Begin(ctx, "chat", CallOptions{Tenant: "acme"})
	if err != nil {
		t.Fatal(err)
	}
	_, err = call.Acquire(ctx)
	checkRefusal(t, err)
	_, again := call.Acquire(ctx)
	checkRefusal(t, again) // final for the call
	if err := call.End(ctx); err != nil {
		t.Fatal(err)
	}
	if err := c.Ping(ctx); err != nil {
		t.Fatal(err)
	}
	wantRequests(t, s, "StartTenant", "Ping") // nothing to end after a refused StartTenant
}

func TestRunReturnsTenantLimitAtOnce(t *testing.T) {
	s := startFake(t)
	refuse := reqStartTenant
	s.setHook(func(fc *fakeConn, id uint64, r *request) bool {
		if r.tag == refuse {
			fc.reply(id, refusal())
			return true
		}
		return false
	})
	c := dialFake(t, s)
	ctx := tctx(t)
	n := 0
	err := c.Run(ctx, "chat", CallOptions{Tenant: "acme"}, func(context.Context, *Permit) error { n++; return nil })
	checkRefusal(t, err)
	if n != 0 {
		t.Fatalf("fn ran %d times", n)
	}
	// a failed attempt whose Retry the tenant refuses: no other attempt
	refuse = reqRetry
	err = c.Run(ctx, "chat", CallOptions{Tenant: "acme"}, func(context.Context, *Permit) error { n++; return &HTTPError{StatusCode: 503} })
	checkRefusal(t, err)
	if n != 1 {
		t.Fatalf("fn ran %d times, want 1", n)
	}
	wantRequests(t, s, "StartTenant", "StartTenant", "Retry")
}

func TestVersion2SidecarFallsBackAndRefusesTenants(t *testing.T) {
	s := startFake(t)
	s.version = 2
	c := dialFake(t, s)
	ctx := tctx(t)
	if n := s.connCount(); n != 2 {
		t.Fatalf("%d connections, want 2 (Hello 3 refused, then Hello 2)", n)
	}
	clear := func(err error) {
		t.Helper()
		se := asSidecar(t, err, "protocol_violation")
		if !strings.Contains(se.Message, "the sidecar speaks protocol 2; tenants need 3: upgrade polygate-sidecar") {
			t.Fatalf("message %q", se.Message)
		}
	}
	call, err := c.Begin(ctx, "chat", CallOptions{Tenant: "acme"})
	if err != nil {
		t.Fatal(err)
	}
	_, err = call.Acquire(ctx)
	clear(err)
	n := 0
	clear(c.Run(ctx, "chat", CallOptions{Tenant: "acme"}, func(context.Context, *Permit) error { n++; return nil }))
	_, err = c.TenantStatus(ctx, "acme", "")
	clear(err)
	if n != 0 {
		t.Fatal("fn ran")
	}
	// an anonymous call works; its cached reads are dropped (SuccessUsage)
	err = c.Run(ctx, "chat", CallOptions{}, func(_ context.Context, p *Permit) error {
		p.SetUsage(Usage{InputTokens: 1, OutputTokens: 2, CachedInputTokens: 3})
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	wantRequests(t, s, "Start", "Finish")
	if o := lastRequest(t, s).outcome; o.tag != outSuccessUsage || o.usage.input != some(1) || o.usage.output != some(2) {
		t.Fatalf("outcome %+v", o)
	}
}

func TestReconnectToAVersion2SidecarFallsBack(t *testing.T) {
	s := startFake(t)
	c := dialFake(t, s)
	ctx := tctx(t)
	s.version = 2
	s.dropConns()
	deadline := time.Now().Add(5 * time.Second)
	for {
		c.mu.Lock()
		dead := c.cur.dead.Load()
		c.mu.Unlock()
		if dead {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the client did not see its connection close")
		}
		time.Sleep(5 * time.Millisecond)
	}
	err := c.Run(ctx, "chat", CallOptions{Tenant: "acme"}, func(context.Context, *Permit) error { return nil })
	if se := asSidecar(t, err, "protocol_violation"); !strings.Contains(se.Message, "tenants need 3") {
		t.Fatalf("message %q", se.Message)
	}
	if n := s.connCount(); n != 3 {
		t.Fatalf("%d connections, want 3", n)
	}
	wantRequests(t, s)
}

func TestSuccessCachedOnVersion3(t *testing.T) {
	s := startFake(t)
	c := dialFake(t, s)
	ctx := tctx(t)
	call, p := acquireOne(t, c, "chat")
	if err := p.SuccessWith(ctx, SuccessOptions{Usage: Usage{InputTokens: 512, OutputTokens: 300, CachedInputTokens: 2048}}); err != nil {
		t.Fatal(err)
	}
	_ = call.End(ctx)
	wantRequests(t, s, "Start", "Finish")
	want := vectorPayload(t, "finish_success_cached")
	if got := rawRequests(s, 0)[1]; !bytes.Equal(got[12:], want[12:]) { // after tag and permit
		t.Fatalf("Finish:\n got %x\nwant %x", got, want)
	}
	// Run with UsageOf an OpenAI and an Anthropic body; zero cached: SuccessUsage
	for _, body := range []string{
		`{"usage":{"prompt_tokens":90,"completion_tokens":10,"total_tokens":100,"prompt_tokens_details":{"cached_tokens":40}}}`,
		`{"usage":{"input_tokens":7,"output_tokens":2,"cache_read_input_tokens":5000}}`,
		`{"usage":{"input_tokens":7,"output_tokens":2,"cache_read_input_tokens":0}}`,
	} {
		err := c.Run(ctx, "chat", CallOptions{}, func(_ context.Context, p *Permit) error { p.SetUsage(UsageOf([]byte(body))); return nil })
		if err != nil {
			t.Fatal(err)
		}
	}
	var got []outcome
	for _, e := range s.entries() {
		if e.req.tag == reqFinish {
			got = append(got, e.req.outcome)
		}
	}
	want3 := []outcome{
		{tag: outSuccessCached, usage: usage{input: some(512), output: some(300)}, cached: 2048, countAttempt: true},
		{tag: outSuccessCached, usage: usage{tokens: some(100), input: some(50), output: some(10)}, cached: 40, countAttempt: true},
		{tag: outSuccessCached, usage: usage{input: some(7), output: some(2)}, cached: 5000, countAttempt: true},
		{tag: outSuccessUsage, usage: usage{input: some(7), output: some(2)}, countAttempt: true},
	}
	if !reflect.DeepEqual(got, want3) {
		t.Fatalf("outcomes\n got %+v\nwant %+v", got, want3)
	}
	_, p = acquireOne(t, c, "chat")
	asSidecar(t, p.SuccessWith(ctx, SuccessOptions{Usage: Usage{CachedInputTokens: -1}}), "invalid_argument")
}

func TestTenantStatus(t *testing.T) {
	s := startFake(t, &fakeScope{name: "chat", sources: []string{"a"}}, &fakeScope{name: "embed", sources: []string{"e"}})
	c := dialFake(t, s)
	ctx := tctx(t)
	all, err := c.TenantStatus(ctx, "acme", "")
	if err != nil {
		t.Fatal(err)
	}
	if all["tenant"] != "acme" || len(all["scopes"].(map[string]any)) != 2 {
		t.Fatalf("%v", all)
	}
	one, err := c.TenantStatus(ctx, "", "embed")
	if err != nil {
		t.Fatal(err)
	}
	if _, ok := one["scopes"].(map[string]any)["embed"]; !ok || len(one["scopes"].(map[string]any)) != 1 || one["tenant"] != "" {
		t.Fatalf("%v", one)
	}
	var got []request
	for _, e := range s.entries() {
		got = append(got, e.req)
	}
	if len(got) != 2 || got[0].scope.ok || got[0].tenant != "acme" || got[1].scope != (optStr{"embed", true}) || got[1].tenant != "" {
		t.Fatalf("requests %+v", got)
	}
}

func TestUsageOf(t *testing.T) {
	type details struct {
		CachedTokens int `json:"cached_tokens"`
	}
	type openaiUsage struct {
		PromptTokens        int     `json:"prompt_tokens"`
		CompletionTokens    int     `json:"completion_tokens"`
		TotalTokens         int     `json:"total_tokens"`
		PromptTokensDetails details `json:"prompt_tokens_details"`
	}
	type openaiReply struct {
		ID    string      `json:"id"`
		Usage openaiUsage `json:"usage"`
	}
	cases := []struct {
		in   any
		want Usage
	}{
		{openaiReply{"x", openaiUsage{900, 100, 1000, details{300}}}, Usage{Tokens: 1000, InputTokens: 600, OutputTokens: 100, CachedInputTokens: 300}},
		{`{"usage":{"input_tokens":700,"output_tokens":50,"total_tokens":750,"input_tokens_details":{"cached_tokens":200}}}`, Usage{Tokens: 750, InputTokens: 500, OutputTokens: 50, CachedInputTokens: 200}},
		{map[string]any{"usage": map[string]any{"input_tokens": 700.0, "output_tokens": 50.0, "cache_read_input_tokens": 5000.0}}, Usage{InputTokens: 700, OutputTokens: 50, CachedInputTokens: 5000}},
		{`{"input_tokens":3,"output_tokens":4}`, Usage{InputTokens: 3, OutputTokens: 4}},
		{`{"usage":{"prompt_tokens":-5,"completion_tokens":1.5,"total_tokens":"x"}}`, Usage{}},
		{`not json`, Usage{}},
		{nil, Usage{}},
		{make(chan int), Usage{}},
	}
	for i, tc := range cases {
		if got := UsageOf(tc.in); got != tc.want {
			t.Errorf("case %d: UsageOf = %+v, want %+v", i, got, tc.want)
		}
	}
}
