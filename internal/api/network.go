package api

import (
	"encoding/json"
	"fmt"
	"net/http"

	"github.com/cagehq/cage/internal/manager"
	"github.com/cagehq/cage/internal/network"
	"github.com/cagehq/cage/internal/store"
)

// networkJSON is E2B's network configuration (create, update and detail),
// with cage's mode. E2B's fields map onto cage's policy: allow_internet_access
// false, or 0.0.0.0/0 in denyOut, makes an allowlist of allowOut; otherwise
// the sandbox has the internet less denyOut, with allowOut overriding it.
type networkJSON struct {
	AllowOut           []string `json:"allowOut,omitempty"`
	DenyOut            []string `json:"denyOut,omitempty"`
	AllowPublicTraffic *bool    `json:"allowPublicTraffic,omitempty"`
	// Mode is cage's: none (no interface at all), internet or allowlist. It
	// overrides what the E2B fields imply.
	Mode string `json:"mode,omitempty"`
	// E2B features cage does not have; a request that sets one is refused
	// rather than silently run without it.
	MaskRequestHost *string          `json:"maskRequestHost,omitempty"`
	Rules           *json.RawMessage `json:"rules,omitempty"`
	EgressProxy     *json.RawMessage `json:"egressProxy,omitempty"`
	HTTPSPorts      *json.RawMessage `json:"httpsPorts,omitempty"`
}

// allTraffic is E2B's "every address" selector.
const allTraffic = "0.0.0.0/0"

// policyOf maps E2B's fields to a policy. internet is allow_internet_access
// (nil: E2B's default, true).
func policyOf(internet *bool, n *networkJSON) (network.Policy, error) {
	var p network.Policy
	if n == nil {
		n = &networkJSON{}
	}
	for name, set := range map[string]bool{"maskRequestHost": n.MaskRequestHost != nil, "rules": n.Rules != nil,
		"egressProxy": n.EgressProxy != nil, "httpsPorts": n.HTTPSPorts != nil} {
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
		m, err := network.ParseMode(n.Mode)
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

// networkOf is a record's network as E2B's detail shows it.
func networkOf(rec *store.Sandbox) (*networkJSON, bool) {
	p, err := manager.DecodePolicy(rec.Network)
	public := rec.PublicTraffic
	n := &networkJSON{AllowPublicTraffic: &public, Mode: string(p.Mode)}
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
	var body struct {
		networkJSON
		AllowInternetAccess *bool `json:"allow_internet_access"`
	}
	if err := decode(r, &body, true); err != nil {
		s.fail(w, r, err)
		return
	}
	if body.AllowPublicTraffic != nil {
		s.fail(w, r, fmt.Errorf("%w: allowPublicTraffic is set at create; it cannot change", errBadRequest))
		return
	}
	p, err := policyOf(body.AllowInternetAccess, &body.networkJSON)
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
	writeJSON(w, http.StatusOK, recordsJSON{Records: page.Records, Dropped: page.Dropped, NextToken: page.Next})
}

// defaultRecordsPage is a records page's size when the request names none.
const defaultRecordsPage = 100

// recordsJSON is one page of network records.
type recordsJSON struct {
	Records   []network.Record `json:"records"`
	Dropped   int64            `json:"dropped"`
	NextToken string           `json:"nextToken,omitempty"`
}
