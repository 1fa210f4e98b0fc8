package polygate

import (
	"fmt"
	"time"
)

// Exhaustion reasons carried by AllSourcesExhaustedError.Reason.
const (
	// ReasonStalled: the call spent longer than the scope's stall_window without a
	// usable permit.
	ReasonStalled = "stalled"
	// ReasonQuotaExhausted: quota (or pacer) refused every source and the scope is
	// configured quota_full = "fail_fast".
	ReasonQuotaExhausted = "quota_exhausted"
	// ReasonRetryExhausted: max_attempts attempts have been made.
	ReasonRetryExhausted = "retry_exhausted"
)

// Skip reasons, the values of GatewayUnavailableError.PerSourceReasons.
const (
	SkipCircuitOpen        = "circuit_open"
	SkipPaced              = "paced"
	SkipRateLimited        = "rate_limited"
	SkipBackendUnavailable = "backend_unavailable"
	// SkipTenantLimited: the call's tenant has no room on this source (DESIGN §19).
	SkipTenantLimited = "tenant_limited"
)

// GatewayUnavailableError means the call-level budget is spent: no source can serve
// this call. Retries, back-off, failover and waiting already happened inside
// PolyGate; do not retry the call in a loop. Re-submitting the whole job later is a
// task-level retry, a different thing, and RetryAfter says when it is certainly
// worth it.
//
// It is returned as is when the shared backend is unreachable and the sidecar is
// configured on_backend_error = "fail_closed" (Kind "backend_unavailable"), and is
// the base of *CircuitOpenError, *AllSourcesExhaustedError and *TenantLimitError:
// errors.As(err, &gu) with gu a *GatewayUnavailableError matches all of them.
type GatewayUnavailableError struct {
	// Kind is the wire error kind in snake_case: "circuit_open",
	// "all_sources_exhausted", "tenant_limited" or "backend_unavailable".
	Kind string
	// Message is the sidecar's explanation, naming the scope and sources.
	Message string
	// RetryAfter is how long until a retry is certainly worth attempting; 0 means
	// now or unknown (a half-open source's probe may succeed at any moment).
	RetryAfter time.Duration
	// PerSourceReasons maps each source skipped in the last admission pass to why:
	// SkipCircuitOpen, SkipPaced, SkipRateLimited, SkipBackendUnavailable or
	// SkipTenantLimited.
	PerSourceReasons map[string]string
	// Scope is the call's scope ("" when the sidecar did not say).
	Scope string
}

func (e *GatewayUnavailableError) Error() string {
	return "polygate: " + e.Message
}

// CircuitOpenError: every source of the scope refused for circuit-breaker reasons
// and the scope is configured circuit_open = "fail_fast". RetryAfter is when the
// earliest breaker's cooldown ends. It unwraps to its *GatewayUnavailableError.
type CircuitOpenError struct {
	GatewayUnavailableError
}

// Unwrap returns the embedded *GatewayUnavailableError, so errors.As finds it.
func (e *CircuitOpenError) Unwrap() error { return &e.GatewayUnavailableError }

// AllSourcesExhaustedError: the call ran out of a budget; Reason says which
// (ReasonStalled, ReasonQuotaExhausted or ReasonRetryExhausted). It unwraps to its
// *GatewayUnavailableError.
type AllSourcesExhaustedError struct {
	GatewayUnavailableError
	// Reason is the budget that ran out; "" if the sidecar sent none.
	Reason string
}

// Unwrap returns the embedded *GatewayUnavailableError, so errors.As finds it.
func (e *AllSourcesExhaustedError) Unwrap() error { return &e.GatewayUnavailableError }

// TenantLimitError: the call's tenant is over one of its limits (DESIGN §19,
// PROTOCOL.md §15); the call is over, and Run returns it at once, with no other
// attempt. Tenant names the tenant ("" is the scope's anonymous tenant), Limit the
// limit that refused: "tpm", "rpm", "tpd", "rpd", "usd_per_day" or
// "usd_per_month". RetryAfter is how long until the tenant's bucket certainly
// holds the call, or, for a spent dollar budget, until its calendar window (UTC
// day or month) ends. It unwraps to its *GatewayUnavailableError.
type TenantLimitError struct {
	GatewayUnavailableError
	// Tenant is the tenant whose limit refused.
	Tenant string
	// Limit is the limit that refused.
	Limit string
}

// Unwrap returns the embedded *GatewayUnavailableError, so errors.As finds it.
func (e *TenantLimitError) Unwrap() error { return &e.GatewayUnavailableError }

// SidecarError is trouble with the sidecar or with the request rather than an
// answer about the gateway: the connection could not be made or was lost, a
// protocol violation, an unknown scope, call or permit, an invalid argument
// (checked locally before anything is sent, or by the sidecar), permission denied,
// the sidecar shutting down, ...
type SidecarError struct {
	// Kind is the wire ErrorKind in snake_case ("unknown_scope", "invalid_argument",
	// "permission_denied", "shutting_down", "busy", "overloaded", ...), or, for
	// trouble seen on this side of the socket, "connection" (cannot connect,
	// connection lost, client closed) or "protocol" (the sidecar sent something this
	// client cannot understand).
	Kind string
	// Message names the offending thing (a scope, a value, the socket path).
	Message string
	// Scope is the call's scope when the error concerns one.
	Scope string
	// Err is the underlying cause (an I/O error), if any.
	Err error
}

func (e *SidecarError) Error() string {
	if e.Err != nil {
		return fmt.Sprintf("polygate: %s: %v", e.Message, e.Err)
	}
	return "polygate: " + e.Message
}

// Unwrap returns the underlying cause, if any.
func (e *SidecarError) Unwrap() error { return e.Err }

// secondsToDuration converts a wire retry_after_s to a Duration, clamping what is
// not a sensible non-negative finite number.
func secondsToDuration(s float64) time.Duration {
	switch {
	case !(s > 0): // also NaN
		return 0
	case s >= float64(1<<63-1)/float64(time.Second):
		return time.Duration(1<<63 - 1)
	}
	return time.Duration(s * float64(time.Second))
}

// tenantLimitError maps a wire TenantRefusal (Reply::TenantLimited, v3).
func tenantLimitError(e *errorReply, tenant, limit string) *TenantLimitError {
	message := e.message
	if message == "" {
		message = fmt.Sprintf("tenant %q is over its %s limit", tenant, limit)
	}
	te := &TenantLimitError{
		GatewayUnavailableError: GatewayUnavailableError{
			Kind:             "tenant_limited",
			Message:          message,
			RetryAfter:       secondsToDuration(e.retryAfter),
			PerSourceReasons: make(map[string]string, len(e.reasons)),
			Scope:            e.scope.v,
		},
		Tenant: tenant,
		Limit:  limit,
	}
	for _, r := range e.reasons {
		te.PerSourceReasons[r.source] = nameOf(skipSnake, r.reason)
	}
	return te
}

// errorFromReply maps a wire ErrorReply to the matching error.
func errorFromReply(e *errorReply) error {
	scope := e.scope.v
	kind := nameOf(errorKindSnake, e.kind)
	message := e.message
	if message == "" {
		message = kind
	}
	switch e.kind {
	case kindCircuitOpen, kindAllSourcesExhausted, kindBackendUnavailable:
		gu := GatewayUnavailableError{
			Kind:             kind,
			Message:          message,
			RetryAfter:       secondsToDuration(e.retryAfter),
			PerSourceReasons: make(map[string]string, len(e.reasons)),
			Scope:            scope,
		}
		for _, r := range e.reasons {
			gu.PerSourceReasons[r.source] = nameOf(skipSnake, r.reason)
		}
		switch e.kind {
		case kindCircuitOpen:
			return &CircuitOpenError{gu}
		case kindAllSourcesExhausted:
			ex := &AllSourcesExhaustedError{GatewayUnavailableError: gu}
			if e.exhausted.ok {
				ex.Reason = nameOf(exhaustSnake, e.exhausted.v)
			}
			return ex
		}
		return &gu
	}
	return &SidecarError{Kind: kind, Message: message, Scope: scope}
}

// invalidArgument is the error of a value refused before anything is sent.
func invalidArgument(format string, args ...any) *SidecarError {
	return &SidecarError{Kind: "invalid_argument", Message: fmt.Sprintf(format, args...)}
}
