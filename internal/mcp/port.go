package mcp

import (
	"context"
	"fmt"
	"net"
	"net/url"
	"strconv"

	sdk "github.com/modelcontextprotocol/go-sdk/mcp"
)

type portIn struct {
	SandboxID string `json:"sandbox_id" jsonschema:"the sandbox, as sandbox_create or sandbox_list gave it"`
	Port      int    `json:"port" jsonschema:"the port a server listens on inside the sandbox"`
}

var portSchema = lazySchema[portIn](func(p props) { p.sandboxID().rng("port", 1, 65535) })

type portOut struct {
	URL     string            `json:"url" jsonschema:"the server's URL: {port}-{sandbox_id}.{domain} through cage's proxy"`
	Host    string            `json:"host"`
	Proxy   string            `json:"proxy" jsonschema:"cage's proxy; a client that cannot resolve host sends its requests here with the headers"`
	Headers map[string]string `json:"headers" jsonschema:"headers that route a request sent to proxy to the port (and authorize it where the sandbox's ports are not public)"`
	Public  bool              `json:"public" jsonschema:"whether the port answers anyone who has the URL; else requests need the E2b-Traffic-Access-Token header"`
	Note    string            `json:"note,omitempty"`
}

func (t *tools) portURL(ctx context.Context, _ *sdk.CallToolRequest, in portIn) (*sdk.CallToolResult, portOut, error) {
	if err := checkID(in.SandboxID); err != nil {
		return nil, portOut{}, err
	}
	if in.Port < 1 || in.Port > 65535 {
		return nil, portOut{}, fmt.Errorf("port %d: want 1 to 65535", in.Port)
	}
	d, err := t.c.Get(ctx, in.SandboxID)
	if err != nil {
		return nil, portOut{}, t.failure(err)
	}
	proxy, err := url.Parse(t.proxyURL)
	if err != nil || proxy.Host == "" {
		return nil, portOut{}, fmt.Errorf("the proxy's address %q is not a URL", t.proxyURL)
	}
	port := strconv.Itoa(in.Port)
	out := portOut{Proxy: proxy.Scheme + "://" + proxy.Host, Public: true,
		Headers: map[string]string{"E2b-Sandbox-Id": d.SandboxID, "E2b-Sandbox-Port": port}}
	if n := d.Network.AllowPublicTraffic; n != nil && !*n {
		out.Public = false
		if tok := d.TrafficAccessToken; tok != nil {
			out.Headers["E2b-Traffic-Access-Token"] = *tok
		}
	}
	domain := ""
	if d.Domain != nil {
		domain = *d.Domain
	}
	proxyHost, proxyPort := proxy.Hostname(), proxy.Port()
	if domain == "" {
		// No domain: *.localhost reaches a proxy on loopback from browsers,
		// curl and systemd-resolved; elsewhere only the headers route.
		if ip := net.ParseIP(proxyHost); proxyHost == "localhost" || (ip != nil && ip.IsLoopback()) {
			domain = "localhost"
			out.Note = "the daemon has no domain: this URL works where *.localhost resolves to loopback (browsers, curl); elsewhere send requests to proxy with headers"
		} else {
			out.Note = "the daemon has no domain (cage serve --domain), so no host name routes here: send requests to proxy with headers"
			out.URL = out.Proxy + "/"
			return nil, out, nil
		}
	}
	out.Host = port + "-" + d.SandboxID + "." + domain
	hostPort := out.Host
	if proxyPort != "" && !(proxy.Scheme == "http" && proxyPort == "80") && !(proxy.Scheme == "https" && proxyPort == "443") {
		hostPort = net.JoinHostPort(out.Host, proxyPort)
	}
	out.URL = proxy.Scheme + "://" + hostPort + "/"
	if !out.Public {
		out.Note = "the sandbox's ports are not public: send the E2b-Traffic-Access-Token header with every request"
	}
	return nil, out, nil
}
