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
)

// RefusalMode says what a Transport does when PolyGate ends a call (circuit open,
// budget exhausted).
type RefusalMode uint8

const (
	// RefuseWithResponse (the default) answers with a synthetic response the SDK
	// already understands: 503 for an open circuit (and a stalled or retry-exhausted
	// call), 429 for exhausted quota, with Retry-After and a JSON error body naming
	// PolyGate and the reason.
	RefuseWithResponse RefusalMode = iota
	// RefuseWithError returns the typed error (*CircuitOpenError,
	// *AllSourcesExhaustedError, *GatewayUnavailableError) from RoundTrip; an
	// http.Client wraps it in a *url.Error, errors.As finds it.
	RefuseWithError
)

// Route is where a granted source's requests go.
type Route struct {
	// BaseURL is the source's deployment: its scheme, host and port replace the
	// request's, and its path (trailing "/" trimmed) is put in front of the
	// request's path (see Transport.SDKBaseURL).
	BaseURL string
	// Headers are set on the request (API key, "api-key", ...), replacing the
	// request's headers of the same name.
	Headers map[string]string
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
// timeout; transport errors → classified (Classify); other 4xx → error. The
// response reaches the caller unchanged.
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
	// SDK sent it. A granted source missing from Routes is a *RouteMissingError
	// before anything is sent.
	Routes map[string]Route
	// SDKBaseURL (optional) is the SDK's base URL ("https://api.openai.com/v1"):
	// with Routes, the part of the request URL after it is appended to the
	// route's BaseURL instead of the whole path.
	SDKBaseURL string
	// Estimate (optional) returns the request's input and output token
	// estimates; a side <= 0 falls back to the built-in rule. The request's
	// body is readable (and re-readable through GetBody).
	Estimate func(*http.Request) (in, out int64)
	// OnRefusal: RefuseWithResponse (default) or RefuseWithError.
	OnRefusal RefusalMode

	mu     sync.Mutex
	dialed *Client
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
	out := req
	if req.Body != nil && req.Body != http.NoBody {
		att.req = *req // RoundTrip must not modify the caller's request
		att.reqBody.Reset(body)
		att.req.Body = &att.reqBody
		att.req.GetBody = func() (io.ReadCloser, error) { return newByteBody(body), nil }
		out = &att.req
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
		if body != nil {
			att.reqBody.Reset(body)
			out.Body = &att.reqBody
		}
	}

	c, err := t.client(ctx)
	if err != nil {
		return nil, err
	}
	call, err := c.Begin(ctx, t.Scope, CallOptions{EstInputTokens: clampCount(in), EstOutputTokens: clampCount(outTok), Priority: t.Priority})
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
	if t.Routes != nil {
		route, ok := t.Routes[p.Source]
		if !ok {
			att.settle(func(p *Permit) error { return p.Cancel(att.ctx) })
			names := make([]string, 0, len(t.Routes))
			for k := range t.Routes {
				names = append(names, k)
			}
			sort.Strings(names)
			return nil, &RouteMissingError{Scope: t.Scope, Source: p.Source, Routes: names}
		}
		if out, err = t.routed(out, route, body); err != nil {
			att.settle(func(p *Permit) error { return p.Cancel(att.ctx) })
			return nil, err
		}
	}

	resp, err := t.base().RoundTrip(out)
	if err != nil {
		att.transportError(err)
		return nil, err
	}
	att.header = resp.Header
	return att.response(resp)
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

// routed is req sent to route: its URL re-rooted under route.BaseURL, its headers set.
func (t *Transport) routed(req *http.Request, route Route, body []byte) (*http.Request, error) {
	base, err := url.Parse(route.BaseURL)
	if err != nil || base.Scheme == "" || base.Host == "" {
		return nil, invalidArgument("Transport.Routes: BaseURL %q is not an absolute URL", route.BaseURL)
	}
	rest := req.URL.EscapedPath()
	query := req.URL.RawQuery
	if t.SDKBaseURL != "" {
		full := req.URL.String()
		if sdk := strings.TrimRight(t.SDKBaseURL, "/"); strings.HasPrefix(full, sdk) {
			tail := full[len(sdk):]
			rest, query, _ = strings.Cut(tail, "?")
		}
	}
	if rest != "" && !strings.HasPrefix(rest, "/") {
		rest = "/" + rest
	}
	to, err := url.Parse(strings.TrimRight(base.String(), "/") + rest)
	if err != nil {
		return nil, invalidArgument("Transport.Routes: cannot join %q and %q: %v", route.BaseURL, rest, err)
	}
	to.RawQuery = query
	r2 := req.Clone(req.Context())
	r2.URL = to
	r2.Host = ""
	for k, v := range route.Headers {
		r2.Header.Set(k, v)
	}
	if body != nil {
		r2.Body = newByteBody(body)
	}
	return r2, nil
}

// ------------------------------------------------------------------ refusal

// refusalResponse is the synthetic answer to a refusal (bindings/conformance
// README, "Transport scenarios").
func refusalResponse(err error, scope string, req *http.Request) *http.Response {
	var gu *GatewayUnavailableError
	errors.As(err, &gu)
	code, status := gu.Kind, http.StatusServiceUnavailable
	var ae *AllSourcesExhaustedError
	if errors.As(err, &ae) {
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
	doc := map[string]any{"error": map[string]any{
		"type":               "polygate",
		"code":               code,
		"message":            fmt.Sprintf("PolyGate refused the request in scope %q (%s): %s", scope, code, gu.Message),
		"scope":              scope,
		"retry_after_s":      after,
		"per_source_reasons": reasons,
	}}
	b, _ := json.Marshal(doc)
	h := http.Header{}
	h.Set("Content-Type", "application/json")
	h.Set("Retry-After", strconv.FormatFloat(math.Ceil(after), 'f', 0, 64))
	h.Set("Retry-After-Ms", strconv.FormatFloat(math.Round(after*1000), 'f', 0, 64))
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
