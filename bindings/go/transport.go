package polygate

// The gate as an http.RoundTripper (DESIGN §17): install it once where the HTTP
// client is built, and every request an SDK sends through that client is admitted,
// reported and settled. DESIGN §18 lives in attempt: the one place holding (permit,
// response header) after a response.

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"net/http"
	"net/url"
	"sort"
	"strconv"
	"strings"
	"sync"
	"time"
	"unicode/utf8"
)

// RefusalMode says what a Transport does when PolyGate ends a call (circuit open,
// budget exhausted).
type RefusalMode uint8

const (
	// RefuseWithResponse (the default) answers with a synthetic response the SDK
	// already understands: 503 for an open circuit (and a stalled or retry-exhausted
	// call), 429 for exhausted quota and for a tenant over its limit, with
	// Retry-After, X-Polygate-Refusal and a JSON error body naming PolyGate and
	// the reason (a tenant's refusal also names the tenant and the limit).
	RefuseWithResponse RefusalMode = iota
	// RefuseWithError returns the typed error (*CircuitOpenError,
	// *AllSourcesExhaustedError, *TenantLimitError, *GatewayUnavailableError)
	// from RoundTrip; an http.Client wraps it in a *url.Error, errors.As finds it.
	RefuseWithError
)

// Route is where a granted source's requests go. A request URL under one of the
// routes' base URLs (same scheme, host and port, and a path prefix ending at a
// segment boundary; the longest wins) has that prefix replaced by the granted
// route's BaseURL: give Routes the base URLs you give the SDK. A request URL under
// none keeps its path, with BaseURL's path put in front.
type Route struct {
	// BaseURL is the source's deployment as the SDK would be given it
	// ("https://api.openai.com/v1", "http://gpu-1:8000/v1",
	// "https://res.openai.azure.com/openai/deployments/gpt-4o"): no query.
	BaseURL string
	// Headers are set on the request (API key, "api-key", ...), replacing the
	// request's headers of the same name.
	Headers map[string]string
	// Query parameters are set on the request's query (Azure OpenAI's
	// {"api-version": "2024-10-21"}), replacing same-named ones and keeping the
	// others; they are added in name order.
	Query map[string]string
	// Model, when set, is the "model" a JSON-object request body gets on this
	// route (a deployment serving the model under another name); the body's other
	// bytes are kept and its length follows.
	Model string
}

// Transport is an http.RoundTripper that gates every request through PolyGate
// (DESIGN §17):
//
//	hc := &http.Client{Transport: &polygate.Transport{Scope: "chat"}}
//	client := openai.NewClient(option.WithHTTPClient(hc))
//
// One request = one call: Start before it is sent, Finish after the response body
// ends (EOF, or Close for a body the caller abandons). An SDK's own retries are
// separate calls, each admitted. The estimate is the body's UTF-8 bytes / 4 for
// input and its max_tokens / max_completion_tokens / max_output_tokens for output
// (else the source's est_output_tokens), or Estimate's. The outcome: 2xx → success
// with the JSON body's usage (OpenAI chat, responses, embeddings; Anthropic
// messages); a text/event-stream body passes through unchanged while its usage
// events are read, and the permit is held until the stream ends; 429 →
// rate-limited (retry-after-ms, then Retry-After); 408, 409, 5xx → server_error /
// timeout; transport errors → classified (Classify); other 4xx → error; 3xx → an
// uncounted success with no tokens. The response reaches the caller unchanged,
// but for a routed 3xx's relative Location, made absolute against the URL sent.
//
// Tenants (DESIGN §19): a request's tenant is its TenantHeader if it has one, else
// TenantFunc's answer, else Tenant; the header is removed before the request is
// sent. A tenant over its limit gets a synthetic 429 (or the *TenantLimitError).
//
// A Transport is safe for concurrent use; set its fields before the first request.
type Transport struct {
	// Base sends the requests; nil = http.DefaultTransport.
	Base http.RoundTripper
	// Client is the connection to the sidecar; nil = one dialled on first use
	// from Path (and kept).
	Client *Client
	// Path is the sidecar's socket when Client is nil ("" → $POLYGATE_SOCKET →
	// the default path).
	Path string
	// Scope is the PolyGate scope every request belongs to (required).
	Scope string
	// Priority names a priority class of the scope (DESIGN §15); "" = its default.
	Priority string
	// Routes maps a source to its deployment; nil = the request goes where the
	// SDK sent it; an empty, non-nil map is an invalid-argument *SidecarError at
	// every request, before it is admitted. A granted source missing from Routes
	// is a *RouteMissingError before anything is sent.
	Routes map[string]Route
	// SDKBaseURL (optional) is the SDK's base URL ("https://api.openai.com/v1")
	// when it is none of the Routes' base URLs: matched like theirs, so the part
	// of the request URL after it is appended to the route's BaseURL.
	SDKBaseURL string
	// Estimate (optional) returns the request's input and output token
	// estimates; a side <= 0 falls back to the built-in rule. The request's
	// body is readable (and re-readable through GetBody).
	Estimate func(*http.Request) (in, out int64)
	// OnRefusal: RefuseWithResponse (default) or RefuseWithError.
	OnRefusal RefusalMode
	// Tenant is the tenant (DESIGN §19) of every request that names none itself:
	// at most MaxTenantBytes (128) bytes of UTF-8; "" = the scope's anonymous
	// tenant. A request's TenantHeader wins over it, and so does TenantFunc.
	Tenant string
	// TenantFunc (optional) returns the tenant of a request that has no
	// TenantHeader; when set, it wins over Tenant ("" = the anonymous tenant).
	// The request's body, when it has one, is readable (and re-readable through
	// GetBody); it must not modify the request.
	TenantFunc func(*http.Request) string

	mu     sync.Mutex
	dialed *Client

	// routesOnce parses Routes (and SDKBaseURL) at the first request into
	// table, or routesErr.
	routesOnce sync.Once
	table      *routeTable
	routesErr  error
}

// TenantHeader is the request header naming a request's tenant (DESIGN §19): it
// wins over Transport.Tenant and Transport.TenantFunc; an empty value is the
// scope's anonymous tenant. Transport removes it from the request it sends
// upstream (with or without Routes); the caller's request is left as it is.
const TenantHeader = "X-Polygate-Tenant"

// tenantHeader is the value of the request's TenantHeader and whether it has one
// (a key set on the map directly, not in its canonical form, counts too: net/http
// would send it as it is). HTTP whitespace around the value (space, tab, CR, LF) is
// not part of it, and a header given more than once is its values joined by ", "
// (RFC 9110, section 5.3): what fetch's Headers gives the Node binding, and Python reads,
// so one request names one tenant in all three.
func tenantHeader(h http.Header) (string, bool) {
	vs, found := h[TenantHeader]
	var others []string // keys not in canonical form, in a fixed order
	for k := range h {
		if k != TenantHeader && len(k) == len(TenantHeader) && strings.EqualFold(k, TenantHeader) {
			others = append(others, k)
		}
	}
	if len(others) == 0 && len(vs) <= 1 { // the usual case: no copy made
		if len(vs) == 0 {
			return "", found
		}
		return strings.Trim(vs[0], " \t\r\n"), true
	}
	sort.Strings(others)
	all := append([]string(nil), vs...) // not the caller's slice: trimmed below
	for _, k := range others {
		all = append(all, h[k]...)
	}
	for i, v := range all {
		all[i] = strings.Trim(v, " \t\r\n")
	}
	return strings.Join(all, ", "), true
}

// withoutTenantHeader is a copy of h without TenantHeader (under any spelling).
func withoutTenantHeader(h http.Header) http.Header {
	out := make(http.Header, len(h))
	for k, v := range h {
		if len(k) == len(TenantHeader) && strings.EqualFold(k, TenantHeader) {
			continue
		}
		out[k] = append([]string(nil), v...)
	}
	return out
}

// RouteMissingError: PolyGate granted a source that Transport.Routes does not
// name; nothing was sent, the permit was released.
type RouteMissingError struct {
	// Scope is the transport's scope.
	Scope string
	// Source is the granted source.
	Source string
	// Routes are the sources Routes names.
	Routes []string
}

func (e *RouteMissingError) Error() string {
	return fmt.Sprintf("polygate: granted source %q in scope %q has no entry in Transport.Routes (routes name: %s); add it to Routes, or remove it from the scope",
		e.Source, e.Scope, strings.Join(e.Routes, ", "))
}

func (t *Transport) client(ctx context.Context) (*Client, error) {
	if t.Client != nil {
		return t.Client, nil
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.dialed == nil {
		c, err := Dial(ctx, t.Path)
		if err != nil {
			return nil, err
		}
		t.dialed = c
	}
	return t.dialed, nil
}

// CloseIdleConnections closes the Base transport's idle connections (http.Client
// calls it through this method).
func (t *Transport) CloseIdleConnections() {
	type closeIdler interface{ CloseIdleConnections() }
	if ci, ok := t.base().(closeIdler); ok {
		ci.CloseIdleConnections()
	}
}

func (t *Transport) base() http.RoundTripper {
	if t.Base != nil {
		return t.Base
	}
	return http.DefaultTransport
}

var outputKeys = [][]byte{[]byte(`"max_tokens"`), []byte(`"max_completion_tokens"`), []byte(`"max_output_tokens"`)}

// EstimateBody is the built-in estimate of a request body: input = ceil(UTF-8
// bytes / 4), output = the first max_tokens / max_completion_tokens /
// max_output_tokens with a number (0 = none).
func EstimateBody(body []byte) (in, out int64) {
	if len(body) == 0 {
		return 0, 0
	}
	in = (int64(len(body)) + 3) / 4
	for _, key := range outputKeys {
		for off := 0; ; {
			i := bytes.Index(body[off:], key)
			if i < 0 {
				break
			}
			j := skipColon(body, off+i+len(key))
			off = j
			if j < 0 {
				break
			}
			n := int64(0)
			k := j
			for ; k < len(body) && body[k] >= '0' && body[k] <= '9' && n < 1e15; k++ {
				n = n*10 + int64(body[k]-'0')
			}
			if k > j {
				return in, n
			}
		}
	}
	return in, 0
}

// skipColon returns the index after `\s*:\s*` at b[i:], or -1.
func skipColon(b []byte, i int) int {
	for i < len(b) && isSpace(b[i]) {
		i++
	}
	if i >= len(b) || b[i] != ':' {
		return -1
	}
	for i++; i < len(b) && isSpace(b[i]); i++ {
	}
	return i
}

func isSpace(c byte) bool { return c == ' ' || c == '\t' || c == '\n' || c == '\r' }

func clampCount(n int64) int {
	if n <= 0 {
		return 0
	}
	if n > maxCount {
		return maxCount
	}
	return int(n)
}

// RoundTrip admits, sends, and settles one request (http.RoundTripper).
func (t *Transport) RoundTrip(req *http.Request) (*http.Response, error) {
	if t.Scope == "" {
		closeBody(req)
		return nil, invalidArgument("polygate.Transport needs a Scope")
	}
	ctx := req.Context()
	var body []byte
	if req.Body != nil && req.Body != http.NoBody {
		b, err := readSized(req.Body, req.ContentLength)
		req.Body.Close()
		if err != nil {
			return nil, err
		}
		body = b
	}
	// One allocation holds the attempt and what the request needs beside it.
	att := &attempt{reqCtx: ctx}
	att.ctx = &att.detached
	att.detached.parent = ctx
	named, hasNamed := tenantHeader(req.Header)
	out := req
	hasBody := req.Body != nil && req.Body != http.NoBody
	if hasBody || hasNamed {
		att.req = *req // RoundTrip must not modify the caller's request
		out = &att.req
	}
	if hasBody {
		att.reqBody.Reset(body)
		att.req.Body = &att.reqBody
		att.req.GetBody = func() (io.ReadCloser, error) { return newByteBody(body), nil }
	}
	if hasNamed {
		// Never sent upstream: the copy's header lacks it, the caller's keeps it.
		att.req.Header = withoutTenantHeader(req.Header)
	}
	// rewind gives a hook that read the body a fresh one.
	rewind := func() {
		if body != nil {
			att.reqBody.Reset(body)
			out.Body = &att.reqBody
		}
	}
	tenant, from := t.Tenant, "Transport.Tenant"
	switch {
	case hasNamed:
		tenant, from = named, "the "+TenantHeader+" header"
	case t.TenantFunc != nil:
		tenant, from = t.TenantFunc(out), "Transport.TenantFunc"
		rewind()
	}
	if err := checkTenant(tenant); err != nil {
		se := err.(*SidecarError)
		se.Message = "polygate.Transport: the tenant from " + from + ": " + se.Message
		se.Scope = t.Scope
		return nil, se
	}
	in, outTok := EstimateBody(body)
	if t.Estimate != nil {
		hi, ho := t.Estimate(out)
		if hi > 0 {
			in = hi
		}
		if ho > 0 {
			outTok = ho
		}
		rewind()
	}

	if t.Routes != nil {
		if _, err := t.routeTable(); err != nil {
			return nil, err
		}
	}
	c, err := t.client(ctx)
	if err != nil {
		return nil, err
	}
	call, err := c.Begin(ctx, t.Scope, CallOptions{EstInputTokens: clampCount(in), EstOutputTokens: clampCount(outTok), Priority: t.Priority, Tenant: tenant})
	if err != nil {
		return nil, err
	}
	p, err := call.Acquire(ctx)
	if err != nil {
		call.End(context.WithoutCancel(ctx))
		var gu *GatewayUnavailableError
		if t.OnRefusal == RefuseWithResponse && errors.As(err, &gu) {
			return refusalResponse(err, t.Scope, req), nil
		}
		return nil, err
	}
	att.call, att.permit = call, p
	var route *parsedRoute
	if t.Routes != nil {
		var ok bool
		route, ok = t.table.routes[p.Source]
		if !ok {
			att.settle(func(p *Permit) error { return p.Cancel(att.ctx) })
			names := make([]string, 0, len(t.Routes))
			for k := range t.Routes {
				names = append(names, k)
			}
			sort.Strings(names)
			return nil, &RouteMissingError{Scope: t.Scope, Source: p.Source, Routes: names}
		}
		if out, err = t.table.routed(out, route, body); err != nil {
			att.settle(func(p *Permit) error { return p.Cancel(att.ctx) })
			return nil, err
		}
	}

	resp, err := t.base().RoundTrip(out)
	if err != nil {
		att.transportError(err)
		return nil, err
	}
	if route != nil && resp.StatusCode >= 300 && resp.StatusCode < 400 {
		relocate(req.URL, out.URL, route, resp.Header)
	}
	att.header = resp.Header
	return att.response(resp)
}

// relocate writes a routed request's 3xx Location as the SDK's own URL (DESIGN
// §17). Resolved against the URL actually sent (RFC 9110, section 10.2.2: relative
// to the request's target), a target under the granted route's base URL has that
// prefix replaced by the one the SDK's request (sdk) was under: an http.Client
// follows redirects above the transport, and a Location left relative would be
// resolved against the SDK's URL and routed twice (a doubled base path), one made
// absolute on the route's host would be sent there with the SDK's keys (the client
// drops only Authorization and cookies on another origin). Any other target is
// made absolute.
func relocate(sdk, sent *url.URL, route *parsedRoute, h http.Header) {
	loc := h.Get("Location")
	if loc == "" {
		return
	}
	ref, err := url.Parse(loc)
	if err != nil {
		return // one the client will refuse itself
	}
	to := sent.ResolveReference(ref)
	if back := sdkLocation(sdk, sent, route, to); back != "" {
		h.Set("Location", back)
	} else if !ref.IsAbs() {
		h.Set("Location", to.String())
	}
}

// sdkLocation is target (absolute) under the SDK's base URL, for a target under
// route's base URL (the origin sent went to, and its prefix); "" for any other.
func sdkLocation(sdk, sent *url.URL, route *parsedRoute, target *url.URL) string {
	tp, sp, kp := target.EscapedPath(), sent.EscapedPath(), sdk.EscapedPath()
	if originKey(target) != originKey(sent) || !under(tp, route.prefix) || !strings.HasPrefix(sp, route.prefix) {
		return ""
	}
	rest := sp[len(route.prefix):]
	if !strings.HasSuffix(kp, rest) {
		return ""
	}
	path := kp[:len(kp)-len(rest)] + tp[len(route.prefix):]
	if !strings.HasPrefix(path, "/") {
		path = "/" + path
	}
	out := sdk.Scheme + "://" + sdk.Host + path
	if target.RawQuery != "" {
		out += "?" + target.RawQuery
	}
	if target.Fragment != "" {
		out += "#" + target.EscapedFragment()
	}
	return out
}

// readSized is io.ReadAll with the buffer sized by a known length (one allocation).
func readSized(r io.Reader, n int64) ([]byte, error) {
	if n <= 0 || n > 64<<20 {
		return io.ReadAll(r)
	}
	b := make([]byte, 0, n+1) // +1: EOF is seen without growing
	for {
		k, err := r.Read(b[len(b):cap(b)])
		b = b[:len(b)+k]
		if err == io.EOF {
			return b, nil
		}
		if err != nil {
			return b, err
		}
		if len(b) == cap(b) {
			b = append(b, 0)[:len(b)]
		}
	}
}

// byteBody is a buffered body: a bytes.Reader that closes (one allocation, where
// io.NopCloser(bytes.NewReader(b)) takes two).
type byteBody struct{ bytes.Reader }

func (*byteBody) Close() error { return nil }

func newByteBody(b []byte) *byteBody {
	bb := &byteBody{}
	bb.Reset(b)
	return bb
}

func closeBody(req *http.Request) {
	if req.Body != nil {
		req.Body.Close()
	}
}

// routeTable is Routes parsed: each source's route and the base URLs a request
// URL is matched against.
type routeTable struct {
	// routes maps a source to its parsed route.
	routes map[string]*parsedRoute
	// bases are the routes' base URLs (and SDKBaseURL), the longest prefix first.
	bases []routeBase
}

// parsedRoute is a Route checked and taken apart.
type parsedRoute struct {
	// scheme and host (with its port, if any) the request goes to.
	scheme, host string
	// prefix is BaseURL's escaped path without its trailing "/".
	prefix string
	// origin is BaseURL's "scheme://host:port" (originKey): a request under a base
	// URL of another origin leaves its credentials behind (credentialHeaders).
	origin string
	// headers are Route.Headers.
	headers map[string]string
	// query is Route.Query, sorted by name.
	query [][2]string
	// model is Route.Model.
	model string
}

// routeBase is a base URL a request URL is matched against.
type routeBase struct {
	// origin is "scheme://host:port", the port always given.
	origin string
	// prefix is the base URL's escaped path without its trailing "/".
	prefix string
}

func (t *Transport) routeTable() (*routeTable, error) {
	t.routesOnce.Do(func() { t.table, t.routesErr = parseRoutes(t.Routes, t.SDKBaseURL) })
	return t.table, t.routesErr
}

func parseBase(what, raw string) (*url.URL, error) {
	u, err := url.Parse(raw)
	if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
		return nil, invalidArgument("%s: %q is not an absolute http(s) URL", what, raw)
	}
	if u.RawQuery != "" || u.ForceQuery || u.Fragment != "" {
		return nil, invalidArgument("%s: %q must not have a query or fragment (give query parameters as the route's Query)", what, raw)
	}
	return u, nil
}

func originKey(u *url.URL) string {
	port := u.Port()
	if port == "" {
		port = "80"
		if strings.EqualFold(u.Scheme, "https") {
			port = "443"
		}
	}
	return strings.ToLower(u.Scheme) + "://" + strings.ToLower(u.Hostname()) + ":" + port
}

func parseRoutes(routes map[string]Route, sdkBase string) (*routeTable, error) {
	if len(routes) == 0 {
		// Every grant would be a RouteMissingError: said once, before anything is
		// admitted, as Python's and Node's constructors say it (nil = no routing).
		return nil, invalidArgument("Transport.Routes is empty: give each source its Route, or leave Routes nil to send requests where the SDK sent them")
	}
	tb := &routeTable{routes: make(map[string]*parsedRoute, len(routes))}
	for src, r := range routes {
		u, err := parseBase(fmt.Sprintf("Transport.Routes[%q].BaseURL", src), r.BaseURL)
		if err != nil {
			return nil, err
		}
		pr := &parsedRoute{scheme: u.Scheme, host: u.Host, prefix: strings.TrimRight(u.EscapedPath(), "/"),
			origin: originKey(u), headers: r.Headers, model: r.Model}
		seen := make(map[string]string, len(r.Headers))
		for k := range r.Headers {
			c := http.CanonicalHeaderKey(k)
			if other, dup := seen[c]; dup {
				a, b := other, k
				if b < a {
					a, b = b, a
				}
				return nil, invalidArgument("Transport.Routes[%q].Headers: %q and %q name one header; give it once", src, a, b)
			}
			seen[c] = k
		}
		for k, v := range r.Query {
			if k == "" {
				return nil, invalidArgument("Transport.Routes[%q].Query has an empty parameter name", src)
			}
			pr.query = append(pr.query, [2]string{k, v})
		}
		sort.Slice(pr.query, func(i, j int) bool { return pr.query[i][0] < pr.query[j][0] })
		tb.routes[src] = pr
		tb.bases = append(tb.bases, routeBase{originKey(u), pr.prefix})
	}
	if sdkBase != "" {
		u, err := parseBase("Transport.SDKBaseURL", sdkBase)
		if err != nil {
			return nil, err
		}
		tb.bases = append(tb.bases, routeBase{originKey(u), strings.TrimRight(u.EscapedPath(), "/")})
	}
	sort.SliceStable(tb.bases, func(i, j int) bool { return len(tb.bases[i].prefix) > len(tb.bases[j].prefix) })
	return tb, nil
}

// under reports whether path is prefix or below it, at a segment boundary.
func under(path, prefix string) bool {
	return prefix == "" || path == prefix || (strings.HasPrefix(path, prefix) && path[len(prefix)] == '/')
}

// credentialHeaders carry a caller's credentials (HTTP auth, cookies; Azure's,
// Anthropic's and Gemini's API key headers): they stay with the origin the SDK sent
// them to (rebase's cross).
var credentialHeaders = [...]string{"Authorization", "Proxy-Authorization", "Cookie", "Api-Key", "X-Api-Key", "X-Goog-Api-Key"}

// rebase is the escaped path and raw query of u sent to route, and whether that
// leaves the origin the SDK addressed (cross): under one of the bases (the SDK's
// base URL is one of the routes') that prefix is replaced by the route's, cross
// when the route's origin is another (its credentialHeaders are then not sent,
// DESIGN §17); else the route's prefix is put in front of the whole path (not
// cross: the routes are its only destinations). The route's query replaces
// same-named parameters.
func (tb *routeTable) rebase(u *url.URL, route *parsedRoute) (path, query string, cross bool) {
	key := originKey(u)
	path = u.EscapedPath()
	matched := false
	for _, b := range tb.bases {
		if b.origin == key && under(path, b.prefix) {
			path = route.prefix + path[len(b.prefix):]
			matched = true
			cross = b.origin != route.origin
			break
		}
	}
	if !matched {
		path = route.prefix + path
	}
	if !strings.HasPrefix(path, "/") {
		path = "/" + path
	}
	query = u.RawQuery
	if len(route.query) > 0 {
		query = withQuery(query, route.query)
	}
	return path, query, cross
}

// withQuery is query (raw) without the parameters params names, then params
// percent-encoded (everything but A-Za-z0-9-._~, as the Python and Node bindings).
func withQuery(query string, params [][2]string) string {
	var kept []string
	for _, kv := range strings.Split(query, "&") {
		if kv == "" {
			continue
		}
		name, _, _ := strings.Cut(kv, "=")
		if n, err := url.QueryUnescape(name); err == nil {
			name = n
		}
		drop := false
		for _, p := range params {
			drop = drop || p[0] == name
		}
		if !drop {
			kept = append(kept, kv)
		}
	}
	for _, p := range params {
		kept = append(kept, escapeAll(p[0])+"="+escapeAll(p[1]))
	}
	return strings.Join(kept, "&")
}

func escapeAll(s string) string {
	const hex = "0123456789ABCDEF"
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		c := s[i]
		if 'A' <= c && c <= 'Z' || 'a' <= c && c <= 'z' || '0' <= c && c <= '9' || c == '-' || c == '.' || c == '_' || c == '~' {
			b.WriteByte(c)
		} else {
			b.WriteByte('%')
			b.WriteByte(hex[c>>4])
			b.WriteByte(hex[c&15])
		}
	}
	return b.String()
}

// routed is req sent to route: its URL re-rooted under the route's base URL, its
// query and headers set, and its JSON body's model set (the length following).
func (tb *routeTable) routed(req *http.Request, route *parsedRoute, body []byte) (*http.Request, error) {
	path, query, cross := tb.rebase(req.URL, route)
	to, err := url.Parse(route.scheme + "://" + route.host + path)
	if err != nil {
		return nil, invalidArgument("Transport.Routes: cannot join %s://%s and %q: %v", route.scheme, route.host, path, err)
	}
	to.RawQuery = query
	r2 := req.Clone(req.Context())
	r2.URL = to
	r2.Host = ""
	if cross { // the SDK's keys stay with their origin (DESIGN §17); the route's headers give this one its own
		for k := range r2.Header {
			for _, c := range credentialHeaders {
				if strings.EqualFold(k, c) {
					delete(r2.Header, k)
				}
			}
		}
	}
	for k, v := range route.headers {
		r2.Header.Set(k, v)
	}
	if route.model != "" && body != nil {
		if nb := setModel(body, route.model); nb != nil {
			body = nb
			r2.ContentLength = int64(len(nb))
			r2.Header.Del("Content-Length")
			r2.GetBody = func() (io.ReadCloser, error) { return newByteBody(nb), nil }
		}
	}
	if body != nil {
		r2.Body = newByteBody(body)
	}
	return r2, nil
}

// setModel is body with its top-level "model" set to model (added first when it
// has none), every other byte kept; nil when body is not a JSON object in valid
// UTF-8 (then it is sent as it is). Transport applies it for a Route with a Model.
func setModel(body []byte, model string) []byte {
	i := skipSpace(body, 0)
	// Valid UTF-8 only, as the Python and Node bindings (json.Valid accepts any
	// byte in a string): a Latin-1 or UTF-16 body is sent as it is.
	if i >= len(body) || body[i] != '{' || !utf8.Valid(body) || !json.Valid(body) {
		return nil
	}
	lit, _ := json.Marshal(model)
	var spans [][2]int
	i = skipSpace(body, i+1)
	for i < len(body) && body[i] == '"' {
		ke := jsonValueEnd(body, i)
		key := body[i:ke]
		i = skipSpace(body, skipSpace(body, ke)+1) // past the ':'
		end := jsonValueEnd(body, i)
		if string(key) == `"model"` || (bytes.IndexByte(key, '\\') >= 0 && jsonString(key) == "model") {
			spans = append(spans, [2]int{i, end})
		}
		i = skipSpace(body, end)
		if i >= len(body) || body[i] != ',' {
			break
		}
		i = skipSpace(body, i+1)
	}
	if len(spans) == 0 {
		at := bytes.IndexByte(body, '{') + 1
		out := make([]byte, 0, len(body)+len(lit)+10)
		out = append(out, body[:at]...)
		out = append(out, `"model":`...)
		out = append(out, lit...)
		if rest := skipSpace(body, at); rest < len(body) && body[rest] != '}' {
			out = append(out, ',')
		}
		return append(out, body[at:]...)
	}
	if last := spans[len(spans)-1]; jsonString(body[last[0]:last[1]]) == model && len(spans) == 1 {
		return body
	}
	out := make([]byte, 0, len(body)+len(lit))
	prev := 0
	for _, sp := range spans {
		out = append(out, body[prev:sp[0]]...)
		out = append(out, lit...)
		prev = sp[1]
	}
	return append(out, body[prev:]...)
}

func skipSpace(b []byte, i int) int {
	for i < len(b) && isSpace(b[i]) {
		i++
	}
	return i
}

// jsonString is the JSON string literal b decoded ("" when b is not one).
func jsonString(b []byte) string {
	var s string
	if json.Unmarshal(b, &s) != nil {
		return ""
	}
	return s
}

// jsonValueEnd is the index after the JSON value at b[i] (b is valid JSON).
func jsonValueEnd(b []byte, i int) int {
	switch b[i] {
	case '"':
		for j := i + 1; j < len(b); j++ {
			if b[j] == '\\' {
				j++
			} else if b[j] == '"' {
				return j + 1
			}
		}
		return len(b)
	case '{', '[':
		if e := objectEnd(b, i); e >= 0 {
			return e
		}
		return len(b)
	}
	j := i
	for j < len(b) && b[j] != ',' && b[j] != '}' && b[j] != ']' && !isSpace(b[j]) {
		j++
	}
	return j
}

// ------------------------------------------------------------------ refusal

// refusalResponse is the synthetic answer to a refusal (bindings/conformance
// README, "Transport scenarios"). A tenant's refusal (*TenantLimitError, DESIGN
// §19) is a 429 whose body adds "limit_source": "tenant", "tenant" and "limit", so
// a caller can tell a spent customer budget from a provider quota; no other
// refusal carries limit_source.
func refusalResponse(err error, scope string, req *http.Request) *http.Response {
	var gu *GatewayUnavailableError
	errors.As(err, &gu)
	code, status := gu.Kind, http.StatusServiceUnavailable
	var ae *AllSourcesExhaustedError
	var te *TenantLimitError
	if errors.As(err, &te) {
		code, status = "tenant_limited", http.StatusTooManyRequests
	} else if errors.As(err, &ae) {
		code = ae.Reason
		if code == "" {
			code = ReasonStalled
		}
		if code == ReasonQuotaExhausted {
			status = http.StatusTooManyRequests
		}
	}
	after := gu.RetryAfter.Seconds()
	reasons := gu.PerSourceReasons
	if reasons == nil {
		reasons = map[string]string{}
	}
	e := map[string]any{
		"type":               "polygate",
		"code":               code,
		"message":            fmt.Sprintf("PolyGate refused the request in scope %q (%s): %s", scope, code, gu.Message),
		"scope":              scope,
		"retry_after_s":      after,
		"per_source_reasons": reasons,
	}
	if te != nil {
		e["limit_source"], e["tenant"], e["limit"] = "tenant", te.Tenant, te.Limit
	}
	b, _ := json.Marshal(map[string]any{"error": e})
	h := http.Header{}
	h.Set("Content-Type", "application/json")
	h.Set("Retry-After", strconv.FormatFloat(math.Ceil(after), 'f', 0, 64))
	h.Set("Retry-After-Ms", strconv.FormatFloat(math.Round(after*1000), 'f', 0, 64))
	// PolyGate's answer, not the provider's (DESIGN §17).
	h.Set("X-Polygate-Refusal", code)
	// The call-level budget is spent (PolyGate retried, failed over and waited as
	// the scope says): openai-go and the other Stainless SDKs do not retry this.
	h.Set("X-Should-Retry", "false")
	return &http.Response{
		Status:        fmt.Sprintf("%d %s", status, http.StatusText(status)),
		StatusCode:    status,
		Proto:         "HTTP/1.1",
		ProtoMajor:    1,
		ProtoMinor:    1,
		Header:        h,
		Body:          io.NopCloser(bytes.NewReader(b)),
		ContentLength: int64(len(b)),
		Request:       req,
	}
}

// ------------------------------------------------------------------ one attempt

// attempt is one request's attempt: its call, its permit and, once the response
// arrived, the response's header. Every report of the transport goes through
// settle, once.
//
// DESIGN §18: settle turns the provider's rate-limit headers of the response into
// the report's observed limits, aged by the time since the headers arrived (a
// stream's length) so the sidecar dates the observation when the provider made it.
type attempt struct {
	// call is the request's call, ended by the report.
	call *Call
	// permit is the grant the request was sent under.
	permit *Permit
	// header is the response's header (nil after a transport error).
	header http.Header
	// at is when the response's header arrived: the observation's age is
	// measured from it.
	at time.Time
	// ctx carries the request's values without its cancellation: a report must
	// go out even when the request was cancelled.
	ctx context.Context
	// reqCtx is the request's own context: its end abandons a body still open.
	reqCtx context.Context
	// once makes the report happen exactly once (EOF, Close and ctx race).
	once sync.Once
	// detached is ctx (the request's context without its cancellation), held here
	// so that it is not an allocation of its own.
	detached detachedCtx
	// req is the request as sent (a copy: RoundTrip must not modify the caller's),
	// reqBody its buffered body and respBody a buffered response body: parts of
	// the attempt's one allocation.
	req      http.Request
	reqBody  byteBody
	respBody byteBody
}

// detachedCtx is context.WithoutCancel(parent) as a value (held in an attempt).
type detachedCtx struct{ parent context.Context }

func (*detachedCtx) Deadline() (time.Time, bool) { return time.Time{}, false }
func (*detachedCtx) Done() <-chan struct{}       { return nil }
func (*detachedCtx) Err() error                  { return nil }
func (d *detachedCtx) Value(key any) any         { return d.parent.Value(key) }
func (d *detachedCtx) String() string            { return "polygate.detached" }

// settle sends the report made by send and ends the call, waiting for the answer
// as Client.Run does (a lost connection ends the wait). Trouble with the sidecar
// never replaces the upstream's answer: a report the sidecar refuses
// leaves the permit unreported and End abandons it (its estimate is charged).
func (a *attempt) settle(send func(p *Permit) error) {
	a.once.Do(func() {
		if a.header != nil {
			if l, _ := ParseRateLimitHeaders(a.header, time.Now()); l != nil {
				l.Age = time.Since(a.at)
				a.permit.SetLimits(l)
			}
		}
		_ = send(a.permit)
		_ = a.call.End(a.ctx)
	})
}

func (a *attempt) success(u Usage) {
	a.settle(func(p *Permit) error {
		if err := p.SuccessWith(a.ctx, SuccessOptions{Usage: u}); err != nil {
			return p.Success(a.ctx, 0) // an invalid usage: keep the estimate
		}
		return nil
	})
}

func (a *attempt) failure(kind FailureKind, u Usage) {
	a.settle(func(p *Permit) error {
		if err := p.FailureWith(a.ctx, kind, u); err != nil {
			return p.Failure(a.ctx, kind)
		}
		return nil
	})
}

// transportError reports a request that got no response: the caller's cancel is
// a cancel, anything else as Classify says (a deadline is a timeout).
func (a *attempt) transportError(err error) {
	v := Classify(err)
	switch v.action {
	case verdictFailed:
		a.failure(v.kind, Usage{})
	case verdictAbandon:
		a.settle(func(p *Permit) error { return p.Cancel(a.ctx) })
	default:
		a.failure(Error, Usage{})
	}
}

// status reports a response that is not a 2xx (DESIGN §17 item 4).
func (a *attempt) status(code int, h http.Header) {
	switch {
	case code >= 300 && code < 400:
		// The source answered but did no work (a redirect's next hop is a call of
		// its own, a 304 has no completion): an uncounted success with no tokens,
		// so the breaker does not blame it and the estimate is refunded.
		a.settle(func(p *Permit) error {
			return p.hold(outcome{tag: outSuccess, tokens: some(0), countAttempt: false})
		})
	case code == http.StatusTooManyRequests:
		ra := RetryAfterHeader(h, time.Now())
		a.settle(func(p *Permit) error { return p.RateLimited(a.ctx, ra) })
	case code == http.StatusRequestTimeout:
		a.failure(Timeout, Usage{})
	case code == http.StatusConflict || code >= 500:
		a.failure(ServerError, Usage{})
	default:
		a.failure(Error, Usage{})
	}
}

// response settles the attempt from resp (or hands the body over to be settled
// when it ends) and returns what the caller gets: resp, unchanged in content.
func (a *attempt) response(resp *http.Response) (*http.Response, error) {
	a.header, a.at = resp.Header, time.Now()
	code := resp.StatusCode
	if code < 200 || code >= 300 {
		b, err := readSized(resp.Body, resp.ContentLength)
		resp.Body.Close()
		a.status(code, resp.Header)
		if err != nil {
			return nil, err
		}
		a.respBody.Reset(b)
		resp.Body = &a.respBody
		return resp, nil
	}
	if resp.Body == nil || resp.Body == http.NoBody {
		a.success(Usage{})
		return resp, nil
	}
	ct := resp.Header.Get("Content-Type")
	switch {
	case strings.Contains(ct, "text/event-stream"):
		resp.Body = newGatedBody(resp.Body, a, &usageScanner{})
	case strings.Contains(ct, "json"):
		b, err := readSized(resp.Body, resp.ContentLength)
		resp.Body.Close()
		if err != nil {
			a.transportError(err)
			return nil, err
		}
		a.success(jsonUsage(b))
		a.respBody.Reset(b)
		resp.Body = &a.respBody
	default:
		resp.Body = newGatedBody(resp.Body, a, nil)
	}
	return resp, nil
}

// gatedBody passes a response body through unchanged and settles the attempt when
// it ends: EOF (success with the usage seen), a read error (classified failure),
// Close before EOF or the request's context ending (abandoned: success with what
// was seen, else the estimate).
type gatedBody struct {
	// rc is the upstream's body.
	rc io.ReadCloser
	// att is settled when the body ends.
	att *attempt
	// mu guards scan (Read and Close may race).
	mu sync.Mutex
	// scan reads the usage events (nil: not a stream with usage).
	scan *usageScanner
	// stop unregisters the context watch.
	stop func() bool
}

func newGatedBody(rc io.ReadCloser, a *attempt, scan *usageScanner) *gatedBody {
	g := &gatedBody{rc: rc, att: a, scan: scan}
	if a.reqCtx.Done() != nil {
		g.stop = context.AfterFunc(a.reqCtx, func() { g.end(nil, true) })
	}
	return g
}

func (g *gatedBody) seen() Usage {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.scan == nil {
		return Usage{}
	}
	return g.scan.usage()
}

// end settles: err nil = the stream ended (or was abandoned), else it failed.
func (g *gatedBody) end(err error, abandoned bool) {
	if g.stop != nil {
		g.stop()
	}
	if err != nil && !abandoned {
		v := Classify(err)
		kind := Connection
		if v.action == verdictFailed {
			kind = v.kind
		}
		g.att.failure(kind, g.seen())
		return
	}
	g.att.success(g.seen())
}

func (g *gatedBody) Read(p []byte) (int, error) {
	n, err := g.rc.Read(p)
	if n > 0 && g.scan != nil {
		g.mu.Lock()
		g.scan.push(p[:n])
		g.mu.Unlock()
	}
	if err == io.EOF {
		g.mu.Lock()
		if g.scan != nil {
			g.scan.end()
		}
		g.mu.Unlock()
		g.end(nil, false) // settled before the caller sees the end
	} else if err != nil {
		g.end(err, g.att.reqCtx.Err() != nil || errors.Is(err, context.Canceled))
	}
	return n, err
}

func (g *gatedBody) Close() error {
	err := g.rc.Close()
	g.end(nil, true)
	return err
}

// ------------------------------------------------------------------ usage

var (
	usageKey = []byte(`"usage"`)
	usageObj = [][]byte{[]byte(`"usage":{`), []byte(`"usage": {`)}
)

// maxCarry bounds a line kept across reads; a longer one is dropped (its usage is
// lost, memory is not).
const maxCarry = 1 << 20

// jsonUsage is the usage of a JSON response body: the object of its last
// `"usage":` key (OpenAI and Anthropic put it at the top level, after the content;
// inside a JSON string the key's quotes would be escaped), read by key search
// without decoding the body (no allocation).
func jsonUsage(b []byte) Usage {
	i := bytes.LastIndex(b, usageKey)
	if i < 0 {
		return Usage{}
	}
	j := skipColon(b, i+len(usageKey))
	if j < 0 || b[j] != '{' {
		return Usage{}
	}
	end := objectEnd(b, j)
	if end < 0 {
		return Usage{}
	}
	return usageObject(b[j:end])
}

var (
	keyTotal      = []byte(`"total_tokens"`)
	keyPrompt     = []byte(`"prompt_tokens"`)
	keyCompletion = []byte(`"completion_tokens"`)
	keyInput      = []byte(`"input_tokens"`)
	keyOutput     = []byte(`"output_tokens"`)
	keyCached     = []byte(`"cached_tokens"`)
)

// numField is the integer value of key (with its quotes) in the JSON object o:
// every usage key is distinct as a quoted name ("input_tokens" is not
// "cache_read_input_tokens"), and "cached_tokens" appears once, in the input's
// details.
func numField(o, key []byte) (int64, bool) {
	for off := 0; ; {
		i := bytes.Index(o[off:], key)
		if i < 0 {
			return 0, false
		}
		j := skipColon(o, off+i+len(key))
		if j < 0 {
			off += i + len(key)
			continue
		}
		n, k := int64(0), j
		for ; k < len(o) && o[k] >= '0' && o[k] <= '9' && n < 1e15; k++ {
			n = n*10 + int64(o[k]-'0')
		}
		return n, k > j
	}
}

// usageObject is the report's Usage of a usage object of OpenAI (chat,
// embeddings: prompt/completion; responses: input/output) or Anthropic
// (input/output, cache reads already apart): input excludes cached reads.
func usageObject(o []byte) Usage {
	total, _ := numField(o, keyTotal)
	cached, _ := numField(o, keyCached)
	u := Usage{Tokens: clampCount(total)}
	in, hasIn := numField(o, keyPrompt)
	out, hasOut := numField(o, keyCompletion)
	if !hasIn && !hasOut {
		in, hasIn = numField(o, keyInput)
		out, _ = numField(o, keyOutput)
	}
	if hasIn {
		u.InputTokens = clampCount(in - cached)
	}
	u.OutputTokens = clampCount(out)
	return u
}

// objectEnd returns the index after the JSON object starting at b[i] ('{'), or -1.
func objectEnd(b []byte, i int) int {
	depth, inStr := 0, false
	for ; i < len(b); i++ {
		c := b[i]
		switch {
		case inStr:
			if c == '\\' {
				i++
			} else if c == '"' {
				inStr = false
			}
		case c == '"':
			inStr = true
		case c == '{' || c == '[':
			depth++
		case c == '}' || c == ']':
			depth--
			if depth == 0 {
				return i + 1
			}
		}
	}
	return -1
}

// usageScanner reads the usage events of a server-sent-events stream as its bytes
// pass by: OpenAI chat's final usage chunk, Responses' response.completed,
// Anthropic's message_start (input) and message_delta (cumulative output). Only
// lines whose "usage" is an object are parsed.
type usageScanner struct {
	carry                []byte
	total, input, output int
}

func (s *usageScanner) push(chunk []byte) {
	buf := chunk
	if len(s.carry) > 0 {
		buf = append(s.carry, chunk...)
		s.carry = nil
	}
	last := bytes.LastIndexByte(buf, '\n')
	if rest := buf[last+1:]; len(rest) > 0 && len(rest) <= maxCarry {
		s.carry = append([]byte(nil), rest...)
	}
	if last >= 0 {
		s.scan(buf[:last+1])
	}
}

func (s *usageScanner) end() {
	if c := s.carry; len(c) > 0 {
		s.carry = nil
		s.scan(c)
	}
}

// scan parses the lines of buf holding a usage object: `"usage":{` (compact, as
// OpenAI and Anthropic send it) or `"usage": {`, where `"usage"` alone would match
// every chat chunk's `"usage":null`.
func (s *usageScanner) scan(buf []byte) {
	for _, key := range usageObj {
		off := 0
		for {
			i := bytes.Index(buf[off:], key)
			if i < 0 {
				break
			}
			at := off + i
			start := bytes.LastIndexByte(buf[:at], '\n') + 1
			stop := bytes.IndexByte(buf[at:], '\n')
			if stop < 0 {
				stop = len(buf)
			} else {
				stop += at
			}
			s.line(bytes.TrimSuffix(buf[start:stop], []byte("\r")))
			off = stop
		}
	}
}

// line reads the usage of one SSE line holding a usage object: OpenAI chat's
// final chunk, Responses' response.completed (its response's usage), Anthropic's
// message_start (input) and message_delta (cumulative output, sometimes input):
// every count given replaces the one seen before.
func (s *usageScanner) line(l []byte) {
	if data, ok := bytes.CutPrefix(l, []byte("data:")); ok {
		s.set(jsonUsage(data))
	}
}

func (s *usageScanner) set(u Usage) {
	if u.Tokens > 0 {
		s.total = u.Tokens
	}
	if u.InputTokens > 0 {
		s.input = u.InputTokens
	}
	if u.OutputTokens > 0 {
		s.output = u.OutputTokens
	}
}

func (s *usageScanner) usage() Usage {
	return Usage{Tokens: s.total, InputTokens: s.input, OutputTokens: s.output}
}
