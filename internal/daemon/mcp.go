package daemon

import (
	"errors"
	"log/slog"
	"net"
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/cagehq/cage/internal/api"
	"github.com/cagehq/cage/internal/audit"
	"github.com/cagehq/cage/internal/client"
	"github.com/cagehq/cage/internal/mcp"
	"github.com/cagehq/cage/internal/store"
)

// withMCP serves MCP's streamable HTTP transport at /mcp beside the API:
// the same keys, checked before the body as the API checks them, and the
// same isolation, since each request's tools are a client of this
// daemon's own API and proxy with the request's key.
//
// Each request to /mcp goes into the audit trail as an API call (its
// client, the key's id or none, the status); the tools' own calls are the
// API's and the proxy's, recorded there.
//
// The tools' calls to the API and the proxy come from the loopback
// address, as every local client's do: they are dialled as the daemon's
// own (apiDial, proxyDial), held to each listener's bound on all
// connections only, so that many keys' tools at once neither fill the
// loopback address's bound for the operator's cage commands nor are
// refused by it.
func withMCP(apiHandler *api.Server, st *store.Store, trail *audit.Trail, apiAddr, proxyAddr net.Addr, apiDial, proxyDial dialFunc, log *slog.Logger) http.Handler {
	api, proxy := dialURL(apiAddr), dialURL(proxyAddr)
	apiTransport := &http.Transport{DialContext: apiDial, MaxIdleConnsPerHost: 16, IdleConnTimeout: 90 * time.Second}
	h := mcp.Handler(mcp.HTTPConfig{
		Log: log,
		Verify: func(key string) (string, error) {
			k, err := st.VerifyKey(key)
			switch {
			case errors.Is(err, store.ErrNotFound):
				return "", nil
			case err != nil:
				return "", err
			}
			return k.ID, nil
		},
		Record: func(r *http.Request, keyID string, status int) {
			client := r.RemoteAddr
			if h, _, err := net.SplitHostPort(client); err == nil {
				client = h
			}
			var team string
			if k, err := st.GetKey(keyID); keyID != "" && err == nil {
				team = k.TeamID // a team's key: the team reads the entry
			}
			trail.Record(audit.Event{Kind: audit.KindAPICall, KeyID: keyID, TeamID: team, Route: r.Method + " /mcp", Status: status, Client: client})
		},
		// A request to /mcp is one of the key's requests, as an API call
		// is: before (found by review, 2026-12-03), /mcp took none of
		// the key's rate, and a key could send requests without bound
		// (16 at a time), each a millisecond of the daemon's CPU where
		// its Host named a new proxy address.
		Admit: func(w http.ResponseWriter, r *http.Request, keyID string) bool {
			k, err := st.GetKey(keyID)
			if err != nil {
				log.Error("/mcp: read the key", "key", keyID, "err", err)
				http.Error(w, "internal error (the server's log has the detail)", http.StatusInternalServerError)
				return false
			}
			return apiHandler.AllowRequest(w, k)
		},
		Server: func(r *http.Request, key string) mcp.Config {
			c := client.New(api, proxy, key)
			c.HostSide = true
			c.Dial = proxyDial
			c.UseTransport(apiTransport)
			return mcp.Config{Client: c, ProxyURL: publicURL(proxyAddr, r)}
		},
	})
	mux := http.NewServeMux()
	mux.Handle("/mcp", h)
	mux.Handle("/", apiHandler)
	return mux
}

// dialURL is where this process reaches one of its listeners: loopback for
// a listener on every address.
func dialURL(a net.Addr) string {
	ta, ok := a.(*net.TCPAddr)
	if !ok {
		return "http://" + a.String()
	}
	ip := ta.IP
	if ip == nil || ip.IsUnspecified() {
		ip = net.IPv4(127, 0, 0, 1)
	}
	return "http://" + net.JoinHostPort(ip.String(), strconv.Itoa(ta.Port))
}

// publicURL is the proxy as the MCP client reaches it: its own address,
// or, for a listener on every address, the host the client reached the
// API by, on the proxy's port.
func publicURL(proxyAddr net.Addr, r *http.Request) string {
	ta, ok := proxyAddr.(*net.TCPAddr)
	if !ok || (ta.IP != nil && !ta.IP.IsUnspecified()) {
		return dialURL(proxyAddr)
	}
	host := r.Host
	if h, _, err := net.SplitHostPort(host); err == nil {
		host = h
	}
	host = strings.Trim(host, "[]")
	if host == "" {
		return dialURL(proxyAddr)
	}
	return "http://" + net.JoinHostPort(host, strconv.Itoa(ta.Port))
}
