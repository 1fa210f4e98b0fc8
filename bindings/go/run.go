package polygate

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"os"
	"strconv"
	"syscall"
	"time"
)

type verdictAction uint8

const (
	verdictDefault verdictAction = iota
	verdictFailed
	verdictThrottled
	verdictFatal
	verdictAbandon
)

// Verdict is what Run does with an error returned by the attempt function. The
// zero Verdict means "no opinion": Run applies the built-in rules (Classify).
type Verdict struct {
	action     verdictAction
	kind       FailureKind
	retryAfter time.Duration
}

// Failed reports the attempt as a failure of the given kind; Run tries again
// (failing over) while the call's budget lasts.
func Failed(kind FailureKind) Verdict { return Verdict{action: verdictFailed, kind: kind} }

// Throttled reports the attempt as rate limited (HTTP 429), with the upstream's
// Retry-After if known (0 = none); Run tries again.
func Throttled(retryAfter time.Duration) Verdict {
	return Verdict{action: verdictThrottled, retryAfter: retryAfter}
}

// Fatal stops Run at once and returns the error: the caller's own bug (an HTTP 4xx
// other than 408 and 429), not the source's. The upstream answered, so the attempt
// is reported as a success kept out of the breaker's statistics (NotCounted).
func Fatal() Verdict { return Verdict{action: verdictFatal} }

// Abandon stops Run at once and returns the error, reporting the attempt as
// cancelled (nothing was learned about the source; its reservation is refunded).
func Abandon() Verdict { return Verdict{action: verdictAbandon} }

func (v Verdict) String() string {
	switch v.action {
	case verdictFailed:
		return "failed: " + v.kind.String()
	case verdictThrottled:
		return fmt.Sprintf("throttled (retry after %v)", v.retryAfter)
	case verdictFatal:
		return "fatal"
	case verdictAbandon:
		return "abandon"
	}
	return "default"
}

// HTTPStatusError is implemented by errors that carry an upstream's HTTP status
// code; Classify reads it (through errors.As, so wrapped errors count). An error
// that also implements RetryAfterError gives 429s their Retry-After.
type HTTPStatusError interface {
	error
	HTTPStatus() int
}

// RetryAfterError is implemented by errors that know how long the upstream asked
// to wait (a 429's Retry-After).
type RetryAfterError interface {
	error
	RetryAfter() time.Duration
}

// HTTPError is an upstream HTTP answer that is not a success, as an error Run
// classifies: return ResponseError(resp) from the attempt function when
// resp.StatusCode >= 400.
type HTTPError struct {
	// StatusCode is the HTTP status code.
	StatusCode int
	// Status is the status line's text ("429 Too Many Requests").
	Status string
	// Header is the response's header (Retry-After is read from it).
	Header http.Header
}

// ResponseError returns the HTTPError of resp (it keeps the header, not the body).
func ResponseError(resp *http.Response) *HTTPError {
	return &HTTPError{StatusCode: resp.StatusCode, Status: resp.Status, Header: resp.Header}
}

func (e *HTTPError) Error() string {
	if e.Status != "" {
		return "upstream answered HTTP " + e.Status
	}
	return "upstream answered HTTP " + strconv.Itoa(e.StatusCode)
}

// HTTPStatus returns the status code (HTTPStatusError).
func (e *HTTPError) HTTPStatus() int { return e.StatusCode }

// RetryAfter returns the wait the response's headers ask for (RetryAfterError).
func (e *HTTPError) RetryAfter() time.Duration { return RetryAfterHeader(e.Header, time.Now()) }

// RetryAfterHeader reads how long a response asks the client to wait:
// "retry-after-ms" (milliseconds, as OpenAI sends), else "Retry-After" in seconds or
// as an HTTP date (relative to now). 0 when absent or unreadable.
func RetryAfterHeader(h http.Header, now time.Time) time.Duration {
	if v := h.Get("Retry-After-Ms"); v != "" {
		if ms, err := strconv.ParseFloat(v, 64); err == nil && ms > 0 && ms < 1e12 {
			return time.Duration(ms * float64(time.Millisecond))
		}
	}
	v := h.Get("Retry-After")
	if v == "" {
		return 0
	}
	if s, err := strconv.ParseFloat(v, 64); err == nil {
		if s > 0 && s < 1e9 {
			return time.Duration(s * float64(time.Second))
		}
		return 0
	}
	if t, err := http.ParseTime(v); err == nil && t.After(now) {
		return t.Sub(now)
	}
	return 0
}

// Classify is Run's built-in rule for an error returned by the attempt function
// (while Run's ctx is still live):
//
//   - an error exposing an HTTP status (HTTPStatusError, e.g. *HTTPError): 429 →
//     Throttled with its RetryAfter (RetryAfterError) if any; 408 → Failed(Timeout);
//     5xx → Failed(ServerError); any other 4xx → Fatal (the request itself is
//     wrong; retrying elsewhere will not help);
//   - context.DeadlineExceeded, os.ErrDeadlineExceeded, a net.Error whose
//     Timeout() is true → Failed(Timeout);
//   - *url.Error, *net.OpError, connection reset/refused/aborted, broken pipe,
//     unreachable host/network, io.ErrUnexpectedEOF → Failed(Connection);
//   - context.Canceled (the function's own context, not Run's) → Abandon;
//   - anything else → Failed(Error).
func Classify(err error) Verdict {
	var hs HTTPStatusError
	if errors.As(err, &hs) {
		switch code := hs.HTTPStatus(); {
		case code == http.StatusTooManyRequests:
			var ra RetryAfterError
			if errors.As(err, &ra) {
				return Throttled(ra.RetryAfter())
			}
			return Throttled(0)
		case code == http.StatusRequestTimeout:
			return Failed(Timeout)
		case code >= 500 && code <= 599:
			return Failed(ServerError)
		case code >= 400 && code <= 499:
			return Fatal()
		}
	}
	var ne net.Error
	if errors.Is(err, context.DeadlineExceeded) || errors.Is(err, os.ErrDeadlineExceeded) ||
		(errors.As(err, &ne) && ne.Timeout()) {
		return Failed(Timeout)
	}
	var ue *url.Error
	var oe *net.OpError
	if errors.As(err, &ue) || errors.As(err, &oe) || errors.Is(err, io.ErrUnexpectedEOF) ||
		errors.Is(err, syscall.ECONNRESET) || errors.Is(err, syscall.ECONNREFUSED) ||
		errors.Is(err, syscall.ECONNABORTED) || errors.Is(err, syscall.EPIPE) ||
		errors.Is(err, syscall.EHOSTUNREACH) || errors.Is(err, syscall.ENETUNREACH) {
		return Failed(Connection)
	}
	if errors.Is(err, context.Canceled) {
		return Abandon()
	}
	return Failed(Error)
}

// Run runs a whole call: acquire a permit, call fn with it, report the outcome,
// and on a failure or 429 fail over to the next attempt, until fn succeeds or the
// call's budget is spent. It ends the call on every path (also when fn panics).
//
//   - fn returns nil → the attempt is reported as a success, with the tokens set by
//     p.SetTokens or p.SetUsage (none set = keep the estimate), and Run returns
//     nil;
//   - fn returns an error while ctx is live → opts.Classify (if set and it returns
//     a non-zero Verdict), else Classify, decides: another attempt after a Failed
//     or Throttled report, or Fatal/Abandon: Run returns fn's error;
//   - ctx ends (cancelled, deadline) → the attempt is reported cancelled and Run
//     returns ctx.Err();
//   - the call cannot proceed → Run returns the *CircuitOpenError or
//     *AllSourcesExhaustedError (or another *GatewayUnavailableError /
//     *SidecarError) of the last Acquire; a tenant's refusal (*TenantLimitError,
//     opts.Tenant) is returned at once, with no other attempt.
//
// fn sets the usage with p.SetUsage(polygate.UsageOf(resp)) for an OpenAI or
// Anthropic response (cached input reads included: sent as SuccessCached on a
// version-3 connection), or p.SetTokens / p.SetUsage by hand.
//
// A result of fn travels through its closure.
func (c *Client) Run(ctx context.Context, scope string, opts CallOptions, fn func(ctx context.Context, p *Permit) error) error {
	call, err := c.Begin(ctx, scope, opts)
	if err != nil {
		return err
	}
	defer call.End(context.WithoutCancel(ctx))
	for {
		p, err := call.Acquire(ctx)
		if err != nil {
			return err
		}
		ferr := fn(ctx, p)
		if ferr == nil {
			// The attempt worked: trouble delivering its report (the sidecar
			// answered BackendUnavailable, the connection dropped) does not undo
			// that, and the sidecar settles an undelivered report by itself.
			if p.SuccessWith(ctx, SuccessOptions{Usage: p.usage}) != nil {
				// Refused before anything changed (an invalid usage)? Report
				// without it; on an already reported permit this is a no-op.
				_ = p.Success(ctx, 0)
			}
			return nil
		}
		if ctx.Err() != nil {
			_ = p.Cancel(ctx)
			return ctx.Err()
		}
		v := Verdict{}
		if opts.Classify != nil {
			v = opts.Classify(ferr)
		}
		if v.action == verdictDefault {
			v = Classify(ferr)
		}
		// A usage, Retry-After or kind the caller got wrong must not lose the
		// report: each step falls back to a plainer one.
		switch v.action {
		case verdictThrottled:
			if p.RateLimited(ctx, v.retryAfter) != nil {
				_ = p.RateLimited(ctx, 0)
			}
		case verdictFatal:
			if p.SuccessWith(ctx, SuccessOptions{Usage: p.usage, NotCounted: true}) != nil {
				_ = p.SuccessWith(ctx, SuccessOptions{NotCounted: true})
			}
			return ferr
		case verdictAbandon:
			_ = p.Cancel(ctx)
			return ferr
		default:
			if p.FailureWith(ctx, v.kind, p.usage) != nil && p.Failure(ctx, v.kind) != nil {
				_ = p.Failure(ctx, Error)
			}
		}
	}
}

// UsageOf reads the usage of an LLM response, for p.SetUsage in Run's attempt
// function: result is a JSON body ([]byte, json.RawMessage, string), a decoded
// JSON object (map[string]any), or any value encoding/json can marshal (an SDK's
// response struct: openai-go, anthropic-sdk-go). Its "usage" object (or result
// itself, if it has none) is read as
//
//   - OpenAI chat: Tokens = total_tokens; InputTokens = prompt_tokens minus
//     prompt_tokens_details.cached_tokens, which are CachedInputTokens;
//     OutputTokens = completion_tokens;
//   - OpenAI responses: total_tokens; input_tokens minus
//     input_tokens_details.cached_tokens (CachedInputTokens); output_tokens;
//   - Anthropic: InputTokens = input_tokens (cache reads already apart),
//     CachedInputTokens = cache_read_input_tokens, OutputTokens = output_tokens.
//
// Counts that are not plausible (negative, fractional, above 1,000,000,000) are
// left 0 ("not given"); so is everything when result has no usage.
func UsageOf(result any) Usage {
	var raw []byte
	switch v := result.(type) {
	case nil:
		return Usage{}
	case []byte:
		raw = v
	case json.RawMessage:
		raw = v
	case string:
		raw = []byte(v)
	case map[string]any:
		return usageOfObject(v)
	default:
		b, err := json.Marshal(v)
		if err != nil {
			return Usage{}
		}
		raw = b
	}
	var doc map[string]any
	if json.Unmarshal(raw, &doc) != nil {
		return Usage{}
	}
	return usageOfObject(doc)
}

func usageOfObject(doc map[string]any) Usage {
	u, ok := doc["usage"].(map[string]any)
	if !ok {
		u = doc
	}
	num := func(o any, key string) (int, bool) {
		m, ok := o.(map[string]any)
		if !ok {
			return 0, false
		}
		f, ok := m[key].(float64)
		if !ok || f < 0 || f > maxCount || f != float64(int(f)) {
			return 0, false
		}
		return int(f), true
	}
	var out Usage
	out.Tokens, _ = num(u, "total_tokens")
	if prompt, ok := num(u, "prompt_tokens"); ok {
		out.CachedInputTokens, _ = num(u["prompt_tokens_details"], "cached_tokens")
		out.InputTokens = max(0, prompt-out.CachedInputTokens)
		out.OutputTokens, _ = num(u, "completion_tokens")
	} else {
		in, hasIn := num(u, "input_tokens")
		out.OutputTokens, _ = num(u, "output_tokens")
		if cached, ok := num(u["input_tokens_details"], "cached_tokens"); ok {
			in, out.CachedInputTokens = max(0, in-cached), cached
		} else {
			out.CachedInputTokens, _ = num(u, "cache_read_input_tokens")
		}
		if hasIn {
			out.InputTokens = in
		}
	}
	if out.InputTokens+out.OutputTokens > maxCount {
		out.InputTokens, out.OutputTokens = 0, 0
	}
	return out
}
