package polygate

// The wire codec: every frame of bindings/PROTOCOL.md (versions 1, 2 and 3), encoded
// and decoded by hand into flat structs — no reflection, no interface boxing, one
// append per field. Both directions are implemented (client and server frames)
// so that the golden vectors can be checked byte for byte both ways and the tests'
// fake sidecar speaks the same codec.

import (
	"encoding/binary"
	"fmt"
	"math"
	"unicode/utf8"
)

// Protocol versions (PROTOCOL.md §13–§15).
const (
	// protocolVersion is the version this client says in Hello (tenants, §15).
	protocolVersion = 3
	// fallbackVersion is said to a sidecar that refuses 3: everything works but
	// tenants.
	fallbackVersion = 2
	// tenantVersion is the first version with tenants (StartTenant, BeginTenant,
	// TenantStatus, SuccessCached, Reply::TenantLimited).
	tenantVersion = 3
)

// MaxTenantBytes is the longest tenant id, in bytes of UTF-8 (PROTOCOL.md §15).
const MaxTenantBytes = 128

// Frame limits (PROTOCOL.md §2, §14.4).
const (
	// defaultMaxFrame is the outgoing limit until Welcome announces the sidecar's.
	defaultMaxFrame = 65536
	// maxIncomingFrame is the largest frame accepted from the sidecar: status
	// replies may exceed max_frame, up to 16 MiB.
	maxIncomingFrame = 16 << 20
)

// Request tags (PROTOCOL.md §4.2).
const (
	reqHello uint32 = iota
	reqBeginCall
	reqAcquire
	reqReport
	reqEndCall
	reqStatus
	reqForceOpen
	reqForceClose
	reqReset
	reqPing
	reqCancel
	reqStart
	reqRetry
	reqFinish
	reqBegin
	reqStatusJSON
	reqReportObserved
	reqRetryObserved
	reqFinishObserved
	reqStartTenant
	reqBeginTenant
	reqTenantStatus
	reqTags
)

// Reply tags (PROTOCOL.md §4.5).
const (
	repWelcome uint32 = iota
	repCallBegun
	repGranted
	repReported
	repOk
	repStatus
	repPong
	repError
	repStarted
	repStatusJSON
	repTenantLimited
	repTags
)

// Outcome tags (PROTOCOL.md §4.3).
const (
	outSuccess uint32 = iota
	outFailure
	outRateLimited
	outCancelled
	outSuccessUsage
	outFailureUsage
	outSuccessCached
	outTags
)

// Error kinds (PROTOCOL.md §4.8).
const (
	kindCircuitOpen uint32 = iota
	kindAllSourcesExhausted
	kindUnknownScope
	kindUnknownCall
	kindUnknownPermit
	kindInvalidArgument
	kindMalformed
	kindFrameTooLarge
	kindProtocolViolation
	kindPermissionDenied
	kindShuttingDown
	kindBackendUnavailable
	kindCancelled
	kindBusy
	kindInternal
	kindOverloaded
	kindTenantLimited
)

// Wire names of the enums, indexed by tag; their snake_case forms are what the API
// exposes (SidecarError.Kind, reasons, states).
var (
	requestNames   = [...]string{"Hello", "BeginCall", "Acquire", "Report", "EndCall", "Status", "ForceOpen", "ForceClose", "Reset", "Ping", "Cancel", "Start", "Retry", "Finish", "Begin", "StatusJson", "ReportObserved", "RetryObserved", "FinishObserved", "StartTenant", "BeginTenant", "TenantStatus"}
	replyNames     = [...]string{"Welcome", "CallBegun", "Granted", "Reported", "Ok", "Status", "Pong", "Error", "Started", "StatusJson", "TenantLimited"}
	outcomeNames   = [...]string{"Success", "Failure", "RateLimited", "Cancelled", "SuccessUsage", "FailureUsage", "SuccessCached"}
	failureNames   = [...]string{"Timeout", "ServerError", "Connection", "BadResult", "Error"}
	errorKindNames = [...]string{"CircuitOpen", "AllSourcesExhausted", "UnknownScope", "UnknownCall", "UnknownPermit", "InvalidArgument", "Malformed", "FrameTooLarge", "ProtocolViolation", "PermissionDenied", "ShuttingDown", "BackendUnavailable", "Cancelled", "Busy", "Internal", "Overloaded", "TenantLimited"}
	skipNames      = [...]string{"CircuitOpen", "Paced", "RateLimited", "BackendUnavailable", "TenantLimited"}
	exhaustNames   = [...]string{"Stalled", "QuotaExhausted", "RetryExhausted"}
	stateNames     = [...]string{"Closed", "Open", "HalfOpen"}

	errorKindSnake = snakeAll(errorKindNames[:])
	skipSnake      = snakeAll(skipNames[:])
	exhaustSnake   = snakeAll(exhaustNames[:])
	stateSnake     = snakeAll(stateNames[:])
)

// snake turns "AllSourcesExhausted" into "all_sources_exhausted".
func snake(s string) string {
	out := make([]byte, 0, len(s)+4)
	for i := 0; i < len(s); i++ {
		c := s[i]
		if 'A' <= c && c <= 'Z' {
			if i > 0 {
				out = append(out, '_')
			}
			c += 'a' - 'A'
		}
		out = append(out, c)
	}
	return string(out)
}

func snakeAll(names []string) []string {
	out := make([]string, len(names))
	for i, n := range names {
		out[i] = snake(n)
	}
	return out
}

// nameOf returns names[tag], or "#<tag>" for a tag this client does not know.
func nameOf(names []string, tag uint32) string {
	if int(tag) < len(names) {
		return names[tag]
	}
	return fmt.Sprintf("#%d", tag)
}

// ---------------------------------------------------------------- values

// optU64 is an Option<u64>.
type optU64 struct {
	v  uint64
	ok bool
}

// optF64 is an Option<f64>.
type optF64 struct {
	v  float64
	ok bool
}

// optStr is an Option<String>.
type optStr struct {
	v  string
	ok bool
}

// optU32 is an Option of an enum tag (ExhaustionReason).
type optU32 struct {
	v  uint32
	ok bool
}

func some(v uint64) optU64 { return optU64{v, true} }

// callSpec is the CallSpec of Start and Begin (PROTOCOL.md §14.2); BeginCall uses
// its scope and estTokens only.
type callSpec struct {
	scope     string
	estTokens optU64
	priority  optStr
	estInput  optU64
	estOutput optU64
}

// usage is the Usage of SuccessUsage and FailureUsage (PROTOCOL.md §14.2).
type usage struct {
	tokens optU64
	input  optU64
	output optU64
}

// outcome is one Outcome (PROTOCOL.md §4.3); tag selects which fields are on the wire.
type outcome struct {
	tag          uint32
	tokens       optU64 // Success
	countAttempt bool   // Success, SuccessUsage, SuccessCached
	kind         uint32 // Failure, FailureUsage: a FailureKind tag
	retryAfter   optF64 // RateLimited
	usage        usage  // SuccessUsage, FailureUsage, SuccessCached
	cached       uint64 // SuccessCached: input tokens read from the provider's prompt cache
}

// request is one Request (PROTOCOL.md §4.2); tag selects which fields are on the wire.
type request struct {
	tag uint32
	// Hello
	version    uint32
	clientName string
	pid        uint32
	// BeginCall (scope, estTokens), Start, Begin, StartTenant, BeginTenant
	spec callSpec
	// StartTenant, BeginTenant, TenantStatus: the tenant id
	tenant string
	// TenantStatus: only this scope (none: every scope with tenants)
	scope optStr
	// Acquire, EndCall: the call; Report, Retry, Finish: the permit; Cancel: the target id
	target  uint64
	outcome outcome    // Report, Retry, Finish
	limits  *obsLimits // Report, Retry, Finish: sent as their Observed variants (§18)
	// ForceOpen (source, seconds), ForceClose, Reset
	source  string
	seconds float64
}

// grant is the body shared by Granted and Started.
type grant struct {
	permit    uint64
	source    string
	isProbe   bool
	attempt   uint32
	estTokens uint64
}

// sourceReason is one element of ErrorReply.per_source_reasons.
type sourceReason struct {
	source string
	reason uint32 // SkipReason tag
}

// errorReply is an ErrorReply (PROTOCOL.md §4.7).
type errorReply struct {
	kind       uint32
	message    string
	retryAfter float64
	reasons    []sourceReason
	exhausted  optU32
	scope      optStr
}

// statusReport, scopeReport and sourceReport are the binary Status reply of protocol
// version 1 (PROTOCOL.md §4.10). This client asks for StatusJson; they are decoded
// for completeness (and the golden vectors).
type statusReport struct {
	sidecarVersion string
	backend        string
	scopes         []scopeReport
}

type scopeReport struct {
	name        string
	circuitOpen string
	quotaFull   string
	waiters     uint32
	calls       uint32
	sources     []sourceReport
}

type sourceReport struct {
	name              string
	state             uint32
	epoch             uint64
	retryAfter        float64
	cooldownLevel     uint32
	windowSuccesses   uint64
	windowFailures    uint64
	streak            uint32
	memoRemaining     float64
	pacerCeiling      float64
	inFlight          uint32
	tokensAvailable   optF64
	requestsAvailable optF64
	quotaBlocked      float64
	degraded          bool
}

// reply is one Reply (PROTOCOL.md §4.5); tag selects which fields were on the wire.
type reply struct {
	tag uint32
	// Welcome
	version        uint32
	sidecarVersion string
	maxFrame       uint32
	// CallBegun, Started
	call uint64
	// Granted, Started
	grant grant
	// Reported
	applied    bool
	state      uint32
	retryAfter float64
	// Status
	status *statusReport
	// StatusJson
	text string
	// Error, TenantLimited (the refusal's error)
	err *errorReply
	// TenantLimited: the tenant and the limit that refused
	tenant, limit string
}

// ---------------------------------------------------------------- encoding

func putU32(b []byte, v uint32) []byte { return binary.LittleEndian.AppendUint32(b, v) }
func putU64(b []byte, v uint64) []byte { return binary.LittleEndian.AppendUint64(b, v) }
func putF64(b []byte, v float64) []byte {
	return binary.LittleEndian.AppendUint64(b, math.Float64bits(v))
}

func putBool(b []byte, v bool) []byte {
	if v {
		return append(b, 1)
	}
	return append(b, 0)
}

func putStr(b []byte, s string) []byte {
	b = putU64(b, uint64(len(s)))
	return append(b, s...)
}

func putOptU64(b []byte, o optU64) []byte {
	if !o.ok {
		return append(b, 0)
	}
	return putU64(append(b, 1), o.v)
}

func putOptF64(b []byte, o optF64) []byte {
	if !o.ok {
		return append(b, 0)
	}
	return putF64(append(b, 1), o.v)
}

func putOptStr(b []byte, o optStr) []byte {
	if !o.ok {
		return append(b, 0)
	}
	return putStr(append(b, 1), o.v)
}

func putOptU32(b []byte, o optU32) []byte {
	if !o.ok {
		return append(b, 0)
	}
	return putU32(append(b, 1), o.v)
}

func putSpec(b []byte, s *callSpec) []byte {
	b = putStr(b, s.scope)
	b = putOptU64(b, s.estTokens)
	b = putOptStr(b, s.priority)
	b = putOptU64(b, s.estInput)
	return putOptU64(b, s.estOutput)
}

func putUsage(b []byte, u *usage) []byte {
	b = putOptU64(b, u.tokens)
	b = putOptU64(b, u.input)
	return putOptU64(b, u.output)
}

func putOutcome(b []byte, o *outcome) []byte {
	b = putU32(b, o.tag)
	switch o.tag {
	case outSuccess:
		b = putOptU64(b, o.tokens)
		b = putBool(b, o.countAttempt)
	case outFailure:
		b = putU32(b, o.kind)
	case outRateLimited:
		b = putOptF64(b, o.retryAfter)
	case outCancelled:
	case outSuccessUsage:
		b = putUsage(b, &o.usage)
		b = putBool(b, o.countAttempt)
	case outFailureUsage:
		b = putU32(b, o.kind)
		b = putUsage(b, &o.usage)
	case outSuccessCached:
		b = putUsage(b, &o.usage)
		b = putU64(b, o.cached)
		b = putBool(b, o.countAttempt)
	}
	return b
}

// beginFrame reserves the 4-byte length prefix and writes the id; endFrame fills
// the prefix in. Between them the message body is appended.
func beginFrame(b []byte, id uint64) ([]byte, int) {
	start := len(b)
	b = append(b, 0, 0, 0, 0)
	return putU64(b, id), start
}

func endFrame(b []byte, start int) []byte {
	binary.BigEndian.PutUint32(b[start:], uint32(len(b)-start-4))
	return b
}

// appendRequest appends the complete frame (length prefix included) of a
// ClientFrame{id, r} to b.
func appendRequest(b []byte, id uint64, r *request) []byte {
	b, start := beginFrame(b, id)
	if r.limits != nil && (r.tag == reqReport || r.tag == reqRetry || r.tag == reqFinish) {
		b = putU32(b, observedTag(r.tag))
	} else {
		b = putU32(b, r.tag)
	}
	switch r.tag {
	case reqHello:
		b = putU32(b, r.version)
		b = putStr(b, r.clientName)
		b = putU32(b, r.pid)
	case reqBeginCall:
		b = putStr(b, r.spec.scope)
		b = putOptU64(b, r.spec.estTokens)
	case reqAcquire, reqEndCall, reqCancel:
		b = putU64(b, r.target)
	case reqReport, reqRetry, reqFinish:
		b = putU64(b, r.target)
		b = putOutcome(b, &r.outcome)
		if r.limits != nil {
			b = putLimits(b, r.limits)
		}
	case reqForceOpen:
		b = putStr(b, r.source)
		b = putF64(b, r.seconds)
	case reqForceClose, reqReset:
		b = putStr(b, r.source)
	case reqStart, reqBegin:
		b = putSpec(b, &r.spec)
	case reqStartTenant, reqBeginTenant:
		b = putSpec(b, &r.spec)
		b = putStr(b, r.tenant)
	case reqTenantStatus:
		b = putOptStr(b, r.scope)
		b = putStr(b, r.tenant)
	case reqStatus, reqPing, reqStatusJSON:
	}
	return endFrame(b, start)
}

func putGrant(b []byte, g *grant) []byte {
	b = putU64(b, g.permit)
	b = putStr(b, g.source)
	b = putBool(b, g.isProbe)
	b = putU32(b, g.attempt)
	return putU64(b, g.estTokens)
}

func putErrorReply(b []byte, e *errorReply) []byte {
	b = putU32(b, e.kind)
	b = putStr(b, e.message)
	b = putF64(b, e.retryAfter)
	b = putU64(b, uint64(len(e.reasons)))
	for _, r := range e.reasons {
		b = putStr(b, r.source)
		b = putU32(b, r.reason)
	}
	b = putOptU32(b, e.exhausted)
	return putOptStr(b, e.scope)
}

func putStatus(b []byte, s *statusReport) []byte {
	b = putStr(b, s.sidecarVersion)
	b = putStr(b, s.backend)
	b = putU64(b, uint64(len(s.scopes)))
	for i := range s.scopes {
		sc := &s.scopes[i]
		b = putStr(b, sc.name)
		b = putStr(b, sc.circuitOpen)
		b = putStr(b, sc.quotaFull)
		b = putU32(b, sc.waiters)
		b = putU32(b, sc.calls)
		b = putU64(b, uint64(len(sc.sources)))
		for j := range sc.sources {
			src := &sc.sources[j]
			b = putStr(b, src.name)
			b = putU32(b, src.state)
			b = putU64(b, src.epoch)
			b = putF64(b, src.retryAfter)
			b = putU32(b, src.cooldownLevel)
			b = putU64(b, src.windowSuccesses)
			b = putU64(b, src.windowFailures)
			b = putU32(b, src.streak)
			b = putF64(b, src.memoRemaining)
			b = putF64(b, src.pacerCeiling)
			b = putU32(b, src.inFlight)
			b = putOptF64(b, src.tokensAvailable)
			b = putOptF64(b, src.requestsAvailable)
			b = putF64(b, src.quotaBlocked)
			b = putBool(b, src.degraded)
		}
	}
	return b
}

// appendReply appends the complete frame of a ServerFrame{id, r} to b (the tests'
// fake sidecar and the golden vectors use it).
func appendReply(b []byte, id uint64, r *reply) []byte {
	b, start := beginFrame(b, id)
	b = putU32(b, r.tag)
	switch r.tag {
	case repWelcome:
		b = putU32(b, r.version)
		b = putStr(b, r.sidecarVersion)
		b = putU32(b, r.maxFrame)
	case repCallBegun:
		b = putU64(b, r.call)
	case repGranted:
		b = putGrant(b, &r.grant)
	case repReported:
		b = putBool(b, r.applied)
		b = putU32(b, r.state)
		b = putF64(b, r.retryAfter)
	case repStatus:
		b = putStatus(b, r.status)
	case repError:
		b = putErrorReply(b, r.err)
	case repStarted:
		b = putU64(b, r.call)
		b = putGrant(b, &r.grant)
	case repStatusJSON:
		b = putStr(b, r.text)
	case repTenantLimited:
		b = putErrorReply(b, r.err)
		b = putStr(b, r.tenant)
		b = putStr(b, r.limit)
	case repOk, repPong:
	}
	return endFrame(b, start)
}

// ---------------------------------------------------------------- decoding

// errMalformed describes a payload that does not decode (PROTOCOL.md §3: decoders
// are strict).
type errMalformed struct {
	what string
	off  int
}

func (e *errMalformed) Error() string {
	return fmt.Sprintf("malformed frame: %s at payload offset %d", e.what, e.off)
}

// dec reads a payload; the first problem sticks in err and every later read
// returns zero values.
type dec struct {
	b   []byte
	off int
	err error
	// intern, when set, deduplicates grant source names (the reader goroutine
	// keeps one per connection: a worker sees the same few names over and over).
	intern map[string]string
}

func (d *dec) fail(what string) {
	if d.err == nil {
		d.err = &errMalformed{what, d.off}
	}
}

func (d *dec) take(n int, what string) []byte {
	if d.err != nil {
		return nil
	}
	if n < 0 || len(d.b)-d.off < n {
		d.fail("truncated " + what)
		return nil
	}
	p := d.b[d.off : d.off+n]
	d.off += n
	return p
}

func (d *dec) u32(what string) uint32 {
	if p := d.take(4, what); p != nil {
		return binary.LittleEndian.Uint32(p)
	}
	return 0
}

func (d *dec) u64(what string) uint64 {
	if p := d.take(8, what); p != nil {
		return binary.LittleEndian.Uint64(p)
	}
	return 0
}

func (d *dec) f64(what string) float64 { return math.Float64frombits(d.u64(what)) }

func (d *dec) flag(what string) bool {
	p := d.take(1, what)
	if p == nil {
		return false
	}
	switch p[0] {
	case 0:
		return false
	case 1:
		return true
	}
	d.off--
	d.fail(fmt.Sprintf("%s: byte 0x%02x is neither 0 nor 1", what, p[0]))
	return false
}

// length reads a u64 length or count and checks it against the bytes left, each
// element taking at least minSize bytes (never trusting it for allocation).
func (d *dec) length(what string, minSize int) int {
	n := d.u64(what + " length")
	if d.err != nil {
		return 0
	}
	if n > uint64(len(d.b)-d.off)/uint64(minSize) {
		d.off -= 8
		d.fail(fmt.Sprintf("%s length %d exceeds the %d bytes left", what, n, len(d.b)-d.off-8))
		return 0
	}
	return int(n)
}

func (d *dec) rawStr(what string) []byte {
	n := d.length(what, 1)
	p := d.take(n, what)
	if p != nil && !utf8.Valid(p) {
		d.off -= n
		d.fail(what + ": invalid UTF-8")
		return nil
	}
	return p
}

func (d *dec) str(what string) string {
	if p := d.rawStr(what); p != nil {
		return string(p)
	}
	return ""
}

// source decodes a source name, interned when the decoder has a table.
func (d *dec) source(what string) string {
	p := d.rawStr(what)
	if p == nil {
		return ""
	}
	if d.intern == nil {
		return string(p)
	}
	if s, ok := d.intern[string(p)]; ok {
		return s
	}
	s := string(p)
	if len(d.intern) < 4096 {
		d.intern[s] = s
	}
	return s
}

func (d *dec) some(what string) bool { return d.flag(what + " (Option)") }

func (d *dec) optU64(what string) optU64 {
	if d.some(what) {
		return optU64{d.u64(what), true}
	}
	return optU64{}
}

func (d *dec) optF64(what string) optF64 {
	if d.some(what) {
		return optF64{d.f64(what), true}
	}
	return optF64{}
}

func (d *dec) optStr(what string) optStr {
	if d.some(what) {
		return optStr{d.str(what), true}
	}
	return optStr{}
}

// tag reads an enum tag and checks it is below n.
func (d *dec) tag(what string, n uint32) uint32 {
	t := d.u32(what)
	if d.err == nil && t >= n {
		d.off -= 4
		d.fail(fmt.Sprintf("unknown %s tag %d", what, t))
	}
	return t
}

// done fails a payload that has bytes after its message.
func (d *dec) done() error {
	if d.err == nil && d.off != len(d.b) {
		d.fail(fmt.Sprintf("%d trailing bytes", len(d.b)-d.off))
	}
	return d.err
}

func (d *dec) spec(s *callSpec) {
	s.scope = d.str("scope")
	s.estTokens = d.optU64("est_tokens")
	s.priority = d.optStr("priority")
	s.estInput = d.optU64("est_input_tokens")
	s.estOutput = d.optU64("est_output_tokens")
}

func (d *dec) usage(u *usage) {
	u.tokens = d.optU64("tokens")
	u.input = d.optU64("input_tokens")
	u.output = d.optU64("output_tokens")
}

func (d *dec) outcome(o *outcome) {
	o.tag = d.tag("Outcome", outTags)
	switch o.tag {
	case outSuccess:
		o.tokens = d.optU64("tokens")
		o.countAttempt = d.flag("count_attempt")
	case outFailure:
		o.kind = d.tag("FailureKind", uint32(len(failureNames)))
	case outRateLimited:
		o.retryAfter = d.optF64("retry_after_s")
	case outSuccessUsage:
		d.usage(&o.usage)
		o.countAttempt = d.flag("count_attempt")
	case outFailureUsage:
		o.kind = d.tag("FailureKind", uint32(len(failureNames)))
		d.usage(&o.usage)
	case outSuccessCached:
		d.usage(&o.usage)
		o.cached = d.u64("cached_input_tokens")
		o.countAttempt = d.flag("count_attempt")
	}
}

// decodeRequest decodes a ClientFrame payload (the fake sidecar's side).
func decodeRequest(payload []byte) (uint64, request, error) {
	d := dec{b: payload}
	var r request
	id := d.u64("id")
	r.tag = d.tag("Request", reqTags)
	switch r.tag {
	case reqHello:
		r.version = d.u32("protocol_version")
		r.clientName = d.str("client_name")
		r.pid = d.u32("pid")
	case reqBeginCall:
		r.spec.scope = d.str("scope")
		r.spec.estTokens = d.optU64("est_tokens")
	case reqAcquire, reqEndCall, reqCancel:
		r.target = d.u64("id")
	case reqReport, reqRetry, reqFinish:
		r.target = d.u64("permit")
		d.outcome(&r.outcome)
	case reqReportObserved, reqRetryObserved, reqFinishObserved:
		r.tag = [...]uint32{reqReport, reqRetry, reqFinish}[r.tag-reqReportObserved]
		r.target = d.u64("permit")
		d.outcome(&r.outcome)
		r.limits = d.limits()
	case reqForceOpen:
		r.source = d.str("source")
		r.seconds = d.f64("seconds")
	case reqForceClose, reqReset:
		r.source = d.str("source")
	case reqStart, reqBegin:
		d.spec(&r.spec)
	case reqStartTenant, reqBeginTenant:
		d.spec(&r.spec)
		r.tenant = d.str("tenant")
	case reqTenantStatus:
		r.scope = d.optStr("scope")
		r.tenant = d.str("tenant")
	}
	return id, r, d.done()
}

func (d *dec) grant(g *grant) {
	g.permit = d.u64("permit")
	g.source = d.source("source")
	g.isProbe = d.flag("is_probe")
	g.attempt = d.u32("attempt")
	g.estTokens = d.u64("est_tokens")
}

func (d *dec) errorReply() *errorReply {
	e := &errorReply{}
	e.kind = d.tag("ErrorKind", uint32(len(errorKindNames)))
	e.message = d.str("message")
	e.retryAfter = d.f64("retry_after_s")
	// a (String, SkipReason) element takes at least 8 + 4 bytes
	if n := d.length("per_source_reasons", 12); n > 0 {
		e.reasons = make([]sourceReason, n)
		for i := range e.reasons {
			e.reasons[i].source = d.source("per_source_reasons source")
			e.reasons[i].reason = d.tag("SkipReason", uint32(len(skipNames)))
		}
	}
	if d.some("exhausted") {
		e.exhausted = optU32{d.tag("ExhaustionReason", uint32(len(exhaustNames))), true}
	}
	e.scope = d.optStr("scope")
	return e
}

func (d *dec) status() *statusReport {
	s := &statusReport{}
	s.sidecarVersion = d.str("sidecar_version")
	s.backend = d.str("backend")
	// a ScopeStatus takes at least 3 strings + 2 u32 + a count = 40 bytes
	if n := d.length("scopes", 40); n > 0 {
		s.scopes = make([]scopeReport, n)
		for i := range s.scopes {
			sc := &s.scopes[i]
			sc.name = d.str("scope name")
			sc.circuitOpen = d.str("circuit_open")
			sc.quotaFull = d.str("quota_full")
			sc.waiters = d.u32("waiters")
			sc.calls = d.u32("calls")
			// a SourceStatus takes at least 8+4+8+8+4+8+8+4+8+8+4+1+1+8+1 = 83 bytes
			if m := d.length("sources", 83); m > 0 {
				sc.sources = make([]sourceReport, m)
				for j := range sc.sources {
					src := &sc.sources[j]
					src.name = d.str("source name")
					src.state = d.tag("BreakerState", uint32(len(stateNames)))
					src.epoch = d.u64("epoch")
					src.retryAfter = d.f64("retry_after_s")
					src.cooldownLevel = d.u32("cooldown_level")
					src.windowSuccesses = d.u64("window_successes")
					src.windowFailures = d.u64("window_failures")
					src.streak = d.u32("streak")
					src.memoRemaining = d.f64("memo_remaining_s")
					src.pacerCeiling = d.f64("pacer_ceiling")
					src.inFlight = d.u32("in_flight")
					src.tokensAvailable = d.optF64("tokens_available")
					src.requestsAvailable = d.optF64("requests_available")
					src.quotaBlocked = d.f64("quota_blocked_s")
					src.degraded = d.flag("degraded")
				}
			}
		}
	}
	return s
}

// decodeReply decodes a ServerFrame payload. intern (may be nil) deduplicates
// source names.
func decodeReply(payload []byte, intern map[string]string) (uint64, reply, error) {
	d := dec{b: payload, intern: intern}
	var r reply
	id := d.u64("id")
	r.tag = d.tag("Reply", repTags)
	switch r.tag {
	case repWelcome:
		r.version = d.u32("protocol_version")
		r.sidecarVersion = d.str("sidecar_version")
		r.maxFrame = d.u32("max_frame")
	case repCallBegun:
		r.call = d.u64("call")
	case repGranted:
		d.grant(&r.grant)
	case repReported:
		r.applied = d.flag("applied")
		r.state = d.tag("BreakerState", uint32(len(stateNames)))
		r.retryAfter = d.f64("retry_after_s")
	case repStatus:
		r.status = d.status()
	case repError:
		r.err = d.errorReply()
	case repStarted:
		r.call = d.u64("call")
		d.grant(&r.grant)
	case repStatusJSON:
		r.text = d.str("status JSON")
	case repTenantLimited:
		r.err = d.errorReply()
		r.tenant = d.str("tenant")
		r.limit = d.str("limit")
	}
	return id, r, d.done()
}
