package api

import (
	"fmt"
	"net/http"

	"github.com/cagehq/cage/api/types"
	"github.com/cagehq/cage/internal/manager"
	"github.com/cagehq/cage/internal/network"
	"github.com/cagehq/cage/internal/proxy"
	"github.com/cagehq/cage/internal/store"
)

// allTraffic is E2B's "every address" selector.
const allTraffic = "0.0.0.0/0"

// policyOf maps E2B's network fields (create and update) to a policy.
// internet is allow_internet_access (nil: E2B's default, true). false, or
// 0.0.0.0/0 in denyOut, makes an allowlist of allowOut; otherwise the
// sandbox has the internet less denyOut, with allowOut overriding it.
// cage's mode overrides what the E2B fields imply. A request that sets an
// E2B feature cage does not have is refused rather than silently run
// without it.
func policyOf(internet *bool, n types.SandboxNetworkConfig) (network.Policy, error) {
	var p network.Policy
	for name, set := range map[string]bool{"maskRequestHost": n.MaskRequestHost != nil, "rules": n.Rules != nil,
		"egressProxy": n.EgressProxy != nil} {
		if set {
			return p, fmt.Errorf("%w: network.%s is not supported by cage", errBadRequest, name)
		}
	}
	var allowAll, denyAll bool
	for _, list := range []struct {
		field string
		in    []string
		all   *bool
		out   *[]network.Rule
	}{{"allowOut", n.AllowOut, &allowAll, &p.Allow}, {"denyOut", n.DenyOut, &denyAll, &p.Deny}} {
		for _, s := range list.in {
			r, err := network.ParseRule(s)
			if err != nil {
				return p, fmt.Errorf("%w: network.%s: %v", errBadRequest, list.field, err)
			}
			if r.Name == "" && r.Prefix.Bits() == 0 && r.Port == 0 {
				*list.all = true // 0.0.0.0/0 however spelt
				continue
			}
			*list.out = append(*list.out, r)
		}
	}
	switch {
	case allowAll:
		p.Mode, p.Allow, p.Deny = network.Internet, nil, nil
	case denyAll || (internet != nil && !*internet):
		p.Mode, p.Deny = network.Allowlist, nil
	default:
		p.Mode = network.Internet
	}
	if n.Mode != "" {
		m, err := network.ParseMode(string(n.Mode))
		if err != nil {
			return p, fmt.Errorf("%w: network.mode: %v", errBadRequest, err)
		}
		p.Mode = m
		if m == network.None {
			p.Allow, p.Deny = nil, nil
		}
	}
	if err := p.Validate(); err != nil {
		return p, fmt.Errorf("%w: %v", errBadRequest, err)
	}
	return p, nil
}

// maxHTTPSPorts bounds a sandbox's network.httpsPorts.
const maxHTTPSPorts = 64

// httpsPortsOf checks E2B's network.httpsPorts: ports 1-65535, unique, at
// most maxHTTPSPorts, never the agent's (it is cage's own plain HTTP).
func httpsPortsOf(ports []int) ([]int, error) {
	if len(ports) > maxHTTPSPorts {
		return nil, fmt.Errorf("%w: network.httpsPorts: at most %d ports", errBadRequest, maxHTTPSPorts)
	}
	seen := map[int]bool{}
	for _, p := range ports {
		switch {
		case p < 1 || p > 65535:
			return nil, fmt.Errorf("%w: network.httpsPorts: port %d is not 1-65535", errBadRequest, p)
		case p == proxy.EnvdPort:
			return nil, fmt.Errorf("%w: network.httpsPorts: port %d is the sandbox agent's, never TLS", errBadRequest, p)
		case seen[p]:
			return nil, fmt.Errorf("%w: network.httpsPorts: port %d is listed twice", errBadRequest, p)
		}
		seen[p] = true
	}
	if len(ports) == 0 {
		return nil, nil
	}
	return ports, nil
}

// networkOf is a record's network as E2B's detail shows it, and whether
// the sandbox has the whole internet.
func networkOf(rec *store.Sandbox) (types.SandboxNetworkConfig, bool) {
	p, err := manager.DecodePolicy(rec.Network)
	public := rec.PublicTraffic
	n := types.SandboxNetworkConfig{AllowPublicTraffic: &public, Mode: types.NetworkMode(p.Mode), HTTPSPorts: rec.HTTPSPorts}
	if err != nil {
		return n, false
	}
	for _, r := range p.Allow {
		n.AllowOut = append(n.AllowOut, r.String())
	}
	switch p.Mode {
	case network.Internet:
		for _, r := range p.Deny {
			n.DenyOut = append(n.DenyOut, r.String())
		}
	case network.Allowlist, network.None:
		n.DenyOut = []string{allTraffic}
	}
	return n, p.Mode == network.Internet
}

// updateNetwork is E2B's PUT /sandboxes/{id}/network: the new egress
// configuration replaces the old one whole.
func (s *server) updateNetwork(w http.ResponseWriter, r *http.Request) {
	var body types.SandboxNetworkUpdate
	if err := decode(r, &body, true); err != nil {
		s.fail(w, r, err)
		return
	}
	if body.AllowPublicTraffic != nil || body.HTTPSPorts != nil {
		s.fail(w, r, fmt.Errorf("%w: allowPublicTraffic and httpsPorts are set at create; they cannot change", errBadRequest))
		return
	}
	p, err := policyOf(body.AllowInternetAccess, types.SandboxNetworkConfig{
		AllowOut: body.AllowOut, DenyOut: body.DenyOut, Mode: body.Mode, MaskRequestHost: body.MaskRequestHost,
		Rules: body.Rules, EgressProxy: body.EgressProxy,
	})
	if err == nil {
		_, err = s.cfg.Manager.SetNetwork(keyID(r), r.PathValue("sandboxID"), p)
	}
	if err != nil {
		s.fail(w, r, err)
		return
	}
	w.WriteHeader(http.StatusNoContent)
}

// networkRecords lists a running sandbox's network records, newest first,
// a page at a time (cage's own route; the records stay in the records
// database afterwards, within its retention). The next page's cursor is in
// X-Next-Token and the body's nextToken; dropped counts the records not
// kept (over the sandbox's rate or cap).
func (s *server) networkRecords(w http.ResponseWriter, r *http.Request) {
	limit, err := atoiDefault(r.URL.Query().Get("limit"), defaultRecordsPage)
	if err != nil || limit < 1 || limit > manager.MaxRecordsPage {
		s.fail(w, r, fmt.Errorf("%w: limit must be 1 to %d records", errBadRequest, manager.MaxRecordsPage))
		return
	}
	page, err := s.cfg.Manager.NetRecords(keyID(r), r.PathValue("sandboxID"), limit, r.URL.Query().Get("nextToken"))
	if err != nil {
		s.fail(w, r, err)
		return
	}
	if page.Next != "" {
		w.Header().Set("X-Next-Token", page.Next)
	}
	out := types.NetworkRecords{Records: make([]types.NetworkRecord, 0, len(page.Records)), Dropped: page.Dropped,
		NextToken: page.Next}
	for _, x := range page.Records {
		out.Records = append(out.Records, types.NetworkRecord{Time: x.Time, Sandbox: x.Sandbox,
			Kind: types.NetworkRecordKind(x.Kind), Decision: types.NetworkRecordDecision(x.Decision), Proto: x.Proto,
			Dest: x.Dest, Name: x.Name, Qtype: x.QType, Detail: x.Detail})
	}
	writeJSON(w, http.StatusOK, out)
}

// defaultRecordsPage is a records page's size when the request names none.
const defaultRecordsPage = 100
