// Package proxy is the daemon's sandbox-traffic listener: it forwards a
// request to the sandbox it names, routing by E2B's headers (E2b-Sandbox-Id,
// E2b-Sandbox-Port) or else by a Host of the form {port}-{sandboxID}.{domain},
// without buffering, so streams pass as they come. The agent checks the
// sandbox's access token itself; the proxy only finds the sandbox.
package proxy

import (
	"context"
	"encoding/json"
	"log/slog"
	"net"
	"net/http"
	"net/http/httputil"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/cagehq/cage/internal/wall"
)

// EnvdPort is the port E2B's SDKs address the agent (envd) on.
const EnvdPort = 49983

// Sandboxes finds a running sandbox by id.
type Sandboxes interface {
	Sandbox(id string) (wall.Sandbox, bool)
}

// Proxy forwards sandbox traffic.
type Proxy struct {
	sandboxes Sandboxes
	domain    string
	log       *slog.Logger

	mu         sync.Mutex
	transports map[wall.Sandbox]*http.Transport
}

// New returns a proxy; domain is the suffix of host-routed requests ("" to
// accept any).
func New(sandboxes Sandboxes, domain string, log *slog.Logger) *Proxy {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	p := &Proxy{sandboxes: sandboxes, domain: domain, log: log, transports: map[wall.Sandbox]*http.Transport{}}
	return p
}

// route returns the sandbox and port a request is for.
func (p *Proxy) route(r *http.Request) (id string, port int, ok bool) {
	if id = r.Header.Get("E2b-Sandbox-Id"); id != "" {
		port = EnvdPort
		if ps := r.Header.Get("E2b-Sandbox-Port"); ps != "" {
			n, err := strconv.Atoi(ps)
			if err != nil {
				return id, 0, false
			}
			port = n
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
	n, err := strconv.Atoi(ps)
	if !found || err != nil || id == "" {
		return "", 0, false
	}
	return id, n, true
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

func (p *Proxy) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	id, port, ok := p.route(r)
	if !ok {
		writeJSON(w, http.StatusBadRequest, map[string]any{"code": 400,
			"message": "no sandbox named: send E2b-Sandbox-Id (and E2b-Sandbox-Port) or use a {port}-{sandboxID}.{domain} host"})
		return
	}
	sb, ok := p.sandboxes.Sandbox(id)
	if !ok {
		writeJSON(w, http.StatusBadGateway, sandboxError{id, "The sandbox was not found", http.StatusBadGateway})
		return
	}
	if port != EnvdPort {
		writeJSON(w, http.StatusBadGateway, sandboxError{id, "The sandbox is running but port is not open", http.StatusBadGateway})
		return
	}
	rp := &httputil.ReverseProxy{
		Rewrite: func(pr *httputil.ProxyRequest) {
			pr.Out.URL.Scheme = "http"
			pr.Out.URL.Host = "agent"
			pr.Out.Host = "agent"
			pr.Out.Header.Del("E2b-Sandbox-Id")
			pr.Out.Header.Del("E2b-Sandbox-Port")
		},
		Transport:     p.transport(sb),
		FlushInterval: -1,
		ErrorHandler: func(w http.ResponseWriter, r *http.Request, err error) {
			select {
			case <-sb.Exited():
				writeJSON(w, http.StatusBadGateway, sandboxError{id, "The sandbox was not found", http.StatusBadGateway})
			default:
				if r.Context().Err() == nil {
					p.log.Warn("proxy to agent", "sandbox", id, "err", err)
				}
				writeJSON(w, http.StatusBadGateway, sandboxError{id, "The sandbox's agent did not answer", http.StatusBadGateway})
			}
		},
	}
	// The agent answers (headers, then a stream's first event) before it has
	// read the request body; without full duplex, Go's HTTP/1 server closes
	// the unread body at the first flush, and the stream breaks.
	_ = http.NewResponseController(w).EnableFullDuplex()
	rp.ServeHTTP(w, r)
}

// transport returns the connection pool to a sandbox's agent.
func (p *Proxy) transport(sb wall.Sandbox) *http.Transport {
	p.mu.Lock()
	defer p.mu.Unlock()
	if t, ok := p.transports[sb]; ok {
		return t
	}
	t := &http.Transport{
		DialContext:         func(ctx context.Context, _, _ string) (net.Conn, error) { return sb.Dial(ctx) },
		MaxIdleConnsPerHost: 16,
		IdleConnTimeout:     90 * time.Second,
	}
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
