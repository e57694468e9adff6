// Package proxy is the daemon's sandbox-traffic listener: it forwards a
// request to the sandbox it names, routing by E2B's headers (E2b-Sandbox-Id,
// E2b-Sandbox-Port) or else by a Host of the form {port}-{sandboxID}.{domain},
// without buffering, so streams and WebSockets pass as they come.
//
// Port 49983 is the agent itself, which checks the sandbox's access token.
// Any other port is a server inside the sandbox, reached through the agent's
// port forward (agentclient.DialPort); unless the sandbox allows public
// traffic, such a request must carry the sandbox's traffic token in
// E2b-Traffic-Access-Token.
package proxy

import (
	"context"
	"crypto/subtle"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"net/http/httputil"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/cagehq/cage/internal/agentclient"
	"github.com/cagehq/cage/internal/wall"
)

// EnvdPort is the port E2B's SDKs address the agent (envd) on.
const EnvdPort = 49983

// Sandboxes finds a running sandbox by id.
type Sandboxes interface {
	Sandbox(id string) (wall.Sandbox, bool)
	// Traffic is the sandbox's traffic token and whether its ports are
	// public (answer without it).
	Traffic(id string) (token string, public, ok bool)
}

// TrafficHeader carries the traffic token of a sandbox whose ports are not public.
const TrafficHeader = "E2b-Traffic-Access-Token"

// Proxy forwards sandbox traffic.
type Proxy struct {
	sandboxes Sandboxes
	domain    string
	log       *slog.Logger

	mu         sync.Mutex
	transports map[target]*http.Transport
}

// target is one port of one sandbox.
type target struct {
	sb   wall.Sandbox
	port int
}

// New returns a proxy; domain is the suffix of host-routed requests ("" to
// accept any).
func New(sandboxes Sandboxes, domain string, log *slog.Logger) *Proxy {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	p := &Proxy{sandboxes: sandboxes, domain: domain, log: log, transports: map[target]*http.Transport{}}
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
	if port < 1 || port > 65535 {
		writeJSON(w, http.StatusBadRequest, sandboxError{id, fmt.Sprintf("port %d is not a TCP port", port), http.StatusBadRequest})
		return
	}
	if port != EnvdPort {
		token, public, ok := p.sandboxes.Traffic(id)
		if !ok {
			writeJSON(w, http.StatusBadGateway, sandboxError{id, "The sandbox was not found", http.StatusBadGateway})
			return
		}
		if !public && subtle.ConstantTimeCompare([]byte(r.Header.Get(TrafficHeader)), []byte(token)) != 1 {
			writeJSON(w, http.StatusForbidden, sandboxError{id, "This sandbox's ports need its traffic access token (" + TrafficHeader + ")", http.StatusForbidden})
			return
		}
	}
	rp := &httputil.ReverseProxy{
		Rewrite: func(pr *httputil.ProxyRequest) {
			pr.Out.URL.Scheme = "http"
			pr.Out.URL.Host = "agent"
			if port == EnvdPort {
				pr.Out.Host = "agent"
			} else {
				pr.Out.Host = r.Host // the sandbox's server sees the host it was addressed by
			}
			pr.Out.Header.Del("E2b-Sandbox-Id")
			pr.Out.Header.Del("E2b-Sandbox-Port")
			pr.Out.Header.Del(TrafficHeader)
		},
		Transport:     p.transport(sb, port),
		FlushInterval: -1,
		ErrorHandler: func(w http.ResponseWriter, r *http.Request, err error) {
			select {
			case <-sb.Exited():
				writeJSON(w, http.StatusBadGateway, sandboxError{id, "The sandbox was not found", http.StatusBadGateway})
			default:
				if errors.Is(err, agentclient.ErrPortClosed) {
					writeJSON(w, http.StatusBadGateway, sandboxError{id, "The sandbox is running but port is not open", http.StatusBadGateway})
					return
				}
				if r.Context().Err() == nil {
					p.log.Warn("proxy to sandbox", "sandbox", id, "port", port, "err", err)
				}
				writeJSON(w, http.StatusBadGateway, sandboxError{id, "The sandbox did not answer", http.StatusBadGateway})
			}
		},
	}
	// The agent answers (headers, then a stream's first event) before it has
	// read the request body; without full duplex, Go's HTTP/1 server closes
	// the unread body at the first flush, and the stream breaks.
	_ = http.NewResponseController(w).EnableFullDuplex()
	rp.ServeHTTP(w, r)
}

// transport returns the connection pool to a port of a sandbox: its agent
// (EnvdPort), or a server inside reached through the agent's port forward.
func (p *Proxy) transport(sb wall.Sandbox, port int) *http.Transport {
	key := target{sb, port}
	p.mu.Lock()
	defer p.mu.Unlock()
	if t, ok := p.transports[key]; ok {
		return t
	}
	dial := func(ctx context.Context, _, _ string) (net.Conn, error) { return sb.Dial(ctx) }
	if port != EnvdPort {
		dial = func(ctx context.Context, _, _ string) (net.Conn, error) {
			return agentclient.DialPort(ctx, sb.Dial, sb.Token(), port)
		}
	}
	t := &http.Transport{DialContext: dial, MaxIdleConnsPerHost: 16, IdleConnTimeout: 90 * time.Second}
	p.transports[key] = t
	go func() {
		<-sb.Exited()
		p.mu.Lock()
		delete(p.transports, key)
		p.mu.Unlock()
		t.CloseIdleConnections()
	}()
	return t
}
