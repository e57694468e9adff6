package network

import (
	"bufio"
	"strings"
	"testing"
	"time"

	"github.com/miekg/dns"

	"github.com/cagehq/cage/internal/testutil"
)

func denyPolicy(t *testing.T, deny ...string) Policy {
	t.Helper()
	p := Policy{Mode: Internet}
	for _, d := range deny {
		r, err := ParseRule(d)
		if err != nil {
			t.Fatal(err)
		}
		p.Deny = append(p.Deny, r)
	}
	return p
}

// Attack: in internet mode with `--deny other.example.org`, the sandbox
// skips DNS and connects to the name's address directly (an IP literal it
// knew, or learnt over DNS-over-HTTPS). Expected: refused from the start;
// the name itself gets NXDOMAIN; other hosts answer.
func TestDenyNameByAddress(t *testing.T) {
	w := testutil.NewWorld(t)
	h := newHost(t, w, nil)
	other, pub := testutil.OtherHost.String(), testutil.PublicHost.String()
	gw := h.Gateway().String() + ":53"
	s := attach(t, h, denyPolicy(t, "other.example.org"))
	if body, err := s.get(other + ":80"); err == nil {
		t.Errorf("the address of a denied name answers its IP literal: %q", body)
	}
	if body, err := s.get(pub + ":80"); err != nil || !strings.HasPrefix(body, "public") {
		t.Errorf("a host nobody denied: %q %v", body, err)
	}
	if ans, err := s.lookup(gw, "other.example.org", false); err != nil || ans.Rcode != dns.RcodeNameError {
		t.Errorf("the denied name resolves: %v %v", ans, err)
	}

	// Kept fresh: once its TTL has passed the address is forgotten, and the
	// host's refresh denies it again.
	if err := s.net.expire(time.Now().Add(2 * maxLearnTTL)); err != nil {
		t.Fatal(err)
	}
	if setHas(t, h, s, "y", testutil.OtherHost) {
		t.Fatal("an address outlived its TTL in the denied set")
	}
	h.refreshOnce()
	if !setHas(t, h, s, "y", testutil.OtherHost) {
		t.Error("the refresh did not deny the name's address again")
	}
	if body, err := s.get(other + ":80"); err == nil {
		t.Errorf("after the refresh, the denied name's address answers: %q", body)
	}

	// A wildcard cannot be resolved ahead: its names' addresses are denied
	// once the sandbox asks for them.
	wild := attach(t, h, denyPolicy(t, "*.example.org"))
	if ans, err := wild.lookup(gw, "other.example.org", false); err != nil || ans.Rcode != dns.RcodeNameError {
		t.Errorf("a name under a denied wildcard resolves: %v %v", ans, err)
	}
	if body, err := wild.get(other + ":80"); err == nil {
		t.Errorf("after the sandbox asked for it, the address of a name under a denied wildcard answers: %q", body)
	}

	// An allow entry overrides the deny (internet mode).
	both := denyPolicy(t, "other.example.org")
	both.Allow = mustPolicy(t, Internet, "other.example.org").Allow
	ok := attach(t, h, both)
	if ans, err := ok.lookup(gw, "other.example.org", false); err != nil || len(addrsOf(ans)) != 1 {
		t.Errorf("denied and allowed: %v %v", ans, err)
	}
	if body, err := ok.get(other + ":80"); err != nil {
		t.Errorf("denied and allowed: %q %v", body, err)
	}

	// A deny added to a running sandbox cuts its connection to the name.
	open := attach(t, h, Policy{Mode: Internet})
	c := open.dial(t, other+":80")
	rd := bufio.NewReader(c.c)
	if st, err := c.httpGet(rd); err != nil || !strings.Contains(st, "200") {
		t.Fatalf("before the deny: %q %v", st, err)
	}
	if err := open.net.SetPolicy(denyPolicy(t, "other.example.org")); err != nil {
		t.Fatal(err)
	}
	if st, err := c.httpGet(rd); err == nil {
		t.Errorf("after the deny, the open connection to the denied name still answers: %q", st)
	}
	if body, err := open.get(other + ":80"); err == nil {
		t.Errorf("after the deny, a new connection answers: %q", body)
	}
}
