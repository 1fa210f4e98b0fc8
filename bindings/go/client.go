package polygate

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"strings"
	"sync"
	"time"
	"unicode/utf8"
)

// ClientVersion is this package's version, sent in Hello as "polygate-go/<version>".
const ClientVersion = "0.2.0"

const (
	// SocketEnv names the environment variable Dial reads when given no path.
	SocketEnv = "POLYGATE_SOCKET"
	// DefaultSocket is root's default socket: the path Dial uses, for uid 0,
	// when neither an argument nor $POLYGATE_SOCKET gives one (see
	// DefaultSocketFor for any other user).
	DefaultSocket = "/run/polygate/sidecar.sock"
	// UserSocket is a non-root user's default socket, under $XDG_RUNTIME_DIR.
	UserSocket = "polygate/sidecar.sock"
)

// DefaultSocketFor is the sidecar's default socket for uid, by the sidecar's
// own rule (DESIGN §12): root DefaultSocket, anyone else
// $XDG_RUNTIME_DIR/polygate/sidecar.sock, given xdgRuntimeDir. A non-root uid
// without an absolute xdgRuntimeDir is a *SidecarError naming what to set.
func DefaultSocketFor(uid int, xdgRuntimeDir string) (string, error) {
	if uid == 0 {
		return DefaultSocket, nil
	}
	if strings.HasPrefix(xdgRuntimeDir, "/") {
		return strings.TrimRight(xdgRuntimeDir, "/") + "/" + UserSocket, nil
	}
	return "", &SidecarError{
		Kind: "connection",
		Message: fmt.Sprintf("no default PolyGate socket for uid %d: XDG_RUNTIME_DIR is not set "+
			"(or not an absolute path); set $%s or pass the path to Dial (the root default %s "+
			"is for uid 0)", uid, SocketEnv, DefaultSocket),
	}
}

// DefaultSocketPath is DefaultSocketFor this process: its effective uid and
// $XDG_RUNTIME_DIR.
func DefaultSocketPath() (string, error) {
	return DefaultSocketFor(os.Geteuid(), os.Getenv("XDG_RUNTIME_DIR"))
}

// maxCount is the largest token count the sidecar accepts (PROTOCOL.md §7, limits).
const maxCount = 1_000_000_000

// Client is a connection to the PolyGate sidecar, safe for use by any number of
// goroutines: they all share one Unix-socket connection, multiplexed by request
// id. If the connection is lost, requests waiting on it fail with a
// *SidecarError of Kind "connection" and the next use dials again (calls and
// permits of the old connection are gone; the sidecar released them).
type Client struct {
	path string
	name string

	// autostart: every dial that finds no sidecar starts one (DESIGN §20), not only
	// the first.
	autostart bool

	mu     sync.Mutex
	cur    *conn
	closed bool
	// dialMu makes concurrent users that find no connection dial once.
	dialMu sync.Mutex
}

// Options configures DialOptions.
type Options struct {
	// ClientName is sent in Hello and shows in the sidecar's logs; default
	// "polygate-go/<ClientVersion>".
	ClientName string
	// Autostart: when nothing answers on the socket, start a sidecar for it
	// first ($POLYGATE_SIDECAR or polygate-sidecar on PATH; DESIGN §20), and
	// again at any reconnect that finds none (it exited after idle_exit, or was
	// killed). Off unless set here or by POLYGATE_AUTOSTART=1.
	Autostart bool
}

// Dial connects to the sidecar at path and performs the handshake; ctx bounds
// both (not the connection's life). path "" means $POLYGATE_SOCKET, else
// DefaultSocketPath (root: DefaultSocket; anyone else:
// $XDG_RUNTIME_DIR/polygate/sidecar.sock).
func Dial(ctx context.Context, path string) (*Client, error) {
	return DialOptions(ctx, path, Options{})
}

// DialOptions is Dial with options.
func DialOptions(ctx context.Context, path string, o Options) (*Client, error) {
	if path == "" {
		path = os.Getenv(SocketEnv)
	}
	if path == "" {
		p, err := DefaultSocketPath()
		if err != nil {
			return nil, err
		}
		path = p
	}
	name := o.ClientName
	if name == "" {
		name = "polygate-go/" + ClientVersion
	}
	if !utf8.ValidString(name) {
		return nil, invalidArgument("ClientName %q is not valid UTF-8", name)
	}
	c := &Client{path: path, name: name, autostart: autostartWanted(o.Autostart)}
	if _, err := c.conn(ctx); err != nil {
		return nil, err
	}
	return c, nil
}

// Path is the socket path the client connects to.
func (c *Client) Path() string { return c.path }

// conn returns the live connection, dialling a new one if there is none.
func (c *Client) conn(ctx context.Context) (*conn, error) {
	c.mu.Lock()
	cur, closed := c.cur, c.closed
	c.mu.Unlock()
	if closed {
		return nil, c.closedErr()
	}
	if cur != nil && !cur.dead.Load() {
		return cur, nil
	}
	c.dialMu.Lock()
	defer c.dialMu.Unlock()
	c.mu.Lock()
	cur, closed = c.cur, c.closed
	c.mu.Unlock()
	if closed {
		return nil, c.closedErr()
	}
	if cur != nil && !cur.dead.Load() {
		return cur, nil
	}
	nc, err := dialAutostart(ctx, c.path, c.name, c.autostart)
	if err != nil {
		return nil, err
	}
	c.mu.Lock()
	if c.closed {
		c.mu.Unlock()
		nc.close()
		return nil, c.closedErr()
	}
	c.cur = nc
	c.mu.Unlock()
	return nc, nil
}

func (c *Client) closedErr() error {
	return &SidecarError{Kind: "connection", Message: fmt.Sprintf("the client of %s is closed", c.path)}
}

// Close closes the connection. Requests still waiting fail with a *SidecarError;
// everything the connection held (waits, permits, calls) is released by the
// sidecar at once. Close is idempotent.
func (c *Client) Close() error {
	c.mu.Lock()
	cur := c.cur
	c.closed, c.cur = true, nil
	c.mu.Unlock()
	if cur != nil {
		cur.close()
	}
	return nil
}

// do runs one request that is not part of a call's lifecycle on the live
// connection and returns its reply, or the error the reply carries.
func (c *Client) do(ctx context.Context, r *request, cancellable bool, want uint32) (reply, error) {
	cn, err := c.conn(ctx)
	if err != nil {
		return reply{}, err
	}
	flags := 0
	if cancellable {
		flags = rtCancellable
	}
	rep, err := cn.roundTrip(ctx, r, flags, 0)
	if err != nil {
		return reply{}, err
	}
	return rep, expect(&rep, want)
}

// expect returns nil if rep is a want, the error it carries if it is an Error, and
// a protocol *SidecarError for anything else.
func expect(rep *reply, want uint32) error {
	switch rep.tag {
	case want:
		return nil
	case repError:
		return errorFromReply(rep.err)
	case repTenantLimited:
		return tenantLimitError(rep.err, rep.tenant, rep.limit)
	}
	return &SidecarError{Kind: "protocol", Message: fmt.Sprintf("the sidecar answered %s where %s was expected", nameOf(replyNames[:], rep.tag), nameOf(replyNames[:], want))}
}

// Ping checks the sidecar answers.
func (c *Client) Ping(ctx context.Context) error {
	_, err := c.do(ctx, &request{tag: reqPing}, false, repPong)
	return err
}

// Status returns the live state of every scope and source (the sidecar's
// StatusJson document, PROTOCOL.md §14.4).
func (c *Client) Status(ctx context.Context) (*Status, error) {
	rep, err := c.do(ctx, &request{tag: reqStatusJSON}, true, repStatusJSON)
	if err != nil {
		return nil, err
	}
	return parseStatus([]byte(rep.text))
}

func checkSource(source string) error {
	if source == "" {
		return invalidArgument("source must not be empty")
	}
	if !utf8.ValidString(source) {
		return invalidArgument("source %q is not valid UTF-8", source)
	}
	return nil
}

// ForceOpen opens the source's breaker for d on every host sharing the backend.
// It needs the caller's uid in the sidecar's admin_uids (else a *SidecarError of
// Kind "permission_denied").
func (c *Client) ForceOpen(ctx context.Context, source string, d time.Duration) error {
	if err := checkSource(source); err != nil {
		return err
	}
	if d <= 0 {
		return invalidArgument("ForceOpen of %q needs a duration > 0, got %v", source, d)
	}
	_, err := c.do(ctx, &request{tag: reqForceOpen, source: source, seconds: d.Seconds()}, false, repOk)
	return err
}

// ForceClose closes the source's breaker now (admin).
func (c *Client) ForceClose(ctx context.Context, source string) error {
	if err := checkSource(source); err != nil {
		return err
	}
	_, err := c.do(ctx, &request{tag: reqForceClose, source: source}, false, repOk)
	return err
}

// Reset forgets all breaker and quota state of the source (admin).
func (c *Client) Reset(ctx context.Context, source string) error {
	if err := checkSource(source); err != nil {
		return err
	}
	_, err := c.do(ctx, &request{tag: reqReset, source: source}, false, repOk)
	return err
}

// CallOptions are a call's estimates and priority class. A zero count means "not
// given"; every count is at most 1,000,000,000.
type CallOptions struct {
	// EstTokens is the per-attempt token estimate for the scope's token quotas;
	// 0 = the sum of the split below if given, else the source's default.
	EstTokens int
	// Priority names a priority class of the scope (DESIGN §15); "" = the scope's
	// default. A scope without classes refuses any name.
	Priority string
	// EstInputTokens estimates the prompt, for input-token limits.
	EstInputTokens int
	// EstOutputTokens estimates the answer, normally the request's max_tokens.
	EstOutputTokens int
	// Tenant is the tenant the call is made for (DESIGN §19): at most
	// MaxTenantBytes (128) bytes of UTF-8; "" = the scope's anonymous tenant (a
	// plain Start). It needs a sidecar that speaks protocol 3: with an older one
	// the call fails before anything is sent.
	Tenant string
	// Classify, used by Run only, decides what an error returned by the attempt
	// function means; a zero Verdict falls back to the built-in rules (see
	// Classify the function). Nil = the built-in rules.
	Classify func(err error) Verdict
}

func countField(name string, v int) (optU64, error) {
	switch {
	case v < 0:
		return optU64{}, invalidArgument("%s must not be negative, got %d", name, v)
	case v > maxCount:
		return optU64{}, invalidArgument("%s %d exceeds the limit of %d", name, v, maxCount)
	case v == 0:
		return optU64{}, nil
	}
	return some(uint64(v)), nil
}

// spec validates a call's options into a wire CallSpec.
func (o *CallOptions) spec(scope string) (callSpec, error) {
	s := callSpec{scope: scope}
	if scope == "" {
		return s, invalidArgument("scope must not be empty")
	}
	if !utf8.ValidString(scope) {
		return s, invalidArgument("scope %q is not valid UTF-8", scope)
	}
	var err error
	if s.estTokens, err = countField("EstTokens", o.EstTokens); err != nil {
		return s, err
	}
	if s.estInput, err = countField("EstInputTokens", o.EstInputTokens); err != nil {
		return s, err
	}
	if s.estOutput, err = countField("EstOutputTokens", o.EstOutputTokens); err != nil {
		return s, err
	}
	if sum := o.EstInputTokens + o.EstOutputTokens; sum > maxCount {
		return s, invalidArgument("EstInputTokens + EstOutputTokens = %d exceeds the limit of %d", sum, maxCount)
	}
	if o.Priority != "" {
		if !utf8.ValidString(o.Priority) {
			return s, invalidArgument("Priority %q is not valid UTF-8", o.Priority)
		}
		s.priority = optStr{o.Priority, true}
	}
	return s, nil
}

// checkTenant validates a tenant id where it is given.
func checkTenant(tenant string) error {
	if !utf8.ValidString(tenant) {
		return invalidArgument("tenant %q is not valid UTF-8", tenant)
	}
	if len(tenant) > MaxTenantBytes {
		short := tenant[:32]
		for !utf8.ValidString(short) {
			short = short[:len(short)-1]
		}
		return invalidArgument("tenant id %q... is %d bytes of UTF-8; the limit is %d bytes", short, len(tenant), MaxTenantBytes)
	}
	return nil
}

// tenantsUnsupported is the error of a tenant call (or TenantStatus) on a
// connection older than version 3: it is refused here, never sent without its
// tenant (PROTOCOL.md §15).
func tenantsUnsupported(what string, version uint32, scope string) *SidecarError {
	return &SidecarError{Kind: "protocol_violation", Scope: scope, Message: fmt.Sprintf(
		"%s: the sidecar speaks protocol %d; tenants need %d: upgrade polygate-sidecar", what, version, tenantVersion)}
}

// TenantStatus returns one tenant's ledger (DESIGN §19) as the sidecar's JSON
// document, decoded: {"tenant": ..., "scopes": {NAME: {...}}} — per scope with
// tenants (only scope, if not ""), its limits, bucket levels, spend in the
// current day and month, calls in flight and waiting. tenant "" is the
// anonymous tenant. It needs a sidecar that speaks protocol 3.
func (c *Client) TenantStatus(ctx context.Context, tenant, scope string) (map[string]any, error) {
	if err := checkTenant(tenant); err != nil {
		return nil, err
	}
	r := request{tag: reqTenantStatus, tenant: tenant}
	if scope != "" {
		if !utf8.ValidString(scope) {
			return nil, invalidArgument("scope %q is not valid UTF-8", scope)
		}
		r.scope = optStr{scope, true}
	}
	cn, err := c.conn(ctx)
	if err != nil {
		return nil, err
	}
	if cn.version < tenantVersion {
		return nil, tenantsUnsupported(fmt.Sprintf("TenantStatus(%q)", tenant), cn.version, scope)
	}
	rep, err := cn.roundTrip(ctx, &r, rtCancellable, 0)
	if err == nil {
		err = expect(&rep, repStatusJSON)
	}
	if err != nil {
		return nil, err
	}
	var doc map[string]any
	if err := json.Unmarshal([]byte(rep.text), &doc); err != nil {
		return nil, &SidecarError{Kind: "protocol", Message: "the sidecar's tenant status is not a JSON object", Err: err}
	}
	return doc, nil
}

// Begin opens a call in scope. Nothing is sent yet: the first Acquire starts the
// call and acquires its first permit in one round trip. Always End the call
// (defer call.End(context.Background())) — End releases whatever the call still
// holds and sends a held report. ctx bounds connecting, if the client has no live
// connection.
func (c *Client) Begin(ctx context.Context, scope string, opts CallOptions) (*Call, error) {
	spec, err := opts.spec(scope)
	if err == nil {
		err = checkTenant(opts.Tenant)
	}
	if err != nil {
		err.(*SidecarError).Scope = scope
		return nil, err
	}
	if _, err := c.conn(ctx); err != nil {
		return nil, err
	}
	return &Call{client: c, spec: spec, tenant: opts.Tenant}, nil
}

// optSeconds converts a Retry-After to the wire's seconds, refusing what no
// sidecar accepts.
func optSeconds(d time.Duration) (optF64, error) {
	switch {
	case d < 0:
		return optF64{}, invalidArgument("retryAfter must not be negative, got %v", d)
	case d == 0:
		return optF64{}, nil
	}
	return optF64{d.Seconds(), true}, nil
}
