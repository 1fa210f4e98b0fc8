package polygate

// One connection to the sidecar, multiplexed by every goroutine of a Client
// (PROTOCOL.md §7): requests carry ids from a per-connection counter, one reader
// goroutine dispatches replies by id, and writes are coalesced — the goroutine that
// finds the output idle becomes the flusher and writes everything queued meanwhile
// in one Write, so N concurrent callers cost far fewer than N syscalls.

import (
	"bufio"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"regexp"
	"strconv"
	"sync"
	"sync/atomic"
	"time"
)

// abandonAction says what the reader does with the reply of a request whose
// caller gave up (its ctx ended) before the reply arrived.
type abandonAction uint8

const (
	// abandonNone: the caller is still waiting.
	abandonNone abandonAction = iota
	// abandonDiscard: drop the reply (Cancel, Ping, admin, reports, status).
	abandonDiscard
	// abandonRelease: the request acquired a permit (Start, Retry, Acquire): a late
	// grant is returned with Finish{Cancelled}, which also ends its call; a late
	// error ends the call p.endCall if it is set (a version-1 Acquire leaves its
	// call alive).
	abandonRelease
)

// pending is one request waiting for its reply. Pooled: a pending whose caller
// gave up is left to the garbage collector instead.
type pending struct {
	ch      chan result
	abandon abandonAction // guarded by conn.mu
	endCall uint64        // abandonRelease: the call to end after a late error (0: none)
}

type result struct {
	r   reply
	err error
}

var pendingPool = sync.Pool{New: func() any { return &pending{ch: make(chan result, 1)} }}

// discarded is the map entry of fire-and-forget requests.
var discarded = &pending{abandon: abandonDiscard}

type conn struct {
	nc   net.Conn
	path string
	// maxFrame is the sidecar's max_frame from Welcome: the outgoing limit.
	maxFrame int
	// sidecarVersion is Welcome.sidecar_version, for messages.
	sidecarVersion string
	// version is the protocol version of the connection (Welcome's): 3, or 2 with
	// an older sidecar, where a tenant call is refused before it is sent.
	version uint32

	nextID atomic.Uint64
	// dead is set once, by kill; read without the lock on the hot path.
	dead atomic.Bool

	mu      sync.Mutex
	pending map[uint64]*pending
	// deadErr is why the connection ended (set with dead).
	deadErr error

	wmu sync.Mutex
	// wbuf holds frames queued while a flusher is writing.
	wbuf []byte
	// spare is the buffer handed back by the last Write, reused for wbuf.
	spare    []byte
	flushing bool

	// done is closed when the reader goroutine has exited.
	done chan struct{}
}

// connectError describes a failed connect, naming the path and a hint.
func connectError(path string, err error) *SidecarError {
	hint := ""
	if errors.Is(err, os.ErrNotExist) {
		hint = " (is polygate-sidecar running? set $" + SocketEnv + " or pass the path to Dial)"
	} else if len(path) > sunPathMax {
		hint = fmt.Sprintf(" (the path is %d bytes, longer than the %d bytes a Unix socket path may have (sun_path): use a shorter one)",
			len(path), sunPathMax)
	} else if errors.Is(err, os.ErrPermission) {
		hint = " (this user may not open the socket: ask the sidecar's operator to admit it " +
			"(socket_mode, the socket directory's group), or set $" + SocketEnv +
			" or pass the path of a sidecar of this user to Dial)"
	}
	return &SidecarError{
		Kind:    "connection",
		Message: fmt.Sprintf("cannot connect to the PolyGate sidecar at %s%s", path, hint),
		Err:     err,
	}
}

// versionFallback is a refusal of Hello 3 by an older sidecar that speaks version
// (2): it closed the connection; dial again saying version.
type versionFallback struct {
	version uint32
	said    string
}

func (e *versionFallback) Error() string { return e.said }

// dial connects to path and performs the handshake (PROTOCOL.md §6, §15): Hello
// with protocol version 3, then Welcome; a sidecar that refuses 3 naming versions
// up to 2 gets a second connection saying 2. ctx bounds all of it.
func dial(ctx context.Context, path, clientName string) (*conn, error) {
	c, err := dialVersion(ctx, path, clientName, protocolVersion)
	var fb *versionFallback
	if errors.As(err, &fb) {
		return dialVersion(ctx, path, clientName, fb.version)
	}
	return c, err
}

func dialVersion(ctx context.Context, path, clientName string, version uint32) (*conn, error) {
	var d net.Dialer
	nc, err := d.DialContext(ctx, "unix", path)
	if err != nil {
		if ctx.Err() != nil {
			return nil, ctx.Err()
		}
		return nil, connectError(path, err)
	}
	c := &conn{nc: nc, path: path, maxFrame: defaultMaxFrame, pending: make(map[uint64]*pending), done: make(chan struct{})}
	if err := c.handshake(ctx, clientName, version); err != nil {
		nc.Close()
		return nil, err
	}
	go c.readLoop(bufio.NewReaderSize(nc, 64<<10))
	return c, nil
}

func (c *conn) handshake(ctx context.Context, clientName string, version uint32) error {
	stop := context.AfterFunc(ctx, func() { c.nc.SetDeadline(time.Unix(1, 0)) })
	defer stop()
	hello := request{tag: reqHello, version: version, clientName: clientName, pid: uint32(os.Getpid())}
	if _, err := c.nc.Write(appendRequest(nil, 0, &hello)); err != nil {
		return c.handshakeIOError(ctx, err)
	}
	payload, err := readFrame(c.nc, nil)
	if err != nil {
		return c.handshakeIOError(ctx, err)
	}
	if !stop() {
		return ctx.Err()
	}
	_, r, err := decodeReply(payload, nil)
	if err != nil {
		return &SidecarError{Kind: "protocol", Message: fmt.Sprintf("the sidecar at %s answered Hello with a frame this client cannot decode", c.path), Err: err}
	}
	switch {
	case r.tag == repWelcome && r.version >= fallbackVersion && r.version <= version:
		if r.maxFrame >= 1024 {
			c.maxFrame = int(r.maxFrame)
		}
		c.sidecarVersion, c.version = r.sidecarVersion, r.version
		return nil
	case r.tag == repWelcome:
		return versionError(c.path, fmt.Sprint(r.version), "")
	case r.tag == repError && r.err.kind == kindProtocolViolation:
		// Our first frame is a Hello, sent at once: the only violation left is the
		// version.
		theirs := spokenVersion(r.err.message)
		if n, err := strconv.Atoi(theirs); version > fallbackVersion && (err != nil || n >= fallbackVersion) {
			return &versionFallback{version: fallbackVersion, said: r.err.message}
		}
		return versionError(c.path, theirs, r.err.message)
	case r.tag == repError:
		e := errorFromReply(r.err)
		if se, ok := e.(*SidecarError); ok {
			se.Message = fmt.Sprintf("the sidecar at %s refused the connection: %s", c.path, se.Message)
		}
		return e
	}
	return &SidecarError{Kind: "protocol", Message: fmt.Sprintf("the sidecar at %s answered Hello with %s, not Welcome", c.path, nameOf(replyNames[:], r.tag))}
}

func (c *conn) handshakeIOError(ctx context.Context, err error) error {
	if ctx.Err() != nil {
		return ctx.Err()
	}
	return &SidecarError{Kind: "connection", Message: fmt.Sprintf("the sidecar at %s closed the connection during the handshake", c.path), Err: err}
}

// spokenVersion pulls the sidecar's highest version out of its refusal ("... this
// sidecar speaks versions 1 to 2", "... speaks version 1", "... speaks 1"); a
// refusal that names none is taken for a version-1 sidecar's.
func spokenVersion(message string) string {
	if m := spokenRE.FindStringSubmatch(message); m != nil {
		if m[2] != "" {
			return m[2]
		}
		return m[1]
	}
	return "1"
}

var spokenRE = regexp.MustCompile(`speaks (?:versions? )?(\d{1,9})(?: to (\d{1,9}))?\W*$`)

func versionError(path, theirs, said string) *SidecarError {
	msg := fmt.Sprintf("the sidecar at %s speaks protocol version %s, this client (polygate-go %s) needs version %d: upgrade polygate-sidecar",
		path, theirs, ClientVersion, fallbackVersion)
	if said != "" {
		msg += " (the sidecar said: " + said + ")"
	}
	return &SidecarError{Kind: "protocol_violation", Message: msg}
}

// readFrame reads one frame and returns its payload, reusing buf.
func readFrame(r io.Reader, buf []byte) ([]byte, error) {
	var hdr [4]byte
	if _, err := io.ReadFull(r, hdr[:]); err != nil {
		return nil, err
	}
	n := binary.BigEndian.Uint32(hdr[:])
	if n > maxIncomingFrame {
		return nil, fmt.Errorf("a frame of %d bytes exceeds this client's limit of %d bytes", n, maxIncomingFrame)
	}
	if n < 8 {
		return nil, fmt.Errorf("a frame of %d bytes is too short for its id", n)
	}
	if cap(buf) < int(n) {
		buf = make([]byte, n)
	}
	buf = buf[:n]
	if _, err := io.ReadFull(r, buf); err != nil {
		if err == io.EOF {
			err = io.ErrUnexpectedEOF
		}
		return nil, err
	}
	return buf, nil
}

func (c *conn) readLoop(br *bufio.Reader) {
	defer close(c.done)
	intern := make(map[string]string)
	buf := make([]byte, 0, 4096)
	for {
		payload, err := readFrame(br, buf)
		if err != nil {
			c.kill(err)
			return
		}
		id, r, err := decodeReply(payload, intern)
		if err != nil {
			c.kill(&SidecarError{Kind: "protocol", Message: fmt.Sprintf("the sidecar at %s (version %s) sent a frame this client cannot decode; is polygate-go older than the sidecar?", c.path, c.sidecarVersion), Err: err})
			return
		}
		if cap(payload) > 1<<20 {
			buf = make([]byte, 0, 4096) // do not keep a large status buffer
		} else {
			buf = payload[:0]
		}
		c.dispatch(id, r)
	}
}

func (c *conn) dispatch(id uint64, r reply) {
	c.mu.Lock()
	p, ok := c.pending[id]
	var ab abandonAction
	if ok {
		delete(c.pending, id)
		ab = p.abandon
	}
	c.mu.Unlock()
	switch {
	case !ok:
		// An Error with id 0 that answers nothing concerns the connection: the
		// sidecar closes it next (PROTOCOL.md §7). Anything else is a reply to a
		// request we never sent; ignore it.
		if id == 0 && r.tag == repError {
			c.kill(errorFromReply(r.err))
		}
	case ab == abandonNone:
		p.ch <- result{r: r}
	case ab == abandonRelease:
		switch {
		case r.tag == repStarted || r.tag == repGranted:
			fin := request{tag: reqFinish, target: r.grant.permit, outcome: outcome{tag: outCancelled}}
			go c.fireAndForget(&fin)
		case (r.tag == repError || r.tag == repTenantLimited) && p.endCall != 0:
			end := request{tag: reqEndCall, target: p.endCall}
			go c.fireAndForget(&end)
		}
	}
}

// fireAndForget sends r and drops its reply.
func (c *conn) fireAndForget(r *request) {
	id := c.nextID.Add(1)
	c.mu.Lock()
	if c.pending == nil {
		c.mu.Unlock()
		return
	}
	c.pending[id] = discarded
	c.mu.Unlock()
	if err := c.send(id, r); err != nil {
		c.forget(id)
	}
}

func (c *conn) forget(id uint64) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	if _, ok := c.pending[id]; ok {
		delete(c.pending, id)
		return true
	}
	return false
}

// kill ends the connection once: every pending request fails with a
// *SidecarError saying why, and the socket is closed.
func (c *conn) kill(cause error) {
	c.mu.Lock()
	if c.pending == nil {
		c.mu.Unlock()
		return
	}
	err := c.closedError(cause)
	c.deadErr = err
	c.dead.Store(true)
	pend := c.pending
	c.pending = nil
	c.mu.Unlock()
	c.nc.Close()
	for _, p := range pend {
		if p.abandon == abandonNone {
			p.ch <- result{err: err}
		}
	}
}

// closedError turns the reason a connection ended into the error its pending
// requests see.
func (c *conn) closedError(cause error) error {
	var se *SidecarError
	var gu *GatewayUnavailableError
	switch {
	case errors.As(cause, &se):
		if se.Kind == "protocol" || se.Kind == "connection" {
			return se
		}
		// a connection-level error reply (overloaded, malformed, ...)
		return &SidecarError{Kind: se.Kind, Message: fmt.Sprintf("the sidecar at %s closed the connection: %s", c.path, se.Message)}
	case errors.As(cause, &gu):
		return &SidecarError{Kind: gu.Kind, Message: fmt.Sprintf("the sidecar at %s closed the connection: %s", c.path, gu.Message)}
	case errors.Is(cause, io.EOF):
		return &SidecarError{Kind: "connection", Message: fmt.Sprintf("the sidecar at %s closed the connection", c.path)}
	case errors.Is(cause, net.ErrClosed) || errors.Is(cause, errClientClosed):
		return &SidecarError{Kind: "connection", Message: fmt.Sprintf("the client closed its connection to %s", c.path)}
	}
	return &SidecarError{Kind: "connection", Message: fmt.Sprintf("lost the connection to the sidecar at %s", c.path), Err: cause}
}

var errClientClosed = errors.New("client closed")

// send queues the frame of r under id and, unless another goroutine is already
// writing, writes everything queued. A nil error means the frame was queued: a
// write failure of another goroutine's batch kills the connection, which fails the
// pending request instead.
func (c *conn) send(id uint64, r *request) error {
	c.wmu.Lock()
	start := len(c.wbuf)
	c.wbuf = appendRequest(c.wbuf, id, r)
	if size := len(c.wbuf) - start - 4; size > c.maxFrame {
		c.wbuf = c.wbuf[:start]
		c.wmu.Unlock()
		return invalidArgument("a %s request of %d bytes exceeds the sidecar's max_frame of %d bytes", nameOf(requestNames[:], r.tag), size, c.maxFrame)
	}
	if c.flushing {
		c.wmu.Unlock()
		return nil
	}
	c.flushing = true
	for len(c.wbuf) > 0 {
		buf := c.wbuf
		c.wbuf = c.spare[:0]
		c.spare = nil
		c.wmu.Unlock()
		_, err := c.nc.Write(buf)
		c.wmu.Lock()
		if cap(buf) <= 1<<20 {
			c.spare = buf[:0]
		}
		if err != nil {
			c.wbuf = c.wbuf[:0]
			c.flushing = false
			c.wmu.Unlock()
			c.kill(err)
			return nil
		}
	}
	c.flushing = false
	c.wmu.Unlock()
	return nil
}

// Flags of roundTrip.
const (
	// rtCancellable: if ctx ends first, send Cancel for the request (the sidecar
	// ends a waiting Start, Acquire, Retry or Status at once).
	rtCancellable = 1 << iota
	// rtRelease: the request acquires a permit; if its caller gives up, the reader
	// releases a late grant (abandonRelease). Without it, a late reply is dropped.
	rtRelease
	// rtAlways: send the request even if ctx is already done (reports and End must
	// reach the sidecar; ctx only bounds the wait for the answer).
	rtAlways
)

// roundTrip sends r and waits for its reply. If ctx ends first, the request is
// left to the reader (see the flags) and ctx.Err() is returned. A lost connection
// returns a *SidecarError. endCall, with rtRelease, is the call to end if a late
// reply is an error (a version-1 Acquire's error leaves its call alive).
func (c *conn) roundTrip(ctx context.Context, r *request, flags int, endCall uint64) (reply, error) {
	if flags&rtAlways == 0 {
		if err := ctx.Err(); err != nil {
			return reply{}, err
		}
	}
	p := pendingPool.Get().(*pending)
	p.abandon, p.endCall = abandonNone, 0
	id := c.nextID.Add(1)
	c.mu.Lock()
	if c.pending == nil {
		err := c.deadErr
		c.mu.Unlock()
		pendingPool.Put(p)
		return reply{}, err
	}
	c.pending[id] = p
	c.mu.Unlock()
	if err := c.send(id, r); err != nil {
		if !c.forget(id) {
			<-p.ch // killed meanwhile: drain what kill delivered
		}
		pendingPool.Put(p)
		return reply{}, err
	}
	select {
	case res := <-p.ch:
		pendingPool.Put(p)
		return res.r, res.err
	case <-ctx.Done():
	}
	c.mu.Lock()
	if _, ok := c.pending[id]; ok {
		p.abandon = abandonDiscard
		if flags&rtRelease != 0 {
			p.abandon, p.endCall = abandonRelease, endCall
		}
		c.mu.Unlock()
		if flags&rtCancellable != 0 {
			c.fireAndForget(&request{tag: reqCancel, target: id})
		}
		return reply{}, ctx.Err()
	}
	c.mu.Unlock()
	// The reply (or the connection's end) was dispatched just now: take it.
	res := <-p.ch
	pendingPool.Put(p)
	return res.r, res.err
}

// close closes the connection from this side.
func (c *conn) close() {
	c.kill(errClientClosed)
	<-c.done
}
