package polygate

// The provider's rate-limit headers → observed limits (DESIGN §18), sent with a
// permit's report. ParseRateLimitHeaders reads OpenAI's
// x-ratelimit-{limit,remaining,reset}-{requests,tokens} (resets as Go durations:
// 1s, 6m0s, 250ms), Anthropic's anthropic-ratelimit-{requests,tokens,input-tokens,
// output-tokens}-{limit,remaining,reset} (RFC 3339 instants, counted from the
// response's Date header, else from now), Azure's x-ratelimit-remaining-{requests,
// tokens}, and retry-after-ms before retry-after (seconds or an HTTP date). The
// shared cases are bindings/vectors/ratelimit_headers.json.

import (
	"math"
	"net/http"
	"strconv"
	"strings"
	"time"
)

// Limit is one dimension of a response's rate-limit headers. -1 means "not said".
type Limit struct {
	// Limit is the provider's limit (what an "auto" bucket learns), or -1.
	Limit int64
	// Remaining is what the provider says is left, or -1.
	Remaining int64
	// Reset is how long until the counter is whole again, from the response, or -1.
	Reset time.Duration
}

// Limits is what one response's headers say (Permit.SetLimits).
type Limits struct {
	Requests, Tokens, InputTokens, OutputTokens *Limit
	// Age is the time between the response and the report (a stream's length): the
	// sidecar dates the observation now − Age and ignores one older than an
	// observation it already applied.
	Age time.Duration
}

func (l *Limits) empty() bool {
	return l == nil || (l.Requests == nil && l.Tokens == nil && l.InputTokens == nil && l.OutputTokens == nil)
}

// ParseRateLimitHeaders returns the observed limits of one response's headers (nil
// when it has no rate-limit header) and its retry-after (-1 when absent). now is
// used for Anthropic's instants when the response has no Date header.
// maxObservedCount is the largest count a parsed header gives (the sidecar cuts
// larger ones to it).
const maxObservedCount = 1e9

func ParseRateLimitHeaders(h http.Header, now time.Time) (*Limits, time.Duration) {
	// Keys are looked up as net/http stores them (canonical), with no per-call
	// key building: the transport parses every response's headers, most of which
	// (a fake, a proxy, a provider that sends none) have none of these.
	if !hasRateLimitHeader(h) {
		return nil, -1
	}
	get := func(key string) (string, bool) {
		if v := h[key]; len(v) > 0 {
			return v[0], true
		}
		return "", false
	}
	// Instants count from the response's Date header, else from now (read once,
	// and only when an instant needs it).
	base, dated := now, false
	since := func(t time.Time) time.Duration {
		if !dated {
			dated = true
			if d, ok := get("Date"); ok {
				if dt, err := http.ParseTime(d); err == nil {
					base = dt
				}
			}
		}
		return t.Sub(base)
	}
	reset := func(v string, ok bool) time.Duration {
		if !ok {
			return -1
		}
		if d, ok := parseResetDuration(v); ok {
			return d
		}
		t, err := time.Parse(time.RFC3339Nano, strings.TrimSpace(v))
		if err != nil {
			return -1
		}
		if d := since(t); d > 0 {
			return d
		}
		return 0
	}
	count := func(v string, ok bool) int64 {
		if !ok {
			return -1
		}
		f, err := strconv.ParseFloat(strings.TrimSpace(v), 64)
		if err != nil || math.IsNaN(f) || math.IsInf(f, 0) || f < 0 {
			return -1
		}
		// The sidecar cuts counts above 10^9 (PROTOCOL §14.6); cutting here keeps
		// an absurd header from overflowing int64 into a dropped dimension.
		return int64(math.Min(f, maxObservedCount))
	}
	dim := func(k *[3]string) *Limit {
		lim, okl := get(k[0])
		rem, okr := get(k[1])
		rst, oks := get(k[2])
		if !okl && !okr && !oks {
			return nil
		}
		l := &Limit{Limit: count(lim, okl), Remaining: count(rem, okr), Reset: reset(rst, oks)}
		if l.Limit < 0 && l.Remaining < 0 && l.Reset < 0 {
			return nil
		}
		return l
	}
	var l Limits
	dims := [4]**Limit{&l.Requests, &l.Tokens, &l.InputTokens, &l.OutputTokens}
	for i, d := range dims {
		*d = dim(&anthropicKeys[i])
		if *d == nil && i < len(openAIKeys) {
			*d = dim(&openAIKeys[i])
		}
	}
	retry := time.Duration(-1)
	if v, ok := get("Retry-After-Ms"); ok {
		if f, err := strconv.ParseFloat(strings.TrimSpace(v), 64); err == nil && f >= 0 && !math.IsInf(f, 0) {
			retry = time.Duration(f * float64(time.Millisecond))
		}
	}
	if v, ok := get("Retry-After"); ok && retry < 0 {
		if f, err := strconv.ParseFloat(strings.TrimSpace(v), 64); err == nil {
			if f >= 0 && !math.IsInf(f, 0) {
				retry = time.Duration(f * float64(time.Second))
			}
		} else if t, err := http.ParseTime(v); err == nil {
			retry = max(0, since(t))
		}
	}
	if l.empty() {
		return nil, retry
	}
	out := l // l stays on the stack: a response without rate-limit headers allocates nothing
	return &out, retry
}

// hasRateLimitHeader says whether h has a header ParseRateLimitHeaders reads (one
// pass over the keys, cheaper than the twenty lookups it would make).
func hasRateLimitHeader(h http.Header) bool {
	for k := range h {
		switch {
		case strings.HasPrefix(k, "X-Ratelimit-"), strings.HasPrefix(k, "Anthropic-Ratelimit-"),
			strings.HasPrefix(k, "Retry-After"):
			return true
		}
	}
	return false
}

// anthropicKeys and openAIKeys are the limit, remaining and reset headers of each
// dimension (requests, tokens, input tokens, output tokens), canonical as
// http.Header keys them. OpenAI (and Azure) name only requests and tokens.
var (
	anthropicKeys = [4][3]string{
		ratelimitKeys("Anthropic-Ratelimit-Requests-"),
		ratelimitKeys("Anthropic-Ratelimit-Tokens-"),
		ratelimitKeys("Anthropic-Ratelimit-Input-Tokens-"),
		ratelimitKeys("Anthropic-Ratelimit-Output-Tokens-"),
	}
	openAIKeys = [2][3]string{
		{"X-Ratelimit-Limit-Requests", "X-Ratelimit-Remaining-Requests", "X-Ratelimit-Reset-Requests"},
		{"X-Ratelimit-Limit-Tokens", "X-Ratelimit-Remaining-Tokens", "X-Ratelimit-Reset-Tokens"},
	}
)

func ratelimitKeys(prefix string) [3]string {
	return [3]string{prefix + "Limit", prefix + "Remaining", prefix + "Reset"}
}

// parseResetDuration reads OpenAI's reset: a Go duration (6m0s, 250ms) or a bare
// number of seconds.
func parseResetDuration(v string) (time.Duration, bool) {
	v = strings.TrimSpace(v)
	if f, err := strconv.ParseFloat(v, 64); err == nil {
		if f < 0 || math.IsNaN(f) || math.IsInf(f, 0) {
			return 0, false
		}
		return time.Duration(f * float64(time.Second)), true
	}
	d, err := time.ParseDuration(v)
	if err != nil || d < 0 {
		return 0, false
	}
	return d, true
}

// SetLimits attaches the response's observed limits to the permit's report (call
// it before reporting; nil clears them).
func (p *Permit) SetLimits(l *Limits) {
	p.call.mu.Lock()
	defer p.call.mu.Unlock()
	if l.empty() {
		p.limits = nil
		return
	}
	w := l.wire()
	p.limits = &w
}

// obsLimits is ObservedLimits on the wire (PROTOCOL.md §4.2): requests, tokens,
// input, output, then age_s.
type obsLimits struct {
	dims [4]obsDim
	age  float64
}

type obsDim struct {
	some      bool
	limit     optU64
	remaining optU64
	reset     optF64
}

func (l *Limits) wire() obsLimits {
	w := obsLimits{age: l.Age.Seconds()}
	for i, d := range []*Limit{l.Requests, l.Tokens, l.InputTokens, l.OutputTokens} {
		if d == nil {
			continue
		}
		x := obsDim{some: true}
		if d.Limit >= 0 {
			x.limit = optU64{uint64(d.Limit), true}
		}
		if d.Remaining >= 0 {
			x.remaining = optU64{uint64(d.Remaining), true}
		}
		if d.Reset >= 0 {
			x.reset = optF64{d.Reset.Seconds(), true}
		}
		w.dims[i] = x
	}
	if w.age < 0 {
		w.age = 0
	}
	return w
}

func putLimits(b []byte, l *obsLimits) []byte {
	for _, d := range l.dims {
		if !d.some {
			b = append(b, 0)
			continue
		}
		b = append(b, 1)
		b = putOptU64(b, d.limit)
		b = putOptU64(b, d.remaining)
		b = putOptF64(b, d.reset)
	}
	return putF64(b, l.age)
}

func (d *dec) limits() *obsLimits {
	l := &obsLimits{}
	for i := range l.dims {
		if d.flag("observed limit") {
			l.dims[i] = obsDim{some: true, limit: d.optU64("limit"), remaining: d.optU64("remaining"), reset: d.optF64("reset_s")}
		}
	}
	l.age = d.f64("age_s")
	return l
}

// observedTag is the tag of the report request tag carrying observed limits.
func observedTag(tag uint32) uint32 {
	switch tag {
	case reqReport:
		return reqReportObserved
	case reqRetry:
		return reqRetryObserved
	default:
		return reqFinishObserved
	}
}
