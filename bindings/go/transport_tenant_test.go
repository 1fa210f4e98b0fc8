package polygate

// Transport's tenants (DESIGN §19 items 1, 6) against the fake sidecar and an
// in-memory upstream: TenantFunc called with the request, the X-Polygate-Tenant
// header winning and never sent (the caller's request untouched), a too-long id
// refused before anything is begun, the tenant's refusal as a 429 or the typed
// error.

import (
	"context"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"net/url"
	"reflect"
	"strings"
	"sync"
	"testing"
	"time"
)

// recordingRoundTripper answers 200 chatOK and keeps what it was sent.
type recordingRoundTripper struct {
	mu   sync.Mutex
	sent []sentRequest
}

type sentRequest struct {
	url    string
	header http.Header
	body   string
}

func (r *recordingRoundTripper) RoundTrip(req *http.Request) (*http.Response, error) {
	var b []byte
	if req.Body != nil {
		b, _ = io.ReadAll(req.Body)
		req.Body.Close()
	}
	r.mu.Lock()
	r.sent = append(r.sent, sentRequest{url: req.URL.String(), header: req.Header.Clone(), body: string(b)})
	r.mu.Unlock()
	return &http.Response{StatusCode: 200, Status: "200 OK", Proto: "HTTP/1.1", ProtoMajor: 1, ProtoMinor: 1,
		Header: http.Header{"Content-Type": {"application/json"}}, Body: io.NopCloser(strings.NewReader(chatOK)),
		ContentLength: int64(len(chatOK)), Request: req}, nil
}

func (r *recordingRoundTripper) last(t *testing.T) sentRequest {
	t.Helper()
	r.mu.Lock()
	defer r.mu.Unlock()
	if len(r.sent) == 0 {
		t.Fatal("nothing was sent upstream")
	}
	return r.sent[len(r.sent)-1]
}

func (r *recordingRoundTripper) count() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return len(r.sent)
}

// startTenants are the tenants of the fake's call-starting requests, in order
// ("-" for a plain Start: the anonymous tenant).
func startTenants(s *fakeSidecar) []string {
	var out []string
	for _, e := range s.entries() {
		switch e.req.tag {
		case reqStart:
			out = append(out, "-")
		case reqStartTenant:
			out = append(out, e.req.tenant)
		}
	}
	return out
}

func tenantRequest(t *testing.T, ctx context.Context, method, target, body string) *http.Request {
	t.Helper()
	var rd io.Reader
	if body != "" {
		rd = strings.NewReader(body)
	}
	req, err := http.NewRequestWithContext(ctx, method, target, rd)
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Authorization", "Bearer caller")
	return req
}

func doRead(t *testing.T, hc *http.Client, req *http.Request) *http.Response {
	t.Helper()
	resp, err := hc.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	readAll(t, resp)
	return resp
}

func TestTransportTenantFuncCalledWithTheRequest(t *testing.T) {
	s := startFake(t)
	c := dialFake(t, s)
	ctx := tctx(t)
	rec := &recordingRoundTripper{}
	var seen []string
	tr := &Transport{Client: c, Scope: "chat", Base: rec, Tenant: "the-option", TenantFunc: func(r *http.Request) string {
		var b []byte
		if r.Body != nil { // a client's GET has none
			var err error
			if b, err = io.ReadAll(r.Body); err != nil { // readable, and still sent whole
				t.Errorf("TenantFunc reading the body: %v", err)
			}
		}
		seen = append(seen, r.Method+" "+r.URL.Path+" "+r.Header.Get("X-Org")+" "+string(b))
		return r.Header.Get("X-Org")
	}}
	hc := &http.Client{Transport: tr, Timeout: 10 * time.Second}

	req := tenantRequest(t, ctx, "POST", "http://up.invalid/v1/chat/completions", chatBody)
	req.Header.Set("X-Org", "acme")
	doRead(t, hc, req)
	if want := []string{"POST /v1/chat/completions acme " + chatBody}; !reflect.DeepEqual(seen, want) {
		t.Fatalf("TenantFunc saw %q, want %q", seen, want)
	}
	if got := rec.last(t).body; got != chatBody {
		t.Fatalf("upstream got body %q after TenantFunc read it", got)
	}
	// TenantFunc's "" is the anonymous tenant: it wins over Tenant.
	doRead(t, hc, tenantRequest(t, ctx, "GET", "http://up.invalid/v1/models", ""))
	// Without TenantFunc, Tenant names every request's tenant.
	tr2 := &Transport{Client: c, Scope: "chat", Base: rec, Tenant: "the-option"}
	doRead(t, &http.Client{Transport: tr2, Timeout: 10 * time.Second}, tenantRequest(t, ctx, "POST", "http://up.invalid/v1/chat/completions", chatBody))
	if got, want := startTenants(s), []string{"acme", "-", "the-option"}; !reflect.DeepEqual(got, want) {
		t.Fatalf("tenants %q, want %q", got, want)
	}
	if len(seen) != 2 {
		t.Fatalf("TenantFunc called %d times, want 2", len(seen))
	}
}

func TestTransportTenantHeaderWinsAndIsNeverSent(t *testing.T) {
	s := startFake(t)
	c := dialFake(t, s)
	ctx := tctx(t)
	upstream, err := url.Parse("http://up.invalid/v1")
	if err != nil {
		t.Fatal(err)
	}
	for _, routed := range []bool{false, true} {
		rec := &recordingRoundTripper{}
		called := 0
		tr := &Transport{Client: c, Scope: "chat", Base: rec, Tenant: "the-option",
			TenantFunc: func(*http.Request) string { called++; return "the-func" }}
		if routed {
			tr.Routes = map[string]Route{}
			for _, src := range []string{"a", "b", "c"} {
				tr.Routes[src] = Route{BaseURL: "http://" + src + ".invalid/v2", Headers: map[string]string{"X-Key": src}}
			}
			tr.SDKBaseURL = upstream.String()
		}
		hc := &http.Client{Transport: tr, Timeout: 10 * time.Second}
		cases := []struct {
			method, body string
			set          func(h http.Header)
		}{
			{"POST", chatBody, func(h http.Header) { h.Set(TenantHeader, "hdr-post") }},
			{"GET", "", func(h http.Header) { h.Set("x-polygate-tenant", "hdr-get") }},
			// a key put on the map as it is: net/http would send it so
			{"POST", chatBody, func(h http.Header) { h["x-polygate-tenant"] = []string{"hdr-raw"} }},
			// an empty value: the anonymous tenant, still winning
			{"POST", chatBody, func(h http.Header) { h.Set(TenantHeader, "") }},
		}
		for i, tc := range cases {
			req := tenantRequest(t, ctx, tc.method, upstream.String()+"/chat/completions?x=1", tc.body)
			req.Header.Set("X-Other", "kept")
			tc.set(req.Header)
			before := req.Header.Clone()
			urlBefore := req.URL.String()
			doRead(t, hc, req)
			if !reflect.DeepEqual(req.Header, before) || req.URL.String() != urlBefore {
				t.Fatalf("routed=%v case %d: the caller's request changed: %v %s, was %v %s", routed, i, req.Header, req.URL, before, urlBefore)
			}
			got := rec.last(t)
			for k := range got.header {
				if strings.EqualFold(k, TenantHeader) {
					t.Fatalf("routed=%v case %d: %s sent upstream: %v", routed, i, k, got.header)
				}
			}
			// Routed to another origin, the SDK's key stays behind (DESIGN §17).
			wantAuth := "Bearer caller"
			if routed {
				wantAuth = ""
			}
			if got.header.Get("X-Other") != "kept" || got.header.Get("Authorization") != wantAuth || got.body != tc.body {
				t.Fatalf("routed=%v case %d: sent %v %q", routed, i, got.header, got.body)
			}
			if routed && (got.header.Get("X-Key") == "" || !strings.HasSuffix(got.url, ".invalid/v2/chat/completions?x=1")) {
				t.Fatalf("routed case %d: sent to %s with %v", i, got.url, got.header)
			}
		}
		if called != 0 {
			t.Fatalf("routed=%v: TenantFunc called %d times though every request had the header", routed, called)
		}
	}
	want := []string{"hdr-post", "hdr-get", "hdr-raw", "-"}
	if got := startTenants(s); !reflect.DeepEqual(got, append(append([]string(nil), want...), want...)) {
		t.Fatalf("tenants %q", got)
	}
}

func TestTransportTenantTooLongIsAClearError(t *testing.T) {
	s := startFake(t)
	c := dialFake(t, s)
	ctx := tctx(t)
	rec := &recordingRoundTripper{}
	long := strings.Repeat("t", MaxTenantBytes+1)
	for _, tc := range []struct {
		name string
		tr   *Transport
		hdr  string
		from string
	}{
		{"header", &Transport{Tenant: "ok"}, long, "the X-Polygate-Tenant header"},
		{"option", &Transport{Tenant: long}, "", "Transport.Tenant"},
		{"func", &Transport{TenantFunc: func(*http.Request) string { return long }}, "", "Transport.TenantFunc"},
	} {
		tc.tr.Client, tc.tr.Scope, tc.tr.Base = c, "chat", rec
		req := tenantRequest(t, ctx, "POST", "http://up.invalid/v1/chat/completions", chatBody)
		if tc.hdr != "" {
			req.Header.Set(TenantHeader, tc.hdr)
		}
		body := &closeCounter{Reader: strings.NewReader(chatBody)}
		req.Body = body
		resp, err := (&http.Client{Transport: tc.tr, Timeout: 10 * time.Second}).Do(req)
		if resp != nil {
			resp.Body.Close()
			t.Fatalf("%s: a response (%d) for a %d-byte tenant", tc.name, resp.StatusCode, len(long))
		}
		se := asSidecar(t, err, "invalid_argument")
		if !strings.Contains(se.Message, tc.from) || !strings.Contains(se.Message, "129 bytes of UTF-8; the limit is 128 bytes") || se.Scope != "chat" {
			t.Fatalf("%s: message %q scope %q", tc.name, se.Message, se.Scope)
		}
		if body.closed != 1 {
			t.Fatalf("%s: the request body was closed %d times", tc.name, body.closed)
		}
	}
	if err := c.Ping(ctx); err != nil {
		t.Fatal(err)
	}
	wantRequests(t, s, "Ping") // no call was begun
	if rec.count() != 0 {
		t.Fatalf("%d requests sent upstream", rec.count())
	}
}

type closeCounter struct {
	io.Reader
	closed int
}

func (c *closeCounter) Close() error { c.closed++; return nil }

type refusalBody struct {
	Error map[string]any `json:"error"`
}

func TestTransportTenantRefusal429AndTypedError(t *testing.T) {
	s := startFake(t)
	s.setHook(func(fc *fakeConn, id uint64, r *request) bool {
		if r.tag == reqStartTenant && r.tenant == "acme" {
			fc.reply(id, refusal()) // acme over usd_per_day, retry after 5400 s
			return true
		}
		return false
	})
	c := dialFake(t, s)
	ctx := tctx(t)
	rec := &recordingRoundTripper{}
	hc := &http.Client{Transport: &Transport{Client: c, Scope: "chat", Base: rec, Tenant: "acme"}, Timeout: 10 * time.Second}
	resp, err := hc.Do(tenantRequest(t, ctx, "POST", "http://up.invalid/v1/chat/completions", chatBody))
	if err != nil {
		t.Fatal(err)
	}
	b := readAll(t, resp)
	var doc refusalBody
	if err := json.Unmarshal(b, &doc); err != nil {
		t.Fatalf("%v: %s", err, b)
	}
	h := resp.Header
	if resp.StatusCode != 429 || h.Get("Content-Type") != "application/json" || h.Get("Retry-After") != "5400" ||
		h.Get("Retry-After-Ms") != "5400000" || h.Get("X-Polygate-Refusal") != "tenant_limited" || h.Get("X-Should-Retry") != "false" {
		t.Fatalf("refusal %d %v", resp.StatusCode, h)
	}
	e := doc.Error
	if e["type"] != "polygate" || e["code"] != "tenant_limited" || e["limit_source"] != "tenant" || e["tenant"] != "acme" ||
		e["limit"] != "usd_per_day" || e["scope"] != "chat" || e["retry_after_s"] != 5400.0 ||
		!strings.Contains(e["message"].(string), "PolyGate") || !strings.Contains(e["message"].(string), `tenant "acme"`) ||
		!reflect.DeepEqual(e["per_source_reasons"], map[string]any{"a": "tenant_limited", "b": "circuit_open"}) {
		t.Fatalf("refusal body %s", b)
	}
	// RefuseWithError: the *TenantLimitError through http.Client's *url.Error.
	hc = &http.Client{Transport: &Transport{Client: c, Scope: "chat", Base: rec, OnRefusal: RefuseWithError}, Timeout: 10 * time.Second}
	req := tenantRequest(t, ctx, "POST", "http://up.invalid/v1/chat/completions", chatBody)
	req.Header.Set(TenantHeader, "acme")
	resp, err = hc.Do(req)
	if resp != nil {
		resp.Body.Close()
	}
	var ue *url.Error
	var te *TenantLimitError
	if !errors.As(err, &ue) || !errors.As(err, &te) || te.Tenant != "acme" || te.Limit != "usd_per_day" || te.RetryAfter != 5400*time.Second {
		t.Fatalf("RefuseWithError: %T %v", err, err)
	}
	if rec.count() != 0 {
		t.Fatalf("a refused request was sent upstream (%d)", rec.count())
	}
	// Another tenant is not refused.
	req = tenantRequest(t, ctx, "POST", "http://up.invalid/v1/chat/completions", chatBody)
	req.Header.Set(TenantHeader, "globex")
	if resp := doRead(t, hc, req); resp.StatusCode != 200 || rec.count() != 1 {
		t.Fatalf("globex: %d, %d sent", resp.StatusCode, rec.count())
	}
}

func TestRefusalResponseLimitSourceOnlyForTenants(t *testing.T) {
	req, _ := http.NewRequest("GET", "http://up.invalid/", nil)
	others := []error{
		&CircuitOpenError{GatewayUnavailableError{Kind: "circuit_open", Message: "open", RetryAfter: 1500 * time.Millisecond}},
		&AllSourcesExhaustedError{GatewayUnavailableError: GatewayUnavailableError{Kind: "all_sources_exhausted", Message: "quota"}, Reason: ReasonQuotaExhausted},
		&GatewayUnavailableError{Kind: "backend_unavailable", Message: "redis"},
	}
	wantCode := []string{"circuit_open", "quota_exhausted", "backend_unavailable"}
	wantStatus := []int{503, 429, 503}
	for i, err := range others {
		resp := refusalResponse(err, "chat", req)
		b, _ := io.ReadAll(resp.Body)
		var doc refusalBody
		if err := json.Unmarshal(b, &doc); err != nil {
			t.Fatal(err)
		}
		if _, has := doc.Error["limit_source"]; has || doc.Error["tenant"] != nil || doc.Error["limit"] != nil {
			t.Fatalf("%T carries tenant keys: %s", err, b)
		}
		if resp.StatusCode != wantStatus[i] || doc.Error["code"] != wantCode[i] || resp.Header.Get("X-Polygate-Refusal") != wantCode[i] {
			t.Fatalf("%T: %d %v %s", err, resp.StatusCode, resp.Header, b)
		}
	}
	// The anonymous tenant is named as "".
	te := &TenantLimitError{GatewayUnavailableError: GatewayUnavailableError{Kind: "tenant_limited", Message: "anon", RetryAfter: 200 * time.Millisecond}, Limit: "rpm"}
	resp := refusalResponse(te, "chat", req)
	b, _ := io.ReadAll(resp.Body)
	var doc refusalBody
	if err := json.Unmarshal(b, &doc); err != nil {
		t.Fatal(err)
	}
	if resp.StatusCode != 429 || doc.Error["tenant"] != "" || doc.Error["limit"] != "rpm" || doc.Error["limit_source"] != "tenant" ||
		resp.Header.Get("Retry-After") != "1" || resp.Header.Get("Retry-After-Ms") != "200" {
		t.Fatalf("anonymous tenant's refusal: %d %v %s", resp.StatusCode, resp.Header, b)
	}
}

func TestTenantHeaderValueIsTrimmedAsHTTPReadsIt(t *testing.T) {
	for _, tc := range []struct {
		h    http.Header
		want string
		ok   bool
	}{
		{http.Header{TenantHeader: {" acme\t"}}, "acme", true},
		{http.Header{"x-polygate-tenant": {"\tglobex "}}, "globex", true},
		{http.Header{TenantHeader: {"  "}}, "", true},
		{http.Header{TenantHeader: {}}, "", true},
		{http.Header{TenantHeader: {"a b"}}, "a b", true},
		{http.Header{TenantHeader: {"acme\r\n"}}, "acme", true},
		{http.Header{"X-Other": {"x"}}, "", false},
		// Given twice: one value, joined as fetch's Headers.get joins them.
		{http.Header{TenantHeader: {" a ", "b"}}, "a, b", true},
		{http.Header{TenantHeader: {"a"}, "x-polygate-tenant": {"b"}, "X-POLYGATE-TENANT": {"c"}}, "a, c, b", true},
	} {
		got, ok := tenantHeader(tc.h)
		if got != tc.want || ok != tc.ok {
			t.Fatalf("tenantHeader(%v) = %q, %v; want %q, %v", tc.h, got, ok, tc.want, tc.ok)
		}
	}
}
