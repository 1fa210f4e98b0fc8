package polygate

import (
	"bytes"
	"encoding/json"
	"fmt"
	"time"
)

// BreakerState is a source's circuit-breaker state.
type BreakerState string

const (
	// StateClosed: normal operation.
	StateClosed BreakerState = "closed"
	// StateOpen: the source is refused until its cooldown ends.
	StateOpen BreakerState = "open"
	// StateHalfOpen: the cooldown ended; one probe attempt is (or may be) in flight.
	StateHalfOpen BreakerState = "half_open"
)

// Status is the live state of the sidecar (PROTOCOL.md §14.4). The document grows
// without a protocol change: keys this version does not decode into fields are
// kept in the Extra maps, and Raw holds the document exactly as sent.
type Status struct {
	// SidecarVersion is the sidecar's software version.
	SidecarVersion string
	// Backend is "memory" or "redis".
	Backend string
	// ProtocolVersion is the newest protocol version the sidecar speaks.
	ProtocolVersion int
	// Scopes lists every scope in configuration order.
	Scopes []ScopeStatus
	// Extra holds the top-level keys not decoded above.
	Extra map[string]json.RawMessage
	// Raw is the whole document as the sidecar sent it.
	Raw json.RawMessage
}

// ScopeStatus is one scope of a Status.
type ScopeStatus struct {
	// Name is the scope's name.
	Name string
	// CircuitOpen is the scope's policy when every circuit is open: "wait" or "fail_fast".
	CircuitOpen string
	// QuotaFull is the scope's policy when quotas refuse: "wait" or "fail_fast".
	QuotaFull string
	// Waiters counts calls currently waiting in an Acquire.
	Waiters int
	// Calls counts live calls.
	Calls int
	// Sources lists the scope's sources in configuration order.
	Sources []SourceStatus
	// Extra holds the scope's keys not decoded above (priority classes, ...).
	Extra map[string]json.RawMessage
}

// SourceStatus is one source of a ScopeStatus.
type SourceStatus struct {
	// Name is the source's name (its breaker and quota are global by name).
	Name string
	// State is the breaker's state.
	State BreakerState
	// Epoch is bumped by every breaker transition.
	Epoch uint64
	// RetryAfter is how long until a retry of this source is certainly worth it.
	RetryAfter time.Duration
	// CooldownLevel k: the open duration is cooldown × 2^k (capped).
	CooldownLevel int
	// WindowSuccesses counts successes in the breaker window.
	WindowSuccesses uint64
	// WindowFailures counts failures in the breaker window.
	WindowFailures uint64
	// Streak counts consecutive failures.
	Streak int
	// MemoRemaining is how long this host still skips the source.
	MemoRemaining time.Duration
	// PacerCeiling is this host's concurrency ceiling for the source.
	PacerCeiling float64
	// InFlight counts permits in flight on this host.
	InFlight int
	// TokensAvailable is what is left in the tokens-per-minute bucket (negative:
	// debt); nil without a tpm limit.
	TokensAvailable *float64
	// RequestsAvailable is what is left in the requests-per-minute bucket; nil
	// without an rpm limit.
	RequestsAvailable *float64
	// QuotaBlocked is how long a 429's Retry-After still blocks the quota.
	QuotaBlocked time.Duration
	// Degraded: the shared backend is unreachable; served from local state.
	Degraded bool
	// Extra holds the source's keys not decoded above.
	Extra map[string]json.RawMessage
}

// Scope returns the scope named name, or nil.
func (s *Status) Scope(name string) *ScopeStatus {
	for i := range s.Scopes {
		if s.Scopes[i].Name == name {
			return &s.Scopes[i]
		}
	}
	return nil
}

// Source returns the source named name, or nil.
func (s *ScopeStatus) Source(name string) *SourceStatus {
	for i := range s.Sources {
		if s.Sources[i].Name == name {
			return &s.Sources[i]
		}
	}
	return nil
}

// fields is a JSON object whose known keys are taken out one by one; what is left
// is the object's Extra.
type fields map[string]json.RawMessage

func (f fields) take(key string, dst any) error {
	raw, ok := f[key]
	if !ok {
		return nil
	}
	delete(f, key)
	if bytes.Equal(raw, []byte("null")) {
		return nil
	}
	if err := json.Unmarshal(raw, dst); err != nil {
		return fmt.Errorf("status key %q: %w", key, err)
	}
	return nil
}

func (f fields) seconds(key string, dst *time.Duration) error {
	var s float64
	if err := f.take(key, &s); err != nil {
		return err
	}
	*dst = secondsToDuration(s)
	return nil
}

func (f fields) extra() map[string]json.RawMessage {
	if len(f) == 0 {
		return nil
	}
	return f
}

func objects(raw json.RawMessage, what string) ([]fields, error) {
	var list []fields
	if err := json.Unmarshal(raw, &list); err != nil {
		return nil, fmt.Errorf("status %s: %w", what, err)
	}
	return list, nil
}

func parseStatus(doc []byte) (*Status, error) {
	st, err := decodeStatus(doc)
	if err != nil {
		return nil, &SidecarError{Kind: "protocol", Message: "the sidecar sent a status document this client cannot read", Err: err}
	}
	return st, nil
}

func decodeStatus(doc []byte) (*Status, error) {
	var top fields
	if err := json.Unmarshal(doc, &top); err != nil {
		return nil, err
	}
	st := &Status{Raw: json.RawMessage(doc)}
	var scopes json.RawMessage
	for _, err := range []error{
		top.take("sidecar_version", &st.SidecarVersion),
		top.take("backend", &st.Backend),
		top.take("protocol_version", &st.ProtocolVersion),
		top.take("scopes", &scopes),
	} {
		if err != nil {
			return nil, err
		}
	}
	st.Extra = top.extra()
	if scopes == nil {
		return st, nil
	}
	list, err := objects(scopes, "scopes")
	if err != nil {
		return nil, err
	}
	st.Scopes = make([]ScopeStatus, len(list))
	for i, f := range list {
		sc := &st.Scopes[i]
		var sources json.RawMessage
		for _, err := range []error{
			f.take("name", &sc.Name),
			f.take("circuit_open", &sc.CircuitOpen),
			f.take("quota_full", &sc.QuotaFull),
			f.take("waiters", &sc.Waiters),
			f.take("calls", &sc.Calls),
			f.take("sources", &sources),
		} {
			if err != nil {
				return nil, err
			}
		}
		sc.Extra = f.extra()
		if sources == nil {
			continue
		}
		srcs, err := objects(sources, "sources of scope "+sc.Name)
		if err != nil {
			return nil, err
		}
		sc.Sources = make([]SourceStatus, len(srcs))
		for j, g := range srcs {
			s := &sc.Sources[j]
			var state string
			for _, err := range []error{
				g.take("name", &s.Name),
				g.take("state", &state),
				g.take("epoch", &s.Epoch),
				g.seconds("retry_after_s", &s.RetryAfter),
				g.take("cooldown_level", &s.CooldownLevel),
				g.take("window_successes", &s.WindowSuccesses),
				g.take("window_failures", &s.WindowFailures),
				g.take("streak", &s.Streak),
				g.seconds("memo_remaining_s", &s.MemoRemaining),
				g.take("pacer_ceiling", &s.PacerCeiling),
				g.take("in_flight", &s.InFlight),
				g.take("tokens_available", &s.TokensAvailable),
				g.take("requests_available", &s.RequestsAvailable),
				g.seconds("quota_blocked_s", &s.QuotaBlocked),
				g.take("degraded", &s.Degraded),
			} {
				if err != nil {
					return nil, err
				}
			}
			s.State = BreakerState(state)
			s.Extra = g.extra()
		}
	}
	return st, nil
}
