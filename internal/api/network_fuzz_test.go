package api

import (
	"errors"
	"reflect"
	"strings"
	"testing"

	"github.com/cagehq/cage/api/types"
	"github.com/cagehq/cage/internal/manager"
	"github.com/cagehq/cage/internal/network"
	"github.com/cagehq/cage/internal/store"
)

// FuzzNetworkMapping: E2B's network fields (allowOut, denyOut, the
// internet flag, cage's mode) become a valid policy or a 400, never
// anything else; a policy has no rules in mode none and no deny rules as an
// allowlist, and every rule came from the request; and the network a
// sandbox's detail shows, sent back, is the same policy (what a client
// reads is what it would set).
func FuzzNetworkMapping(f *testing.F) {
	seeds := []struct {
		allow, deny, mode string
		internet          byte
	}{
		{"", "", "", 0},
		{"allowed.example.com", "0.0.0.0/0", "", 0},
		{"pypi.org\n*.github.com:443", "", "", 2},
		{"", "ads.example.com\n10.0.0.0/8", "", 1},
		{"0.0.0.0/0", "ads.example.com", "", 0},
		{"x.org", " 0.0.0.0/0", "", 0},
		{"x.org", "0.0.0.0/0:80", "", 0},
		{"", "", "none", 0},
		{"a.org", "", "allowlist", 1},
		{"::1", "", "", 0},
		{"a..b", "", "internet", 0},
		{"", "", "everything", 0},
	}
	for _, s := range seeds {
		f.Add(s.allow, s.deny, s.mode, s.internet)
	}
	f.Fuzz(func(t *testing.T, allow, deny, mode string, internet byte) {
		n := types.SandboxNetworkConfig{AllowOut: lines(allow), DenyOut: lines(deny), Mode: types.NetworkMode(mode)}
		var flag *bool // 0: absent, 1: false, 2: true
		if internet%3 > 0 {
			v := internet%3 == 2
			flag = &v
		}
		p, err := policyOf(flag, n)
		if err != nil {
			if !errors.Is(err, errBadRequest) {
				t.Fatalf("policyOf: %v is not a bad request", err)
			}
			return
		}
		if err := p.Validate(); err != nil {
			t.Fatalf("policyOf gave an invalid policy %+v: %v", p, err)
		}
		switch p.Mode {
		case network.None:
			if len(p.Allow)+len(p.Deny) > 0 {
				t.Fatalf("mode none with rules: %+v", p)
			}
		case network.Allowlist:
			if len(p.Deny) > 0 {
				t.Fatalf("an allowlist with deny rules: %+v", p)
			}
		case network.Internet:
		default:
			t.Fatalf("mode %q", p.Mode)
		}
		for _, r := range append(append([]network.Rule(nil), p.Allow...), p.Deny...) {
			if r.Name == "" && r.Prefix.Bits() == 0 && r.Port == 0 {
				t.Fatalf("a rule for every address stayed a rule instead of E2B's all-traffic selector: %+v", p)
			}
			if !fromRequest(r, n) {
				t.Fatalf("rule %s is in no list of the request %+v", r, n)
			}
		}
		shown, _ := networkOf(&store.Sandbox{Network: manager.EncodePolicy(p), PublicTraffic: true})
		shown.AllowPublicTraffic = nil
		again, err := policyOf(nil, shown)
		if err != nil {
			t.Fatalf("the network a detail shows (%+v) is refused: %v", shown, err)
		}
		if !samePolicy(p, again) {
			t.Fatalf("policy %+v is shown as %+v, which reads back as %+v", p, shown, again)
		}
	})
}

func lines(s string) []string {
	if s == "" {
		return nil
	}
	return strings.Split(s, "\n")
}

func fromRequest(r network.Rule, n types.SandboxNetworkConfig) bool {
	for _, s := range append(append([]string(nil), n.AllowOut...), n.DenyOut...) {
		if q, err := network.ParseRule(s); err == nil && q == r {
			return true
		}
	}
	return false
}

func samePolicy(a, b network.Policy) bool {
	norm := func(rs []network.Rule) []network.Rule {
		if len(rs) == 0 {
			return nil
		}
		return rs
	}
	return a.Mode == b.Mode && reflect.DeepEqual(norm(a.Allow), norm(b.Allow)) && reflect.DeepEqual(norm(a.Deny), norm(b.Deny))
}
