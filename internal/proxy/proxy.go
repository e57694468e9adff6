// Package proxy is the daemon's sandbox-traffic listener: it forwards a
// request to the sandbox it names, routing by E2B's headers (E2b-Sandbox-Id,
// E2b-Sandbox-Port) or else by a Host of the form {port}-{sandboxID}.{domain},
// without buffering, so streams and WebSockets pass as they come.
//
// Port 49983 is the agent itself. The proxy checks the sandbox's access
// token (or, on /files, a signature made with it) before it forwards a byte:
// the agent runs inside the sandbox's memory limit, so a body sent by anyone
// who merely knows a sandbox's id must never reach it. Only GET /health
// passes without. Any other port is a server inside the sandbox, reached
// through the agent's port forward (agentclient.DialPort); unless the
// sandbox allows public traffic, such a request must carry the sandbox's
// traffic token in E2b-Traffic-Access-Token. Port 49999, the code
// interpreter, also takes the access token to run code (see
// interpUnauthorized), and never passes it on.
// A port the sandbox lists in its httpsPorts is reached over TLS
// (tlsport.go); the client side is unchanged.
//
// Each sandbox has one connection pool, whatever the number of its ports a
// client sweeps: ports are pool keys, not pools.
package proxy

import (
	"bufio"
	"context"
	"crypto/subtle"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	stdlog "log"
	"log/slog"
	"net"
	"net/http"
	"net/http/httputil"
	"net/netip"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/cagehq/cage/internal/agentclient"
	"github.com/cagehq/cage/internal/filesig"
	"github.com/cagehq/cage/internal/logbound"
	"github.com/cagehq/cage/internal/wall"
)

// EnvdPort is the port E2B's SDKs address the agent (envd) on.
const EnvdPort = 49983

// Sandboxes finds sandboxes by id.
type Sandboxes interface {
	// Lookup says how to authorize traffic to a sandbox; ok is false when
	// there is none to reach (a paused one is reachable only where traffic
	// resumes it).
	Lookup(id string) (a Access, ok bool)
	// Ready returns the running sandbox; where it is paused and resumes on
	// traffic, it resumes it first if mayResume. It is called only once
	// the request is authorized.
	Ready(ctx context.Context, id string, mayResume bool) (wall.Sandbox, error)
}

// Access is what authorizes traffic to one sandbox.
type Access struct {
	Token   string // the agent's access token
	Traffic string // the exposed ports' traffic token
	Public  bool   // exposed ports answer without the traffic token
	Owner   string // the API key the sandbox belongs to (for the audit trail)
	// HTTPSPorts are the ports whose servers speak TLS: the proxy reaches
	// them over TLS (tlsport.go).
	HTTPSPorts []int
}

// TrafficHeader carries the traffic token of a sandbox whose ports are not public.
const TrafficHeader = "E2b-Traffic-Access-Token"

// NodeAuthHeader is the node signature of cluster mode (internal/cluster
// signs and checks it): a node that forwards sandbox traffic to the
// sandbox's node signs it there, and no sandbox ever sees it.
const NodeAuthHeader = "X-Cage-Node-Auth"

// Proxy forwards sandbox traffic.
type Proxy struct {
	sandboxes Sandboxes
	domain    string
	log       *slog.Logger

	mu         sync.Mutex
	transports map[wall.Sandbox]*http.Transport
	inFlight   map[flightKey]int // requests being relayed, by sandbox and class
	anonymous  map[clientKey]int // anonymous ones, by sandbox and client (see enter)
	byKey      map[string]int    // credentialed ones, by the sandboxes' API key, all its sandboxes
	byClient   map[string]int    // anonymous ones, by client, all sandboxes
	warnLog    logbound.Limiter  // warnings logged (see warn; its own lock)
	relayLog   *stdlog.Logger    // the reverse proxy's (see relayLog)

	// Observe, when set, is given every authorized request before it is
	// forwarded (the audit trail): it may replace r.Body, and returns
	// what to call with the response (nil when the sandbox was not
	// reached) and once the request is over; or nils.
	Observe func(r *http.Request, sandbox, owner string, port int) (response func(*http.Response), done func())
	// Denied, when set, is told of each request refused for want of a
	// valid token.
	Denied func(r *http.Request, sandbox string, port, status int, why string)
	// Count, when set, is told of each request once answered: its port
	// (0: none routed), path, status and the bytes of its body and of the
	// answer (count.go; the daemon's metrics).
	Count func(port int, path string, status int, in, out int64)
	// Forward, when set (cluster mode), is given a request for a sandbox
	// this host does not have: it forwards it to the node that holds the
	// sandbox and reports whether it did (false: 502, as for any sandbox
	// that does not exist).
	Forward func(w http.ResponseWriter, r *http.Request, id string) bool
	// Client, when set, names the client a request comes from (its
	// share of a sandbox's anonymous budget: see enter); unset, or where
	// it returns "", the request's own address (ClientOf). Cluster mode
	// sets it: traffic a front forwarded here comes from the front's
	// address, and names its client in ClientHeader, under the front's
	// node signature.
	Client func(r *http.Request) string
}

// ClientHeader names the client of traffic another node of the cluster
// forwarded here (see Proxy.Client); it is believed only with that node's
// signature, and no sandbox sees it.
const ClientHeader = "X-Cage-Client"

// ClientOf names the client a request comes from by its address: an IPv4
// address, or an IPv6 address's /64 (one host's or one network's, which
// its holder may spread over 2^64 addresses); "" where there is none (a
// unix socket).
func ClientOf(r *http.Request) string {
	ap, err := netip.ParseAddrPort(r.RemoteAddr)
	if err != nil {
		return ""
	}
	a := ap.Addr().Unmap().WithZone("")
	if a.Is6() {
		if p, err := a.Prefix(64); err == nil {
			return p.String()
		}
	}
	return a.String()
}

// New returns a proxy; domain is the suffix of host-routed requests ("" to
// accept any; a port on it, as in cage.localhost:3001, is not compared).
func New(sandboxes Sandboxes, domain string, log *slog.Logger) *Proxy {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	p := &Proxy{sandboxes: sandboxes, domain: DomainHost(domain), log: log, transports: map[wall.Sandbox]*http.Transport{},
		inFlight: map[flightKey]int{}, anonymous: map[clientKey]int{}, byKey: map[string]int{}, byClient: map[string]int{}}
	p.relayLog = stdlog.New(relayLog{p}, "", 0)
	return p
}

// route returns the sandbox and port a request is for.
func (p *Proxy) route(r *http.Request) (id string, port int, ok bool) {
	if id = r.Header.Get("E2b-Sandbox-Id"); id != "" {
		port = EnvdPort
		if ps := r.Header.Get("E2b-Sandbox-Port"); ps != "" {
			if port, ok = parsePort(ps); !ok {
				return id, 0, false
			}
		}
		return id, port, true
	}
	host := r.Host
	if h, _, err := net.SplitHostPort(host); err == nil {
		host = h
	}
	label, rest, found := strings.Cut(host, ".")
	if !found || (p.domain != "" && rest != p.domain) {
		return "", 0, false
	}
	ps, id, found := strings.Cut(label, "-")
	n, ok := parsePort(ps)
	if !found || !ok || id == "" {
		return "", 0, false
	}
	return id, n, true
}

// parsePort reads a TCP port written the one way: 1 to 65535 in decimal,
// without sign or leading zeros.
func parsePort(s string) (int, bool) {
	if len(s) == 0 || len(s) > 5 || s[0] == '0' {
		return 0, false
	}
	n := 0
	for _, c := range s {
		if c < '0' || c > '9' {
			return 0, false
		}
		n = n*10 + int(c-'0')
	}
	return n, n <= 65535
}

func writeJSON(w http.ResponseWriter, status int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(v)
}

type sandboxError struct {
	SandboxID string `json:"sandboxId"`
	Message   string `json:"message"`
	Code      int    `json:"code"`
}

func (p *Proxy) serve(w http.ResponseWriter, r *http.Request) {
	// The proxy's own answers (refusals, errors) get answerWrite to reach
	// the client; what is relayed gets relayWrite for each write (see
	// progressWriter). Without a bound, a client that lets nothing be sent
	// (an HTTP/2 stream window of 0, a TCP one never read) held each of its
	// requests, refused or not, and its handler for good.
	rc := http.NewResponseController(w)
	_ = rc.SetWriteDeadline(time.Now().Add(answerWrite))
	// What the server writes once the handler is done (the end of a
	// chunked answer) is bounded too: a progressWriter leaves no deadline.
	defer func() { _ = rc.SetWriteDeadline(time.Now().Add(answerWrite)) }()
	id, port, ok := p.route(r)
	if !ok {
		writeJSON(w, http.StatusBadRequest, map[string]any{"code": 400,
			"message": "no sandbox named: send E2b-Sandbox-Id (and E2b-Sandbox-Port, 1-65535) or use a {port}-{sandboxID}.{domain} host"})
		return
	}
	access, ok := p.sandboxes.Lookup(id)
	if !ok && p.Forward != nil {
		// As for a relayed answer (below): each write is bounded, not
		// the wait for the owner node's answer.
		_ = rc.SetWriteDeadline(time.Time{})
		if p.Forward(&progressWriter{ResponseWriter: w, rc: rc, clear: true}, r, id) {
			return
		}
		_ = rc.SetWriteDeadline(time.Now().Add(answerWrite))
	}
	if !ok {
		writeJSON(w, http.StatusBadGateway, sandboxError{id, "The sandbox was not found", http.StatusBadGateway})
		return
	}
	if port == EnvdPort {
		if msg := envdUnauthorized(r, access.Token); msg != "" {
			p.denied(r, id, port, http.StatusUnauthorized, msg)
			writeUnauthorized(w, r, id, msg)
			return
		}
	} else {
		if !access.Public && (access.Traffic == "" || subtle.ConstantTimeCompare([]byte(r.Header.Get(TrafficHeader)), []byte(access.Traffic)) != 1) {
			p.denied(r, id, port, http.StatusForbidden, "missing or invalid traffic access token")
			writeJSON(w, http.StatusForbidden, sandboxError{id, "This sandbox's ports need its traffic access token (" + TrafficHeader + ")", http.StatusForbidden})
			return
		}
		if port == InterpPort {
			if msg := interpUnauthorized(r, access.Token); msg != "" {
				p.denied(r, id, port, http.StatusUnauthorized, msg)
				writeUnauthorized(w, r, id, msg)
				return
			}
		}
	}
	owner := credentialed(r, access, port)
	client := ""
	if !owner {
		if p.Client != nil {
			client = p.Client(r)
		}
		if client == "" {
			client = ClientOf(r)
		}
	}
	release, why := p.enter(flightKey{id, owner}, access.Owner, client)
	if why != "" {
		writeJSON(w, http.StatusTooManyRequests, sandboxError{id, why, http.StatusTooManyRequests})
		return
	}
	defer release()
	if port == EnvdPort && r.URL.Path == "/health" {
		// Open to anyone: nothing of a body reaches the agent, nor
		// anything after the request, whatever the agent answers (see
		// errUpgradeUnasked).
		r.Body, r.ContentLength, r.TransferEncoding = http.NoBody, 0, nil
		r.Header.Del("Upgrade")
		r.Header.Del("Connection")
	}
	upgradeAsked := r.Header.Get("Upgrade") != ""
	// Only a request that carries a credential wakes a paused sandbox (an
	// anonymous /health does not), as on E2B; public ports are anyone's.
	mayResume := port != EnvdPort || r.URL.Path == "/files" ||
		subtle.ConstantTimeCompare([]byte(r.Header.Get("X-Access-Token")), []byte(access.Token)) == 1
	sb, err := p.sandboxes.Ready(r.Context(), id, mayResume)
	if err != nil {
		writeJSON(w, http.StatusBadGateway, sandboxError{id, "The sandbox was not found", http.StatusBadGateway})
		return
	}
	var observed func(*http.Response)
	var done func()
	if p.Observe != nil {
		observed, done = p.Observe(r, id, access.Owner, port)
	}
	status := 0 // the sandbox's answer's (0: none came)
	pw := &progressWriter{ResponseWriter: w, rc: rc, clear: true}
	// An anonymous request through which no byte passes, either way, for
	// relayIdle is ended (see relayIdle): its round trip and the copy of
	// its answer are cancelled, and a read of its body waiting on the
	// client fails.
	var relay *idleWatch
	var idled atomic.Bool // relay fired
	if !owner {
		ctx, cancel := context.WithCancel(r.Context())
		defer cancel()
		r = r.WithContext(ctx)
		relay = newIdleWatch(relayIdle)
		defer relay.stop()
		relay.watch(closerFunc(func() error {
			idled.Store(true)
			cancel()
			return rc.SetReadDeadline(time.Now())
		}))
	}
	rp := &httputil.ReverseProxy{
		Rewrite: func(pr *httputil.ProxyRequest) {
			pr.Out.URL.Scheme, pr.Out.URL.Host = upstream(access, port, r.Host)
			if port == EnvdPort {
				pr.Out.Host = "agent"
			} else {
				pr.Out.Host = r.Host // the sandbox's server sees the host it was addressed by
			}
			pr.Out.Header.Del("E2b-Sandbox-Id")
			pr.Out.Header.Del("E2b-Sandbox-Port")
			pr.Out.Header.Del(TrafficHeader)
			pr.Out.Header.Del(NodeAuthHeader) // another node's, on traffic it forwarded here
			pr.Out.Header.Del(ClientHeader)   // the same
			dropUICookies(pr.Out.Header)
			if port == InterpPort {
				pr.Out.Header.Del("X-Access-Token") // checked here; code in the sandbox never sees it
			}
		},
		Transport:     p.transport(sb),
		FlushInterval: -1,
		ErrorLog:      p.relayLog,
		ModifyResponse: func(resp *http.Response) error {
			if resp.StatusCode < 100 || resp.StatusCode > 999 {
				return errBadStatus // net/http's WriteHeader panics on it
			}
			if resp.StatusCode == http.StatusSwitchingProtocols && !upgradeAsked {
				return errUpgradeUnasked
			}
			if resp.StatusCode == http.StatusSwitchingProtocols && !sameUpgrade(resp.Request.Header, resp.Header) {
				return errUpgradeOther // refused here, its connection closed (see the defer below)
			}
			status = resp.StatusCode
			if rwc, ok := resp.Body.(io.ReadWriteCloser); ok && resp.StatusCode == http.StatusSwitchingProtocols {
				// An upgrade: both ends are watched for idleness from
				// here (progressWriter.Hijack takes the client's).
				if relay != nil {
					relay.stop()
				}
				pw.watch = newIdleWatch(upgradeIdle)
				resp.Body = pw.watch.sandboxEnd(rwc)
			} else if relay != nil {
				relay.touch()
				resp.Body = &touchingBody{ReadCloser: resp.Body, w: relay}
			}
			if observed != nil {
				observed(resp)
			}
			return nil
		},
		ErrorHandler: func(w http.ResponseWriter, r *http.Request, err error) {
			if idled.Load() {
				w.Header().Set("Connection", "close") // its body, if any, is not read on
				writeJSON(w, http.StatusGatewayTimeout, sandboxError{id,
					"Nothing passed either way for " + relayIdle.String() + ": the request was ended", http.StatusGatewayTimeout})
				return
			}
			select {
			case <-sb.Exited():
				writeJSON(w, http.StatusBadGateway, sandboxError{id, "The sandbox was not found", http.StatusBadGateway})
			default:
				if errors.Is(err, errUpgradeUnasked) {
					writeJSON(w, http.StatusBadGateway, sandboxError{id, "The sandbox switched protocols where none was asked for", http.StatusBadGateway})
					return
				}
				if errors.Is(err, errUpgradeOther) {
					writeJSON(w, http.StatusBadGateway, sandboxError{id, "The sandbox switched to another protocol than the one asked for", http.StatusBadGateway})
					return
				}
				if errors.Is(err, errBadStatus) {
					writeJSON(w, http.StatusBadGateway, sandboxError{id, "The sandbox's answer was not HTTP (a status outside 100-999)", http.StatusBadGateway})
					return
				}
				if errors.Is(err, agentclient.ErrPortClosed) {
					writeJSON(w, http.StatusBadGateway, sandboxError{id, "The sandbox is running but port is not open", http.StatusBadGateway})
					return
				}
				if msg := tlsMismatch(err); msg != "" {
					writeJSON(w, http.StatusBadGateway, sandboxError{id, msg, http.StatusBadGateway})
					return
				}
				if r.Context().Err() == nil {
					p.warn(id, port, err)
				}
				writeJSON(w, http.StatusBadGateway, sandboxError{id, "The sandbox did not answer", http.StatusBadGateway})
			}
		},
	}
	// The agent answers (headers, then a stream's first event) before it has
	// read the request body; without full duplex, Go's HTTP/1 server closes
	// the unread body at the first flush, and the stream breaks.
	_ = http.NewResponseController(w).EnableFullDuplex()
	if done != nil {
		defer done() // also when the copy aborts the handler (a client gone mid-stream)
	}
	// A sandbox's server may refuse a request before it has read the body
	// (413 to 10 MB of code). The transport then closes the body, and Go's
	// server closes a connection with more than 256 KiB unread: the
	// client, still sending, meets a reset instead of the answer. So the
	// transport gets a body it cannot close, and after an error answer what
	// the client still sends is read and dropped (bounded) before the
	// connection is let go; after any other, it is closed as before.
	body := r.Body
	if body != nil && body != http.NoBody {
		r.Body = keepOpen{body}
		if relay != nil {
			r.Body = keepOpen{&touchingBody{ReadCloser: body, w: relay}}
		}
		defer func() {
			if status == 0 || status >= 400 {
				release() // the sandbox is done with it; the drain is the client's
				if !idled.Load() {
					drain(w, body)
				}
			}
			_ = body.Close()
		}()
	}
	// The relay's writes are bounded each (progressWriter), not the wait
	// for the sandbox's answer: HTTP/2 resets a stream when its deadline
	// passes, written or not.
	_ = rc.SetWriteDeadline(time.Time{})
	// Once the relay is over, what a switch of protocols opened is closed,
	// the sandbox's end too: net/http's reverse proxy refuses a switch to
	// another protocol than the one asked for without closing it, and
	// each such answer left a connection through the agent open for as
	// long as the sandbox lived (found by review, 2026-12-05).
	defer func() {
		if pw.watch != nil {
			pw.watch.end()
		}
	}()
	rp.ServeHTTP(pw, r)
}

// Write deadlines of the proxy's answers: its own, whole; a relayed one's,
// each write's (a stream or a WebSocket may stay idle as long as it likes,
// but each write must get through within relayWrite). Variables for the
// tests.
var (
	answerWrite = 10 * time.Second
	relayWrite  = 30 * time.Second
)

// relayIdle ends an anonymous request (one without the sandbox's
// credential: see flightKey) through which no byte has passed, either way,
// for this long: none of its body read from the client and none of its
// answer from the sandbox (the answer's head counts). A stream that sends
// (server-sent events, a download, a long poll's heartbeats) or an upload
// that makes progress, however slowly, is not cut. Before, a client could
// hold such a request, and its place in the sandbox's anonymous budget,
// for good: a body announced and never sent, to a server that waits for
// it. An upgraded connection has its own (upgradeIdle). A variable for
// the tests.
var relayIdle = 10 * time.Minute

// progressWriter gives each write of a relayed answer relayWrite to get
// through, and clears the deadline for a connection that is hijacked (an
// upgrade: the tunnel is bounded by its idle time instead, upgradeIdle).
//
// With clear, the deadline is cleared again once each write is through:
// HTTP/2 resets a stream when its write deadline passes, written or not,
// so a stream quiet for relayWrite was reset (found by review,
// 2026-12-04: a command silent for 30 s, an idle terminal of the
// dashboard, through cage's own h2c clients). Whoever uses clear bounds
// what the server writes after the handler (the end of a chunked answer)
// with a deadline of its own.
type progressWriter struct {
	http.ResponseWriter
	rc    *http.ResponseController
	watch *idleWatch // an upgrade's, once the sandbox has switched protocols
	clear bool
}

func (w *progressWriter) arm() { _ = w.rc.SetWriteDeadline(time.Now().Add(relayWrite)) }

func (w *progressWriter) disarm() {
	if w.clear {
		_ = w.rc.SetWriteDeadline(time.Time{})
	}
}

func (w *progressWriter) WriteHeader(code int) {
	w.arm()
	w.ResponseWriter.WriteHeader(code)
	w.disarm()
}

func (w *progressWriter) Write(b []byte) (int, error) {
	w.arm()
	defer w.disarm()
	return w.ResponseWriter.Write(b)
}

func (w *progressWriter) FlushError() error {
	w.arm()
	defer w.disarm()
	return w.rc.Flush()
}

func (w *progressWriter) Hijack() (net.Conn, *bufio.ReadWriter, error) {
	_ = w.rc.SetWriteDeadline(time.Time{})
	c, brw, err := w.rc.Hijack()
	if err == nil && w.watch != nil {
		c = w.watch.clientEnd(c)
	}
	return c, brw, err
}

func (w *progressWriter) Unwrap() http.ResponseWriter { return w.ResponseWriter }

// WriteProgress gives each write of h's answers relayWrite to get
// through (the daemon's API, dashboard and MCP listeners, whose answers
// may be large or streamed): a client that never reads holds a handler
// and what it built for at most that long after it stops reading.
func WriteProgress(h http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		rc := http.NewResponseController(w)
		// An HTTP/1 connection keeps the deadline an earlier request on
		// it left: this one starts with none.
		_ = rc.SetWriteDeadline(time.Time{})
		h.ServeHTTP(&progressWriter{ResponseWriter: w, rc: rc, clear: true}, r)
		// What the server writes after the handler (all of a small
		// answer, buffered until then) has its bound too.
		_ = rc.SetWriteDeadline(time.Now().Add(relayWrite))
	})
}

// uiCookies are the dashboard's session cookies (internal/ui). A browser
// sends them to the proxy's port of the dashboard's host too (cookies do
// not go by port), and a sandbox's page on the same site can make it send
// a request there for its own sandbox; no sandbox sees them.
var uiCookies = map[string]bool{"cage_ui": true, "__Host-cage_ui": true}

// dropUICookies takes the dashboard's cookies out of h's Cookie headers.
func dropUICookies(h http.Header) {
	lines := h.Values("Cookie")
	if len(lines) == 0 {
		return
	}
	var kept []string
	for _, line := range lines {
		for _, c := range strings.Split(line, ";") {
			c = strings.TrimSpace(c)
			name, _, _ := strings.Cut(c, "=")
			if c != "" && !uiCookies[strings.TrimSpace(name)] {
				kept = append(kept, c)
			}
		}
	}
	h.Del("Cookie")
	if len(kept) > 0 {
		h.Set("Cookie", strings.Join(kept, "; "))
	}
}

// keepOpen is a request body whose Close leaves it open (see drain).
type keepOpen struct{ io.ReadCloser }

func (keepOpen) Close() error { return nil }

// drainLimit and drainTime bound what drain reads of a body a sandbox did
// not read.
const (
	drainLimit = 32 << 20
	drainTime  = 10 * time.Second
)

// drain sends the answer written so far, then reads what is left of a
// request body: at most drainLimit bytes, for at most drainTime.
func drain(w http.ResponseWriter, body io.Reader) {
	rc := http.NewResponseController(w)
	_ = rc.SetWriteDeadline(time.Now().Add(answerWrite))
	_ = rc.Flush()
	_ = rc.SetReadDeadline(time.Now().Add(drainTime))
	_, _ = io.CopyN(io.Discard, body, drainLimit)
}

func (p *Proxy) denied(r *http.Request, id string, port, status int, why string) {
	if p.Denied != nil {
		p.Denied(r, id, port, status, why)
	}
}

// errBadStatus is a sandbox's answer whose status net/http's client takes
// (any three digits; any number over HTTP/2) and its server does not
// write (outside 100-999): passed on, WriteHeader panicked in the proxy's
// handler, cutting the client's connection and putting a goroutine's
// stack in the daemon's log for every such answer (found by review,
// 2026-12-04).
var errBadStatus = errors.New("the sandbox's answer has a status outside 100-999")

// errUpgradeUnasked is a sandbox's switch of protocols (101) on a request
// that asked for none, as the open /health never does (the proxy drops
// its Upgrade): relayed, anyone's /health became a tunnel to an agent
// that agreed, without the access token, into a sandbox whose ports need
// its traffic token (found by review, 2026-12-04).
var errUpgradeUnasked = errors.New("the sandbox switched protocols where none was asked for")

// errUpgradeOther is a sandbox's switch of protocols (101) to another
// protocol than the request asked for, or to none: net/http's reverse
// proxy refuses it too, but without closing the sandbox's end.
var errUpgradeOther = errors.New("the sandbox switched to another protocol than the one asked for")

// sameUpgrade says whether an answer's switch of protocols names the one
// its request asked for (net/http's reverse proxy's test: Connection has
// the token "upgrade", and the Upgrade values are equal, case aside).
func sameUpgrade(req, resp http.Header) bool {
	want, got := upgradeOf(req), upgradeOf(resp)
	return want != "" && strings.EqualFold(want, got)
}

// upgradeOf is the protocol h asks or switches to ("" for none).
func upgradeOf(h http.Header) string {
	for _, v := range h.Values("Connection") {
		for _, tok := range strings.Split(v, ",") {
			if strings.EqualFold(strings.TrimSpace(tok), "upgrade") {
				return h.Get("Upgrade")
			}
		}
	}
	return ""
}

// InterpPort is the port of the code interpreter (cage-interp) that
// @e2b/code-interpreter addresses.
const InterpPort = 49999

// interpUnauthorized says why a request for the code interpreter may not
// pass ("" when it may). The SDK sends the sandbox's access token
// (X-Access-Token) only on POST /execute, so running code takes it; the
// context routes it does not send it on (GET /health, GET and POST
// /contexts, POST /contexts/{id}/restart, DELETE /contexts/{id}) pass
// without, guarded only by the traffic token where the sandbox is not
// public. A token that is sent must be the right one, on any route.
func interpUnauthorized(r *http.Request, token string) string {
	got, sent := r.Header["X-Access-Token"]
	if sent {
		if token != "" && len(got) == 1 && subtle.ConstantTimeCompare([]byte(got[0]), []byte(token)) == 1 {
			return ""
		}
		return "invalid access token (X-Access-Token)"
	}
	if interpOpenRoute(r.Method, r.URL.Path) {
		return ""
	}
	return "running code needs the sandbox's access token (X-Access-Token)"
}

// interpOpenRoute says whether a route of the code interpreter is one the
// SDK calls without the access token.
func interpOpenRoute(method, path string) bool {
	switch {
	case path == "/health":
		return method == http.MethodGet || method == http.MethodHead
	case path == "/contexts":
		return method == http.MethodGet || method == http.MethodPost
	}
	rest, ok := strings.CutPrefix(path, "/contexts/")
	if !ok {
		return false
	}
	id, restart, hasSlash := strings.Cut(rest, "/")
	if id == "" || strings.ContainsAny(id, ".%") {
		return false
	}
	if hasSlash {
		return restart == "restart" && method == http.MethodPost
	}
	return method == http.MethodDelete
}

// envdUnauthorized says why a request for the agent may not pass ("" when
// it may): GET /health is open, /files takes the access token or a
// signature made with it, everything else the token.
func envdUnauthorized(r *http.Request, token string) string {
	if r.URL.Path == "/health" && (r.Method == http.MethodGet || r.Method == http.MethodHead) {
		return ""
	}
	if token == "" {
		// A record without a token (none is made so; a store written by
		// another version could hold one) matches an empty header and
		// signs with an empty key: nothing is let through on it.
		return "the sandbox has no access token"
	}
	if got := r.Header.Get("X-Access-Token"); got != "" || r.URL.Path != "/files" {
		if got != "" && subtle.ConstantTimeCompare([]byte(got), []byte(token)) == 1 {
			return ""
		}
		return "missing or invalid access token"
	}
	if err := filesig.Check(r.URL.Query(), filesig.Op(r.Method), token, time.Now()); err != nil {
		return err.Error()
	}
	return ""
}

// writeUnauthorized answers 401 as the agent would: a Connect error for its
// RPCs, E2B's {code, message} otherwise. The request's body is not read (Go's
// server drains at most 256 KiB of it to reuse the connection, then closes).
func writeUnauthorized(w http.ResponseWriter, r *http.Request, id, msg string) {
	if strings.HasPrefix(r.URL.Path, "/process.Process/") || strings.HasPrefix(r.URL.Path, "/filesystem.Filesystem/") {
		writeJSON(w, http.StatusUnauthorized, map[string]string{"code": "unauthenticated", "message": msg})
		return
	}
	writeJSON(w, http.StatusUnauthorized, map[string]any{"code": http.StatusUnauthorized, "message": msg})
}

// poolKey names a port of a sandbox in its connection pool, which keeps
// idle connections per URL host.
func poolKey(port int) string { return "port-" + strconv.Itoa(port) }

// portOf reads the port back from a dial address "port-N:80".
func portOf(addr string) (int, error) {
	host, _, err := net.SplitHostPort(addr)
	if err != nil {
		return 0, err
	}
	n, err := strconv.Atoi(strings.TrimPrefix(host, "port-"))
	if err != nil || n < 1 || n > 65535 {
		return 0, fmt.Errorf("proxy: bad pool key %q", addr)
	}
	return n, nil
}

// transport returns the connection pool of a sandbox: connections to its
// agent (EnvdPort) and to servers inside reached through the agent's port
// forward, pooled by port, bounded in idle connections whatever the
// number of ports.
func (p *Proxy) transport(sb wall.Sandbox) *http.Transport {
	p.mu.Lock()
	defer p.mu.Unlock()
	if t, ok := p.transports[sb]; ok {
		return t
	}
	dial := func(ctx context.Context, _, addr string) (net.Conn, error) {
		port, err := portOf(addr)
		if err != nil {
			return nil, err
		}
		if port == EnvdPort {
			return sb.Dial(ctx)
		}
		return agentclient.DialPort(ctx, sb.Dial, sb.Token(), port)
	}
	t := &http.Transport{DialContext: dial, DialTLSContext: dialTLS(sb), MaxIdleConns: maxIdlePerSandbox,
		MaxIdleConnsPerHost: 16, IdleConnTimeout: 90 * time.Second, MaxResponseHeaderBytes: maxAnswerHead}
	p.transports[sb] = t
	go func() {
		<-sb.Exited()
		p.mu.Lock()
		delete(p.transports, sb)
		p.mu.Unlock()
		t.CloseIdleConnections()
	}()
	return t
}

// maxIdlePerSandbox bounds the idle connections the proxy keeps to one
// sandbox, all its ports together.
const maxIdlePerSandbox = 64

// maxAnswerHead bounds the head of a sandbox's answer (net/http's default
// is 10 MiB, which a sandbox's server could send to every request while
// its client does not read).
const maxAnswerHead = 64 << 10

// maxInFlightPerSandbox bounds the requests the proxy relays to one
// sandbox at once, of each class (see flightKey; open WebSockets and
// streams included): each holds a
// connection through the agent, its buffers and goroutines, and HTTP/2
// lets one client connection carry hundreds. Beyond it: 429. (A
// variable for the tests, which hold a smaller number open.)
var maxInFlightPerSandbox = 1024

// flightKey counts a sandbox's requests in flight: those that carry its
// own credential (its access token, its traffic token) apart from the
// rest (anyone's, to a public port or the open /health, or with a signed
// /files URL), so that anonymous clients, however many, never fill the
// owner's budget.
type flightKey struct {
	id    string
	owner bool
}

// credentialed says whether r, checked already, carries the sandbox's own
// credential for port.
func credentialed(r *http.Request, a Access, port int) bool {
	token := r.Header.Get("X-Access-Token")
	tokenOK := token != "" && subtle.ConstantTimeCompare([]byte(token), []byte(a.Token)) == 1
	switch port {
	case EnvdPort, InterpPort:
		// A signed /files URL (past envdUnauthorized, a /files request
		// without a token had a valid one) is anyone's who has the link:
		// E2B's way to let a browser move one file. Counted as the
		// owner's, one link's holder took the sandbox's whole budget,
		// with no share per client and no idle time (found by review,
		// 2026-12-04).
		return tokenOK
	}
	traffic := r.Header.Get(TrafficHeader)
	return traffic != "" && subtle.ConstantTimeCompare([]byte(traffic), []byte(a.Traffic)) == 1
}

// maxAnonymousPerClient bounds the anonymous requests (see flightKey) one
// client (ClientOf: an IPv4 address, an IPv6 /64) has in flight to one
// sandbox at once: an eighth of the sandbox's anonymous budget, so that
// one address cannot take all of it (found by review, 2026-12-03: 1024
// requests from one address, each holding its body back a byte at a
// time, made the sandbox's public ports answer 429 to everyone else; the
// listener's conns_per_client, 4096, and HTTP/2's streams left that
// open). A variable for the tests.
var maxAnonymousPerClient = 128

// clientKey counts a sandbox's anonymous requests by client.
type clientKey struct{ id, client string }

// maxInFlightPerKey bounds the credentialed requests (see flightKey) in
// flight to all the sandboxes of one API key together, and
// maxAnonymousPerClientAll the anonymous ones of one client (ClientOf)
// to all sandboxes together. Each costs the daemon some 48 KiB (its
// handler, its connection through the agent, their buffers), outside any
// sandbox's limits and its team's quotas; the per-sandbox bounds alone
// let a key hold 1,024 for each of its sandboxes (48 MiB a sandbox, six
// times what max_sandboxes sizes one at), and an anonymous client 128 for
// each public sandbox whose server holds requests (found by review,
// 2026-12-04). Variables for the tests.
var (
	maxInFlightPerKey        = 8192
	maxAnonymousPerClientAll = 1024
)

// enter counts a request in, unless its sandbox has maxInFlightPerSandbox
// of its class already; for a credentialed one, its sandbox's key
// maxInFlightPerKey; for an anonymous one, its client
// maxAnonymousPerClient to this sandbox or maxAnonymousPerClientAll to
// all; why says which (else ""). release (which may be called more than
// once) counts it out.
func (p *Proxy) enter(k flightKey, key, client string) (release func(), why string) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.inFlight[k] >= maxInFlightPerSandbox {
		return nil, "Too many requests to this sandbox at once (" + strconv.Itoa(maxInFlightPerSandbox) + ")"
	}
	ck := clientKey{k.id, client}
	if k.owner && p.byKey[key] >= maxInFlightPerKey {
		return nil, "Too many requests to this API key's sandboxes at once (" + strconv.Itoa(maxInFlightPerKey) + ")"
	}
	if !k.owner && p.anonymous[ck] >= maxAnonymousPerClient {
		return nil, "Too many requests to this sandbox at once from one client without its token (" +
			strconv.Itoa(maxAnonymousPerClient) + ")"
	}
	if !k.owner && p.byClient[client] >= maxAnonymousPerClientAll {
		return nil, "Too many requests to sandboxes at once from one client without their tokens (" +
			strconv.Itoa(maxAnonymousPerClientAll) + ")"
	}
	p.inFlight[k]++
	if k.owner {
		p.byKey[key]++
	} else {
		p.anonymous[ck]++
		p.byClient[client]++
	}
	var once sync.Once
	return func() { once.Do(func() { p.leave(k, key, ck) }) }, ""
}

// warn logs a request the sandbox did not answer: at most one a second,
// with how many were not logged since (anyone may send requests to a
// public port whose server fails, each of which would be a line).
func (p *Proxy) warn(id string, port int, err error) {
	if skipped, ok := p.mayWarn(); ok {
		p.log.Warn("proxy to sandbox", "sandbox", id, "port", port, "err", err, "not_logged_before", skipped)
	}
}

// mayWarn says whether a warning may be logged now (one a second, all
// warnings together), and how many were not since the last.
func (p *Proxy) mayWarn() (skipped int, ok bool) {
	ok, skipped = p.warnLog.Allow("")
	return skipped, ok
}

// relayLog is the reverse proxy's logger: net/http writes a line there for
// each relayed answer that breaks off (a body shorter than its
// Content-Length, a server that closed mid-answer), a sandbox's doing, so
// its lines are warnings under warn's bound. Without it they went to the
// standard logger, a line for each request (found by review, 2026-12-04).
type relayLog struct{ p *Proxy }

func (l relayLog) Write(b []byte) (int, error) {
	if skipped, ok := l.p.mayWarn(); ok {
		l.p.log.Warn("proxy: relaying a sandbox's answer", "err", strings.TrimSpace(string(b)), "not_logged_before", skipped)
	}
	return len(b), nil
}

func (p *Proxy) leave(k flightKey, key string, ck clientKey) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.inFlight[k]--; p.inFlight[k] <= 0 {
		delete(p.inFlight, k)
	}
	if k.owner {
		if p.byKey[key]--; p.byKey[key] <= 0 {
			delete(p.byKey, key)
		}
		return
	}
	if p.anonymous[ck]--; p.anonymous[ck] <= 0 {
		delete(p.anonymous, ck)
	}
	if p.byClient[ck.client]--; p.byClient[ck.client] <= 0 {
		delete(p.byClient, ck.client)
	}
}
