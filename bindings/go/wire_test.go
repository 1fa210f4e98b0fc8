package polygate

// The golden vectors of bindings/vectors/frames.json, byte for byte, both
// directions for every vector, plus the strictness PROTOCOL.md §3 and §12 demand of
// a decoder.

import (
	"bytes"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"os"
	"reflect"
	"sort"
	"strconv"
	"testing"
)

type vector struct {
	Name      string          `json:"name"`
	Direction string          `json:"direction"`
	Value     json.RawMessage `json:"value"`
	FrameHex  string          `json:"frame_hex"`
}

func loadVectors(t *testing.T) []vector {
	t.Helper()
	raw, err := os.ReadFile("../vectors/frames.json")
	if err != nil {
		t.Fatalf("the golden vectors: %v", err)
	}
	var file struct {
		ProtocolVersion int      `json:"protocol_version"`
		Encoding        string   `json:"encoding"`
		Vectors         []vector `json:"vectors"`
	}
	if err := json.Unmarshal(raw, &file); err != nil {
		t.Fatal(err)
	}
	if file.ProtocolVersion != protocolVersion || file.Encoding != "bincode-legacy" {
		t.Fatalf("vectors are protocol %d / %s, this binding speaks %d / bincode-legacy", file.ProtocolVersion, file.Encoding, protocolVersion)
	}
	if len(file.Vectors) < 60 {
		t.Fatalf("only %d vectors", len(file.Vectors))
	}
	return file.Vectors
}

// jv walks a JSON value decoded with UseNumber; every object key must be used
// (so a vector field this binding ignores fails the test).
type jv struct {
	t    *testing.T
	path string
	v    any
	used map[string]bool
}

func (j *jv) fail(format string, args ...any) {
	j.t.Helper()
	j.t.Fatalf("%s: %s", j.path, fmt.Sprintf(format, args...))
}

func (j *jv) obj() map[string]any {
	j.t.Helper()
	m, ok := j.v.(map[string]any)
	if !ok {
		j.fail("not an object: %v", j.v)
	}
	return m
}

func (j *jv) get(key string) *jv {
	j.t.Helper()
	m := j.obj()
	v, ok := m[key]
	if !ok {
		j.fail("missing key %q", key)
	}
	if j.used == nil {
		j.used = map[string]bool{}
	}
	j.used[key] = true
	return &jv{t: j.t, path: j.path + "." + key, v: v}
}

// close checks every key was used.
func (j *jv) close() {
	j.t.Helper()
	for k := range j.obj() {
		if !j.used[k] {
			j.fail("key %q not mapped by the binding", k)
		}
	}
}

func (j *jv) u64() uint64 {
	j.t.Helper()
	n, ok := j.v.(json.Number)
	if !ok {
		j.fail("not a number: %v", j.v)
	}
	v, err := strconv.ParseUint(n.String(), 10, 64)
	if err != nil {
		j.fail("%v", err)
	}
	return v
}

func (j *jv) u32() uint32 {
	j.t.Helper()
	v := j.u64()
	if v > 1<<32-1 {
		j.fail("%d exceeds u32", v)
	}
	return uint32(v)
}

func (j *jv) f64() float64 {
	j.t.Helper()
	n, ok := j.v.(json.Number)
	if !ok {
		j.fail("not a number: %v", j.v)
	}
	v, err := strconv.ParseFloat(n.String(), 64)
	if err != nil {
		j.fail("%v", err)
	}
	return v
}

func (j *jv) str() string {
	j.t.Helper()
	s, ok := j.v.(string)
	if !ok {
		j.fail("not a string: %v", j.v)
	}
	return s
}

func (j *jv) boolean() bool {
	j.t.Helper()
	b, ok := j.v.(bool)
	if !ok {
		j.fail("not a bool: %v", j.v)
	}
	return b
}

func (j *jv) isNull() bool { return j.v == nil }

func (j *jv) optU64() optU64 {
	if j.isNull() {
		return optU64{}
	}
	return some(j.u64())
}

func (j *jv) optF64() optF64 {
	if j.isNull() {
		return optF64{}
	}
	return optF64{j.f64(), true}
}

func (j *jv) optStr() optStr {
	if j.isNull() {
		return optStr{}
	}
	return optStr{j.str(), true}
}

func (j *jv) list() []*jv {
	j.t.Helper()
	l, ok := j.v.([]any)
	if !ok {
		j.fail("not a list: %v", j.v)
	}
	out := make([]*jv, len(l))
	for i, v := range l {
		out[i] = &jv{t: j.t, path: fmt.Sprintf("%s[%d]", j.path, i), v: v}
	}
	return out
}

// variant splits an externally tagged enum value: "Unit" or {"Variant": body}.
func (j *jv) variant(names []string) (uint32, *jv) {
	j.t.Helper()
	name := ""
	var body *jv
	switch v := j.v.(type) {
	case string:
		name = v
	case map[string]any:
		if len(v) != 1 {
			j.fail("an enum value has one key, got %d", len(v))
		}
		for k := range v {
			name = k
		}
		body = j.get(name)
	default:
		j.fail("not an enum value: %v", j.v)
	}
	for i, n := range names {
		if n == name {
			return uint32(i), body
		}
	}
	j.fail("unknown variant %q", name)
	return 0, nil
}

func (j *jv) tag(names []string) uint32 {
	j.t.Helper()
	tag, body := j.variant(names)
	if body != nil {
		j.fail("%s is a unit variant", names[tag])
	}
	return tag
}

func specFromJSON(j *jv) callSpec {
	s := callSpec{scope: j.get("scope").str(), estTokens: j.get("est_tokens").optU64(), priority: j.get("priority").optStr(),
		estInput: j.get("est_input_tokens").optU64(), estOutput: j.get("est_output_tokens").optU64()}
	j.close()
	return s
}

func usageFromJSON(j *jv) usage {
	u := usage{tokens: j.get("tokens").optU64(), input: j.get("input_tokens").optU64(), output: j.get("output_tokens").optU64()}
	j.close()
	return u
}

func outcomeFromJSON(j *jv) outcome {
	tag, b := j.variant(outcomeNames[:])
	o := outcome{tag: tag}
	switch tag {
	case outSuccess:
		o.tokens, o.countAttempt = b.get("tokens").optU64(), b.get("count_attempt").boolean()
	case outFailure:
		o.kind = b.get("kind").tag(failureNames[:])
	case outRateLimited:
		o.retryAfter = b.get("retry_after_s").optF64()
	case outSuccessUsage:
		o.usage, o.countAttempt = usageFromJSON(b.get("usage")), b.get("count_attempt").boolean()
	case outFailureUsage:
		o.kind, o.usage = b.get("kind").tag(failureNames[:]), usageFromJSON(b.get("usage"))
	case outSuccessCached:
		o.usage, o.cached, o.countAttempt = usageFromJSON(b.get("usage")), b.get("cached_input_tokens").u64(), b.get("count_attempt").boolean()
	}
	if b != nil {
		b.close()
	}
	return o
}

func requestFromJSON(j *jv) request {
	tag, b := j.variant(requestNames[:])
	r := request{tag: tag}
	switch tag {
	case reqHello:
		r.version, r.clientName, r.pid = b.get("protocol_version").u32(), b.get("client_name").str(), b.get("pid").u32()
	case reqBeginCall:
		r.spec.scope, r.spec.estTokens = b.get("scope").str(), b.get("est_tokens").optU64()
	case reqAcquire, reqEndCall:
		r.target = b.get("call").u64()
	case reqCancel:
		r.target = b.get("target").u64()
	case reqReport, reqRetry, reqFinish:
		r.target, r.outcome = b.get("permit").u64(), outcomeFromJSON(b.get("outcome"))
	case reqReportObserved, reqRetryObserved, reqFinishObserved:
		r.tag = [...]uint32{reqReport, reqRetry, reqFinish}[tag-reqReportObserved]
		r.target, r.outcome = b.get("permit").u64(), outcomeFromJSON(b.get("outcome"))
		r.limits = limitsFromJSON(b.get("limits"))
	case reqForceOpen:
		r.source, r.seconds = b.get("source").str(), b.get("seconds").f64()
	case reqForceClose, reqReset:
		r.source = b.get("source").str()
	case reqStart, reqBegin:
		r.spec = specFromJSON(b)
		return r
	case reqStartTenant, reqBeginTenant:
		r.spec, r.tenant = specFromJSON(b.get("spec")), b.get("tenant").str()
	case reqTenantStatus:
		r.scope, r.tenant = b.get("scope").optStr(), b.get("tenant").str()
	}
	if b != nil {
		b.close()
	}
	return r
}

func grantFromJSON(b *jv) grant {
	return grant{permit: b.get("permit").u64(), source: b.get("source").str(), isProbe: b.get("is_probe").boolean(),
		attempt: b.get("attempt").u32(), estTokens: b.get("est_tokens").u64()}
}

func statusFromJSON(b *jv) *statusReport {
	s := &statusReport{sidecarVersion: b.get("sidecar_version").str(), backend: b.get("backend").str()}
	for _, sj := range b.get("scopes").list() {
		sc := scopeReport{name: sj.get("name").str(), circuitOpen: sj.get("circuit_open").str(), quotaFull: sj.get("quota_full").str(),
			waiters: sj.get("waiters").u32(), calls: sj.get("calls").u32()}
		for _, x := range sj.get("sources").list() {
			sc.sources = append(sc.sources, sourceReport{
				name: x.get("name").str(), state: x.get("state").tag(stateNames[:]), epoch: x.get("epoch").u64(),
				retryAfter: x.get("retry_after_s").f64(), cooldownLevel: x.get("cooldown_level").u32(),
				windowSuccesses: x.get("window_successes").u64(), windowFailures: x.get("window_failures").u64(),
				streak: x.get("streak").u32(), memoRemaining: x.get("memo_remaining_s").f64(),
				pacerCeiling: x.get("pacer_ceiling").f64(), inFlight: x.get("in_flight").u32(),
				tokensAvailable: x.get("tokens_available").optF64(), requestsAvailable: x.get("requests_available").optF64(),
				quotaBlocked: x.get("quota_blocked_s").f64(), degraded: x.get("degraded").boolean(),
			})
			x.close()
		}
		sj.close()
		s.scopes = append(s.scopes, sc)
	}
	return s
}

func errorReplyFromJSON(b *jv) *errorReply {
	e := &errorReply{kind: b.get("kind").tag(errorKindNames[:]), message: b.get("message").str(), retryAfter: b.get("retry_after_s").f64(), scope: b.get("scope").optStr()}
	for _, pair := range b.get("per_source_reasons").list() {
		l := pair.list()
		if len(l) != 2 {
			pair.fail("a reason is a (source, reason) pair")
		}
		e.reasons = append(e.reasons, sourceReason{l[0].str(), l[1].tag(skipNames[:])})
	}
	if ex := b.get("exhausted"); !ex.isNull() {
		e.exhausted = optU32{ex.tag(exhaustNames[:]), true}
	}
	return e
}

func replyFromJSON(j *jv) reply {
	tag, b := j.variant(replyNames[:])
	r := reply{tag: tag}
	switch tag {
	case repWelcome:
		r.version, r.sidecarVersion, r.maxFrame = b.get("protocol_version").u32(), b.get("sidecar_version").str(), b.get("max_frame").u32()
	case repCallBegun:
		r.call = b.get("call").u64()
	case repGranted:
		r.grant = grantFromJSON(b)
	case repStarted:
		r.call, r.grant = b.get("call").u64(), grantFromJSON(b)
	case repReported:
		r.applied, r.state, r.retryAfter = b.get("applied").boolean(), b.get("state").tag(stateNames[:]), b.get("retry_after_s").f64()
	case repStatus:
		r.status = statusFromJSON(b)
	case repError:
		r.err = errorReplyFromJSON(b)
	case repStatusJSON:
		r.text = b.str()
		return r
	case repTenantLimited:
		ej := b.get("error")
		r.err, r.tenant, r.limit = errorReplyFromJSON(ej), b.get("tenant").str(), b.get("limit").str()
		ej.close()
	}
	if b != nil {
		b.close()
	}
	return r
}

func parseValue(t *testing.T, name string, raw json.RawMessage) *jv {
	d := json.NewDecoder(bytes.NewReader(raw))
	d.UseNumber()
	var v any
	if err := d.Decode(&v); err != nil {
		t.Fatalf("%s: %v", name, err)
	}
	return &jv{t: t, path: name, v: v}
}

func TestGoldenVectors(t *testing.T) {
	vectors := loadVectors(t)
	seen := map[string]map[uint32]bool{"request": {}, "reply": {}, "outcome": {}, "error": {}}
	for _, v := range vectors {
		t.Run(v.Name, func(t *testing.T) {
			frame, err := hex.DecodeString(v.FrameHex)
			if err != nil {
				t.Fatal(err)
			}
			top := parseValue(t, v.Name, v.Value)
			id := top.get("id").u64()
			switch v.Direction {
			case "client":
				want := requestFromJSON(top.get("request"))
				top.close()
				seen["request"][want.tag] = true
				if want.limits != nil {
					seen["request"][observedTag(want.tag)] = true
				}
				if want.tag == reqReport || want.tag == reqRetry || want.tag == reqFinish {
					seen["outcome"][want.outcome.tag] = true
				}
				if got := appendRequest(nil, id, &want); !bytes.Equal(got, frame) {
					t.Fatalf("encode:\n got %x\nwant %x", got, frame)
				}
				gotID, got, err := decodeRequest(frame[4:])
				if err != nil {
					t.Fatalf("decode: %v", err)
				}
				if gotID != id || !reflect.DeepEqual(got, want) {
					t.Fatalf("decode: id %d %+v, want id %d %+v", gotID, got, id, want)
				}
			case "server":
				want := replyFromJSON(top.get("reply"))
				top.close()
				seen["reply"][want.tag] = true
				if want.err != nil {
					seen["error"][want.err.kind] = true
				}
				if got := appendReply(nil, id, &want); !bytes.Equal(got, frame) {
					t.Fatalf("encode:\n got %x\nwant %x", got, frame)
				}
				gotID, got, err := decodeReply(frame[4:], map[string]string{})
				if err != nil {
					t.Fatalf("decode: %v", err)
				}
				if gotID != id || !reflect.DeepEqual(got, want) {
					t.Fatalf("decode: id %d %+v, want id %d %+v", gotID, got, id, want)
				}
			default:
				t.Fatalf("direction %q", v.Direction)
			}
		})
	}
	// Every request, reply, outcome and error kind this binding knows is covered.
	for what, n := range map[string]int{"request": len(requestNames), "reply": len(replyNames), "outcome": len(outcomeNames), "error": len(errorKindNames)} {
		var missing []int
		for i := 0; i < n; i++ {
			if !seen[what][uint32(i)] {
				missing = append(missing, i)
			}
		}
		sort.Ints(missing)
		if len(missing) > 0 {
			t.Errorf("no vector for %s tags %v", what, missing)
		}
	}
}

// Every proper prefix of every vector's payload is truncated and must be refused,
// and so must every payload with a byte appended.
func TestDecodeRefusesTruncatedAndTrailing(t *testing.T) {
	for _, v := range loadVectors(t) {
		frame, _ := hex.DecodeString(v.FrameHex)
		payload := frame[4:]
		decode := func(p []byte) error {
			if v.Direction == "client" {
				_, _, err := decodeRequest(p)
				return err
			}
			_, _, err := decodeReply(p, nil)
			return err
		}
		for n := 0; n < len(payload); n++ {
			if decode(payload[:n]) == nil {
				t.Fatalf("%s: a %d-byte prefix of %d decoded", v.Name, n, len(payload))
			}
		}
		if err := decode(append(append([]byte(nil), payload...), 0)); err == nil {
			t.Fatalf("%s: trailing byte accepted", v.Name)
		}
	}
}

func mustHex(s string) []byte {
	b, err := hex.DecodeString(s)
	if err != nil {
		panic(err)
	}
	return b
}

func TestDecodeRefusesBadBytes(t *testing.T) {
	id := "0300000000000000"
	errHead := id + "07000000" + "05000000" + "0000000000000000" + "0000000000000000" // Error, InvalidArgument, "", 0.0
	cases := []struct {
		name, payload, want string
	}{
		{"unknown reply tag", id + "63000000", "unknown Reply tag 99"},
		{"unknown error kind", id + "07000000" + "11000000", "unknown ErrorKind tag 17"},
		{"bad bool", id + "03000000" + "02", "applied: byte 0x02"},
		{"bad option byte", errHead + "0000000000000000" + "02", "exhausted (Option): byte 0x02"},
		{"invalid utf-8", id + "09000000" + "0200000000000000" + "c328", "invalid UTF-8"},
		{"hostile string length", id + "09000000" + "0000000000000080", "exceeds"},
		{"hostile list length", errHead + "ffffffffffffff7f", "per_source_reasons length"},
	}
	for _, c := range cases {
		_, _, err := decodeReply(mustHex(c.payload), nil)
		if err == nil {
			t.Errorf("%s: decoded", c.name)
			continue
		}
		if !bytes.Contains([]byte(err.Error()), []byte(c.want)) {
			t.Errorf("%s: error %q does not mention %q", c.name, err, c.want)
		}
	}
	// Requests: an unknown tag and a bad FailureKind.
	if _, _, err := decodeRequest(mustHex(id + "10000000")); err == nil {
		t.Error("unknown request tag decoded")
	}
	if _, _, err := decodeRequest(mustHex(id + "03000000" + "0b00000000000000" + "01000000" + "05000000")); err == nil {
		t.Error("unknown FailureKind decoded")
	}
}

// The hot frames the client builds directly agree with the vectors' layout: a
// Start from CallOptions, a Finish from SuccessOptions.
func TestHotFramesFromTheAPI(t *testing.T) {
	opts := CallOptions{EstTokens: 1200, Priority: "interactive", EstInputTokens: 900, EstOutputTokens: 300}
	spec, err := opts.spec("chat")
	if err != nil {
		t.Fatal(err)
	}
	got := appendRequest(nil, 2, &request{tag: reqStart, spec: spec})
	want := "000000470200000000000000" + "0b000000" + "0400000000000000" + "63686174" + "01b004000000000000" + "01" + "0b00000000000000" + "696e746572616374697665" + "018403000000000000" + "012c01000000000000"
	if hex.EncodeToString(got) != want {
		t.Fatalf("Start:\n got %x\nwant %s", got, want)
	}
	u, split, err := (&Usage{InputTokens: 1200, OutputTokens: 334}).wire()
	if err != nil || !split {
		t.Fatal(err, split)
	}
	got = appendRequest(nil, 8, &request{tag: reqFinish, target: 1<<64 - 1, outcome: outcome{tag: outSuccessUsage, usage: u, countAttempt: true}})
	if hex.EncodeToString(got) != findVector(t, "finish_success_usage") {
		t.Fatalf("Finish: %x", got)
	}
}

func findVector(t *testing.T, name string) string {
	for _, v := range loadVectors(t) {
		if v.Name == name {
			return v.FrameHex
		}
	}
	t.Fatalf("no vector %s", name)
	return ""
}

func TestSnake(t *testing.T) {
	for in, want := range map[string]string{"AllSourcesExhausted": "all_sources_exhausted", "Ok": "ok", "HalfOpen": "half_open", "StatusJson": "status_json"} {
		if got := snake(in); got != want {
			t.Errorf("snake(%q) = %q, want %q", in, got, want)
		}
	}
}

func limitsFromJSON(j *jv) *obsLimits {
	l := &obsLimits{}
	for i, name := range []string{"requests", "tokens", "input_tokens", "output_tokens"} {
		d := j.get(name)
		if d.v == nil {
			continue
		}
		l.dims[i] = obsDim{some: true, limit: d.get("limit").optU64(), remaining: d.get("remaining").optU64(), reset: d.get("reset_s").optF64()}
		d.close()
	}
	l.age = j.get("age_s").f64()
	j.close()
	return l
}
